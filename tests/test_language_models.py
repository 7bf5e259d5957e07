"""Language models as workloads: an (N, T, V) output for an (N, T) int64 input learns the next
token (workloads/next_token.py), reads a text corpus (data/corpus.py), reports tokens/s and
MFU (run/tokens.py); `--model hf:SPEC` builds a Hugging Face causal LM (workloads/hf_models.py).

References: one float64 process (`--train --check`: the ranks' trained weights against it),
the module itself in float64 (inference --check), closed forms (the shifted targets, the
mean cross-entropy, MFU's arithmetic), from_pretrained's own model (a local checkpoint).
"""

import json
import math
import sys

import pytest
import torch

from programs.train_helpers import PROGRAMS, launcher, records_and_weights, run
from scalelab.config import RunConfig
from scalelab.data import corpus
from scalelab.run import tokens
from scalelab.run.runner import execute
from scalelab.workloads import next_token
from scalelab.workloads.base import WORKLOADS

ZOO = PROGRAMS / "zoo.py"
LM = dict(workload="model", input_shape="8", input_dtype="int64", vocab=40, quiet=True,
          threads=1, dtype="fp64")  # fmt: skip
TRAIN = dict(train=True, train_size=16, heldout_size=8, batch=8, epochs=1, lr=0.2, check=True)
LLAMA = {"model": f"{ZOO}:hf_llama", "model_arg": ["lm=True", "seq=8"]}
HF_LLAMA = {"model": "hf:llama", "model_arg": ["hidden_size=16", "intermediate_size=48",
                                               "head_dim=4"]}  # fmt: skip
NANO_LM = {"model": f"{ZOO}:nanogpt", "model_arg": ["lm=True", "tied=False"]}


@pytest.mark.mpi
def test_two_ranks_train_and_split_a_language_model_like_one_process(tmp_path):
    """One torchrun launch of 2 ranks: HF Llama returning (B, T, V) (the zoo's wrapper, and
    `hf:llama` with no wrapper) trained by ddp in fp64 equals one float64 process
    (--train --check), with tokens/s and MFU in the record; nanoGPT's logits cut into 2
    pipeline stages equal the module in float64."""
    runs = {
        "zoo-llama": {**LM, **TRAIN, **LLAMA, "strategy": "ddp", "ranks": 2},
        "hf-llama": {**LM, **TRAIN, **HF_LLAMA, "strategy": "ddp", "ranks": 2},
        "pipe": {**LM, **NANO_LM, "strategy": "pipeline", "engine": "torch", "ranks": 2,
                 "stages": 2, "batch": 4, "iters": 1, "warmup": 0, "check": True},
    }  # fmt: skip
    cmd = [*launcher("torchrun", 2), str(PROGRAMS / "user_runs.py"), str(tmp_path),
           json.dumps(runs)]  # fmt: skip
    proc = run(cmd, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs, _ = records_and_weights(tmp_path)
    for name in ("zoo-llama", "hf-llama"):
        rec = recs[name]
        assert rec["train_check"]["passed"] and rec["status"] == "ok", (name, rec["train_check"])
        assert rec["task"] == "next-token" and "accuracy" not in rec
        assert rec["heldout_loss"][0] < math.log(40) + 0.5  # a loss, near ln(vocab) at start
        assert rec["perplexity"][0] == pytest.approx(math.exp(rec["heldout_loss"][0]))
        assert rec["tokens_per_s"] == pytest.approx(rec["throughput"] * 8)
        assert rec["tokens_per_s_per_device"] == pytest.approx(rec["tokens_per_s"] / 2)
        assert rec["mfu"]["flops_per_token"] == pytest.approx(3 * rec["flops_per_item"] / 8)
    pipe = recs["pipe"]
    assert pipe["check_passed"] and pipe["relerr"] <= 1e-12, pipe["relerr"]


def test_training_on_ag_news_text_lowers_the_held_out_loss(tmp_path, agnews_dir):
    """nanoGPT (all positions) on the AG News text as bytes: the held-out loss starts near
    ln(256) for small random weights and falls over two epochs."""
    cfg = RunConfig(**{**LM, "vocab": 256, "input_shape": "32", "dtype": "fp32"},
                    model=f"{ZOO}:nanogpt", data_dir=str(agnews_dir),
                    model_arg=("lm=True", "vocab=256", "seq=32", "width=32"), train=True,
                    batch=32, train_size=256, heldout_size=64, epochs=2, lr=0.5)  # fmt: skip
    rec = execute(cfg, tmp_path / "runs.jsonl").record
    held = rec["heldout_loss"]
    assert held[1] < held[0] < math.log(256) - 1.0, held
    assert rec["config"]["data_dir"] == str(agnews_dir)


def test_corpus_windows_are_the_text_bytes_and_their_next_bytes(tmp_path):
    """Items are consecutive windows of T + 1 bytes: x the first T, y the last T."""
    (tmp_path / "a.txt").write_text("hello world, ")
    (tmp_path / "b.txt").write_text("and more text")
    data = b"hello world, \nand more text"
    x, y = corpus.sequences(str(tmp_path), 4, 6, 256, None)
    for i in range(6):
        assert bytes(x[i].tolist()) == data[4 * i : 4 * i + 4]
        assert bytes(y[i].tolist()) == data[4 * i + 1 : 4 * i + 5]


def test_synthetic_targets_are_the_input_shifted_and_the_loss_is_the_mean_token_ce():
    cfg = RunConfig(**LM, **NANO_LM)
    wl = WORKLOADS.get("model")(cfg)
    assert wl.task == "next-token" and wl.tokens_per_item == 8 and wl.num_classes == 40
    data = wl.synthetic_inputs(5, 3)
    assert data.y.shape == (5, 8) and torch.equal(data.y[:, :-1], data.x[:, 1:])
    logits = torch.randn(5, 8, 40, dtype=torch.float64)
    manual = -sum(
        torch.log_softmax(logits[b, t], 0)[data.y[b, t]] for b in range(5) for t in range(8)
    ) / 40  # fmt: skip
    assert float(wl.loss(wl.build_model(), logits, data.y)) == pytest.approx(float(manual))
    assert wl.score(logits, data.y) == pytest.approx(5 * float(manual))


def test_mfu_is_flops_per_token_times_tokens_per_second_over_the_named_peak(tmp_path):
    rec = {"throughput": 100.0, "ranks": 2, "flops_per_item": 8e6, "mode": "train",
           "precision": "bf16", "config": {"device": "cuda"},
           "env": {"gpu_name": "NVIDIA H200", "hostname": "h"}}  # fmt: skip
    ceilings = {"schema": "scalelab.ceilings/1", "device": "cuda",
                "machine": {"hostname": "h", "gpu": "NVIDIA H200", "date": "d"},
                "gemm_flops": {"bf16": 6e14}}  # fmt: skip
    (tmp_path / "ceilings.json").write_text(json.dumps(ceilings))
    got = tokens.fields(rec, 16, tmp_path / "ceilings.json")
    per_token = 3 * 8e6 / 16
    assert got["tokens_per_s"] == 1600 and got["tokens_per_s_per_device"] == 800
    assert got["mfu"]["measured"] == pytest.approx(per_token * 800 / 6e14)
    assert got["mfu"]["datasheet"] == pytest.approx(per_token * 800 / 989.5e12)
    assert "H200 SXM" in got["mfu"]["datasheet_peak"]["source"]
    missing = tokens.fields(rec, 16, tmp_path / "nowhere.json")["mfu"]
    assert missing["measured"] is None and "no ceilings file" in missing["measured_peak"]["missing"]


def test_hf_folder_with_a_checkpoint_loads_its_weights(tmp_path):
    """hf:DIR with config.json and model.safetensors: from_pretrained's weights, not random."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=8)  # fmt: skip
    saved = transformers.LlamaForCausalLM(config).eval()
    saved.save_pretrained(tmp_path)
    wl = WORKLOADS.get("model")(RunConfig(**{**LM, "dtype": "fp32"}, model=f"hf:{tmp_path}"))
    ids = torch.randint(0, 40, (2, 8))
    with torch.no_grad():
        expected = saved(input_ids=ids, use_cache=False).logits
        assert torch.equal(wl.build_model()(ids), expected)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--model", "hf:nosuchtype"], "unknown model type 'nosuchtype'"),
        (["--model", "hf:missing/config.json"], "no such config file missing/config.json"),
        ([*["--model", f"{ZOO}:nanogpt", "--model-arg", "lm=True", "--model-arg", "vocab=256"],
          "--data-dir", "DATA", "--tokenizer", "no-such-tokenizer"],
         "--tokenizer no-such-tokenizer: not found in local files"),
    ],
)  # fmt: skip
def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, monkeypatch, cli, args, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("some text to read " * 20)
    args = [str(tmp_path) if a == "DATA" else a for a in args]
    code, _, err = cli("run", *args, "--input-shape", "8", "--input-dtype", "int64", "--vocab",
                       "256", "--out", str(tmp_path / "runs.jsonl"))  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    assert not (tmp_path / "runs.jsonl").exists()


def test_is_lm_output_needs_int_ids_and_one_logit_row_per_position():
    out = torch.zeros(1, 8, 40)
    assert next_token.is_lm_output(out, (8,), True)
    assert not next_token.is_lm_output(out, (8,), False)
    assert not next_token.is_lm_output(out, (7,), True)
    assert not next_token.is_lm_output(torch.zeros(1, 40), (8,), True)


def test_hf_without_transformers_names_the_extra(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    code, _, err = cli("run", "--model", "hf:llama", "--input-shape", "8", "--input-dtype",
                       "int64", "--vocab", "40", "--out", str(tmp_path / "runs.jsonl"))  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert 'pip install "scalelab[hf]"' in err and not (tmp_path / "runs.jsonl").exists()


def test_predict_and_plan_give_a_token_models_tokens_per_second():
    from scalelab.predict.frame import tokens_per_s

    root = PROGRAMS.parents[1]
    gpt = RunConfig(workload="model", model=f"{root / 'examples/models/gpt.py'}:gpt",
                    input_shape="16", input_dtype="int64", vocab=64)  # fmt: skip
    assert tokens_per_s(gpt, 10.0) == 160.0  # 10 sequences/s of 16 tokens
    assert tokens_per_s(RunConfig(workload="alexnet"), 10.0) is None


def test_held_out_forwards_are_sized_by_the_logits_they_produce():
    """An (N, T, V) model's held-out forward holds T x V logits an item: 500 items of GPT-2's
    1024 x 50304 were 96 GiB (an H200 ran out of memory after the first step). The held-out
    batch is capped at 2^29 output elements, never below the training batch; an (N, K)
    model keeps 512 items whatever its input length."""
    from scalelab.train.loop import eval_batch

    gpt = f"{ZOO.parent.parent.parent / 'examples' / 'models' / 'gpt.py'}:gpt"
    arg = ["seq=1024", "width=8", "heads=2", "depth=1", "vocab=50304"]
    cfg = dict(LM, input_shape="1024", vocab=50304, model=gpt, dtype="fp32")
    lm = WORKLOADS.get("model")(RunConfig(**cfg, model_arg=(*arg, "lm=True")))
    last = WORKLOADS.get("model")(RunConfig(**cfg, model_arg=tuple(arg)))  # (N, V): one row
    assert lm.task == next_token.TASK and last.task != next_token.TASK
    assert eval_batch(lm, 1) == 2**29 // (1024 * 50304) == 10
    assert eval_batch(lm, 16) == 16  # the training batch's forward fits where its step did
    assert eval_batch(last, 1) == 512
    mlp = WORKLOADS.get("mlp")(RunConfig(workload="mlp", hidden=16))  # no class count set
    assert eval_batch(mlp, 20) == 512 and eval_batch(mlp, 600) == 600


def test_every_hf_model_type_builds_at_the_small_size():
    """hf:TYPE for types whose config derives a field SMALL sets (falcon's head_dim is a
    read-only property: the config was refused), and the families the tensor and pipeline
    tests run: each builds and maps (B, T) ids to (B, T, V) logits."""
    pytest.importorskip("transformers")
    for kind in ("falcon", "opt", "qwen3", "phi3", "gemma"):
        wl = WORKLOADS.get("model")(RunConfig(**{**LM, "dtype": "fp32"}, model=f"hf:{kind}"))
        ids = torch.randint(0, 40, (2, 8))
        with torch.no_grad():
            assert wl.build_model()(ids).shape == (2, 8, 40), kind
