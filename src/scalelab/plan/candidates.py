"""Candidate configurations: one source per strategy, registered in SOURCES by the strategy's
name. A source turns a PlanSpec into the RunConfigs that strategy could run it with (ranks,
threads, split, per-rank batch, precision, and its own knobs); sources that do not apply
(inference-only splits for a training plan, GPU knobs on CPUs) yield nothing. New ways to run
plug in as new sources: `@SOURCES.register("name", "what it varies")` over a function
PlanSpec -> Iterator[RunConfig]; a strategy that subclasses another needs none (its
parent's candidates, renamed; a plan without `--strategies` takes them too). A user's
`--model` needs no source of its own: its base config carries --model/--model-arg/
--input-shape into every candidate, and a strategy its model cannot run under is left out
with that strategy's own refusal (applies.py).

    mpi / nccl       inference splits (batch, spatial, broadcast) x ranks x threads
    mpi-dp, ddp      data-parallel training
    fsdp             sharded data parallel (FSDP2): reshard after forward on/off, and HSDP
                     (--dp-replicate 2) from 4 ranks
    pipeline         scalelab's engine: stages x micro-batches x gpipe/1f1b
    pipeline-torch   torch.distributed.pipelining (training): --dp D x --stages S,
                     micro-batches, gpipe/1f1b and, 2 stages per rank, interleaved-1f1b,
                     zero-bubble and zbv; inference too (gpipe, interleaved-1f1b)
                     for a model of repeated blocks, which only torch's tracer cuts
    tensor           the mlp's hidden units over MPI (training)
    tensor-torch     DTensor: --dp D x --tp N, inference and training

The planner ranks whatever the sources yield; filtering (memory, topology, what the strategy
model calls not runnable) happens after, in rank.py, so every dropped candidate says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.plan.space import PlanSpec
from scalelab.registry import Registry
from scalelab.strategies import STRATEGIES, lineage
from scalelab.workloads import WORKLOADS

Source = Callable[[PlanSpec], Iterator[RunConfig]]
SOURCES: Registry[Source] = Registry("candidate source")
SPLITS = ("batch", "spatial", "broadcast")
HALF = ("bf16", "fp16")


def candidates(spec: PlanSpec) -> list[RunConfig]:
    """Every source's candidates, duplicates (equal configs) dropped, in source order; with no
    --strategies, also every registered strategy that inherits its parent's source."""
    names = spec.strategies or (*SOURCES.names(), *_inheriting())
    seen, out = set(), []
    for name in names:
        for cfg in _source_of(name)(spec):
            key = repr(cfg)
            if key not in seen:
                seen.add(key)
                out.append(cfg)
    return out


def _inheriting() -> tuple[str, ...]:
    """Registered strategies with no source of their own whose ancestor has one (a plugin
    that subclasses a built-in strategy), in registration order."""
    return tuple(n for n in STRATEGIES.names() if n not in SOURCES and _ancestor(n) is not None)


def _ancestor(name: str) -> str | None:
    """The nearest strategy in name's lineage (itself first) that has a source."""
    return next((n for n in lineage(name) if n in SOURCES), None)


def _source_of(name: str) -> Source:
    """The strategy's own source, else its nearest ancestor's with the strategy renamed: a
    subclass strategy (registered outside plan/) gets its parent's candidates under its name."""
    if name in SOURCES or name not in STRATEGIES:
        return SOURCES.get(name)
    parent = _ancestor(name)
    if parent is None:
        return SOURCES.get(name)  # the unknown-source error, listing the known ones

    def renamed(spec: PlanSpec) -> Iterator[RunConfig]:
        for cfg in SOURCES.get(parent)(spec):
            yield dataclasses.replace(cfg, strategy=name) if cfg.strategy == parent else cfg

    return renamed


def plain(spec: PlanSpec) -> RunConfig:
    """What a user would try first: every rank, one thread each, the first precision; the
    batch split for inference, ddp for training (the largest batch the plan allows)."""
    strategy = "ddp" if spec.base.train else ("nccl" if spec.gpu else "mpi")
    return _config(spec, strategy, spec.ranks_max, 1, spec.precisions[0], split="batch")


def _config(spec: PlanSpec, strategy: str, ranks: int, threads: int | None, precision: str,
            **knobs) -> RunConfig:  # fmt: skip
    """The candidate's RunConfig: --batch all ranks together (every strategy) and the
    precision where the strategy takes it (ddp: autocast through --amp)."""
    batch = spec.batch_of(ranks)
    fields: dict = {"strategy": strategy, "ranks": ranks, "batch": batch, **knobs}
    if not spec.gpu:
        fields["threads"] = threads
    if STRATEGIES.get(strategy).ddp_buckets and precision in HALF:
        return spec.config(**fields, amp=precision, dtype="fp32")
    return spec.config(**fields, dtype=precision)


def _each(spec: PlanSpec, least: int = 1) -> Iterator[tuple[int, int | None, str]]:
    for ranks, threads in spec.layouts():
        if ranks >= least:
            for p in spec.precisions:
                yield ranks, threads, p


@SOURCES.register("mpi", "CPU inference: batch/spatial/broadcast splits x ranks x threads")
def mpi_splits(spec: PlanSpec) -> Iterator[RunConfig]:
    if spec.gpu or spec.base.train:
        return
    for ranks, threads, p in _each(spec):
        for split in SPLITS if ranks > 1 else ("batch",):  # one rank: the splits coincide
            yield _config(spec, "mpi", ranks, threads, p, split=split)


@SOURCES.register("nccl", "GPU inference: batch/spatial/broadcast splits over NCCL x ranks")
def nccl_splits(spec: PlanSpec) -> Iterator[RunConfig]:
    if not spec.gpu or spec.base.train:
        return
    for ranks, threads, p in _each(spec):
        for split in SPLITS if ranks > 1 else ("batch",):
            yield _config(spec, "nccl", ranks, threads, p, split=split)


@SOURCES.register("mpi-dp", "training: data parallel over MPI, flat or per-layer all-reduce")
def mpi_dp(spec: PlanSpec) -> Iterator[RunConfig]:
    if not spec.base.train:
        return
    for ranks, threads, p in _each(spec):
        for nonblocking in (False, True) if ranks > 1 else (False,):
            yield _config(spec, "mpi-dp", ranks, threads, p, nonblocking=nonblocking)


@SOURCES.register("ddp", "training: DDP (gloo on CPU); GPU: --fast/--compile, buckets, compression")
def ddp(spec: PlanSpec) -> Iterator[RunConfig]:
    if not spec.base.train:
        return
    # one GPU: ddp --ranks 1 is where --fast and --compile run (mpi-dp takes neither); one
    # CPU rank: mpi-dp's candidate is the same step
    for ranks, threads, p in _each(spec, least=1 if spec.gpu else 2):
        for knobs in _ddp_knobs(spec, ranks):
            yield _config(spec, "ddp", ranks, threads, p, **knobs)


def _ddp_knobs(spec: PlanSpec, ranks: int) -> list[dict]:
    """GPU only: the CUDA-graph step or torch.compile; over several ranks two bucket sizes
    and bf16 gradients too."""
    if not spec.gpu:
        return [{}]
    speed = [{}, {"fast": True}, {"compile": True}]
    comm = [{}, {"bucket_mb": 100.0}, {"grad_compress": "bf16"}] if ranks > 1 else [{}]
    return [{**a, **b} for a in speed for b in comm]


@SOURCES.register("fsdp", "training: FSDP2 (reshard after forward on/off); HSDP (2 replicas)")
def fsdp(spec: PlanSpec) -> Iterator[RunConfig]:
    if not spec.base.train:
        return
    for ranks, threads, p in _each(spec, least=2):
        replicas = (1, 2) if ranks >= 4 and ranks % 2 == 0 else (1,)
        for r in replicas:
            for reshard in ("on", "off"):
                yield _config(spec, "fsdp", ranks, threads, p, dp_replicate=r,
                              reshard_after_forward=reshard)  # fmt: skip


@SOURCES.register("pipeline", "layers in stages (one per rank) x micro-batches x schedule")
def pipeline(spec: PlanSpec) -> Iterator[RunConfig]:
    schedules = ("gpipe", "1f1b") if spec.base.train else ("gpipe",)
    for ranks, threads, p in _each(spec, least=2):
        batch = spec.batch_of(ranks)
        for m in sorted({ranks, 2 * ranks, 4 * ranks}):
            if m > batch or batch % m:
                continue
            for schedule in schedules:
                knobs = {"stages": ranks, "microbatches": m, "schedule": schedule}
                if spec.gpu:
                    knobs["compile"] = True  # each stage compiled: the pipeline's fast path
                yield _config(spec, "pipeline", ranks, threads, p, **knobs)


# torch's schedules with the stages per rank each takes: interleaved and zero-bubble 2 in a
# loop, zbv 2 in a V (its --virtual-stages is implied: 1 on the command line). Left out:
# looped-bfs (GPipe's bubble over more sends) and dualpipev (its overlapped forward/backward
# pairs run one after the other on a CPU: zbv's order with more bookkeeping).
TORCH_SCHEDULES = (
    ("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2), ("zbv", 1)
)  # fmt: skip


# A forward-only pass: the schedules whose eval() runs forwards alone
# (layout/torch_schedule.NO_EVAL runs backward too).
EVAL_SCHEDULES = (("gpipe", 1), ("interleaved-1f1b", 2))  # 1f1b: gpipe's order in eval


def _blocks(base: RunConfig) -> bool:
    """A user's model seen through its repeated blocks: the hand engine's pipeline cannot cut
    it, torch's tracer can (also for inference)."""
    if not hasattr(WORKLOADS.get(base.workload), "blocks"):  # a shipped workload
        return False
    try:
        return getattr(WORKLOADS.get(base.workload)(base), "blocks", None) is not None
    except UsageError:
        return False  # a model that does not build: every candidate says why (applies.py)


def _meshes(ranks: int) -> list[tuple[int, int]]:
    """(dp, inner) with dp x inner = ranks and an inner group of at least 2 ranks."""
    return [(ranks // k, k) for k in range(2, ranks + 1) if ranks % k == 0]


@SOURCES.register(
    "pipeline-torch",
    "training: torch.distributed.pipelining, --dp x --stages, gpipe/1f1b/interleaved-1f1b",
)
def pipeline_torch(spec: PlanSpec) -> Iterator[RunConfig]:
    schedules = TORCH_SCHEDULES if spec.base.train else EVAL_SCHEDULES
    if not spec.base.train and not _blocks(spec.base):
        return
    for ranks, threads, p in _each(spec, least=2):
        batch = spec.batch_of(ranks)
        for dp, stages in _meshes(ranks):
            for m in sorted({stages, 2 * stages, 4 * stages}):
                if batch % (dp * m):  # torch's stages fix the micro-batch shape
                    continue
                for schedule, v in schedules:
                    knobs = {"engine": "torch", "stages": stages, "dp": dp, "microbatches": m,
                             "schedule": schedule, "virtual_stages": v}  # fmt: skip
                    yield _config(spec, "pipeline", ranks, threads, p, **knobs)


@SOURCES.register("tensor-torch", "DTensor tensor parallelism: --dp x --tp over Linear pairs")
def tensor_torch(spec: PlanSpec) -> Iterator[RunConfig]:
    for ranks, threads, p in _each(spec, least=2):
        for dp, tp in _meshes(ranks):
            yield _config(spec, "tensor", ranks, threads, p, engine="torch", tp=tp, dp=dp)


@SOURCES.register("tensor", "mlp training: hidden units split over MPI ranks")
def tensor(spec: PlanSpec) -> Iterator[RunConfig]:
    if not spec.base.train or spec.base.workload != "mlp" or spec.gpu:
        return
    for ranks, threads, p in _each(spec, least=2):
        yield _config(spec, "tensor", ranks, threads, p)
