"""The seed-style per-rank table: one column per rank, phase start/end times and durations,
totals, what the phases leave unaccounted, bytes per phase, throughput and the critical path.

Every rank records its phases with a `TimelineTimer` (a PhaseTimer that also keeps the start
and end of each top-level phase, relative to the iteration start that follows the barrier);
the strategy gathers one `RankReport` per rank and the root formats them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from scalelab.instrument.timer import PhaseTimer

# Share of a rank's wall time its phases may leave unexplained before the table says so.
ACCOUNTING_TOLERANCE = 0.05


class TimelineTimer(PhaseTimer):
    """PhaseTimer that also logs (phase, start, end) of top-level phases per iteration.

    Call `begin()` first thing in a timed step; `lap()` (called by timed_iterations) files the
    iteration's events in `history` (history[0] holds the discarded warm-up lap).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._t0: float | None = None
        self._events: list[tuple[str, float, float]] = []
        self.history: list[list[tuple[str, float, float]]] = []

    def begin(self) -> None:
        self._t0 = time.perf_counter()
        self._events = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        top = self.enabled and not self._stack and self._t0 is not None
        with super().phase(name):
            start = time.perf_counter()  # after the entry sync: the phase's own work starts
            yield
        if top:  # after the exit sync: the device work of the phase is done
            t0 = self._t0
            self._events.append((name, start - t0, time.perf_counter() - t0))

    def lap(self) -> dict[str, float]:
        self.history.append(self._events)
        self._events = []
        return super().lap()


@dataclass
class RankReport:
    """One rank's view of a run.

    wall_s, phases: medians over the timed iterations (what the record's rank_phases keep).
    iteration_wall_s, iteration: the median-wall iteration itself, whose phases add up to its
    wall (medians of different iterations need not); timeline: that iteration's events.
    """

    rank: int
    wall_s: float
    phases: dict[str, float]
    bytes: dict[str, int] = field(default_factory=dict)
    timeline: list[tuple[str, float, float]] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    iteration_wall_s: float | None = None
    iteration: dict[str, float] | None = None

    @property
    def top_phases(self) -> dict[str, float]:
        """The median iteration's top-level phases (nested ones are inside their parent)."""
        src = self.iteration if self.iteration is not None else self.phases
        return {k: v for k, v in src.items() if "/" not in k}

    @property
    def iter_wall_s(self) -> float:
        return self.wall_s if self.iteration_wall_s is None else self.iteration_wall_s

    @property
    def unaccounted_s(self) -> float:
        return self.iter_wall_s - sum(self.top_phases.values())

    def to_dict(self) -> dict:
        return asdict(self)


def accounting(reports: Sequence[RankReport]) -> list[dict[str, float]]:
    """Per rank, in its median iteration: wall, sum of phases, and the remainder (Python
    between phases: slicing, allocation, loop control)."""
    return [
        {
            "rank": r.rank,
            "wall_s": r.iter_wall_s,
            "phases_s": sum(r.top_phases.values()),
            "unaccounted_s": r.unaccounted_s,
            "unaccounted_fraction": r.unaccounted_s / r.iter_wall_s if r.iter_wall_s > 0 else 0.0,
        }
        for r in reports
    ]


def critical_path(reports: Sequence[RankReport]) -> dict:
    """The rank that kept the others waiting: the most busy time (every phase but `wait`).

    In these SPMD steps every rank meets the others at a barrier or a collective, so the
    busiest rank sets the iteration time; the others' `wait` is their slack behind it.
    """

    def busy(r: RankReport) -> float:
        return sum(v for k, v in r.top_phases.items() if k != "wait")

    slowest = max(reports, key=busy)
    return {
        "rank": slowest.rank,
        "busy_s": busy(slowest),
        "phases": slowest.top_phases,
        "slack_s": {r.rank: r.top_phases.get("wait", 0.0) for r in reports},
    }


def phase_order(reports: Sequence[RankReport]) -> list[str]:
    """Phase names by first appearance in the timelines (root first), then the rest."""
    seen: dict[str, float] = {}
    for rep in reports:
        for name, start, _ in rep.timeline:
            seen.setdefault(name, start)
    names = sorted(seen, key=seen.get)
    rest = sorted({n for r in reports for n in r.top_phases} - set(names))
    return names + rest


def _cells(values: Sequence[float | None], scale: float = 1e3, fmt: str = "{:>11.3f}") -> str:
    return "".join(" " * 11 if v is None else fmt.format(v * scale) for v in values)


def format_rank_table(reports: Sequence[RankReport], items: int, unit: str, title: str = "") -> str:
    """The table rank 0 prints: the median-wall iteration of every rank, times in ms from
    its start (after the barrier); throughput from the median wall over iterations."""
    names = phase_order(reports)
    head = f"{'':<18}" + "".join(f"{'rank ' + str(r.rank):>11}" for r in reports)
    lines = [
        f"per-rank phases (ms) of each rank's median-wall iteration (the iteration the record's "
        f"phases and rank_phases hold){': ' + title if title else ''}",
        head,
    ]
    for name in names:  # timeline: first start and last end of each phase
        starts = [min((s for n, s, _ in r.timeline if n == name), default=None) for r in reports]
        ends = [max((e for n, _, e in r.timeline if n == name), default=None) for r in reports]
        if any(v is not None for v in starts):
            lines.append(f"{name + '_start':<18}" + _cells(starts))
            lines.append(f"{name + '_end':<18}" + _cells(ends))
    lines.append(f"{'-- durations':<18}")
    for name in names:
        lines.append(f"{name:<18}" + _cells([r.top_phases.get(name) for r in reports]))
    lines.append(f"{'phases total':<18}" + _cells([sum(r.top_phases.values()) for r in reports]))
    lines.append(f"{'wall':<18}" + _cells([r.iter_wall_s for r in reports]))
    acc = accounting(reports)
    lines.append(
        f"{'unaccounted %':<18}"
        + _cells([a["unaccounted_fraction"] for a in acc], 100, "{:>11.1f}")
    )
    lines += _bytes_lines(reports)
    lines += _overlap_lines(reports)
    lines += _footer(reports, items, unit, acc)
    return "\n".join(lines)


def _bytes_lines(reports: Sequence[RankReport]) -> list[str]:
    kinds = sorted({k for r in reports for k in r.bytes})
    if not kinds:
        return []
    out = [f"{'-- MB received':<18}"]
    for k in kinds:
        out.append(f"{k:<18}" + _cells([r.bytes.get(k, 0) for r in reports], 1e-6))
    return out


def _overlap_lines(reports: Sequence[RankReport]) -> list[str]:
    """--overlap: communication (copies + message waits) hidden under compute, per rank."""
    stats = [r.extra.get("overlap") for r in reports]
    if not any(stats):
        return []

    def row(label: str, key: str, scale: float = 1e3, fmt: str = "{:>11.3f}") -> str:
        return f"{label:<18}" + _cells([s.get(key) if s else None for s in stats], scale, fmt)

    return [
        f"{'-- overlap (ms)':<18}",
        row("comm busy", "comm_s"),
        row("hidden", "hidden_s"),
        row("exposed", "exposed_s"),
        row("hidden %", "hidden_fraction", 100, "{:>11.1f}"),
    ]


def _footer(reports: Sequence[RankReport], items: int, unit: str, acc: list[dict]) -> list[str]:
    wall = reports[0].wall_s
    crit = critical_path(reports)
    top = sorted(crit["phases"].items(), key=lambda kv: -kv[1])[:3]
    lines = [
        f"throughput {items / wall:.1f} {unit}/s ({items} {unit}, wall {wall * 1e3:.2f} ms "
        f"on rank 0)",
        f"critical path: rank {crit['rank']}, busy {crit['busy_s'] * 1e3:.2f} ms ("
        + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in top)
        + ")",
    ]
    worst = max(acc, key=lambda a: a["unaccounted_fraction"])
    if worst["unaccounted_fraction"] > ACCOUNTING_TOLERANCE:
        lines.append(
            f"note: rank {worst['rank']}'s phases leave "
            f"{worst['unaccounted_fraction']:.1%} of its wall unaccounted: Python between "
            "phases (slicing, allocation, loop control), not communication or compute"
        )
    return lines
