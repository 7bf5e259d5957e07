"""Shared by the `scalelab plan` tests: a plan specification of this 2-core host, the
ceilings fixture's figures (also test_blocks_plan's), the example models, and the whole loop
run on this host with its regret check (test_plan_proved*.py)."""

from __future__ import annotations

import json
from pathlib import Path

from scalelab.config import RunConfig
from scalelab.plan.rank import OK
from scalelab.plan.space import PlanSpec
from scalelab.predict.figures import Figures

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"
RESCNN, TOKCNN = f"{MODELS / 'rescnn.py'}:rescnn", f"{MODELS / 'tokcnn.py'}:tokcnn"


def spec(workload="alexnet", train=False, batch=32, **kw) -> PlanSpec:
    base = RunConfig(
        workload=workload, train=train, image_size=67 if workload == "alexnet" else None
    )
    return PlanSpec(base=base, ranks_max=2, per_node=2, cores=2, global_batch=batch, **kw)


def figures() -> Figures:
    """`scalelab ceilings --quick --device cpu` and --comm-only for mpi and gloo, measured on
    a 2-core host of this project; a calm contention curve in place of the loaded one."""
    data = json.loads((FIXTURES / "plan" / "ceilings_2core.json").read_text())
    data["cpu_concurrency"] = {"ranks": [1, 2], "slowdown": [1, 1.1], "slowdown_max": [1, 1.2]}
    return Figures(data, "fixture")


# The mlp plan verifies the top 3 (and the plain choice) with medians of two runs; the user
# model's plan the top 2 (and the plain one), also with medians of two. On the shared 2-core
# host a run is mostly process start-up (8-30 s under load), so CI time is the number of
# runs: each loop has a file of its own, so that two test processes run them side by side.
# AlexNet's whole loop runs as README's plan line (without the regret assertion) and as
# docs/PLAN.md's worked example: a third loop here put CI past 30 minutes.
def _plan(cli, tmp_path: Path, *args: str, verify=99, repeats=3) -> tuple[dict, Path]:
    """The plan with --calibrate-missing --verify `verify` --repeats `repeats` (runs per
    calibration point and per verified candidate: their medians)."""
    ceilings = tmp_path / "ceilings.json"
    ceilings.write_text(json.dumps(figures().data))  # communication figures: the fixture's
    out = tmp_path / "plan"
    code, stdout, err = cli("plan", *args, "--ranks-max", "2", "--ceilings", ceilings,
                            "--calibrate-missing", "--verify", verify, "--repeats", repeats,
                            "--timeout", "120", "-o", out)  # fmt: skip
    assert code == 0, err
    print(stdout, err)  # shown with -s or on a failure: the tables and the progress lines
    assert "plan: verify 1/" in err and "plan: calibrate 1/" in err  # progress on stderr
    return json.loads((out / "plan.json").read_text()), out


NOISE = 1.25  # the most one configuration's repeated runs may differ for a 5% claim to hold


def _host_noise(out: Path) -> float:
    """The largest fastest/slowest rate ratio among repeated runs of one configuration
    (calibration and verification): how much load from elsewhere moved the measurements
    during this test."""
    from scalelab.orchestration.sweep import config_key
    from scalelab.plan.calibrate import rate
    from scalelab.record import read_records

    runs: dict[str, list[float]] = {}
    for name in ("calibration_runs.jsonl", "verify.jsonl"):
        for rec in read_records(out / name):
            runs.setdefault(config_key(rec["config"]), []).append(rate(rec))
    return max(max(v) / min(v) for v in runs.values())


def _assert_regret(summary: dict, out: Path, top: int | None = None, repeats: int = 3) -> None:
    """Every runnable candidate measured `repeats` times (top: the first `top` and the plain
    configuration);
    the choice within 5% of the best measured, or the
    best's lead not consistent over the rounds (in some round the choice came within 5% of it).
    On a host whose repeated runs of one configuration differ by more than NOISE, 5% cannot be
    told apart: there the choice must still lie within the host's own measured spread of the
    best (a wrong choice beyond the noise fails either way). The same for the choice's
    prediction, against 10%."""
    v = summary["verify"]
    rows = {r["candidate"]: r for r in v["rows"]}
    ranked = [r for r in summary["rows"] if r["status"] == OK]
    measured = sorted(r["rank"] for r in ranked if r["candidate"] in rows)
    want = len(ranked) if top is None else min(top, len(ranked))
    assert measured[:want] == list(range(1, want + 1))  # the top `top` (default: all)
    assert len(rows) == len(measured) <= want + 1  # and at most the plain one besides
    assert all(r["runs"] == repeats for r in rows.values())
    noise = _host_noise(out) - 1.0
    bound = max(0.05, noise)
    best = rows[v["best"]]
    assert v["regret"] <= bound or best["vs_chosen_low"] <= 1.0 + bound, (bound, v)
    # the choice's prediction from the calibration measured alongside it: within 10% of its
    # measurement, or within the host's own spread between runs of one configuration
    chosen = rows[v["chosen"]]
    assert abs(chosen["alongside_error_pct"]) <= 100 * max(0.10, noise), (noise, chosen)
