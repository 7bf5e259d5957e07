"""The run configuration's sections: which fields belong together, each section's own rules,
and the one place both are applied.

`RunConfig` (config.py) stays one flat dataclass (so `dataclasses.replace(cfg, ...)` and the
record's flat `config` dict keep working); each field names its section in its metadata.
A section is a name, a help title, its ranges and one function of the whole config for its
cross-field rules. `validate(cfg)` runs every section (RunConfig.__post_init__ calls it);
`refuse_unread(cfg, strategy, workload)` refuses a non-default option from a section the strategy
or, for the shape sections (SHAPES), the workload does not read (the runner, sweeps and
`scalelab run` call it before any work or launcher).
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from scalelab.errors import UsageError
from scalelab.precision import PRECISIONS

DEVICES = ("cpu", "cuda")
ENGINES = ("scalelab", "torch")
# torch.compile backends: inductor generates kernels; aot_eager traces forward and backward
# through AOTAutograd as inductor does, then runs the traced graphs eagerly (no codegen)
COMPILE_BACKENDS = ("inductor", "aot_eager")
HALF = (None, "bf16", "fp16")
PLACEMENTS = ("pipeline", "manual")
# Schedules by engine (strategies/pipeline_schedule.py, pipeline_torch_stages.py; a test
# keeps these lists equal to the engines' own tables).
SCHEDULES = {
    "scalelab": ("gpipe", "1f1b"),
    "torch": ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv",
              "dualpipev"),
}  # fmt: skip
BIG = 2**31 - 1  # sizes beyond int32 are typos, and torch indexes with int32 in places
SHAPE_TITLE = "workload shape (each workload reads its own)"  # one --help group for them


@dataclass(frozen=True)
class Section:
    """name: what fields carry in metadata["section"] and strategies list in `reads`."""

    name: str
    title: str
    ints: dict[str, tuple[int, int]] = field(default_factory=dict)  # inclusive; None passes
    # (low, high, low end open): finite and inside, so inf/nan/1e300 never reach an optimizer
    floats: dict[str, tuple[float, float, bool]] = field(default_factory=dict)
    rules: Callable[[Any], None] | None = None  # rules on this section's own values
    # rules that hold only when a strategy reads the section (they involve other sections'
    # fields whose defaults would trip them: the pipeline's batch against its micro-batches)
    when_read: Callable[[Any], None] | None = None

    def validate(self, cfg: Any) -> None:
        for name, (lo, hi) in self.ints.items():
            value = getattr(cfg, name)
            if value is not None and not lo <= value <= hi:
                bound = f">= {lo}" if value < lo else f"<= {hi}"
                raise UsageError(f"--{flag(name)} must be {bound}, got {value}")
        for name, (lo, hi, lo_open) in self.floats.items():
            value = getattr(cfg, name)
            if value is None:  # an optional float: None passes, as for ints
                continue
            inside = lo < value <= hi if lo_open else lo <= value <= hi
            if not (math.isfinite(value) and inside):
                span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
                raise UsageError(f"--{flag(name)} must be in {span}, got {value}")
        if self.rules is not None:
            self.rules(cfg)


def flag(name: str) -> str:
    return name.replace("_", "-")


def _known(value: Any, known: tuple, what: str) -> None:
    if value not in known:
        names = ", ".join(str(k) for k in known if k is not None)
        raise UsageError(f"unknown {what} {value!r} (known: {names})")


# --- each section's cross-field rules ------------------------------------------------------
def _run_rules(cfg: Any) -> None:
    _known(cfg.dtype, tuple(PRECISIONS), "dtype")
    _known(cfg.device, DEVICES, "device")
    if cfg.strict_fp32 and cfg.dtype not in ("fp32", "fp64"):
        raise UsageError(f"--strict-fp32 goes with --dtype fp32 (or fp64), not {cfg.dtype}")


def _infer_rules(cfg: Any) -> None:
    if (cfg.explain or cfg.tolerance is not None) and not cfg.check:
        raise UsageError("--explain and --tolerance go with --check")


def _workload_rules(cfg: Any) -> None:
    if cfg.data_dir is not None and not Path(cfg.data_dir).is_dir():
        raise UsageError(f"--data-dir {cfg.data_dir}: no such directory")
    if cfg.weights is not None and not Path(cfg.weights).is_file():
        raise UsageError(f"--weights {cfg.weights}: no such file")


def _checkpoint_rules(cfg: Any) -> None:
    if cfg.resume is not None and not Path(cfg.resume).is_file():
        raise UsageError(f"--resume {cfg.resume}: no such file")


def _ddp_rules(cfg: Any) -> None:
    if cfg.grad_compress not in HALF:
        raise UsageError(f"--grad-compress must be bf16 or fp16, got {cfg.grad_compress!r}")


def _amp_rules(cfg: Any) -> None:
    if cfg.amp not in HALF:
        raise UsageError(f"--amp must be bf16 or fp16, got {cfg.amp!r}")


def _amp_when_read(cfg: Any) -> None:
    if cfg.amp == "fp16" and cfg.device == "cpu":
        raise UsageError(
            "--amp fp16 needs a GPU (fp16 gradients need a grad scaler, which runs on "
            "CUDA); use --amp bf16 on the CPU"
        )
    if cfg.amp is not None and cfg.dtype not in ("fp32", cfg.amp):
        raise UsageError(f"--amp {cfg.amp} and --dtype {cfg.dtype} disagree; give one")


def _ddp_when_read(cfg: Any) -> None:
    if cfg.grad_compress == "bf16" and cfg.device == "cpu":
        raise UsageError(
            "--grad-compress bf16 needs NCCL (torch's bf16 hook does not run on gloo); "
            "use --grad-compress fp16 on the CPU"
        )


def _fsdp_rules(cfg: Any) -> None:
    _known(cfg.reshard_after_forward, ("auto", "on", "off"), "--reshard-after-forward")


def _fsdp_when_read(cfg: Any) -> None:
    if cfg.ranks > 1 and cfg.ranks % cfg.dp_replicate:
        raise UsageError(
            f"--dp-replicate {cfg.dp_replicate} does not divide --ranks {cfg.ranks} "
            "(HSDP shards over --ranks / R ranks in each of R replicas)"
        )


def _split_rules(cfg: Any) -> None:
    if cfg.overlap and cfg.split != "batch":
        raise UsageError("--overlap pipelines the chunks of --split batch; drop one of them")


def _pipeline_rules(cfg: Any) -> None:
    _known(cfg.schedule, SCHEDULES["torch"], "--schedule")
    _known(cfg.placement, PLACEMENTS, "--placement")
    _balance_form(cfg.balance)


def _balance_form(spec: str) -> None:
    """--balance is 'auto' or layer counts >= 1 (layout/partition.py checks them against
    the model's layers and stages, once the model is built)."""
    if spec.strip() == "auto":
        return
    parts = [part.strip() for part in spec.split(",")]
    if not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise UsageError(f"--balance must be 'auto' or layer counts like 5,7; got {spec!r}")


def _pipeline_when_read(cfg: Any) -> None:
    _known(cfg.schedule, SCHEDULES[cfg.engine], "--schedule")
    if cfg.engine == "torch":
        if cfg.batch % (cfg.dp * cfg.microbatches):
            raise UsageError(
                f"--batch {cfg.batch} must split into --dp {cfg.dp} x --microbatches "
                f"{cfg.microbatches} equal parts (torch's stages fix the micro-batch shape)"
            )
    elif cfg.batch < cfg.microbatches and cfg.placement == "pipeline":
        raise UsageError(f"--batch {cfg.batch} is smaller than --microbatches {cfg.microbatches}")


def _engine_rules(cfg: Any) -> None:
    _known(cfg.engine, ENGINES, "--engine")


def _compile_rules(cfg: Any) -> None:
    _known(cfg.compile_backend, COMPILE_BACKENDS, "--compile-backend")


SECTIONS: dict[str, Section] = {
    s.name: s
    for s in (
        Section("run", "run (every strategy)", {
            "batch": (1, BIG), "seed": (0, 2**63 - 1), "threads": (1, 4096),
            "ranks": (1, 2**20)}, rules=_run_rules),
        Section("workload", "workload data and weights", {
            "train_size": (1, BIG), "heldout_size": (1, BIG)}, rules=_workload_rules),
        # The shape sections: a workload reads those in its `reads` (SHAPES below).
        Section("image", SHAPE_TITLE, {"image_size": (1, 65536)}),
        Section("classes", SHAPE_TITLE, {"num_classes": (1, 10**7)}),
        Section("hidden", SHAPE_TITLE, {"hidden": (1, 2**24)}),
        Section("stack", SHAPE_TITLE, {"convs": (1, 10**4), "fcs": (1, 10**4)}),
        Section("swap", SHAPE_TITLE),
        Section("user-model", "your own model (--model)",
                {"vocab": (1, 2**24)}),  # token ids travel through float32 inputs exactly to 2**24
        # Timing and data sizes are read in both modes as far as a caller can tell: scripts
        # and tests pass one set of them to inference and training runs alike.
        Section("timing", "timing", {"iters": (1, 10**7), "warmup": (0, 10**7)}),
        Section("infer", "inference (without --train)",
                floats={"tolerance": (0.0, 1e6, True)}, rules=_infer_rules),
        Section("train", "training (--train)", {"epochs": (1, 10**6), "steps": (1, BIG)},
            {"lr": (0.0, 1e30, True), "momentum": (0.0, 0.999999, False),
             "l2": (0.0, 1e6, False)}),
        Section("compare", "mlp: CPU against GPU training"),
        Section("checkpoint", "checkpoints (--train)", {"ckpt_every": (1, BIG)},
                rules=_checkpoint_rules),
        Section("instrument", "instrumentation"),
        Section("split", "split inference (mpi, mpi-gpu, nccl)", {"chunks": (1, BIG)},
                rules=_split_rules),
        Section("gpus", "GPUs per node (mpi-gpu, nccl, pipeline)"),
        Section("ddp", "ddp", {"workers": (0, 1024)}, {"bucket_mb": (0.0, 1e6, True)},
                rules=_ddp_rules, when_read=_ddp_when_read),
        Section("amp", "autocast (local, ddp)", rules=_amp_rules, when_read=_amp_when_read),
        Section("fsdp", "fsdp (torch fully_shard)", {"dp_replicate": (1, 2**20)},
                rules=_fsdp_rules, when_read=_fsdp_when_read),
        Section("mpi-dp", "mpi-dp"),
        Section("layout", "memory layout (ddp, pipeline)"),
        Section("compile", "torch.compile (local, ddp, fsdp, pipeline)", rules=_compile_rules),
        Section("fast", "fast path (local, ddp)"),
        Section("pipeline", "pipeline", {
            "stages": (1, 4096), "microbatches": (1, BIG), "rebalance": (0, 100)},
            rules=_pipeline_rules, when_read=_pipeline_when_read),
        Section("placement", "pipeline placement (--engine scalelab)"),
        Section("engine", "engine (pipeline, tensor)", rules=_engine_rules),
        Section("mesh", "2-D mesh (--engine torch)", {"dp": (1, 2**20)}),
        Section("interleave", "virtual stages (pipeline --engine torch)",
                {"virtual_stages": (1, 64)}),
        Section("tensor", "tensor-parallel degree (tensor --engine torch)", {"tp": (1, 2**20)}),
    )
}  # fmt: skip
ALWAYS = ("run", "workload", "timing", "instrument")  # sections every strategy reads
# Sections a workload reads when its class lists them in `reads` (workloads/base.py), in
# place of a strategy: the refusal names the workloads that read the option.
SHAPES = ("image", "classes", "hidden", "stack", "swap", "user-model")
MODES = {"infer": "(drop --train)", "train": "(add --train)"}  # read by the run's mode


def section_of(f: Any) -> str:
    return f.metadata["section"]


def validate(cfg: Any) -> None:
    """What holds whatever the strategy (RunConfig.__post_init__): types, then every
    section's ranges and rules on its own values."""
    _check_types(cfg)
    for section in SECTIONS.values():
        section.validate(cfg)


def check(cfg: Any, strategy: type, workload: type | None = None) -> None:
    """What holds for cfg under strategy and workload (its class), before any work and
    before any launcher starts ranks (the runner, `scalelab run` and sweeps call this): no
    option the run would ignore, then the rules of the sections it reads that involve other
    sections. Without a workload class every shape section counts as read."""
    refuse_unread(cfg, strategy, workload)
    read = read_by(cfg, strategy, workload)
    for section in SECTIONS.values():
        if section.name in read and section.when_read is not None:
            section.when_read(cfg)


@functools.cache
def _field_kinds(cls: type) -> tuple[tuple[str, tuple[type, ...], bool], ...]:
    """(field, the types its value may have, whether the hint is a tuple) per field of cls.
    Cached per class: get_type_hints evaluates every string annotation again on each call
    (~4 ms a RunConfig), and plan and predict build thousands of configs."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        hint = hints[f.name]
        kinds = tuple(a for a in typing.get_args(hint) if a is not type(None)) or (hint,)
        out.append((f.name, kinds, typing.get_origin(hint) is tuple))
    return tuple(out)


def _check_types(cfg: Any) -> None:
    """Values from TOML or Python must have the field's type (an int field given 2.5 or
    True would pass the range checks and fail deep inside a strategy)."""
    for name, kinds, is_tuple in _field_kinds(type(cfg)):
        value = getattr(cfg, name)
        if value is None:
            continue
        if is_tuple:  # tuple[str, ...]: every item a str
            kinds = (tuple,) if all(isinstance(v, str) for v in value) else (str,)
        ok = isinstance(value, kinds) and not (bool not in kinds and isinstance(value, bool))
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise UsageError(f"--{flag(name)}: {value!r} is not {kinds[0].__name__}")


def read_by(cfg: Any, strategy: type, workload: type | None = None) -> set[str]:
    """The sections a run of cfg reads: the strategy's own (per its engine and placement),
    the workload's shape sections, the ones every run reads, and the mode's."""
    own = set(strategy.reads_for(cfg))
    shapes = set(SHAPES if workload is None else workload.reads)
    if cfg.train:
        return {*ALWAYS, "train", *own, *shapes}
    return {*ALWAYS, "infer", *(own - {"train", "checkpoint", "compare"}), *shapes}


def refuse_unread(cfg: Any, strategy: type, workload: type | None = None) -> None:
    """One line for the first option given a non-default value in a section this run does
    not read (it would be ignored silently)."""
    read = read_by(cfg, strategy, workload)
    for f in fields(cfg):
        name = section_of(f)
        if name in read or getattr(cfg, f.name) == f.default:
            continue
        if name in SHAPES:
            _refuse_shape(cfg, workload, f.name, name)
        _refuse_for_strategy(cfg, strategy, f.name, name)


def refuse_unread_shapes(cfg: Any, workload: type) -> None:
    """refuse_unread for the commands that model a workload without running a strategy
    (`layers`, `fit`, `predict`): a shape option the workload would not read."""
    for f in fields(cfg):
        name = section_of(f)
        if name in SHAPES and name not in workload.reads and getattr(cfg, f.name) != f.default:
            _refuse_shape(cfg, workload, f.name, name)


def _refuse_shape(cfg: Any, workload: type, option: str, name: str) -> None:
    readers = "--model" if name == "user-model" else "/".join(workload.readers(name))
    raise UsageError(
        f"--{flag(option)} is {_article(readers)} {readers} option; the "
        f"{cfg.workload} workload does not read it"
    )


def _refuse_for_strategy(cfg: Any, strategy: type, option: str, name: str) -> None:
    what = f"--{flag(option)} is {_article(name)} {name} option"
    if name in MODES:
        mode = "a --train run" if cfg.train else "an inference run"
        raise UsageError(f"{what}; {mode} does not read it {MODES[name]}")
    if (
        not cfg.train
        and name in ("train", "checkpoint", "compare")
        and name in set(strategy.reads_for(cfg))
    ):
        raise UsageError(f"{what}; an inference run does not read it (add --train)")
    needs = strategy.read_with(cfg, name)
    readers = ", ".join(strategy.readers(cfg, name)) or "no strategy"
    hint = f" (--{flag(option)} needs {needs})" if needs else f" (read by {readers})"
    raise UsageError(f"{what}; {strategy.describe(cfg)} does not read it{hint}")


def _article(name: str) -> str:
    an = ("infer", "instrument", "engine", "interleave", "mpi-dp", "alexnet", "mlp", "amp")
    return "an" if name.startswith(an) else "a"
