"""Helpers the training tests share (imported as programs.train_helpers): launching ranks,
reading what the runs wrote, and the float64 oracle's weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from scalelab.comm.launch import find_mpiexec, torchrun_command
from scalelab.config import RunConfig
from scalelab.record import read_records
from scalelab.train.loop import batch_order, batch_slices
from scalelab.workloads import WORKLOADS
from scalelab.workloads.base import state_dict_float64

PROGRAMS = Path(__file__).parent
# 203 items in batches of 32: the last batch holds 11 (11/11/10 and 4/4/3 over 3 ranks).
COMMON = dict(
    workload="mlp", train=True, hidden=24, train_size=203, heldout_size=60, batch=32,
    epochs=2, lr=0.5, l2=1e-3, quiet=True, threads=1,
)  # fmt: skip
N_PARAMS = 24 * 784 + 24 + 10 * 24 + 10


def run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def launcher(kind: str, ranks: int) -> list[str]:
    """The command prefix that starts `ranks` copies of a Python script."""
    if kind == "mpi":
        return [find_mpiexec(), "-n", str(ranks), sys.executable]
    return torchrun_command(ranks)


def launch_runs(kind: str, ranks: int, runs: dict, out: Path) -> tuple[dict, dict]:
    """Run configs (COMMON + each run's fields) in one launch; (records, weights) by name."""
    fields = {name: _for_mode({**COMMON, "ranks": ranks, **kw}) for name, kw in runs.items()}
    cmd = [*launcher(kind, ranks), str(PROGRAMS / "train_runs.py"), str(out), json.dumps(fields)]
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records_and_weights(out)


def _for_mode(fields: dict) -> dict:
    """An inference run without COMMON's training options (a run refuses what it ignores)."""
    if fields.get("train", False):
        return fields
    return {k: v for k, v in fields.items() if k not in ("epochs", "lr", "l2")}


def records_and_weights(out: Path) -> tuple[dict, dict]:
    recs = {Path(r["config"]["save_weights"]).stem: r for r in read_records(out / "runs.jsonl")}
    weights = {n: torch.load(out / f"{n}.pt") for n, r in recs.items() if r["mode"] == "train"}
    return recs, weights


def relerr(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).square().sum()) for k in b)
    return (num / sum(float(b[k].double().square().sum()) for k in b)) ** 0.5


def oracle_weights(cfg: RunConfig) -> dict:
    """The float64 NumPy SGD (hand-derived gradients) over the one-process batch order."""
    wl = WORKLOADS.get(cfg.workload)(cfg)
    params = state_dict_float64(wl.build_model())
    train, _ = wl.training_data()
    for epoch in range(cfg.epochs):
        order = batch_order(len(train), epoch, cfg.seed)
        for part in batch_slices(len(train), cfg.batch):
            idx = order[part]
            wl.reference_train_step(params, train.x[idx].numpy(), train.y[idx].numpy())
    return {k: torch.from_numpy(v) for k, v in params.items()}


def model_flags(spec: dict) -> list[str]:
    """`scalelab` flags of a user-model spec (model, input shape, dtype, vocab, args)."""
    out = ["--model", spec["model"], "--input-shape", spec["input_shape"]]
    if "input_dtype" in spec:
        out += ["--input-dtype", spec["input_dtype"], "--vocab", str(spec["vocab"])]
    for arg in spec.get("model_arg", []):
        out += ["--model-arg", arg]
    return out
