"""What a run hands back: the strategy's output and timings, and a training history.

Below strategies/ and train/ so that both (and the runner) read them without importing up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn

from scalelab.instrument.timer import Timings


@dataclass
class TrainHistory:
    """Per-epoch training loss (mean over steps) and held-out accuracy (fraction correct)."""

    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    steps: int = 0
    items: int = 0  # items trained on, all ranks together

    def end_epoch(self, items: int, mean_loss: float, accuracy: float, progress: Any) -> None:
        """Book one finished epoch and report it (progress: instrument.progress.Progress)."""
        self.items += items
        self.loss.append(mean_loss)
        self.accuracy.append(accuracy)
        progress.milestone(self.steps, epoch=len(self.loss), loss=mean_loss, heldout_acc=accuracy)


@dataclass
class RunOutput:
    """What a strategy hands back to the runner.

    timings: this rank's per-iteration walls and phase laps (training: one lap per epoch).
    rank_phases: every rank's median phase seconds, on the root rank only.
    output: the gathered model output as float64 (root only; None when not gathered).
    items_per_iter: items processed by all ranks in one timed iteration.
    """

    timings: Timings
    rank_phases: list[dict[str, float]] | None
    output: np.ndarray | None
    items_per_iter: int
    bytes_moved: dict[str, int] = field(default_factory=dict)
    history: TrainHistory | None = None
    model: nn.Module | None = None  # the trained model, for --save-weights
    notes: dict[str, Any] = field(default_factory=dict)
