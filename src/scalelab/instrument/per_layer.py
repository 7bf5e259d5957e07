"""`--per-layer`: forward hooks on every leaf module recording its time, output bytes and the
allocator's peak, the per-layer memory/time table of the model-parallel seed's study.

A pre-hook synchronises the device, resets CUDA's peak-memory counter and starts a clock; the
post-hook synchronises again and reads the clock, the output's bytes and
`torch.cuda.max_memory_allocated` (the peak while the layer ran, its output included). The
extra synchronisations slow the run down: per-layer numbers are a study of the layers, the
run's own wall time is not comparable with an uninstrumented one. On CPU there is no
allocator peak to read (None). Functional ops (F.relu inside forward) are not modules and get
no row. A row is named after the workload's cost-table row computed by that module (the
row's `module` field), so analyses find its FLOPs and bytes; `module` keeps the dotted path.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def output_bytes(out: Any) -> int:
    """Bytes of every tensor in a module's output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (tuple, list)):
        return sum(output_bytes(o) for o in out)
    if isinstance(out, dict):
        return sum(output_bytes(o) for o in out.values())
    return 0


@dataclass
class LayerStats:
    name: str  # the cost-table row's name when the module has one (c1, fc6), else `module`
    module: str  # dotted path in the model
    kind: str  # the cost-table kind (conv, linear, lrn), else the module class in lower case
    module_type: str  # the module class: Conv2d, Linear, ...
    seconds: list[float] = field(default_factory=list)
    intervals: list[tuple[float, float]] = field(default_factory=list)  # perf_counter
    out_bytes: int = 0  # of the last call
    out_shape: list[int] | None = None
    peak_bytes: int | None = None  # largest allocator peak over calls (CUDA only)

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "kind": self.kind,
            "module_type": self.module_type,
            "calls": len(self.seconds),
            "seconds": statistics.median(self.seconds),
            "out_bytes": self.out_bytes,
            "out_shape": self.out_shape,
            "peak_bytes": self.peak_bytes,
        }


class PerLayer:
    """Context manager: hooks on model's leaf modules while active, removed on exit.

    train: skip calls made in eval mode (the held-out evaluation between epochs), so a
    training run's rows describe training forwards only.
    names: module path -> (cost-table name, kind), from the workload's cost table.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        train: bool = False,
        names: dict[str, tuple[str, str]] | None = None,
    ) -> None:
        self.model = model
        self.names = names or {}
        self.cuda = device.type == "cuda"
        self.device = device
        self.train = train
        self.stats: dict[str, LayerStats] = {}
        self._handles: list[Any] = []
        self._start: dict[str, float] = {}

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _pre(self, name: str, module: nn.Module) -> None:
        if self.train and not module.training:
            return
        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start[name] = time.perf_counter()

    def _post(self, name: str, module: nn.Module, out: Any) -> None:
        start = self._start.pop(name, None)
        if start is None:
            return
        self._sync()
        end = time.perf_counter()
        stats = self.stats.get(name) or self.stats.setdefault(name, self._new_stats(name, module))
        stats.seconds.append(end - start)
        stats.intervals.append((start, end))
        stats.out_bytes = output_bytes(out)
        stats.out_shape = list(out.shape) if isinstance(out, torch.Tensor) else None
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            stats.peak_bytes = max(stats.peak_bytes or 0, peak)

    def _new_stats(self, path: str, module: nn.Module) -> LayerStats:
        cls = type(module).__name__
        name, kind = self.names.get(path, (path, cls.lower()))
        return LayerStats(name, path, kind, cls)

    def __enter__(self) -> PerLayer:
        for name, module in self.model.named_modules():
            if name and not any(True for _ in module.children()):
                self._handles.append(
                    module.register_forward_pre_hook(lambda m, a, n=name: self._pre(n, m))
                )
                self._handles.append(
                    module.register_forward_hook(lambda m, a, o, n=name: self._post(n, m, o))
                )
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def rows(self) -> list[dict[str, Any]]:
        """One row per leaf module that ran, in order of first call."""
        return [s.row() for s in self.stats.values()]
