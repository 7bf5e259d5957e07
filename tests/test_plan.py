"""`scalelab plan`'s candidates and memory filter: every split and core layout, the global
batch kept per strategy, one GPU's fast and compiled steps, torch-engine schedules and meshes,
a user's model (refused where its strategy refuses it, round-tripped through `run`'s command
line), each candidate's launcher, and the memory per rank against the cost table."""

from __future__ import annotations

import dataclasses

from plan_helpers import RESCNN, figures, spec
from scalelab.config import RunConfig
from scalelab.plan import candidates as cand
from scalelab.plan.memory import device_bytes
from scalelab.plan.rank import OK, label, rank
from scalelab.plan.space import PlanSpec
from scalelab.predict.calibration import Pool
from scalelab.predict.models import Context
from scalelab.predict.scenario import Scenario
from scalelab.workloads import WORKLOADS


# --- candidates ---------------------------------------------------------------------------
def test_inference_candidates_cover_every_split_and_core_layout():
    cfgs = cand.candidates(spec())
    labels = {label(c) for c in cfgs}
    assert {c.strategy for c in cfgs} == {"mpi", "pipeline", "tensor"}  # tensor: DTensor
    assert {c.engine for c in cfgs if c.strategy == "tensor"} == {"torch"}
    for split in ("batch", "spatial", "broadcast"):
        assert f"mpi --ranks 2 --split {split} --threads 1 --batch 32" in labels
    assert "mpi --ranks 1 --split batch --threads 2 --batch 32" in labels
    assert all(c.ranks * c.threads <= 2 for c in cfgs)  # never more busy threads than cores
    assert all(c.batch == 32 for c in cfgs)  # a global batch: the same work everywhere
    assert len(labels) == len(cfgs)


def test_training_candidates_keep_the_global_batch_per_strategy():
    cfgs = cand.candidates(spec("mlp", train=True, batch=100))
    assert {c.strategy for c in cfgs} == {"mpi-dp", "ddp", "fsdp", "pipeline", "tensor"}
    ddp = [c for c in cfgs if c.strategy == "ddp"]
    assert ddp and all(c.batch == 100 for c in cfgs)  # --batch: all ranks, every strategy
    assert cand.plain(spec("mlp", train=True)).strategy == "ddp"
    assert cand.plain(spec()).split == "batch" and cand.plain(spec()).ranks == 2
    labels = [label(c) for c in cfgs]  # one label a candidate: verify looks rows up by it
    assert len(set(labels)) == len(labels)
    fsdp = {x for x in labels if x.startswith("fsdp --ranks 2")}
    assert "fsdp --ranks 2 --threads 1 --batch 100 --reshard-after-forward off" in fsdp
    assert len(fsdp) == 2


def test_one_gpu_training_weighs_the_fast_and_compiled_steps():
    base = RunConfig(workload="resnet18", train=True, device="cuda")
    s = PlanSpec(base=base, ranks_max=1, per_node=1, global_batch=256, precisions=("fp32", "bf16"))
    labels = {label(c) for c in cand.candidates(s)}
    for p in ("", " --amp bf16"):  # ddp takes a lower precision as autocast
        for speed in ("", " --fast", " --compile"):
            assert f"ddp --ranks 1 --batch 256{p}{speed}" in labels
    assert not any("--bucket-mb" in x or "--grad-compress" in x for x in labels)  # one rank
    assert {"mpi-dp --ranks 1 --batch 256", "mpi-dp --ranks 1 --batch 256 --dtype bf16"} < labels
    # bf16 weights and bf16 autocast are calibrated apart (two families, not one "bf16")
    from scalelab.plan.calibrate import missing

    todo = {label(c) for c in missing(s, Pool(), cand.candidates(s), 1)}
    assert {"ddp --ranks 1 --batch 256 --dtype bf16", "ddp --ranks 1 --batch 256 --amp bf16"} < todo


def test_per_rank_batch_grows_with_the_ranks():
    s = PlanSpec(base=RunConfig(workload="mlp", train=True), ranks_max=2, per_node=2, cores=2,
                 per_rank_batch=10)  # fmt: skip
    for c in cand.candidates(s):
        assert Scenario(c, c.ranks, 2).global_batch == 10 * c.ranks


def test_a_new_source_plugs_in_by_name(monkeypatch):
    def mine(s: PlanSpec):
        yield s.config(strategy="mpi", ranks=1, threads=1, split="batch", batch=7)

    monkeypatch.setitem(cand.SOURCES._entries, "mine", mine)
    monkeypatch.setitem(cand.SOURCES._descriptions, "mine", "test")
    got = cand.candidates(spec(strategies=("mine",)))
    assert [c.batch for c in got] == [7]


def _mesh(c: RunConfig) -> str:
    return f"{c.dp}x{c.stages if c.strategy == 'pipeline' else c.tp}"


def test_torch_engine_sources_cover_schedules_and_meshes():
    s = PlanSpec(base=RunConfig(workload="mlp", train=True), ranks_max=4, per_node=4, cores=4,
                 global_batch=24, strategies=("pipeline-torch", "tensor-torch"))  # fmt: skip
    cfgs = cand.candidates(s)
    assert {c.engine for c in cfgs} == {"torch"}
    pipe = [c for c in cfgs if c.strategy == "pipeline"]
    assert {(c.schedule, c.virtual_stages) for c in pipe} == {
        ("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2), ("zbv", 1)
    }  # fmt: skip
    # ranks = dp x stages: 2 = 1x2; 3 = 1x3; 4 = 1x4 and 2 replicas of 2 stages
    assert {_mesh(c) for c in pipe} == {"1x2", "1x3", "1x4", "2x2"}
    assert all(c.ranks == c.dp * c.stages and c.batch % (c.dp * c.microbatches) == 0
               for c in pipe)  # fmt: skip
    tp = [c for c in cfgs if c.strategy == "tensor"]
    assert {_mesh(c) for c in tp} == {"1x2", "1x3", "1x4", "2x2"}
    assert all(c.ranks == c.dp * c.tp for c in tp)
    # inference: no pipeline-torch (it trains), DTensor still applies
    inference = cand.candidates(dataclasses.replace(s, base=RunConfig(workload="mlp")))
    assert {c.strategy for c in inference} == {"tensor"}


def test_torch_engine_candidates_are_predicted_or_say_why_not():
    s = PlanSpec(base=RunConfig(workload="mlp", train=True, hidden=64), ranks_max=4,
                 per_node=4, cores=4, global_batch=32,
                 strategies=("pipeline-torch", "tensor-torch"))  # fmt: skip
    table = rank(Context(figures(), None, Pool()), s, cand.candidates(s)).set_index("candidate")
    status = table["status"]
    # interleaved-1f1b replayed from torch's order: predicted where its 2 x S stages fit the
    # mlp's 5 layers, refused where they do not (4 x 2 = 8)
    interleaved = table[table.index.str.contains("interleaved-1f1b")]
    fits = interleaved.index.str.contains("--stages 2")
    assert fits.any() and (interleaved.loc[fits, "status"] == OK).all()
    assert interleaved.loc[~fits, "status"].str.contains("8 stages but the model has 5").all()
    ok = table[status == OK]
    assert any("--dp 2" in c and "--stages 2" in c for c in ok.index)  # dp2 x pp2 predicted
    assert any("--dp 2" in c and "--tp 2" in c for c in ok.index)  # dp2 x tp2 predicted
    # alexnet's heads under DTensor: runnable, but predict has no model of it
    a = spec(strategies=("tensor-torch",))
    got = rank(Context(figures(), None, Pool()), a, cand.candidates(a))
    assert got["status"].str.contains("tensor parallelism of the mlp only").all()


def test_torch_pipeline_candidates_get_one_rank_run_for_their_host_work():
    """torch pipelining's forward host work has no ceiling: --calibrate-missing adds one
    one-rank, one-stage GPipe torch-engine run per family (at the candidates' micro-batches),
    besides the plain one-rank runs; none once the pool holds such a run."""
    from scalelab.plan.calibrate import missing
    from scalelab.predict.calibration import CalPoint

    s = PlanSpec(base=RunConfig(workload="mlp", train=True, hidden=64), ranks_max=2,
                 per_node=2, cores=2, global_batch=32, strategies=("pipeline-torch",))  # fmt: skip
    todo = missing(s, Pool(), cand.candidates(s), 2)
    assert all(c.ranks == 1 for c in todo)
    host = [c for c in todo if c.strategy == "pipeline"]
    assert [(c.engine, c.schedule, c.stages, c.microbatches) for c in host] == [
        ("torch", "gpipe", 1, 8)
    ]
    fam = Scenario(host[0], 1, 2).family()
    run = CalPoint(fam, "pipeline", None, 32, 0.01, 0.0, "pp.jsonl:1", cfg=host[0],
                   forward_host_s=0.001)  # fmt: skip
    assert not [c for c in missing(s, Pool([run]), cand.candidates(s), 2)
                if c.strategy == "pipeline"]  # fmt: skip


def test_a_user_model_left_out_where_its_strategy_refuses_it_names_the_layer(tmp_path):
    (tmp_path / "skip.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc1 = nn.Linear(12, 16); self.fc2 = nn.Linear(16, 4)\n"
        "    def forward(self, x):\n"
        "        h = torch.relu(self.fc1(x)); return self.fc2(h) + h[:, :4]\n"
        "def m():\n    return M()\n"
    )  # fmt: skip
    base = RunConfig(workload="model", model=f"{tmp_path / 'skip.py'}:m", input_shape="12")
    s = PlanSpec(base=base, ranks_max=2, per_node=2, cores=2, global_batch=8)
    table = rank(Context(figures(), None, Pool()), s, cand.candidates(s))
    why = dict(zip(table["candidate"], table["status"]))
    spatial = why["mpi --ranks 2 --split spatial --threads 1"]
    assert spatial.startswith("does not apply: --split spatial needs a convolution trunk")
    assert "its local run stops at model, block" in spatial  # the forward is one block
    pipe = [v for k, v in why.items() if k.startswith("pipeline")]
    assert pipe and all("pipeline: cannot cut the model into stages" in v for v in pipe)
    assert why["mpi --ranks 2 --split batch --threads 1"] == OK
    from scalelab.plan.calibrate import missing

    todo = missing(s, Pool(), cand.candidates(s), 2)  # no one-rank spatial run for it
    assert todo and all(c.split == "batch" and c.ranks == 1 for c in todo)


def test_a_user_models_candidates_round_trip_through_the_run_command_line():
    from scalelab.cli.main import build_parser
    from scalelab.cli.options import config_from_args, workload_name
    from scalelab.orchestration.sweep import Point

    base = RunConfig(workload="model", model=RESCNN, model_arg=("width=4", "blocks=1"),
                     input_shape="3,16,16", train=True)  # fmt: skip
    s = PlanSpec(base=base, ranks_max=2, per_node=2, cores=2, global_batch=4)
    cfgs = cand.candidates(s)
    assert {c.strategy for c in cfgs} >= {"mpi-dp", "ddp", "pipeline", "tensor"}
    for cfg in cfgs:
        args = build_parser().parse_args(Point(0, {}, cfg).argv())
        assert config_from_args(args, workload=workload_name(args)) == cfg, label(cfg)


def test_each_candidate_is_measured_under_its_own_launcher(tmp_path):
    from scalelab.orchestration.sweep import Point, command

    s = PlanSpec(base=RunConfig(workload="mlp", train=True), ranks_max=2, per_node=2, cores=2,
                 global_batch=8, strategies=("tensor", "tensor-torch"))  # fmt: skip
    launched = {c.engine: command(Point(0, {}, c), tmp_path / "r.jsonl")[0]
                for c in cand.candidates(s) if c.ranks == 2}  # fmt: skip
    assert "torch.distributed.run" in launched["torch"]  # DTensor: torchrun, as `run` does
    assert "torch.distributed.run" not in launched["scalelab"]  # the MPI split: mpiexec


# --- memory ---------------------------------------------------------------------------------
def test_memory_per_rank_matches_the_cost_table():
    cfg = RunConfig(workload="alexnet", image_size=67, strategy="mpi", ranks=2, batch=32)
    rows = WORKLOADS.get("alexnet")(cfg).cost_table()
    weights = 4 * sum(r.params for r in rows)
    per_item = 4 * (rows[0].in_elems + sum(r.out_elems for r in rows))
    assert device_bytes(cfg) == weights + 16 * per_item  # batch split: 16 items per rank
    broadcast = RunConfig(**{**cfg.to_dict(), "split": "broadcast"})
    assert device_bytes(broadcast) == weights + 32 * per_item
    train = RunConfig(**{**cfg.to_dict(), "strategy": "pipeline", "train": True})
    assert device_bytes(train) == (2 * weights + 32 * per_item) // 2


def test_memory_filter_drops_what_does_not_fit():
    s = spec(memory_per_device=30 * 2**20)
    table = rank(Context(figures(), None, Pool()), s, cand.candidates(s))
    out = table[table["status"].str.startswith("does not fit")]
    assert len(out) and (out["mem_MiB"] > 30).all()
    assert (table.loc[table["status"] == OK, "mem_MiB"] <= 30).all()
