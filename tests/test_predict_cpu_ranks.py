"""predict for CPU ranks sharing a host: compute scaled by the measured cpu_concurrency curve
(the slowest process's, per thread count, a curve of the ranks' own step and its lockstep
rounds), and the spatial split's tail, gathered and run whole on the root."""

import json

import pytest

from predict_helpers import CEILINGS, FIXTURES
from scalelab.config import RunConfig
from scalelab.predict.figures import Figures
from scalelab.predict.models.spatial import trunk_of
from scalelab.predict.scenario import Scenario
from scalelab.strategies.halo import plan_trunk


# --- CPU ranks sharing a host: the measured cpu_concurrency curve ------------------------------
def _alexnet_ctx(curve=None):
    from scalelab.predict.calibration import Pool
    from scalelab.predict.models import Context
    from scalelab.predict.points import discover

    data = json.loads(CEILINGS.read_text())
    if curve is not None:
        data["cpu_concurrency"] = curve
    pool = Pool()
    for p in discover(FIXTURES / "mpi_scaling_h200x2.jsonl").pools.values():
        pool.extend(p)
    return Context(Figures(data, "c.json"), None, pool)


@pytest.mark.parametrize("split", ["batch", "spatial"])
def test_cpu_ranks_compute_scales_by_the_measured_slowdown(split):
    """6 single-threaded ranks on one node, slowest-process curve 1 / 1.2 / 1.5 / 2.1 at
    1 / 2 / 4 / 8 processes: linear between 4 and 8, s(6) = 1.5 + (2.1 - 1.5) * 2 / 4 = 1.8, so
    compute is 1.8x the no-contention model's (the median-process curve, lower, is not the
    one a bulk-synchronous step waits for); the note names the curve."""
    from scalelab.predict.frame import predict_one

    curve = {"ranks": [1, 2, 4, 8], "slowdown_max": [1.0, 1.2, 1.5, 2.1]}
    curve["slowdown"] = [1.0, 1.1, 1.2, 1.3]
    cfg = RunConfig(workload="alexnet", strategy="mpi", split=split, batch=32, threads=1)
    s = Scenario(cfg, 1, 64).at(6)
    plain, contended = predict_one(_alexnet_ctx(), s), predict_one(_alexnet_ctx(curve), s)
    assert contended.phases["compute"] == pytest.approx(1.8 * plain.phases["compute"])
    assert contended.phases["scatter"] == pytest.approx(plain.phases["scatter"])
    assert any("compute x1.8" in n and "cpu_concurrency" in n for n in contended.notes)
    assert any("assumed not to slow each other" in n for n in plain.notes)
    # one rank is the calibration itself: no slowdown, no note
    one = predict_one(_alexnet_ctx(curve), s.at(1))
    assert one.phases["compute"] == pytest.approx(
        predict_one(_alexnet_ctx(), s.at(1)).phases["compute"]
    )
    assert not any("cpu_concurrency" in n for n in one.notes)


def test_a_measured_speed_up_from_more_busy_processes_is_read_as_none():
    """A noisy curve (a --quick one on a 32-core host read 0.79 at 8 processes): more busy
    processes never make the slowest one faster, so compute is not scaled below 1."""
    from scalelab.predict.frame import predict_one

    curve = {"ranks": [1, 2, 8], "slowdown": [1.0, 1.1, 0.8], "slowdown_max": [1.0, 1.25, 0.79]}
    cfg = RunConfig(workload="alexnet", strategy="mpi", split="batch", batch=32, threads=1)
    s = Scenario(cfg, 1, 64).at(8)
    plain, noisy = predict_one(_alexnet_ctx(), s), predict_one(_alexnet_ctx(curve), s)
    assert noisy.phases["compute"] == pytest.approx(plain.phases["compute"])
    assert any("below 1: read as 1" in n for n in noisy.notes)


def test_ranks_of_several_threads_take_the_curve_measured_with_that_many():
    """2 ranks of 2 threads: the single-threaded curve says s(4) / s(2) = 1.5 / 1.2 = 1.25;
    a plan's curve of 2-thread processes (by_threads) says 1.7 at 2 of them, and wins."""
    from scalelab.predict.frame import predict_one

    curve = {"ranks": [1, 2, 4, 8], "slowdown_max": [1.0, 1.2, 1.5, 2.1]}
    curve["slowdown"] = curve["slowdown_max"]
    cfg = RunConfig(workload="alexnet", strategy="mpi", split="batch", batch=32, threads=2)
    s = Scenario(cfg, 1, 64).at(2)
    plain = predict_one(_alexnet_ctx(), s).phases["compute"]
    single = predict_one(_alexnet_ctx(curve), s)
    assert single.phases["compute"] == pytest.approx(1.25 * plain)
    threaded = {**curve, "by_threads": {"2": {"ranks": [1, 2], "slowdown_max": [1.0, 1.7],
                                               "slowdown": [1.0, 1.6]}}}  # fmt: skip
    two = predict_one(_alexnet_ctx(threaded), s)
    assert two.phases["compute"] == pytest.approx(1.7 * plain)
    assert any("compute x1.7" in n and "with 2 threads per process" in n for n in two.notes)


# --- spatial: a gathered tail runs whole on the root --------------------------------------------
def _stack(ranks: int) -> Scenario:
    cfg = RunConfig(workload="deepstack", strategy="mpi", split="spatial", batch=4, image_size=8,
                    convs=2, fcs=1, num_classes=10)  # fmt: skip
    return Scenario(cfg, 1, 4).at(ranks)


def test_spatial_tail_after_the_gather_counts_whole_on_the_root():
    """deepstack at 8 x 8 over 2 ranks: rows 4 + 4, rank 0 expands input rows 0..5 (its halo)
    for the first 3x3 conv. Compute = prepare 5/8 + each trunk step / 2 + the tail (pool,
    proj, fc1, classifier) whole, since the root runs it alone after gathering the final
    maps; alexnet's dense head is still split N ways."""
    from scalelab.predict.models.spatial import critical_compute, tail_bytes

    s = _stack(2)
    trunk = trunk_of(s)
    trunk_times = {"conv1": 1.0, "conv1_relu": 0.2, "conv2": 2.0, "conv2_relu": 0.4}
    tail_times = {"pool": 0.3, "proj": 0.5, "fc1": 0.6, "classifier": 0.1}
    layers = [("prepare", 0.8), *trunk_times.items(), *tail_times.items()]
    plans = plan_trunk(trunk.geometries(), 2)
    want = 0.8 * 5 / 8 + sum(trunk_times.values()) / 2 + sum(tail_times.values())
    assert critical_compute(layers, trunk, plans, 2) == pytest.approx(want)
    one = plan_trunk(trunk.geometries(), 1)
    assert critical_compute(layers, trunk, one, 1) == pytest.approx(sum(t for _, t in layers))
    # gathered: (4 items, 64 channels, 8 rows, 8 columns) float32
    assert tail_bytes(s, trunk) == 4 * 64 * 8 * 8 * 4
    cfg = RunConfig(workload="alexnet", strategy="mpi", split="spatial", batch=4, image_size=67)
    dense = trunk_of(Scenario(cfg, 1, 4).at(2))
    assert not dense.rest and dense.head
    head = [(name, 1.0) for name in ("fc6", "fc7", "fc8")]
    plans = plan_trunk(dense.geometries(), 2)
    assert critical_compute(head, dense, plans, 2) == pytest.approx(1.5)  # 3 s of head / 2


def test_spatial_tail_prediction_gathers_the_maps_and_sums_nothing():
    from scalelab.predict.frame import predict_one
    from scalelab.predict.models.spatial import tail_bytes

    ctx = _alexnet_ctx()
    s = _stack(2)
    pred = predict_one(ctx, s)
    assert pred.phases["allreduce"] == 0.0  # no dense head, no LayerNorm
    fabric = ctx.fabric(s, "mpi")
    assert pred.phases["gather"] == pytest.approx(fabric.scatter(tail_bytes(s, trunk_of(s)), 2))


def _step_curve(batch=8, lockstep=True):
    """A curve timed on AlexNet's own forward at `batch` items (a step's curve): alone 0.5 s,
    the slowest process's mean 1.5x at 4 processes, the slowest call per lockstep round 1.9x."""
    dtype = RunConfig(workload="alexnet").dtype
    curve = {"ranks": [1, 2, 4, 8], "slowdown": [1.0, 1.1, 1.2, 1.3],
             "slowdown_max": [1.0, 1.2, 1.5, 2.1], "seconds": [0.5, 0.55, 0.6, 0.65],
             "step": {"workload": "alexnet", "model": None, "train": False,
                      "dtype": dtype, "batch": batch, "threads": 1}}  # fmt: skip
    if lockstep:  # the median call alone (0.4 s) in place of the mean (seconds[0])
        curve["slowdown_lockstep"] = [1.0, 1.3, 1.9, 2.6]
        curve["seconds_lockstep"] = [0.4, 0.52, 0.76, 1.04]
    return curve


def test_a_curve_of_the_ranks_own_step_gives_their_compute():
    """4 single-threaded ranks of 32 images each compute 8: a curve timed on the forward at
    8 items says the step alone in place of the calibration law's value at 8 (its lockstep
    rounds' median call, 0.4 s) times the lockstep slowdown at 4 (1.9); without lockstep
    rounds, its mean call alone (0.5 s) times the slowest process's mean (1.5); a curve
    of another batch (16) or of several-thread ranks is read as the plain curve is."""
    from scalelab.predict.frame import predict_one

    def compute(curve, threads=1, ranks=4):
        cfg = RunConfig(workload="alexnet", strategy="mpi", split="batch", batch=32,
                        threads=threads)  # fmt: skip
        p = predict_one(_alexnet_ctx(curve), Scenario(cfg, 1, 64).at(ranks))
        return sum(p.phases.get(k, 0.0) for k in ("launch", "compute")), p.notes

    plain_curve = {k: v for k, v in _step_curve().items() if k != "step"}
    plain, plain_notes = compute(plain_curve)
    lock, notes = compute(_step_curve())
    assert lock == pytest.approx(1.9 * 0.4)
    assert any("lockstep round" in n and "x1.9" in n for n in notes)
    assert any("alone 400 ms" in n for n in notes)
    assert not any("alone 4" in n for n in plain_notes)
    no_lock, notes = compute(_step_curve(lockstep=False))
    assert no_lock == pytest.approx(1.5 * 0.5)
    assert any("compute x1.5" in n for n in notes) and not any("lockstep" in n for n in notes)
    assert plain != pytest.approx(0.75)  # the calibration law differs from the step alone
    # not this rank's step: the plain curve's prediction exactly
    assert compute(_step_curve(batch=16))[0] == pytest.approx(plain)
    assert compute(_step_curve(), ranks=2)[0] == pytest.approx(compute(plain_curve, ranks=2)[0])
    assert compute(_step_curve(batch=4), threads=2, ranks=8)[0] == pytest.approx(
        compute(plain_curve, threads=2, ranks=8)[0]
    )


def test_a_point_takes_the_threads_its_run_used_where_the_config_gave_none():
    """A run without --threads records what it chose (one per rank here): its point is
    predicted at that, not at the config's None (read as the host's cores over the ranks:
    2 MPI ranks on a 32-core host were predicted at 16 threads each, 12x fast). A given
    --threads stands; an old record's bare integer is read too."""
    from scalelab.predict.points import computed_in

    cfg = RunConfig(workload="alexnet", strategy="mpi", ranks=2)
    chose = {"threads": {"threads": 1, "source": "chosen", "why": "32 CPUs, 2 ranks"}}
    assert computed_in(cfg, chose).threads == 1
    assert computed_in(cfg, {"threads": 3}).threads == 3
    assert computed_in(cfg, {}).threads is None
    given = RunConfig(workload="alexnet", strategy="mpi", ranks=2, threads=4)
    assert computed_in(given, chose).threads == 4
