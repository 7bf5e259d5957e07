"""nccl-tests' five collectives over the run's communication library, with nccl-tests' own
bandwidth definitions (NVIDIA/nccl-tests, doc/PERFORMANCE.md), so the numbers compare with
an `all_reduce_perf` run directly:

    size S   all_reduce, broadcast: the buffer; all_gather: the gathered (output) buffer;
             reduce_scatter: the input buffer; alltoall: what one rank sends in all
    algbw  = S / time
    busbw  = algbw * factor(n): all_reduce 2(n-1)/n; all_gather, reduce_scatter,
             alltoall (n-1)/n; broadcast 1  (the bandwidth each link carried: comparable
             with the hardware's peak whatever the rank count)

torch.distributed's collectives on gloo/NCCL, mpi4py's on MPI; times as for every comm
ceiling (comm_bench.CommBench: slowest rank's best block).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from scalelab.comm.base import Comm
from scalelab.instrument.comm_bench import CommBench

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "alltoall")
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "alltoall": lambda n: (n - 1) / n,
}
Op = Callable[[], Any]


def bandwidths(name: str, nbytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s of one call of `name` on size nbytes."""
    algbw = nbytes / seconds
    return algbw, algbw * BUS_FACTOR[name](ranks)


def _torch_ops(count: int, n: int, device: torch.device) -> dict[str, Op]:
    """count float32 elements of size S (a multiple of n) per collective, torch.distributed."""
    import torch.distributed as dist

    full = lambda: torch.zeros(count, dtype=torch.float32, device=device)  # noqa: E731
    part = lambda: torch.zeros(count // n, dtype=torch.float32, device=device)  # noqa: E731
    # torch >= 2.13 names the flat-tensor forms *_single (the old names warn); same arguments
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    a, b, c, d, e, f, g, h = full(), full(), part(), full(), part(), full(), full(), full()
    return {
        "all_reduce": lambda: dist.all_reduce(a),
        "all_gather": lambda: gather(b, c),
        "reduce_scatter": lambda: scatter(e, d),
        "broadcast": lambda: dist.broadcast(f, 0),
        "alltoall": lambda: dist.all_to_all_single(g, h),
    }


def _mpi_ops(world: Any, count: int, n: int) -> dict[str, Op]:
    """The same over mpi4py (host buffers)."""
    from mpi4py import MPI

    full = lambda: np.zeros(count, dtype=np.float32)  # noqa: E731
    part = lambda: np.zeros(count // n, dtype=np.float32)  # noqa: E731
    a, b, c, d, e, f, g, h = full(), full(), part(), full(), part(), full(), full(), full()
    return {
        "all_reduce": lambda: world.Allreduce(MPI.IN_PLACE, a),
        "all_gather": lambda: world.Allgather(c, b),
        "reduce_scatter": lambda: world.Reduce_scatter_block(d, e),
        "broadcast": lambda: world.Bcast(f, root=0),
        "alltoall": lambda: world.Alltoall(g, h),
    }


def collective_ops(comm: Comm, device: torch.device, nbytes: int) -> dict[str, Op]:
    """One call of each collective on size nbytes (rounded down to whole float32 per rank)."""
    n = comm.size
    count = max(nbytes // (4 * n), 1) * n
    if comm.backend == "mpi":
        return _mpi_ops(comm.world, count, n)
    return _torch_ops(count, n, device)


def measure_collectives(
    comm: Comm, device: torch.device, sizes: list[int], block_s: float, repeats: int
) -> dict[str, list[dict[str, float]]] | None:
    """{collective: [{bytes, time_s, algbw_Bps, busbw_Bps}, ...]} on the root; None elsewhere.
    Every rank calls it."""
    bench = CommBench(comm, device, block_s, repeats)
    out: dict[str, list[dict[str, float]]] = {name: [] for name in COLLECTIVES}
    for nbytes in sizes:
        ops = collective_ops(comm, device, nbytes)
        size = 4 * (max(nbytes // (4 * comm.size), 1) * comm.size)
        for name in COLLECTIVES:
            seconds = bench.seconds_per_call(ops[name])
            if seconds is not None:
                algbw, busbw = bandwidths(name, size, seconds, comm.size)
                row = {"bytes": size, "time_s": seconds, "algbw_Bps": algbw, "busbw_Bps": busbw}
                out[name].append(row)
    return out if comm.is_root else None


def format_collectives(collectives: dict[str, list[dict[str, float]]], title: str) -> str:
    """nccl-tests' columns: size, time (us), algbw and busbw (GB/s), one block per collective."""
    lines = [f"collectives ({title}), nccl-tests' algbw and busbw:"]
    for name, rows in collectives.items():
        lines.append(f"  {name}")
        lines.append(
            f"    {'size (B)':>12} {'time (us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}"
        )
        for r in rows:
            lines.append(
                f"    {int(r['bytes']):>12} {r['time_s'] * 1e6:>11.2f} "
                f"{r['algbw_Bps'] / 1e9:>11.3f} {r['busbw_Bps'] / 1e9:>11.3f}"
            )
    return "\n".join(lines)


def parse_nccl_tests(text: str, hint: str = "") -> tuple[str, int, list[dict[str, float]]]:
    """(collective, ranks, rows) from the stdout of one nccl-tests binary (all_reduce_perf,
    ...). Rows keep the out-of-place columns: size (B), time (us), algbw, busbw (GB/s). The
    collective is read from the output's 'Collective test starting' line, else from hint
    (the file name); ranks from its '#  Rank' lines (0 when it lists none)."""
    name = _collective_named(text) or _collective_named(hint)
    if name is None:
        raise ValueError("names none of " + ", ".join(COLLECTIVES))
    ranks = sum(1 for line in text.splitlines() if line.lstrip("# ").startswith("Rank "))
    rows = []
    for line in text.splitlines():
        tokens = line.split()
        if not tokens or line.lstrip().startswith("#") or not tokens[0].isdigit():
            continue
        if len(tokens) < 10:
            raise ValueError(f"a result line with {len(tokens)} columns: {line.strip()!r}")
        time_us, algbw, busbw = (float(t) for t in tokens[-8:-5])
        rows.append(
            {
                "bytes": int(tokens[0]),
                "time_s": time_us * 1e-6,
                "algbw_Bps": algbw * 1e9,
                "busbw_Bps": busbw * 1e9,
            }  # fmt: skip
        )
    if not rows:
        raise ValueError("holds no result lines")
    return name, ranks, rows


def _collective_named(text: str) -> str | None:
    """The collective a binary's name or banner says (all_reduce_perf -> all_reduce)."""
    squashed = text.replace("-", "_").lower()
    for name in sorted(COLLECTIVES, key=len, reverse=True):
        if f"{name}_perf" in squashed or squashed.endswith(name):
            return name
    return None
