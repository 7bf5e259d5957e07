"""What is predicted (a Scenario: a run config at N ranks) and what comes back (a Prediction:
seconds per iteration on the critical path, phase by phase)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field

from scalelab.config import RunConfig
from scalelab.config_sections import SHAPES, section_of
from scalelab.workloads import WORKLOADS, Workload

# Config fields that must agree between a measurement and a scenario it calibrates (the rest
# are bookkeeping or the strategy's own communication choices).
MATCH_KEYS = (
    "workload",
    "device",
    "train",
    "image_size",
    "num_classes",
    "hidden",
    "convs",
    "fcs",
    "channels_last",
    "compile",
    "fast",
    "swap_relu_pool",
    # a user's model (--model): which module, its factory's arguments, one item's shape
    "model",
    "model_arg",
    "input_shape",
    "input_dtype",
    "vocab",
)


@dataclass(frozen=True)
class Scenario:
    """cfg at `ranks` ranks with `per_node` ranks on each node (GPUs per node, or CPU ranks
    per node). `series`: a named configuration (a summary's "weak-512") to calibrate
    against, when the measurement has one."""

    cfg: RunConfig
    ranks: int
    per_node: int
    nics: int | None = None  # network ports per node; None: one per rank on GPUs, 1 on CPUs
    series: str | None = None
    balance: tuple[int, ...] | None = None  # pipeline: layers per stage the run used
    # Weak scaling: items per rank, the global batch growing with the ranks (a benchmark
    # summary's "weak-512" rows); None: strong, cfg.batch all ranks together at any count.
    weak_batch: int | None = None

    @property
    def precision(self) -> str:
        return self.cfg.amp or self.cfg.dtype

    @property
    def global_batch(self) -> int:
        if self.weak_batch is not None:
            return self.weak_batch * self.ranks
        return self.cfg.batch

    @property
    def strong(self) -> bool:
        """Strong scaling: the global batch stays fixed as ranks grow."""
        return self.weak_batch is None

    @property
    def rank_batch(self) -> float:
        """Mean items per rank per iteration."""
        return self.global_batch / self.ranks

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.per_node)

    @property
    def nics_per_node(self) -> int:
        if self.nics is not None:
            return self.nics
        return self.per_node if self.cfg.device == "cuda" else 1

    def family(self) -> tuple:
        """What a calibration measurement must share with this scenario (unset sizes read as
        the workload's native ones). The precision is two keys: weights stored in bf16
        (--dtype bf16) and fp32 weights under bf16 autocast (--amp bf16) are different steps
        (on an H100, resnet18-cifar mpi-dp --dtype bf16 ran 33% below ddp --amp bf16)."""
        cfg = self.cfg
        keys = [_native(cfg, k) for k in MATCH_KEYS]
        threads = cfg.threads if cfg.device == "cpu" else None
        return (*keys, cfg.dtype, cfg.amp, threads)

    def at(self, ranks: int) -> Scenario:
        return dataclasses.replace(
            self, ranks=ranks, cfg=dataclasses.replace(self.cfg, ranks=ranks)
        )


# The workloads of the last models predicted, by what defines the model: the phase models of
# one prediction each ask for its cost table, and `--validate` predicts every record (the
# records of one model differ in ranks, batch and strategy, and building a GPT's module, even
# on the meta device, and its cost table for each of them was half of validate's time).
_RECENT: OrderedDict[tuple, Workload] = OrderedDict()
RECENT_MAX = 64


def model_key(cfg: RunConfig) -> tuple:
    """What defines cfg's model and inputs: the workload, its shape options (the SHAPES
    sections, --model and its arguments included), the --model file's version, and where its
    data and seed come from. Prediction reads a workload only as this model's description."""
    shape = tuple(
        (f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if section_of(f) in SHAPES
    )
    return (cfg.workload, shape, cfg.data_dir, cfg.seed, _file_version(cfg.model))


def build_workload(cfg: RunConfig) -> Workload:
    """cfg's workload, one instance per model (model_key) in this process: read-only here,
    its cost table computed once, and never asked about how cfg runs (a strategy's own
    checks take the run's cfg as their argument)."""
    key = model_key(cfg)
    if key in _RECENT:
        _RECENT.move_to_end(key)
        return _RECENT[key]
    workload = _RECENT[key] = WORKLOADS.get(cfg.workload)(cfg)
    if len(_RECENT) > RECENT_MAX:
        _RECENT.popitem(last=False)
    return workload


def _file_version(model: str | None) -> tuple[int, int] | None:
    """(mtime ns, size) of a --model FILE:FACTORY's file: an edited file is another model."""
    path = (model or "").rpartition(":")[0]
    try:
        info = os.stat(path) if path else None
    except OSError:
        return None
    return (info.st_mtime_ns, info.st_size) if info else None


# An unset size of the family key read as the workload's native one, a class attribute: no
# model is built to classify a record (a user model's sizes follow from its model keys, which
# the family holds; building each GPT record's model was most of `predict --calibrate`).
_NATIVE = {"image_size": "native_size", "num_classes": "native_classes"}


def _native(cfg: RunConfig, key: str):
    value = getattr(cfg, key)
    if value is None and key in _NATIVE:
        return getattr(WORKLOADS.get(cfg.workload), _NATIVE[key])
    return value


@dataclass
class Prediction:
    """Seconds per iteration (inference) or optimizer step (training), phase by phase along
    the critical path; `comm_phases` names the phases that cross ranks."""

    scenario: Scenario
    phases: dict[str, float]
    comm_phases: frozenset[str] = frozenset()
    calibration: dict[str, str] = field(default_factory=dict)  # measured point -> what it set
    notes: list[str] = field(default_factory=list)
    feasible: str | None = None  # why the scenario cannot run (None: it can)
    extra: dict[str, float] = field(default_factory=dict)  # more columns for the table
    where: dict[str, str] = field(default_factory=dict)  # phase -> where on the ranks it is

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    @property
    def throughput(self) -> float:
        return self.scenario.global_batch / self.seconds if self.seconds > 0 else math.nan
