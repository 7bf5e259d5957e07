"""`scalelab plan`'s ranking and its proof: ranked by predicted throughput with the
calibration named, a tensor rank calibrated on its shard, calibrated rows before bounds, the
steady training rate and the median calibration run, missing figures named with the command
that measures them, and verification's regret paired within rounds."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from plan_helpers import figures, spec
from scalelab.config import RunConfig
from scalelab.plan import candidates as cand
from scalelab.plan.rank import OK, label, rank
from scalelab.plan.space import PlanSpec
from scalelab.plan.verify import picks, verify
from scalelab.predict.calibration import CalPoint, Pool
from scalelab.predict.models import Context
from scalelab.predict.scenario import Scenario


# --- ranking --------------------------------------------------------------------------------
def _point(s: PlanSpec, threads: int, batch: int, seconds: float, split="batch") -> CalPoint:
    cfg = s.config(strategy="mpi", ranks=1, threads=threads, batch=batch, split=split)
    fam = Scenario(cfg, 1, 2).family()
    return CalPoint(fam, "mpi", split, batch, seconds, 0.0, f"cal{threads}:{batch}")


def test_ranking_is_by_predicted_throughput_and_names_its_calibration():
    s = spec(strategies=("mpi",))
    pool = Pool([_point(s, 1, 32, 0.32), _point(s, 1, 16, 0.16), _point(s, 2, 32, 0.2)])
    table = rank(Context(figures(), None, pool), s, cand.candidates(s))
    ok = table[table["status"] == OK]
    assert list(ok["rank"]) == list(range(1, len(ok) + 1))
    assert ok["throughput"].is_monotonic_decreasing
    one = ok.set_index("candidate").loc["mpi --ranks 1 --split batch --threads 1 --batch 32"]
    assert one["basis"] == "calibrated on cal1:32"
    assert one["efficiency"] == pytest.approx(1.0)
    # one rank, one thread: the calibration's 0.32 s plus the modelled local copies only
    assert 320 <= one["ms"] < 321
    assert ok["basis"].str.startswith("calibrated").all()
    bare = rank(Context(figures(), None, Pool()), s, cand.candidates(s))
    assert bare.loc[bare["status"] == OK, "basis"].str.startswith("bound").all()


def test_a_tensor_rank_is_calibrated_on_a_one_rank_run_of_its_shard():
    # mlp, 100 hidden units over 3 ranks: the largest shard has 34 units; the whole mlp's
    # one-rank step is 10 ms at batch 60 of which 4 ms do not shrink with the batch
    from scalelab.plan.calibrate import missing

    s = PlanSpec(base=RunConfig(workload="mlp", train=True, hidden=100), ranks_max=3,
                 per_node=3, cores=3, global_batch=60, strategies=("tensor",))  # fmt: skip
    [three] = [c for c in cand.candidates(s) if c.ranks == 3 and c.threads == 1]

    def point(hidden: int, batch: int, seconds: float) -> CalPoint:
        cfg = s.config(strategy="mpi-dp", ranks=1, threads=1, batch=batch, hidden=hidden)
        return CalPoint(Scenario(cfg, 1, 3).family(), "mpi-dp", None, batch, seconds, 0.0,
                        f"h{hidden}b{batch}")  # fmt: skip

    whole = [point(100, 30, 0.007), point(100, 60, 0.010)]
    todo = missing(s, Pool(whole), [three], 3)
    assert [(c.strategy, c.ranks, c.hidden, c.batch) for c in todo] == [("tensor", 1, 34, 60)]
    ctx = Context(figures(), None, Pool(whole))
    split = rank(ctx, s, [three]).iloc[0]  # no shard measured: the whole law split 3 ways
    assert split["basis"] == "calibrated on h100b60"
    ctx = Context(figures(), None, Pool([*whole, point(34, 60, 0.0045)]))
    shard = rank(ctx, s, [three]).iloc[0]
    assert shard["basis"] == "calibrated on h34b60"
    # the shard's 4.5 ms as measured, against 4 + 6/3 = 6 ms from the split law (contention
    # and the all-reduce scale both alike)
    assert shard["ms"] < split["ms"] * 0.9
    assert missing(s, ctx.pool, [three], 3) == []


# --- verification ---------------------------------------------------------------------------
def _chosen(n: int) -> pd.DataFrame:
    cfgs = [RunConfig(workload="mlp", batch=10 + i) for i in range(n)]
    return pd.DataFrame(
        {
            "role": ["chosen"] + ["top"] * (n - 1),
            "candidate": [f"{label(c)} {i}" for i, c in enumerate(cfgs)],
            "throughput": [100.0] * n,
            "cfg": cfgs,
        }
    )


def test_regret_is_paired_within_rounds_and_order_rotates():
    true = {10: 100.0, 11: 110.0, 12: 50.0}  # candidate 11 beats the choice by 10%
    load = iter([1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 2.0, 2.0, 2.0])  # the host's load per round
    calls = []

    def run(cfg):
        calls.append(cfg.batch)
        return {"throughput": true[cfg.batch] * next(load)}

    v = verify(_chosen(3), 3, run)
    assert calls == [10, 11, 12, 11, 12, 10, 12, 10, 11]
    assert v.regret == pytest.approx(1 - 1 / 1.1)
    assert v.best.endswith(" 1")
    assert list(v.table["vs_chosen"]) == pytest.approx([1.0, 1.1, 0.5])
    # every prediction 100/s: absolute errors carry the load, ratios to the choice do not
    assert list(v.table["ratio_error_pct"]) == pytest.approx([0.0, -100 / 11, 100.0])
    assert list(v.table["measured"]) == pytest.approx([100.0, 110.0, 50.0])
    assert list(v.table["runs"]) == [3, 3, 3]


def test_failed_runs_are_listed_and_the_rest_still_scored():
    def run(cfg):
        return "exploded" if cfg.batch == 11 else {"throughput": float(cfg.batch)}

    v = verify(_chosen(3), 2, run)
    assert len(v.failures) == 2 and "exploded" in v.failures[0]
    assert v.table["runs"].tolist() == [2, 0, 2]
    assert math.isnan(v.table["measured"][1])
    assert v.regret == pytest.approx(1 - 10 / 12)


def test_picks_add_the_plain_configuration():
    s = spec(strategies=("mpi",))
    pool = Pool([_point(s, 1, 32, 0.32), _point(s, 1, 16, 0.3), _point(s, 2, 32, 0.1)])
    table = rank(Context(figures(), None, pool), s, cand.candidates(s))
    got = picks(table, 1, cand.plain(s))
    assert list(got["role"]) == ["chosen", "plain"]
    assert got["candidate"].iloc[1] == label(cand.plain(s))


def test_training_is_compared_at_its_steady_rate():
    # 100 steps of 512 items: 90 steady ones in 15.36 s after 31.2 s of warm-up (compiling)
    from scalelab.plan.calibrate import rate
    from scalelab.predict.points import _step_seconds

    steady = {"basis": "steps", "from_step": 11, "steps": 90, "items": 46080, "seconds": 15.36}
    rec = {"mode": "train", "steps": 100, "wall_s": 46.56, "throughput": 51200 / 46.56,
           "steady_throughput": 46080 / 15.36, "steady": steady}  # fmt: skip
    assert rate(rec) == pytest.approx(3000.0)
    assert _step_seconds(rec, 46.56 / 100) == pytest.approx(15.36 / 90)  # calibration's step
    whole = {**rec, "steady": {"basis": "whole run (too few steps to leave warm-up out)"}}
    assert _step_seconds(whole, 0.4656) == 0.4656
    assert rate({"mode": "infer", "throughput": 5.0, "steady_throughput": 9.0}) == 5.0


def test_calibration_keeps_the_median_run(tmp_path):
    from scalelab.plan.calibrate import measure_medians
    from scalelab.record import read_records

    speeds = {1: iter([5.0, 1.0, 3.0]), 2: iter(["boom", "boom", "boom"])}

    def run(cfg):
        got = next(speeds[cfg.batch])
        return got if isinstance(got, str) else {"schema": "scalelab.run/1", "throughput": got}

    cfgs = [RunConfig(workload="mlp", batch=1), RunConfig(workload="mlp", batch=2)]
    out = measure_medians(cfgs, tmp_path / "cal.jsonl", 3, run)
    median = {"schema": "scalelab.run/1", "throughput": 3.0}
    assert out == [median, "boom"]
    assert read_records(tmp_path / "cal.jsonl") == [median]


def test_bounds_rank_after_calibrated_predictions():
    s = spec(strategies=("mpi",))
    pool = Pool([_point(s, 1, 32, 100.0)])  # one slow calibrated family; the rest are bounds
    table = rank(Context(figures(), None, pool), s, cand.candidates(s))
    ok = table[table["status"] == OK]
    calibrated = ok["basis"].str.startswith("calibrated").tolist()
    assert calibrated[0] and not all(calibrated)
    assert calibrated == sorted(calibrated, reverse=True)  # every calibrated row first
    assert ok["throughput"].iloc[0] < ok["throughput"].iloc[-1]  # though slower than a bound


def test_a_missing_figure_names_a_command_that_pastes(tmp_path):
    """With the plan's own contention curve beside the ceilings, a missing figure's message
    still ends in a command a shell runs as printed (the curve's file named before it)."""
    import shlex

    from scalelab.errors import UsageError
    from scalelab.plan.calibrate import with_contention
    from scalelab.predict.figures import Figures

    (tmp_path / "curve.json").write_text(json.dumps({"processes": [1], "slowdown": [1.0]}))
    figures = with_contention(Figures({}, "c.json"), tmp_path / "curve.json")
    with pytest.raises(UsageError) as caught:
        figures.comm_fit("nccl", "allreduce")
    said, command = str(caught.value).split("; measure it: ")
    assert "(cpu_concurrency: " in said
    assert shlex.split(command)[-2:] == ["-o", "c.json"]


def test_calibrate_missing_names_the_comm_fits_the_ranking_lacks():
    """A candidate left out for a missing comm fit names its backend; --calibrate-missing
    measures each such backend once, into the ceilings file, keeping its other figures."""
    from scalelab.errors import UsageError
    from scalelab.plan.calibrate import comm_command, lacking_comm
    from scalelab.predict.figures import Figures

    with pytest.raises(UsageError) as caught:
        Figures({}, "c.json").comm_fit("nccl", "p2p")
    statuses = [str(caught.value), "ok", "c.json lacks comm.gloo.allreduce (alpha/beta), ..."]
    assert lacking_comm(statuses) == ["gloo", "nccl"]
    assert comm_command("nccl", "c.json")[-3:] == ["--comm-only", "-o", "c.json"]
