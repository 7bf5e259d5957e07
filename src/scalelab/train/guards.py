"""Stop a diverging run: a NaN/inf loss ends training with one line naming the step.

Checking every loss on the host would sync the device every step (the GPU would idle while the
host waits). Instead each step's loss is copied into a small device buffer (one kernel); the
buffer is read when it is full, before every checkpoint and at every epoch end, and the ranks
agree on the first bad step with one max-reduction. A checkpoint is written only after that
check (and a check that the weights are finite), so the last good checkpoint stays intact.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from scalelab.comm import Comm

CHECK_EVERY = 64  # steps between host reads of the loss buffer


class TrainingDiverged(RuntimeError):
    """The loss or the weights stopped being finite; exit code 1 (a failed run, not bad input)."""

    exit_code = 1

    @classmethod
    def at(cls, step: int, now: int, checkpoint: Path | None) -> TrainingDiverged:
        return cls(
            f"loss is NaN or inf at step {step}; training stopped at step {now}. "
            f"{_kept(checkpoint)} (a smaller --lr usually helps)"
        )

    @classmethod
    def weights(cls, now: int, checkpoint: Path | None) -> TrainingDiverged:
        return cls(
            f"weights are NaN or inf after step {now}; training stopped. {_kept(checkpoint)} "
            "(a smaller --lr usually helps)"
        )


def _kept(checkpoint: Path | None) -> str:
    if checkpoint is None:
        return "No checkpoint was written."
    return f"The last good checkpoint {checkpoint} is intact."


class NonFiniteGuard:
    """Remembers the last CHECK_EVERY step losses on the device; check() finds the first bad one."""

    def __init__(self, device: torch.device, every: int = CHECK_EVERY) -> None:
        self.buf = torch.zeros(every, dtype=torch.float64, device=device)
        self.n = 0
        self.steps: list[int] = []  # global step number of each buffered loss

    def observe(self, loss: torch.Tensor, step: int) -> None:
        self.buf[self.n].copy_(loss)  # one device kernel, no host sync
        self.steps.append(step)
        self.n += 1

    def full(self) -> bool:
        return self.n == len(self.buf)

    def check(self, comm: Comm) -> int | None:
        """The first step (over all ranks) whose loss was not finite, or None; resets."""
        bad = (~torch.isfinite(self.buf[: self.n])).nonzero()  # the one host sync
        # The max over ranks of -step is -(first bad step); a rank with none sends -inf.
        mine = -float(self.steps[int(bad[0])]) if len(bad) else -math.inf
        self.n, self.steps = 0, []
        flag = torch.tensor([mine], dtype=torch.float64, device=comm.device)
        first = float(comm.allreduce(flag, op="max").cpu()[0])
        return None if first == -math.inf else int(-first)


def all_finite(weights: list[torch.Tensor], comm: Comm) -> bool:
    """Whether every weight on every rank is finite (one host sync, one reduction)."""
    checks = [torch.isfinite(w.detach()).all() for w in weights]
    ok = torch.stack(checks).all() if checks else torch.tensor(True)
    bad = torch.tensor([0.0 if bool(ok) else 1.0], dtype=torch.float64)
    return float(comm.allreduce(bad.to(comm.device), op="max").cpu()[0]) == 0.0
