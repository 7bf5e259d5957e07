"""Measured points found in a results folder, recognised by content rather than file name.

Recognised: scalelab run records (one JSON object per line; the time of one iteration or
optimizer step), DDP scaling summaries (benchmarks/ddp_scaling.py: {"rows": [{config, gpus,
per_gpu, global, ours, plain}]}; `ours` is scalelab's ddp, `plain` a hand-written baseline
the model does not describe), the pipeline benchmark's summary record (one-GPU step times to
calibrate on) and ceilings files. Anything else is counted, with the reason, and passed over.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.layout.schedule import steady_step
from scalelab.predict.calibration import (
    CalPoint,
    MultiPoint,
    Pool,
    dtensor_calibrated,
    fsdp_calibrated,
    host_calibrated,
    split_calibrated,
)
from scalelab.predict.hosts import Host
from scalelab.predict.scenario import Scenario
from scalelab.record_schema import FINISHED
from scalelab.strategies import STRATEGIES

CEILINGS = "scalelab.ceilings/1"
RUN = "scalelab.run/1"
# What benchmarks/ddp_scaling.py runs (its summary rows do not repeat it).
DDP_SUMMARY = {"workload": "resnet18", "amp": "bf16", "channels_last": True}


@dataclass(frozen=True)
class Measured:
    scenario: Scenario
    seconds: float  # per iteration (inference) or optimizer step (training)
    source: str  # file:line or file[row]
    origin: Path  # the file, to pair it with the ceilings of its machine
    warnings: tuple[str, ...] = ()  # the record's run warnings (oversubscribed, busy host, ...)
    # what the measurement is, whichever file holds it: the record's id, or a summary row's
    # file name, row and time (the committed results copy records and summaries between
    # folders; one measurement is one point)
    key: tuple = ()


@dataclass
class Found:
    points: list[Measured] = field(default_factory=list)
    pools: dict[Path, Pool] = field(default_factory=dict)  # per file
    ceilings: dict[Path, dict[str, Any]] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)
    ddp_files: list[Path] = field(default_factory=list)  # DDP summaries read so far
    hosts: dict[Path, Host] = field(default_factory=dict)  # the machine each file ran on
    # each file as its points' sources name it: the file name, or where two files share a
    # name (every study folder's speed_records.jsonl) its path under the root
    labels: dict[Path, str] = field(default_factory=dict)

    def pool(self, origin: Path) -> Pool:
        return self.pools.setdefault(origin, Pool())

    def saw_host(self, origin: Path, host: Host) -> None:
        """The file's machine: the first of its entries that names one."""
        if host.known and origin not in self.hosts:
            self.hosts[origin] = host


def discover(root: Path) -> Found:
    files = sorted([*root.rglob("*.jsonl"), *root.rglob("*.json")]) if root.is_dir() else [root]
    files.sort(key=lambda f: ".partial." in f.name)  # a complete summary before its partial
    found = Found()
    names = Counter(f.name for f in files)
    for f in files:
        found.labels[f] = str(f.relative_to(root)) if names[f.name] > 1 else f.name
    for path in files:
        objects = _objects(path, found.labels[path])
        if objects is None:
            found.skipped[f"not JSON: {path.name}"] += 1
            continue
        for where, obj in objects:
            try:
                _classify(found, path, where, obj)
            except UsageError as exc:  # e.g. a workload this checkout does not know
                found.skipped[f"unreadable entries: {exc}"] += 1
    return found


def _objects(path: Path, label: str) -> list[tuple[str, Any]] | None:
    text = path.read_text(errors="replace")
    try:
        if path.suffix == ".jsonl":
            lines = [(n, ln) for n, ln in enumerate(text.splitlines(), 1) if ln.strip()]
            return [(f"{label}:{n}", json.loads(ln)) for n, ln in lines]
        return [(label, json.loads(text))]
    except json.JSONDecodeError:
        return None


def _classify(found: Found, path: Path, where: str, obj: Any) -> None:
    schema = obj.get("schema") if isinstance(obj, dict) else None
    if schema == CEILINGS:
        found.ceilings[path] = obj
    elif isinstance(obj, dict) and _is_ddp_summary(obj):
        _ddp_summary(found, path, obj)
    elif schema == RUN and obj.get("kind") == "pipeline_vgg_summary":
        _pipeline_summary(found, path, where, obj)
    elif schema == RUN:
        _run_record(found, path, where, obj)
    elif isinstance(schema, str) and schema.startswith("scalelab.bench/"):
        found.skipped["bench records (one GPU, fast path: no scaling)"] += 1
    else:
        found.skipped[f"in no known format: {path.name}"] += 1


# --- run records -----------------------------------------------------------------------------
def _run_record(found: Found, path: Path, where: str, rec: dict[str, Any]) -> None:
    from scalelab.analysis.frame import per_iteration, phase_scale, run_config
    from scalelab.predict.model_registry import modelled_as

    if rec.get("status", "ok") not in FINISHED or "wall_s" not in rec:
        found.skipped["failed runs"] += 1
        return
    from scalelab.record_schema import problem

    if problem(rec) is not None:  # the record reader's own check, as read_records makes it
        found.skipped["malformed run records"] += 1
        return
    found.saw_host(path, Host.of_record(rec))
    cfg = _model_found(computed_in(run_config(rec), rec), path)
    ranks = int(rec.get("ranks") or cfg.ranks)
    cores = (rec.get("env") or {}).get("cpu_count")
    if cfg.device == "cpu" and cores and ranks * (cfg.threads or 1) > cores:
        found.skipped["CPU runs with more threads than cores (time-sliced: not modelled)"] += 1
        return
    if (rec.get("config") or {}).get("trace"):  # torch.profiler recorded every op: the times
        # carry its overhead (a traced 2-GPU resnet18 step read 70 ms of "DDP host cost")
        found.skipped["profiled runs (--trace: the profiler's overhead is in their times)"] += 1
        return
    pipe = rec.get("pipeline") or {}
    hand = cfg.engine != "torch"  # torch's engine: every rank loads its own batch
    if pipe and hand and cfg.train and ranks > 1 and not pipe.get("host_prefetch"):
        # Before the root prefetched, it gathered each batch between steps, inside the period
        # (~7-8 ms of VGG-16's 256 images); no ceiling measures that gather (the one-core
        # copy bandwidth predicted 12.5 ms on one host and 25 ms on another).
        found.skipped["pipeline training runs before host prefetch (gather not modelled)"] += 1
        return
    steady, steps = rec.get("steady") or {}, rec.get("steps")
    if cfg.train and steps is not None and int(steps) < 3 and not steady.get("steps"):
        # one or two steps, no steady part: the first step's warm-up (cuDNN autotuning,
        # allocator growth, NCCL set-up) is most of the time (a 2-step deepstack pipeline
        # probe: 31 ms for what its steady step would take a fraction of)
        found.skipped["training runs of fewer than 3 steps (their warm-up is their time)"] += 1
        return
    balance = pipe.get("balance")  # the partition the run used
    scenario = Scenario(  # a record's ranks shared one host
        cfg,
        ranks,
        per_node=ranks,
        balance=tuple(balance) if balance else None,
    )
    seconds = _step_seconds(rec, per_iteration(rec)[1])
    warned = tuple(rec.get("warnings") or ())
    host = forward_host(rec) if cfg.engine == "torch" else None
    fwd = forward_part(rec, seconds)
    if ranks == 1:
        point = _cal_point(rec, scenario, seconds, phase_scale(rec), where)
        point = dataclasses.replace(point, warnings=warned, forward_host_s=host, forward_s=fwd)
        found.pool(path).singles.append(point)
    elif host_calibrated(cfg) or dtensor_calibrated(cfg) or fsdp_calibrated(cfg):
        multi = MultiPoint(scenario, seconds, where, warned, host, forward_s=fwd)
        found.pool(path).multis.append(multi)
    elif split_calibrated(cfg) and "compute" in (rec.get("phases") or {}):
        computed = rec["phases"]["compute"] * phase_scale(rec)
        found.pool(path).multis.append(
            MultiPoint(scenario, seconds, where, warned, compute_s=computed)
        )
    if modelled_as(cfg.strategy) is None:
        found.skipped[f"{cfg.strategy} runs (no model of that strategy)"] += 1
        return
    key = ("record", rec["id"]) if rec.get("id") else ("at", path.name, where, seconds)
    found.points.append(Measured(scenario, seconds, where, path, warned, key))


def forward_part(rec: dict[str, Any], seconds: float) -> float | None:
    """A training record's forward seconds per step: its step times the forward phase's share
    of its compute phase (both totals over the same steps), or None without those phases."""
    phases = rec.get("phases") or {}
    fwd, whole = phases.get("compute/forward"), phases.get("compute")
    if rec.get("mode") != "train" or not fwd or not whole:
        return None
    return seconds * min(1.0, fwd / whole)


def forward_host(rec: dict[str, Any]) -> float | None:
    """A torch-engine pipeline record's forward actions, seconds per micro-batch summed
    over its stages (one replica): what one micro-batch's forward through every layer costs
    under the runtime where the host bounds it (CUDA events time an action from its first
    launch to its last kernel's end)."""
    pipe = rec.get("pipeline") or {}
    micro = int(pipe.get("microbatches") or 0)
    rows = [r for r in pipe.get("stage") or [] if not r.get("dp_rank")]
    forwards = [v for r in rows for k, v in (r.get("action_s") or {}).items() if k.endswith(":F")]
    if not micro or not forwards:
        return None
    return sum(forwards) / micro


def _step_seconds(rec: dict[str, Any], default: float) -> float:
    """A pipeline run's step: its period from every stage's step walls (records written
    before the period took the slowest stage carry the root's shorter median). Another
    training run's step: its steady part (train/headline.py), without the warm-up that a
    short run's whole wall is mostly made of on a GPU (cuDNN autotuning, a CUDA graph's
    capture, torch.compile: 100 steps of resnet18-cifar --compile on an H100, 1.1k img/s
    overall). torch's pipeline engine: the steady step too (its stages' step walls time the
    schedule's step alone: on 4 CPU cores 19.7 ms of a 23.6 ms step)."""
    pipe = rec.get("pipeline") or {}
    step = steady_step(pipe.get("stage") or []) if pipe.get("engine") != "torch" else None
    if step:
        return step
    steady = rec.get("steady") or {}
    if rec.get("mode") == "train" and steady.get("basis") == "steps" and steady.get("steps"):
        return float(steady["seconds"]) / int(steady["steps"])
    return default


def computed_in(cfg: RunConfig, rec: dict[str, Any]) -> RunConfig:
    """The config with the dtype and threads the run computed with. The dtype: `serial`
    computes in float64 whatever --dtype asked (its record says precision fp64 under config
    dtype fp32), and its time must not calibrate an fp32 rank's compute (AlexNet's batch of
    32: 2.6 s predicted from serial's float64 step, 1.5 s measured). Under --amp the record's
    precision is the autocast dtype, which the family already carries as `amp`."""
    ran = rec.get("precision")
    if not (cfg.amp or not ran or ran == cfg.dtype):
        cfg = dataclasses.replace(cfg, dtype=ran)
    return _threads_used(cfg, rec)


def _threads_used(cfg: RunConfig, rec: dict[str, Any]) -> RunConfig:
    """The config with the torch threads per rank the run used where it did not give
    --threads: the record's `threads` says what was chosen (one per rank on a 32-core host,
    where the config's None read as 16 per rank predicted 2 MPI ranks 12x too fast)."""
    used = rec.get("threads")
    used = used.get("threads") if isinstance(used, dict) else used
    if cfg.threads is not None or not isinstance(used, int) or isinstance(used, bool):
        return cfg
    return dataclasses.replace(cfg, threads=used)


def _cal_point(rec: dict, s: Scenario, seconds: float, scale: float, where: str) -> CalPoint:
    """A one-rank record as a calibration point: a training step counts whole; an inference
    iteration counts its compute phase, and the host time outside every phase separately."""
    if s.cfg.train:
        batch, micro = round(s.rank_batch), _micro_batches(s)
        return CalPoint(s.family(), s.cfg.strategy, s.cfg.split, batch // micro, seconds / micro,
                        0.0, where, cfg=s.cfg)  # fmt: skip
    phases = {k: v * scale for k, v in (rec.get("phases") or {}).items()}
    compute = phases.get("compute", seconds)
    overhead = max(0.0, seconds - sum(phases.values()))
    split = s.cfg.split if STRATEGIES.get(s.cfg.strategy).takes_split else None
    layers = _layer_times(rec, s) if split == "spatial" else _per_layer(rec)
    return CalPoint(
        s.family(), s.cfg.strategy, split, s.cfg.batch, compute, overhead, where, None, layers
    )


def _micro_batches(s: Scenario) -> int:
    """The forward-backward passes a one-rank training step makes: a one-stage pipeline of the
    hand-written engine runs its batch as M micro-batches of B/M items, so its step is M
    steps at B/M, not one at B (VGG-16's 256 images as 8 of 32 took 92.7 ms where one pass of
    256 took 70.9: read at 256, one put the other 30% high); 1 for every other run, and where M
    does not divide the batch. (A torch-pipelining run is not a bare step: Pool.candidates.)"""
    strategy = STRATEGIES.get(s.cfg.strategy)
    micro = max(1, s.cfg.microbatches)
    if not strategy.pipelined or strategy.pipelined_by_torch(s.cfg) or round(s.rank_batch) % micro:
        return 1
    return micro


def _layer_times(rec: dict, s: Scenario) -> tuple | None:
    from scalelab.predict.models.spatial import timeline_layers, trunk_of

    return _per_layer(rec) or timeline_layers(rec, trunk_of(s))


def _per_layer(rec: dict) -> tuple | None:
    from scalelab.analysis.frame import layer_rows

    rows = layer_rows(rec)
    return tuple((r["name"], float(r["seconds"])) for r in rows if r.get("seconds")) or None


# --- summaries -------------------------------------------------------------------------------
def _is_ddp_summary(obj: dict) -> bool:
    rows = obj.get("rows")
    need = {"config", "gpus", "per_gpu", "global", "ours"}
    return isinstance(rows, list) and bool(rows) and all(need <= set(r) for r in rows)


def _ddp_summary(found: Found, path: Path, obj: dict) -> None:
    if obj.get("partial") and any(p.parent == path.parent for p in found.ddp_files):
        found.skipped[f"partial summary beside a complete one: {path.name}"] += 1
        return
    found.ddp_files.append(path)
    found.saw_host(path, Host.of_summary(obj))
    for i, row in enumerate(obj["rows"]):
        gpus, name = int(row["gpus"]), str(row["config"])
        weak = None if str(row["config"]).startswith("strong") else int(row["per_gpu"])
        s = Scenario(_summary_config(obj, row), gpus, per_node=gpus, series=name, weak_batch=weak)
        seconds, where = row["global"] / row["ours"], f"{found.labels[path]}[{i}] {name} x{gpus}"
        if gpus == 1:
            point = CalPoint(
                s.family(), "ddp", None, int(row["per_gpu"]), seconds, 0.0, where, name
            )
            found.pool(path).singles.append(point)
        else:
            found.pool(path).multis.append(MultiPoint(s, seconds, where))
        found.points.append(Measured(s, seconds, where, path, key=("at", path.name, i, seconds)))
        if row.get("plain") is not None:
            found.skipped["plain-DDP baseline rows (not a scalelab strategy)"] += 1


def _summary_config(obj: dict, row: dict) -> RunConfig:
    """The `scalelab run` a summary row measured. Rows that name their workload come from
    the script that runs ours with --fast (CUDA-graph step); older summaries ran eager."""
    fast = bool(row.get("fast", obj.get("fast", "workload" in row)))
    return RunConfig(
        workload=row.get("workload", obj.get("workload", DDP_SUMMARY["workload"])),
        strategy="ddp", device="cuda", train=True, fast=fast,
        amp=obj.get("amp", DDP_SUMMARY["amp"]), batch=int(row["global"]), ranks=int(row["gpus"]),
        channels_last=obj.get("channels_last", DDP_SUMMARY["channels_last"]),
    )  # fmt: skip


def _pipeline_summary(found: Found, path: Path, where: str, rec: dict) -> None:
    """One-GPU training steps of the pipeline benchmark's model: calibration only."""
    found.saw_host(path, Host.of_summary(rec))
    for batch, img_s in (rec.get("plain_img_s") or {}).items():
        cfg = RunConfig(
            workload="vgg16", strategy="local", device="cuda", train=True, dtype="bf16",
            channels_last=True, batch=int(batch),
        )  # fmt: skip
        s = Scenario(cfg, 1, 1)
        seconds = int(batch) / float(img_s)
        point = CalPoint(s.family(), "local", None, int(batch), seconds, 0.0, f"{where} b{batch}")
        found.pool(path).singles.append(point)


def _model_found(cfg: RunConfig, records: Path) -> RunConfig:
    """A record's `--model FILE.py:FACTORY` with FILE relative to where it ran (a checkout's
    root: `examples/models/gpt.py`) read from wherever validate runs: where FILE is not
    found from here, the first folder above the records file that holds it."""
    file, sep, factory = (cfg.model or "").rpartition(":")
    if not sep or not file.endswith(".py") or Path(file).is_absolute() or Path(file).exists():
        return cfg
    for folder in records.resolve().parents:
        if (folder / file).is_file():
            return dataclasses.replace(cfg, model=f"{folder / file}:{factory}")
    return cfg
