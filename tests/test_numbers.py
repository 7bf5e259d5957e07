"""Numbers a careful user believes, checked on recorded fixtures and known answers: the
statistics of repeated times, the run warnings (oversubscription, host load, spread), the
training headline, ceilings that check themselves, phases inside their wall, roofline points
above their roof flagged, and predict --validate's headline over uncalibrated points.
(Live runs under a load generator: test_numbers_live.py.)"""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from scalelab.analysis import phases, roofline
from scalelab.instrument import ceiling_checks as CC
from scalelab.instrument import host_checks as H
from scalelab.instrument.stats import SPREAD_CV, describe
from scalelab.instrument.timer import Timings
from scalelab.record import read_records
from scalelab.train.headline import headline

FIXTURES = Path(__file__).parent / "fixtures"


# --- statistics -------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 5, 10, 11])
def test_describe_matches_numpy(n):
    x = np.random.default_rng(n).lognormal(size=n).tolist()
    got = describe(x)
    q1, med, q3 = np.percentile(x, [25, 50, 75])  # linear interpolation, NumPy's default
    assert got["n"] == n and got["median"] == pytest.approx(med)
    assert got["q1"] == pytest.approx(q1) and got["iqr"] == pytest.approx(q3 - q1)
    assert got["cv"] == pytest.approx(np.std(x) / np.mean(x))
    assert (got["min"], got["max"]) == (min(x), max(x))


def test_timings_phases_come_from_one_iteration_inside_its_wall():
    """Per-phase medians of different iterations can add up past every wall; the median-wall
    iteration's phases cannot."""
    t = Timings()
    for wall, a, b in [(2.0, 1.0, 1.0), (1.0, 1.0, 0.0), (1.0, 0.0, 1.0), (1.1, 0.5, 0.5)]:
        t.add(wall, {"a": a, "b": b})
    medians = t.phase_medians()
    assert medians["a"] + medians["b"] > t.wall_median  # phase medians above the wall
    it = t.iteration_phases()
    assert sum(it.values()) <= t.iteration_wall() <= t.wall_median
    assert t.iteration_wall() == 1.0 and t.spread()["n"] == 4


# --- warnings -----------------------------------------------------------------------------------
def test_oversubscription_counts_processes_and_threads():
    assert H.oversubscription(4, 1, (2.0, "affinity")) == [
        "4 processes on 2 CPUs (affinity): ranks wait for cores"
    ]
    assert "x 2 torch threads" in H.oversubscription(2, 2, (2.0, "cgroup quota"))[0]
    assert H.oversubscription(2, 1, (2.0, "affinity")) == []
    assert H.oversubscription(1, 2, (2.0, "affinity")) == []


def test_cpu_limits_from_cgroup_and_slurm(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert H.cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert H.cgroup_quota(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert H.cgroup_quota(v1) == 3.0
    assert H.slurm_cpus({"SLURM_CPUS_ON_NODE": "6"}) == 6 and H.slurm_cpus({}) is None
    assert H.ranks_on_host(8, {"LOCAL_WORLD_SIZE": "4"}) == 4 and H.ranks_on_host(3, {}) == 3


def test_busy_seconds_per_cpu(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    stat.write_text(
        "cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 100 0 50 1000 7 0 0 0 0 0\ncpu1 200 0 0 5 5 0 0 0 0 0\n"
    )
    tick = __import__("os").sysconf("SC_CLK_TCK")
    assert H.cpu_busy(stat) == pytest.approx({0: 150 / tick, 1: 200 / tick})  # no "cpu" total


def test_ranks_bound_to_their_own_cores_have_the_union_of_their_masks(monkeypatch):
    """A launcher that binds each rank to one core (Open MPI at 2 ranks) leaves every rank a
    one-CPU mask: the run still had both CPUs, and 2 threads per rank oversubscribe them."""
    import socket

    for var in (*H.LOCAL_SIZE_VARS, "SLURM_CPUS_ON_NODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(H, "cgroup_quota", lambda: None)
    me = socket.gethostname()
    places = [H.Place(me, (0,), 1.0), H.Place(me, (1,), 1.0), H.Place("elsewhere", (2, 3), 1.0)]
    warnings, host = H.run_checks(3, 1, [1.0] * 3, None, "iterations", places)
    # 3 ranks, 2 of them here (the launcher's local size is unset: the world stands for it)
    assert host["allowed_cpus"] == 2 and host["rank_cpus"] == [[0], [1]]
    assert warnings == ["3 processes on 2 CPUs (affinity): ranks wait for cores"]
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert H.run_checks(3, 1, [1.0] * 3, None, "iterations", places)[0] == []
    warnings, _ = H.run_checks(3, 2, [1.0] * 3, None, "iterations", places)
    assert warnings == [
        "2 processes x 2 torch threads on 2 CPUs (affinity): threads wait for cores (the "
        "launcher bound each rank to 1 CPU(s): mpirun --bind-to none or --map-by slot:PE=2, "
        "srun --cpus-per-task=2)"
    ]
    unbound = [H.Place(me, (0, 1), 1.0), H.Place(me, (0, 1), 1.0)]
    warnings, host = H.run_checks(2, 2, [1.0] * 3, None, "iterations", unbound)
    assert "rank_cpus" not in host and warnings[0].endswith("(pass --threads to cap them)")


def test_load_and_spread_warnings():
    load = {"cpus": 2, "others_cpus": 1.2}
    assert "host busy" in H.load_warning(load, need_cpus=2)[0]
    assert H.load_warning(load, need_cpus=1) == []  # 1 CPU left free, 1.2 used: in margin
    assert H.load_warning({"cpus": 2, "others_cpus": 0.1}, need_cpus=2) == []
    assert H.load_warning({"cpus": 2}, need_cpus=2) == []  # no /proc/stat: no claim
    steady = [1.0, 1.01, 0.99, 1.0]
    assert H.spread_warning(steady) == []
    noisy = [1.0, 1.0, 2.0, 1.0]
    assert describe(noisy)["cv"] > SPREAD_CV and "CV 35%" in H.spread_warning(noisy)[0]
    assert H.spread_warning([1.0, 3.0]) == []  # two repetitions: no spread claim


# --- training headline ----------------------------------------------------------------------------
def test_steady_throughput_leaves_the_warm_up_out():
    """A 6.8 s capture then 10 steps of 0.025 s, 100 items each (as in a ddp --fast run)."""
    t = Timings()
    marks, now = [], 0.0
    for step in range(11):
        now += 6.8 if step == 0 else 0.025
        marks.append((now, 100 * (step + 1)))
    t.marks = marks
    t.add(now, {})
    got = headline(t, 1100)
    assert got["time_to_train_s"] == pytest.approx(now)
    assert got["steady"]["from_step"] == 2 and got["steady"]["basis"] == "steps"
    assert got["steady_throughput"] == pytest.approx(100 / 0.025)
    assert 1100 / now < got["steady_throughput"] / 20  # the whole-run rate understates it


def test_steady_throughput_leaves_at_least_the_warmup_steps_out():
    """--warmup 10, as a peer loop timing 30 steps after 10: 40 steps whose first ten take
    0.03 s (under twice the median: not slow enough to be found) and the rest 0.02 s; the
    steady part is the last 30 (from step 11), and never every step."""
    t = Timings()
    times = np.cumsum([0.03] * 10 + [0.02] * 30)
    t.marks = [(float(now), 16 * (i + 1)) for i, now in enumerate(times)]
    t.add(float(times[-1]), {})
    assert headline(t, 640)["steady"]["from_step"] == 2  # found: the first step only
    got = headline(t, 640, warmup=10)
    assert got["steady"]["from_step"] == 11 and got["steady"]["steps"] == 30
    assert got["steady_throughput"] == pytest.approx(16 / 0.02)
    assert headline(t, 640, warmup=99)["steady"]["from_step"] == 40  # one step left


def test_a_partial_last_batch_is_left_out_of_the_steady_rate():
    """13 steps of 512 items at 0.01 s after a 2 s first step, then 320 items in 1.5 s (new
    shapes: cuDNN autotunes again): the steady rate is the full steps'."""
    t = Timings()
    durations, sizes = [2.0] + [0.01] * 13 + [1.5], [512] * 14 + [320]
    times, counts = np.cumsum(durations), np.cumsum(sizes)
    t.marks = [(float(a), int(b)) for a, b in zip(times, counts)]
    t.add(float(times[-1]), {})
    got = headline(t, int(counts[-1]))
    assert got["steady"]["steps"] == 13 and got["steady"]["partial_steps_left_out"] == 1
    assert got["steady_throughput"] == pytest.approx(512 / 0.01)
    assert got["steady"]["items"] == 13 * 512


def test_a_partial_batch_is_preceded_by_a_synced_mark():
    """The last full step's mark is taken again after the device sync, so GPU work queued by
    the full steps ends inside their window (the partial step is left out of it)."""
    import time

    from scalelab.train.loop import Trainer

    syncs = []
    t = Trainer.__new__(Trainer)  # the two methods under test need only these fields
    t.sync, t.timings = (lambda: syncs.append(time.perf_counter())), Timings()
    t.excluded, t.trained_s, t.trained, t.full_items = 0.0, 0.0, 0, 0
    t.epoch_t0 = time.perf_counter()
    for items in (512, 512):
        t._before_step(items)
        t.trained += items
        t._mark()
    first = list(t.timings.marks)
    t._before_step(320)
    assert len(syncs) == 1 and len(t.timings.marks) == 2 and t.timings.marks[0] == first[0]
    assert t.timings.marks[1][1] == 1024 and t.timings.marks[1][0] >= first[1][0]
    assert t.timings.marks[1][0] >= syncs[0] - t.epoch_t0  # read after the sync


def test_the_mark_at_the_warmup_step_follows_a_device_sync():
    """--warmup 3: the third step's mark (where the steady window may start) is read after one
    device sync, the others without one."""
    import time
    from types import SimpleNamespace

    from scalelab.train.loop import Trainer

    syncs = []
    t = Trainer.__new__(Trainer)  # the method under test needs only these fields
    t.sync, t.timings = (lambda: syncs.append(time.perf_counter())), Timings()
    t.cfg, t.excluded, t.trained_s, t.trained = SimpleNamespace(warmup=3), 0.0, 0.0, 0
    t.epoch_t0 = time.perf_counter()
    for _ in range(5):
        t.trained += 16
        t._mark_step()
    assert len(syncs) == 1 and len(t.timings.marks) == 5
    assert t.timings.marks[1][0] <= syncs[0] - t.epoch_t0 <= t.timings.marks[2][0]


def test_steady_throughput_by_epochs_without_marks():
    t = Timings()
    for wall in (5.0, 1.0, 1.0):
        t.add(wall, {})
    got = headline(t, 300)
    assert got["steady"]["from_epoch"] == 2 and got["steady_throughput"] == pytest.approx(100)


# --- ceilings ------------------------------------------------------------------------------------
def _ceilings(**over):
    data = {
        "device": "cpu",
        "gemm_flops": {"fp64": 50e9, "fp32": 90e9, "detail": {"fp64": [1], "fp32": [2]}},
        "cpu_gemm_flops": {"one_core": 30e9, "all_cores": 55e9, "cores": 2},
        "cpu_mem_bw": {"one_core": 10e9, "all_cores": 15e9},
    }
    data.update(over)
    return data


def test_sane_ceilings_break_no_relation():
    assert CC.violations(_ceilings()) == []
    with open(FIXTURES / "ceilings_cpu.json") as f:
        assert CC.violations(json.load(f)) == []


def test_contradictory_ceilings_break_every_relation():
    """fp32 GEMM 88 below fp64 149; NumPy fp64 on 2 cores 1.09 below one core 32.2; a copy
    above a cited datasheet."""
    bad = _ceilings(
        gemm_flops={"fp64": 149e9, "fp32": 88e9},
        cpu_gemm_flops={"one_core": 32.2e9, "all_cores": 1.09e9, "cores": 2},
        mem_bw=5e12,
        peaks={"mem_Bps": 3.35e12},
    )
    sections = sorted(s for s, _ in CC.violations(bad))
    assert sections == ["datasheet", "gemm", "host"]


def test_self_check_remeasures_and_keeps_the_best():
    data = _ceilings(gemm_flops={"fp64": 149e9, "fp32": 88e9, "detail": {"fp32": [1]}})
    calls = []

    def gemm():
        calls.append(1)
        return {"gemm_flops": {"fp64": 140e9, "fp32": 290e9, "detail": {"fp32": [2]}}}

    CC.self_check(data, {"gemm": gemm, "host": lambda: pytest.fail("host is sane")})
    assert len(calls) == 1 and data["passes"] == {"gemm": 2, "host": 1}
    assert data["gemm_flops"]["fp64"] == 149e9 and data["gemm_flops"]["fp32"] == 290e9
    assert data["gemm_flops"]["detail"]["fp32"] == [1, 2] and data["warnings"] == []


def test_self_check_never_hides_what_stays_broken():
    data = _ceilings(gemm_flops={"fp64": 149e9, "fp32": 88e9})
    same = lambda: {"gemm_flops": {"fp64": 149e9, "fp32": 88e9}}  # noqa: E731
    CC.self_check(data, {"gemm": same})
    assert data["passes"]["gemm"] == 1 + CC.RETRIES
    assert data["warnings"] and "fp32 GEMM" in data["warnings"][0]


# --- phases and roofline on recorded fixtures ----------------------------------------------------
def _ok(name):
    return [r for r in read_records(FIXTURES / name) if r.get("status") == "ok"]


@pytest.mark.parametrize("name", ["scaling_strong.jsonl", "scaling_weak.jsonl", "layers.jsonl"])
def test_recorded_phases_stay_inside_each_ranks_wall(name):
    for rec in _ok(name):
        acc = phases.phase_accounting(rec)
        assert not acc["exceeds"].any(), rec["id"]
        assert (acc["other_s"] >= -phases.PHASE_SLACK_S).all()
        table = phases.rank_phase_table(rec)
        ranks = [i for i in table.index if i.startswith("rank")]
        tops = [c for c in table.columns if "/" not in c and c != "wall"]
        assert table.loc[ranks, tops].sum(axis=1).to_numpy() == pytest.approx(
            table.loc[ranks, "wall"].to_numpy()
        )  # top-level phases + other = the wall, per rank


def test_phase_bars_stack_to_the_ranks_mean_wall():
    """Bars never stand above the measured iteration: self times + other = mean rank wall."""
    rec = {
        "id": "x",
        "status": "ok",
        "mode": "infer",
        "workload": "mlp",
        "strategy": "mpi",
        "ranks": 2,
        "wall_s": 0.010,
        "rank_wall_s": [0.010, 0.012],
        "rank_phases": [{"compute": 0.008, "compute/fwd": 0.005}, {"compute": 0.011}],
    }
    bars = phases.phase_breakdown([rec])
    assert bars["seconds"].sum() == pytest.approx(0.011)
    assert (bars["seconds"] >= 0).all()


def test_phases_longer_than_the_wall_are_flagged():
    """Rank 1's phases sum to 0.583 s in a run whose wall is 0.384 s."""
    rec = {
        "mode": "infer",
        "wall_s": 0.384,
        "rank_phases": [{"compute": 0.3, "allreduce": 0.05}, {"compute": 0.5, "wait": 0.083}],
    }
    acc = phases.phase_accounting(rec)
    assert acc["exceeds"].tolist() == [False, True]
    rec["rank_wall_s"] = [0.384, 0.6]  # each rank against its own wall
    assert not phases.phase_accounting(rec)["exceeds"].any()


def test_points_above_the_roof_are_flagged():
    recs = _ok("layers.jsonl")
    with open(FIXTURES / "ceilings_cpu.json") as f:
        ceilings = json.load(f)
    df = roofline.layer_roofline(recs, ceilings)
    assert (df["fraction"] <= 1.0 + 1e-12).all() and (df["flag"] == "").all()
    low = {**ceilings, "gemm_flops": {"fp32": 1e6, "fp64": 1e6}, "mem_bw": 1e6}
    df = roofline.layer_roofline(recs, low)  # a ceiling measured 1000x too low
    above = df["fraction"] > 1.0
    assert above.any() and (df.loc[above, "flag"] == roofline.UNDER_MEASURED).all()
    assert (df.loc[~above, "flag"] == "").all()


# --- predict --validate --------------------------------------------------------------------------
def test_validate_headline_is_the_held_out_error_then_the_in_sample_one():
    from scalelab.predict.validate import validate

    v = validate(FIXTURES / "predict", None, None)
    head = v.summary()
    m = re.match(r"MAPE held out: ([\d.]+)% over (\d+) points \(leave-one-out\); "
                 r"in sample: ([\d.]+)% over (\d+)", head)  # fmt: skip
    assert m, head
    loo = v.scored["held_out_pct"].dropna()  # each point predicted without itself
    assert float(m[1]) == pytest.approx(loo.abs().mean(), abs=0.05) and int(m[2]) == len(loo)
    assert float(m[3]) == pytest.approx(v.scored["error_pct"].abs().mean(), abs=0.05)
    assert int(m[4]) == len(v.scored) and 0 < len(loo) <= len(v.scored)
    # leaving a point out can only cost accuracy on average: the in-sample figure flatters
    assert float(m[1]) >= float(m[3]) - 0.05
    assert (v.table["warnings"] == "").all()


# --- warned runs dropped on request ----------------------------------------------------------
def _warn_first(src: Path, dst: Path) -> None:
    """dst: src's records with a warning on the first ok one."""
    lines = src.read_text().splitlines()
    for i, line in enumerate(lines):
        rec = json.loads(line)
        if rec.get("status") == "ok":
            rec["warnings"] = ["host busy: test"]
            lines[i] = json.dumps(rec)
            break
    dst.write_text("\n".join(lines) + "\n")


def test_report_lists_or_drops_warned_runs(cli, tmp_path):
    results = tmp_path / "runs.jsonl"
    _warn_first(FIXTURES / "scaling_strong.jsonl", results)
    code, _, err = cli("report", results, "-o", tmp_path / "all", "--no-plots")
    assert code == 0, err
    page = (tmp_path / "all" / "index.html").read_text()
    assert "host busy: test" in page and "1 with warnings" in page
    code, out, err = cli("report", results, "-o", tmp_path / "kept", "--no-plots", "--drop-warned")
    assert code == 0 and "left out 1 warned run" in out, err
    assert "host busy: test" not in (tmp_path / "kept" / "index.html").read_text()


def test_validate_drops_warned_points(tmp_path):
    import shutil

    from scalelab.predict.validate import validate

    folder = tmp_path / "predict"
    shutil.copytree(FIXTURES / "predict", folder)
    target = next(p for p in sorted(folder.glob("*.jsonl")) if "mpi" in p.name)
    _warn_first(FIXTURES / "predict" / target.name, target)
    kept = validate(folder, None, None)
    dropped = validate(folder, None, None, drop_warned=True)
    assert (kept.table["warnings"] != "").sum() == 1 and "warned runs" in kept.summary()
    assert len(dropped.table) == len(kept.table) - 1 and (dropped.table["warnings"] == "").all()
