"""Transformers written as a user would (examples/models/gpt.py: fused qkv, GELU MLP, learned
positions; tests/programs/transformer_nets.py: torch's nn.TransformerEncoder with a position
table on the root module, and a llama-style net with separate q/k/v and a SwiGLU MLP), split
by pipeline stages (torch's tracer) and by attention heads (DTensor), on real ranks (gloo).

References: the same module in float64 on the CPU in eval mode (inference --check, relerr
<= 1e-12); one float64 process (training: the ranks' weights after 3 steps within 1e-10).
One torchrun launch per rank count runs every case of every model (tests/programs/user_runs.py).
"""

from pathlib import Path

import pytest
import torch

from programs.train_helpers import PROGRAMS, launcher, records_and_weights, relerr, run
from scalelab.config import RunConfig
from scalelab.runner import execute

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
PIPE = dict(strategy="pipeline", engine="torch", microbatches=2)
TENSOR = dict(strategy="tensor", engine="torch")
# 2 ranks: pipeline inference and three schedules' training
SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved-1f1b": {"virtual_stages": 2}}


def _launch(ranks: int, runs: dict, out: Path) -> tuple[dict, dict]:
    import json

    cmd = [*launcher("torchrun", ranks), str(PROGRAMS / "user_runs.py"), str(out),
           json.dumps(runs)]  # fmt: skip
    proc = run(cmd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records_and_weights(out)


def _two_rank_runs() -> dict:
    runs = {}
    for name, spec in MODELS.items():
        runs[f"{name}-pipe"] = {**INFER, **spec, **PIPE, "ranks": 2, "stages": 2}
        for sched, extra in SCHEDULES.items():
            runs[f"{name}-pipetrain-{sched}"] = {**TRAIN, **spec, **PIPE, "ranks": 2,
                                                 "stages": 2, "schedule": sched, **extra}
    return runs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    return _launch(2, _two_rank_runs(), out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Each model trained 3 steps by one fp64 process: its weights by model name."""
    out, weights = tmp_path_factory.mktemp("one"), {}
    for name, spec in MODELS.items():
        path = out / f"{name}.pt"
        execute(RunConfig(**TRAIN, **spec, save_weights=str(path)), None)
        weights[name] = torch.load(path)
    return weights


@pytest.mark.mpi
def test_pipeline_stages_infer_and_train_like_one_process(two_ranks, one_process):
    recs, weights = two_ranks
    for name in MODELS:
        rec = recs[f"{name}-pipe"]
        assert rec["check_passed"] and rec["relerr"] <= 1e-12, (name, rec["relerr"])
        for sched in SCHEDULES:
            key = f"{name}-pipetrain-{sched}"
            err = relerr(weights[key], one_process[name])
            assert err < 1e-10, (key, err)
            assert relerr(weights[key], _initial(name)) > 1e-3, key  # it trained


def _initial(name: str) -> dict:
    from scalelab.workloads import WORKLOADS

    wl = WORKLOADS.get("model")(RunConfig(**TRAIN, **MODELS[name]))
    return {k: v.double() for k, v in wl.build_model().state_dict().items()}
