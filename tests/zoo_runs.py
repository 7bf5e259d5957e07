"""The zoo's runs, shared by tests/test_zoo.py (CPU ranks, fp64) and tests/test_zoo_gpu.py (2
GPUs, fp32): each model of tests/programs/zoo.py as its author wrote it, under local, ddp,
fsdp and the torch pipeline (2 stages; dp 2 x pp 2), inference checked and trained 2 steps."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

from programs.train_helpers import PROGRAMS, launcher, records_and_weights
from scalelab.config import RunConfig
from scalelab.workloads import WORKLOADS

ZOO = PROGRAMS / "zoo.py"
TESTS = PROGRAMS.parent
TOKENS = {"input_shape": "8", "input_dtype": "int64", "vocab": 40}
HF = importlib.util.find_spec("transformers") is not None
MODELS = {
    "nanogpt": {"model": f"{ZOO}:nanogpt", **TOKENS},
    "nanogpt-untied": {"model": f"{ZOO}:nanogpt", **TOKENS, "model_arg": ["tied=False"]},
    **({"hf_llama": {"model": f"{ZOO}:hf_llama", **TOKENS},
        "hf_gpt2": {"model": f"{ZOO}:hf_gpt2", **TOKENS},
        # OPT: a traced cut handing on a tuple; its F.dropout floats off, as hf_gpt2's pdrop
        # (the multi-rank runs here train without --check, which turns dropout off)
        "hf_opt": {"model": "hf:opt", **TOKENS, "model_arg": [
            "dropout=0.0", "attention_dropout=0.0", "activation_dropout=0.0"]}} if HF else {}),
    "encoder": {"model": f"{ZOO}:encoder", "input_shape": "5,6"},
    "tuple_blocks": {"model": f"{ZOO}:tuple_blocks", **TOKENS},
}  # fmt: skip
# 16 items in batches of 8: two steps
INFER = dict(workload="model", batch=8, iters=1, warmup=0, check=True, quiet=True, threads=1)
TRAIN = dict(workload="model", train=True, check=True, train_size=16, heldout_size=8, batch=8,
             epochs=1, lr=0.2, quiet=True, threads=1)  # fmt: skip
PIPE = dict(strategy="pipeline", engine="torch", microbatches=2, rebalance=0, stages=2)
TWO = {"ddp": dict(strategy="ddp"), "fsdp": dict(strategy="fsdp"), "pipe": PIPE}
TRAIN_ONLY = ("ddp",)  # ddp's inference is local's (it refuses to run one)
FOUR = {"dpxpp": {**PIPE, "dp": 2, "schedule": "1f1b"}}


def runs(ways: dict, ranks: int, dtype: str, extra: dict | None = None) -> dict:
    """Every model under every way: inference (`NAME-WAY`) and training (`NAME-train-WAY`)."""
    out = {}
    for name, spec in MODELS.items():
        for how, fields in ways.items():
            common = {**spec, **fields, "ranks": ranks, "dtype": dtype, **(extra or {})}
            if how not in TRAIN_ONLY:
                out[f"{name}-{how}"] = {**INFER, **common}
            out[f"{name}-train-{how}"] = {**TRAIN, **common}
    return out


def launch(ranks: int, runs_: dict, out: Path, timeout: int = 900) -> tuple[dict, dict]:
    """Every run in one torchrun launch (tests/programs/user_runs.py)."""
    cmd = [*launcher("torchrun", ranks), str(PROGRAMS / "user_runs.py"), str(out),
           json.dumps(runs_)]  # fmt: skip
    # the zoo's encoder imports tests/programs/transformer_nets.py as `programs.`
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records_and_weights(out)


def initial(name: str, dtype: str) -> dict:
    """The model's weights before training, as every run builds them."""
    wl = WORKLOADS.get("model")(RunConfig(**TRAIN, **MODELS[name], dtype=dtype))
    return {k: v.double() for k, v in wl.build_model().state_dict().items()}
