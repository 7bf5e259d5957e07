"""--compile per repeated block (strategies/compile_scope.py) and the fsdp policy scalelab
chooses by default, held by what the record says and by the one-process references:

- compile_blocks compiles each block in place (state_dict keys unchanged), a model without a
  block stack is left to the whole-model path; fsdp's "auto" reshards every unit but the last;
- the scope and the numerics are torch.compile's graphs, not Inductor's CPU code: the ranks
  and the float64 check run `--compile-backend aot_eager` (the same dynamo + AOTAutograd
  graphs, forward and backward, run without code generation); one local run compiles
  with Inductor itself, at a tiny GPT (two blocks, width 8);
- on 2 gloo ranks in float64, ddp --compile and fsdp --compile (blocks compiled before DDP /
  fully_shard wrap them) train what one eager float64 process trains (`--check`), and the
  record names the per-block scope, the graphs built and fsdp's units, policy and reshard list;
- one process: local --compile --amp bf16 passes its --check against the float64 reference
  (tolerance from a one-process bf16 autocast run) and says bf16 in the record;
- on a GPU (`-m gpu`): local --compile --amp bf16 and ddp --compile on one GPU train a tiny GPT.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from programs.train_helpers import PROGRAMS, launcher, run
from scalelab.config import RunConfig
from scalelab.record import read_records
from scalelab.run.runner import execute
from scalelab.strategies.compile_scope import compile_blocks
from scalelab.strategies.fsdp_units import reshard_policy

ROOT = Path(__file__).resolve().parents[1]
GPT = dict(
    workload="model", model=f"{ROOT / 'examples' / 'models' / 'gpt.py'}:gpt",
    model_arg=("vocab=32", "seq=8", "width=16", "heads=2", "depth=2"), input_shape="8",
    input_dtype="int64", vocab=32, train=True, train_size=16, heldout_size=4, batch=8,
    epochs=1, lr=0.2, momentum=0.9, seed=5, quiet=True, threads=1, check=True, compile=True,
    compile_backend="aot_eager",
)  # fmt: skip


def test_blocks_compile_in_place_and_a_chain_without_blocks_is_left_whole():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples/models/gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.gpt(depth=3)
    keys = list(model.state_dict())
    notes = compile_blocks(model)
    assert notes == {"scope": "per-block", "blocks": 3, "block_types": ["Block"],
                     "backend": "inductor"}  # fmt: skip
    assert list(model.state_dict()) == keys  # in place: no _orig_mod prefix
    assert all(b._compiled_call_impl is not None for b in model.blocks)
    assert model._compiled_call_impl is None and model.head._compiled_call_impl is None
    chain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert compile_blocks(chain) is None
    assert all(m._compiled_call_impl is None for m in chain.modules())


def test_auto_reshards_every_unit_but_the_last():
    assert reshard_policy("auto", 4) == [True, True, True, False]
    assert reshard_policy("on", 3) == [True] * 3 and reshard_policy("off", 2) == [False] * 2
    assert RunConfig(workload="mlp").reshard_after_forward == "auto"


@pytest.mark.mpi
@pytest.mark.slow
def test_compiled_ddp_and_fsdp_train_what_one_eager_process_trains(tmp_path):
    # ddp's and fsdp's GPT is a language model ((N, T, V) logits): its loss is compiled too
    lm = {"model_arg": (*GPT["model_arg"], "lm=True")}
    runs = {
        "ddp": {**GPT, **lm, "strategy": "ddp", "ranks": 2, "dtype": "fp64"},
        # one unit per block (the default joins blocks this small): the policy per unit
        "fsdp": {**GPT, **lm, "strategy": "fsdp", "ranks": 2, "dtype": "fp64", "fsdp_unit_mb": 0},
        "fsdp-bf16": {**GPT, "strategy": "fsdp", "ranks": 2, "dtype": "bf16",
                      "compile": False, "check": False},
    }  # fmt: skip
    runs = {k: {**v, "model_arg": list(v["model_arg"])} for k, v in runs.items()}
    cmd = [
        *launcher("torchrun", 2),
        str(PROGRAMS / "fsdp_runs.py"),
        str(tmp_path),
        json.dumps(runs),
    ]
    proc = run(cmd, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = {
        Path(r["config"]["save_weights"]).stem: r for r in read_records(tmp_path / "runs.jsonl")
    }
    for name in ("ddp", "fsdp"):
        rec = recs[name]
        assert rec["status"] == "ok" and rec["check_passed"], (name, rec.get("relerr"))
        assert rec["compile"]["scope"] == "per-block" and rec["compile"]["blocks"] == 2
        assert rec["compile"]["graphs"] >= 1 and rec["compile"]["backend"] == "aot_eager"
        assert rec["compile"]["loss"] == "compiled" and rec["task"] == "next-token"
    fsdp = recs["fsdp"]["fsdp"]
    assert fsdp["units"] == 3 and fsdp["reshard_after_forward"] == [True, False, True]
    assert fsdp["mp_policy"] == {"param_dtype": None, "reduce_dtype": None}
    low = recs["fsdp-bf16"]["fsdp"]["mp_policy"]
    assert low == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert "compile" not in recs["fsdp-bf16"]


@pytest.mark.slow
def test_local_compile_with_amp_passes_its_check(tmp_path, monkeypatch):
    import torch._inductor.config as inductor

    # its ~25 kernels compiled in this process: a pool of compile workers would first start
    # two more processes that import torch (7 s of CPU on a 2-core host, no wall saved)
    monkeypatch.setattr(inductor, "compile_threads", 1)
    tiny = ("vocab=32", "seq=8", "width=8", "heads=2", "depth=2", "lm=True")  # loss compiled
    fields = {**GPT, "model_arg": tiny, "compile_backend": "inductor"}
    cfg = RunConfig(**{**fields, "strategy": "local", "amp": "bf16", "steps": 1})
    rec = execute(cfg, tmp_path / "r.jsonl").record
    assert rec["status"] == "ok" and rec["check_passed"], rec.get("relerr")
    assert rec["precision"] == "bf16" and rec["compile"]["scope"] == "per-block"
    assert rec["compile"]["backend"] == "inductor" and rec["compile"]["graphs"] >= 1
    assert rec["compile"]["loss"] == "compiled"


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["local", "ddp"])
def test_compiled_bf16_step_runs_on_one_gpu(strategy, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fields = {**GPT, "strategy": strategy, "device": "cuda", "amp": "bf16", "check": False,
              "steps": 4, "train_size": 32}  # fmt: skip
    rec = execute(RunConfig(**fields), tmp_path / "r.jsonl").record
    assert rec["status"] == "ok" and rec["compile"]["scope"] == "per-block"
    assert rec["compile"]["graphs"] >= 1 and rec["steady_throughput"] > 0
    assert all(v >= 0 for v in rec["phases"].values())
