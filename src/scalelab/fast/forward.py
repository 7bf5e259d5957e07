"""FastForward: the object `accelerate()` returns; transport-form inputs in, fp32 logits out.

On the first call it picks every stage's implementation on that input (pipeline.py), then
captures the chosen pipeline in a CUDA graph (graphs.py); later calls replay the graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from scalelab.fast.graphs import GraphedForward
from scalelab.fast.pipeline import Choice, choose
from scalelab.fast.registry import Plan


class FastForward:
    def __init__(
        self,
        plan: Plan,
        device: torch.device,
        kernels: bool,
        graphs: bool,
        log: Callable[[str], None],
        unavailable: list[str],
        tag: str = "",
    ) -> None:
        self.plan = plan
        self.tag = tag
        self.device = device
        self.kernels = kernels
        self.graphs = graphs
        self.log = log
        self.unavailable = unavailable
        self.choices: list[Choice] = []
        self._run: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._graph: GraphedForward | None = None

    @property
    def parts(self) -> dict[str, str]:
        """Stage -> chosen implementation, plus how the whole forward runs."""
        parts = {c.stage: c.name for c in self.choices}
        if self._graph is not None:
            parts["graph"] = "captured" if self._graph.captured else "eager"
        return parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            if self.plan.prepare is not None:
                x = self.plan.prepare(x)
            first = self._run is None
            if first:
                self._setup(x)
            out = self._run(x).to(torch.float32, copy=True)  # the graph output is reused
            if first:  # after the first run, so the line says whether the graph was captured
                self.log("fast path: " + self.describe())
            return out

    def _setup(self, x: torch.Tensor) -> None:
        timing = self.device.type == "cuda"
        pipeline, self.choices = choose(
            self.plan, x, self.device, self.kernels, timing, self.log, self.tag
        )
        self._run = pipeline
        if self.graphs:
            self._graph = GraphedForward(pipeline, self.log)
            self._run = self._graph

    def describe(self) -> str:
        parts = ", ".join(f"{k}={v}" for k, v in self.parts.items())
        extra = f" (unavailable: {'; '.join(self.unavailable)})" if self.unavailable else ""
        notes = f" [{', '.join(self.plan.notes)}]" if self.plan.notes else ""
        return f"{parts}{notes}{extra}"

    def tuned_from_cache(self) -> list[str]:
        """Stages whose implementation came from the tuning cache (not timed this time)."""
        return [c.stage for c in self.choices if c.cached]

    def stage_seconds(self) -> dict[str, float]:
        """The chosen implementation's time per stage (GPU only; empty elsewhere)."""
        return {c.stage: c.seconds[c.name] for c in self.choices if c.name in c.seconds}
