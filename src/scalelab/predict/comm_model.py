"""Alpha-beta (latency-bandwidth) models of the messages a strategy sends.

One message of n bytes over a link takes t = alpha + n / beta. Collectives over N ranks:

    ring all-reduce     2 (N-1) alpha + 2 (N-1)/N * n / beta      (reduce-scatter + all-gather)
    tree all-reduce     2 ceil(log2 N) alpha + 2 n / beta        (reduce up, broadcast down,
                                                                  pipelined: NCCL's double tree)
    all-reduce          the faster of the two (NCCL and MPI pick by size)
    hierarchical        ranks on M nodes, g per node: intra-node reduce-scatter and all-gather
                        (ring over g: 2 (g-1) alpha_i + 2 (g-1)/g * n / beta_i) around an
                        inter-node all-reduce of each rank's n/g shard over M nodes, every
                        rank on its own share of the node's NICs (rail-aligned)
    scatter / gather    the root's link carries (N-1) messages of n/N: (N-1) alpha + (N-1)/N n/beta
    broadcast           binomial tree: ceil(log2 N) (alpha + n / beta)

The intra-node link is derived from `scalelab ceilings`' all-reduce fit measured on p ranks,
t_p(n) = A + n / B: read as a ring, per-hop alpha = A / (2 (p-1)) and beta = B * 2 (p-1) / p
(for p = 2: alpha = A / 2, beta = B). Point-to-point messages use the p2p fit directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scalelab.errors import UsageError


@dataclass(frozen=True)
class Link:
    alpha_s: float  # seconds per message (latency)
    beta_Bps: float  # bytes per second

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_Bps


def ring_allreduce(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes / link.beta_Bps


def tree_allreduce(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.alpha_s + 2 * nbytes / link.beta_Bps


def flat_allreduce(nbytes: float, n: int, link: Link) -> float:
    return min(ring_allreduce(nbytes, n, link), tree_allreduce(nbytes, n, link))


def ring_link_from_fit(alpha_s: float, beta_Bps: float, ranks: int) -> Link:
    """Per-hop link of a ring whose all-reduce on `ranks` ranks fitted t = alpha + n/beta."""
    hops = 2 * (max(ranks, 2) - 1)
    return Link(alpha_s / hops, beta_Bps * hops / max(ranks, 2))


def hierarchical_allreduce(nbytes: float, g: int, m: int, intra: Link, inter: Link) -> float:
    """m nodes of g ranks: intra reduce-scatter, inter all-reduce of n/g, intra all-gather."""
    inside = 2 * (g - 1) * intra.alpha_s + 2 * (g - 1) / g * nbytes / intra.beta_Bps
    return inside + flat_allreduce(nbytes / g, m, inter)


@dataclass(frozen=True)
class Fabric:
    """Where N ranks sit and what connects them.

    intra_ring: per-hop link of an intra-node ring (from the measured all-reduce);
    intra_p2p: one intra-node message (measured p2p); inter: one inter-node message of one
    rank (network profile, its bandwidth shared by the ranks behind each NIC) or None when
    no network was given; per_node: ranks per node."""

    intra_ring: Link
    intra_p2p: Link
    inter: Link | None
    per_node: int

    def nodes(self, n: int) -> int:
        return math.ceil(n / self.per_node)

    def need_inter(self, n: int) -> Link:
        if self.inter is None:
            raise UsageError(
                f"{n} ranks at {self.per_node} per node span {self.nodes(n)} nodes: give "
                "--network (a profile such as ndr400, or a JSON file of a measured alpha/beta)"
            )
        return self.inter

    def allreduce(self, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        m = self.nodes(n)
        if m == 1:
            return flat_allreduce(nbytes, n, self.intra_ring)
        return hierarchical_allreduce(nbytes, self.per_node, m, self.intra_ring, self.need_inter(n))

    def p2p(self, nbytes: float, crosses_node: bool) -> float:
        return (self.need_inter(2) if crosses_node else self.intra_p2p).time(nbytes)

    def root_link(self, n: int) -> Link:
        """The slowest link a root-centred collective uses at n ranks."""
        return self.need_inter(n) if self.nodes(n) > 1 else self.intra_p2p

    def scatter(self, total_bytes: float, n: int) -> float:
        """Root sends every other rank its 1/n share (gather: the same in reverse)."""
        if n <= 1:
            return 0.0
        link = self.root_link(n)
        return (n - 1) * link.alpha_s + (n - 1) / n * total_bytes / link.beta_Bps

    def bcast(self, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        return math.ceil(math.log2(n)) * self.root_link(n).time(nbytes)
