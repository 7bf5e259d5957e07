"""PhaseTimer: nesting, laps, the instrumentation hub (intervals, step hooks), CUDA events."""

import gc
import time

import pytest
import torch

from scalelab.instrument.timer import (
    HUB,
    PhaseTimer,
    Timings,
    device_sync,
    notify_step,
    timed_iterations,
)


def test_phases_nest_into_paths_and_lap_resets():
    timer = PhaseTimer()
    with timer.phase("train"):
        with timer.phase("backward"), timer.phase("allreduce"):
            time.sleep(0.02)
        with timer.phase("step"):
            time.sleep(0.01)
    lap = timer.lap()
    assert set(lap) == {"train", "train/backward", "train/backward/allreduce", "train/step"}
    assert lap["train/backward/allreduce"] >= 0.02 and lap["train/step"] >= 0.01
    # An outer phase contains its children: at least their sum, and not much more.
    inner = lap["train/backward"] + lap["train/step"]
    assert inner <= lap["train"] < inner + 0.05
    assert lap["train/backward"] >= lap["train/backward/allreduce"]
    assert timer.lap() == {}


def test_repeated_phase_accumulates_and_disabled_timer_books_nothing():
    timer = PhaseTimer()
    for _ in range(3):
        with timer.phase("halo"):
            time.sleep(0.005)
    assert timer.lap()["halo"] >= 0.015
    off = PhaseTimer(enabled=False)
    with off.phase("compute"):
        pass
    assert off.lap() == {}


def test_phase_stack_unwinds_on_exception():
    timer = PhaseTimer()
    with pytest.raises(ValueError), timer.phase("outer"), timer.phase("inner"):
        raise ValueError
    with timer.phase("next"):
        pass
    assert set(timer.lap()) == {"outer", "outer/inner", "next"}


def test_hub_intervals_record_every_phase_with_its_path():
    timer = PhaseTimer()
    HUB.intervals = []
    try:
        with timer.phase("compute"), timer.phase("forward"):
            time.sleep(0.005)
        intervals = list(HUB.intervals)
    finally:
        HUB.intervals = None
    assert [p for p, _, _ in intervals] == ["compute/forward", "compute"]  # inner ends first
    (_, s_in, e_in), (_, s_out, e_out) = intervals
    assert s_out <= s_in < e_in <= e_out and e_in - s_in >= 0.005


def test_timed_iterations_steps_hooks_and_drops_warmup():
    ticks = []
    HUB.step_hooks.append(lambda: ticks.append(1))
    timer = PhaseTimer()
    calls = []

    def step():
        calls.append(1)
        with timer.phase("compute"):
            time.sleep(0.002)
        return len(calls)

    try:
        timings, last = timed_iterations(step, timer, warmup=2, iters=3)
    finally:
        HUB.step_hooks.clear()
    assert len(ticks) == 5 and last == 5
    assert len(timings.walls) == 3 and len(timings.laps) == 3
    assert all(lap["compute"] <= wall for lap, wall in zip(timings.laps, timings.walls))
    assert timings.device_laps == [] and timings.device_phase_medians() == {}
    notify_step()  # no hooks: a no-op


def test_no_garbage_collection_inside_a_timed_iteration_and_back_on_after():
    """A collection of a large heap would land between phases: timed steps run without it,
    warm-up and the caller's own code with it, and a caller that had it off keeps it off."""
    seen = []

    def step():
        seen.append(gc.isenabled())

    timer = PhaseTimer()
    timed_iterations(step, timer, warmup=1, iters=2)
    assert seen == [True, False, False] and gc.isenabled()
    gc.disable()
    try:
        timed_iterations(step, timer, warmup=0, iters=1)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_timings_device_medians():
    t = Timings()
    for i in range(3):
        t.add(1.0 + i, {"compute": 0.5 + i}, {"compute": 0.4 + i})
    assert t.phase_medians() == {"compute": 1.5}
    assert t.device_phase_medians() == pytest.approx({"compute": 1.4})


def test_cpu_timer_records_no_events():
    timer = PhaseTimer(device_sync(torch.device("cpu")))
    assert not timer.events
    with timer.phase("compute"):
        pass
    timer.lap()
    assert timer.last_device_lap == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_time_the_device_work():
    device = torch.device("cuda")
    timer = PhaseTimer(device_sync(device))
    assert timer.events
    a = torch.randn(4096, 4096, device=device)
    for _ in range(3):
        with timer.phase("compute"):
            for _ in range(10):
                a @ a
        host = timer.lap()["compute"]
        dev = timer.last_device_lap["compute"]
    # 10 GEMMs of 2*4096^3 FLOPs: real device time, within the synchronised host time.
    assert 0 < dev <= host * 1.01
    assert dev > host * 0.5  # the host clock adds launch and sync overhead, not 2x
