"""`scalelab versions`: every strategy this machine can run, one table, same answer."""

import re

import pytest
import torch

from scalelab.cli.commands.versions import cli_flags, unavailable, variant_config, variants
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
    if not torch.cuda.is_available():
        assert "skipped mpi-gpu (V4): no CUDA GPU" in stdout


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
