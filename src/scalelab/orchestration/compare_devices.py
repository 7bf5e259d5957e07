"""`scalelab run mlp --train --compare-devices`: the seed's CPU-vs-GPU question, measured.

The same training (same initial weights, same batches in the same order, same precision) runs
once on the CPU and once on the GPU through the shared loop; after every epoch both weight sets
are compared. The relative difference ||W_gpu - W_cpu|| / ||W_cpu|| per tensor and over all
weights shows how rounding differences (summation order, fused multiply-add) grow through
training, next to each device's loss and held-out precision, which typically agree far better
than the weights do.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from scalelab import environment
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.record import new_record
from scalelab.results import TrainHistory
from scalelab.strategies import STRATEGIES
from scalelab.strategies.local import LocalStrategy
from scalelab.train.loop import Trainer, default_plan
from scalelab.weights import load_weights
from scalelab.workloads import WORKLOADS
from scalelab.workloads.base import Inputs, Workload, state_dict_float64

Setup = tuple[str, str]  # (device, dtype)


@dataclass
class DeviceRun:
    setup: Setup
    history: TrainHistory
    snapshots: list[dict[str, np.ndarray]]  # float64 weights after each epoch
    wall_s: float = 0.0  # the whole training on this setup, held-out evaluation included


@dataclass
class DeviceComparison:
    runs: list[DeviceRun]
    rows: list[dict[str, Any]]
    record: dict[str, Any]

    def table(self) -> str:
        (a, b), names = (r.setup for r in self.runs), list(self.rows[0]["relerr"])
        la, lb = f"{a[0]} {a[1]}", f"{b[0]} {b[1]}"
        head = f"{'epoch':>5} {'loss ' + la:>16} {'loss ' + lb:>16} {'acc ' + la:>15} "
        head += f"{'acc ' + lb:>15} " + " ".join(f"{n:>12}" for n in names)
        lines = [f"relative weight difference, {lb} against {la}:", head]
        for row in self.rows:
            cells = f"{row['epoch']:>5} {row['loss'][0]:>16.6f} {row['loss'][1]:>16.6f} "
            cells += f"{row['accuracy'][0]:>15.4f} {row['accuracy'][1]:>15.4f} "
            lines.append(cells + " ".join(f"{row['relerr'][n]:>12.3e}" for n in names))
        return "\n".join(lines)


def relerr(a: dict[str, np.ndarray], b: dict[str, np.ndarray], keys: list[str]) -> float:
    """||a - b|| / ||b|| over the listed tensors together (b is the reference)."""
    num = sum(float(np.square(a[k] - b[k]).sum()) for k in keys)
    den = sum(float(np.square(b[k]).sum()) for k in keys)
    return float(np.sqrt(num / den)) if den > 0 else float("nan")


def _check(cfg: RunConfig, setups: list[Setup]) -> None:
    if not cfg.train:
        raise UsageError("--compare-devices compares training runs; add --train")
    if not STRATEGIES.get(cfg.strategy).plain_local:
        raise UsageError("--compare-devices trains in one process; drop --strategy")
    if any(d == "cuda" for d, _ in setups) and not torch.cuda.is_available():
        raise UsageError("--compare-devices needs a CUDA GPU; none is visible to torch here")


def train_on(
    cfg: RunConfig, workload: Workload, model: torch.nn.Module, data: tuple[Inputs, Inputs]
) -> DeviceRun:
    """Train a copy of model under cfg (device, dtype) with a snapshot after every epoch."""
    strategy = LocalStrategy(cfg)  # sets torch's threads (chosen or --threads) until close()
    snapshots: list[dict[str, np.ndarray]] = []
    try:
        placed = strategy.place(copy.deepcopy(model))
        plan = default_plan(strategy, workload, placed, *data)
        plan.epoch_end = lambda epoch, m: snapshots.append(state_dict_float64(m))
        history = TrainHistory()
        start = time.perf_counter()
        Trainer(strategy, workload, placed, plan, strategy.timer, history).run()
        wall = time.perf_counter() - start
    finally:
        strategy.close()
    return DeviceRun((cfg.device, cfg.dtype), history, snapshots, wall)


def compare_devices(cfg: RunConfig, setups: list[Setup] | None = None) -> DeviceComparison:
    setups = setups or [("cpu", cfg.dtype), ("cuda", cfg.dtype)]
    _check(cfg, setups)
    workload = WORKLOADS.get(cfg.workload)(cfg)
    model = workload.build_model()
    if cfg.weights is not None:
        load_weights(model, cfg.weights)
    data = workload.training_data()
    runs = [train_on(replace(cfg, device=d, dtype=t), workload, model, data) for d, t in setups]
    rows = comparison_rows(runs[0], runs[1])
    record = new_record(
        status="ok",
        workload=cfg.workload,
        strategy="local",
        mode="compare-devices",
        ranks=1,
        # the record's item count and wall: the reference setup's training (a record the
        # readers accept); each setup's own wall is in setup_walls_s
        items=runs[0].history.items,
        wall_s=runs[0].wall_s,
        setup_walls_s=[r.wall_s for r in runs],
        config=cfg.to_dict(),
        env=environment.collect(),
        **environment.git_commit(),
        setups=[list(s) for s in setups],
        compare=rows,
    )
    return DeviceComparison(runs, rows, record)


def comparison_rows(ref: DeviceRun, other: DeviceRun) -> list[dict[str, Any]]:
    rows = []
    for epoch, (a, b) in enumerate(zip(other.snapshots, ref.snapshots), 1):
        weights = [k for k in b if k.endswith("weight")]
        per = {k: relerr(a, b, [k]) for k in weights}
        rows.append(
            {
                "epoch": epoch,
                "loss": [ref.history.loss[epoch - 1], other.history.loss[epoch - 1]],
                "accuracy": [ref.history.accuracy[epoch - 1], other.history.accuracy[epoch - 1]],
                "relerr": {**per, "all": relerr(a, b, list(b))},
            }
        )
    return rows
