"""`scalelab scaling` and `scalelab roofline` end to end on the fixtures: files written,
known numbers printed, bad input one line and exit 2."""

import csv
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def test_scaling_command(cli, tmp_path):
    code, out, err = cli("scaling", FIXTURES / "scaling_strong.jsonl", "-o", tmp_path)
    assert code == 0, err
    assert "0.9091" in out and "0.8" in out and "strong" in out
    for name in ("scaling.csv", "scaling.png", "scaling.svg", "scaling_phases.png"):
        assert (tmp_path / name).stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "scaling.csv").open()))
    assert [float(r["efficiency"]) for r in rows] == pytest.approx([1, 8 / 8.8, 0.8])


def test_scaling_forced_mode(cli, tmp_path):
    code, out, _ = cli(
        "scaling", FIXTURES / "scaling_weak.jsonl", "--mode", "strong", "-o", tmp_path, "--no-plots"
    )
    assert code == 0 and "nothing to scale" in out and not (tmp_path / "scaling.png").exists()


def test_roofline_command(cli, tmp_path):
    code, out, err = cli(
        "roofline",
        FIXTURES / "layers.jsonl",
        "--ceilings",
        FIXTURES / "ceilings_cpu.json",
        "-o",
        tmp_path,
    )
    assert code == 0, err
    assert "fc1" in out and "18.57" in out
    assert (tmp_path / "roofline_layers.png").stat().st_size > 0
    code, out, _ = cli("roofline", FIXTURES / "system_roofline.jsonl", "-o", tmp_path)
    assert code == 0 and "P_flops 2e+10 FLOP/s" in out and "P_mpi 1e+09 B/s" in out
    rows = list(csv.DictReader((tmp_path / "roofline_system.csv").open()))
    assert [r["bound"] for r in rows].count("network") == 2
    assert (tmp_path / "roofline_system.svg").stat().st_size > 0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["roofline", "MISSING"], "no such results file"),
        (["roofline", "layers.jsonl"], "per-layer roofline needs --ceilings"),
        (["roofline", "scaling_strong.jsonl"], "nothing to put on a roofline"),
        (["roofline", "layers.jsonl", "--ceilings", "scaling_strong.jsonl"], "not JSON"),
        (
            ["roofline", "layers.jsonl", "--ceilings", "ceilings_cpu.json", "--run", "nope"],
            "no --per-layer run with id nope",
        ),
        (["scaling", "MISSING"], "no such results file"),
        (["scaling", "ceilings_cpu.json"], "holds no run records (schema scalelab.ceilings/1"),
        (["scaling", "make_fixtures.py"], "not JSON"),
        (["scaling", "scaling_weak.jsonl", "--mode", "linear"], "invalid choice"),
    ],
)
def test_bad_input_one_line_exit_2(cli, tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(FIXTURES)
    code, _, err = cli(*args, "-o", tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_plots_without_matplotlib(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = cli("scaling", FIXTURES / "scaling_strong.jsonl", "-o", tmp_path)
    assert code == 2 and "plots need matplotlib" in err and "--no-plots" in err
    code, _, _ = cli("scaling", FIXTURES / "scaling_strong.jsonl", "-o", tmp_path, "--no-plots")
    assert code == 0 and (tmp_path / "scaling.csv").exists()
