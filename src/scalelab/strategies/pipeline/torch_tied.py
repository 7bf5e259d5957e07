"""Tied parameters across stages of `pipeline --engine torch`: a head tied to the embedding
(nanoGPT, GPT-2, many Hugging Face models) is used by the first stage and the last.

torch's tracer gives each stage using such a parameter its own copy (`Pipe.replicated_params`)
and leaves their sum to the caller. As Megatron's embedding group does, the stages that use it
hold the model's own Parameter (torch_trace.py puts it back in place of the copies) and its
gradient is summed each step, before the optimizer's, over a process group of exactly the
ranks holding those stages, one group per dp replica: each holder's copy then takes the same
step from the same value, as one process's single tensor does. A rank holding two of the
stages (the V schedules put the first and the last on rank 0) accumulates both uses' gradients
in the one tensor itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scalelab.layout.torch_schedule import stage_ids


@dataclass(frozen=True)
class Tied:
    """One parameter the tracer found in several stages: its names in the model (`a = b`),
    the model's own tensor, and the stages using it."""

    names: str
    param: nn.Parameter
    stages: frozenset[int]


@dataclass
class Traced:
    """This rank's stage modules of one trace (stage index -> module) and the tied
    parameters the trace found."""

    pieces: dict[int, nn.Module]
    tied: list[Tied]


@dataclass
class TiedGrads:
    """The tied parameters this rank holds and the group summing each one's gradient."""

    schedule: str
    stages: int
    virtual: int
    dp: int
    dp_rank: int
    _groups: dict[frozenset[int], Any] = field(default_factory=dict)
    _held: dict[int, tuple[Tied, Any]] = field(default_factory=dict)

    def add(self, tied: list[Tied], ids: list[int]) -> None:
        """Register a trace's tied parameters. The first sight of a set of pipeline ranks
        creates its groups (one per replica), on every rank in the same order: each rank
        traces its first pass at the same point of the run, and a trace of another size
        finds the same stages."""
        for t in tied:
            ranks = self._ranks(t.stages)
            if ranks not in self._groups:
                self._groups[ranks] = self._new_groups(ranks)
            if t.stages & set(ids):
                self._held[id(t.param)] = (t, self._groups[ranks])

    def sum_grads(self) -> int:
        """Sum each held tied parameter's gradient over its group; returns the bytes sent."""
        sent = 0
        for t, group in self._held.values():
            if group is None:
                continue
            if t.param.grad is None:  # a holder whose use took no gradient this step
                t.param.grad = torch.zeros_like(t.param)
            dist.all_reduce(t.param.grad, group=group)
            sent += t.param.grad.numel() * t.param.grad.element_size()
        return sent

    @property
    def names(self) -> list[str]:
        return [t.names for t, _ in self._held.values()]

    def _ranks(self, used_by: frozenset[int]) -> frozenset[int]:
        """The pipeline ranks (within a replica) holding any of the stages `used_by`."""
        return frozenset(
            r for r in range(self.stages)
            if used_by & set(stage_ids(self.schedule, r, self.stages, self.virtual))
        )  # fmt: skip

    def _new_groups(self, ranks: frozenset[int]) -> Any:
        """One group per replica over its ranks (rank = d * stages + r, the mesh's
        row-major order); this rank's group, or None where one rank holds every use."""
        if len(ranks) < 2:
            return None
        mine = None
        for d in range(self.dp):  # every rank creates every group, in the same order
            group = dist.new_group([d * self.stages + r for r in sorted(ranks)])
            if d == self.dp_rank:
                mine = group
        return mine
