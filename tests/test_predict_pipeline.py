"""predict for pipelines: the run's partition mapped onto the cost rows, GPipe against the
hand formula, data-parallel replicas of a pipeline, torch's multi-stage schedules replayed
from torch's own order, torch pipelining's forward host work, every stage holding a layer,
and the uncertainty band and extrapolation notes of a pipeline prediction."""

import json

import pytest

from predict_helpers import CEILINGS, COMMITTED, PLAN_CEILINGS
from scalelab.config import RunConfig
from scalelab.predict.figures import Figures
from scalelab.predict.scenario import Scenario
from scalelab.record import read_records


# --- pipeline: the run's partition, per-stage times, the simulated schedule --------------------
def _vgg(**kw):
    cfg = dict(workload="vgg16", strategy="pipeline", device="cuda", train=True, dtype="bf16",
               channels_last=True, batch=256, microbatches=8)  # fmt: skip
    return RunConfig(**{**cfg, **kw})


def test_pipeline_partition_maps_layers_to_cost_rows():
    from scalelab.predict.models.pipeline import row_stages

    s = Scenario(_vgg(), 2, 2)
    owner = row_stages(s, [16, 24])  # cast + features.0..14 | features.15.. + classifier
    assert owner == [0] * 15 + [1] * 21  # conv1_1 .. conv3_3 on stage 0; relu3_3 .. fc8 on 1
    alex = Scenario(RunConfig(workload="alexnet", strategy="pipeline", batch=8), 2, 2)
    assert row_stages(alex, [5, 17])[-1] == 1  # the softmax row no layer claims goes last


def test_pipeline_points_carry_the_runs_partition():
    from scalelab.predict.points import discover

    path = COMMITTED / "pipeline_vgg_h200x2_prefetch.jsonl"
    runs = [r for r in read_records(path) if isinstance(r.get("pipeline"), dict)]
    got = [p.scenario.balance for p in discover(path).points]
    assert got == [tuple(r["pipeline"]["balance"]) for r in runs] and len(got) == 2


def test_pipeline_two_gpipe_stages_against_the_hand_formula():
    """Two stages, t0 >= t1 per micro-batch (forward t/3, backward 2t/3), GPipe, M = 8: stage 0
    forwards back to back, stage 1's last forward ends at 8 f0 + f1, its backwards run
    while stage 0 waits for the first, so the step is 8 t0 + t1 (+ 2 sends on the path).
    t(m) from two one-GPU steps: 20 ms at 64, 68 ms at 256 -> 4 ms + 0.25 ms/item, t(32) = 12
    ms, split over the stages by the roofline shares at 32."""
    from scalelab.predict.calibration import CalPoint, Pool
    from scalelab.predict.compute_model import roofline_layers
    from scalelab.predict.frame import bound, predict_one
    from scalelab.predict.models import Context

    local = Scenario(_vgg(strategy="local"), 1, 1)
    pool = Pool([CalPoint(local.family(), "local", None, b, t, 0.0, f"b{b}")
                 for b, t in ((64, 0.020), (256, 0.068))])  # fmt: skip
    ctx = Context(Figures(json.loads(CEILINGS.read_text()), "c.json"), None, pool)
    s = Scenario(_vgg(), 2, 2, balance=(16, 24))
    roof = [t for _, t in roofline_layers(s, ctx.figures, 32)]
    t0 = 0.012 * sum(roof[:15]) / sum(roof)
    t1 = 0.012 - t0
    assert t0 > t1
    pred = predict_one(ctx, s)
    assert pred.phases["compute"] == pytest.approx(8 * t0)
    assert pred.phases["bubble"] == pytest.approx(t1)
    send = ctx.fabric(s, "nccl").p2p(32 * 802816 * 2, False)  # conv3_3's output, bf16
    assert pred.phases["p2p"] == pytest.approx(2 * send)
    assert "slowest stage: rank 0 of 2, cast..conv3_3" in bound(pred)[1]


def test_dp_replicas_of_a_pipeline_add_one_gradient_allreduce():
    """dp2 x pp2 on 4 GPUs: each replica is the 2-stage pipeline at half the batch, plus one
    all-reduce over the 2 replicas of a rank's share of the gradients (parameters / 2 stages,
    in the storage dtype); 3 ranks cannot hold 2 replicas."""
    from scalelab.predict.calibration import CalPoint, Pool
    from scalelab.predict.frame import predict_one
    from scalelab.predict.models import Context
    from scalelab.predict.models.base import param_layers, storage_bytes

    local = Scenario(_vgg(strategy="local"), 1, 1)
    pool = Pool([CalPoint(local.family(), "local", None, b, t, 0.0, f"b{b}")
                 for b, t in ((64, 0.020), (256, 0.068))])  # fmt: skip
    ctx = Context(Figures(json.loads(CEILINGS.read_text()), "c.json"), None, pool)
    one = predict_one(ctx, Scenario(_vgg(batch=128), 2, 2, balance=(16, 24)))
    two = Scenario(_vgg(dp=2, engine="torch", ranks=4), 4, 4, balance=(16, 24))
    pred = predict_one(ctx, two)
    grads = sum(p for _, p, _ in param_layers(two)) * storage_bytes(two) / 2
    assert pred.phases["dp_allreduce"] == pytest.approx(ctx.fabric(two, "nccl").allreduce(grads, 2))
    assert {k: v for k, v in pred.phases.items() if k != "dp_allreduce"} == pytest.approx(
        one.phases
    )
    assert pred.throughput == pytest.approx(256 / pred.seconds)
    bad = Scenario(_vgg(dp=2, engine="torch", ranks=3), 3, 3)
    assert "do not split into --dp 2" in predict_one(ctx, bad).feasible


def test_torchs_multi_stage_schedules_are_replayed_from_torchs_order():
    """VGG-16 over 2 ranks, 8 micro-batches, under torch's schedules on GPUs: the replay of
    torch's own lowered lists over the S x V stages. Interleaving V = 2 stages per rank keeps
    the work (compute within the cut's imbalance) and shrinks the bubble below 1F1B's, towards
    (K - 1) / V stage-times (measured 79.95 ms against 156.92 with the timing sync
    the engine had before, which held the ranks in lock-step; tests/test_torch_pipelining.py
    replays both); it pays a send at every one of the 2K - 1 cuts; the V-shaped zbv holds
    stages 0 and 3 on rank 0. GPipe and 1F1B (fused transfers) keep the prediction of
    scalelab's own schedule simulation, the same as the hand engine's."""
    from scalelab.errors import UsageError
    from scalelab.predict.calibration import CalPoint, Pool
    from scalelab.predict.frame import predict_one
    from scalelab.predict.models import Context

    local = Scenario(_vgg(strategy="local"), 1, 1)
    pool = Pool([CalPoint(local.family(), "local", None, b, t, 0.0, f"b{b}")
                 for b, t in ((64, 0.020), (256, 0.068))])  # fmt: skip
    ctx = Context(Figures(json.loads(CEILINGS.read_text()), "c.json"), None, pool)

    def pred(schedule: str, v: int = 1, engine: str = "torch"):
        cfg = _vgg(engine=engine, ranks=2, stages=2, schedule=schedule, virtual_stages=v)
        out = predict_one(ctx, Scenario(cfg, 2, 2))
        assert out.feasible is None and out.seconds == pytest.approx(sum(out.phases.values()))
        return out

    one, inter, zbv = pred("1f1b"), pred("interleaved-1f1b", 2), pred("zbv")
    assert inter.phases["compute"] == pytest.approx(one.phases["compute"], rel=0.1)
    assert inter.phases["bubble"] < 0.6 * one.phases["bubble"]  # (K - 1) / V, with imbalance
    assert inter.phases["p2p"] > one.phases["p2p"]
    for name in ("gpipe", "1f1b"):  # scalelab's own simulation of their fused transfers
        assert pred(name).phases == pytest.approx(pred(name, engine="scalelab").phases)
    assert "conv" in zbv.where["compute"] and "fc8" in zbv.where["compute"]  # 0 and 3: a V
    with pytest.raises(UsageError, match="one stage per rank"):
        predict_one(ctx, Scenario(_vgg(engine="torch", ranks=2, stages=2, virtual_stages=2), 2, 2))


def test_torch_pipelinings_forward_host_work_is_calibrated_on_a_one_rank_run():
    """The runtime's forward host work H per micro-batch, from a one-rank GPipe run of the
    family: one stage, M forwards issued back to back, each ending no sooner than the host
    issued it (M H), then the M backwards on the device: M (H + b), against M (f + b)
    without it; a run the model does not reproduce within 5% is said in a note; without
    such a run the note says the forwards are device-bound."""
    from scalelab.predict.calibration import CalPoint, Pool
    from scalelab.predict.frame import predict_one
    from scalelab.predict.models import Context
    from scalelab.predict.models.pipeline import NO_HOST, PipelineModel

    local = Scenario(_vgg(strategy="local"), 1, 1)
    singles = [CalPoint(local.family(), "local", None, b, t, 0.0, f"b{b}")
               for b, t in ((64, 0.020), (256, 0.068))]  # fmt: skip
    figures = Figures(json.loads(CEILINGS.read_text()), "c.json")
    bare = Context(figures, None, Pool(singles))
    one = _vgg(engine="torch", ranks=1, stages=1, schedule="gpipe", microbatches=8)
    lay = PipelineModel()._layout(bare, Scenario(one, 1, 1))
    f, m = lay.t_stage[0] / 3, 8
    host = 3 * f  # host-bound forwards

    def ctx_with(measured: float) -> Context:
        run = CalPoint(local.family(), "pipeline", None, one.batch, measured, 0.0, "pp.jsonl:1",
                       cfg=one, forward_host_s=host)  # fmt: skip
        return Context(figures, None, Pool([*singles, run]))

    expected = m * (host + 2 * f)
    pred = predict_one(ctx_with(expected), Scenario(one, 1, 1))
    assert pred.calibration["pp.jsonl:1"] == "pipelining host cost"
    assert pred.phases["host"] == pytest.approx(m * (host - f))
    assert any("pp.jsonl:1" in n and "forward host work" in n for n in pred.notes)
    assert not any("does not reproduce" in n for n in pred.notes)
    off = predict_one(ctx_with(1.5 * expected), Scenario(one, 1, 1))
    assert any("does not reproduce" in n and "pp.jsonl:1" in n for n in off.notes)
    # the one-rank pipelining run is not the bare step: the compute law ignores it
    assert predict_one(bare, Scenario(one, 1, 1)).phases["compute"] == pytest.approx(
        pred.phases["compute"]
    )
    two = _vgg(engine="torch", ranks=2, stages=2, schedule="1f1b", microbatches=8)
    assert NO_HOST in predict_one(bare, Scenario(two, 2, 2)).notes
    assert predict_one(ctx_with(expected), Scenario(two, 2, 2)).phases["host"] >= 0


def test_every_stage_of_a_cut_holds_a_layer():
    """The mlp's 5 layers in 4 stages (zbv: 2 per rank): the roofline cut puts the loss's
    rows, which no layer computes, in a stage of their own; the stage takes a layer from
    the one before it instead (no engine runs an empty stage)."""
    import re

    from scalelab.predict.calibration import Pool
    from scalelab.predict.frame import predict_one
    from scalelab.predict.models import Context

    cfg = RunConfig(workload="mlp", strategy="pipeline", engine="torch", schedule="zbv",
                    stages=2, ranks=2, train=True, batch=64)  # fmt: skip
    ctx = Context(Figures(json.loads(PLAN_CEILINGS.read_text()), "c.json"), None, Pool())
    pred = predict_one(ctx, Scenario(cfg, 2, 2))
    (note,) = [n for n in pred.notes if n.startswith("pipeline stages:")]
    counts = [int(c) for c in re.findall(r"\d+", note.split("layers")[0])]
    assert len(counts) == 4 and min(counts) >= 1 and sum(counts) == 5, note


def test_uncertainty_band_and_extrapolations(tmp_path):
    """A prediction's band is its family's held-out MAPE from bands.json; it names the ranks
    beyond the family's measured runs and a pipeline schedule none of them ran."""
    import pandas as pd

    from scalelab.predict.calibration import MultiPoint, Pool
    from scalelab.predict.uncertainty import band_note, extrapolations, write_bands

    fams = pd.DataFrame([{"family": "pipeline", "points": 5, "held_out": 4, "loo_mape_pct": 8.04,
                          "in_sample_mape_pct": 1.0, "worst_loo_pct": 12.0}])  # fmt: skip
    write_bands(fams, tmp_path / "bands.json")
    assert band_note("pipeline", str(tmp_path / "bands.json")).startswith("uncertainty: +-8% ")
    assert "never validated" in band_note("tensor", str(tmp_path / "bands.json"))
    ran = Scenario(_vgg(engine="torch", ranks=2, stages=2, schedule="gpipe"), 2, 2)
    pool = Pool(multis=[MultiPoint(ran, 0.05, "pp.jsonl:1")])
    want = Scenario(_vgg(engine="torch", ranks=2, stages=2, schedule="1f1b"), 2, 8)
    notes = extrapolations(pool, want, [2, 4])
    assert notes[0].startswith("extrapolates to 4 ranks") and "most" in notes[0]
    assert any("--schedule 1f1b" in n for n in notes)
    assert extrapolations(pool, ran, [2]) == []


def test_a_one_stage_pipeline_run_calibrates_at_its_micro_batch():
    """A one-rank pipeline step of 8 micro-batches is 8 forward-backward passes of 32 images:
    it calibrates t(32) at an eighth of its step, not t(256); one micro-batch stays whole."""
    from scalelab.predict.points import _cal_point

    eight = Scenario(_vgg(), 1, 1)
    point = _cal_point({}, eight, 0.0927, 1.0, "p.jsonl:2")
    assert (point.batch, point.compute_s) == (32, pytest.approx(0.0927 / 8))
    one = _cal_point({}, Scenario(_vgg(microbatches=1), 1, 1), 0.0709, 1.0, "p.jsonl:1")
    assert (one.batch, one.compute_s) == (256, 0.0709)
    torch_run = Scenario(_vgg(engine="torch"), 1, 1)
    assert _cal_point({}, torch_run, 0.3, 1.0, "t.jsonl:1").batch == 256
