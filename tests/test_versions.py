"""`scalelab versions`: every strategy this machine can run, one table, same answer."""

import re

import pytest
import torch

from scalelab.cli.commands.versions_variants import (
    cli_flags,
    unavailable,
    variant_config,
    variants,
)
from scalelab.config import RunConfig
from scalelab.record import read_records


@pytest.mark.mpi
def test_versions_runs_every_available_strategy_on_the_same_inputs(readme_clone):
    """README's `scalelab versions alexnet --image-size 99 --batch 8 --ranks 2` line, run once
    per test run in the shared fresh clone (test_readme.py reads the same run)."""
    done = readme_clone.run("scalelab versions alexnet")
    stdout = done.stdout
    assert done.returncode == 0, (stdout, done.stderr[-2000:])
    tag = re.search(r"records appended to (\S+) \(versions id (\w+)\)", stdout)
    assert tag, stdout
    every = read_records(readme_clone.path / tag[1])  # other README lines append here too
    recs = [r for r in every if "versions" in r]
    got = {(r["strategy"], r.get("split"), r["ranks"]) for r in recs}
    want = {("serial", None, 1), ("local", None, 1)}
    want |= {("mpi", s, 2) for s in ("broadcast", "batch", "spatial")}
    assert want <= got
    assert {r["versions"] for r in recs} == {tag[2]}  # one comparison, one id
    assert len({r["digest"] for r in recs}) == 1 and all(r["check_passed"] for r in recs)
    assert "digests: all equal" in stdout
    for label in ("serial (V1)", "mpi broadcast (V2)", "mpi spatial (V2)"):
        assert label in stdout
    serial = next(r for r in recs if r["strategy"] == "serial")
    assert serial["relerr"] == 0.0
    if not torch.cuda.is_available():  # one line of reasons with counts; the list in the records
        (line,) = [line for line in stdout.splitlines() if line.startswith("skipped")]
        assert re.fullmatch(r"skipped \d+ variants: .*no CUDA GPU on this machine \(\d+\).*", line)
        assert recs[0]["versions_skipped"]["mpi-gpu (V4)"] == "no CUDA GPU on this machine"


def test_unavailable_variants_say_why():
    base = RunConfig(workload="mlp", batch=4)
    reasons = {v.label: unavailable(v, base) for v in variants(2)}
    assert "needs a convolution trunk" in reasons["mpi spatial (V2)"]
    assert reasons["serial (V1)"] is None and reasons["local cpu"] is None
    small = RunConfig(workload="alexnet", image_size=67, batch=1)
    assert "2 ranks but only 1 items" in unavailable(variants(2)[3], small)  # mpi batch


def test_cli_flags_rebuild_the_config():
    base = RunConfig(workload="alexnet", image_size=67, batch=3, iters=2, warmup=0, seed=4)
    cfg = variant_config(variants(2)[4], base)  # mpi spatial
    flags = cli_flags(cfg)
    assert flags[flags.index("--split") + 1] == "spatial"
    assert "--check" in flags and "--quiet" in flags and "--overlap" not in flags
    for flag, value in (("--image-size", "67"), ("--seed", "4"), ("--ranks", "2")):
        assert flags[flags.index(flag) + 1] == value


def _labels(vs):
    return {v.label: v for v in vs}


def test_a_cpu_only_machine_lists_every_gpu_variant_and_the_model_parallel_ones_as_skipped(
    monkeypatch,
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = RunConfig(workload="alexnet", image_size=67, batch=4)
    for train in (False, True):
        vs = variants(2, train=train)
        assert len(_labels(vs)) == len(vs)  # labels name one variant each
        for v in vs:
            why = unavailable(v, base)
            if v.device == "cuda":
                assert why == "no CUDA GPU on this machine", v
            elif v.strategy in ("pipeline", "tensor", "fsdp"):
                assert why == "on CPU ranks with --all", v
            else:
                assert why is None, (v, why)
    got = {(v.strategy, v.engine, v.dp) for v in variants(2) if v.device == "cuda"}
    assert {
        ("pipeline", "scalelab", 1),
        ("pipeline", "torch", 1),
        ("tensor", "torch", 1),
        ("fsdp", "scalelab", 1),
        ("tensor", "torch", 2),
        ("pipeline", "torch", 2),
    } <= got
    trains = {v.strategy for v in variants(2, train=True)}
    assert trains == {"local", "ddp", "mpi-dp", "pipeline", "tensor", "fsdp"}


def test_with_all_the_cpu_variants_run_or_say_the_strategys_own_refusal(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    alexnet = RunConfig(workload="alexnet", image_size=67, batch=4)
    cpu = [v for v in variants(2) if v.device == "cpu"]
    assert all(unavailable(v, alexnet, every=True) is None for v in cpu)
    mesh = _labels(variants(2))
    assert unavailable(mesh["dp x tp cuda"], alexnet) == "needs 4 GPUs, this machine has 2"
    assert mesh["dp x pp cuda"].ranks == 4 and mesh["dp x pp cuda"].dp == 2
    mlp = RunConfig(workload="mlp", hidden=8, batch=4, train=True, steps=2)
    why = unavailable(_labels(variants(2, train=True))["pipeline cpu"], mlp, every=True)
    assert why.startswith("pipeline: mlp's loss looks at the whole model")  # its preflight
    fsdp = _labels(variants(3, train=True))["fsdp cpu"]  # its preflight: the batch's shares
    assert "--batch 4 (the global batch) does not divide over 3 ranks" in unavailable(
        fsdp, mlp, every=True
    )


def _rebuilt(cfg):
    """cfg as `scalelab run` parses the flags cli_flags writes for it."""
    import argparse

    from scalelab.cli.commands import run as run_command
    from scalelab.cli.options import config_from_args

    parser = argparse.ArgumentParser()
    run_command.add_arguments(parser)
    args = parser.parse_args([cfg.workload, *cli_flags(cfg)])
    return config_from_args(args, workload=cfg.workload)


def test_cli_flags_rebuild_the_model_parallel_and_training_variants():
    base = RunConfig(workload="alexnet", image_size=67, batch=4, iters=2, seed=3)
    train = RunConfig(
        workload="mlp",
        hidden=8,
        batch=4,
        train=True,
        steps=2,
        train_size=8,
        heldout_size=4,
        dtype="fp64",
        lr=0.05,
    )
    for b in (base, train):
        for v in variants(2, train=b.train):
            cfg = variant_config(v, b)
            assert _rebuilt(cfg) == cfg, v
    by = _labels(variants(2))
    flags = cli_flags(variant_config(by["pipeline torch cuda"], base))
    assert flags[flags.index("--engine") + 1] == "torch" and "--stages" not in flags  # 2: default
    cfg = variant_config(by["dp x pp cuda"], base)  # 2 replicas of a 2-stage pipeline
    flags = cli_flags(cfg)
    assert [flags[flags.index(f) + 1] for f in ("--dp", "--ranks")] == ["2", "4"]
    assert cfg.stages == 2
    flags = cli_flags(variant_config(_labels(variants(3))["pipeline torch cpu"], base))
    assert flags[flags.index("--stages") + 1] == "3"  # a stage a rank
    flags = cli_flags(variant_config(_labels(variants(2, train=True))["fsdp cpu"], train))
    assert "--train" in flags and flags[flags.index("--strategy") + 1] == "fsdp"
    assert flags[flags.index("--steps") + 1] == "2" and "--engine" not in flags


def test_a_refusal_on_the_ranks_is_a_skipped_line_not_a_failed_row(monkeypatch, tmp_path):
    from scalelab.cli.commands import versions

    line = "scalelab run: error: tensor --engine torch: convnet marks no Linear pair to shard"
    monkeypatch.setattr(versions, "launch_run", lambda cfg, results, timeout: (2, line))
    v = _labels(variants(2))["tensor dtensor cpu"]
    rec = versions.run_variant(v, RunConfig(workload="alexnet", batch=4), tmp_path, 10)
    assert rec == {"status": "refused", "error": line.removeprefix("scalelab run: error: ")}
    monkeypatch.setattr(versions, "launch_run", lambda cfg, results, timeout: (1, "boom"))
    assert versions.run_variant(v, RunConfig(workload="alexnet"), tmp_path, 10) == {
        "status": "failed",
        "error": "exit 1: boom",
    }


def test_speedup_is_against_local_cuda_where_it_ran_else_serial():
    from scalelab.cli.commands.versions_table import baseline_line, format_table

    def rec(wall):
        return {
            "status": "ok",
            "wall_s": wall,
            "ranks": 1,
            "throughput": 4 / wall,
            "relerr": 0.0,
            "digest": "d",
            "reference_digest": "d",
            "phases": {},
        }

    by = _labels(variants(2))
    rows = [(by["serial (V1)"], rec(0.4)), (by["local cpu"], rec(0.2))]
    assert baseline_line(rows) == "speedup vs serial (V1)"
    assert "2.00x" in format_table(rows).splitlines()[3]
    rows.append((by["local cuda (V3)"], rec(0.01)))
    assert baseline_line(rows) == "speedup vs local cuda (V3)"
    assert "0.05x" in format_table(rows).splitlines()[3]  # local cpu: 0.01 / 0.2


@pytest.mark.mpi
def test_versions_train_checks_every_data_parallel_strategy_on_cpu_ranks(cli, tmp_path):
    """ONE launch per strategy, a tiny fp64 mlp, the default few steps: every row trains the
    same batches as one float64 process and says so. The model-parallel rows on CPU ranks wait
    for --all (their training checks: test_train_check.py; the variants' command lines:
    test_cli_flags_rebuild_the_model_parallel_and_training_variants)."""
    out = tmp_path / "v.jsonl"
    code, stdout, err = cli(
        "versions", "mlp", "--hidden", "8", "--dtype", "fp64", "--batch", "4", "--train",
        "--threads", "1", "--out", out,
    )  # fmt: skip
    assert code == 0, (stdout, err[-2000:])
    recs = read_records(out)
    got = {(r["strategy"], (r.get("config") or {}).get("engine")) for r in recs}
    assert got == {("local", "scalelab"), ("ddp", "scalelab"), ("mpi-dp", "scalelab")}
    assert all(r["mode"] == "train" and r["steps"] == 3 and r["check_passed"] for r in recs)
    assert all(
        r["relerr"] <= 1e-12 and r["ranks"] == (1 if r["strategy"] == "local" else 2) for r in recs
    )
    assert "speedup vs local cpu" in stdout and "training 3 steps" in stdout
    table = stdout[stdout.index("strategy") : stdout.index("skipped")]
    for label in ("local cpu", "ddp cpu", "mpi-dp"):
        row = next(line for line in table.splitlines() if line.startswith(label + " "))
        assert row.endswith("passed"), row
    (skipped,) = [line for line in stdout.splitlines() if line.startswith("skipped")]
    assert re.search(r"on CPU ranks with --all \(\d+\)", skipped), skipped  # one line for all
    assert {"pipeline torch cpu", "tensor dtensor cpu", "fsdp cpu"} <= {
        k for k, v in recs[0]["versions_skipped"].items() if "--all" in v
    }
    assert "FAILED" not in stdout and "failed" not in table


# The GPU rows in three launches of `versions --only`, so the suite's workers share them: the
# whole table in one test took ~280 s of a 290 s suite on a fresh 2x H200, and the test queued
# behind it on its worker (xdist sends each worker its next test before the current one ends)
# was still running at the kill, twice.
GPU_ROWS = {
    "data-parallel": (["local cuda", "nccl", "mpi-gpu"], ["nccl (V5)"]),
    "pipeline": (["local cuda", "pipeline"], ["pipeline cuda", "pipeline torch cuda"]),
    "sharded": (["local cuda", "tensor", "fsdp", "dp x"], ["tensor dtensor cuda", "fsdp cuda"]),
}


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
@pytest.mark.parametrize("group", GPU_ROWS)
def test_versions_on_two_gpus_runs_every_gpu_strategy(cli, tmp_path, group):
    """Every GPU row of a 2-GPU host ran and passed (mpi-gpu where MPI is installed), with a
    speedup over local cuda; the 2-D meshes (4 ranks) are skipped with the reason."""
    from scalelab.environment import mpi_problem

    only, labels = GPU_ROWS[group]
    out = tmp_path / "v.jsonl"
    code, stdout, err = cli(
        "versions", "alexnet", "--image-size", "67", "--batch", "8", "--out", out,
        *(a for text in only for a in ("--only", text)),
    )  # fmt: skip
    assert code == 0, (stdout, err[-2000:])
    assert "speedup vs local cuda (V3)" in stdout
    # the table: from its header to the skipped lines, or to the digests where none was skipped
    table = re.split(r"\n(?:skipped|digests)", stdout[stdout.index("strategy") :])[0]
    table = table.splitlines()
    labels = ["local cuda (V3)", *labels]
    if group == "data-parallel" and mpi_problem() is None:
        labels += ["mpi-gpu (V4)", "mpi-gpu --overlap"]
    for label in labels:
        row = next(line for line in table if line.startswith(label + " "))
        assert "failed" not in row and "x " in row, row  # a speedup, not a status
    recs = read_records(out)
    assert len(recs) == len(labels) and all(r["check_passed"] for r in recs)
    assert all(r["config"]["device"] == "cuda" for r in recs)
    if group == "sharded" and torch.cuda.device_count() < 4:
        assert "needs 4 GPUs" in stdout and "dp x tp cuda" in recs[0]["versions_skipped"]


def test_skipped_variants_fold_into_one_line_with_counts_and_refusals_keep_theirs():
    from scalelab.cli.commands.versions import skipped_lines

    skipped = {"a": "no CUDA GPU", "b": "no CUDA GPU", "c": "on CPU ranks with --all"}
    refusal = {"d": "tensor --engine torch: convnet marks no Linear pair to shard"}
    text = skipped_lines({**skipped, **refusal}, set(refusal), verbose=0)
    assert text.splitlines() == [
        f"skipped d: {refusal['d']}",
        "skipped 3 variants: no CUDA GPU (2); on CPU ranks with --all (1) (-v: each)",
    ]
    every = skipped_lines({**skipped, **refusal}, set(refusal), verbose=1).splitlines()
    assert every[:2] == ["skipped a: no CUDA GPU", "skipped b: no CUDA GPU"] and len(every) == 4


def test_only_keeps_the_variants_it_names_and_refuses_text_no_label_holds(cli, tmp_path):
    from scalelab.cli.commands.versions import _selected

    every = variants(2)
    assert _selected(every, None) == every
    got = [v.label for v in _selected(every, ["nccl", "pipeline torch"])]
    assert got == ["pipeline torch cpu", "nccl (V5)", "pipeline torch cuda"]  # their order
    out = tmp_path / "v.jsonl"
    code, stdout, err = cli("versions", "mlp", "--only", "nccl", "--only", "bogus", "--out", out)
    assert code == 2 and stdout == "" and not out.exists()
    assert len(err.strip().splitlines()) == 1 and "--only 'bogus' matches no variant" in err
    assert "nccl (V5)" in err  # the labels it could have named


def test_sync_bn_reaches_the_per_rank_normalising_strategies_only():
    """`versions --train --sync-bn` (a BatchNorm model): ddp and mpi-dp normalise over the
    whole batch with it; local, pipeline, tensor and fsdp already do and would refuse it."""
    base = RunConfig(workload="resnet18", batch=4, train=True, sync_bn=True)
    got = {v.label: variant_config(v, base).sync_bn for v in variants(2, train=True)}
    per_rank = ("ddp cpu", "mpi-dp", "ddp cuda")
    assert all(got[label] for label in per_rank)
    assert not any(on for label, on in got.items() if label not in per_rank)
    assert unavailable(_labels(variants(2, train=True))["local cpu"], base) is None
