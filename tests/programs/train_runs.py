"""Run training configs under whatever launcher started this process (mpiexec, torchrun or
none): `python train_runs.py OUT '{"name": {config fields}, ...}'`.

Each config runs through the runner (records appended to OUT/runs.jsonl by the root rank);
its trained weights go to OUT/NAME.pt (--save-weights). Several runs share one launch, so a
multi-rank test pays the start-up of its ranks once.
"""

import json
import sys
from pathlib import Path

from scalelab.config import RunConfig
from scalelab.run.runner import execute

out = Path(sys.argv[1])
for name, fields in json.loads(sys.argv[2]).items():
    cfg = RunConfig(**{"save_weights": str(out / f"{name}.pt"), **fields})
    execute(cfg, out / "runs.jsonl")  # records name their run by config.save_weights
print("done", flush=True)
