"""Transformers written as a user would (examples/models/gpt.py: fused qkv, GELU MLP, learned
positions; tests/programs/transformer_nets.py: torch's nn.TransformerEncoder with a position
table on the root module, and a llama-style net with separate q/k/v and a SwiGLU MLP), split
by pipeline stages (torch's tracer) and by attention heads (DTensor), on real ranks (gloo).

References: the same module in float64 on the CPU in eval mode (inference --check, relerr
<= 1e-12); one float64 process (training: the ranks' weights after 3 steps within 1e-10).
One torchrun launch per rank count runs every case of every model (tests/programs/user_runs.py).
"""

import json
from pathlib import Path

import pytest
import torch

from programs.train_helpers import PROGRAMS, launcher, model_flags, records_and_weights, relerr, run
from scalelab.config import RunConfig
from scalelab.run.runner import execute

ROOT = Path(__file__).resolve().parents[1]
NETS = PROGRAMS / "transformer_nets.py"
MODELS = {
    "gpt": {"model": f"{ROOT / 'examples/models/gpt.py'}:gpt", "input_shape": "6",
            "input_dtype": "int64", "vocab": 24,
            "model_arg": ["vocab=24", "seq=6", "width=16", "heads=4", "depth=3"]},
    "encoder": {"model": f"{NETS}:encoder", "input_shape": "5,6"},
    "llama": {"model": f"{NETS}:llama", "input_shape": "6", "input_dtype": "int64",
              "vocab": 40},
}  # fmt: skip
INFER = dict(workload="model", batch=8, iters=1, warmup=0, check=True, quiet=True, threads=1,
             dtype="fp64")  # fmt: skip
TRAIN = dict(workload="model", train=True, train_size=24, heldout_size=8, batch=8, epochs=1,
             lr=0.2, dtype="fp64", quiet=True, threads=1)  # fmt: skip
PIPE = dict(strategy="pipeline", engine="torch", microbatches=2, rebalance=0)
TENSOR = dict(strategy="tensor", engine="torch")
SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved-1f1b": {"virtual_stages": 2}}
MESHES = {"dpxpp": {**PIPE, "dp": 2, "stages": 2, "schedule": "1f1b"},
          "dpxtp": {**TENSOR, "dp": 2, "tp": 2}}  # fmt: skip


def _launch(ranks: int, runs: dict, out: Path) -> tuple[dict, dict]:
    cmd = [*launcher("torchrun", ranks), str(PROGRAMS / "user_runs.py"), str(out),
           json.dumps(runs)]  # fmt: skip
    proc = run(cmd, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records_and_weights(out)


# The example GPT trains under every schedule; the other two under one each (CI time).
TRAINED = {"gpt": [*SCHEDULES, "tensor"], "encoder": ["interleaved-1f1b", "tensor"],
           "llama": ["1f1b", "tensor"]}  # fmt: skip
MESH_TRAINED = {"gpt": list(MESHES), "encoder": ["dpxtp"], "llama": ["dpxpp"]}


def _two_rank_runs() -> dict:
    """Per model: inference under 2 stages and 2 tensor ranks; training under schedules
    and 2 tensor ranks (TRAINED)."""
    runs = {}
    for name, spec in MODELS.items():
        runs[f"{name}-pipe"] = {**INFER, **spec, **PIPE, "ranks": 2, "stages": 2}
        runs[f"{name}-tensor"] = {**INFER, **spec, **TENSOR, "ranks": 2}
        for how in TRAINED[name]:
            fields = (
                {**TENSOR}
                if how == "tensor"
                else {**PIPE, "stages": 2, "schedule": how, **SCHEDULES[how]}
            )
            runs[f"{name}-train-{how}"] = {**TRAIN, **spec, **fields, "ranks": 2}
    return runs


def _four_rank_runs() -> dict:
    """Per model: inference on the (dp 2, pp 2) and (dp 2, tp 2) meshes; training on them
    (MESH_TRAINED)."""
    runs = {}
    for name, spec in MODELS.items():
        for mesh, fields in MESHES.items():
            runs[f"{name}-{mesh}"] = {**INFER, **spec, **fields, "ranks": 4}
        for mesh in MESH_TRAINED[name]:
            runs[f"{name}-train-{mesh}"] = {**TRAIN, **spec, **MESHES[mesh], "ranks": 4}
    return runs


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Each model trained 3 steps by one fp64 process: its weights by model name."""
    out, weights = tmp_path_factory.mktemp("one"), {}
    for name, spec in MODELS.items():
        path = out / f"{name}.pt"
        execute(RunConfig(**TRAIN, **spec, save_weights=str(path)), None)
        weights[name] = torch.load(path)
    return weights


def _check_runs(recs: dict, weights: dict, one_process: dict, infer: list, train: dict) -> None:
    for name in MODELS:
        for how in infer:
            rec = recs[f"{name}-{how}"]
            assert rec["check_passed"] and rec["relerr"] <= 1e-12, (name, how, rec["relerr"])
        for how in train[name]:
            key = f"{name}-train-{how}"
            assert relerr(weights[key], one_process[name]) < 1e-10, key
            assert relerr(weights[key], _initial(name)) > 1e-3, key  # it trained


@pytest.mark.mpi
def test_two_ranks_split_by_stages_and_heads_like_one_process(tmp_path, one_process):
    """2 pipeline stages (torch's tracer, cut between blocks) and 2 tensor ranks (q/k/v and
    the MLP by heads): the module's fp64 output; 3 training steps under gpipe, 1f1b,
    interleaved-1f1b (the GPT all three) and tensor: one fp64 process's weights."""
    recs, weights = _launch(2, _two_rank_runs(), tmp_path)
    _check_runs(recs, weights, one_process, ["pipe", "tensor"], TRAINED)
    pipe = recs["gpt-train-interleaved-1f1b"]["pipeline"]
    assert pipe["virtual_stages"] == 2
    pairs = dict(map(tuple, recs["encoder-tensor"]["tensor"]["pairs"]))
    assert pairs["body.layers.0.self_attn.in_proj"] == "ColwiseParallel"
    assert pairs["body.layers.2.linear2"] == "RowwiseParallel"


@pytest.mark.mpi
def test_two_by_two_meshes_like_one_process(tmp_path, one_process):
    """4 ranks: (dp 2, pp 2) and (dp 2, tp 2), inference checked, training as one process."""
    recs, weights = _launch(4, _four_rank_runs(), tmp_path)
    _check_runs(recs, weights, one_process, list(MESHES), MESH_TRAINED)


def test_layers_lists_the_blocks(cli):
    code, out, err = cli("layers", *model_flags(MODELS["encoder"]))
    assert code == 0, err
    names = [line.split()[0] for line in out.splitlines()[1:-1]]
    assert names == ["embed", "pos", "body.layers.0", "body.layers.1", "body.layers.2",
                     "norm", "head"]  # fmt: skip
    block = next(line for line in out.splitlines() if line.startswith("body.layers.1"))
    assert block.split()[1] == "block" and float(block.split()[4]) > 0  # FLOPs counted


def test_repeated_blocks_finds_the_stack_not_the_pieces():
    from programs.transformer_nets import encoder, llama
    from scalelab.workloads.blocks import repeated_blocks

    assert repeated_blocks(encoder()) == ("body.layers", [f"body.layers.{i}" for i in range(3)])
    assert repeated_blocks(llama(depth=2))[1] == ["layers.0", "layers.1"]
    assert repeated_blocks(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize(
    "model, args, needle",
    [
        ("gpt", ["--strategy", "pipeline", "--stages", "2"], "cut it with --engine torch"),
        (
            "gpt",
            ["--strategy", "pipeline", "--engine", "torch", "--cut", "blocks.1,ln_f"],
            "2 stages need 1 module names",
        ),
    ],
)
def test_splits_that_cannot_apply_say_why(cli, model, args, needle):
    code, out, err = cli("run", *model_flags(MODELS[model]), *args, "--no-record")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert needle in err


def test_a_head_count_the_ranks_do_not_divide_is_refused_naming_the_module():
    from programs.transformer_nets import llama
    from scalelab.errors import UsageError
    from scalelab.strategies.tensor_plans import derived as tensor_plan

    with pytest.raises(UsageError, match="layers.0.attention has n_heads=4, which 3"):
        tensor_plan.derive_plan(llama(width=24), 3)


def test_fused_qkv_rows_go_back_to_the_users_order():
    from scalelab.strategies.tensor_plans import derived as tensor_plan

    order = tensor_plan.qkv_order(4, 2)  # q, k, v of width 4 over 2 ranks
    assert order.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]


def _initial(name: str) -> dict:
    from scalelab.workloads import WORKLOADS

    wl = WORKLOADS.get("model")(RunConfig(**TRAIN, **MODELS[name]))
    return {k: v.double() for k, v in wl.build_model().state_dict().items()}


def test_cut_names_give_the_layers_per_stage():
    from scalelab.errors import UsageError
    from scalelab.layout.partition import cut_counts, given_counts

    paths = ["tok", None, "blocks.0", "blocks.1", "blocks.2", "ln_f", "head"]
    assert cut_counts("blocks.1, ln_f", paths, 3) == [3, 2, 2]
    assert given_counts("auto", None, paths, 2) is None
    for spec, needle in (
        ("blocks.9", "no layer is that module"),
        ("ln_f,blocks.1", "in forward order"),
        ("tok", "after the first"),
    ):
        with pytest.raises(UsageError, match=needle):
            cut_counts(spec, paths, len(spec.split(",")) + 1)
    with pytest.raises(UsageError, match="give one"):
        given_counts("3,4", "blocks.1", paths, 2)


def test_weights_leave_a_head_split_in_the_users_names_and_order():
    """nn.MultiheadAttention swapped and its packed rows reordered by heads inside the run;
    what leaves the run is the user's model's state, and goes back in exactly."""
    import copy

    from programs.transformer_nets import encoder
    from scalelab.strategies.tensor_plans import derived as tensor_plan

    ref = encoder()
    model = copy.deepcopy(ref)
    plan = tensor_plan.derive_plan(model, 2)
    tensor_plan.reorder_fused(model, plan, 2)
    assert model.body.layers[0].self_attn.num_heads == 2  # 4 heads, 2 per rank
    user = tensor_plan.to_user(model.state_dict(), plan, 2)
    assert list(user) == list(ref.state_dict())
    assert all(torch.equal(user[k], v) for k, v in ref.state_dict().items())
    back = tensor_plan.from_user(ref.state_dict(), plan, 2)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
