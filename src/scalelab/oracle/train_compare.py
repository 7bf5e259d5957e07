"""The training check's comparison (`run --train --check`): the weights and buffers a
strategy trained against those one float64 process trained from the same weights over the
same batches, and the verdict with the tolerance it was held to and why that tolerance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

REFERENCE = "train-fp64-one-process"  # the record's `reference` for a training check
FACTOR = 10.0  # a strategy may be this much worse than one process in its own dtype


@dataclass(frozen=True)
class StateDiff:
    """relerr: ||trained - ref|| / ||ref|| over every floating tensor together; worst: the
    tensor with the largest own relerr; counts: integer buffers that differ (BatchNorm's
    num_batches_tracked), exact; missing: keys on one side only."""

    relerr: float
    worst: tuple[str, float]
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    missing: tuple[str, ...] = ()

    def over(self, keys: Sequence[str], trained: Mapping, ref: Mapping) -> float:
        return _relerr([(trained[k], ref[k]) for k in keys if k in trained and k in ref])


def _relerr(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    num = sum(float((a.double().cpu() - b.double().cpu()).square().sum()) for a, b in pairs)
    den = sum(float(b.double().cpu().square().sum()) for _, b in pairs)
    return (num / den) ** 0.5 if den > 0 else num**0.5


def state_diff(trained: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> StateDiff:
    missing = tuple(sorted(set(trained) ^ set(ref)))
    common = [k for k in ref if k in trained]
    floats = [k for k in common if ref[k].is_floating_point()]
    counts = {
        k: (int(trained[k]), int(ref[k]))
        for k in common
        if not ref[k].is_floating_point() and not torch.equal(trained[k].cpu(), ref[k].cpu())
    }
    per = {k: _relerr([(trained[k], ref[k])]) for k in floats}
    worst = max(per.items(), key=lambda kv: kv[1], default=("", 0.0))
    return StateDiff(_relerr([(trained[k], ref[k]) for k in floats]), worst, counts, missing)


def bound(floor: float, dtype: str, same_dtype: float | None) -> tuple[float, str]:
    """(tolerance, basis): the dtype's floor (precision.py), or FACTOR x what one process in
    the same dtype and device lost against float64 where that is larger."""
    if same_dtype is None or FACTOR * same_dtype <= floor:
        return floor, f"the {dtype} floor (precision.py)"
    return FACTOR * same_dtype, (
        f"{FACTOR:g} x the one-process {dtype} run's relerr {same_dtype:.1e} (floor {floor:.0e})"
    )


@dataclass
class TrainCheck:
    """The verdict of `run --train --check`; `passed` drives exit 1 / status check-failed."""

    diff: StateDiff
    tolerance: float
    basis: str
    reference: str
    notes: dict[str, Any] = field(default_factory=dict)  # dropout off, BatchNorm, sync-bn
    cause: str | None = None  # why it differs by design (a line), when known

    @property
    def passed(self) -> bool:
        d = self.diff
        return d.relerr <= self.tolerance and not d.counts and not d.missing

    @property
    def relerr(self) -> float:
        return self.diff.relerr

    def fields(self) -> dict[str, Any]:
        """The record's fields: the usual relerr/tolerance/check_passed/reference and the
        details under `train_check`."""
        d = self.diff
        detail = {
            "relerr": d.relerr, "tolerance": self.tolerance, "basis": self.basis,
            "worst": {"name": d.worst[0], "relerr": d.worst[1]},
            "counts_differ": {k: {"trained": a, "reference": b} for k, (a, b) in d.counts.items()},
            "missing": list(d.missing), "reference": self.reference, "passed": self.passed,
            "cause": self.cause, **self.notes,
        }  # fmt: skip
        return {
            "relerr": d.relerr, "tolerance": self.tolerance, "tolerance_basis": self.basis,
            "check_passed": self.passed, "reference": REFERENCE, "train_check": detail,
        }  # fmt: skip

    def line(self) -> str:
        return summary_line(self.fields()["train_check"])


def summary_line(tc: Mapping[str, Any]) -> str:
    """The summary's one check line for a training record."""
    verdict = "ok" if tc["passed"] else "FAILED"
    head = (
        f"  check: trained weights and buffers vs one float64 process: relerr "
        f"{tc['relerr']:.2e} (tolerance {tc['tolerance']:.0e}, {tc['basis']}) {verdict}"
    )
    if not tc["passed"] and tc["worst"]["name"]:
        head += f"; worst {tc['worst']['name']} {tc['worst']['relerr']:.1e}"
    for key, what in tc["counts_differ"].items():
        head += f"; {key} {what['trained']} != {what['reference']}"
    if tc.get("cause"):
        head += f"\n  check: {tc['cause']}"
    if tc.get("dropout_off"):
        head += "\n  check: dropout off for the check (masks are drawn per rank): " + ", ".join(
            tc["dropout_off"]
        )
    return head
