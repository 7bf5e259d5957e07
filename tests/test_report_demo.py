"""The demo's report, rendered from what a demo run wrote on a 2-core host without a GPU
(tests/fixtures/demo): one row per host, the waits of a multi-rank run, two figures of one
quantity that disagree flagged with the reason, a section with nothing to show on a CPU says
so, and the convergence table says which loss and which accuracy."""

import re
import shutil
from pathlib import Path

import pytest

from scalelab.analysis import load_records
from scalelab.analysis import system_roofline as sysroof
from scalelab.analysis.report import write_report
from scalelab.analysis.roofline import read_ceilings
from scalelab.orchestration.strategy_roles import strategy_roles

DEMO = Path(__file__).parent / "fixtures" / "demo"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-report")
    shutil.copy(DEMO / "runs.jsonl", out / "runs.jsonl")
    records = load_records(out / "runs.jsonl")
    path = write_report(
        records, out / "report", read_ceilings(DEMO / "ceilings.json"), plots=False,
        roles=strategy_roles(),
    )  # fmt: skip
    return path.read_text()


def section(page: str, anchor: str) -> str:
    return re.search(rf'<section id="{anchor}">(.*?)</section>', page, re.S)[1]


def test_one_environment_row_per_host_with_the_fields_merged(page):
    records = load_records(DEMO / "runs.jsonl")
    assert {(r.get("env") or {}).get("mpi_library") is None for r in records} == {True, False}
    env = section(page, "env")
    assert env.count("<tr>") == 2  # the header and the one host
    assert ">MPICH Version:" in env and f">{len(records)}</td>" in env  # every run counted


def test_waiting_vs_working_shows_the_multi_rank_runs_timeline(page):
    waits = section(page, "waits")
    assert "No multi-rank run carries a timeline" not in waits
    assert "alexnet mpi x2" in waits and "alexnet mpi x1" not in waits  # one rank waits for none
    head = re.search(r"<tr>(.*?)</tr>", waits, re.S)[1]
    assert all(f">{part}</th>" in head for part in ("rank", "compute", "transfer", "wait"))


def test_the_runs_all_reduce_fit_and_the_ceiling_are_flagged_where_they_disagree(page):
    roof = section(page, "roofline")
    (flag,) = re.findall(r"<li>(all-reduce latency[^<]*)</li>", roof)
    assert "1.24e+03 us" in flag and "mpi x2 12.1 us" in flag and "102x apart" in flag
    assert "waiting for the slower rank" in flag  # the reason they differ
    assert "all-reduce bandwidth" not in roof  # 2.35 vs 1.55 GB/s: within 2x, not flagged


def test_figures_within_twice_each_other_agree_and_further_apart_are_flagged():
    ceilings = {"comm": {"mpi": {"ranks": 2, "allreduce": {"alpha_s": 1e-5, "beta_Bps": 1e9}}}}
    near = sysroof.SystemPeaks(1e10, None, 1e9, 0.0, 3, alpha_s=1.9e-5, beta_Bps=0.6e9)
    assert sysroof.against_ceilings(near, ceilings, "mpi") == []
    far = sysroof.SystemPeaks(1e10, None, 1e9, 0.0, 3, alpha_s=-4e-6, beta_Bps=3e9)
    lines = sysroof.against_ceilings(far, ceilings, "mpi")
    assert [line.split(":")[0] for line in lines] == [
        "all-reduce latency (alpha)",
        "all-reduce bandwidth (beta)",
    ]
    assert "one of them not positive" in lines[0] and "(3x apart)" in lines[1]
    assert sysroof.against_ceilings(far, ceilings, "gloo") == []  # another backend's ceiling


def test_memory_and_power_say_in_one_line_that_a_cpu_measures_neither(page):
    memory = section(page, "memory")
    assert memory.count("No memory or power measured") == 1
    assert "<th" in memory and ">peak_MB<" not in memory and ">power_W<" not in memory


def test_the_convergence_table_says_which_loss_and_which_accuracy(page):
    conv = section(page, "convergence")
    assert ">training loss</th>" in conv and ">held-out accuracy</th>" in conv
    assert "final_loss" not in conv and "final_accuracy" not in conv


def test_the_demo_records_a_timeline_in_its_multi_rank_scaling_sweep(tmp_path, monkeypatch):
    from scalelab.orchestration import demo as demo_study

    seen = {}
    monkeypatch.setattr(demo_study.Demo, "sweep", lambda self, name, grid, fixed: seen.update(
        {name: (grid, fixed)}) or "")  # fmt: skip
    demo = demo_study.Demo(tmp_path, None, quick=True, force=False, echo=lambda line: None)
    demo.scaling()
    grid, fixed = seen["demo-scaling"]
    assert fixed["timeline"] is True and max(grid["ranks"]) >= 2
