"""The cpu_concurrency ceiling: k single-threaded processes computing the same kernel at once.
The curve's arithmetic on exact data, the levels it measures, and real processes: alone vs
sharing one core (time-sliced, so each runs about half as fast)."""

import math
import os
import warnings

import pytest

from scalelab.instrument import concurrency as C


def test_curve_from_exact_times():
    ks, per_k = [1, 2, 4], [[0.010], [0.010, 0.012], [0.012, 0.014, 0.016, 0.030]]
    c = C.curve(ks, per_k, "kernel", "method")
    assert c["ranks"] == [1, 2, 4] and c["slowdown"][0] == 1.0
    # median over processes / the time alone; the slowest process separately
    assert c["slowdown"] == pytest.approx([1.0, 1.1, 1.5])
    assert c["slowdown_max"] == pytest.approx([1.0, 1.2, 3.0])
    assert c["seconds"] == pytest.approx([0.010, 0.011, 0.015])


@pytest.mark.parametrize(
    "cores, want", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (64, [1, 2, 4, 8, 16, 32, 64])]
)
def test_levels_double_up_to_the_cores(cores, want):
    assert C.levels(cores) == want


def test_a_curve_of_processes_of_several_threads_counts_them_against_the_cores():
    c = C.measure(2, quick=True, threads=2)  # 2 cores hold one process of 2 threads
    assert c["ranks"] == [1] and c["threads"] == 2 and "2 torch thread(s)" in c["kernel"]


def test_measured_curve_is_sane_at_small_k():
    """Two processes on a 2-core runner: not faster than one alone (within noise), and not
    slower than time-slicing both on one core would make them. The test run shares the host
    with a second test process (README: `-n 2`), whose load can land on the k=2 measurement
    and not the k=1 one (a slowdown of 6.6 seen once): a round whose curves all fall outside
    is measured again, up to 3 rounds; a real error (every round outside) still fails."""
    seen = []
    for _ in range(3):
        # two curves one after another from one pool of workers (plan's repeated curves)
        curves = C.measure_curves(2, 2, quick=True)
        assert len(curves) == 2 and curves[0] is not curves[1]
        for c in curves:
            assert c["ranks"] == [1, 2] and c["slowdown"][0] == 1.0
            assert all(math.isfinite(x) and x > 0 for x in c["seconds"])
            assert c["slowdown_max"][1] >= c["slowdown"][1]
            assert "conv2d" in c["kernel"] and "same instant" in c["method"]
        seen += [c["slowdown"][1] for c in curves]
        if any(0.7 < c["slowdown"][1] < 2.6 for c in curves):
            return
    pytest.fail(f"k=2 slowdowns {seen}: none within (0.7, 2.6) in 3 rounds")


def _mlp_step() -> C.StepKernel:
    from scalelab.config import RunConfig

    return C.StepKernel(RunConfig(workload="mlp", train=True, hidden=256), 20)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
@pytest.mark.parametrize(
    "kernel, alone_s",
    [
        (C.QUICK, (1e-4, 1.0)),  # the conv: tens of ms on one core
        # plan's kernel, a training step of the mlp (784 -> 256 -> 10) at 20 items, built
        # in each worker from the config: ~0.1-1 ms on one core
        (_mlp_step(), (1e-5, 0.01)),
    ],
)
def test_processes_sharing_one_core_measure_as_slowed(kernel, alone_s):
    """Workers inherit the parent's affinity: pinned to one core, two time-slice it and each
    call takes about twice as long; the measurement must see that contention (a slowdown
    over one alone above 1.4). Each worker also says its CPU seconds per call, so a round
    tells its own disturbance apart: two on one core get at most half of it each (wall >=
    ~2x CPU, whatever else runs: checked every round), and a round without the slowdown fails
    only where the one alone had its core (wall < 1.15x CPU). Else it is measured again: the
    other test process's load can take the core from the one alone while the kernel's
    scheduler moves it off the core the two share (slowdowns of 0.98-1.27 seen in CI). After
    4 such rounds the test ends on the checks that held, with a warning."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        pool = C.Workers(2, kernel)
    finally:
        os.sched_setaffinity(0, before)
    seen = []
    try:  # up to 4 rounds
        for _ in range(4):
            alone = pool.run(1, 0.1)
            alone_share = alone[0] / pool.cpu_seconds[0]
            both = pool.run(2, 0.2)
            # the kernel's size by its CPU seconds per call: the wall of the one alone grows
            # with whatever else the host runs (10 ms seen for the ~1 ms mlp step under load)
            assert alone_s[0] < pool.cpu_seconds[0] < alone_s[1]
            for wall, cpu in zip(both, pool.cpu_seconds, strict=True):
                assert wall > 1.5 * cpu, f"two on one core, one had {cpu / wall:.0%} of it"
            slowdown = C.curve([1, 2], [alone, both], "", "")["slowdown"]
            assert slowdown[0] == 1.0
            seen.append((round(slowdown[1], 2), round(alone_share, 2)))
            if slowdown[1] > 1.4:
                return
            # not slowed: a failure where the one alone had its core, else measured again
            # (1.2, the one alone lost a sixth of its core, with a slowdown of 1.18, seen in CI)
            assert alone_share >= 1.15, f"(slowdown, alone's wall/CPU) per round: {seen}"
    finally:
        pool.close()
    # Every round's absolute check held (two on one core each had at most ~half of it); only
    # the ratio to one alone went unjudged, its core never free: said, not skipped.
    warnings.warn(
        f"the core was never free for one alone: (slowdown, wall/CPU) {seen}", stacklevel=1
    )


def test_a_step_kernel_says_what_it_times():
    from scalelab.config import RunConfig

    step = _mlp_step()
    assert step.describe() == "one training step of mlp at batch 20, 1 torch thread(s) per process"
    assert (
        C.StepKernel(RunConfig(workload="alexnet"), 16)
        .describe()
        .startswith("one forward of alexnet")
    )


def test_lockstep_curve_from_exact_rounds():
    """Per round the slowest of the k calls, their median over the rounds, over the median
    call alone: 2.0 at k = 2 where the slowest process's mean over the rounds reads 1.625
    (the max of means is below the mean of maxes a bulk-synchronous step waits for)."""
    alone = [[0.010], [0.012], [0.010]]  # median 0.010, mean 0.010667
    two = [[0.010, 0.020], [0.012, 0.011], [0.030, 0.010]]  # round maxes 0.020, 0.012, 0.030
    c = C.lockstep_curve([1, 2], [alone, two], "kernel", "method")
    assert c["slowdown_lockstep"] == pytest.approx([1.0, 2.0])
    assert c["seconds_lockstep"] == pytest.approx([0.010, 0.020])
    assert c["seconds"][0] == pytest.approx(0.032 / 3)
    assert c["slowdown_max"][1] == pytest.approx((0.052 / 3) / (0.032 / 3))  # 1.625
    assert c["lockstep_rounds"] == [3, 3]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_a_step_curve_is_timed_in_lockstep_and_says_its_step():
    """A workload's step (the mlp's training step at 20 items) timed by two workers pinned to
    one core: each lockstep round ends when both calls are done, so the round's slowest call,
    counted from the common start, takes both calls' time on the one core: about twice one
    alone, whichever ran first (above 1.4; the time-slicing that a process's mean over the
    rounds halves). The curve records the step it timed. Two curves from one pool: the other
    test process's load can land on the one alone (a disturbed alone read 1.8 where an
    undisturbed one read 6.3 on this 2-core host), so one of the two above 1.4 suffices, and a
    round whose two curves were both disturbed (1.17 and 1.28 seen once in CI) is measured
    again, up to 3 rounds; a real error (every round at or below 1.4) still fails."""
    seen = []
    for _ in range(3):
        curves = _pinned_to_one_core(lambda: C.measure_curves(2, 2, quick=True, kernel=_mlp_step()))
        for c in curves:
            assert c["step"] == {"workload": "mlp", "model": None, "train": True,
                                 "dtype": "fp32", "batch": 20, "threads": 1}  # fmt: skip
            assert c["ranks"] == [1, 2] and "training step of mlp" in c["kernel"]
            assert "lockstep rounds" in c["method"] and min(c["lockstep_rounds"]) >= C.MIN_ROUNDS
            assert c["slowdown_lockstep"][0] == 1.0 and c["slowdown"][0] == 1.0
            assert all(math.isfinite(x) and x > 0 for x in c["slowdown_lockstep"])
        seen += [round(c["slowdown_lockstep"][1], 2) for c in curves]
        if max(c["slowdown_lockstep"][1] for c in curves) > 1.4:
            return
    pytest.fail(f"k=2 lockstep slowdowns {seen} on one core: none above 1.4 in 3 rounds")


def _pinned_to_one_core(measure):
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})  # the workers inherit it
    try:
        return measure()
    finally:
        os.sched_setaffinity(0, before)


def test_a_process_measures_a_kernels_curves_from_one_pool_of_workers():
    """plan measures the same curve beside every verify round: the second measurement reuses
    the first one's workers (their start, each importing torch, costs more than the curve),
    another kernel gets its own pool, and a closed pool is started afresh."""
    C.measure(2, quick=True)
    first = C.Workers.kept(2, C.QUICK)
    pids = [p.pid for p in first.procs]
    C.measure(2, quick=True)
    assert [p.pid for p in C.Workers.kept(2, C.QUICK).procs] == pids
    assert C.Workers.kept(2, C.DEFAULT) is not first
    C.Workers.close_kept()
    assert all(p.poll() is not None for p in first.procs)
    assert [p.pid for p in C.Workers.kept(2, C.QUICK).procs] != pids
