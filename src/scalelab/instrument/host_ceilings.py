"""The host's ceilings with NumPy: float64 GEMM and copy bandwidth on one core and on all of
them (the `cpu_gemm_flops` and `cpu_mem_bw` sections of ceilings.json)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from scalelab.environment import usable_cpus
from scalelab.instrument.ceiling_timing import Plan, seconds_per_call


def numpy_gemm_flops(n: int, threads: int, plan: Plan) -> float:
    """float64 GEMM FLOP/s with the BLAS limited to `threads` threads."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    with threadpool_limits(limits=threads):
        return 2 * n**3 / seconds_per_call(lambda: a @ b, lambda: None, plan)


def numpy_copy_bandwidth(nbytes: int, threads: int, plan: Plan) -> float:
    """np.copyto of nbytes per thread, `threads` threads at once (NumPy drops the GIL while
    copying); bytes/s counting the read and the write."""
    pairs = [(np.ones(nbytes // 8), np.ones(nbytes // 8)) for _ in range(threads)]
    with ThreadPoolExecutor(threads) as pool:

        def step() -> None:
            list(pool.map(lambda p: np.copyto(p[1], p[0]), pairs))

        seconds = seconds_per_call(step, lambda: None, plan)
    return 2 * nbytes * threads / seconds


def host_ceilings(plan: Plan) -> dict[str, Any]:
    cores = usable_cpus()
    best = lambda threads: max(numpy_gemm_flops(n, threads, plan) for n in plan.cpu_gemm_sizes)  # noqa: E731
    copy = lambda threads: numpy_copy_bandwidth(plan.cpu_copy_bytes, threads, plan)  # noqa: E731
    return {
        "cpu_gemm_flops": {**_cores_pair(best, cores), "cores": cores, "dtype": "fp64"},
        # the working set says which cache or memory it measured (8 MiB: L3 on many hosts)
        "cpu_mem_bw": {**_cores_pair(copy, cores), "bytes_per_thread": plan.cpu_copy_bytes},
    }


def _cores_pair(rate: Callable[[int], float], cores: int) -> dict[str, Any]:
    """one_core and all_cores; all_cores is the better of `cores` threads and one thread (n
    cores can always do what one does: on a busy host n threads can be 10x slower than one,
    a worker waiting for a core), the threads that reached it and the n-thread figure kept."""
    one, many = rate(1), rate(cores) if cores > 1 else None
    if many is None or many >= one:
        return {"one_core": one, "all_cores": many or one, "all_cores_threads": cores}
    return {"one_core": one, "all_cores": one, "all_cores_threads": 1, "all_threads_measured": many}
