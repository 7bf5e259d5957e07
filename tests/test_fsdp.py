"""fsdp (torch's fully_shard) on real gloo ranks: an MLP, resnet18-cifar at 32x32 and a small
transformer (programs/fsdp_nets.py, run as a user's --model) train on 2 and 3 ranks, with and
without resharding after forward, and as HSDP 2x2 on 4 ranks, to the weights of one float64
process; a checkpoint taken on 2 ranks (rank 1 SIGKILLed mid-epoch) resumes on 3 ranks to what
one process resuming it trains; inference under fsdp passes the oracle's check; fsdp options
with another strategy are refused in one line.

The one-process reference (shares_reference) is independent of scalelab's strategies: the
model in float64, each step every rank's DistributedSampler share run in turn and its loss / W
back-propagated (so BatchNorm sees each rank's own batch, as on the ranks), then torch's SGD.
Three launches (2, 3, 4 ranks) carry every multi-rank check; across them each network runs with
and without resharding (the mlp both ways on 2 ranks), to keep CI's wall time down.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from programs.train_helpers import (
    PROGRAMS,
    launcher,
    oracle_weights,
    relerr,
    run,
)
from scalelab.config import RunConfig
from scalelab.record import read_records
from scalelab.run.runner import execute
from scalelab.train.data import epoch_sampler
from scalelab.workloads import WORKLOADS

# --- the runs ---------------------------------------------------------------------------------
BASE = dict(train=True, dtype="fp64", quiet=True, threads=1, heldout_size=8, seed=3)
MLP = dict(workload="mlp", hidden=16, train_size=48, batch=12, epochs=2, lr=0.5, l2=1e-3)
RESNET = dict(workload="resnet18-cifar", train_size=6, batch=6, epochs=1, lr=0.05,
              num_classes=10, heldout_size=2)  # fmt: skip
TRANSFORMER = dict(
    workload="model", model=f"{PROGRAMS / 'fsdp_nets.py'}:tiny_transformer", input_shape="8",
    input_dtype="int64", vocab=50, train_size=48, batch=12, epochs=2, lr=0.2, momentum=0.9,
)  # fmt: skip
# resnet18-cifar's 8 BasicBlocks hold 11,166,976 parameters (74 k to 4.7 M each): their mean
# in fp64 MB, 8 bytes each
RESNET_BLOCK_MB = 11_166_976 / 8 * 8 / 2**20
# Killed on 2 ranks before its 8th step (checkpoints every 3: the last at step 6, mid-epoch
# 2 of 4 steps), resumed on 3: the momentum buffers travel resharded.
KILLED = {**MLP, "epochs": 3, "momentum": 0.9, "ckpt_every": 3}


def fsdp(fields: dict, ranks: int, reshard: str = "on", replicate: int = 1) -> dict:
    """A run with one FSDP unit per block or layer (--fsdp-unit-mb 0): the units these tests
    count; "tr-grouped" runs the default grouping."""
    return {**BASE, **fields, "strategy": "fsdp", "ranks": ranks, "fsdp_unit_mb": 0.0,
            "reshard_after_forward": reshard, "dp_replicate": replicate}  # fmt: skip


def launch(tmp: Path, ranks: int, runs: dict, kill: tuple[int, int] | None = None):
    cmd = [*launcher("torchrun", ranks), str(PROGRAMS / "fsdp_runs.py"), str(tmp), json.dumps(runs)]
    proc = run([*cmd, *map(str, kill or ())], timeout=400)
    assert (proc.returncode != 0) == (kill is not None), proc.stderr[-3000:]
    recs = {Path(r["config"]["save_weights"]).stem: r for r in read_records(tmp / "runs.jsonl")}
    recs = {name: r for name, r in recs.items() if r["status"] == "ok"}
    return recs, {n: torch.load(tmp / f"{n}.pt") for n, r in recs.items() if r["mode"] == "train"}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    runs = {
        "mlp-on": fsdp(MLP, 2), "mlp-off": fsdp(MLP, 2, "off"),
        "tr-on": fsdp(TRANSFORMER, 2), "res-on": fsdp(RESNET, 2),
        # resnet18's 8 BasicBlocks joined 3 at a time (--fsdp-unit-mb 2.5 mean blocks, so
        # k = 3 by size): units that are lists of blocks, one gather each
        "res-grouped": {**fsdp(RESNET, 2), "fsdp_unit_mb": 2.5 * RESNET_BLOCK_MB},
        # the default unit size (200 MB) joins the transformer's two small blocks
        "tr-grouped": {k: v for k, v in fsdp(TRANSFORMER, 2).items() if k != "fsdp_unit_mb"},
        "infer": {"workload": "mlp", "hidden": 16, "strategy": "fsdp", "ranks": 2,
                  "dtype": "fp64", "batch": 7, "check": True, "quiet": True, "threads": 1},
        "killed": {**fsdp(KILLED, 2), "ckpt_dir": str(tmp / "ck")},
    }  # fmt: skip
    recs, weights = launch(tmp, 2, runs, kill=(8, 1))
    (ckpt,) = (tmp / "ck").glob("*.pt")
    kept = shutil.copy(ckpt, tmp / "taken-on-2.pt")  # the 3-rank resume rewrites ckpt
    return recs, weights, runs, Path(kept)


@pytest.fixture(scope="module")
def three(two, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp3")
    ckpt = two[3]
    runs = {
        "mlp-on": fsdp(MLP, 3), "tr-off": fsdp(TRANSFORMER, 3, "off"),
        "res-off": fsdp(RESNET, 3, "off"),
        "resumed": {**fsdp(KILLED, 3), "resume": str(ckpt), "ckpt_dir": str(tmp / "ck")},
    }  # fmt: skip
    recs, weights = launch(tmp, 3, runs)
    return recs, weights, runs, ckpt


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hsdp")
    runs = {"mlp-on": fsdp(MLP, 4, replicate=2), "tr-off": fsdp(TRANSFORMER, 4, "off", 2)}
    recs, weights = launch(tmp, 4, runs)
    return recs, weights, runs


# --- the one-process reference ------------------------------------------------------------------
def shares_reference(fields: dict, world: int) -> dict[str, torch.Tensor]:
    """Parameters after one float64 process runs every rank's share of each step in turn
    (loss / W each, gradients accumulated), then torch's SGD step."""
    cfg = RunConfig(**{k: v for k, v in fields.items() if k not in ("ranks",)})
    wl = WORKLOADS.get(cfg.workload)(cfg)
    model = wl.build_model().to(torch.float64).train()
    train, _ = wl.training_data()
    x = wl.prepare(train.x).to(torch.float64)
    opt = wl.optimizer(model)
    per_rank = cfg.batch // world
    for epoch in range(cfg.epochs):
        shares = []
        for r in range(world):
            sampler = epoch_sampler(len(train), world, r, cfg.seed)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
        for k in range(math.ceil(len(shares[0]) / per_rank)):
            for share in shares:
                idx = share[k * per_rank : (k + 1) * per_rank]
                (wl.loss(model, model(x[idx]), train.y[idx]) / world).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in model.named_parameters()}


def check_trained(recs: dict, weights: dict, runs: dict, world: int, names: list[str]) -> None:
    for name in names:
        rec, got = recs[name], weights[name]
        assert rec["status"] == "ok" and rec["ranks"] == world, name
        ref = shares_reference(runs[name], world)
        assert relerr({k: got[k] for k in ref}, ref) < 1e-10, name
        # every rank holds a shard, together the whole model (1/W each, up to dim-0 rounding)
        held = [m["params"] for m in rec["memory_per_rank"]]
        total = sum(p.numel() * 8 for p in ref.values())
        assert sum(held) == total and max(held) < total * (1 / world + 0.25), (name, held)
        assert (
            rec["fsdp_units"] > 1
            and rec["reshard_after_forward"] == runs[name]["reshard_after_forward"]
        )
        # SGD steps each rank's local shards (fsdp_step.py), to the same weights
        assert rec["fsdp"]["optimizer_step"] == "local shards", name


# --- the tests ----------------------------------------------------------------------------------
@pytest.mark.mpi
def test_two_ranks_train_what_one_process_trains(two):
    recs, weights, runs, _ = two
    names = ["mlp-on", "mlp-off", "tr-on", "tr-grouped", "res-on", "res-grouped"]
    check_trained(recs, weights, runs, 2, names)
    # the mlp also against the float64 NumPy SGD with hand-derived gradients (no torch)
    oracle = oracle_weights(RunConfig(**{**BASE, **MLP}))
    assert relerr(weights["mlp-off"], oracle) < 1e-10
    assert recs["res-on"]["fsdp_units"] == 9  # resnet18's 8 BasicBlocks, then the root
    grouped = recs["res-grouped"]["fsdp"]
    assert grouped["units"] == 4 and grouped["unit_kind"] == "3 blocks per unit"  # 3, 3, 2
    assert grouped["reshard_after_forward"] == [True] * 4  # "on": every unit and the root
    default = recs["tr-grouped"]["fsdp"]
    assert default["unit_mb"] == 200 and default["units"] == 2  # both blocks, then the root
    assert default["unit_kind"] == "2 blocks per unit" and recs["tr-on"]["fsdp"]["units"] == 3
    # 8 steps over fc1 and fc2: one reduce-scatter per unit and step either way; resharding
    # after forward gathers each unit again in backward (2 more all-gathers a step)
    on, off = recs["mlp-on"]["fsdp_comm"][1], recs["mlp-off"]["fsdp_comm"][1]
    assert on["reducescatter_calls"] == off["reducescatter_calls"] == 8 * 2
    assert on["allgather_calls"] - off["allgather_calls"] == 8 * 2
    assert on["allgather_s"] > 0 and on["reducescatter_bytes"] == off["reducescatter_bytes"]


@pytest.mark.mpi
def test_inference_under_fsdp_passes_the_oracle_check(two):
    rec = two[0]["infer"]
    assert rec["mode"] == "infer" and rec["check_passed"] and rec["relerr"] < 1e-12
    # the default unit size joins fc1 and fc2 (0.1 MB) into one unit, then the root
    assert rec["ranks"] == 2 and rec["fsdp"]["unit_kind"] == "2 blocks per unit"
    assert rec["fsdp_units"] == 2


@pytest.mark.mpi
def test_three_ranks_train_what_one_process_trains(three):
    recs, weights, runs, _ = three
    check_trained(recs, weights, runs, 3, ["mlp-on", "tr-off", "res-off"])


@pytest.mark.mpi
def test_checkpoint_from_two_ranks_resumes_on_three(two, three):
    """The 2-rank checkpoint (step 6, mid-epoch, momentum buffers) resumed on 3 fsdp ranks
    equals one float64 process (`local`) resuming the same file."""
    state = torch.load(two[3])
    assert state["world_size"] == 2 and state["position"]["steps"] == 6
    assert len(state["optimizer"]["state"]) == 4  # a momentum buffer per parameter, whole
    assert state["optimizer"]["state"][0]["momentum_buffer"].shape == (16, 784)
    recs, weights = three[0], three[1]
    assert recs["resumed"]["steps"] == 12 and recs["resumed"]["resumed_from"]
    out = two[3].parent / "local.pt"
    local = {**BASE, **KILLED, "strategy": "local", "resume": str(two[3]), "ckpt_every": None}
    execute(RunConfig(**local, save_weights=str(out)), None)
    assert relerr(weights["resumed"], torch.load(out)) < 1e-12


@pytest.mark.mpi
def test_hsdp_two_by_two_trains_what_one_process_trains(four):
    recs, weights, runs = four
    for name in runs:
        assert recs[name]["dp_replicate"] == 2 and recs[name]["dp_shard"] == 2
        ref = shares_reference(runs[name], 4)
        assert relerr({k: weights[name][k] for k in ref}, ref) < 1e-10, name


@pytest.mark.parametrize(
    "args, says",
    [
        (["--strategy", "ddp", "--train", "--dp-replicate", "2"], "--dp-replicate is a fsdp"),
        (["--reshard-after-forward", "off"], "the local strategy does not read it"),
        (["--strategy", "fsdp", "--reshard-after-forward", "maybe"], "--reshard-after-forward"),
        (["--strategy", "fsdp", "--ranks", "3", "--dp-replicate", "2"], "does not divide"),
    ],
)
def test_fsdp_options_elsewhere_are_refused_in_one_line(args, says, capsys):
    from scalelab.cli.main import main

    assert main(["run", "mlp", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_units_are_joined_by_gathered_size():
    """k consecutive units per FSDP unit, k the fewest whose mean gathered bytes reach the
    asked MB; 0: one unit each."""
    from torch import nn

    from scalelab.strategies.fsdp_units import group_units

    blocks = [nn.Linear(256, 256, bias=False) for _ in range(7)]  # 256 KiB each in fp32
    assert [len(g) for g in group_units(blocks, 0.0, 4)] == [1] * 7
    assert [len(g) for g in group_units(blocks, 0.25, 4)] == [1] * 7  # one block is enough
    assert [len(g) for g in group_units(blocks, 0.6, 4)] == [3, 3, 1]  # 0.6 / 0.25 -> 3
    assert [len(g) for g in group_units(blocks, 0.6, 2)] == [5, 2]  # bf16: half the bytes
    assert [len(g) for g in group_units(blocks, 1e6, 4)] == [7]  # never more than all
    joined = group_units(blocks, 0.6, 4)
    assert [b for g in joined for b in g] == blocks  # consecutive, in order, each once


@pytest.mark.mpi
def test_the_optimizer_on_local_shards_steps_as_on_the_dtensors():
    """Every optimizer fsdp steps on local shards (SGD with momentum, Nesterov and weight
    decay, Adam, AdamW, ...), stepped through LocalShardOptimizer on 2 real ranks (rows that
    do not split evenly), reaches torch's own step over the DTensors bit for bit, parameters
    and state, and leaves the state as DTensors keyed by the parameters (what
    torch.distributed.checkpoint reads)."""
    cmd = [*launcher("torchrun", 2), str(PROGRAMS / "fsdp_local_step.py")]
    proc = run(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from scalelab.strategies.fsdp_step import ELEMENTWISE

    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    got = {r["optimizer"]: r for r in map(json.loads, lines)}
    assert set(got) == {kind.__name__.lower() for kind in ELEMENTWISE}
    for r in got.values():
        assert r["params"] == 0.0 and r["state"] == 0.0 and r["moved"] > 1e-3, r
        assert "DTensor" in r["kinds"] and r["keys_dtensor"], r
    assert got["adam"]["kinds"] == ["DTensor", "Tensor"]  # the step count stays a scalar


# --- the models: memory per rank and the step's collectives (no ranks) ---------------------------
def test_memory_model_shards_state_and_counts_the_gathered_units():
    from scalelab.plan import memory

    cfg = RunConfig(workload="mlp", train=True, hidden=1024, batch=64, momentum=0.9,
                    fsdp_unit_mb=0.0)  # one unit per layer  # fmt: skip
    weights = 4 * (1024 * 784 + 1024 + 10 * 1024 + 10)  # fp32
    ddp = memory.breakdown(memory.as_strategy(cfg, "ddp", 4))
    fsdp = memory.breakdown(memory.as_strategy(cfg, "fsdp", 4))
    assert ddp["params"] == ddp["grads"] == ddp["optimizer"] == weights
    assert abs(fsdp["params"] - weights / 4) <= 1 and fsdp["optimizer"] == fsdp["params"]
    # resharding: fc1's weights twice at most (gathered + prefetched), never more than all
    assert fsdp["gathered"] == min(weights, 2 * 4 * (1024 * 784 + 1024))
    off = dataclasses.replace(memory.as_strategy(cfg, "fsdp", 4), reshard_after_forward="off")
    assert memory.breakdown(off)["gathered"] == weights
    hsdp = memory.as_strategy(cfg, "hsdp", 8)
    assert hsdp.dp_replicate == 2 and memory.breakdown(hsdp)["params"] == fsdp["params"]
    # ddp's buckets, as large as the gradients, on 2+ ranks only (one rank trains the module)
    assert ddp["buckets"] == weights and memory.breakdown(cfg)["buckets"] == 0
    assert memory.device_bytes(memory.as_strategy(cfg, "ddp", 4)) == sum(ddp.values())
    # fsdp's peak: the forward's end (gathered + activations, no gradients) or the
    # backward's (every gradient shard, two units gathered), whichever is larger. A stack of
    # 8 equal layers (fsdp_memory.py's model, small): resharded, the backward's end; not
    # resharded, the forward's end (all 8 layers gathered).
    deep = RunConfig(workload="deepstack", convs=1, fcs=8, image_size=32, train=True,
                     batch=8, momentum=0.9, strategy="fsdp", ranks=2, fsdp_unit_mb=0.0)  # fmt: skip
    parts = memory.breakdown(deep)
    shard, acts = parts["params"], parts["activations"]
    assert memory.device_bytes(deep) == 3 * shard + parts["gathered"]
    # units joined up to M MB (here one layer's): under M MB and one more layer each, two
    # of them gathered, fewer than all 8
    layer = parts["gathered"] // 2
    grouped = memory.breakdown(dataclasses.replace(deep, fsdp_unit_mb=layer / 2**20))
    not_resharded = dataclasses.replace(deep, reshard_after_forward="off")
    assert grouped["gathered"] == 4 * layer < memory.breakdown(not_resharded)["gathered"]
    whole = memory.breakdown(not_resharded)["gathered"]
    assert abs(whole - 2 * shard) <= 1 and whole > 2 * parts["gathered"]
    assert memory.device_bytes(not_resharded) == 2 * shard + whole + acts
    # the smallest rank count that fits: ddp never (its state is whole on every rank)
    limit = 1.2 * memory.device_bytes(memory.as_strategy(cfg, "fsdp", 8))
    assert memory.smallest_ranks(cfg, "fsdp", limit) == 8
    assert memory.smallest_ranks(cfg, "ddp", limit) is None


def test_fit_answers_the_fewest_ranks_per_strategy(capsys):
    from scalelab.cli.main import main

    argv = ["fit", "mlp", "--find", "ranks", "--hidden", "4096", "--batch", "64",
            "--momentum", "0.9", "--memory-per-device", "20MB"]  # fmt: skip
    assert main(argv) == 0
    lines = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines()[2:]}
    assert lines["ddp"][1] == "-" and lines["fsdp"][1] == "8" and lines["hsdp"][1] == "16"


def test_fsdp_step_model_overlaps_gathers_and_scatters():
    from scalelab.predict.models.fsdp import overlap

    units = [(1000, 10)] * 4
    comm = lambda p: p * 1e-3  # noqa: E731  1 s per unit each way
    free = overlap(units, 12.0, lambda p: 0.0, lambda p: 0.0, True)
    assert free["allgather"] == free["reducescatter"] == 0.0
    on, off = overlap(units, 12.0, comm, comm, True), overlap(units, 12.0, comm, comm, False)
    assert on["allgather_busy"] == 2 * off["allgather_busy"] == 8.0  # gathered again
    assert on["reducescatter_busy"] == off["reducescatter_busy"] == 4.0
    # compute (1 s forward, 2 s backward a unit) hides all but the first gather of each pass
    # and the last reduce-scatter
    assert (on["allgather"], on["reducescatter"]) == (2.0, 1.0)
    assert (off["allgather"], off["reducescatter"]) == (1.0, 1.0)
    tight = overlap(units, 0.1, comm, comm, True)
    # nothing to hide behind: one link, so nearly all of the 12 s of collectives is exposed
    exposed = tight["allgather"] + tight["reducescatter"]
    assert 11.5 < exposed <= tight["allgather_busy"] + tight["reducescatter_busy"]


def test_fsdp_host_cost_is_calibrated_on_a_one_rank_fsdp_run():
    """A one-rank fsdp run of the family and unit size (10 ms plain + 4 ms of FSDP's hooks and
    copies at 8 items) sets fsdp's host cost to the difference, added to every fsdp step; it
    never calibrates another strategy's compute, which stays on the plain run."""
    from scalelab.predict.calibration import CalPoint, Pool
    from scalelab.predict.figures import Figures
    from scalelab.predict.frame import predict_one
    from scalelab.predict.models import Context
    from scalelab.predict.scenario import Scenario

    ceilings = Path(__file__).parent / "fixtures" / "predict" / "ceilings_h200x2.json"
    figures = Figures(json.loads(ceilings.read_text()), "c.json")
    cfg = RunConfig(workload="mlp", train=True, device="cuda", batch=16, strategy="fsdp")
    fam = Scenario(cfg, 1, 1).family()
    plain = CalPoint(fam, "local", None, 8, 0.010, 0.0, "plain")
    one = dataclasses.replace(cfg, batch=8)  # the one-rank run's own config: its unit size
    sharded = CalPoint(fam, "fsdp", None, 8, 0.014, 0.0, "fsdp1", cfg=one)
    pool = Pool([plain, sharded])
    pred = predict_one(Context(figures, None, pool), Scenario(cfg, 2, 2))
    assert pred.phases["fsdp_host"] == pytest.approx(0.004)
    assert pred.calibration == {"plain": "compute", "fsdp1": "FSDP host cost"}
    assert not any("lower bound" in n for n in pred.notes)  # host 0.4x the 10 ms compute
    heavy = CalPoint(fam, "fsdp", None, 8, 0.030, 0.0, "fsdp1", cfg=one)  # host 2x the compute
    flagged = predict_one(Context(figures, None, Pool([plain, heavy])), Scenario(cfg, 2, 2))
    assert any("likely a lower bound" in n for n in flagged.notes), flagged.notes
    ddp = predict_one(
        Context(figures, None, pool), Scenario(dataclasses.replace(cfg, strategy="ddp"), 2, 2)
    )
    assert ddp.calibration.get("plain") == "compute" and "fsdp1" not in ddp.calibration
    # without the one-rank fsdp run: no host cost, and the prediction says it is a bound;
    # likewise with only a run of another unit size (its host work is another unit count's)
    alone = predict_one(Context(figures, None, Pool([plain])), Scenario(cfg, 2, 2))
    assert "fsdp_host" not in alone.phases and any("lower bound" in n for n in alone.notes)
    other = CalPoint(fam, "fsdp", None, 8, 0.014, 0.0, "fsdp1", cfg=dataclasses.replace(
        one, fsdp_unit_mb=0.0))  # fmt: skip
    blind = predict_one(Context(figures, None, Pool([plain, other])), Scenario(cfg, 2, 2))
    assert "fsdp_host" not in blind.phases and "fsdp1" not in blind.calibration


def test_bf16_compute_hands_the_model_its_token_ids_exactly():
    """Token ids travel as float32 (exact); FSDP's bf16 policy casts a root's float inputs,
    and bf16 holds integers exactly only below 256 (id 299 became 300, out of a vocabulary
    of 300). The ids the sharded model is handed are int64, among those the plain fp32 run's
    model is handed, and keep the odd ids above 256 that bf16 would have rounded away."""
    from programs import seen_ids

    base = dict(workload="model", model="programs.seen_ids:model", input_shape="16",
                input_dtype="int64", vocab=300, train=True, batch=8, train_size=32,
                heldout_size=8, epochs=1, quiet=True, threads=1)  # fmt: skip
    seen = {}
    for name, fields in (("local", {}), ("fsdp", {"ranks": 1, "dtype": "bf16"})):
        seen_ids.SEEN.clear()
        execute(RunConfig(**base, strategy=name, **fields), None)
        kept = [ids for cls, ids in seen_ids.SEEN if name == "local" or cls.startswith("FSDP")]
        assert kept and all(ids.dtype == torch.int64 for ids in kept), name
        seen[name] = set(torch.cat([ids.flatten() for ids in kept]).tolist())
    assert seen["fsdp"] <= seen["local"]
    assert any(i > 256 and i % 2 for i in seen["fsdp"])  # ids bf16 cannot hold got through
