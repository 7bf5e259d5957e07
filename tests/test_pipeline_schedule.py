"""Pipeline schedules and their bubble against closed forms: every op list complete and in
dependency order, equal stages leaving the textbook bubble, unequal ones the fill-drain
makespan, communication on every hop, and the measured bubble from synthetic phases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scalelab.config import RunConfig
from scalelab.layout.schedule import (
    SCHEDULES,
    bubble_formula,
    simulate,
)
from scalelab.strategies.pipeline.report import stage_summary
from scalelab.workloads.layers import describe

# --- schedules and the bubble -----------------------------------------------------------------


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("k, m", [(1, 1), (2, 1), (2, 4), (3, 4), (4, 8), (4, 2)])
def test_op_lists_are_complete_and_respect_dependencies(schedule, k, m):
    for s in range(k):
        ops = SCHEDULES[schedule](s, k, m, True)
        assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(m))
        # Activations alive at once: all M for GPipe, at most K - s for 1F1B.
        alive = max(
            sum(1 for op in ops[: n + 1] if op[0] == "F")
            - sum(1 for op in ops[: n + 1] if op[0] == "B")
            for n in range(len(ops))
        )
        assert alive == (m if schedule == "gpipe" else min(k - s, m))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("k, m", [(2, 1), (2, 8), (3, 4), (4, 16), (8, 8)])
def test_equal_stages_leave_the_formula_bubble(schedule, k, m):
    sim = simulate(schedule, m, [1.0] * k, [2.0] * k)
    assert sim.makespan == pytest.approx((m + k - 1) * 3.0)
    assert sim.mean_bubble == pytest.approx(bubble_formula(k, m))
    assert bubble_formula(k, m) == pytest.approx((k - 1) / (m + k - 1))


def test_unequal_stages_match_the_fill_drain_closed_form():
    """Forward-only pipelining of M items through stages taking t_s each ends at
    sum(t) + (M - 1) * max(t): the slowest stage paces the steady state."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        k, m = int(rng.integers(1, 6)), int(rng.integers(1, 10))
        t = list(rng.uniform(0.1, 2.0, size=k))
        sim = simulate("gpipe", m, t, [0.0] * k, train=False)
        assert sim.makespan == pytest.approx(sum(t) + (m - 1) * max(t))


def test_communication_delays_every_hop():
    sim = simulate("gpipe", 1, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], t_comm=0.5)
    assert sim.makespan == pytest.approx(6 * 1.0 + 4 * 0.5)


class _FakeStrategy:
    """Just what stage_summary reads."""

    def __init__(self, train: bool) -> None:
        self.cfg = RunConfig(workload="deepstack", train=train)
        self.device = torch.device("cpu")
        self.layers = [describe(f"l{i}", torch.nn.Identity()) for i in range(4)]
        self.counts = [3, 1]
        self.stage = torch.nn.Linear(2, 2)

        class _Comm:
            rank = 0

        self.comm = _Comm()


def test_measured_bubble_from_synthetic_phases():
    """A stage that computed 1.8 s of a 2.0 s schedule idled 10%; the optimizer step and the
    first (warm-up) training step stay out of the account."""
    lap = {"forward": 0.6, "backward": 1.2, "recv": 0.2, "step": 0.1, "h2d": 0.05}
    laps = [{"forward": 9.0, "step": 9.0}] + [lap] * 3
    walls = [20.0] + [2.15] * 3
    fake = _FakeStrategy(train=True)
    names = [layer.name for layer in fake.layers[:3]]
    row = stage_summary(fake.cfg, 0, fake.device, names, 6, laps, walls)
    assert row["span_s"] == pytest.approx(2.0)
    assert row["bubble"] == pytest.approx(0.1)
    assert row["layers"] == ["l0", "l2"] and row["n_layers"] == 3
    assert row["step_s"] == [2.15] * 3
