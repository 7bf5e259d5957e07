"""fsdp's multi-rank checks in one launch (tests/test_fsdp.py):
`python fsdp_runs.py OUT '{"name": {config fields}, ...}' [KILL_AT KILL_RANK]`.

Every config runs through the runner (records to OUT/runs.jsonl, weights to OUT/NAME.pt), in
order; with KILL_AT, the last one SIGKILLs rank KILL_RANK before its KILL_AT-th optimizer step
(a real kill -9: no handler, no flush), after its checkpoints are written.
"""

import json
import os
import signal
import sys
from pathlib import Path

from scalelab.config import RunConfig
from scalelab.run.runner import execute
from scalelab.train import loop

out = Path(sys.argv[1])
runs = list(json.loads(sys.argv[2]).items())
kill = [int(v) for v in sys.argv[3:5]] if len(sys.argv) > 3 else None


def die_at(kill_at: int, kill_rank: int) -> None:
    real, calls = loop.Trainer.train_step, [0]

    def dying_step(self, step):
        calls[0] += 1
        if int(os.environ.get("RANK", "0")) == kill_rank and calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, step)

    loop.Trainer.train_step = dying_step


for i, (name, fields) in enumerate(runs):
    if kill is not None and i == len(runs) - 1:
        die_at(*kill)
    cfg = RunConfig(**{"save_weights": str(out / f"{name}.pt"), **fields})
    execute(cfg, out / "runs.jsonl")
print("done", flush=True)
