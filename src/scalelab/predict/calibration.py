"""Measured points the model is calibrated on, and how compute time moves with the batch.

A user measures a configuration on one rank (one GPU, one core) and asks how it scales; the
model takes that measurement's compute time as given and predicts everything else. A
CalPoint is such a one-rank measurement: its compute seconds per iteration at its batch, the
host time no phase accounts for, and (where the record has them) per-layer times.

Compute at another batch b (strong scaling shrinks each rank's share):

    t(b) = t_a + c (b - b_a)

anchored at the point a of the same configuration (same named series, else the same batch,
else the nearest), with slope c fitted by least squares over every one-rank point of the
family (same workload, device, precision, ...) when they span two batch sizes: the intercept
is the per-step cost that does not shrink with the batch (kernel launches on a GPU). With one
batch size only, t is proportional to b (c = t_a / b_a).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from scalelab.config import RunConfig
from scalelab.predict.model_registry import modelled_by
from scalelab.predict.scenario import Scenario
from scalelab.strategies import STRATEGIES


@dataclass(frozen=True)
class CalPoint:
    family: tuple
    strategy: str
    split: str | None
    batch: int  # items per iteration on the one rank
    compute_s: float  # compute seconds per iteration (a whole step for training summaries)
    overhead_s: float  # per-iteration host time outside every phase
    source: str
    series: str | None = None
    layer_times: tuple[tuple[str, float], ...] | None = None  # (step name, seconds)
    warnings: tuple[str, ...] = ()  # the record's run warnings (busy host, unstable timing)
    cfg: RunConfig | None = None  # the run's configuration, where a run record gave it
    forward_host_s: float | None = None  # torch pipelining: forward actions' s per micro-batch
    # the sources of the runs whose median this point's compute is (typical), else ()
    pooled: tuple[str, ...] = ()
    forward_s: float | None = None  # a training step's forward part (forward_part)

    @property
    def sources(self) -> tuple[str, ...]:
        """Every run this point's figures come from."""
        return self.pooled or (self.source,)

    @property
    def bare(self) -> bool:
        """Whether the point is the bare step its compute law wants (see Pool.candidates)."""
        runtime = self.cfg is not None and (dtensor_run(self.cfg) or pipelining_run(self.cfg))
        return not STRATEGIES.get(self.strategy).shards_parameters and not runtime


@dataclass(frozen=True)
class MultiPoint:
    """A measured multi-rank point, for the few figures only such a run shows (DDP's host
    cost per step): the scenario it ran and its seconds per iteration."""

    scenario: Scenario
    seconds: float
    source: str
    warnings: tuple[str, ...] = ()
    forward_host_s: float | None = None  # torch pipelining: forward actions' s per micro-batch
    compute_s: float | None = None  # the root's compute phase per iteration (split_calibrated)
    forward_s: float | None = None  # a training step's forward part (forward_part)


def unwarned(points: list) -> list:
    """The points whose runs carry no warning, when there are any: a run warned busy or
    unstable (a local run at CV 87%) calibrated a 17x-off prediction on a loaded host."""
    return [p for p in points if not p.warnings] or points


@dataclass
class Pool:
    """Measurements of one machine. `prefer`: a results file's name; when that file holds
    points of a family, only they calibrate it (the same study, the same day)."""

    singles: list[CalPoint] = field(default_factory=list)
    multis: list[MultiPoint] = field(default_factory=list)
    prefer: str = ""

    def _own(self, points: list) -> list:
        mine = [p for p in points if self.prefer and p.source.startswith(self.prefer)]
        return unwarned(mine or points)

    def extend(self, other: Pool) -> None:
        self.singles += other.singles
        self.multis += other.multis

    def candidates(self, scenario: Scenario, spatial: bool = False) -> list[CalPoint]:
        """One-rank points of the scenario's family; spatial models prefer spatial records.
        A one-rank fsdp run is not the bare step (FSDP's per-unit copies and hooks run even
        on one rank): it calibrates FSDP's host cost (fsdp_single), and the compute only
        when the family has no other one-rank point. Nor is a one-rank `tensor --engine
        torch` run (DTensor over a one-device mesh: every sharded op still dispatches through
        DTensor and each all-reduce is a collective over a group of one): it calibrates
        DTensor's host cost (dtensor_single), the same way. The hand-written split's one-rank
        run (`tensor`, engine scalelab) stays: it is the mlp's whole step plus one all-reduce
        of the (B, classes) logits over one rank, and it is what calibrates a tensor rank's
        compute at its shard's width (model_parallel.shard_config)."""
        mine = [p for p in self.singles if p.family == scenario.family()]
        bare = [p for p in mine if p.bare]
        fam = self._own(bare or [p for p in mine if _same_units(p, scenario)])
        if spatial:
            same = [p for p in fam if p.split == "spatial"]
            return same or fam
        return [p for p in fam if p.split != "spatial"] or fam

    def multi(self, scenario: Scenario) -> list[MultiPoint]:
        """Multi-rank points of the scenario's family and strategy model (a subclass strategy's
        runs and its parent's calibrate the one model they share)."""
        fam, model = scenario.family(), modelled_by(scenario.cfg.strategy)
        same = [m for m in self.multis if modelled_by(m.scenario.cfg.strategy) == model]
        return self._own([m for m in same if m.scenario.family() == fam])

    def host_anchor(self, scenario: Scenario) -> MultiPoint | None:
        """The measured run that calibrates the scenario's host-side cost (see
        host_calibrated), or None when the pool holds none."""
        runs = [m for m in self.multi(scenario) if host_calibrated(m.scenario.cfg)]
        return min(runs, key=lambda m: (anchor_key(m.scenario.cfg), m.source), default=None)

    def pipelining_host(self, scenario: Scenario) -> CalPoint | MultiPoint | None:
        """The torch-engine pipeline run that calibrates the runtime's forward host work
        (predict/models/pipeline.py: host_forward): a one-rank run of the family (its one
        stage holds every layer) nearest the scenario's micro-batch, else the host anchor."""
        fam = scenario.family()
        ones = [p for p in self.singles if p.family == fam and p.forward_host_s is not None]
        ones = self._own([p for p in ones if p.cfg is not None and pipelining_run(p.cfg)])
        if ones:
            micro = max(scenario.cfg.batch / max(1, scenario.cfg.microbatches), 1e-9)
            key = lambda p: (abs(math.log(p.batch / p.cfg.microbatches / micro)), p.source)  # noqa: E731
            return min(ones, key=key)
        m = self.host_anchor(scenario)
        return m if m is not None and m.forward_host_s is not None else None

    def fsdp_single(self, scenario: Scenario) -> CalPoint | None:
        """The one-rank fsdp run of the scenario's family nearest its per-rank batch (FSDP's
        host cost per step: that run's step less the bare step at its batch), or None. Only a
        run of the scenario's unit size: FSDP's host work is per unit (one H200, GPT-2 small:
        13 units cost 13 to 20 ms a step more than 2), so another size's run would calibrate
        the wrong cost."""
        runs = [p for p in self.singles if p.family == scenario.family()]
        runs = [p for p in runs if STRATEGIES.get(p.strategy).shards_parameters]
        runs = self._own([p for p in runs if _same_units(p, scenario)])
        target = max(scenario.rank_batch, 1e-9)
        near = min(runs, key=lambda p: (abs(math.log(p.batch / target)), p.source), default=None)
        return None if near is None else typical(runs, near)

    def fsdp_anchor(self, scenario: Scenario) -> MultiPoint | None:
        """The measured multi-rank fsdp run (fsdp_calibrated) of the scenario's family that
        ran FSDP's units as the scenario would (unit size and replicas; the same resharding
        where the pool has one, else another, whose host cost fsdp.py scales by the
        collectives each issues): the rank count nearest the scenario's, then the smallest
        batch; None when the pool holds none."""
        fam, cfg = scenario.family(), scenario.cfg
        runs = [m for m in self.multis if m.scenario.family() == fam]
        runs = [m for m in runs if fsdp_calibrated(m.scenario.cfg)
                and _same_sharding(m.scenario.cfg, cfg)]  # fmt: skip
        raf = cfg.reshard_after_forward
        same = [m for m in runs if m.scenario.cfg.reshard_after_forward == raf]
        runs = self._own(same or runs)
        key = lambda m: (abs(math.log(m.scenario.ranks / max(1, scenario.ranks))),  # noqa: E731
                         m.scenario.cfg.batch, m.source)  # fmt: skip
        return min(runs, key=key, default=None)

    def split_anchor(self, scenario: Scenario) -> MultiPoint | None:
        """The measured multi-GPU batch-split run (split_calibrated) of the scenario's family
        (any strategy that splits the batch: mpi-gpu's and nccl's ranks compute alike) whose
        rank count is nearest the scenario's; None when the pool holds none."""
        fam = scenario.family()
        runs = [m for m in self.multis if m.compute_s is not None and m.scenario.family() == fam]
        runs = self._own([m for m in runs if split_calibrated(m.scenario.cfg)])
        key = lambda m: (abs(math.log(m.scenario.ranks / max(1, scenario.ranks))), m.source)  # noqa: E731
        return min(runs, key=key, default=None)

    def dtensor_single(self, scenario: Scenario) -> CalPoint | None:
        """The one-rank DTensor run (dtensor_run) of the scenario's family nearest its batch
        (one replica's: tensor ranks all compute the whole batch), or None."""
        runs = [p for p in self.singles if p.family == scenario.family()]
        runs = self._own([p for p in runs if p.cfg is not None and _planned_single(p.cfg)])
        target = max(scenario.cfg.batch, 1)
        return min(runs, key=lambda p: (abs(math.log(p.batch / target)), p.source), default=None)

    def dtensor_anchor(self, scenario: Scenario) -> MultiPoint | None:
        """The measured DTensor run of the scenario's family (dtensor_calibrated) with the
        fewest ranks, then the smallest batch; None when the pool holds none."""
        runs = [m for m in self.multi(scenario) if dtensor_calibrated(m.scenario.cfg)]
        key = lambda m: (m.scenario.ranks, m.scenario.cfg.batch, m.source)  # noqa: E731
        return min(runs, key=key, default=None)


# What a one-rank run executes beyond its family and batch: two runs that agree on these are
# repeats of one configuration (they differ in iterations, warm-up, seed, bookkeeping), whose
# times typical() pools; a one-rank pipeline of 1 and one of 8 micro-batches are not.
RUN_SHAPE = ("split", "microbatches", "schedule", "stages", "virtual_stages", "engine",
             "balance", "cut", "placement", "fsdp_unit_mb", "reshard_after_forward",
             "dp_replicate", "dp", "tp", "tp_plan", "bucket_mb", "overlap", "chunks",
             "nonblocking", "grad_compress")  # fmt: skip


def _same_run(a: CalPoint, b: CalPoint) -> bool:
    if a.cfg is None or b.cfg is None:
        return a.cfg is None and b.cfg is None and a.split == b.split
    return all(getattr(a.cfg, k, None) == getattr(b.cfg, k, None) for k in RUN_SHAPE)


def _same_units(point: CalPoint, scenario: Scenario) -> bool:
    """Whether a one-rank point ran FSDP's units as the scenario would (--fsdp-unit-mb)."""
    return point.cfg is not None and point.cfg.fsdp_unit_mb == scenario.cfg.fsdp_unit_mb


def _same_sharding(a: RunConfig, b: RunConfig) -> bool:
    return (a.fsdp_unit_mb, max(1, a.dp_replicate)) == (b.fsdp_unit_mb, max(1, b.dp_replicate))


def fsdp_calibrated(cfg: RunConfig) -> bool:
    """Whether cfg is a measured multi-rank run of a strategy that shards the parameters
    (fsdp): it calibrates its family's FSDP host cost under a real process group
    (predict/models/fsdp.py)."""
    return cfg.ranks >= 2 and STRATEGIES.get(cfg.strategy).shards_parameters


def split_calibrated(cfg: RunConfig) -> bool:
    """Whether cfg is a measured run of GPU ranks that split the batch (no --overlap, whose
    compute runs chunk by chunk): its compute phase against the one-GPU law at its share
    says how much slower a rank computes beside the others (predict/models/split.py)."""
    strategy = STRATEGIES.get(cfg.strategy)
    return (cfg.ranks >= 2 and cfg.device == "cuda" and strategy.takes_split
            and cfg.split == "batch" and not cfg.overlap)  # fmt: skip


def dtensor_run(cfg: RunConfig) -> bool:
    """Whether cfg runs DTensor's tensor parallelism (`tensor --engine torch`), on any ranks."""
    return STRATEGIES.get(cfg.strategy).traced_by_torch(cfg)


def pipelining_run(cfg: RunConfig) -> bool:
    """Whether cfg runs torch.distributed.pipelining (`pipeline --engine torch`), any ranks."""
    return STRATEGIES.get(cfg.strategy).pipelined_by_torch(cfg)


def dtensor_calibrated(cfg: RunConfig) -> bool:
    """Whether cfg is a measured DTensor run that calibrates its family's host cost per
    all-reduce of a model of repeated blocks (predict/models/model_parallel.py): tensor
    parallelism over torch on several ranks, one replica, the plan scalelab derives."""
    return dtensor_run(cfg) and cfg.ranks >= 2 and dtensor_planned(cfg)


def _planned_single(cfg: RunConfig) -> bool:
    return dtensor_run(cfg) and cfg.ranks == 1 and dtensor_planned(cfg)


def dtensor_planned(cfg: RunConfig) -> bool:
    """One replica (no --dp) sharded by the plan scalelab derives (no --tp-plan of the
    user's, whose sharding the model does not know)."""
    return max(1, cfg.dp) == 1 and cfg.tp_plan is None


def host_calibrated(cfg: RunConfig) -> bool:
    """Whether cfg pays a host-side cost no ceiling measures, calibrated on one measured
    multi-rank run of its family and strategy: DDP's per step (predict/models/ddp.py), torch
    pipelining's forward host work, where no one-rank torch-engine run gives it
    (predict/models/pipeline.py: host_forward)."""
    if cfg.ranks < 2:
        return False
    return STRATEGIES.get(cfg.strategy).ddp_buckets or (
        STRATEGIES.get(cfg.strategy).pipelined_by_torch(cfg) and max(1, cfg.dp) == 1
    )


def anchor_key(cfg: RunConfig) -> tuple:
    """Which of a family's host-calibrated runs is its anchor (the least of this key): the
    fewest ranks; for a pipeline gpipe (one stage per rank) with the most micro-batches (the
    most transfers to fit the cost on); then the smallest batch."""
    return cfg.ranks, cfg.schedule != "gpipe", cfg.virtual_stages, -cfg.microbatches, cfg.batch


def anchor(points: list[CalPoint], scenario: Scenario) -> CalPoint:
    """The one-rank point of the same configuration: same series, else the batch one rank
    ran in the scaling series (strong: the global batch; weak: the per-rank batch), else the
    nearest batch (the median of the runs at that batch: typical)."""
    if scenario.series is not None:
        named = [p for p in points if p.series == scenario.series]
        if named:
            return named[0]
    target = scenario.global_batch if scenario.strong else scenario.rank_batch
    return typical(points, min(points, key=lambda p: (abs(math.log(p.batch / target)), p.source)))


def typical(points: list[CalPoint], near: CalPoint) -> CalPoint:
    """The anchor `near` with the median compute and host time of every one-rank run at its
    batch (of the same strategy and split). A launch- or host-bound step on one GPU varies
    from run to run and host to host far more than its device time does: GPT-2 small's
    one-GPU fsdp step read 29.3, 35.7 and 37.3 ms in three runs of one call on one host and
    29-55 ms over nine hosts and commits, so the first run by name is a draw from that spread
    (it put a held-out one-rank run 72% high) where the median is its centre. The point keeps
    the middle run's identity (its layer times, its configuration) and names every run it
    took the median of (`pooled`), each a calibration point of the prediction."""
    same = [p for p in points if p.batch == near.batch and p.strategy == near.strategy
            and p.series is None and _same_run(p, near)]  # fmt: skip
    if len(same) < 2 or near.series is not None:
        return near
    same.sort(key=lambda p: (p.compute_s, p.source))
    mid = same[(len(same) - 1) // 2]
    return dataclasses.replace(
        mid,
        compute_s=float(np.median([p.compute_s for p in same])),
        overhead_s=float(np.median([p.overhead_s for p in same])),
        pooled=tuple(sorted(p.source for p in same)),
    )


def slope(points: Iterable[CalPoint], a: CalPoint) -> float:
    """Seconds per item: least squares over the family's batches, within [0, t_a / b_a]."""
    by_batch: dict[int, list[float]] = {}
    for p in points:
        by_batch.setdefault(p.batch, []).append(p.compute_s)
    proportional = a.compute_s / a.batch
    if len(by_batch) < 2:
        return proportional
    b = np.array(list(by_batch), dtype=np.float64)
    t = np.array([float(np.median(v)) for v in by_batch.values()])
    c = float(np.polyfit(b, t, 1)[0])
    return min(max(c, 0.0), proportional)


@dataclass(frozen=True)
class BatchLaw:
    """t(b) = t_a + c (b - b_a), never below c b (a negative intercept is not physical)."""

    point: CalPoint
    per_item_s: float

    def seconds(self, batch: float) -> float:
        a = self.point
        return max(a.compute_s + self.per_item_s * (batch - a.batch), self.per_item_s * batch)

    def describe(self) -> str:
        a = self.point
        fixed = a.compute_s - self.per_item_s * a.batch
        return (
            f"compute calibrated on {a.source} ({a.strategy}, 1 rank, batch {a.batch}: "
            f"{a.compute_s * 1e3:.4g} ms; {self.per_item_s * 1e6:.4g} us/item + "
            f"{fixed * 1e3:.3g} ms/iteration)"
        )


def near_miss(pool: Pool, scenario: Scenario) -> str | None:
    """Why the closest one-rank measurement of the same workload does not calibrate this
    scenario: the settings that differ (None when the pool has none of the workload)."""
    from scalelab.predict.scenario import MATCH_KEYS

    names = [*MATCH_KEYS, "dtype", "amp", "threads"]
    want = scenario.family()
    same = [p for p in pool.singles if p.family[0] == want[0]]
    if not same:
        return None
    diff = min(([n for n, a, b in zip(names, p.family, want) if a != b] for p in same), key=len)
    best = next(p for p in same if [n for n, a, b in zip(names, p.family, want) if a != b] == diff)
    shown = ", ".join(
        f"{n} {a!r} there vs {b!r} here" for n, a, b in zip(names, best.family, want) if a != b
    )
    return f"{best.source} differs in {shown}"


def batch_law(pool: Pool, scenario: Scenario, spatial: bool = False) -> BatchLaw | None:
    points = pool.candidates(scenario, spatial)
    if not points:
        return None
    a = anchor(points, scenario)
    target = scenario.global_batch if scenario.strong else scenario.rank_batch
    named = scenario.series is not None and a.series == scenario.series
    if pool.prefer and a.batch != target and not named:
        # The study's own runs did not run the anchor batch but another file of this machine
        # did: that measurement calibrates it, not the study's runs carried there along the
        # fixed + per-item law, which a host-bound step does not follow far (a GPT's one-GPU
        # step at 32 put 32% high from its 4 and 16; resnet18-cifar's at 1024, 20% from 128).
        there = [p for p in dataclasses.replace(pool, prefer="").candidates(scenario, spatial)
                 if p.batch == target]  # fmt: skip
        if there:
            a = anchor(there, scenario)
            return BatchLaw(a, slope(points + there, a))
    return BatchLaw(a, slope(points, a))
