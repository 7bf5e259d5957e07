"""What predict's calibration reads off a record: the dtype the run computed in."""

from scalelab.config import RunConfig
from scalelab.predict.points import computed_in
from scalelab.predict.scenario import Scenario


def _family(cfg: RunConfig):
    return Scenario(cfg, 1, per_node=1).family()


def test_serial_float64_step_does_not_calibrate_an_fp32_rank():
    # serial computes in float64 whatever --dtype asked; its record says so in `precision`
    asked = RunConfig(workload="alexnet", strategy="serial", device="cpu", dtype="fp32")
    ran = computed_in(asked, {"precision": "fp64"})
    assert ran.dtype == "fp64"
    mpi_rank = RunConfig(workload="alexnet", strategy="mpi", device="cpu", dtype="fp32")
    assert _family(ran) != _family(mpi_rank)
    assert _family(computed_in(mpi_rank, {"precision": "fp32"})) == _family(mpi_rank)


def test_amp_record_keeps_its_dtype_the_family_carries_amp():
    cfg = RunConfig(workload="resnet18", strategy="ddp", device="cuda", dtype="fp32", amp="bf16")
    assert computed_in(cfg, {"precision": "bf16"}) == cfg
    assert computed_in(cfg, {}) == cfg


def test_repeated_one_rank_runs_calibrate_at_their_median_not_the_first_by_name():
    # A host-bound one-GPU step varies run to run: three runs of one configuration at one
    # batch anchor the law at their median, and each is named a calibration point.
    from scalelab.predict.calibration import CalPoint, Pool, batch_law

    cfg = RunConfig(workload="resnet18", strategy="fsdp", device="cuda", batch=16, train=True)
    s = Scenario(cfg, 1, per_node=1)
    times = (("a.jsonl:1", 0.049), ("b.jsonl:1", 0.0293), ("c.jsonl:1", 0.0357))
    runs = [CalPoint(s.family(), "fsdp", None, 16, t, 0.0, src, cfg=cfg) for src, t in times]
    pool = Pool(runs)
    law = batch_law(pool, s)
    assert law.point.compute_s == 0.0357 and law.seconds(16) == 0.0357
    assert set(law.point.sources) == {"a.jsonl:1", "b.jsonl:1", "c.jsonl:1"}
    single = pool.fsdp_single(s)
    assert single.compute_s == 0.0357 and single.sources == law.point.sources


def test_the_anchor_batch_measured_in_another_file_beats_the_studys_runs_carried_there():
    # The study ran 4 and 16 items a step, another file of the machine ran 32: at 32 that
    # run calibrates, not the fixed + per-item law carried from 16.
    from scalelab.predict.calibration import CalPoint, Pool, batch_law

    cfg = RunConfig(workload="resnet18", strategy="ddp", device="cuda", batch=32, train=True)
    s = Scenario(cfg, 1, per_node=1)
    at = lambda src, b, t: CalPoint(s.family(), "ddp", None, b, t, 0.0, src, cfg=cfg)  # noqa: E731
    own = [at("study.jsonl:1", 4, 0.033), at("study.jsonl:2", 16, 0.114)]
    pool = Pool([*own, at("other.jsonl:1", 32, 0.207)], prefer="study.jsonl")
    law = batch_law(pool, s)
    assert law.point.source == "other.jsonl:1" and law.seconds(32) == 0.207
    assert batch_law(Pool(own, prefer="study.jsonl"), s).point.source == "study.jsonl:2"
