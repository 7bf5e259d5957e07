"""`instrumented(cfg, strategy, model)`: the one hook the runner puts around a run.

It starts what the flags ask for (`--trace`, `--nvml`, `--per-layer`), all fed by the same
`PhaseTimer.phase` calls, and afterwards hands back the record fields they produced (merged
into `RunOutput.notes`, so into the record). With no flag set it starts nothing and costs a
few attribute reads. Every rank runs it; per-rank results are gathered to the root rank.

Record fields:
  device_phases: {phase: median CUDA-event seconds} of the root rank (GPU inference runs)
  trace: {"dir", "schedule": {wait, warmup, active}, "files": [per rank, None if unwritten]}
  nvml: the root rank's nvml.summarize() dict; rank_nvml: every rank's (ranks > 1)
  layers: the root rank's PerLayer.rows() (with --nvml also each layer's power_w and
      energy_j); rank_layers: every rank's (ranks > 1)
  timeline (--timeline, --trace): every rank's spans on the root's clock (instrument/spans.py,
      instrument/trace_events.py); --trace also writes DIR/timeline.json (Chrome trace events)
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scalelab.config import RunConfig
from scalelab.instrument.nvml import NvmlSampler
from scalelab.instrument.per_layer import PerLayer
from scalelab.instrument.profiler import TraceSchedule, TraceSession
from scalelab.instrument.spans import SPANS, SpanLog, clock_offset, slow_rank_delay
from scalelab.instrument.timer import HUB
from scalelab.workloads.base import Workload


def trace_plan(cfg: RunConfig, train_size: int) -> TraceSchedule:
    """Inference: warm up on the untimed iterations, record timed ones. Training (clocked by
    the loop's notify_step, once per optimizer step): skip the first two steps (allocation,
    autotuning) when there are enough."""
    if not cfg.train:
        return TraceSchedule.fit(cfg.warmup, cfg.iters)
    from scalelab.train.loop import total_steps

    steps = total_steps(train_size, cfg.batch, cfg.epochs, cfg.steps)
    warm = min(2, steps - 1)
    return TraceSchedule.fit(warm, steps - warm)


class Instrumentation:
    def __init__(self, cfg: RunConfig, strategy: Any, model: nn.Module, workload: Workload) -> None:
        self.cfg = cfg
        self.workload = workload
        self.comm = strategy.comm
        self.device = getattr(strategy, "device", None) or torch.device("cpu")
        self.model = model
        self.trace: TraceSession | None = None
        self.nvml: NvmlSampler | None = None
        self.per_layer: PerLayer | None = None
        self.spans: SpanLog | None = None
        self.clock = (0.0, 0.0)  # (offset to the root's clock, round trip) in seconds
        self._stack = ExitStack()

    @property
    def active(self) -> bool:
        return bool(self.cfg.trace or self.cfg.nvml or self.cfg.per_layer or self.spans)

    def __enter__(self) -> Instrumentation:
        try:
            self._start()
        except BaseException:
            self._stack.close()  # a failed start leaves no hook or thread behind
            raise
        return self

    def _start(self) -> None:
        cfg, stack = self.cfg, self._stack
        if cfg.nvml:  # first: it refuses machines without NVML before anything starts
            self.nvml = NvmlSampler(self.device)
        self._start_spans()
        if cfg.per_layer:
            names = {r.module: (r.name, r.kind) for r in self.workload.cost_table() if r.module}
            self.per_layer = stack.enter_context(
                PerLayer(self.model, self.device, cfg.train, names)
            )
        if cfg.trace:
            self.trace = stack.enter_context(
                TraceSession(
                    cfg.trace,
                    self.comm.rank,
                    self.comm.size,
                    self.comm.backend,
                    trace_plan(cfg, self.workload.train_size),
                    cuda=self.device.type == "cuda",
                )
            )
        if self.nvml is not None:
            stack.enter_context(self.nvml)

    def _start_spans(self) -> None:
        """The straggler test hook, and with --timeline/--trace the span log (clocks first)."""
        slow = slow_rank_delay(self.comm.rank)
        if slow:
            SPANS.slow_compute_s = slow
            self._stack.callback(setattr, SPANS, "slow_compute_s", 0.0)
        if not (self.cfg.timeline or self.cfg.trace):
            return
        self.clock = clock_offset(self.comm)
        self.spans = SPANS.log = SpanLog()
        HUB.step_hooks.append(self.spans.step)
        self._stack.callback(HUB.step_hooks.remove, self.spans.step)
        self._stack.callback(setattr, SPANS, "log", None)

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
        if self.trace is not None and not self.trace.written and exc[0] is None:
            sys.stderr.write(
                f"scalelab: --trace: rank {self.comm.rank} ended before the profiler's "
                f"recording window {self.trace.notes()['schedule']}; no trace written\n"
            )

    def _layers(self) -> list[dict[str, Any]] | None:
        if self.per_layer is None:
            return None
        rows = self.per_layer.rows()
        if self.nvml is not None:  # the seed's per-layer power study
            for row in rows:
                spans = self.per_layer.stats[row["module"]].intervals
                seen = self.nvml.over(spans)
                row.update(power_w=seen["power_w"], energy_j=seen["energy_j"])
        return rows

    def _local(self) -> dict[str, Any]:
        return {
            "trace": self.trace.notes()["file"] if self.trace else None,
            "nvml": self.nvml.notes() if self.nvml else None,
            "layers": self._layers(),
            "spans": self._spans(),
        }

    def _spans(self) -> dict[str, Any] | None:
        if self.spans is None:
            return None
        offset, rtt = self.clock
        rows = self.spans.rows(offset, 0.0)  # absolute, on the root's clock
        return {"offset_s": offset, "rtt_s": rtt, "dropped": self.spans.dropped, "spans": rows}

    def notes(self, output: Any) -> dict[str, Any]:
        """Record fields; a collective (gather) when any flag is on, so every rank calls it."""
        out: dict[str, Any] = {}
        device_phases = output.timings.device_phase_medians()
        if device_phases:
            out["device_phases"] = device_phases
        if not self.active:
            return out
        ranks = self.comm.gather_object(self._local())
        if ranks is None:  # not the root rank
            return out
        if self.cfg.trace:
            schedule = self.trace.notes()["schedule"]
            files = [r["trace"] for r in ranks]
            out["trace"] = {"dir": self.cfg.trace, "schedule": schedule, "files": files}
        if self.spans is not None:
            out["timeline"] = self._timeline([r["spans"] for r in ranks])
        for key in ("nvml", "layers"):
            if ranks[0][key] is not None:
                out[key] = ranks[0][key]
                if len(ranks) > 1:
                    out[f"rank_{key}"] = [r[key] for r in ranks]
        return out

    def _timeline(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        """The record's timeline: spans from the earliest start; --trace: DIR/timeline.json."""
        from scalelab.instrument.trace_events import make_timeline, write_trace

        timeline = make_timeline(ranks)
        if self.cfg.trace:
            rec = {"strategy": self.cfg.strategy, "workload": self.cfg.workload}
            write_trace([{**rec, "timeline": timeline}], Path(self.cfg.trace) / "timeline.json")
        return timeline


def instrumented(
    cfg: RunConfig, strategy: Any, model: nn.Module, workload: Workload
) -> Instrumentation:
    return Instrumentation(cfg, strategy, model, workload)
