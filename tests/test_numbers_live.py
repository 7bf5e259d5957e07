"""Live runs on a deliberately disturbed host: a load generator (busy processes, one per CPU
this job may use) runs beside them, and the numbers must say so: warnings in the record and
on stderr, phases still inside every rank's wall, ceilings that satisfy their relations or say
which they break, and roofline points above their roof flagged in the report. Sizes are tiny;
the assertions are invariants, never speeds."""

import json
import subprocess
import sys

import pytest

from scalelab.analysis import phases, roofline
from scalelab.instrument import ceiling_checks as CC
from scalelab.instrument import host_checks as H
from scalelab.record import read_records


@pytest.fixture
def busy_host():
    """Two spinning processes per CPU we may use (a run's fair share is then well below what
    it asks for: with one more than the CPUs, a 1-thread run on 2 CPUs left others 1.5 CPUs
    against the 1.25 that warns, and a short run's boosted first slices fell below it),
    stopped by pid when the test ends; yields the CPUs we may use."""
    cpus = max(int(H.cpu_allowance()[0]), 1)
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(2 * cpus)]
    try:
        yield cpus
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


CPUS = max(int(H.cpu_allowance()[0]), 1)


def _scalelab(*args, timeout=300):
    cmd = [sys.executable, "-m", "scalelab", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_training_on_a_busy_host_is_warned_with_its_steady_rate(busy_host, cli, tmp_path):
    out = tmp_path / "runs.jsonl"
    code, stdout, err = cli(
        "run", "mlp", "--train", "--epochs", "2", "--batch", "50", "--hidden", "32",
        "--train-size", "600", "--heldout-size", "100", "--threads", "1", "--quiet",
        "--out", out,
    )  # fmt: skip
    assert code == 0, err
    (rec,) = read_records(out)
    assert any(w.startswith("host busy") for w in rec["warnings"]), rec["host"]
    warned = [line for line in err.splitlines() if line.startswith("scalelab: warning:")]
    assert len(warned) == 1 and "host busy" in warned[0]
    assert "WARNING: host busy" in stdout and "steady" in stdout
    assert rec["time_to_train_s"] == pytest.approx(rec["wall_s"])
    steady = rec["steady"]
    assert steady["items"] <= rec["items"] and steady["seconds"] <= rec["time_to_train_s"]
    assert rec["steady_throughput"] == pytest.approx(steady["items"] / steady["seconds"])
    assert not phases.phase_accounting(rec)["exceeds"].any()


@pytest.mark.mpi
def test_oversubscribed_mpi_run_is_warned_and_its_phases_add_up(busy_host, tmp_path):
    ranks = busy_host + 1  # one more rank than the CPUs we may use
    if ranks > 5:
        pytest.skip(f"{busy_host} CPUs: an oversubscribed run would start {ranks} ranks")
    out = tmp_path / "runs.jsonl"
    proc = _scalelab(
        "run", "alexnet", "--image-size", 67, "--batch", ranks, "--strategy", "mpi",
        "--split", "spatial", "--ranks", ranks, "--iters", 3, "--warmup", 1, "--threads", 1,
        "--out", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rec,) = read_records(out)
    assert any(f"{ranks} processes on" in w for w in rec["warnings"]), rec["warnings"]
    assert len(rec["rank_wall_s"]) == ranks == len(rec["rank_phases"])
    acc = phases.phase_accounting(rec)
    assert not acc["exceeds"].any(), acc
    assert "scalelab: warning:" in proc.stderr
    # The per-rank table, the summary and the record show the same iteration of each rank.
    rows = {}
    for line in proc.stdout.splitlines():  # table rows: a name, then one number per rank
        name, *cells = line.split() or [""]
        if len(cells) == ranks and all(c.replace(".", "", 1).isdigit() for c in cells):
            rows[name] = cells
    for r, (ph, wall) in enumerate(zip(rec["rank_phases"], rec["rank_wall_s"])):
        assert float(rows["wall"][r]) == pytest.approx(wall * 1e3, abs=1e-3)
        assert float(rows["compute"][r]) == pytest.approx(ph["compute"] * 1e3, abs=1e-3)
    assert f"compute {rec['phases']['compute'] * 1e3:.2f} ms" in proc.stdout  # the summary
    assert rec["phases"] == rec["rank_phases"][0] and rec["wall_s"] == rec["rank_wall_s"][0]


def test_ceilings_and_report_on_a_busy_host(busy_host, cli, tmp_path):
    """Ceilings measured under load (in-process, quick sizes, GEMM and host sections) keep
    their relations or name the broken ones; a per-layer run's roofline flags every point
    above its roof, and the report shows the flag and the run's warnings."""
    import torch

    from scalelab.cli.commands.ceilings import checked_local
    from scalelab.instrument import ceilings as C

    cpu = torch.device("cpu")
    plan = C.Plan.make(cpu, quick=True)
    data = {"device": "cpu", "gemm_flops": C.gemm_flops(cpu, plan, ["fp64", "fp32"])}
    data.update(C.host_ceilings(plan))
    data["mem_bw"] = data["cpu_mem_bw"]["all_cores"]
    checked_local(data, cpu, quick=True)
    broken = [f"implausible ceiling: {why}" for _, why in CC.violations(data)]
    assert set(broken) <= set(data["warnings"])  # never silent
    for key in ("cpu_gemm_flops", "cpu_mem_bw"):  # n cores can always do what one does
        assert data[key]["all_cores"] >= data[key]["one_core"]
    results = tmp_path / "results"
    results.mkdir()
    (results / "ceilings.json").write_text(json.dumps(C.new_ceilings(data)))
    code, _, err = cli(
        "run",
        "mlp",
        "--batch",
        64,
        "--hidden",
        256,
        "--per-layer",
        "--iters",
        20,  # a window of many 10 ms scheduler ticks: /proc/stat counts CPU time in them
        "--quiet",
        "--threads",
        CPUS,
        "--out",
        results / "runs.jsonl",
    )  # fmt: skip  (every CPU asked for: any busy process is load beyond what it left free)
    assert code == 0, err
    recs = read_records(results / "runs.jsonl")
    df = roofline.layer_roofline(recs, data)
    above = df["fraction"] > 1.0
    assert not df.empty and (df.loc[above, "flag"] == roofline.UNDER_MEASURED).all()
    assert (df.loc[~above, "flag"] == "").all()
    code, _, err = cli("report", results, "-o", tmp_path / "report", "--no-plots")
    assert code == 0, err
    page = (tmp_path / "report" / "index.html").read_text()
    assert (roofline.UNDER_MEASURED in page) == bool(above.any())
    assert recs[0]["warnings"] and all(w.split(":")[0] in page for w in recs[0]["warnings"])
