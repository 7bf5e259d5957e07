"""The worked example of docs/ARCHITECTURE.md done for real: `mpi-dp-naive`, one module
outside the package (tests/programs/naive_strategy.py), reached through the entry-point group
`scalelab.strategies`. It trains under mpiexec against the float64 steps, and predict and plan
treat it as its parent `mpi-dp` with no entry of its own in predict/ or plan/."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scalelab.config import RunConfig
from scalelab.plan import candidates as cand
from scalelab.plan.rank import rank
from scalelab.plan.space import PlanSpec
from scalelab.predict.calibration import CalPoint, Pool
from scalelab.predict.figures import Figures
from scalelab.predict.models import Context, model_for
from scalelab.predict.scenario import Scenario
from scalelab.strategies import STRATEGIES, lineage

PROGRAMS = Path(__file__).parent / "programs"
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def naive():
    """The example's module imported here as a rank imports it (importing registers it);
    unregistered after this module's tests, so no other test sees a strategy it did not add."""
    sys.path.insert(0, str(PROGRAMS))
    try:
        import naive_strategy
    finally:
        sys.path.remove(str(PROGRAMS))
    yield naive_strategy.NaiveMPIDataParallel
    STRATEGIES.unregister("mpi-dp-naive")
    sys.modules.pop("naive_strategy", None)


def _figures() -> Figures:
    data = json.loads((FIXTURES / "plan" / "ceilings_2core.json").read_text())
    data["cpu_concurrency"] = {"ranks": [1, 2], "slowdown": [1, 1.1], "slowdown_max": [1, 1.2]}
    return Figures(data, "fixture")


@pytest.mark.mpi
def test_an_entry_point_strategy_trains_under_mpiexec_against_float64(tmp_path):
    info = tmp_path / "naive-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: naive\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[scalelab.strategies]\nmpi-dp-naive = naive_strategy\n")
    path = [str(tmp_path), str(PROGRAMS), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    scalelab = [sys.executable, "-m", "scalelab"]
    listed = subprocess.run([*scalelab, "list"], capture_output=True, text=True, env=env)
    assert "mpi-dp-naive" in listed.stdout, listed.stderr
    flags = ["run", "mlp", "--strategy", "mpi-dp-naive", "--ranks", "2", "--train", "--check",
             "--hidden", "16", "--batch", "20", "--train-size", "40", "--heldout-size", "20",
             "--steps", "2", "--no-record", "--json"]  # fmt: skip
    ran = subprocess.run([*scalelab, *flags], capture_output=True, text=True, env=env, timeout=300)
    assert ran.returncode == 0, ran.stderr
    rec = json.loads(ran.stdout)
    assert rec["strategy"] == "mpi-dp-naive" and rec["ranks"] == 2
    assert rec["check_passed"] and rec["relerr"] < 1e-5, rec["relerr"]


def test_the_subclass_inherits_its_parents_model_and_candidates(naive):
    assert lineage("mpi-dp-naive")[:2] == ["mpi-dp-naive", "mpi-dp"]
    assert STRATEGIES.get("mpi-dp-naive") is naive
    assert type(model_for("mpi-dp-naive")) is type(model_for("mpi-dp"))

    base = RunConfig(workload="mlp", train=True, hidden=64)
    both = PlanSpec(base=base, ranks_max=2, per_node=2, cores=2, global_batch=40,
                    strategies=("mpi-dp", "mpi-dp-naive"))  # fmt: skip
    cfgs = cand.candidates(both)
    parent = [c for c in cfgs if c.strategy == "mpi-dp"]
    child = [c for c in cfgs if c.strategy == "mpi-dp-naive"]
    assert parent and [dataclasses.replace(c, strategy="mpi-dp") for c in child] == parent
    every = cand.candidates(dataclasses.replace(both, strategies=None))  # no --strategies
    assert [c for c in every if c.strategy == "mpi-dp-naive"] == child

    def point(batch: int, seconds: float) -> CalPoint:
        cfg = both.config(strategy="mpi-dp", ranks=1, threads=1, batch=batch)
        return CalPoint(Scenario(cfg, 1, 2).family(), "mpi-dp", None, batch, seconds, 0.0,
                        f"b{batch}")  # fmt: skip

    ctx = Context(_figures(), None, Pool([point(20, 0.004), point(40, 0.007)]))
    table = rank(ctx, both, cfgs)
    ms = {(r.strategy, r.candidate.split(" ", 1)[1]): r.ms for r in table.itertuples()}
    assert {s for s, _ in ms} == {"mpi-dp", "mpi-dp-naive"}
    for (_, rest), value in ms.items():
        assert value == ms[("mpi-dp", rest)] and value > 0, rest
    for c in parent:  # the model's whole prediction, phase by phase, and what calibrated it
        a = model_for("mpi-dp").predict(ctx, Scenario(c, c.ranks, 2))
        renamed = dataclasses.replace(c, strategy="mpi-dp-naive")
        b = model_for("mpi-dp-naive").predict(ctx, Scenario(renamed, c.ranks, 2))
        assert (a.phases, a.calibration, a.notes) == (b.phases, b.calibration, b.notes)
