"""predict and plan for models of repeated blocks (transformers written as a user would:
examples/models/gpt.py, and tests/programs/transformer_nets.py's nn.TransformerEncoder with a
root position table and llama-style q/k/v + SwiGLU): pipeline stages cut where the torch
engine cuts them, tensor parallelism by heads with the blocks' all-reduces, memory per rank,
and `plan --model ... --ranks-max 4` ranking pipeline, tensor and data-parallel candidates.
No rank is launched: predictions from the ceilings fixture (tests/plan_helpers.py: figures()).
"""

import dataclasses
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from plan_helpers import figures
from scalelab.config import RunConfig
from scalelab.layout.partition import balance_auto, memory_model, snap_counts
from scalelab.predict.calibration import Pool
from scalelab.predict.compute_model import roofline_layers
from scalelab.predict.frame import predict_one
from scalelab.predict.models import Context
from scalelab.predict.scenario import Scenario
from scalelab.workloads import WORKLOADS

ROOT = Path(__file__).resolve().parents[1]
NETS = ROOT / "tests" / "programs" / "transformer_nets.py"
B, T, C, D = 8, 6, 16, 3  # batch, sequence, width, blocks of the GPT below
GPT = {"model": f"{ROOT / 'examples/models/gpt.py'}:gpt", "input_shape": str(T),
       "input_dtype": "int64", "vocab": 24,
       "model_arg": ("vocab=24", f"seq={T}", f"width={C}", "heads=4", f"depth={D}")}  # fmt: skip
MODELS = {
    "gpt": (GPT, "blocks.0.attn has heads=4"),
    "encoder": ({"model": f"{NETS}:encoder", "input_shape": "5,6"},
                "body.layers.0.self_attn has num_heads=4"),
    "llama": ({"model": f"{NETS}:llama", "input_shape": "6", "input_dtype": "int64",
               "vocab": 40}, "layers.0.attention has n_heads=4"),
}  # fmt: skip


def _ctx() -> Context:
    return Context(figures(), None, Pool())


def _scenario(ranks: int, **kw) -> Scenario:
    cfg = RunConfig(workload="model", **GPT, dtype="fp64", batch=B, ranks=ranks, **kw)
    return Scenario(cfg, ranks, 4)


def _rows(s: Scenario):
    """(cost rows, roofline seconds of each at the step's batch) of the one-rank model."""
    rows = WORKLOADS.get("model")(s.cfg).cost_table()
    return rows, [t for _, t in roofline_layers(s, _ctx().figures, s.cfg.batch)]


@pytest.mark.parametrize("train", [False, True])
def test_tensor_by_heads_divides_the_blocks_and_all_reduces_their_activations(train):
    s = _scenario(2, strategy="tensor", engine="torch", tp=2, train=train)
    ctx = _ctx()
    pred = predict_one(ctx, s)
    assert pred.feasible is None and all(math.isfinite(v) for v in pred.phases.values())
    rows, seconds = _rows(s)
    blocks = sum(t for r, t in zip(rows, seconds) if r.kind == "block")
    assert [r.name for r in rows if r.kind == "block"] == [f"blocks.{i}" for i in range(D)]
    rest = sum(seconds) - blocks  # embedding, position table, final norm, head: replicated
    assert rest > 0 and blocks > 10 * rest
    slowdown = ctx.compute(s).contention  # two ranks share the host (the fixture's curve)
    assert pred.phases["compute"] == pytest.approx(slowdown * (blocks / 2 + rest), rel=1e-9)
    # two all-reduces per block of its (B, T, C) fp64 activation forward, two more backward
    assert pred.extra["allreduce_bytes"] == (4 if train else 2) * D * B * T * C * 8
    assert pred.phases["allreduce"] > 0 and pred.comm_phases == {"allreduce"}
    # --dp 2 x --tp 2: each replica at half the batch; training adds the replicas' gradients
    mesh = predict_one(ctx, dataclasses.replace(_scenario(4, strategy="tensor", engine="torch",
                                                          tp=2, dp=2, train=train)))  # fmt: skip
    assert mesh.extra["allreduce_bytes"] == pred.extra["allreduce_bytes"] / 2
    assert ("dp_allreduce" in mesh.phases) == train


@pytest.mark.parametrize("train", [False, True])
def test_tensor_prediction_reads_a_declared_plan_that_shards_the_embedding_and_head(train):
    """Hugging Face's Llama declares its own plan: every block's projections and, in recent
    transformers, the token embedding (row-wise: partial sums all-reduced) and lm_head
    (column-wise: the logits gathered). predict reads the plan the ranks would run, so a row
    outside the blocks divides when the plan shards its module and adds its collectives;
    what the plan leaves whole (rotary table, final norm) runs whole. Which modules are
    sharded is read off the model's own declaration (as the ranks map it onto DTensor)."""
    pytest.importorskip("transformers")
    from fnmatch import fnmatch

    from scalelab.strategies.tensor_plans import declared

    zoo = f"{ROOT / 'tests' / 'programs' / 'zoo.py'}:hf_llama"
    cfg = RunConfig(workload="model", model=zoo, input_shape="16", input_dtype="int64",
                    vocab=40, dtype="fp64", batch=B, ranks=2, strategy="tensor",
                    engine="torch", tp=2, train=train)  # fmt: skip
    s, ctx = Scenario(cfg, 2, 4), _ctx()
    pred = predict_one(ctx, s)
    rows, seconds = _rows(s)
    patterns = declared.styles(declared.declared(WORKLOADS.get("model")(cfg).build_model()))
    assert any(fnmatch("model.model.layers.0.self_attn.q_proj", p) for p in patterns)
    outside = [r for r in rows if r.kind != "block" and any(fnmatch(r.name, p) for p in patterns)]
    split = {r.name for r in rows if r.kind == "block"} | {r.name for r in outside}
    divided = sum(t for r, t in zip(rows, seconds) if r.name in split)
    whole = sum(seconds) - divided
    assert whole > 0 and divided > 0
    slowdown = ctx.compute(s).contention
    assert pred.phases["compute"] == pytest.approx(slowdown * (divided / 2 + whole), rel=1e-9)
    expect = (4 if train else 2) * sum(r.out_elems for r in rows if r.kind == "block")
    expect += sum(r.out_elems + (r.in_elems if train else 0) for r in outside)
    assert pred.extra["allreduce_bytes"] == B * 8 * expect


def test_predict_command_takes_dtensor_inference_and_names_the_heads(cli, tmp_path):
    ceilings = tmp_path / "ceilings.json"
    ceilings.write_text(json.dumps(figures().data))
    model_args = [x for a in GPT["model_arg"] for x in ("--model-arg", a)]
    args = ["--model", GPT["model"], "--input-shape", str(T), "--input-dtype", "int64",
            "--vocab", "24", *model_args]  # fmt: skip
    code, out, err = cli("predict", *args, "--strategy", "tensor", "--engine", "torch",
                         "--ranks", "1,2,3", "--batch", str(B), "--dtype", "fp64",
                         "--ceilings", ceilings)  # fmt: skip
    assert code == 0, err
    assert "inference" in out.splitlines()[0]  # DTensor also infers: not forced to --train
    assert "not runnable: tensor: blocks.0.attn has heads=4, which 3 ranks" in out
    assert "2 all-reduces per block" in out and "DTensor host cost not calibrated" in out


def test_dtensor_host_cost_is_calibrated_on_one_measured_run_of_the_family():
    """DTensor's own work per sharded op has no ceiling: a measured 2-rank run of the family
    sets a cost per all-reduce, so its own prediction comes back to its measured step, and
    plan --calibrate-missing asks for that run when the pool has none."""
    from scalelab.plan import candidates as cand
    from scalelab.plan.calibrate import missing
    from scalelab.plan.space import PlanSpec
    from scalelab.predict.calibration import MultiPoint

    s = _scenario(2, strategy="tensor", engine="torch", tp=2)
    bare = predict_one(_ctx(), s)
    assert bare.phases["dtensor_host"] == 0 and "not calibrated" in " ".join(bare.notes)
    pool = Pool(multis=[MultiPoint(s, bare.seconds + 0.012, "tp.jsonl:0")])
    ctx = Context(figures(), None, pool)
    got = predict_one(ctx, s)
    assert got.seconds == pytest.approx(bare.seconds + 0.012, rel=1e-9)
    assert got.phases["dtensor_host"] == pytest.approx(0.012) and got.calibration == {
        "tp.jsonl:0": "DTensor host cost"}  # fmt: skip
    mesh = predict_one(ctx, _scenario(4, strategy="tensor", engine="torch", tp=2, dp=2))
    assert mesh.phases["dtensor_host"] == pytest.approx(0.012)  # 2 x 3 all-reduces a replica
    spec = PlanSpec(base=RunConfig(workload="model", **GPT, dtype="fp64"), ranks_max=2,
                    per_node=2, cores=2, global_batch=B, strategies=("tensor-torch",))  # fmt: skip
    (run,) = [c for c in missing(spec, Pool(), cand.candidates(spec), 2) if c.ranks > 1]
    assert (run.strategy, run.engine, run.ranks, run.tp, run.dp) == ("tensor", "torch", 2, 2, 1)
    have = Pool(multis=[MultiPoint(Scenario(run, 2, 2), 0.05, "tp.jsonl:1")])
    assert not [c for c in missing(spec, have, cand.candidates(spec), 2) if c.ranks > 1]


def test_dtensor_host_cost_is_calibrated_on_a_one_rank_tensor_run(cli, tmp_path):
    """The one-GPU calibration: a plain one-rank run and a one-rank `tensor --engine
    torch` run (DTensor over a one-device mesh: every sharded op still dispatches, each
    all-reduce over a group of one) of the same GPT at the same batch. The plain run stays
    the compute calibration; the tensor run's step beyond it, per all-reduce, is DTensor's
    host cost, which a 2-rank prediction then carries; a multi-rank run, when there is one,
    still wins."""
    from scalelab.predict.calibration import MultiPoint
    from scalelab.predict.points import discover

    results = tmp_path / "runs.jsonl"
    model_args = [x for a in GPT["model_arg"] for x in ("--model-arg", a)]
    args = ["--model", GPT["model"], "--input-shape", str(T), "--input-dtype", "int64",
            "--vocab", "24", *model_args, "--dtype", "fp64", "--batch", str(B), "--train",
            "--steps", "12", "--threads", "1", "--quiet", "--out", results]  # fmt: skip
    for how in (["--strategy", "local"], ["--strategy", "tensor", "--engine", "torch"]):
        code, _, err = cli("run", *args, *how, "--ranks", "1")
        assert code == 0, err
    found = discover(results)
    pool = found.pool(results)
    plain, tensor = pool.singles  # runs.jsonl:1, runs.jsonl:2
    assert (plain.strategy, tensor.cfg.engine, tensor.bare) == ("local", "torch", False)
    ctx = Context(figures(), None, pool)
    one = predict_one(ctx, Scenario(tensor.cfg, 1, 2))
    # the one-rank tensor step comes back: the plain step plus DTensor's measured excess
    assert one.seconds == pytest.approx(tensor.compute_s, rel=0.03)
    assert one.phases["dtensor_host"] == pytest.approx(tensor.compute_s - plain.compute_s)
    two = predict_one(ctx, Scenario(dataclasses.replace(tensor.cfg, ranks=2, tp=2), 2, 2))
    sources = {plain.source: "compute", tensor.source: "DTensor host cost"}
    assert two.calibration == sources and two.phases["dtensor_host"] > 0
    assert two.phases["dtensor_host"] == pytest.approx(one.phases["dtensor_host"])  # 12 each
    assert any("one-rank run runs.jsonl:2" in n and "lower bound" in n for n in two.notes)
    assert not any("lower bound" in n for n in one.notes)  # one rank: its own configuration
    # alone, the tensor run calibrates the compute and nothing is left for DTensor's cost
    alone = predict_one(Context(figures(), None, Pool([tensor])), two.scenario)
    assert alone.phases["dtensor_host"] == 0 and alone.calibration == {tensor.source: "compute"}
    # a measured 2-rank run of the family wins over the one-rank run
    pool.multis.append(MultiPoint(two.scenario, two.seconds + 0.012, "tp.jsonl:0"))
    multi = predict_one(ctx, two.scenario)
    assert multi.calibration == {plain.source: "compute", "tp.jsonl:0": "DTensor host cost"}
    assert multi.seconds == pytest.approx(two.seconds + 0.012, rel=1e-9)
    # plan --calibrate-missing: the tensor run does not stand for the plain one-rank run (and
    # a block model's is the plain run, not the hand-written split, which splits the mlp
    # only); the 2-rank DTensor run is still asked for (it sees the real collectives)
    from scalelab.plan import candidates as cand
    from scalelab.plan.calibrate import missing
    from scalelab.plan.space import PlanSpec

    spec = PlanSpec(base=RunConfig(workload="model", **GPT, dtype="fp64", train=True),
                    ranks_max=2, per_node=2, cores=2, global_batch=B, precisions=("fp64",),
                    strategies=("tensor-torch",))  # fmt: skip

    def asked(pool: Pool) -> set[tuple]:
        return {
            (c.strategy, c.engine, c.ranks) for c in missing(spec, pool, cand.candidates(spec), 2)
        }

    dtensor = ("tensor", "torch", 2)
    assert asked(Pool([tensor])) == {("mpi-dp", "scalelab", 1), dtensor}
    assert asked(Pool([plain, tensor])) == {dtensor}


def test_pipeline_cuts_where_the_torch_engine_does_and_sends_a_blocks_activation():
    from scalelab.strategies.pipeline.torch_trace import flop_profile

    s = _scenario(2, strategy="pipeline", engine="torch", stages=2, microbatches=2, train=True)
    pred = predict_one(_ctx(), s)
    assert pred.feasible is None and all(math.isfinite(v) for v in pred.phases.values())
    # the torch engine's --balance auto: its FLOP profile balanced, then snapped to modules
    wl = WORKLOADS.get("model")(s.cfg)
    profile = flop_profile(wl.cost_table(), B // 2, True, 8)
    engine = snap_counts(balance_auto(profile, 2, memory_model(None, 2, 2, True, "gpipe")),
                         wl.layers(wl.meta_model()), wl.blocks.cut_points)  # fmt: skip
    (note,) = [n for n in pred.notes if n.startswith("pipeline stages:")]
    assert note.startswith(f"pipeline stages: {engine} layers")
    # the slowest stage computes at least half of the step's work, M micro-batches of it
    rows, _ = _rows(s)
    _, micro = _rows(dataclasses.replace(s, cfg=dataclasses.replace(s.cfg, batch=B // 2)))
    slowdown = _ctx().compute(s).contention
    starts = [0, engine[0], len(rows)]
    stage = [slowdown * sum(micro[a:b]) for a, b in zip(starts, starts[1:])]
    assert pred.phases["compute"] == pytest.approx(2 * max(stage), rel=1e-9)
    assert pred.phases["compute"] >= sum(stage) * (1 - 1e-9)  # 2 x max >= the sum of two
    # what crosses the cut: one micro-batch's block input, (B/2, T, C) in fp64
    assert pred.extra["cut_bytes"] == B // 2 * T * C * 8
    assert pred.phases["bubble"] > 0 and pred.phases["p2p"] > 0
    hand = predict_one(_ctx(), _scenario(2, strategy="pipeline", stages=2, microbatches=2))
    assert hand.feasible.endswith("cut it with --engine torch (torch's tracer)")
    deep = predict_one(_ctx(), _scenario(8, strategy="pipeline", engine="torch", stages=8))
    assert deep.feasible.startswith("pipeline: cannot cut the model into 8 stages at module")


def test_memory_per_rank_follows_the_split():
    from scalelab.plan.memory import breakdown

    base = dict(workload="model", **GPT, dtype="fp64", batch=B, train=True)
    rows = WORKLOADS.get("model")(RunConfig(**base)).cost_table()
    whole = sum(r.params for r in rows)
    blocks = sum(r.params for r in rows if r.kind == "block")
    tp = breakdown(RunConfig(**base, strategy="tensor", engine="torch", ranks=2, tp=2))
    assert tp["params"] == tp["grads"] == 8 * (blocks // 2 + whole - blocks)
    pp = breakdown(RunConfig(**base, strategy="pipeline", engine="torch", ranks=2, stages=2))
    assert 8 * whole / 2 <= pp["params"] < 8 * whole  # the fuller stage's parameters


def _plan(cli, tmp_path: Path, spec: dict) -> pd.DataFrame:
    ceilings = tmp_path / "ceilings.json"
    data = figures().data
    data["machine"] = {**data.get("machine", {}), "cpu_cores": 4}  # 4 ranks of 1 thread
    ceilings.write_text(json.dumps(data))
    args = ["--model", spec["model"], "--input-shape", spec["input_shape"]]
    if "vocab" in spec:
        args += ["--input-dtype", spec["input_dtype"], "--vocab", str(spec["vocab"])]
    for arg in spec.get("model_arg", ()):
        args += ["--model-arg", arg]
    out = tmp_path / "plan"
    code, stdout, err = cli("plan", *args, "--train", "--ranks-max", "4", "--batch", "8",
                            "--precisions", "fp64", "--ceilings", ceilings, "-o", out)  # fmt: skip
    assert code == 0, err
    return pd.read_csv(out / "plan.csv")


@pytest.mark.parametrize("name", list(MODELS))
def test_plan_ranks_pipeline_tensor_and_data_parallel_for_a_transformer(cli, tmp_path, name):
    spec, heads = MODELS[name]
    table = _plan(cli, tmp_path, spec)
    ok = table[table["status"] == "ok"]
    assert ok["ms"].gt(0).all() and ok["rank"].notna().all()
    for kind in ("pipeline --ranks", "tensor --ranks", "ddp --ranks", "mpi-dp --ranks"):
        assert ok["candidate"].str.startswith(kind).any(), kind
    pipe = ok[ok["candidate"].str.startswith("pipeline")]["candidate"]
    assert pipe.str.contains("--engine torch").all()  # only torch's tracer cuts these
    for flags in ("--stages 2", "--stages 4", "--schedule 1f1b", "--schedule interleaved-1f1b",
                  "--schedule zbv", "--dp 2"):  # fmt: skip
        assert pipe.str.contains(flags).any(), flags
    assert ok["candidate"].str.contains("--dp 2 --tp 2").any()
    mem = ok.set_index("candidate")["mem_MiB"]
    tp2 = mem[[c for c in mem.index if c.startswith("tensor --ranks 2 --threads 1")]].iloc[0]
    assert tp2 < mem["ddp --ranks 2 --threads 1 --dtype fp64"]
    out = table[table["status"] != "ok"]
    assert out["status"].map(lambda x: "\n" not in x).all()  # each refusal one line
    hand = out[out["candidate"].str.startswith("pipeline") & ~out["candidate"].str.contains(
        "--engine torch")]  # fmt: skip
    assert hand["status"].str.contains("cut it with --engine torch").all() and len(hand)
    # three ranks do not divide four heads: a row naming the attention module, not a number
    (tp3,) = out[out["candidate"].str.contains("--tp 3")]["status"]
    assert tp3 == f"does not apply: tensor: {heads}, which 3 ranks do not divide"
