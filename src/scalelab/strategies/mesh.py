"""2-D layouts on one device mesh: `--dp D` data-parallel replicas of a model-parallel group of
M ranks (M pipeline stages, or M tensor shards); ranks = D x M.

torch's `init_device_mesh` lays the mesh out row-major, so rank = d * M + m: the model-parallel
group is M neighbouring ranks (on a GPU node, its per-micro-batch traffic stays among close
GPUs) and each data-parallel group takes one rank from every replica. Gradients are summed over
the dp group once per step (one flat all-reduce of this rank's shard of every gradient); each
replica trains on its contiguous share of the global batch with its loss weighted by its share,
so the sum is the gradient of the global mean loss, as in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scalelab.comm.base import even_counts
from scalelab.errors import UsageError


@dataclass(frozen=True)
class Layout:
    """dp replicas of an inner group of `inner` ranks named `name` ("pp" or "tp")."""

    dp: int
    inner: int
    name: str

    @property
    def world(self) -> int:
        return self.dp * self.inner

    def check(self, world: int, what: str) -> None:
        if world != self.world:
            raise UsageError(
                f"{what}: --dp {self.dp} x {self.inner} runs on {self.world} ranks; "
                f"pass --ranks {self.world} (got {world})"
            )

    def shape(self) -> dict[str, int]:
        return {"dp": self.dp, self.name: self.inner}


class MeshGroups:
    """This rank's place on the (dp, inner) mesh and the two process groups."""

    def __init__(self, layout: Layout, device_type: str) -> None:
        self.layout = layout
        self.mesh: DeviceMesh = init_device_mesh(
            device_type, (layout.dp, layout.inner), mesh_dim_names=("dp", layout.name)
        )
        self.inner_mesh: DeviceMesh = self.mesh[layout.name]
        self.dp_group = self.mesh["dp"].get_group()
        self.inner_group = self.inner_mesh.get_group()
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.inner_rank = self.mesh.get_local_rank(layout.name)

    def share(self, n: int) -> slice:
        """This replica's contiguous rows of a global batch of n."""
        counts = even_counts(n, self.layout.dp)
        start = sum(counts[: self.dp_rank])
        return slice(start, start + counts[self.dp_rank])

    def gather_replicas(self, comm, out: torch.Tensor | None) -> torch.Tensor | None:
        """Every replica's logits onto the root, in replica order (float64, host). out: this
        rank's logits, or None on ranks that hold none (one rank per replica gives them).
        Collective over comm (the whole world)."""
        mine = None if out is None else (self.dp_rank, out.detach().to("cpu", torch.float64))
        parts = comm.gather_object(mine)
        return None if parts is None else torch.cat([t for _, t in sorted(p for p in parts if p)])

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> int:
        """Sum this rank's gradients over the dp group in one flat message (DTensor gradients:
        their local shard); returns the bytes sent. Parameters without a gradient (another
        stage's layers) are skipped: every member of a dp group holds the same ones."""
        if self.layout.dp == 1:
            return 0
        grads = [_local(p.grad) for p in params if p.grad is not None]
        if not grads:
            return 0
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return flat.numel() * flat.element_size()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
