"""`scalelab report`: contents of the page checked against the fixtures' known answers, and
the page rendered headless by Chromium (skipped only where Chromium is absent) to a
screenshot that must show a real page."""

import base64
import re
import shutil
import subprocess
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One report over every fixture record (with the matching ceilings beside them)."""
    from scalelab.cli.main import main

    root = tmp_path_factory.mktemp("rep")
    results = root / "results"
    results.mkdir()
    for f in FIXTURES.glob("*.jsonl"):
        shutil.copy(f, results / f.name)
    shutil.copy(FIXTURES / "ceilings_cpu.json", results / "ceilings.json")
    assert main(["report", str(results), "-o", str(root / "out"), "--title", "Fixture study"]) == 0
    return root / "out"


def test_report_contents(report):
    page = (report / "index.html").read_text()
    for heading in (
        "Environment",
        "Ceilings",
        "Versions",
        "All runs",
        "Per-rank phases",
        "Scaling",
        "Roofline",
        "Convergence",
        "Memory and power per layer",
    ):
        assert f"<h2>{heading}</h2>" in page
    assert "<title>Fixture study</title>" in page
    assert ">0.909<" in page and ">0.800<" in page  # strong and weak E2, E4
    assert "P_flops = 2e+10 FLOP/s" in page and ">network<" in page  # system roofline
    assert ">18.57<" in page and ">compute<" in page  # fc1's AI and bound
    assert "RuntimeError: boom" in page  # the failed point is listed
    assert ">1.00x<" in page  # per-rank imbalance rows
    # Self-contained: no scripts, nothing fetched; every image embedded as PNG data (its file
    # beside the page too).
    assert "<script" not in page and not re.search(r"(src|href)=\"(https?:)?//", page)
    images = re.findall(r'<img src="data:image/png;base64,([^"]+)" data-file="([^"]+)"', page)
    assert len(images) == 6 and len(images) == page.count("<img")
    for data, name in images:
        assert base64.b64decode(data) == (report / name).read_bytes()
    assert (report / "scaling.csv").read_text().count("\n") == 7  # header + 6 points


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium not installed (apt-get install chromium)")
def test_report_renders_headless(report, tmp_path):
    import matplotlib.image as mpimg
    import numpy as np

    shot = tmp_path / "page.png"
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1280,2000",
            (report / "index.html").as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pixels = mpimg.imread(shot)[..., :3]  # (2000, 1280, 3) floats in [0, 1]
    assert pixels.shape[:2] == (2000, 1280)
    ink = (pixels.mean(axis=2) < 0.5).mean()  # dark text and lines
    assert 0.005 < ink < 0.5, ink  # a page with text, not blank and not an error slab
    assert np.unique(pixels.reshape(-1, 3).round(2), axis=0).shape[0] > 50  # tables, colours


def test_report_without_matplotlib(cli, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, _, err = cli("report", FIXTURES / "scaling_strong.jsonl", "-o", tmp_path / "r")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "need matplotlib" in err
    code, out, _ = cli(
        "report", FIXTURES / "scaling_strong.jsonl", "-o", tmp_path / "r", "--no-plots"
    )
    page = (tmp_path / "r" / "index.html").read_text()
    assert code == 0 and "<img" not in page and ">0.909<" in page


def test_report_bad_input(cli, tmp_path):
    code, _, err = cli("report", tmp_path / "missing.jsonl")
    assert code == 2 and "no such results file" in err
    other = tmp_path / "other.jsonl"
    other.write_text('{"schema": "someone.else/1"}\n')
    code, _, err = cli("report", other)
    assert code == 2 and "not a scalelab record" in err
    code, _, err = cli("report", FIXTURES / "layers.jsonl", "--ceilings", FIXTURES / "nope.json")
    assert code == 2 and "no such ceilings file" in err


def test_report_warns_on_ceilings_of_another_machine(cli, tmp_path):
    code, _, err = cli(
        "report",
        FIXTURES / "layers.jsonl",
        "--ceilings",
        FIXTURES / "ceilings_other.json",
        "-o",
        tmp_path / "r",
        "--no-plots",
    )
    assert code == 0 and "warning: ceilings measured on nodeB, runs on nodeA" in err
