"""The demo study (orchestration/demo.py): pieces this install or machine lacks are skipped
with a note, real pieces run as their own processes, the report is written, and a second run
resumes instead of measuring again. Only the mlp training piece runs here (the others are
exercised by their own tests); it trains the same function on 1 and 2 ranks."""

import pytest

from scalelab.errors import UsageError
from scalelab.record import read_records


@pytest.mark.mpi
def test_demo_degrades_and_resumes(tmp_path, monkeypatch):
    from scalelab.orchestration import demo as demo_study

    def absent(self):
        raise UsageError("not on this machine")

    for piece in ("ceilings", "versions", "scaling", "per_layer"):
        monkeypatch.setattr(demo_study.Demo, piece, absent)
    lines = []
    code = demo_study.run_demo(tmp_path, quick=True, echo=lines.append)
    assert code == 0, "\n".join(lines)
    recs = read_records(tmp_path / "runs.jsonl")
    assert [(r["strategy"], r["ranks"], r["mode"]) for r in recs] == [
        ("mpi-dp", 1, "train"),
        ("mpi-dp", 2, "train"),
    ]
    # Data parallelism on 2 ranks trains the same model as 1 rank (up to summation order).
    assert recs[1]["loss"] == pytest.approx(recs[0]["loss"], rel=1e-4)
    page = (tmp_path / "report" / "index.html").read_text()
    assert "<h2>Demo steps</h2>" in page and page.count("not on this machine") == 4
    assert "mlp mpi-dp fp32 cpu train x2" in page  # convergence and phase tables
    assert any(line.startswith("report: ") for line in lines)

    lines.clear()
    assert demo_study.run_demo(tmp_path, quick=True, echo=lines.append) == 0
    assert len(read_records(tmp_path / "runs.jsonl")) == 2  # resumed: nothing ran again
    assert sum("already, skipped" in line for line in lines) == 2
