"""predict's host costs calibrated on measured multi-rank runs: FSDP's under a process group
(a multi-rank fsdp run of the same sharding, else the one-rank fsdp run's), each anchor's
host cost taken against the compute its own results file calibrates, and what a GPU rank's
forward call costs beside the other ranks of its host (a multi-GPU batch-split run)."""

import json

import pytest

from predict_helpers import CEILINGS
from scalelab.config import RunConfig
from scalelab.predict.calibration import CalPoint, MultiPoint, Pool
from scalelab.predict.figures import Figures
from scalelab.predict.frame import predict_one
from scalelab.predict.models import Context
from scalelab.predict.models.ddp import DDPModel
from scalelab.predict.models.fsdp import FSDPModel
from scalelab.predict.scenario import Scenario

BASE = dict(workload="resnet18", device="cuda", train=True)


def _figures() -> Figures:
    return Figures(json.loads(CEILINGS.read_text()), "c.json")


def _fsdp(ranks: int, batch: int, reshard: str = "on") -> RunConfig:
    return RunConfig(strategy="fsdp", ranks=ranks, batch=batch, reshard_after_forward=reshard,
                     **BASE)  # fmt: skip


def test_fsdp_host_cost_on_several_ranks_comes_from_a_multi_rank_run_of_its_sharding():
    """A measured 2-rank fsdp run of the family with the same units and resharding sets the
    host cost of every multi-rank step (measured less the step without host work); one that
    reshards otherwise does where none does, scaled by the collectives each issues (per unit
    2 with the re-gather before backward off, 3 with it on); without either the one-rank fsdp
    run's cost stands."""
    from scalelab.predict.models.fsdp import collectives

    plain = RunConfig(strategy="ddp", batch=32, **BASE)
    fam = Scenario(plain, 1, 1).family()
    singles = [CalPoint(fam, "ddp", None, 32, 0.030, 0.0, "one.jsonl:1", cfg=plain),
               CalPoint(fam, "fsdp", None, 32, 0.050, 0.0, "one.jsonl:2",
                        cfg=_fsdp(1, 32))]  # fmt: skip
    four = Scenario(_fsdp(4, 128), 4, 4)
    ctx = Context(_figures(), None, Pool(singles))
    assert predict_one(ctx, four).phases["fsdp_host"] == pytest.approx(0.020)  # one rank's
    off = Scenario(_fsdp(2, 64, "off"), 2, 2)
    ctx = Context(_figures(), None, Pool(singles, [MultiPoint(off, 0.090, "two.jsonl:2")]))
    units = collectives(off) // 2
    assert collectives(four) == 3 * units and units > 1
    bare = FSDPModel().without_host(ctx, off).seconds
    assert predict_one(ctx, four).phases["fsdp_host"] == pytest.approx((0.090 - bare) * 1.5)
    two = Scenario(_fsdp(2, 64), 2, 2)
    anchors = [MultiPoint(off, 0.090, "two.jsonl:2"), MultiPoint(two, 0.110, "two.jsonl:1")]
    ctx = Context(_figures(), None, Pool(singles, anchors))
    bare = FSDPModel().without_host(ctx, two).seconds
    pred = predict_one(ctx, four)
    assert pred.phases["fsdp_host"] == pytest.approx(0.110 - bare)
    assert pred.calibration["two.jsonl:1"] == "FSDP host cost"
    assert predict_one(ctx, two).seconds == pytest.approx(0.110)


def test_a_host_cost_anchor_is_taken_against_its_own_files_compute():
    """A 2-GPU ddp run filed beside a one-GPU run of 30 ms calibrates DDP's host cost of a
    study whose own one-GPU run took 40 ms (a slower host): the cost is the anchor's step less
    the 30 ms step of its own file, not less the study's 40 ms."""
    one = RunConfig(strategy="ddp", batch=32, **BASE)
    fam = Scenario(one, 1, 1).family()
    singles = [CalPoint(fam, "ddp", None, 32, 0.030, 0.0, "anchor.jsonl:1", cfg=one),
               CalPoint(fam, "ddp", None, 32, 0.040, 0.0, "study.jsonl:1", cfg=one)]  # fmt: skip
    two = Scenario(RunConfig(strategy="ddp", ranks=2, batch=64, **BASE), 2, 2)
    pool = Pool(singles, [MultiPoint(two, 0.036, "anchor.jsonl:2")], prefer="study.jsonl")
    ctx = Context(_figures(), None, pool)
    exposed = DDPModel().without_host(ctx.of_run("anchor.jsonl:2"), two)
    assert exposed.phases["compute"] == pytest.approx(0.030)
    pred = predict_one(ctx, two)
    assert pred.phases["compute"] == pytest.approx(0.040)
    assert pred.phases["ddp_host"] == pytest.approx(0.036 - exposed.seconds)


def test_gpu_ranks_pay_per_forward_call_what_a_multi_gpu_split_run_shows():
    """A 2-GPU nccl run whose root computed its 32 images in 10 ms, where the one-GPU law
    gives 2 ms, shows 8 ms per forward call beside the other rank: an mpi-gpu rank of the
    family pays it once per call, 4 times under --overlap with 4 chunks (the share computed
    chunk by chunk); the run is named a calibration point."""
    alex = dict(workload="alexnet", device="cuda", batch=64)
    one = RunConfig(strategy="local", **alex)
    local = CalPoint(Scenario(one, 1, 1).family(), "local", None, 64, 0.004, 0.0, "v.jsonl:6")
    nccl = Scenario(RunConfig(strategy="nccl", ranks=2, **alex), 2, 2)
    run = MultiPoint(nccl, 0.012, "v.jsonl:9", compute_s=0.010)
    ctx = Context(_figures(), None, Pool([local], [run]))
    plain = Scenario(RunConfig(strategy="mpi-gpu", ranks=2, **alex), 2, 2)
    pred = predict_one(ctx, plain)
    assert pred.phases["beside"] == pytest.approx(0.008)
    assert pred.phases["compute"] == pytest.approx(0.002)
    assert pred.calibration["v.jsonl:9"] == "GPU ranks' compute"
    chunked = Scenario(RunConfig(strategy="mpi-gpu", ranks=2, overlap=True, chunks=4, **alex), 2, 2)
    assert predict_one(ctx, chunked).phases["beside"] == pytest.approx(4 * 0.008)
    alone = Context(_figures(), None, Pool([local]))
    assert predict_one(alone, plain).phases["beside"] == 0.0


def test_dtensor_forward_takes_the_longer_of_its_device_time_and_the_hosts_issue_time():
    """A 2-rank DTensor run whose forward took 25 ms a step: the host issues the same sharded
    ops at any rank count, so a 4-rank step's forward takes 25 ms where its device time is
    less (dtensor_host: the difference); a run that did not time its forward falls back to a
    cost per all-reduce."""
    from pathlib import Path

    gpt = {"model": f"{Path(__file__).resolve().parents[1] / 'examples/models/gpt.py'}:gpt",
           "input_shape": "6", "input_dtype": "int64", "vocab": 24,
           "model_arg": ("vocab=24", "seq=6", "width=16", "heads=4", "depth=3")}  # fmt: skip
    base = dict(workload="model", device="cuda", train=True, batch=8, **gpt)
    plain = RunConfig(strategy="local", **base)
    local = CalPoint(Scenario(plain, 1, 1).family(), "local", None, 8, 0.030, 0.0, "one.jsonl:1",
                     cfg=plain)  # fmt: skip
    tp = lambda n: Scenario(RunConfig(strategy="tensor", engine="torch", ranks=n, **base), n, n)  # noqa: E731
    timed = MultiPoint(tp(2), 0.040, "tp.jsonl:1", forward_s=0.025)
    pred = predict_one(Context(_figures(), None, Pool([local], [timed])), tp(4))
    device_fwd = (pred.phases.get("launch", 0.0) + pred.phases["compute"]) / 3
    assert 0 < device_fwd < 0.025
    assert pred.phases["dtensor_host"] == pytest.approx(0.025 - device_fwd)
    assert pred.calibration["tp.jsonl:1"] == "DTensor host cost"
    untimed = MultiPoint(tp(2), 0.040, "tp.jsonl:1")
    old = predict_one(Context(_figures(), None, Pool([local], [untimed])), tp(4))
    assert old.phases["dtensor_host"] != pytest.approx(pred.phases["dtensor_host"])
