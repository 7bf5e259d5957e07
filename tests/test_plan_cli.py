"""`scalelab plan` on the command line: bad input (one line, exit 2, nothing written), the
table, CSV, JSON and report section it writes, and a larger machine's ceilings capped at this
host's cores only where plan runs here."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from plan_helpers import figures
from scalelab.predict.figures import Figures


# --- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, words",
    [
        (["--ranks-max", "0"], "--ranks-max"),
        (["--ranks-max", "64"], "ranks per node"),
        (["--ranks-max", "2", "--strategies", "nope"], "unknown candidate source 'nope'"),
        (["--ranks-max", "2", "--memory-per-device", "lots"], "--memory-per-device"),
        (["--ranks-max", "2", "--verify", "-1"], "--verify"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(cli, tmp_path, args, words):
    ceilings = tmp_path / "c.json"
    ceilings.write_text(json.dumps(figures().data))
    out = tmp_path / "out"
    code, stdout, err = cli("plan", "alexnet", *args, "--ceilings", ceilings, "-o", out)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


# --- output ---------------------------------------------------------------------------------
def test_plan_writes_table_csv_json_and_a_report_section(cli, tmp_path):
    from scalelab.analysis.plan_report import plan_sections

    ceilings = tmp_path / "c.json"
    ceilings.write_text(json.dumps(figures().data))
    out = tmp_path / "results" / "plan"
    code, stdout, err = cli("plan", "alexnet", "--ranks-max", "2", "--batch", "8",
                            "--image-size", "67", "--ceilings", ceilings, "-o", out)  # fmt: skip
    assert code == 0, err
    assert "uncalibrated roofline bound" in stdout  # nothing measured: every row a bound
    csv = pd.read_csv(out / "plan.csv")
    summary = json.loads((out / "plan.json").read_text())
    assert [r["candidate"] for r in summary["rows"]] == list(csv["candidate"])
    assert csv.loc[0, "candidate"] in stdout
    summary["verify"] = {"chosen": csv.loc[0, "candidate"], "best": "x", "regret": 0.031,
                         "rows": [{"role": "chosen", "candidate": csv.loc[0, "candidate"],
                                   "predicted": 1.0, "measured": 1.0, "low": 1.0, "high": 1.0,
                                   "runs": 3, "error_pct": 0.0}]}  # fmt: skip
    (out / "plan.json").write_text(json.dumps(summary))
    [(anchor, title, body)] = plan_sections(tmp_path / "results")
    assert anchor == "plan" and "regret 3.1%" in body and csv.loc[0, "candidate"] in body
    assert plan_sections(tmp_path / "nothing") == []


@pytest.mark.parametrize("runs_here, cores", [((), 16), (("--calibrate-missing",), 2),
                                              (("--verify", "1"), 2)])  # fmt: skip
def test_a_larger_machines_ceilings_cap_the_cores_only_where_plan_runs_here(
    monkeypatch, caplog, runs_here, cores
):
    """Ceilings of a 16-core machine plan for its 16 cores; measured on a 2-core host
    (--calibrate-missing, --verify), candidates of more cores would time its
    oversubscription (16-thread runs on 2 cores, seen taking minutes each), so they are
    capped at this host's cores with a warning."""
    from scalelab import environment
    from scalelab.cli.commands.plan import _spec
    from scalelab.cli.main import build_parser
    from scalelab.errors import UsageError

    monkeypatch.setattr(environment, "usable_cpus", lambda: 2)
    data = {**figures().data, "machine": {"cpu_cores": 16}}
    args = build_parser().parse_args(["plan", "alexnet", "--ranks-max", "2", *runs_here])
    got = _spec(args, Figures(data, "sixteen.json"))
    assert got.cores == cores
    assert ("ceilings describe 16 CPU cores, this host has 2" in caplog.text) == (cores == 2)
    assert max(n * t for n, t in got.layouts()) == cores  # no candidate above the cores
    caplog.clear()  # a refused plan says only its one line
    too_many = build_parser().parse_args(["plan", "alexnet", "--ranks-max", "4", *runs_here])
    if cores == 2:
        with pytest.raises(UsageError, match="2 ranks per node"):
            _spec(too_many, Figures(data, "sixteen.json"))
        assert "ceilings describe" not in caplog.text


def test_calibrate_missing_on_a_fresh_machine_measures_the_ceilings_first(
    cli, tmp_path, monkeypatch
):
    """No --ceilings and no scalelab-results/ceilings.json: --calibrate-missing measures them
    (`scalelab ceilings --quick`, said first) instead of stopping at "measure this machine
    first"; without it the plan still stops in one line, writing nothing."""
    monkeypatch.chdir(tmp_path)
    args = ["plan", "mlp", "--hidden", "8", "--batch", "4", "--ranks-max", "1", "--repeats", "1"]
    code, _, err = cli(*args)
    assert code == 2 and "measure this machine first" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "scalelab-results").exists()
    code, stdout, err = cli(*args, "--calibrate-missing")
    assert code == 0, err
    assert "calibrate: no ceilings here yet: scalelab ceilings --quick --device cpu" in stdout
    ceilings = json.loads((tmp_path / "scalelab-results" / "ceilings.json").read_text())
    assert ceilings["cpu_gemm_flops"] and "mpi" in ceilings["comm"]  # this host's, measured now
    assert json.loads((tmp_path / "scalelab-results" / "plan" / "plan.json").read_text())["rows"]
