"""Tensor parallelism (`--strategy tensor --engine torch`) on the zoo's transformers as their
authors write them (tests/programs/zoo.py): nanoGPT tied and untied (fused c_attn split by
`n_embd`, `view(B, T, n_head, C // n_head)`), Hugging Face's LlamaForCausalLM (its declared
plan, grouped-query key/value heads) and GPT2LMHeadModel (Conv1D, tied head), torch's
TransformerEncoder, and blocks returning tuples.

References: the module itself in float64 (inference --check, relerr <= 1e-12); one float64
process trained the same two steps (weights within 1e-10, and moved from the initial ones).
One torchrun launch per rank count runs every case (tests/programs/user_runs.py): 2 tensor
ranks, and the (dp 2, tp 2) mesh on 4 ranks. Plans that cannot work are refused before any
rank starts, in one line (exit 2).
"""

import importlib.util
import json

import pytest
import torch

from programs.train_helpers import PROGRAMS, launcher, model_flags, records_and_weights, relerr, run
from scalelab.config import RunConfig
from scalelab.run.runner import execute

ZOO = PROGRAMS / "zoo.py"
IDS = {"input_shape": "8", "input_dtype": "int64", "vocab": 40}
MODELS = {
    "nanogpt": {"model": f"{ZOO}:nanogpt", **IDS},
    "nanogpt_untied": {"model": f"{ZOO}:nanogpt", **IDS, "model_arg": ["tied=False"]},
    "encoder": {"model": f"{PROGRAMS / 'transformer_nets.py'}:encoder", "input_shape": "5,6"},
    "tuple_blocks": {"model": f"{ZOO}:tuple_blocks", **IDS},
}
if importlib.util.find_spec("transformers") is not None:  # the `hf` extra
    MODELS["hf_llama"] = {"model": f"{ZOO}:hf_llama", **IDS}
    MODELS["hf_gpt2"] = {"model": f"{ZOO}:hf_gpt2", **IDS}
    # Qwen3 declares q_norm/k_norm "replicated_with_grad_allreduce" (a rank's gradient is its
    # heads' share); Phi-3 a fused qkv_proj "colwise_gather_output" (every head after it)
    MODELS["hf_qwen3"] = {"model": "hf:qwen3", **IDS}
    MODELS["hf_phi3"] = {"model": "hf:phi3", **IDS}
INFER = dict(workload="model", batch=4, iters=1, warmup=0, check=True, quiet=True, threads=1,
             dtype="fp64")  # fmt: skip
TRAIN = dict(workload="model", train=True, train_size=8, heldout_size=4, batch=4, epochs=1,
             lr=0.2, dtype="fp64", quiet=True, threads=1)  # fmt: skip
MESHES = {2: {"strategy": "tensor", "engine": "torch"},
          4: {"strategy": "tensor", "engine": "torch", "dp": 2, "tp": 2}}  # fmt: skip


def _runs(ranks: int) -> dict:
    fields = {**MESHES[ranks], "ranks": ranks}
    runs = {}
    for name, spec in MODELS.items():
        runs[f"{name}-infer"] = {**INFER, **spec, **fields}
        runs[f"{name}-train"] = {**TRAIN, **spec, **fields}
    return runs


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Each model trained two steps by one fp64 process, and its initial weights."""
    out, trained, initial = tmp_path_factory.mktemp("one"), {}, {}
    for name, spec in MODELS.items():
        path = out / f"{name}.pt"
        cfg = RunConfig(**TRAIN, **spec, save_weights=str(path))
        execute(cfg, None)
        trained[name] = torch.load(path)
        from scalelab.workloads import WORKLOADS

        model = WORKLOADS.get("model")(cfg).build_model()
        initial[name] = {k: v.double() for k, v in model.state_dict().items()}
    return trained, initial


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_zoo_under_tensor_parallel_equals_one_process(tmp_path, one_process, ranks):
    """2 tensor ranks, and dp 2 x tp 2: the module's fp64 output; two training steps: one
    fp64 process's weights."""
    cmd = [*launcher("torchrun", ranks), str(PROGRAMS / "user_runs.py"), str(tmp_path),
           json.dumps(_runs(ranks))]  # fmt: skip
    proc = run(cmd, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs, weights = records_and_weights(tmp_path)
    trained, initial = one_process
    for name in MODELS:
        rec = recs[f"{name}-infer"]
        assert rec["check_passed"] and rec["relerr"] <= 1e-12, (name, rec.get("relerr"))
        assert relerr(weights[f"{name}-train"], trained[name]) < 1e-10, name
        assert relerr(weights[f"{name}-train"], initial[name]) > 1e-4, name  # it trained
    if "hf_llama" in MODELS:  # the model's own plan, under the wrapper's path
        notes = recs["hf_llama-infer"]["tensor"]
        assert notes["plan"] == "declared"
        pairs = dict(map(tuple, notes["pairs"]))
        assert pairs["model.model.layers.0.self_attn.k_proj"] == "ColwiseParallel"
        assert pairs["model.model.layers.1.self_attn.o_proj"] == "RowwiseParallel"
    if "hf_gpt2" in MODELS:  # derived, Conv1D by its own styles
        pairs = dict(map(tuple, recs["hf_gpt2-infer"]["tensor"]["pairs"]))
        assert pairs["model.transformer.h.0.attn.c_attn"] == "Conv1DColwise"
        assert pairs["model.transformer.h.1.mlp.c_proj"] == "Conv1DRowwise"


TENSOR = ["--strategy", "tensor", "--engine", "torch", "--dtype", "fp64", "--no-record"]
WRONG = """from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

# v by heads but q and k whole: every shape fits, the values do not.
PLAN = {"layers.*.v_proj": ColwiseParallel(), "layers.*.out_proj": RowwiseParallel()}
"""


def test_a_head_count_the_ranks_do_not_divide_is_refused_before_launch(cli):
    code, out, err = cli("run", *model_flags(MODELS["nanogpt"]), *TENSOR, "--ranks", "3")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "transformer.h.0.attn has n_head=4, which 3 ranks do not divide" in err


def test_a_plan_that_disagrees_with_the_module_is_refused_before_launch(cli, tmp_path):
    plan = tmp_path / "wrong_plan.py"
    plan.write_text(WRONG)
    args = [*model_flags(MODELS["tuple_blocks"]), *TENSOR, "--ranks", "2"]
    code, out, err = cli("run", *args, "--tp-plan", f"{plan}:PLAN")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "the --tp-plan plan disagrees with the unsharded module" in err
    assert "first at layers.0" in err and "num_heads" in err and "--tp-plan" in err


def test_a_plan_whose_forward_fails_names_the_module(cli, tmp_path):
    plan = tmp_path / "fails.py"
    plan.write_text(WRONG.replace('"layers.*.out_proj": RowwiseParallel()',
                                  '"layers.*.fc2": RowwiseParallel()'))  # fmt: skip
    args = [*model_flags(MODELS["tuple_blocks"]), *TENSOR, "--ranks", "2"]
    code, out, err = cli("run", *args, "--tp-plan", f"{plan}:PLAN")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "plan fails in rank 0's forward at layers.0.out_proj" in err


def test_hf_models_declared_plan_is_read_under_the_wrappers_path():
    pytest.importorskip("transformers")
    from programs import zoo
    from scalelab.strategies.tensor_plans import declared, derived

    llama = zoo.hf_llama()
    own = declared.declared(llama)
    assert own["model.model.layers.*.self_attn.k_proj"] == "colwise"
    plan = derived.derive_plan(llama, 2)
    assert plan.source == "declared" and plan.heads == {}  # HF reads head counts off config
    gpt2 = zoo.hf_gpt2()
    assert declared.declared(gpt2) is None
    plan = derived.derive_plan(gpt2, 2)
    attn = "model.transformer.h.0.attn"
    assert plan.source == "derived" and plan.fused[f"{attn}.c_attn"] == 16
    assert set(plan.heads[attn]) == {"num_heads", "embed_dim", "split_size"}
    with pytest.raises(Exception, match="k_proj has 2 heads of 4 to shard, which 4 ranks"):
        derived.derive_plan(zoo.hf_llama(), 4)


def test_conv1d_fused_rows_go_back_to_the_users_order():
    """GPT-2's c_attn weight is (C, 3C): its q|k|v sit on dim 1, reordered there."""
    from scalelab.strategies.tensor_plans import derived

    w = torch.arange(2 * 12.0).reshape(2, 12)  # C = 4, 2 ranks
    there = derived.permute(w, (4, 1), 2)
    assert there[0].tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert torch.equal(derived.permute(there, (4, 1), 2, back=True), w)


def test_the_attention_of_nanogpt_sees_the_ranks_width():
    """n_head and n_embd halved, and the width its forward reads off x.size() halved too."""
    from programs import zoo
    from scalelab.strategies.tensor_plans import derived, local_width

    model = zoo.nanogpt()
    plan = derived.derive_plan(model, 2)
    attn = model.transformer.h[0].attn
    assert plan.narrow == {"transformer.h.0.attn": 16, "transformer.h.1.attn": 16}
    derived.reorder_fused(model, plan, 2)
    assert (attn.n_head, attn.n_embd) == (2, 8)
    local_width.install(model, {"transformer.h.0.attn": 8})
    seen = []

    class Seen(Exception):
        pass

    def stop(_m, args):
        seen.append(args[0].size())
        raise Seen

    attn.register_forward_pre_hook(lambda _m, args: seen.append(args[0].size()))
    attn.c_attn.register_forward_pre_hook(stop)
    with pytest.raises(Seen):
        model(torch.zeros(1, 8, dtype=torch.long))
    assert seen == [torch.Size([1, 8, 8]), torch.Size([1, 8, 16])]


def test_shares_say_which_part_of_a_block_a_plan_splits():
    from programs import zoo
    from scalelab.strategies.tensor_plans import derived, shares

    model = zoo.tuple_blocks()
    whole = derived.derive_plan(model, 2)
    assert shares.block_shares(model, whole) == {"layers.0": 1.0, "layers.1": 1.0}
    attention_only = derived.HeadPlan({k: s for k, s in whole.styles.items() if ".fc" not in k})
    # q, k, v, out: 4 x 16 x 16 of the block's 4 x 256 + 2 x 16 x 32 projection weights
    assert shares.block_shares(model, attention_only) == {"layers.0": 0.5, "layers.1": 0.5}


def test_a_plan_that_matches_no_module_is_refused(tmp_path):
    from programs import zoo
    from scalelab.errors import UsageError
    from scalelab.strategies.tensor_plans import derived

    plan = tmp_path / "elsewhere.py"
    plan.write_text(WRONG.replace("layers.*", "blocks.*"))
    with pytest.raises(UsageError, match="the --tp-plan plan matches no module of the model"):
        derived.derive_plan(zoo.tuple_blocks(), 2, f"{plan}:PLAN")
