"""The `pipeline` record field: per-stage times and memory, and the bubble three ways.

formula:   (K-1)/(M+K-1), equal stage times and free communication.
simulated: the schedule's op lists replayed with each stage's measured forward/backward time
           per micro-batch (catches imbalance between stages, not communication).
measured:  per stage, 1 - (seconds in forward + backward) / (seconds of the schedule), the
           schedule being the step minus the phases outside it (input copy to the device,
           optimizer step). Waiting counts as idle wherever it happens: for activations,
           gradients, labels (last stage) or the output (stage 0 in inference, the drain).
           The record gives each stage's and their mean.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from scalelab.config import RunConfig
from scalelab.layout.schedule import bubble_formula, measured_bubble, simulate, steady_step
from scalelab.strategies.pipeline.stage_plan import StagePlan

OUTSIDE_SCHEDULE = ("h2d", "step", "d2h")


def _medians(laps: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({n for lap in laps for n in lap})
    return {n: statistics.median(lap.get(n, 0.0) for lap in laps) for n in names}


def stage_summary(
    cfg: RunConfig,
    rank: int,
    device: torch.device,
    layers: list[str],
    params: int,
    laps: list[dict[str, float]],
    walls: list[float],
    spans: list[list] | None = None,
) -> dict:
    """This rank's stage (layers: its layer names; params: its parameter count): medians over
    iterations (training: over steps after the first, which pays for allocation and
    autotuning, when there are at least three)."""
    spans = spans or [[]] * len(laps)
    if cfg.train and len(laps) > 2:
        laps, walls, spans = laps[1:], walls[1:], spans[1:]
    med = _medians(laps)
    wall = statistics.median(walls) if walls else 0.0
    busy = med.get("forward", 0.0) + med.get("backward", 0.0)
    span = wall - sum(med.get(p, 0.0) for p in OUTSIDE_SCHEDULE)
    return {
        "rank": rank,
        "device": str(device),
        "layers": [layers[0], layers[-1]],
        "n_layers": len(layers),
        "params": params,
        "forward_s": med.get("forward", 0.0),
        "backward_s": med.get("backward", 0.0),
        "recv_s": med.get("recv", 0.0),
        "send_s": med.get("send", 0.0),
        "wall_s": wall,
        "span_s": span,
        "bubble": measured_bubble(busy, span),
        "peak_mem_bytes": torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else None,
        "step_s": list(walls) if cfg.train else None,
        # CUDA training: the median step's phases [name, start ms, end ms] on this stage's
        # clock from its first phase, in the order they ran (the gaps are waits nothing timed).
        "timeline_ms": _median_step_spans(walls, spans) if cfg.train else None,
        # --compile: graphs Dynamo handed to Inductor in this process (0 means it ran eager).
        "compiled_graphs": compiled_graphs() if cfg.compile else None,
    }


def _median_step_spans(walls: list[float], spans: list[list]) -> list | None:
    if not walls or not any(spans):
        return None
    order = sorted(range(len(walls)), key=walls.__getitem__)
    return [[name, round(a, 4), round(b, 4)] for name, a, b in spans[order[len(order) // 2]]]


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters  # private but stable since 2.0; only read here

    return int(counters["stats"]["unique_graphs"])


def pipeline_notes(
    cfg: RunConfig, plan: StagePlan, stages: list[dict] | None, train: bool
) -> dict[str, Any]:
    """The record's `pipeline` field (root rank; {} elsewhere)."""
    if stages is None:
        return {}
    k, m = len(stages), min(cfg.microbatches, cfg.batch)
    t_fwd = [s["forward_s"] / m for s in stages]
    t_bwd = [s["backward_s"] / m for s in stages]
    sim = simulate(cfg.schedule, m, t_fwd, t_bwd, train)
    notes: dict[str, Any] = {
        "placement": "pipeline",
        "stages": k,
        "microbatches": m,
        "schedule": cfg.schedule,
        "compiled": bool(cfg.compile),
        "balance": list(plan.counts),
        "bubble_formula": bubble_formula(k, m),
        "bubble_simulated": sim.mean_bubble,
        "bubble_measured": statistics.mean(s["bubble"] for s in stages),
        "stage": stages,
    }
    step = steady_step(stages) if train else None
    if step:
        # host_prefetch: the root gathers the next batch during this step (records without
        # it gathered between steps, inside the period).
        notes.update(steady_step_s=step, steady_throughput=cfg.batch / step, host_prefetch=True)
    if plan.rounds:  # --rebalance: the cuts tried, each with its stage times
        notes["balance_rounds"] = plan.rounds
    if plan.profile is not None:
        notes["layer_profile"] = [
            {
                "layer": p.name,
                "ms": p.seconds * 1e3,
                "param_bytes": p.param_bytes,
                "act_bytes": p.act_bytes,
            }
            for p in plan.profile
        ]
    return {"pipeline": notes}


def summary_line(notes: dict[str, Any]) -> str:
    """One line for the terminal: the split and the bubble three ways."""
    p = notes["pipeline"]
    if p["placement"] == "manual":
        busy = ", ".join(f"{b:.0%}" for b in p["stage_busy"])
        return f"  manual split {p['balance']} over {p['devices']}: each stage busy {busy}"
    return (
        f"  pipeline {p['stages']} stages x {p['microbatches']} micro-batches ({p['schedule']}, "
        f"balance {','.join(map(str, p['balance']))}): bubble measured "
        f"{p['bubble_measured']:.3f}, simulated {p['bubble_simulated']:.3f}, "
        f"formula (K-1)/(M+K-1) {p['bubble_formula']:.3f}"
    )
