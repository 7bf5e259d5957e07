"""`pipeline --engine torch`: the workload's layers cut into S x V stages (the same cut and
balancing as the hand engine: `--balance auto|5,7`, `--rebalance R`), run by a schedule from
torch.distributed.pipelining (`--schedule gpipe|1f1b|interleaved-1f1b|looped-bfs|zero-bubble|
zbv|dualpipev`), optionally replicated `--dp D` times on a (dp, pp) device mesh.

Training goes through train/loop.py's Trainer (checkpoints, resume, NaN stop): its step here is
the schedule's step (forward and backward of every micro-batch), then the gradients summed over
the dp group, then the workload's parameter penalty (mlp's L2: strategies/penalty.py) per
stage, then SGD (a parameter tied across stages summed over its holders first:
torch_tied.py). The loss of micro-batch m is its mean cross-entropy weighted by n_m / N (N the
global batch), torch's own scaling off: one pipelined step equals one single-process step.

Every rank holds the whole model on the host (the optimizer is built over it; other stages'
parameters never get a gradient, so SGD skips them) and its own pieces on the device.
Checkpoints and --save-weights gather each stage's parameters from replica 0 onto the root.

The record's `pipeline` field carries what the hand engine's does (per-stage times, bubble
measured and simulated, timelines) plus engine, virtual stages and the mesh: the simulation
replays the schedule's own action lists with the measured per-stage times
(layout/torch_schedule.py).

Two gaps of torch 2.13's split backward (zero-bubble, zbv, dualpipev) are closed in
torch_stages.py with torch's own API: a stage after parameter-free stages runs its whole
backward (whole_backward_stages: PipelineStage's dw_builder), and a stage output is never a
view (OwnedOutput). Every schedule trains any cut like one process.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from scalelab.errors import UsageError
from scalelab.instrument.timer import timed_iterations
from scalelab.layout import partition as part
from scalelab.layout import profiling
from scalelab.layout.preserve import kept_state
from scalelab.layout.torch_schedule import NO_EVAL, stage_ids, virtual_stages
from scalelab.results import RunOutput
from scalelab.strategies import penalty as pen
from scalelab.strategies.mesh import Layout, MeshGroups
from scalelab.strategies.pipeline import torch_trace as tr
from scalelab.strategies.pipeline.placements import PLACEMENTS
from scalelab.strategies.pipeline.torch_report import RunLog, torch_pipeline_notes
from scalelab.strategies.pipeline.torch_stages import (
    Clock,
    Pass,
    build_pass,
    micro_for,
    whole_backward_stages,
)
from scalelab.strategies.pipeline.torch_tied import TiedGrads
from scalelab.strategies.torchdist_base import TorchDistStrategy
from scalelab.train.loop import GlobalBatches, TorchStep, TrainPlan, require_labels, run_training
from scalelab.train.sources import Step
from scalelab.workloads.base import Inputs, Workload


class TorchPipeline(TorchDistStrategy):
    name = "pipeline"
    reads = PLACEMENTS["torch"].reads
    needs_data_everywhere = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.layout = Layout(cfg.dp, cfg.stages, "pp")
        self.log = RunLog()

    # --- checks ---------------------------------------------------------------------------
    def validate(self, workload: Workload) -> None:
        cfg = self.cfg
        self.v = virtual_stages(cfg.schedule, cfg.virtual_stages)
        if cfg.cut is not None:  # names the model's modules: refused before any work
            with torch.device("meta"):
                layers = workload.layers(workload.build_model())
            counts = part.given_counts(cfg.balance, cfg.cut, [x.path for x in layers],
                                       cfg.stages * self.v)  # fmt: skip
            blocks = getattr(workload, "blocks", None)
            if blocks is not None:
                tr.check_cut(counts, layers, blocks.cut_points)
        self.layout.check(self.comm.size, "pipeline --engine torch")
        if self.precision.autocast is torch.float16 and cfg.train:
            raise UsageError("pipeline --engine torch trains in fp64/fp32/tf32/bf16; use bf16")
        self.groups = MeshGroups(self.layout, self.device.type)

    # --- the cut ----------------------------------------------------------------------------
    def setup(self, workload: Workload, model: nn.Module, sample: torch.Tensor) -> None:
        """sample: one batch's transport-form items, on every rank."""
        cfg = self.cfg
        self.workload, self.model = workload, model.to(dtype=self.precision.storage)
        self.layers = workload.layers(model)
        self.n_stages = cfg.stages * self.v
        self.clock = Clock(device=self.device)
        # A model whose layers do not compose (block_layers.BlockView): torch's tracer cuts it
        self.blocks = getattr(workload, "blocks", None)
        paths = [x.path for x in self.layers]
        counts = part.given_counts(cfg.balance, cfg.cut, paths, self.n_stages)
        if counts is not None and self.blocks is not None:
            tr.check_cut(counts, self.layers, self.blocks.cut_points)
        self.profile: list[part.LayerProfile] | None = None
        self.balance_rounds: list[dict[str, Any]] = []
        auto = counts is None
        # the balancing passes leave the model's state and the RNG as they were
        with kept_state([model]) if cfg.train else nullcontext():
            if auto:
                counts = self.comm.bcast_object(self._auto_counts(sample) if self.is_root else None)
            self._place(counts)
            if auto and cfg.stages > 1 and cfg.rebalance > 0:
                self._rebalance(sample)
        self.log.current.clear()  # the balancing passes are not steps

    def _auto_counts(self, sample: torch.Tensor) -> list[int]:
        cfg = self.cfg
        n = cfg.batch // (cfg.dp * cfg.microbatches)
        if self.blocks is not None:
            self.profile = tr.flop_profile(
                self.workload.cost_table(), n, cfg.train, self.precision.itemsize
            )
        else:
            x = self.workload.prepare(sample[:n].to(self.device)).to(self.precision.storage)
            self.profile = profiling.profile_layers(
                self.layers,
                x,
                self.device,
                self.precision.storage,
                cfg.train,
                self.autocast,
                channels_last=cfg.channels_last,
            )
        capacity = profiling.device_capacity(self.device, profiling.env_mem_limit())
        self._mem = part.memory_model(
            capacity, self.n_stages, cfg.microbatches, cfg.train, cfg.schedule, cfg.momentum
        )
        counts = part.balance_auto(self.profile, self.n_stages, self._mem)
        if self.blocks is not None:
            counts = part.snap_counts(counts, self.layers, self.blocks.cut_points)
        return counts

    def _place(self, counts: list[int]) -> None:
        """This rank's pieces of the cut on the device; passes are built per size on use."""
        self.counts = counts
        bounds = part.bounds(counts)
        self.whole_backward = whole_backward_stages(
            [any(p.numel() for lay in self.layers[slice(*b)] for p in lay.module.parameters())
             for b in bounds]
        )  # fmt: skip
        ids = stage_ids(self.cfg.schedule, self.groups.inner_rank, self.cfg.stages, self.v)
        for piece in getattr(self, "pieces", {}).values():
            piece.to("cpu")
        self.ids = sorted(ids)
        self.traced: dict[tuple[int, bool], dict[int, nn.Module]] = {}
        self.tied = TiedGrads(self.cfg.schedule, self.cfg.stages, self.v, self.cfg.dp,
                              self.groups.dp_rank)  # fmt: skip
        if self.blocks is not None:  # traced per micro-batch size (_pieces_for)
            self.pieces = {}
        else:
            self.pieces = {
                i: nn.Sequential(*[lay.module for lay in self.layers[slice(*bounds[i])]]).to(
                    device=self.device, dtype=self.precision.storage
                )
                for i in self.ids
            }
        self.passes: dict[tuple[int, bool], Pass] = {}

    def _pieces_for(self, size: int, train: bool) -> dict[int, nn.Module]:
        """This rank's pieces for micro-batches of `size` items: the Sequential of its layers,
        or for a traced model (torch_trace.py) the tracer's stage modules for that size."""
        if self.blocks is None:
            return self.pieces
        if (size, train) not in self.traced:
            starts = [self.layers[a].path for a, _ in part.bounds(self.counts)[1:]]
            x = self.workload.synthetic_inputs(size, self.cfg.seed).x
            x = self.workload.prepare(x).to(self.precision.storage)
            mode = self.model.training
            self.model.train(train)
            try:  # the whole model on the device for the export, then back on the host
                traced = tr.trace_pieces(self.model, x, starts, self.ids, self.device)
            finally:
                self.model.train(mode)
                for pieces in self.traced.values():  # the earlier traces' parameters too
                    for piece in pieces.values():
                        piece.to(self.device)
            self.traced[(size, train)] = traced.pieces
            self.tied.add(traced.tied, self.ids)
            if train == self.cfg.train:  # the run's own mode: what it owns and exports
                # (an eval-mode trace leaves out buffers its graph does not read, such as
                # BatchNorm's batch count, and torch_state reads ownership from self.pieces)
                self.pieces = self.traced[(size, train)]
        return self.traced[(size, train)]

    def _rebalance(self, sample: torch.Tensor) -> None:
        """--rebalance R: time each stage in a real pipelined pass, re-cut the profile fitted
        to every cut timed (partition.rebalance), keep the fastest cut; at most R rounds."""
        timed: dict[tuple[int, ...], float] = {}
        n = self.cfg.batch
        for round_ in range(self.cfg.rebalance + 1):
            for _ in range(2):  # the second pass counts (the first allocates)
                self._run_pass(Inputs(sample[:n], self.workload.blank_targets(n)), n, True)
            self._drop_grads()
            per_stage = self.comm.gather_object(self.log.stage_seconds(self.clock.events))
            decision = None
            if self.is_root:
                measured = [0.0] * self.n_stages
                for rank_times in per_stage:
                    for i, s in rank_times.items():
                        measured[i] = max(measured[i], s)
                counts, done = part.recut_step(
                    self.profile, self.balance_rounds, timed, self.counts, measured,
                    round_ == self.cfg.rebalance, self._mem,
                )  # fmt: skip
                decision = (self._snapped(counts), done)
            counts, done = self.comm.bcast_object(decision)
            if counts != self.counts:
                self._place(counts)
            if done:
                return

    def _snapped(self, counts: list[int]) -> list[int]:
        """A re-cut of a traced model moved to modules torch's tracer splits before (the timed
        re-cut may fall between them: a stage began at a root op, whose path is None, and the
        trace raised on one rank in four); where none fits, the current cut stays."""
        if self.blocks is None:
            return counts
        try:
            return part.snap_counts(counts, self.layers, self.blocks.cut_points)
        except UsageError:
            return self.counts

    # --- one pass ---------------------------------------------------------------------------
    def _pass_for(self, n_local: int, train: bool) -> Pass:
        key = (n_local, train)
        if key not in self.passes:
            micro = micro_for(n_local, self.cfg.microbatches)
            loss = self._loss if train or self.cfg.schedule in NO_EVAL else None
            # a traced model's pieces carry the mode they were traced in (BatchNorm's batch
            # statistics and running-stat updates are baked into the graph): the held-out
            # passes of a training run need the eval-mode trace
            pieces = self._pieces_for(n_local // micro, train)
            if self.cfg.channels_last:  # the weights NHWC; the stages' boundaries stay NCHW
                for piece in pieces.values():
                    piece.to(memory_format=torch.channels_last)
            self.passes[key] = build_pass(
                self.cfg.schedule, pieces, self.n_stages, self.device,
                self.groups.inner_group, micro, loss, self.clock, self.whole_backward,
                channels_last=self.cfg.channels_last,
            )  # fmt: skip
        return self.passes[key]

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Micro-batch m's share of the global batch's mean cross-entropy: mean_m * n_m / N
        (zero for forward-only passes that run a training schedule)."""
        base = pen.item_loss(self.workload, out, target)
        return base * (len(target) * self._scale)

    def _run_pass(self, local: Inputs, n_global: int, train: bool):
        """This replica's share through the schedule; returns (outputs on the last stage or
        None, summed loss * N on the last stage or None)."""
        p = self._pass_for(len(local), train)
        self._scale = 1.0 / n_global if train else 0.0
        args = ()
        if p.first:
            x = self.to_device(local.x)
            args = (self.workload.prepare(x).to(self.precision.storage),)
        target = self.to_device(local.y) if p.last and local.y is not None else None
        if p.last and target is None:
            target = self.workload.blank_targets(len(local), self.device)
        losses: list[torch.Tensor] = []
        start = self.clock.start()
        with self.autocast():
            if train or self.cfg.schedule in NO_EVAL:
                out = p.schedule.step(*args, target=target, losses=losses)
            else:
                with torch.no_grad():
                    out = p.schedule.eval(*args)
        self.log.add_pass(self.clock.events, start, self.clock.finish(), self.cfg.train)
        loss_sum = (
            torch.stack(losses).detach().sum().double() * n_global if losses and train else None
        )
        return (out if p.last else None), loss_sum

    def _drop_grads(self) -> None:
        for piece in self.pieces.values():
            piece.zero_grad(set_to_none=True)

    def _own_params(self) -> list[nn.Parameter]:
        """This rank's parameters, once each (two stages on one rank may share a tied one)."""
        own = {id(p): p for piece in self.pieces.values() for p in piece.parameters()}
        return list(own.values())

    # --- hooks of the training loop ---------------------------------------------------------
    def shard(self, batch: Inputs) -> Inputs:
        share = self.groups.share(len(batch))
        return batch.slice(share.start, share.stop)

    def all_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.comm.device)
        return float(self.comm.allreduce(t).cpu()[0])

    # --- inference --------------------------------------------------------------------------
    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        x = self.comm.bcast_object(inputs.x if self.is_root else None)
        self.setup(workload, model, x)
        local = self.shard(Inputs(x, None))

        def step() -> torch.Tensor | None:
            with self.timer.phase("schedule"):
                out, _ = self._run_pass(local, len(x), False)
            self.log.end_step()
            with self.timer.phase("gather"):
                return self.groups.gather_replicas(self.comm, out)

        timings, out = timed_iterations(
            step, self.timer, self.cfg.warmup, self.cfg.iters, barrier=self.comm.barrier
        )
        return RunOutput(
            timings,
            self.gather_phases(timings),
            None if out is None else np.asarray(out),
            len(x),
            notes=torch_pipeline_notes(self, train=False),
        )

    # --- training ---------------------------------------------------------------------------
    def train(
        self, workload: Workload, model: nn.Module, data: tuple[Inputs, Inputs] | None
    ) -> RunOutput:
        train, heldout = data
        require_labels(train, heldout)
        self.setup(workload, model, train.x[: self.cfg.batch])
        from scalelab.strategies.pipeline.torch_state import export_state, import_state

        plan = TrainPlan(
            source=GlobalBatches(self, train, self.cfg.batch, self.cfg.seed),
            evaluate=lambda m: self.evaluate(heldout),
            module=self.model,
            prepare=workload.prepare,
            loss=workload.loss,
            n_train=len(train),
            export_state=lambda m, opt: export_state(self, opt),
            import_state=lambda m, opt, s, o: import_state(self, opt, s, o),
        )
        step = PipelineStep(self, workload, self.model, plan)
        out = run_training(self, workload, self.model, plan, step=step)
        whole = export_state(self, None)
        if whole is not None:
            self.model.load_state_dict(whole[0])
        out.model = self.model if self.is_root else None
        out.notes.update(torch_pipeline_notes(self, train=True))
        return out

    def evaluate(self, heldout: Inputs) -> float:
        """Held-out accuracy: each replica scores its share, batch by batch (untimed)."""
        share = self.groups.share(len(heldout))
        mine = heldout.slice(share.start, share.stop)
        correct = 0
        for piece in self.pieces.values():  # BatchNorm: running statistics, not updated
            piece.eval()
        for start in range(0, len(mine), max(self.cfg.batch // self.cfg.dp, 1)):
            piece = mine.slice(start, start + self.cfg.batch // self.cfg.dp)
            out, _ = self._run_pass(Inputs(piece.x, None), len(piece), False)
            if out is not None:
                correct += self.workload.score(out, piece.y)
        for module in self.pieces.values():
            module.train()
        self._drop_grads()
        self.log.drop_last_passes(evaluation=True)
        self.timer.lap()
        return self.all_sum(correct) / max(len(heldout), 1)


class PipelineStep(TorchStep):
    """The Trainer's pluggable step: the schedule's forward and backward of every
    micro-batch, the dp sum, the penalty, SGD (the optimizer spans the whole model)."""

    def __call__(self, step: Step) -> torch.Tensor:
        s: TorchPipeline = self.strategy
        with self.timer.phase("schedule"):
            _, loss_sum = s._run_pass(step.local, step.items, True)
        if s.tied.names:  # a tied parameter's uses on other stages (torch_tied.py)
            with self.timer.phase("tied_allreduce"):
                self.timer.add_bytes("tied_allreduce", s.tied.sum_grads())
        with self.timer.phase("dp_allreduce"):
            sent = s.groups.all_reduce_grads(s._own_params())
        self.timer.add_bytes("dp_allreduce", sent)
        total = torch.zeros((), dtype=torch.float64, device=s.device)
        if loss_sum is not None:
            total = total + loss_sum
        for piece in s.pieces.values():  # after the dp sum: the penalty's gradient once
            reg = pen.penalty(s.workload, piece.named_parameters())
            if reg is not None:
                if reg.requires_grad:  # a user model's loss adds nothing: a constant zero
                    reg.backward()
                total = total + reg.detach().double() * len(step.local)
        with self.timer.phase("step"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        s.log.end_step()
        return total
