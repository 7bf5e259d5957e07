"""`mpi`, `mpi-gpu` and `nccl` inference: one model per --split, the transport per strategy.

batch (per iteration, B items over N ranks, critical path through the root):
    scatter   root's local copy of its share (host wires: 2 B/N in / host copy bandwidth)
              + the wire: (N-1) alpha + (N-1)/N * B in / beta     (in: bytes per input item)
              mpi-gpu: + h2d of the share from the pageable receive buffer
              nccl:    + h2d of the whole batch on the root first (pinned input)
    compute   t(ceil(B / N))                                       (calibration.py)
    beside    GPU ranks: what a forward call costs beside the other ranks of the host, from
              a measured multi-GPU batch-split run of the family (beside())
    gather    outputs (B/N x classes, compute dtype): d2h of the share (mpi-gpu, pinned),
              the wire, and on nccl the root's pageable d2h of the whole output
    overhead  the one-rank record's host time outside every phase
--overlap (mpi-gpu) pipelines --chunks chunks: only one chunk's in- and outbound transfers
stay exposed, and the share is computed in one forward call per chunk. broadcast: every
rank gets the batch and all weights (binomial tree) and computes the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from scalelab.predict.models.base import (
    MODELS,
    Context,
    StrategyModel,
    Wire,
    item_bytes,
    output_width,
    param_layers,
    storage_bytes,
)
from scalelab.predict.scenario import Prediction, Scenario
from scalelab.registry import Registry

SplitFn = Callable[[Context, Scenario, Wire], Prediction]
SPLITS: Registry[SplitFn] = Registry("split model")
# split name -> why it cannot run a scenario (or None); splits with conditions register here
SPLIT_CHECKS: dict[str, Callable[[Scenario], str | None]] = {}
COMM = frozenset({"scatter", "gather", "bcast", "halo", "allreduce"})


class SplitModel(StrategyModel):
    wire_of: Wire

    def wire(self, scenario: Scenario) -> Wire:
        return self.wire_of

    def infeasible(self, scenario: Scenario) -> str | None:
        cfg = scenario.cfg
        if cfg.split == "batch" and scenario.ranks > cfg.batch:
            return f"{scenario.ranks} ranks but only {cfg.batch} items in the batch"
        check = SPLIT_CHECKS.get(cfg.split)
        return None if check is None else check(scenario)

    def predict(self, ctx: Context, scenario: Scenario) -> Prediction:
        return SPLITS.get(scenario.cfg.split)(ctx, scenario, self.wire(scenario))


@MODELS.register("mpi", "CPU ranks, MPI on host buffers")
class MPIModel(SplitModel):
    wire_of = Wire("mpi", staged=False, gpu=False)


@MODELS.register("mpi-gpu", "GPU ranks, MPI through pinned host staging")
class MPIGPUModel(SplitModel):
    wire_of = Wire("mpi", staged=True, gpu=True)


@MODELS.register("nccl", "GPU ranks, NCCL on device buffers")
class NCCLModel(SplitModel):
    def wire(self, scenario: Scenario) -> Wire:
        gpu = scenario.cfg.device == "cuda"
        return Wire("nccl" if gpu else "gloo", staged=False, gpu=gpu)


def scatter_in(ctx: Context, s: Scenario, wire: Wire, total: float) -> float:
    """Root -> every rank's share of `total` input bytes, and onto the rank's device."""
    n, f = s.ranks, ctx.figures
    t = ctx.fabric(s, wire.backend).scatter(total, n)
    if not wire.gpu:
        return t + 2 * total / n / f.host_copy_Bps()
    if wire.staged:  # MPI receives into pageable host memory, then h2d
        return t + 2 * total / n / f.host_copy_Bps() + total / n / f.copy_Bps("h2d", "pageable")
    return total / f.copy_Bps("h2d", "pinned") + t  # nccl: the root's pinned batch goes up first


def gather_out(ctx: Context, s: Scenario, wire: Wire, total: float) -> float:
    """Every rank's share of `total` output bytes -> the root's host."""
    n, f = s.ranks, ctx.figures
    t = ctx.fabric(s, wire.backend).scatter(total, n)
    if wire.staged:
        return total / n / f.copy_Bps("d2h", "pinned") + t
    if wire.gpu:
        return t + total / f.copy_Bps("d2h", "pageable")
    return t


def beside(ctx: Context, s: Scenario) -> tuple[float, str | None]:
    """The seconds a GPU rank's forward call takes beside the other ranks of its host over
    what the one-GPU law says, and the run that shows it: a measured multi-GPU batch-split
    run of the family (Pool.split_anchor), its root's compute phase less its own file's
    one-GPU law at its share (never below 0). A short call is bound by its host's kernel
    launches, and the ranks' processes share that host (its cores, memory bandwidth, the
    driver): AlexNet's 32 images per GPU took 10 ms a call on each of 2 H200 ranks, mpi-gpu
    and nccl alike, where one GPU alone took 3.9 ms for 64, and 4 chunks of 8 took 8.9 ms
    each under --overlap: a cost per call, not per image. A long call does not see it (a
    char-CNN's 32k images per GPU: 731 ms on each of 2, 1463 ms for 65k on one). (0, None) on
    CPU ranks (their contention is the ceilings' cpu_concurrency) and without such a run."""
    if s.cfg.device != "cuda" or s.ranks < 2:
        return 0.0, None
    m = ctx.pool.split_anchor(s)
    if m is None or m.compute_s is None:
        return 0.0, None
    alone = ctx.of_run(m.source).compute(m.scenario)
    if alone.law is None:
        return 0.0, None
    share = math.ceil(m.scenario.cfg.batch / m.scenario.ranks)
    return max(0.0, m.compute_s - alone.seconds(share)), m.source


@SPLITS.register("batch", "Scatterv the batch, compute, Gatherv")
def batch_split(ctx: Context, s: Scenario, wire: Wire) -> Prediction:
    cfg, n = s.cfg, s.ranks
    compute = ctx.compute(s)
    share = math.ceil(cfg.batch / n)
    # --overlap on GPUs computes the share chunk by chunk: a forward call per chunk, each
    # paying the per-call costs (the law's fixed part, the host's beside the other ranks)
    calls = max(cfg.chunks, 1) if cfg.overlap and wire.gpu else 1
    per_call, shown_by = beside(ctx, s)
    phases = {
        "scatter": scatter_in(ctx, s, wire, cfg.batch * item_bytes(s)),
        **{k: v * calls for k, v in compute.phases(share / calls).items()},
        "beside": calls * per_call,
        "gather": gather_out(ctx, s, wire, cfg.batch * output_width(s) * storage_bytes(s)),
        "overhead": compute.overhead_s,
    }
    notes = list(compute.notes)
    if cfg.overlap and wire.gpu:
        chunks = max(cfg.chunks, 1)
        phases["scatter"] /= chunks
        phases["gather"] /= chunks
        notes.append(f"--overlap: {chunks} chunks, one chunk's transfers exposed")
    pred = Prediction(s, phases, COMM, compute.sources, notes)
    if shown_by is not None:
        pred.calibration[shown_by] = "GPU ranks' compute"
        notes.append(
            f"beside: {per_call * 1e3:.3g} ms per forward call of a GPU rank beside the others "
            f"of its host, as {shown_by} computed its share over the one-GPU law"
        )
    return pred


@SPLITS.register("broadcast", "every rank gets the whole batch and every weight")
def broadcast_split(ctx: Context, s: Scenario, wire: Wire) -> Prediction:
    cfg, n, f = s.cfg, s.ranks, ctx.figures
    compute = ctx.compute(s)
    weights = sum(p for _, p, _ in param_layers(s)) * storage_bytes(s)
    total = cfg.batch * item_bytes(s) + weights
    bcast = ctx.fabric(s, wire.backend).bcast(total, n)
    if wire.gpu and n > 1:
        bcast += total / f.copy_Bps("h2d", "pageable" if wire.staged else "pinned")
    phases = {"bcast": bcast, **compute.phases(cfg.batch), "overhead": compute.overhead_s}
    return Prediction(s, phases, COMM, compute.sources, list(compute.notes))
