"""The zoo's transformers (tests/programs/zoo.py) under 2 tensor ranks on 2 GPUs (NCCL) in
fp32: inference checked against the module in float64, and two training steps checked
against one float64 process (`run --train --check`), each within the project's fp32 bound
(the check's own tolerance: 10x the plain one-process run, floor 1e-5). One torchrun launch
(tests/programs/user_runs.py) runs every case. Run on the device machine:
`NCCL_NVLS_ENABLE=0 PYTHONPATH=src python -m pytest -m gpu tests/test_zoo_tensor_gpu.py`.
"""

import json

import pytest
import torch

from programs.train_helpers import PROGRAMS, launcher, records_and_weights, run
from test_zoo_tensor import MODELS  # the zoo as the CPU test runs it

COMMON = dict(workload="model", strategy="tensor", engine="torch", ranks=2, device="cuda",
              dtype="fp32", check=True, quiet=True)  # fmt: skip
INFER = dict(batch=4, iters=2, warmup=1)
TRAIN = dict(train=True, train_size=8, heldout_size=4, batch=4, epochs=1, lr=0.2)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
def test_zoo_under_tensor_parallel_on_two_gpus(tmp_path):
    runs = {}
    for name, spec in MODELS.items():
        runs[f"{name}-infer"] = {**COMMON, **INFER, **spec}
        runs[f"{name}-train"] = {**COMMON, **TRAIN, **spec}
    cmd = [*launcher("torchrun", 2), str(PROGRAMS / "user_runs.py"), str(tmp_path),
           json.dumps(runs)]  # fmt: skip
    proc = run(cmd, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs, _ = records_and_weights(tmp_path)
    for name in runs:
        rec = recs[name]
        assert rec["status"] == "ok" and rec["check_passed"], (name, rec.get("relerr"))
        assert rec["relerr"] <= rec["tolerance"], name
