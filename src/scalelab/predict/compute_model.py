"""Compute time of one rank's share: calibrated on a one-rank measurement where the pool has
one, otherwise bounded below by the measured ceilings (roofline over the cost table).

Roofline of layer l at batch b (per iteration; training counts 3x the forward, as FLOPs do):

    t_l(b) = max(flops_l * b / F, bytes_l(b) / B)

F the GEMM ceiling for the precision (CPU ranks: the ceilings' NumPy float64 GEMM, one core
per thread), B the memory copy ceiling, bytes_l(b) = itemsize * (b * (in + out) + params)
from the cost table. It is a lower bound (no launch latency, no cache misses): predictions
built on it say so.

CPU ranks share the host: with p = (ranks on the node) x (threads per rank) processes busy,
each computes slower than one alone by s(p), the ceilings' measured `cpu_concurrency` curve
(instrument/concurrency.py), interpolated at p. The one-rank calibration ran with p0 = threads
busy, so its time is scaled by s(p) / s(p0). Without the curve the ranks are assumed not to
contend, and the prediction says so.

A curve timed on this scenario's own rank step (its `step`: same workload, model, train mode
and dtype, at the rank's batch, single-threaded ranks of a strategy whose ranks each run the
whole model; inference for now) says more: the rank's compute is the curve's own time of
that step alone (`seconds_lockstep[0]`, the median call alone, else `seconds[0]`), not the
calibration law's value at that batch (a law fitted at 64 images put AlexNet's forward at 8
items at 293 ms where the step took 419 ms), scaled by the slowest call per lockstep round
(`slowdown_lockstep`) where the curve has it: each step waits for its slowest rank every
step, which the slowest process's mean over a window understates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scalelab.precision import get_precision
from scalelab.predict.calibration import BatchLaw, Pool, batch_law, near_miss
from scalelab.predict.figures import Figures
from scalelab.predict.scenario import Scenario, build_workload
from scalelab.strategies import STRATEGIES
from scalelab.workloads.base import LayerCost


def roofline_layers(scenario: Scenario, figures: Figures, batch: float) -> list[tuple[str, float]]:
    cfg = scenario.cfg
    costs = build_workload(cfg).cost_table()
    threads = cfg.threads if cfg.device == "cpu" else None
    flops = figures.gemm_flops(cfg.device, scenario.precision, threads)
    mem = figures.mem_Bps(cfg.device, threads)
    itemsize = get_precision(scenario.precision).itemsize
    factor = 3.0 if cfg.train else 1.0
    return [(c.name, factor * _layer_seconds(c, batch, itemsize, flops, mem)) for c in costs]


def _layer_seconds(c: LayerCost, batch: float, itemsize: int, flops: float, mem: float) -> float:
    moved = itemsize * (batch * (c.in_elems + c.out_elems) + c.params)
    return max(c.flops * batch / flops, moved / mem)


@dataclass
class ComputeModel:
    """Seconds of compute per iteration for one rank's batch, and where the figure comes from."""

    scenario: Scenario
    figures: Figures
    law: BatchLaw | None
    notes: list[str] = field(default_factory=list)
    contention: float = 1.0  # CPU ranks: per-process slowdown of sharing the host (1: none)
    # CPU ranks whose step the contention curve timed: (the rank's batch, its seconds alone)
    own_step: tuple[int, float] | None = None
    spatial: bool = False

    @classmethod
    def build(cls, scenario: Scenario, figures: Figures, pool: Pool, spatial: bool = False):
        law = batch_law(pool, scenario, spatial)
        model = cls(scenario, figures, law, spatial=spatial)
        model._contend()
        if law is None:
            miss = near_miss(pool, scenario)
            why = f"the closest, {miss}" if miss else "pass --calibrate RESULTS"
            model.notes.append(
                "compute: roofline lower bound from the ceilings (no one-rank measurement of "
                f"this configuration to calibrate on; {why})"
            )
        else:
            model.notes.append(law.describe())
        return model

    def _contend(self) -> None:
        """Scale CPU compute by the host's measured slowdown at the processes busy per node."""
        s, cfg = self.scenario, self.scenario.cfg
        threads = cfg.threads or 1
        busy = min(s.ranks, s.per_node) * threads
        if cfg.device != "cpu" or busy <= threads:
            return
        # Every CPU-rank strategy here is bulk-synchronous (a halo exchange per layer, a gather
        # or an all-reduce per step): each step waits for its slowest rank, so the slowest
        # process's slowdown at `busy` sets the pace, not the median's.
        ranks = min(s.ranks, s.per_node)
        threaded = self.figures.cpu_slowdown(ranks, True, threads) if threads > 1 else None
        if threaded is not None:  # measured with processes of `threads` threads
            self.contention = max(1.0, threaded)
            self.notes.append(
                f"compute x{threaded:.3g}: the slowest of {ranks} processes of {threads} "
                f"threads busy per node runs slower than one (cpu_concurrency of "
                f"{self.figures.path}, measured with {threads} threads per process)"
            )
            return
        at = self.figures.cpu_slowdown(busy, slowest=True)
        alone = self.figures.cpu_slowdown(threads, slowest=True)
        if at is None or alone is None:
            self.notes.append(
                "compute: CPU ranks on one node assumed not to slow each other (no "
                f"cpu_concurrency curve in {self.figures.path}; scalelab ceilings -o FILE "
                "measures it)"
            )
            return
        if self._take_own_step(busy):
            return
        # More busy processes never run a process faster: a ratio below 1 is the measurement's
        # noise (a --quick curve read 0.79 at 8 processes on a 32-core host), so 1 stands.
        self.contention = max(1.0, at / alone)
        self.notes.append(
            f"compute x{self.contention:.3g}: the slowest of {busy} single-threaded processes "
            f"busy per node runs slower than {threads} (cpu_concurrency of {self.figures.path}: "
            f"{at:.3g} / {alone:.3g}{', below 1: read as 1' if at < alone else ''})"
        )

    def _take_own_step(self, busy: int) -> bool:
        """Where the curve timed this rank's own step: its time alone as the rank's compute,
        and its lockstep slowdown at `busy` when measured (True: the contention is set)."""
        own = self._matching_step()
        if own is None:
            return False
        batch, alone_s = self.own_step = own
        law = f"{self.law.seconds(batch) * 1e3:.3g} ms" if self.law is not None else "none"
        self.notes.append(
            f"compute: a rank's step at {batch} items alone {alone_s * 1e3:.3g} ms, the "
            f"cpu_concurrency curve's own time of this step ({self.figures.path}), in place "
            f"of the calibration's value at that batch ({law})"
        )
        lock = self.figures.cpu_lockstep(busy)
        if lock is None:
            return False
        self.contention = max(1.0, lock)
        self.notes.append(
            f"compute x{self.contention:.3g}: the slowest call per lockstep round of {busy} "
            f"single-threaded processes running this step, median over rounds, over one alone "
            f"(slowdown_lockstep of the cpu_concurrency of {self.figures.path}: {lock:.3g}"
            f"{', below 1: read as 1' if lock < 1 else ''})"
        )
        return True

    def _matching_step(self) -> tuple[int, float] | None:
        """(the rank's batch, the step's seconds alone) where the curve's `step` is this
        scenario's rank step, else None."""
        got = self.figures.cpu_step()
        s, cfg = self.scenario, self.scenario.cfg
        whole = STRATEGIES.get(cfg.strategy).replicates_model(cfg)
        # Inference only for now: a training step's call (zero_grad, forward, backward, the
        # optimizer's step) is not yet checked against what a data-parallel run's "compute"
        # phase holds, and plan's curves (timed on its plain candidate's rank step) would move
        # its training predictions unverified.
        if got is None or not whole or self.spatial or (cfg.threads or 1) != 1 or cfg.train:
            return None
        step, batch = got[0], math.ceil(s.rank_batch - 1e-9)  # the largest rank's share
        same = (
            step.get("workload") == cfg.workload
            and step.get("model") == cfg.model
            and bool(step.get("train")) == bool(cfg.train)
            and step.get("dtype", cfg.dtype) == cfg.dtype
            and step.get("threads", 1) == 1
            and step.get("batch") == batch
        )
        return (batch, got[1]) if same else None

    @property
    def sources(self) -> dict[str, str]:
        return {} if self.law is None else dict.fromkeys(self.law.point.sources, "compute")

    @property
    def overhead_s(self) -> float:
        """Host time per iteration outside every phase, as measured on one rank."""
        return 0.0 if self.law is None else self.law.point.overhead_s

    def seconds(self, batch: float) -> float:
        if self.own_step is not None and math.isclose(batch, self.own_step[0]):
            return self.contention * self.own_step[1]
        if self.law is not None:
            return self.contention * self.law.seconds(batch)
        return self.contention * sum(
            t for _, t in roofline_layers(self.scenario, self.figures, batch)
        )

    @property
    def fixed_s(self) -> float:
        """The calibrated per-iteration cost that does not shrink with the batch (0 for the
        roofline and for time proportional to the batch)."""
        if self.law is None:
            return 0.0
        a = self.law.point
        return self.contention * max(0.0, a.compute_s - self.law.per_item_s * a.batch)

    def phases(self, batch: float) -> dict[str, float]:
        """{"launch": the fixed part, "compute": the rest} of the compute at batch."""
        total = self.seconds(batch)
        fixed = min(self.fixed_s, total)
        return {"launch": fixed, "compute": total - fixed} if fixed > 0 else {"compute": total}

    def layer_times(self, batch: float) -> list[tuple[str, float]]:
        """Per-layer seconds at batch: the anchor's measured layers scaled to its compute
        time at batch, else roofline layers (for the shares the spatial split needs)."""
        total = self.seconds(batch)
        measured = self.law.point.layer_times if self.law is not None else None
        rows = list(measured) if measured else roofline_layers(self.scenario, self.figures, batch)
        scale = total / max(sum(t for _, t in rows), 1e-30)
        return [(name, t * scale) for name, t in rows]
