"""Stages and schedules of `pipeline --engine torch`: which of the S x V cut pieces a rank
holds, torch's PipelineStage around each, the schedule over them, and a clock around every
forward/backward a stage runs (the same record the hand engine's timeline keeps).

Placement follows the schedule: one stage per rank (gpipe, 1f1b); V stages in a loop
(interleaved-1f1b, looped-bfs, zero-bubble: rank r holds r, r + S, r + 2S, ...); two stages in
a V (zbv, dualpipev: rank r holds r and 2S - 1 - r, so the last stage is on rank 0).

torch's PipelineStage learns the shapes crossing each boundary from the first micro-batch it
runs and keeps them: every micro-batch must have the same size (with 7 items over 4
micro-batches the last stage returned 8 rows). So each (replica share, train) size gets its
own stages and schedule, and a share not divisible by the micro-batch count runs with the
largest count that divides it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from scalelab.errors import UsageError
from scalelab.layout.torch_schedule import SINGLE, SPLIT_BACKWARD, schedule_class
from scalelab.strategies.pipeline.torch_meta import keep_inference_state


def whole_backward_stages(holds_parameters: list[bool]) -> frozenset[int]:
    """The stages (after stage 0) whose input does not require a gradient: every stage before
    them holds no parameters, so the activation they receive carries requires_grad=False
    (PipelineStage takes it from the sender's first output).

    torch 2.13's split backward skips their weights: stage_backward_input (_backward.py)
    groups a stage's parameters by the autograd nodes joining them to the stage's inputs, and
    finds none when no input requires a gradient, so stage_backward_weight has nothing to
    differentiate and the parameters keep grad None; PipelineStage.backward_weight_one_chunk
    (stage.py) falls back to the whole backward for stage_index 0 only (its TODO says so).
    Such a stage is given PipelineStage's own dw_builder (a no-op weight step), with which
    its I action runs the whole backward (stage_backward) and its W action nothing: nothing
    waits on its input gradient, which does not exist. The mlp cut [flatten cast | fc1 |
    sigmoid | fc2] left fc1 untrained (weights off by 2.6e-3 to 6.2e-3 after 2 steps)."""
    first = next((i for i, holds in enumerate(holds_parameters) if holds), 0)
    return frozenset(range(1, first + 1))


def _no_weight_step() -> Callable[[], None]:
    return lambda: None


class OwnedOutput(nn.Module):
    """A stage piece whose output is never a view of another tensor (a copy when it is one).

    Under the split backward, torch 2.13's stage_backward_input (_backward.py) ends with
    `t.detach_()` on every stage output, which raises "Can't detach views in-place" when the
    output is a view: a cut ending at `flatten` ([N, C, 1, 1] -> [N, C]) did that. The auto
    balancer is timed, so such a cut came and went with the machine's load: the rank raised,
    left, and its peer reported gloo's "Connection closed by peer" mid-schedule. The copy is
    the size of the activation the stage sends anyway; the parameters are the piece's own.

    Every stage's output is also laid out contiguously: torch 2.11's stage checks its output's
    strides against the traced ones, and a model returning `logits[:, -1]` (a strided view,
    (N, V) with stride (T*V, 1)) was refused there ("stride mismatch: expected (40, 1) actual
    (320, 1)") while torch 2.13 passes it."""

    def __init__(self, piece: nn.Module, own: bool = True) -> None:
        super().__init__()
        self.piece = piece
        self.own = own

    def forward(self, *args: Any) -> Any:
        out = self.piece(*args)
        if isinstance(out, (tuple, list)):  # a traced cut handing on several values (OPT's)
            return type(out)(self._laid_out(o) for o in out)
        return self._laid_out(out)

    def _laid_out(self, out: Any) -> Any:
        if not isinstance(out, torch.Tensor):
            return out
        if not out.is_contiguous():
            return out.contiguous()  # a copy: neither a view nor strided
        return out.clone() if self.own and out._is_view() else out


class _ToNHWC(torch.autograd.Function):
    """x (N, C, H, W) laid out NHWC; its gradient handed back NCHW (the autograd of
    `contiguous(memory_format=...)` passes the NHWC gradient through, and the previous stage
    sizes its gradient buffer from it: torch raised "input tensor has to be contiguous")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class ChannelsLast(nn.Module):
    """A stage piece run in channels_last (NHWC) memory order, its boundaries in NCHW.

    cuDNN runs bf16 convolutions much faster in NHWC, but torch's PipelineStage sizes its
    buffers (activations and their gradients) from the strides of the first micro-batch's
    tensors and sends them as they are, so what crosses a boundary stays NCHW: 4-D inputs are
    laid out NHWC on entry (their gradients NCHW on the way back) and the output is made
    contiguous on exit, one copy of the activation the stage sends anyway. The piece's 4-D
    weights are converted by the caller (they are the model's own)."""

    def __init__(self, piece: nn.Module) -> None:
        super().__init__()
        self.piece = piece

    def forward(self, *args: Any) -> Any:
        args = tuple(
            _ToNHWC.apply(a) if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args
        )
        out = self.piece(*args)
        return out.contiguous() if isinstance(out, torch.Tensor) else out


def micro_for(n: int, micro: int) -> int:
    """The micro-batch count for n items: `micro`, or the largest count below it dividing n."""
    return max(d for d in range(1, min(micro, n) + 1) if n % d == 0)


@dataclass
class Clock:
    """Every forward/backward action this rank ran in the current pass: (stage, kind, m,
    start, end) in perf_counter seconds.

    On a GPU each action is timed by two CUDA events on the current stream, read once when the
    pass ends, on the device's clock placed at the pass's host start. A device-wide sync around
    each action would also wait for every transfer torch has posted (its runtime posts
    receives early), holding the ranks in lock-step: VGG-16's interleaved-1F1B step took
    157.7 ms on 2x H200 where the replay of its lists without that wait gives 78-84 ms. The
    event before an action is reached once the stream has waited for the action's receive, so
    the span is the action's own compute."""

    device: torch.device
    events: list[tuple[int, str, int, float, float]] = field(default_factory=list)
    _pending: list[tuple[int, str, int, Any, Any]] = field(default_factory=list)
    _origin: tuple[float, Any] | None = None

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def start(self) -> float:
        """A pass begins: forget the last pass; the host seconds now (the device idle first,
        so its origin event is reached at this instant)."""
        self.events.clear()
        self._pending.clear()
        if self._cuda:
            torch.cuda.synchronize(self.device)
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
            self._origin = (time.perf_counter(), origin)
            return self._origin[0]
        return time.perf_counter()

    def finish(self) -> float:
        """The pass ends: wait for the device, place each action's events on the host clock;
        the host seconds now."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        if self._pending:
            t0, origin = self._origin
            self.events.extend(
                (s, k, m, t0 + origin.elapsed_time(a) / 1e3, t0 + origin.elapsed_time(b) / 1e3)
                for s, k, m, a, b in self._pending
            )
            self._pending.clear()
        return end

    def wrap(self, stage: PipelineStage) -> None:
        """Time the stage's three compute entry points (the schedules call them by name)."""
        fwd, bwd, wgt = (
            stage.forward_one_chunk,
            stage.backward_one_chunk,
            stage.backward_weight_one_chunk,
        )
        i = stage.stage_index

        def forward_one_chunk(m, *args, **kwargs):
            return self._time(i, "F", m, fwd, m, *args, **kwargs)

        def backward_one_chunk(m, *args, **kwargs):
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            return self._time(i, "B" if full else "I", m, bwd, m, *args, **kwargs)

        def backward_weight_one_chunk(m, *args, **kwargs):
            return self._time(i, "W", m, wgt, m, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def _time(self, stage: int, kind: str, m: int, fn: Callable, *args, **kwargs) -> Any:
        if not self._cuda:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.events.append((stage, kind, m, start, time.perf_counter()))
            return out
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = fn(*args, **kwargs)
        end.record()
        self._pending.append((stage, kind, m, begin, end))
        return out


@dataclass
class Pass:
    """One configured pipeline for one replica share size: its stages and schedule."""

    stages: list[PipelineStage]
    schedule: Any
    micro: int

    @property
    def first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def last(self) -> bool:
        return any(s.is_last for s in self.stages)


def build_pass(
    name: str,
    pieces: dict[int, nn.Module],
    n_stages: int,
    device: torch.device,
    group: Any,
    micro: int,
    loss_fn: Callable | None,
    clock: Clock,
    whole_backward: frozenset[int] = frozenset(),
    channels_last: bool = False,
) -> Pass:
    """Fresh PipelineStages over the pieces (shapes are learnt per size) and the schedule;
    torch's refusals (a micro-batch count a schedule cannot take) become one-line errors.
    The stages in `whole_backward` run their whole backward in one action
    (whole_backward_stages says why); under the split backward every stage but the last
    hands on an output of its own, and every stage a contiguous one (OwnedOutput says why);
    channels_last: each piece runs in NHWC (ChannelsLast says how)."""
    split = name in SPLIT_BACKWARD
    if channels_last:
        pieces = {i: ChannelsLast(mod) for i, mod in pieces.items()}
    stages = [
        PipelineStage(OwnedOutput(mod, own=split and i < n_stages - 1), i, n_stages,
                      device, group=group,
                      dw_builder=_no_weight_step if i in whole_backward else None)
        for i, mod in pieces.items()
    ]  # fmt: skip
    for stage in stages:
        clock.wrap(stage)
        keep_inference_state(stage)  # its shape-learning forward changes no state
    cls = schedule_class(name)
    try:
        sched = cls(stages[0] if name in SINGLE else stages, n_microbatches=micro,
                    loss_fn=loss_fn, scale_grads=False)  # fmt: skip
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise UsageError(
            f"--schedule {name} with {micro} micro-batches: torch says: {exc}"
        ) from None
    return Pass(stages, sched, micro)
