"""The inference check explains itself: where the error entered, a bound that fits
the model, one verdict under every launcher, and MPI loaded only where it is used.

Models (tests/programs/check_nets.py) lose precision on purpose: a Linear computed in bf16
inside an fp32 model, the same Linear only on ranks other than 0 (a split worse than one
process in the same dtype), a transformer whose second attention runs under bf16 autocast (a
reduced-precision kernel path forced on the CPU). References are the float64 module.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scalelab.config import RunConfig
from scalelab.run.check import FACTOR, derive_bound
from scalelab.run.runner import execute

NETS = Path(__file__).parent / "programs" / "check_nets.py"
INFER = dict(workload="model", batch=8, iters=1, warmup=0, check=True, quiet=True, threads=1)
MLP = dict(INFER, model=f"{NETS}:imprecise", input_shape="16")
TRANSFORMER = dict(INFER, model=f"{NETS}:transformer", input_shape="6,16")


def _run(**kw) -> dict:
    report = execute(RunConfig(**kw), None)
    assert report.exit_code == (1 if report.record["status"] == "check-failed" else 0)
    return report.record


def test_a_bf16_layer_in_an_fp32_model_fails_and_is_named():
    rec = _run(**MLP)
    assert rec["status"] == "check-failed" and not rec["check_passed"]
    assert rec["relerr"] > 1e-4 and rec["tolerance"] == 1e-5
    cause = rec["explain"]["cause"]
    assert cause["module"] == "2" and cause["kind"] == "Bf16Linear", cause
    assert cause["in_err"] < 1e-6 < 1e-4 < cause["own_err"]  # entered there, not carried in
    rows = {m["module"]: m for m in rec["explain"]["modules"]}
    assert rows["4"]["in_err"] > 1e-4 and rows["4"]["own_err"] < 1e-6  # carried, not made


def test_the_same_model_with_the_layer_fixed_passes_and_explains_nothing():
    rec = _run(**MLP, model_arg=("bad=0",), explain=True)
    assert rec["status"] == "ok" and rec["relerr"] < 1e-6
    assert rec["explain"]["cause"] is None and len(rec["explain"]["modules"]) == 6
    assert rec["tolerance_basis"].startswith("the fp32 tolerance")


def test_tolerance_overrides_the_derived_bound():
    rec = _run(**MLP, tolerance=0.05)
    assert rec["status"] == "ok" and rec["tolerance"] == 0.05
    assert rec["tolerance_basis"] == "--tolerance" and "explain" not in rec


def test_an_fp32_transformer_losing_precision_in_one_kernel_is_explained():
    """The second layer's attention under bf16 autocast: named, with the dtype it computed in;
    without it the same transformer passes and no module is flagged."""
    rec = _run(**TRANSFORMER, model_arg=("low_attn=1",))
    assert rec["status"] == "check-failed"
    cause = rec["explain"]["cause"]
    assert cause["module"] == "1.self_attn" and "bfloat16" in cause["kernel"], cause
    clean = _run(**TRANSFORMER, explain=True)
    assert clean["status"] == "ok" and clean["explain"]["cause"] is None


def test_derived_bounds():
    # one process: the floor, or the a-priori bound when it is larger
    assert derive_bound(None, 1e-5, 2e-6, None, "fp32").value == 1e-5
    assert derive_bound(None, 1e-5, 3e-5, None, "fp32").basis.startswith("a-priori")
    # a strategy: FACTOR x one process, never below the floor
    assert derive_bound(None, 1e-5, 0.0, 1e-7, "fp32").value == 1e-5
    assert derive_bound(None, 1e-2, 0.0, 4e-3, "bf16").value == pytest.approx(FACTOR * 4e-3)
    # one process over its own bound: the dtype lost it, the strategy is held to that bound
    held = derive_bound(None, 1e-5, 0.0, 2e-4, "fp32")
    assert held.value == 1e-5 and "already exceeds" in held.basis
    assert derive_bound(3e-3, 1e-5, 0.0, 2e-4, "fp32").value == 3e-3


# --- launched jobs: one verdict ----------------------------------------------------------------
def _cli(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[int, list[str], list]:
    out = tmp_path / "runs.jsonl"
    cmd = [sys.executable, "-m", "scalelab", "run", *args, "--out", str(out), "-q"]
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=full)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("scalelab")]
    recs = [json.loads(ln) for ln in out.read_text().splitlines()] if out.exists() else []
    return proc.returncode, [ln for ln in lines if "warning" not in ln], recs


SPLIT = ["model", "--model", f"{NETS}:rank_imprecise", "--input-shape", "16", "--check",
         "--batch", "8", "--iters", "1", "--warmup", "0", "--threads", "1",
         "--ranks", "2"]  # fmt: skip


@pytest.mark.mpi
def test_under_mpiexec_a_split_worse_than_one_process_fails_in_one_line(tmp_path):
    code, lines, recs = _cli(tmp_path, *SPLIT, "--strategy", "mpi")
    assert code == 1 and len(lines) == 1 and "check failed" in lines[0], lines
    assert "the split lost it" in lines[0] and "died" not in lines[0]
    (rec,) = recs
    assert rec["status"] == "check-failed" and rec["one_process_relerr"] < 1e-6
    good_code, good_lines, good = _cli(tmp_path, *SPLIT, "--strategy", "mpi", "--model-arg",
                                       "good=1")  # fmt: skip
    assert good_code == 0 and not good_lines and good[-1]["status"] == "ok"
    assert good[-1]["relerr"] <= FACTOR * good[-1]["one_process_relerr"]


def test_under_torchrun_a_failed_check_is_not_a_dead_rank(tmp_path):
    code, lines, recs = _cli(tmp_path, *SPLIT, "--strategy", "nccl")
    assert code == 1 and len(lines) == 1 and "check failed" in lines[0], lines
    assert "exited" not in lines[0] and recs[-1]["status"] == "check-failed"


# --- MPI only where it is used -----------------------------------------------------------------
def test_without_an_mpi_library_only_mpi_strategies_are_refused(tmp_path):
    """mpi4py installed, its library not loadable (MPI4PY_LIBMPI names a missing file)."""
    pytest.importorskip("mpi4py")
    gone = {"MPI4PY_LIBMPI": str(tmp_path / "no" / "libmpi.so")}
    small = ["--batch", "2", "--iters", "1", "--warmup", "0", "--threads", "1"]
    code, lines, recs = _cli(tmp_path, "mlp", *small, "--check", env=gone)
    assert code == 0 and not lines and recs[-1]["status"] == "ok", lines
    assert recs[-1]["env"]["mpi_library"] is None
    code, lines, recs = _cli(tmp_path, "alexnet", "--strategy", "mpi", "--ranks", "2", env=gone)
    assert code == 2 and len(lines) == 1 and len(recs) == 1, lines
    assert "finds no MPI library" in lines[0] and 'pip install "scalelab[mpich]"' in lines[0]
    assert "module load" in lines[0]
    env = subprocess.run([sys.executable, "-m", "scalelab", "env", "--json"], capture_output=True,
                         text=True, env={**os.environ, **gone}, timeout=120)  # fmt: skip
    assert "finds no MPI library" in json.loads(env.stdout)["mpi_problem"]


def test_versions_report_and_the_schema_read_check_failed():
    """A failed check is a finished run (its timings stand) that says check-failed."""
    pytest.importorskip("pandas")
    from scalelab.analysis.frame import ok_records, records_frame
    from scalelab.cli.commands.versions_table import format_table
    from scalelab.cli.commands.versions_variants import Variant
    from scalelab.record_schema import problem

    rec = _run(**MLP)
    assert problem(rec) is None and ok_records([rec]) == [rec]
    assert list(records_frame([rec])["status"]) == ["check-failed"]
    assert "check-failed" in format_table([(Variant("local", "local"), rec)])


def test_strict_fp32_turns_reduced_precision_kernels_off_and_back():
    import torch

    from scalelab.precision import strict_fp32

    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True  # cuDNN may use TF32 for fp32 convolutions
    try:
        with strict_fp32(True):
            assert not torch.backends.cuda.matmul.allow_tf32
            assert not torch.backends.cudnn.allow_tf32
            assert torch.backends.cuda.math_sdp_enabled()
            assert not torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.flash_sdp_enabled()
        rec = _run(**MLP, model_arg=("bad=0",), strict_fp32=True)
        assert rec["status"] == "ok" and rec["config"]["strict_fp32"]
        assert torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32 = before
