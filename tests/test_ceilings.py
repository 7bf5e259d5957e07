"""`scalelab ceilings`: plausible CPU measurements, the alpha-beta fit against exact data, a
real 2-rank MPI measurement, the datasheet table, and bad input (files that are not ceilings,
ceilings of another machine)."""

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import can_clone
from scalelab.errors import UsageError
from scalelab.instrument import ceilings as C
from scalelab.instrument.comm_bench import fit_alpha_beta, message_sizes
from scalelab.instrument.peaks import PEAKS, datasheet_peak


@pytest.fixture(scope="module")
def cpu_ceilings(request, tmp_path_factory):
    """One `scalelab ceilings --quick` on the CPU shared by the tests below: README's line,
    run once per test run in the shared fresh clone (test_readme.py reads the same run), where
    no GPU makes it measure the CPU; else `--device cpu` run here. (path, stdout, the path as
    the command was given it)."""
    if not torch.cuda.is_available() and can_clone():
        clone = request.getfixturevalue("readme_clone")
        done = clone.run("scalelab ceilings --quick")
        assert done.returncode == 0, done.stderr[-2000:]
        given = "scalelab-results/ceilings.json"  # the default --out, in the clone
        # the file as this line wrote it: a later README line measures ceilings into it again
        return clone.written("scalelab ceilings --quick", given), done.stdout, given
    path = tmp_path_factory.mktemp("ceil") / "ceilings.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scalelab", "ceilings", "--quick", "--device", "cpu", "-o", path],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return path, proc.stdout, str(path)


def _positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_each_ceilings_warning_is_said_once(cpu_ceilings, request):
    """In the summary's WARNING lines; stderr counts them in one short line (it once repeated
    them all joined into one line of ~1,000 characters)."""
    if torch.cuda.is_available() or not can_clone():
        pytest.skip("reads the README clone's CPU run")
    done = request.getfixturevalue("readme_clone").run("scalelab ceilings --quick")
    warnings = C.load_ceilings(cpu_ceilings[0]).get("warnings") or []
    for warning in warnings:
        assert (done.stdout + done.stderr).count(warning) == 1, warning
    said = [line for line in done.stderr.splitlines() if "ceilings: warning" in line]
    assert len(said) == (1 if warnings else 0) and all(len(line) < 160 for line in said)


def test_cpu_ceilings_are_plausible(cpu_ceilings):
    path, out, given = cpu_ceilings
    data = C.load_ceilings(path)
    assert data["schema"] == C.SCHEMA and data["device"] == "cpu" and data["quick"]
    cores = data["machine"]["cpu_cores"]
    # The keys analyses read, with rates a CPU can reach: above 10 MFLOP/s and 100 MB/s,
    # below 1 TFLOP/s per core (AVX-512 FMA at 5 GHz is 160 GFLOP/s fp64) and 1 TB/s.
    for dtype in ("fp64", "fp32", "tf32", "bf16"):
        assert 1e7 < data["gemm_flops"][dtype] < 1e12 * cores, dtype
    assert data["gemm_flops"]["tf32"] == data["gemm_flops"]["fp32"]
    assert all(_positive(r["seconds"]) for r in data["gemm_flops"]["detail"]["fp64"])
    assert 1e8 < data["mem_bw"] < 1e12
    for key in ("one_core", "all_cores"):
        assert 1e7 < data["cpu_gemm_flops"][key] < 1e12 * cores
        assert 1e8 < data["cpu_mem_bw"][key] < 1e12
    assert data["cpu_gemm_flops"]["cores"] == cores
    assert "h2d" not in data  # no GPU
    # MPI alpha-beta over 2 ranks by default when MPI is installed (this suite's [mpi] extra)
    from scalelab.cli.commands.ceilings import mpi_available

    if mpi_available():
        mpi = data["comm"]["mpi"]
        assert mpi["ranks"] == 2 and mpi["p2p"]["beta_Bps"] > 0 and "mpi x2 p2p" in out
    else:
        assert "comm" not in data
    # Self-checked: every relation holds, or the file says which one does not.
    from scalelab.instrument.ceiling_checks import violations

    assert {f"implausible ceiling: {w}" for _, w in violations(data)} <= set(data["warnings"])
    assert data["passes"]["gemm"] >= 1 and data["passes"]["host"] >= 1
    for key in ("cpu_gemm_flops", "cpu_mem_bw"):
        assert data[key]["all_cores"] >= data[key]["one_core"]
    conc = data["cpu_concurrency"]  # part of every default run (not only --comm-only ones)
    assert conc["ranks"][0] == 1 and conc["ranks"][-1] == cores and conc["slowdown"][0] == 1.0
    assert len(conc["slowdown"]) == len(conc["ranks"]) and "CPU processes at once" in out
    assert "GEMM cpu fp32" in out and given in out


def test_gemm_rate_matches_its_detail(cpu_ceilings):
    gemm = C.read_ceilings(cpu_ceilings[0])["gemm_flops"]
    for dtype, rows in gemm["detail"].items():
        for r in rows:
            assert r["flops"] == pytest.approx(2 * r["n"] ** 3 / r["seconds"])
        assert gemm[dtype] == max(r["flops"] for r in rows)


def test_alpha_beta_fit_recovers_exact_data():
    alpha, beta = 3.5e-6, 12.5e9
    points = [(n, alpha + n / beta) for n in message_sizes(64 << 20)]
    got_alpha, got_beta = fit_alpha_beta(points)
    assert got_alpha == pytest.approx(alpha, rel=1e-9)
    assert got_beta == pytest.approx(beta, rel=1e-9)


def test_alpha_beta_fit_stays_finite_when_times_do_not_grow_with_the_size():
    """A busy host (CI's once): the 1 MiB message timed faster than the 8-byte one, so no
    positive slope fits; beta is the best rate seen, finite, so the file loads again."""
    points = [(8, 2e-4), (4096, 1.5e-4), (1 << 20, 1e-4)]
    alpha, beta = fit_alpha_beta(points)
    assert alpha >= 0 and math.isfinite(beta)
    assert beta == pytest.approx(max(n / t for n, t in points))


def test_alpha_beta_fit_clamps_negative_latency():
    # Small messages faster than the bandwidth line predicts: the free fit's alpha is < 0.
    points = [(1 << 16, 3e-6), (1 << 20, 1e-4), (4 << 20, 4e-4)]
    alpha, beta = fit_alpha_beta(points)
    # Refit through the origin: beta = sum(w^2) / sum(w) of the points' w = n / t, a mean
    # weighted by w, so it lies between the slowest and the fastest point.
    w = [n / t for n, t in points]
    assert alpha == 0.0 and beta == pytest.approx(sum(x * x for x in w) / sum(w))
    assert min(w) <= beta <= max(w)
    with pytest.raises(ValueError):
        fit_alpha_beta([(8, 1e-6)])


@pytest.mark.mpi
def test_two_rank_mpi_ceilings(tmp_path):
    path = tmp_path / "c.json"
    cmd = [sys.executable, "-m", "scalelab", "ceilings", "--quick", "--comm-only",
           "--ranks", "2", "-o", str(path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    mpi = C.load_ceilings(path)["comm"]["mpi"]
    assert mpi["ranks"] == 2 and mpi["device"] == "cpu"
    for op in ("allreduce", "p2p"):
        res = mpi[op]
        assert _positive(res["beta_Bps"]) and res["alpha_s"] >= 0
        assert [n for n, _ in res["points"]] == message_sizes(1 << 20, factor=16)
        assert all(_positive(t) for _, t in res["points"])
        # Shared-memory MPI: latency under 10 ms, bandwidth above 10 MB/s.
        assert res["alpha_s"] < 1e-2 and res["beta_Bps"] > 1e7
    assert "mpi x2 p2p" in proc.stdout


def test_datasheet_table_is_cited_and_matches_torch_names():
    assert datasheet_peak("NVIDIA H100 80GB HBM3").name == "H100 SXM5"
    assert datasheet_peak("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert datasheet_peak("NVIDIA H200").name == "H200 SXM"
    assert datasheet_peak("NVIDIA A100-SXM4-40GB").name == "A100 SXM4 40GB"
    assert datasheet_peak("NVIDIA A100 80GB PCIe").name == "A100 PCIe 80GB"
    assert datasheet_peak("Tesla V100-SXM2-32GB").name == "V100 SXM2"
    assert datasheet_peak("NVIDIA GeForce GTX 1080 Ti") is None and datasheet_peak(None) is None
    for row in PEAKS:
        assert "https://" in row.source and row.mem_Bps > 1e11
        # Dense tensor-core rates are never below the plain FP32 rate of the same part.
        assert all(r is None or r >= row.fp32 for r in (row.tf32, row.bf16, row.fp16)), row


def test_peaks_flag_prints_the_table(cli):
    code, out, _ = cli("ceilings", "--peaks")
    assert code == 0 and "H100 SXM5" in out and "sources:" in out


@pytest.mark.parametrize(
    "content, needle",
    [("not json {", "not JSON"), ('{"schema": "scalelab.run/1"}', "not a ceilings file"),
     ("[1, 2]", "not a ceilings file")],
)  # fmt: skip
def test_not_a_ceilings_file(tmp_path, content, needle):
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(UsageError, match=needle):
        C.load_ceilings(path)


def test_ceilings_refuses_to_overwrite_another_file(cli, tmp_path):
    path = tmp_path / "runs.json"
    path.write_text('{"schema": "scalelab.run/1"}')
    code, _, err = cli("ceilings", "--quick", "-o", path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not a ceilings file" in err
    assert json.loads(path.read_text()) == {"schema": "scalelab.run/1"}


def test_ceilings_of_another_machine_warn(cpu_ceilings, tmp_path, capsys):
    data = C.read_ceilings(cpu_ceilings[0])
    data["machine"].update(hostname="gpu-node-7", gpu="NVIDIA H100 80GB HBM3")
    other = tmp_path / "other.json"
    C.write_ceilings(other, data)
    assert C.load_ceilings(other)["gemm_flops"] == data["gemm_flops"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another machine" in err[0] and "gpu-node-7" in err[0]
    C.load_ceilings(cpu_ceilings[0])  # this machine's own file: silent
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "args, needle",
    [(["--comm-only", "--ranks", "1"], "--ranks"), (["--ranks", "0"], "--ranks must be >= 1"),
     (["--no-comm", "--ranks", "2"], "contradict"),
     (["--backend", "nccl", "--ranks", "2"], "GPU per rank")],
)  # fmt: skip
def test_bad_ceilings_flags(cli, tmp_path, args, needle):
    if "nccl" in args and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    code, _, err = cli("ceilings", "-o", tmp_path / "c.json", *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_ceilings_below_datasheet():
    local = C.measure_local(torch.device("cuda"), quick=True, quiet=True)
    peak = datasheet_peak(torch.cuda.get_device_name(0))
    assert local["gemm_flops"]["fp16"] > local["gemm_flops"]["fp32"]  # tensor cores
    assert local["h2d"]["pinned"] > 1e9 and local["d2h"]["pinned"] > 1e9
    if peak is not None:
        for dtype in ("fp64", "fp32", "tf32", "bf16", "fp16"):
            assert local["gemm_flops"][dtype] < 1.05 * peak.flops(dtype), dtype
        assert 0.3 * peak.mem_Bps < local["mem_bw"] < 1.05 * peak.mem_Bps
        assert local["h2d"]["pinned"] < 1.05 * peak.pcie_bidir_Bps / 2
