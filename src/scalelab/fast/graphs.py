"""CUDA graph capture of a whole forward (inference) per input shape.

Capturing the forward turns hundreds of kernel launches (each ~5-20 us of host time in eager
PyTorch) into one graph launch, so small and medium batches stop being launch-bound. The
recipe is the one in torch.cuda.graphs' documentation: warm up on a side stream (cuDNN
autotuning, cuBLAS workspaces, Triton compilation happen there), capture once, then replay
after copying each new input into the captured input buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Forward = Callable[[torch.Tensor], torch.Tensor]


def warm_up(fn: Callable[[], object], steps: int, stream: torch.cuda.Stream | None = None) -> None:
    """Run fn on a side stream (`stream`, else a new one), as graph capture requires of
    everything it will record."""
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            fn()
    torch.cuda.current_stream().wait_stream(side)


class GraphedForward:
    """fn(x) replayed from a CUDA graph captured for x's shape and dtype.

    The returned tensor is the graph's static output: it is overwritten by the next call, so
    callers copy what they keep. If capture fails (an op that cannot be captured), the failure
    is logged once and fn runs eagerly from then on.
    """

    def __init__(self, fn: Forward, log: Callable[[str], None], warmup: int = 2) -> None:
        self.fn = fn
        self.log = log
        self.warmup = warmup
        self.failed: str | None = None
        self._graphs: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.cuda.CUDAGraph]] = {}

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.dtype, x.device)
        entry = self._graphs.get(key)
        if entry is None and self.failed is None:
            entry = self._capture(x, key)
        if entry is None:
            return self.fn(x)
        static_in, static_out, graph = entry
        static_in.copy_(x)
        graph.replay()
        return static_out

    def _capture(self, x: torch.Tensor, key: tuple) -> tuple | None:
        static_in = x.clone()
        warm_up(lambda: self.fn(static_in), self.warmup)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                static_out = self.fn(static_in)
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {str(exc).strip()[:120]}"
            self.log(f"fast path: CUDA graph capture failed ({self.failed}); running eagerly")
            return None
        self._graphs[key] = (static_in, static_out, graph)
        return self._graphs[key]
