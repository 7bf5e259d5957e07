"""Scaling, phases and convergence on checked-in records with hand-computed answers
(tests/fixtures/README.md)."""

from pathlib import Path

import pytest

from scalelab.analysis.convergence import convergence_frame, final_table
from scalelab.analysis.frame import per_iteration, records_frame
from scalelab.analysis.phases import phase_breakdown, rank_phase_table, self_times
from scalelab.analysis.scaling import detect_mode, scaling_phases, scaling_table
from scalelab.errors import UsageError
from scalelab.record import read_records

FIXTURES = Path(__file__).parent / "fixtures"


def _load(name):
    return read_records(FIXTURES / name)


def test_strong_scaling_efficiency():
    """T1 = 8 s, T2 = median(4.2, 4.6) = 4.4 s, T4 = 2.5 s at global batch 16."""
    recs = _load("scaling_strong.jsonl")
    assert detect_mode(recs) == "strong"
    t = scaling_table(recs).set_index("ranks")
    assert list(t.index) == [1, 2, 4]  # the failed 8-rank point is left out
    assert t.loc[2, "runs"] == 2 and t.loc[2, "seconds"] == pytest.approx(4.4)
    assert t["efficiency"].tolist() == pytest.approx([1.0, 8 / (2 * 4.4), 0.8])
    assert t["speedup"].tolist() == pytest.approx([1.0, 8 / 4.4, 3.2])
    assert t["throughput"].tolist() == pytest.approx([2.0, 16 / 4.4, 6.4])
    assert t["ideal_throughput"].tolist() == pytest.approx([2.0, 4.0, 8.0])
    assert set(t["mode"]) == {"strong"} and set(t["series"]) == {"global batch 16"}


def test_weak_scaling_efficiency_from_training_steps():
    """100 items per rank per step; per-step 0.05, 0.055, 0.0625 s -> E = 1, 0.909, 0.8."""
    recs = _load("scaling_weak.jsonl")
    assert per_iteration(recs[1]) == pytest.approx((200, 0.055))  # 2000 items / 10 steps
    assert detect_mode(recs) == "weak"
    t = scaling_table(recs).set_index("ranks")
    assert t["efficiency"].tolist() == pytest.approx([1.0, 0.05 / 0.055, 0.8])
    assert t["speedup"].tolist() == pytest.approx([1.0, 2 * 0.05 / 0.055, 3.2])
    assert t["throughput"].tolist() == pytest.approx([2000, 200 / 0.055, 6400])
    assert set(t["batch_per_rank"]) == {100}


def test_forced_mode_overrides_detection():
    """Forcing strong on a weak sweep splits it into one single-N series per global batch."""
    t = scaling_table(_load("scaling_weak.jsonl"), mode="strong")
    assert len(t) == 3 and t["efficiency"].tolist() == pytest.approx([1.0, 1.0, 1.0])
    with pytest.raises(UsageError, match="strong or weak"):
        scaling_table(_load("scaling_weak.jsonl"), mode="linear")


def test_families_are_separate_series():
    recs = _load("scaling_strong.jsonl") + _load("scaling_weak.jsonl")
    t = scaling_table(recs)
    assert t.groupby("family")["mode"].first().to_dict() == {
        "alexnet mpi fp32 cpu": "strong",
        "mlp mpi-dp fp32 cpu train": "weak",
    }


def test_self_times_subtract_children():
    got = self_times(
        {"compute": 10.0, "compute/fwd": 3.0, "compute/bwd": 5.0, "compute/bwd/ar": 2.0, "h2d": 1.0}
    )
    assert got == pytest.approx(
        {"compute": 2.0, "compute/fwd": 3.0, "compute/bwd": 3.0, "compute/bwd/ar": 2.0, "h2d": 1.0}
    )


def test_phase_breakdown_adds_up_to_iteration_time():
    """Self times per phase + 'other' = seconds per iteration, for each N."""
    recs = _load("scaling_weak.jsonl")
    bd = phase_breakdown(recs)
    per_run = bd.groupby("ranks")["seconds"].sum()
    assert per_run.tolist() == pytest.approx([0.05, 0.055, 0.0625])
    allreduce = bd[bd["phase"] == "compute/allreduce"].set_index("ranks")["seconds"]
    assert allreduce.tolist() == pytest.approx([0.018, 0.023, 0.0305])  # the phase that grew
    bars = scaling_phases(recs)
    assert set(bars["series"]) == {"batch/rank 100"}


def test_rank_phase_table_imbalance():
    rec = {
        "mode": "infer",
        "rank_phases": [{"compute": 1.0, "gather": 0.1}, {"compute": 3.0, "gather": 0.1}],
    }
    t = rank_phase_table(rec)
    assert t.loc["mean", "compute"] == 2.0 and t.loc["max", "compute"] == 3.0
    assert t.loc["imbalance", "compute"] == pytest.approx(1.5)
    assert t.loc["imbalance", "gather"] == pytest.approx(1.0)


def test_convergence_curves():
    curves = convergence_frame(_load("scaling_weak.jsonl"))
    assert len(curves) == 6 and curves["epoch"].tolist() == [1, 2] * 3
    assert curves["loss"].tolist() == [2.0, 1.0] * 3
    final = final_table(_load("scaling_weak.jsonl"))
    assert final["final_accuracy"].tolist() == [0.75] * 3
    assert final["run"].nunique() == 3  # names tell the runs apart (batch differs)


def test_records_frame_flattens_config():
    df = records_frame(_load("scaling_strong.jsonl"))
    assert len(df) == 5 and df["status"].tolist().count("failed") == 1
    assert df["cfg.image_size"].iloc[0] == 67 and df["iter_s"].iloc[0] == 8.0
