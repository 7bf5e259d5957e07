"""`--split spatial`: domain decomposition of the convolution trunk along one axis (the seed's
V2.2): height for AlexNet, text length for the char-CNN.

Per iteration, on every rank:

    scatter   root's transport-form input (uint8), rows of the split axis, Scatterv
    per layer halo exchange with the neighbours (non-blocking isend/irecv) for conv/pool
              layers, edge padding on the true edges, the layer on the slab; a LayerNorm
              over the split axis all-reduces per-item partial moments (sum, then sum of
              squared deviations: two (N,) all-reduces, exact two-pass variance)
    head      the dense layers in weight blocks (head.py): one all-reduce, one gather; a
              tail that is not dense layers (global pooling, residual blocks) runs on the
              root after a gather of the final slabs

The first halo exchange happens on the transport form (1-byte pixels or indices), before
prepare() expands the slab on the device. Geometry and ownership: halo.py.
"""

from __future__ import annotations

import torch
from torch import nn

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.layout.trunk import Step, Trunk, trunk_for
from scalelab.strategies.halo import RankRows, edge_pad, exchange, max_ranks, plan_trunk
from scalelab.strategies.split.base import SPLITS, Split
from scalelab.strategies.split.head import head_forward, plan_head
from scalelab.workloads.base import Inputs, Workload


@SPLITS.register("spatial", "halo-exchange domain decomposition of the conv trunk (seed V2.2)")
class SpatialSplit(Split):
    @classmethod
    def check(cls, cfg: RunConfig, workload: Workload, ranks: int) -> None:
        geoms = trunk_for(workload, None).geometries()
        try:
            plan_trunk(geoms, ranks)
        except UsageError as exc:  # a slab thinner than a halo: say how far it can go
            raise UsageError(f"{exc} (at most {max_ranks(geoms)} ranks here)") from None

    def setup(self, model: nn.Module, inputs: Inputs | None) -> None:
        super().setup(model, inputs)
        self.trunk: Trunk = trunk_for(self.workload, model)
        geoms = self.trunk.geometries()
        self.plans = plan_trunk(geoms, self.comm.size)
        self.counts = [r.own[1] - r.own[0] for r in self.plans[0]]
        final = self.plans[-1][self.rank].out
        final_shape = self._final_shape(geoms[-1].out_size)
        self.head = None
        if self.trunk.head:
            self.head = plan_head(self.trunk.head, final, final_shape, self.rank, self.comm.size)
        self.host_x = self.wire.pin(inputs.x) if inputs is not None else None
        self.dtype = self.strategy.precision.storage

    def _final_shape(self, rows: int) -> tuple[int, ...]:
        """(C, rows, ...) of the trunk's output per item: channels, split axis, the rest."""
        trailing = self.trunk.in_trailing
        for step in self.trunk.steps:
            trailing = step.out_trailing(trailing)
        return (self.trunk.steps[-1].out_channels, rows, *trailing)

    def notes(self) -> dict:
        return {"halo_plan": halo_table(self.trunk, self.plans)}

    def step(self) -> torch.Tensor | None:
        x = self._scatter_rows()
        axis = self.trunk.in_axis
        for i, (step, plan) in enumerate(zip(self.trunk.steps, self.plans)):
            if step.kind == "window":
                x = exchange(self.comm, self.wire, self.timer, x, axis, plan, tag=i)
            if i == 0:  # expand 1-byte inputs only now, halo rows included
                with self.timer.phase("compute"):
                    x = self.workload.prepare(x).to(self.dtype)
                axis = self.trunk.axis
            x = self._apply(step, plan[self.rank], x)
        out = head_forward(self, self.head, x) if self.head is not None else self._tail(x)
        return self.wire.to_host64(out) if out is not None else None

    def _tail(self, x: torch.Tensor) -> torch.Tensor | None:
        """The final slabs gathered on the root along the split axis (ranks in order: rows
        in order), then the layers after the trunk there; None on other ranks."""
        axis = self.trunk.axis
        with self.timer.phase("gather"):  # gatherv stacks dim 0: put the split axis first
            full = self.comm.gatherv(self.wire.to_wire(x.movedim(axis, 0).contiguous()))
        if not self.comm.is_root:
            return None
        h = self.wire.from_wire(full).movedim(0, axis)
        with self.timer.phase("compute"):
            for layer in self.trunk.rest:
                h = layer.module(h)
        return h

    def _scatter_rows(self) -> torch.Tensor:
        """Rows [own] of the root's input along the transport form's split axis."""
        axis = self.trunk.in_axis
        x = None
        if self.comm.is_root:
            x = self.wire.host_to_wire(self.host_x)
        with self.timer.phase("scatter"):
            if x is not None:  # Scatterv splits dim 0: put the split axis first
                x = x.movedim(axis, 0).contiguous()
            x = self.comm.scatterv(x, self.counts)
        self.received("scatter", x)
        return self.wire.from_wire(x).movedim(0, axis)

    def _apply(self, step: Step, rows: RankRows, x: torch.Tensor) -> torch.Tensor:
        axis = self.trunk.axis
        if step.kind == "norm":
            return self._layernorm(step, rows, x)
        with self.timer.phase("compute"):
            if step.kind == "point":
                return step.apply(x) if x.shape[axis] else x
            if rows.empty:  # no output rows here: an empty slab of the right shape
                shape = (x.shape[0], step.out_channels, 0, *step.out_trailing(x.shape[3:]))
                return x.new_empty(shape)
            x = edge_pad(x, axis, rows.pad_top, rows.pad_bottom, step.pad_value)
            return step.apply(x)

    def _layernorm(self, step: Step, rows: RankRows, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm over (C, L) of maps split along L: moments summed over ranks.

        x: (N, C, l) with l = this rank's rows [a, b); gamma, beta: (C, L) sliced to [a, b).
        mean = all_sum(sum x) / (C L); var = all_sum(sum (x - mean)^2) / (C L), as torch.
        """
        ln, (a, b) = step.norm, rows.out
        count = x.shape[1] * ln.normalized_shape[-1]
        with self.timer.phase("compute"):
            s1 = x.sum(dim=(1, 2), dtype=torch.float64)  # (N,)
        mean = self._all_sum(s1) / count
        with self.timer.phase("compute"):
            d = x - mean.to(x.dtype)[:, None, None]
            s2 = (d * d).sum(dim=(1, 2), dtype=torch.float64)
        var = self._all_sum(s2) / count
        with self.timer.phase("compute"):
            rstd = torch.rsqrt(var + ln.eps).to(x.dtype)[:, None, None]
            return d * rstd * ln.weight[:, a:b] + ln.bias[:, a:b]

    def _all_sum(self, t: torch.Tensor) -> torch.Tensor:
        buf = self.wire.to_wire(t)
        with self.timer.phase("allreduce"):
            self.comm.allreduce(buf)
        self.timer.add_bytes("allreduce", buf.nbytes)
        return self.wire.from_wire(buf)


def halo_table(trunk: Trunk, plans: list[list[RankRows]]) -> list[dict]:
    """Per windowed layer: rows owned, halo rows received above/below, edge padding."""
    rows = []
    for step, plan in zip(trunk.steps, plans):
        if step.kind != "window":
            continue
        rows.append(
            {
                "layer": step.name,
                "kernel": step.kernel,
                "stride": step.stride,
                "pad": step.pad,
                "out_rows": [r.out[1] - r.out[0] for r in plan],
                "halo_up": [r.halo_up for r in plan],
                "halo_down": [r.halo_down for r in plan],
            }
        )
    return rows
