"""Halo geometry and exchange for a domain decomposition along one spatial axis.

Every rank owns a contiguous slab of rows of every feature map (height for images, length for
texts). Before a layer with kernel k, stride s and padding p it needs the input rows under the
windows of the output rows it owns; rows owned by a neighbour arrive as halo rows.

Geometry (rows are global indices along the split axis, H the layer's input size):

    out_size       O = (H + 2p - k) // s + 1                   (floor mode, as torch)
    window(j)      input rows [j*s - p, j*s - p + k)            (output row j)
    centre(j)      j*s - p + (k - 1) // 2, clamped to [0, H)
    need(a, b)     [a*s - p, (b - 1)*s - p + k)                 (output rows [a, b))

Ownership follows the *centre rule*: output row j belongs to the rank that owns input row
centre(j). Output rows are then owned exactly once, slabs stay contiguous and balanced, and
every rank needs at most (k - 1) // 2 rows from the rank above and k // 2 rows from the rank
below: the seed's halo = (kernel - 1) / 2 (C1: 5 rows, C2: 2 rows), generalised to any stride.
Rows of `need` outside [0, H) are padding: only ranks at the true top and bottom edges add
them, with the layer's pad value (0 for convolutions, -inf for max-pools).

The first layer's input partition is chosen backwards from an even split of that layer's
output (the centre of each rank's first output row starts its input slab), so the expensive
early layers are balanced to one row; later layers inherit it through the centre rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scalelab.errors import UsageError


def even_counts(n: int, parts: int) -> list[int]:
    """n rows over parts ranks, the first n % parts ranks one row more (the same split as
    comm.base.even_counts, Scatterv's counts; layout does not import comm/)."""
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


@dataclass(frozen=True)
class Geometry:
    """One layer along the split axis."""

    name: str
    kernel: int
    stride: int
    pad: int
    in_size: int

    @property
    def out_size(self) -> int:
        return max(0, (self.in_size + 2 * self.pad - self.kernel) // self.stride + 1)

    def centre(self, j: int) -> int:
        c = j * self.stride - self.pad + (self.kernel - 1) // 2
        return min(max(c, 0), self.in_size - 1)

    def need(self, a: int, b: int) -> tuple[int, int]:
        """Input rows (unclipped: may run past the edges into padding) for output rows [a, b)."""
        return a * self.stride - self.pad, (b - 1) * self.stride - self.pad + self.kernel


@dataclass(frozen=True)
class RankRows:
    """What one rank owns and needs at one layer (global row indices, [start, stop))."""

    own: tuple[int, int]  # input rows this rank holds
    out: tuple[int, int]  # output rows this rank computes
    need: tuple[int, int]  # input rows its outputs read, clipped to [0, in_size)
    pad_top: int  # padding rows above (top edge only)
    pad_bottom: int  # padding rows below (bottom edge only)

    @property
    def empty(self) -> bool:
        return self.out[0] == self.out[1]

    @property
    def halo_up(self) -> int:
        """Rows to receive from the rank above."""
        return 0 if self.empty else max(0, self.own[0] - self.need[0])

    @property
    def halo_down(self) -> int:
        """Rows to receive from the rank below."""
        return 0 if self.empty else max(0, self.need[1] - self.own[1])

    @property
    def keep(self) -> tuple[int, int]:
        """Own rows this rank's outputs read, relative to its slab start."""
        if self.empty:
            return 0, 0
        lo, hi = max(self.need[0], self.own[0]), min(self.need[1], self.own[1])
        return lo - self.own[0], max(lo, hi) - self.own[0]


def bounds(counts: Sequence[int]) -> list[int]:
    """[0, c0, c0+c1, ..., sum]: rank r owns rows [b[r], b[r+1])."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def out_bounds(geom: Geometry, in_bounds: Sequence[int]) -> list[int]:
    """Output partition by the centre rule: rank r owns j with centre(j) in its input slab."""
    centres = [geom.centre(j) for j in range(geom.out_size)]
    inner = [sum(1 for c in centres if c < b) for b in in_bounds[1:-1]]
    return [0, *inner, geom.out_size]


def first_in_bounds(geom: Geometry, ranks: int) -> list[int]:
    """Input partition that splits this layer's output evenly (one row of imbalance at most)."""
    target = bounds(even_counts(geom.out_size, ranks))
    inner = [geom.in_size if j >= geom.out_size else geom.centre(j) for j in target[1:-1]]
    return [0, *inner, geom.in_size]


def plan_layer(geom: Geometry, in_bounds: Sequence[int]) -> list[RankRows]:
    """Every rank's rows at one layer, from the input partition."""
    outs = out_bounds(geom, in_bounds)
    plan = []
    for r in range(len(in_bounds) - 1):
        a, b = outs[r], outs[r + 1]
        lo, hi = geom.need(a, b) if b > a else (in_bounds[r], in_bounds[r])
        plan.append(
            RankRows(
                own=(in_bounds[r], in_bounds[r + 1]),
                out=(a, b),
                need=(max(lo, 0), min(hi, geom.in_size)),
                pad_top=max(0, -lo) if b > a else 0,
                pad_bottom=max(0, hi - geom.in_size) if b > a else 0,
            )
        )
    return plan


def check_neighbours(geom: Geometry, plan: Sequence[RankRows]) -> None:
    """Halo rows must come from the adjacent rank: a slab thinner than the halo is an error."""
    for r, rows in enumerate(plan):
        for side, halo, peer in (("above", rows.halo_up, r - 1), ("below", rows.halo_down, r + 1)):
            if halo == 0:
                continue
            have = 0 if not 0 <= peer < len(plan) else plan[peer].own[1] - plan[peer].own[0]
            if have < halo:
                raise UsageError(
                    f"--split spatial: at layer {geom.name} rank {r} needs {halo} halo rows "
                    f"from the rank {side}, whose slab has only {have} "
                    f"(slab thinner than the halo); use fewer ranks or a larger input"
                )


def plan_trunk(geoms: Sequence[Geometry], ranks: int) -> list[list[RankRows]]:
    """Plans for every layer of a trunk, input partition anchored on the first layer."""
    if not geoms:
        return []
    in_b = first_in_bounds(geoms[0], ranks)
    plans = []
    for geom in geoms:
        plan = plan_layer(geom, in_b)
        check_neighbours(geom, plan)
        plans.append(plan)
        in_b = out_bounds(geom, in_b)
    return plans


def max_ranks(geoms: Sequence[Geometry], limit: int = 64) -> int:
    """The most ranks the trunk can be split over without a slab thinner than its halo."""
    best = 1
    for n in range(2, limit + 1):
        try:
            plan_trunk(geoms, n)
        except UsageError:
            break
        best = n
    return best
