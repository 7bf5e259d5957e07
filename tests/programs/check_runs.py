"""`python check_runs.py OUT '{"name": {config fields}}'` under mpiexec, torchrun or none:
train_runs.py for `--check` runs, which exits as `scalelab run` would after the last one: 1
when any run's check failed (RunReport.exit_code, what the CLI returns), else 0. One process
group serves every torch.distributed run (as user_runs.py); it is closed once, at the end.
"""

import json
import sys
from pathlib import Path

from scalelab.comm.torchdist import TorchDistComm
from scalelab.config import RunConfig
from scalelab.run.runner import execute

CLOSE, TorchDistComm.close = TorchDistComm.close, lambda self: None

out, code = Path(sys.argv[1]), 0
for fields in json.loads(sys.argv[2]).values():
    # no --save-weights: the check must gather the trained model itself (the pipeline did so
    # only for --save-weights); the root appends the records in this order
    code = max(code, execute(RunConfig(**fields), out / "runs.jsonl").exit_code)

TorchDistComm.close = CLOSE
import torch.distributed as dist  # noqa: E402

if dist.is_initialized():
    TorchDistComm(dist.get_backend()).close()
print("done", flush=True)
sys.exit(code)
