"""The `pipeline` record field of `--engine torch`: per rank, the actions it ran (stage, kind,
micro-batch) with their clocks; per stage, one micro-batch's seconds per kind; the bubble
measured on every rank beside the one simulated from the schedule's own action lists
(layout/torch_schedule.py) and the textbook (S-1)/(M+S-1); the mesh and the dp group's traffic.
"""

from __future__ import annotations

import statistics
from typing import Any

from scalelab.layout.schedule import bubble_formula, measured_bubble
from scalelab.layout.torch_schedule import schedule_actions, simulated_bubble, stage_seconds

Event = tuple[int, str, int, float, float]  # stage, kind, micro-batch, start s, end s


class RunLog:
    """Passes of the timed work: one list of (events relative to the pass start, span) per
    training step or timed inference iteration; evaluation passes are discarded."""

    def __init__(self) -> None:
        self.current: list[tuple[list[Event], float]] = []
        self.steps: list[tuple[list[Event], float]] = []

    def add_pass(self, events: list[Event], start: float, end: float, train: bool) -> None:
        rel = [(s, k, m, a - start, b - start) for s, k, m, a, b in events]
        self.current.append((rel, end - start))

    def end_step(self) -> None:
        if self.current:
            events = [e for ev, _ in self.current for e in ev]
            self.steps.append((events, sum(span for _, span in self.current)))
        self.current = []

    def drop_last_passes(self, evaluation: bool = True) -> None:
        self.current = []

    @staticmethod
    def stage_seconds(events: list[Event]) -> dict[int, float]:
        """Per stage: seconds of all its actions per micro-batch (for --rebalance)."""
        total: dict[int, float] = {}
        micro: dict[int, set[int]] = {}
        for s, _, m, a, b in events:
            total[s] = total.get(s, 0.0) + (b - a)
            micro.setdefault(s, set()).add(m)
        return {s: t / len(micro[s]) for s, t in total.items()}


def _rank_row(strategy: Any, train: bool) -> dict[str, Any]:
    """This rank's medians over steps (training: after the first, when there are three)."""
    steps = strategy.log.steps
    if train and len(steps) > 2:
        steps = steps[1:]
    elif not train:
        steps = steps[strategy.cfg.warmup :] or steps
    per_step = []
    for events, span in steps:
        kinds: dict[str, float] = {}
        for s, k, _, a, b in events:
            kinds[f"{s}:{k}"] = kinds.get(f"{s}:{k}", 0.0) + (b - a)
        per_step.append((kinds, span))
    keys = sorted({k for kinds, _ in per_step for k in kinds})
    action_s = {k: statistics.median(kinds.get(k, 0.0) for kinds, _ in per_step) for k in keys}
    spans = [span for _, span in per_step]
    span = statistics.median(spans) if spans else 0.0
    fwd = sum(v for k, v in action_s.items() if k.endswith(":F"))
    busy = sum(action_s.values())
    names = [layer.name for layer in strategy.layers]
    bounds = _bounds(strategy.counts)
    ids = sorted(strategy.pieces)
    return {
        "rank": strategy.comm.rank,
        "dp_rank": strategy.groups.dp_rank,
        "pp_rank": strategy.groups.inner_rank,
        "device": str(strategy.device),
        "stages": ids,
        "layers": [[names[bounds[i][0]], names[bounds[i][1] - 1]] for i in ids],
        "n_layers": sum(strategy.counts[i] for i in ids),
        "params": sum(p.numel() for p in strategy._own_params()),
        "forward_s": fwd,
        "backward_s": busy - fwd,
        "action_s": action_s,
        "wall_s": span,
        "span_s": span,
        "bubble": measured_bubble(busy, span),
        "step_s": spans,
        "timeline_ms": _median_timeline(steps),
    }


def _bounds(counts: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def _median_timeline(steps: list[tuple[list[Event], float]]) -> list | None:
    if not steps:
        return None
    order = sorted(range(len(steps)), key=lambda i: steps[i][1])
    events = steps[order[len(order) // 2]][0]
    return [[f"{s}{k}{m}", round(a * 1e3, 4), round(b * 1e3, 4)] for s, k, m, a, b in events]


def torch_pipeline_notes(strategy: Any, train: bool) -> dict[str, Any]:
    """The record's `pipeline` field on the root ({} elsewhere); collective."""
    rows = strategy.comm.gather_object(_rank_row(strategy, train))
    if rows is None:
        return {}
    cfg = strategy.cfg
    k, v = cfg.stages, strategy.v
    main = strategy.passes.get((cfg.batch // cfg.dp, True)) or next(iter(strategy.passes.values()))
    m = main.micro
    replica = sorted((r for r in rows if r["dp_rank"] == 0), key=lambda r: r["pp_rank"])
    actions = schedule_actions(main.schedule, cfg.schedule, k, m)
    # the lists the runtime walks, transfers included
    lowered = schedule_actions(main.schedule, cfg.schedule, k, m, comms=True)
    sim = simulated_bubble(lowered, stage_seconds(replica, m), k * v)
    notes: dict[str, Any] = {
        "placement": "pipeline",
        "engine": "torch",
        "schedule": cfg.schedule,
        "stages": k,
        "virtual_stages": v,
        "microbatches": m,
        "mesh": strategy.layout.shape(),
        "balance": list(strategy.counts),
        "bubble_formula": bubble_formula(k, m),
        "bubble_simulated": statistics.mean(sim.values()),
        "bubble_simulated_rank": [sim[r] for r in range(k)],
        "bubble_measured": statistics.mean(r["bubble"] for r in replica),
        "actions": {str(r): [f"{s}{kind}{mb}" for s, kind, mb in a] for r, a in actions.items()},
        "stage": rows,
        # Per-group communication: pp = the schedule's point-to-point inside each rank's span
        # (the span minus its actions: waits and transfers), dp = one gradient all-reduce.
        "comm_groups": {
            "pp": {"size": k, "ops": "p2p activations/gradients"},
            "dp": {"size": cfg.dp, "ops": "all-reduce of gradients per step"},
        },  # fmt: skip
    }
    if strategy.balance_rounds:
        notes["balance_rounds"] = strategy.balance_rounds
    return {"pipeline": notes}


def torch_summary_line(notes: dict[str, Any]) -> str:
    p = notes["pipeline"]
    return (
        f"  pipeline (torch {p['schedule']}, {p['stages']} ranks x {p['virtual_stages']} stages, "
        f"mesh {p['mesh']}, {p['microbatches']} micro-batches): bubble measured "
        f"{p['bubble_measured']:.3f}, simulated {p['bubble_simulated']:.3f}, "
        f"formula {p['bubble_formula']:.3f}"
    )
