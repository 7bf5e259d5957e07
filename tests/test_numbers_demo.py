"""Figures that agree under the demo: what `benchmarks/demo_under_load.py` (the README's demo
beside two busy processes per core, then an audit of every contradiction) found unflagged, each
fixed here on constructed inputs or a tiny run; and the audit itself, which must be able to
fail (a constructed demo folder with an unflagged rank skew)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from scalelab.instrument import ceiling_checks as CC
from scalelab.instrument import ceilings as C
from scalelab.instrument import threads as T
from scalelab.orchestration.strategy_roles import strategy_roles
from scalelab.record import read_records

ROOT = Path(__file__).resolve().parents[1]


# --- 1. every run says its threads and why ----------------------------------------------------
def test_the_serial_reference_records_its_blas_thread(cli, tmp_path):
    """The demo's `versions` ran serial (NumPy float64) without a `threads` entry, the only
    run of 14 that did not say how many threads it used."""
    out = tmp_path / "runs.jsonl"
    code, _, err = cli("run", "mlp", "--strategy", "serial", "--hidden", 8, "--batch", 4,
                       "--iters", 1, "--warmup", 0, "--out", out)  # fmt: skip
    assert code == 0, err
    (rec,) = read_records(out)
    assert rec["threads"]["threads"] == 1 == rec["host"]["torch_threads"], rec["threads"]
    assert "BLAS" in rec["threads"]["why"]


def test_the_thread_count_says_where_it_came_from(monkeypatch):
    """--threads 1 reads 'given by --threads', under srun too; a count taken from the CPUs
    Slurm gave the task (no --threads) says Slurm, not --threads."""
    monkeypatch.delenv("SCALELAB_THREADS_FROM_SLURM", raising=False)
    assert T.pick(1, "cpu", 1, 2).why == "given by --threads"
    under = T.given(2, env={"SLURM_STEP_ID": "0"})
    assert under.threads == 2 and under.source == "--threads" and "srun" not in under.why
    slurm = T.given(2, env={"SLURM_STEP_ID": "0", "SCALELAB_THREADS_FROM_SLURM": "2"})
    assert slurm.source == "Slurm" and "CPUs Slurm gave this task" in slurm.why


# --- 6. a ceiling that moved between runs ----------------------------------------------------
def _ceilings(fp32: float, copy: float, spread: float = 0.03, **top) -> dict:
    rows = [
        {"n": 512, "threads": 1, "flops": fp32, "spread": spread, "repeats": 3},
        {"n": 128, "threads": 1, "flops": fp32 / 3, "spread": 0.9, "repeats": 3},
    ]
    return {
        "schema": C.SCHEMA, "device": "cpu", "quick": True,
        "machine": {"hostname": C.machine_fingerprint()["hostname"], "date": "09:00"},
        "gemm_flops": {"fp64": 2e10, "fp32": fp32, "detail": {
            "fp32": rows, "fp64": [{"n": 512, "flops": 2e10, "spread": 0.02, "repeats": 3}]}},
        "mem_bw": copy, "mem_bw_detail": [{"bytes": 1 << 24, "Bps": copy, "spread": spread,
                                           "repeats": 3}],
        "warnings": [], **top,
    }  # fmt: skip


def test_a_ceiling_that_moved_beyond_its_spread_is_named():
    """Two `ceilings --quick` runs seen minutes apart: fp32 GEMM 194 vs 94.8 GF/s,
    memory copy 46.7 vs 6.41 GB/s (the blocks of each run agreeing within a few percent)."""
    old, new = _ceilings(1.94e11, 4.67e10), _ceilings(9.48e10, 6.41e9)
    got = {m["what"]: m for m in CC.moved(new, old)}
    assert set(got) == {"fp32 GEMM", "memory copy"}  # fp64 did not move
    assert got["fp32 GEMM"]["ratio"] == pytest.approx(2.046, abs=1e-3)
    assert got["memory copy"]["allowed"] == CC.MOVED
    CC.flag_moved(new, old)
    assert len(new["moved"]) == 2 and new["warnings"][0].startswith("ceiling moved: fp32 GEMM")
    # Within what the spread allows, another host, another --quick: nothing to say.
    assert CC.moved(_ceilings(1.6e11, 4.0e10), old) == []
    assert CC.moved(_ceilings(9.48e10, 2e10, spread=1.5), old) == []  # blocks 150% apart
    assert CC.moved(_ceilings(9.48e10, 6.41e9, quick=False), old) == []
    elsewhere = _ceilings(9.48e10, 6.41e9)
    elsewhere["machine"] = {"hostname": "other"}
    assert CC.moved(elsewhere, old) == [] and CC.moved(new, {}) == []


def test_ceilings_flags_a_figure_that_moved_from_the_file_it_replaces(cli, tmp_path, monkeypatch):
    """`scalelab ceilings` over its own earlier file: the warning on stderr, `moved` in the
    JSON (the measurement itself replaced by a constructed one: this tests the comparison)."""
    path = tmp_path / "ceilings.json"
    path.write_text(json.dumps(_ceilings(1.94e11, 4.67e10)))
    fresh = _ceilings(9.48e10, 4.6e10)
    local = {k: fresh[k] for k in ("device", "quick", "gemm_flops", "mem_bw", "mem_bw_detail")}
    monkeypatch.setattr(C, "measure_local", lambda device, quick, quiet=False: local)
    code, out, err = cli("ceilings", "--quick", "--quiet", "--no-comm", "--device", "cpu",
                         "-o", path)  # fmt: skip
    assert code == 0, err
    data = json.loads(path.read_text())
    assert [m["what"] for m in data["moved"]] == ["fp32 GEMM"], data["moved"]
    said = "ceiling moved: fp32 GEMM 9.48e+10 FLOP/s is 2.05x off"
    assert any(w.startswith(said) for w in data["warnings"]), data["warnings"]
    assert said in out  # the summary's WARNING line; stderr counts them and points there
    assert "figure(s) suspect" in err


# --- the audit can fail ------------------------------------------------------------------------
def _audit_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("demo_audit", ROOT / "benchmarks" /
                                                      "demo_audit.py")  # fmt: skip
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_demo_audit_finds_an_unflagged_rank_skew_and_a_nan():
    audit = _audit_module()
    rec = {"id": "r1", "status": "ok", "workload": "mlp", "mode": "infer", "ranks": 2,
           "wall_s": 0.241, "rank_walls_s": [0.241, 0.624], "warnings": []}  # fmt: skip
    assert audit.check_skew([rec])["status"] == audit.UNFLAGGED
    rec["warnings"] = ["rank skew: rank 1's wall 624 ms is 2.59x the run's 241 ms (rank 0's)"]
    assert audit.check_skew([rec])["status"] == audit.FLAGGED
    assert audit.check_nan("<td>fits, nan ms</td>", None)["status"] == audit.UNFLAGGED
    assert audit.check_nan("<td>fits, 1.2 ms</td>", "nanoseconds")["status"] == audit.ABSENT


def test_the_two_copy_ceilings_name_their_working_sets():
    """The demo's report showed 'memory copy (cpu, read + write) 22.6 GB/s' (torch, 16 MiB)
    beside 'CPU memory copy, one core 38.77 GB/s' (NumPy, 8 MiB per thread: L3 on a 32 MiB
    L3 host); each row now says the working set it measured."""
    from scalelab.analysis.report_context import _ceiling_rows

    data = _ceilings(1e11, 2.26e10)
    data["cpu_mem_bw"] = {"one_core": 3.88e10, "all_cores": 4.88e10, "bytes_per_thread": 8 << 20}
    labels = [label for label, _, _ in _ceiling_rows(data)]
    assert "memory copy (cpu, read + write, 16 MiB)" in labels, labels
    assert "CPU memory copy, one core, 8 MiB per thread" in labels, labels


def test_a_superlinear_versions_row_is_flagged_in_its_table():
    """The demo beside two busy processes per core: `mpi` on 2 ranks 4.53x faster than
    `local` (one thread each), every row warned only 'host busy'. The versions table now
    says it beside the speedup; a row within 1.5 x ranks says nothing."""
    from scalelab.analysis.report_context import versions_section

    def rec(strategy: str, ranks: int, wall_s: float, split: str | None = None) -> dict:
        return {"id": strategy + str(wall_s), "status": "ok", "workload": "alexnet",
                "strategy": strategy, "mode": "infer", "ranks": ranks, "precision": "fp32",
                "wall_s": wall_s, "items": 4, "relerr": 1e-7, "check_passed": True,
                "versions": "v1", "warnings": ["host busy: other processes kept 1.9 of 2"],
                "config": {"device": "cpu", "split": split, "batch": 4, "image_size": 67},
                }  # fmt: skip

    records = [rec("local", 1, 0.0905), rec("mpi", 2, 0.0200, "batch"),
               rec("mpi", 2, 0.0400, "spatial")]  # fmt: skip
    _, _, body = versions_section(records, strategy_roles())
    assert body.count("superlinear: 2 ranks") == 1, body
    assert "superlinear: 2 ranks 4.5x local" in body
