"""The MNIST seed's system roofline for data-parallel training, from measured phases.

Per rank and optimizer step, a data-parallel run does F FLOPs (3x the forward of its share
B/N of the batch), copies gradients between device and host (bytes_pci, GPU runs staging
through host memory) and all-reduces them (bytes_mpi). From the measured phases:

    P_flops = F / (t_forward + t_backward + t_step)
    P_pci   = bytes_pci / t_pci        (nested h2d/d2h: gradient staging, not the input copy)
    P_mpi   = bytes_mpi / t_mpi        (the innermost allreduce / mpi / wait phase)

pooled over the runs (or taken from one reference run, as the seed did). With AI = F /
(bytes_pci + bytes_mpi) the model is

    FLOP/s = AI / (AI / P_flops + 1 / P_comm),  1 / P_comm = s / P_pci + (1 - s) / P_mpi

where s is the PCIe share of the bytes (the seed's (1/P_pci + 1/P_mpi) / 2 when s = 1/2).
Each run is then one measured point against that curve, and its bound is the largest of the
three modelled times F / P_flops, bytes_pci / P_pci, bytes_mpi / P_mpi.

Bytes come from the record's `bytes_per_step` or `bytes` (keyed by phase name, totals over
the run) when the strategy booked them, else from the parameter count: each step all-reduces
the gradients (all parameters at the run's element size; the message size, as the seed
counts it) and, when staged, copies them device -> host and back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from scalelab.analysis.frame import ok_records, per_iteration, phase_scale, run_config
from scalelab.analysis.phases import rank_phases, self_times
from scalelab.analysis.roles import StrategyRoles
from scalelab.analysis.roofline import fit_alpha_beta
from scalelab.errors import UsageError
from scalelab.precision import get_precision
from scalelab.workloads import WORKLOADS

COMPUTE = frozenset({"forward", "backward", "step"})
NETWORK = frozenset({"allreduce", "allgather", "reduce_scatter", "reduce", "bcast", "wait", "mpi"})
PCIE = frozenset({"h2d", "d2h"})
BOUNDS = ("compute", "PCIe", "network")
POINT_COLUMNS = [
    "id",
    "hidden",
    "batch",
    "ranks",
    "flops",
    "bytes_pci",
    "bytes_mpi",
    "ai",
    "measured",
    "measured_phases",
    "model",
    "t_compute",
    "t_pci",
    "t_mpi",
    "bound",
    "flag",
]
# A point may sit at its model (the pooled peaks are its own phases when one run is pooled);
# more than this above it says a peak was under-measured, never that the run beat its roof.
ABOVE_SLACK = 0.01
ABOVE_MODEL = "above the model: a pooled peak under-measured (runs unlike each other)"


@dataclass(frozen=True)
class StepCosts:
    """One run's per-rank, per-step work and measured phase seconds (mean over ranks)."""

    flops: float
    bytes_pci: float
    bytes_mpi: float
    t_compute: float
    t_pci: float
    t_mpi: float
    t_step: float


@dataclass(frozen=True)
class SystemPeaks:
    p_flops: float
    p_pci: float | None  # None: no gradient staging measured (CPU runs)
    p_mpi: float | None
    pci_share: float
    runs: int
    alpha_s: float | None = None  # all-reduce latency fit over the runs' message sizes
    beta_Bps: float | None = None

    def times(self, c: StepCosts) -> dict[str, float]:
        """Modelled seconds of each term for a run's step."""
        return {
            "compute": c.flops / self.p_flops,
            "PCIe": c.bytes_pci / self.p_pci if self.p_pci else 0.0,
            "network": c.bytes_mpi / self.p_mpi if self.p_mpi else 0.0,
        }

    def model(self, ai: float) -> float:
        """FLOP/s = AI / (AI / P_flops + 1 / P_comm)."""
        inv_comm = (self.pci_share / self.p_pci if self.p_pci else 0.0) + (
            (1 - self.pci_share) / self.p_mpi if self.p_mpi else 0.0
        )
        return ai / (ai / self.p_flops + inv_comm)


def _leaf(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def step_costs(rec: dict[str, Any]) -> StepCosts:
    """Per-rank per-step FLOPs, bytes and phase seconds of a training record."""
    scale = phase_scale(rec)
    ranks = rank_phases(rec)
    own = [self_times(ph) for ph in ranks]

    def mean_time(pick) -> float:
        return sum(t for ph in own for p, t in ph.items() if pick(p)) / len(own) * scale

    paths = {p for ph in ranks for p in ph}
    t_compute = mean_time(lambda p: _leaf(p) in COMPUTE)
    t_pci = mean_time(lambda p: _leaf(p) in PCIE and "/" in p)
    t_mpi = mean_time(lambda p: _leaf(p) in NETWORK and not _has_network_child(p, paths))
    items, t_step = per_iteration(rec)
    n = max(int(rec.get("ranks", 1)), 1)
    flops = 3.0 * rec.get("flops_per_item", 0) * items / n
    grad = _gradient_bytes(rec)
    booked = _booked_bytes(rec, scale)
    # A top-level "h2d" is the input batch copy, which the seed's model leaves out.
    bytes_mpi = sum(v for k, v in booked.items() if _leaf(k) in NETWORK)
    bytes_pci = sum(v for k, v in booked.items() if _leaf(k) in PCIE and "/" in k)
    bytes_mpi = bytes_mpi or (grad if t_mpi > 0 else 0.0)
    bytes_pci = bytes_pci or (2 * grad if t_pci > 0 else 0.0)
    return StepCosts(flops, bytes_pci, bytes_mpi, t_compute, t_pci, t_mpi, t_step)


def _has_network_child(path: str, paths: set[str]) -> bool:
    """ "allreduce" wrapping "allreduce/mpi" (or "wait"): only the inner one is the network;
    the wrapper's own time is packing the flat gradient buffer."""
    return any(p.startswith(path + "/") and _leaf(p) in NETWORK for p in paths)


def _booked_bytes(rec: dict[str, Any], scale: float) -> dict[str, float]:
    """Bytes per step by phase: `bytes_per_step` where the strategy wrote it, else the run's
    `bytes` totals spread over the steps."""
    per_step = rec.get("bytes_per_step")
    if isinstance(per_step, dict) and per_step:
        return {k: float(v) for k, v in per_step.items()}
    return {k: v * scale for k, v in (rec.get("bytes") or {}).items()}


def _gradient_bytes(rec: dict[str, Any]) -> float:
    """Parameters x element size: the gradient buffer every rank sends per step."""
    try:
        workload = WORKLOADS.get(rec["workload"])(run_config(rec))
    except (UsageError, KeyError, TypeError):
        return 0.0
    dtype = rec.get("precision") or (rec.get("config") or {}).get("dtype", "fp32")
    return float(sum(r.params for r in workload.cost_table()) * get_precision(dtype).itemsize)


def training_runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Finished training runs on more than one rank that communicated (a 1-rank run's
    all-reduce is a local copy: no network to model, and it would flatter P_mpi)."""
    out = []
    for rec in ok_records(records):
        if rec.get("mode") != "train" or int(rec.get("ranks", 1)) < 2:
            continue
        c = step_costs(rec)
        if c.bytes_pci + c.bytes_mpi > 0 and c.t_compute > 0 and c.flops > 0:
            out.append(rec)
    return out


def estimate_peaks(records: list[dict[str, Any]], reference: str | None = None) -> SystemPeaks:
    """P_flops, P_pci, P_mpi pooled over the training runs (or from the run with id
    `reference`), plus an alpha-beta fit of the all-reduce when message sizes differ."""
    runs = training_runs(records)
    if reference is not None:
        runs = [r for r in runs if r.get("id") == reference]
    if not runs:
        raise UsageError(
            "no distributed training runs with measured compute and communication phases "
            "(the system roofline needs e.g. `--train --strategy mpi-dp --ranks 2` records)"
        )
    costs = [step_costs(r) for r in runs]
    total = lambda f: sum(f(c) for c in costs)  # noqa: E731
    p_flops = total(lambda c: c.flops) / total(lambda c: c.t_compute)
    p_pci = _ratio(total(lambda c: c.bytes_pci), total(lambda c: c.t_pci))
    p_mpi = _ratio(total(lambda c: c.bytes_mpi), total(lambda c: c.t_mpi))
    moved = total(lambda c: c.bytes_pci + c.bytes_mpi)
    alpha = beta = None
    sized = [(c.bytes_mpi, c.t_mpi) for c in costs if c.t_mpi > 0]
    if len({b for b, _ in sized}) >= 2:
        alpha, beta = fit_alpha_beta([b for b, _ in sized], [t for _, t in sized])
    share = total(lambda c: c.bytes_pci) / moved
    return SystemPeaks(p_flops, p_pci, p_mpi, share, len(runs), alpha, beta)


def _ratio(num: float, den: float) -> float | None:
    return num / den if num > 0 and den > 0 else None


def system_points(records: list[dict[str, Any]], peaks: SystemPeaks) -> pd.DataFrame:
    """Each communicating training run against the model (columns POINT_COLUMNS).

    measured: F / (wall seconds per step), the whole step as the user waits for it;
    measured_phases: F / (compute + PCIe + network phase seconds), the seed's second figure
    (input copies and Python between phases left out).
    """
    rows = []
    for rec in training_runs(records):
        c = step_costs(rec)
        cfg = rec.get("config") or {}
        ai = c.flops / (c.bytes_pci + c.bytes_mpi)
        modelled = peaks.times(c)
        rows.append(
            {
                "id": rec.get("id"),
                "hidden": cfg.get("hidden"),
                "batch": cfg.get("batch"),
                "ranks": rec.get("ranks", 1),
                "flops": c.flops,
                "bytes_pci": c.bytes_pci,
                "bytes_mpi": c.bytes_mpi,
                "ai": ai,
                "measured": c.flops / c.t_step if c.t_step > 0 else math.nan,
                "measured_phases": c.flops / (c.t_compute + c.t_pci + c.t_mpi),
                "model": peaks.model(ai),
                "t_compute": modelled["compute"],
                "t_pci": modelled["PCIe"],
                "t_mpi": modelled["network"],
                "bound": max(BOUNDS, key=modelled.__getitem__),
            }
        )
        rows[-1]["flag"] = above_model(rows[-1])
    return pd.DataFrame(rows, columns=POINT_COLUMNS)


def above_model(row: dict[str, Any]) -> str:
    """The flag of a point above its model (seen: H=512, B=800 measured 2.03e10 FLOP/s
    against a model of 1.90e10, unflagged), else ""."""
    top = max(row["measured"], row["measured_phases"])
    return ABOVE_MODEL if top > row["model"] * (1 + ABOVE_SLACK) else ""


# Two figures of one quantity further apart than this factor contradict each other: flagged.
DISAGREE = 2.0


def ceiling_backend(records: list[dict[str, Any]], roles: StrategyRoles) -> str:
    """The ceilings' `comm` entry the training runs' all-reduces went over."""
    runs = training_runs(records)
    if runs and all(r.get("strategy") in roles.mpi_allreduce for r in runs):
        return "mpi"
    gpu = any((r.get("config") or {}).get("device") == "cuda" for r in runs)
    return "nccl" if gpu else "gloo"


def against_ceilings(
    peaks: SystemPeaks, ceilings: dict[str, Any] | None, backend: str
) -> list[str]:
    """The runs' all-reduce fit beside the measured ceiling of the same all-reduce: one line
    per figure more than DISAGREE x apart, with why they differ."""
    fit = ((ceilings or {}).get("comm") or {}).get(backend, {}).get("allreduce") or {}
    if peaks.alpha_s is None or peaks.beta_Bps is None or not fit:
        return []
    ranks = (ceilings or {})["comm"][backend].get("ranks", "?")
    pairs = (
        ("latency (alpha)", peaks.alpha_s, fit["alpha_s"], lambda v: f"{v * 1e6:.3g} us"),
        ("bandwidth (beta)", peaks.beta_Bps, fit["beta_Bps"], lambda v: f"{v / 1e9:.3g} GB/s"),
    )
    out = []
    for what, runs, ceiling, fmt in pairs:
        apart = runs / ceiling if runs > 0 and ceiling > 0 else math.inf
        if max(apart, 1 / apart) > DISAGREE:
            out.append(
                f"all-reduce {what}: the training runs' fit {fmt(runs)} disagrees with the "
                f"Ceilings' {backend} x{ranks} {fmt(ceiling)} ({_apart(apart)}): the fit "
                f"reads the runs' whole all-reduce phase (waiting for the slower rank, the "
                f"copies around the call) at {peaks.runs} runs' few message sizes; the "
                f"ceiling times bare all-reduces over a range of sizes"
            )
    return out


def _apart(ratio: float) -> str:
    if not math.isfinite(ratio) or ratio <= 0:
        return "one of them not positive"
    return f"{max(ratio, 1 / ratio):.3g}x apart"
