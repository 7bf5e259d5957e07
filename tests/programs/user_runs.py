"""train_runs.py for runs on torch.distributed's own group (nccl, pipeline, tensor --engine
torch, ddp) several in one torchrun launch: `python user_runs.py OUT '{"name": {fields}}'`.

One process group serves every run: re-creating it on torchrun's store after a destroy can
meet the previous group's addresses (as mpi_splits.py). It is closed once, at the end.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from scalelab.comm.torchdist import TorchDistComm
from scalelab.config import RunConfig
from scalelab.run.runner import execute

CLOSE, TorchDistComm.close = TorchDistComm.close, lambda self: None

out = Path(sys.argv[1])
for name, fields in json.loads(sys.argv[2]).items():
    cfg = RunConfig(**{"save_weights": str(out / f"{name}.pt"), **fields})
    execute(cfg, out / "runs.jsonl")  # records name their run by config.save_weights

TorchDistComm.close = CLOSE
if dist.is_initialized():
    TorchDistComm(dist.get_backend()).close()
print("done", flush=True)
