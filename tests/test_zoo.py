"""The zoo (tests/programs/zoo.py: nanoGPT tied and untied, Hugging Face's Llama with GQA and
GPT-2 with its tied head, torch's TransformerEncoder, blocks returning tuples) as their authors
wrote them, under local, ddp, fsdp and the torch pipeline (2 stages; dp 2 x pp 2), on real CPU
ranks (gloo) in float64.

References: the same module in float64 in one process (inference --check: relerr <= 1e-12);
the same steps trained by `local` in one fp64 process (weights within 1e-10 after 2 steps, and
moved from where they began). One torchrun launch per rank count (tests/zoo_runs.py). The
ranks' training runs skip their own --check: it would replay the same fp64 training in one
process on rank 0, which the module's one-process runs already did (its weights are the
reference compared here).
"""

from __future__ import annotations

import pytest
import torch

from programs.train_helpers import relerr
from scalelab.config import RunConfig
from scalelab.run.runner import execute
from zoo_runs import FOUR, INFER, MODELS, PIPE, TRAIN, TRAIN_ONLY, TWO, initial, launch, runs

SCHEDULES = {"gpipe": {}, "interleaved-1f1b": {"virtual_stages": 2},
             "looped-bfs": {"virtual_stages": 2}, "zero-bubble": {"virtual_stages": 2},
             "zbv": {}, "dualpipev": {}}  # fmt: skip
DEEP = ["depth=4"]  # 2 x 2 virtual stages cut between 4 blocks (dualpipev: 4 micro-batches)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Each model trained 2 steps by local in one fp64 process, its inference checked:
    (records, weights) by model name."""
    out, recs, weights = tmp_path_factory.mktemp("one"), {}, {}
    for name, spec in MODELS.items():
        for mode, fields in (("infer", INFER), ("train", TRAIN)):
            path = out / f"{name}-{mode}.pt"
            cfg = RunConfig(**fields, **spec, dtype="fp64", save_weights=str(path))
            recs[f"{name}-{mode}"] = execute(cfg, None).record
        weights[name] = torch.load(out / f"{name}-train.pt")
        moved = relerr(weights[name], initial(name, "fp64"))
        assert moved > 1e-3, (name, moved)  # it trained
    return recs, weights


def _check(recs: dict, weights: dict, reference: dict, ways: list[str]) -> None:
    for name in MODELS:
        for how in ways:
            if how not in TRAIN_ONLY:
                rec = recs[f"{name}-{how}"]
                assert rec["check_passed"] and rec["relerr"] <= 1e-12, (name, how, rec["relerr"])
            key = f"{name}-train-{how}"
            assert recs[key]["status"] == "ok", key
            assert relerr(weights[key], reference[name]) < 1e-10, key


def test_local_checks_and_trains_every_model(one_process):
    recs, _ = one_process
    for name in MODELS:
        rec = recs[f"{name}-infer"]
        assert rec["check_passed"] and rec["relerr"] <= 1e-12, (name, rec["relerr"])
        assert recs[f"{name}-train"]["check_passed"], name


@pytest.mark.mpi
def test_two_ranks_ddp_fsdp_pipeline_equal_one_process(tmp_path, one_process):
    """ddp, fsdp and 2 pipeline stages on 2 ranks; the tied nanoGPT under every other
    schedule too (its tied head summed between the first and the last stage)."""
    todo = runs(TWO, 2, "fp64")
    for sched, fields in SCHEDULES.items():
        todo[f"nanogpt-train-{sched}"] = {**TRAIN, **MODELS["nanogpt"], **PIPE, "ranks": 2,
                                          "dtype": "fp64", "schedule": sched, **fields,
                                          "model_arg": DEEP, "microbatches": 4}  # fmt: skip
    recs, weights = launch(2, _without_train_check(todo), tmp_path)
    _check(recs, weights, one_process[1], list(TWO))
    deep = _deep_reference(tmp_path)
    for sched in SCHEDULES:
        key = f"nanogpt-train-{sched}"
        assert recs[key]["status"] == "ok", key
        assert relerr(weights[key], deep) < 1e-10, key
        tied = weights[key]
        assert tied["lm_head.weight"].data_ptr() == tied["transformer.wte.weight"].data_ptr()


@pytest.mark.mpi
def test_dp2_by_pp2_equals_one_process(tmp_path, one_process):
    recs, weights = launch(4, _without_train_check(runs(FOUR, 4, "fp64")), tmp_path)
    _check(recs, weights, one_process[1], list(FOUR))


def test_saved_weights_keep_the_users_names_and_one_tied_weight(one_process):
    _, weights = one_process
    tied = weights["nanogpt"]
    assert tied["lm_head.weight"].data_ptr() == tied["transformer.wte.weight"].data_ptr()


def test_pipeline_stages_default_to_ranks_over_dp():
    from scalelab.cli.main import build_parser
    from scalelab.cli.options import config_from_args, workload_name

    base = ["run", "mlp", "--strategy", "pipeline", "--engine", "torch", "--ranks", "4"]
    for extra, stages in (([], 4), (["--dp", "2"], 2), (["--stages", "2", "--dp", "2"], 2)):
        args = build_parser().parse_args([*base, *extra])
        assert config_from_args(args, workload=workload_name(args)).stages == stages, extra


def _without_train_check(todo: dict) -> dict:
    """The training runs without --check (the one-process weights are their reference)."""
    return {k: {**v, "check": False} if v.get("train") else v for k, v in todo.items()}


def _deep_reference(out) -> dict:
    path = out / "deep-local.pt"
    cfg = RunConfig(**TRAIN, **MODELS["nanogpt"], dtype="fp64", model_arg=DEEP,
                    save_weights=str(path))  # fmt: skip
    execute(cfg, None)
    return torch.load(path)
