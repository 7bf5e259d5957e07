"""Typed run configuration. The resolved config is written into every record."""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from scalelab.errors import UsageError
from scalelab.precision import PRECISIONS

DEVICES = ("cpu", "cuda")
ENGINES = ("scalelab", "torch")
BIG = 2**31 - 1  # sizes beyond int32 are typos, and torch indexes with int32 in places
# Inclusive ranges; None (unset) always passes. A seed is any 64-bit value torch accepts.
INT_RANGES = {
    "batch": (1, BIG),
    "iters": (1, 10**7),
    "warmup": (0, 10**7),
    "seed": (0, 2**63 - 1),
    "threads": (1, 4096),
    "image_size": (1, 65536),
    "num_classes": (1, 10**7),
    "hidden": (1, 2**24),
    "convs": (1, 10**4),
    "fcs": (1, 10**4),
    "epochs": (1, 10**6),
    "steps": (1, BIG),
    "train_size": (1, BIG),
    "heldout_size": (1, BIG),
    "ranks": (1, 2**20),
    "chunks": (1, BIG),
    "global_batch": (1, BIG),
    "workers": (0, 1024),
    "ckpt_every": (1, BIG),
    "stages": (1, 4096),
    "microbatches": (1, BIG),
    "rebalance": (0, 100),
    "virtual_stages": (1, 64),
    "dp": (1, 2**20),
    "tp": (1, 2**20),
    "vocab": (1, 2**24),  # token ids travel through float32 inputs exactly up to 2**24
}
# (low, high, low end open): finite and inside, so inf/nan/1e300 never reach an optimizer
# (lr's bound: finite in float32 with margin; a huge lr then diverges and is caught by name).
FLOAT_RANGES = {
    "lr": (0.0, 1e30, True),
    "momentum": (0.0, 0.999999, False),
    "l2": (0.0, 1e6, False),
    "bucket_mb": (0.0, 1e6, True),
}


def opt(default: Any, help: str) -> Any:
    """A config field with its help text; the CLI builds `--flag` options from these."""
    return field(default=default, metadata={"help": help})


@dataclass(kw_only=True)
class RunConfig:
    """One run of one workload under one strategy."""

    workload: str = field(metadata={"help": "Registered workload name (`scalelab list`)."})
    strategy: str = opt("local", "Registered strategy name.")
    batch: int = opt(
        8,
        "Global batch: items per forward pass (inference) or per optimizer step, all ranks "
        "together; ddp alone reads it per rank (--global-batch gives ddp a global one).",
    )
    device: str = opt("cpu", "Where the `local` strategy computes: cpu or cuda.")
    dtype: str = opt(
        "fp32", "Numeric precision: fp64, fp32, tf32, bf16 or fp16 (bf16/fp16 via autocast)."
    )
    iters: int = opt(5, "Timed iterations (inference); the median is reported.")
    warmup: int = opt(2, "Untimed iterations before timing (allocator, cuDNN autotune, caches).")
    check: bool = opt(
        False, "Compare the output with the float64 NumPy oracle; exit 1 if over tolerance."
    )
    seed: int = opt(0, "Seeds weights, synthetic inputs and data splits.")
    quiet: bool = opt(False, "No progress lines on stderr.")
    threads: int | None = opt(None, "torch intra-op threads on CPU (None: torch's default).")

    # Workload shape options (each workload reads the ones it needs).
    image_size: int | None = opt(
        None, "Input height = width for image workloads (None: the workload's native size)."
    )
    num_classes: int | None = opt(None, "Output classes (None: the workload's native count).")
    hidden: int = opt(512, "Hidden width of the mlp.")
    convs: int = opt(8, "deepstack: number of identical conv layers.")
    fcs: int = opt(2, "deepstack: number of identical linear layers.")
    data_dir: str | None = opt(None, "Folder with the real data set; synthetic inputs when None.")
    # Your own model (workloads/user_model.py): workload `model`, built by MODULE:FACTORY.
    model: str | None = opt(
        None, "Your own network: MODULE:FACTORY (an importable module or a .py path) -> nn.Module."
    )
    model_arg: tuple[str, ...] = opt((), "KEY=VALUE passed to the factory (repeatable; literals).")
    input_shape: str | None = opt(None, "--model: one item's shape, C,H,W or C,L or F.")
    input_dtype: str = opt("float32", "--model: float32 (N(0,1) inputs) or int64 (token ids).")
    vocab: int | None = opt(None, "--model --input-dtype int64: token ids lie in [0, vocab).")
    weights: str | None = opt(
        None, "state_dict (.pt) or safetensors file to load instead of seeded random weights."
    )
    save_weights: str | None = opt(
        None, "Write the weights here after the run (trained; inference: the weights it ran)."
    )

    # Training.
    train: bool = opt(False, "Train instead of inference.")
    epochs: int = opt(1, "Passes over the training set.")
    steps: int | None = opt(
        None, "Stop after this many optimizer steps in total (None: run all epochs)."
    )
    lr: float = opt(0.1, "SGD learning rate.")
    momentum: float = opt(0.0, "SGD momentum.")
    l2: float = opt(
        1e-4,
        "L2 regularisation strength lambda: loss += lambda/2 * sum(W**2) over weight matrices.",
    )
    train_size: int = opt(
        8000, "mlp: items in the seeded training split when only the MNIST test set is present."
    )
    heldout_size: int = opt(2000, "mlp: items in the held-out split.")

    # Distributed execution (MPI, torch.distributed).
    ranks: int = opt(
        1, "Processes to run; scalelab starts mpiexec/torchrun when not already inside one."
    )
    split: str = opt(
        "batch", "How mpi/nccl strategies divide inference: broadcast, batch or spatial."
    )
    overlap: bool = opt(
        False, "mpi-gpu: pipeline copies, compute and MPI over chunks on CUDA streams."
    )
    chunks: int = opt(4, "mpi-gpu --overlap: chunks per rank's batch.")
    oversubscribe_gpus: bool = opt(False, "Allow more ranks than GPUs on a node (warned).")
    nonblocking: bool = opt(
        False, "mpi-dp: start layer 2's gradient reduction before layer 1's backward ends."
    )
    global_batch: int | None = opt(
        None, "ddp: global batch over all ranks (strong scaling); else --batch per rank."
    )
    amp: str | None = opt(None, "ddp: autocast dtype bf16 or fp16 (fp16 with a grad scaler).")
    bucket_mb: float = opt(25.0, "ddp: gradient bucket size in MB.")
    grad_compress: str | None = opt(
        None, "ddp: all-reduce gradients in bf16 or fp16 (half the bytes; a DDP comm hook)."
    )
    channels_last: bool = opt(False, "Use channels_last memory format for image models.")
    compile: bool = opt(False, "torch.compile the model (ddp; pipeline: each stage).")
    workers: int = opt(0, "DataLoader worker processes.")
    ckpt_every: int | None = opt(
        None, "Write a checkpoint every N optimizer steps (and at the end)."
    )
    ckpt_dir: str | None = opt(None, "Folder for checkpoints (default: next to --out).")
    resume: str | None = opt(None, "Checkpoint to resume training from.")
    compare_devices: bool = opt(
        False, "mlp: train on CPU and GPU from the same weights and report the difference."
    )

    # Model parallelism.
    stages: int = opt(2, "pipeline: number of stages (one rank or GPU each).")
    microbatches: int = opt(4, "pipeline: micro-batches per batch (GPipe).")
    schedule: str = opt(
        "gpipe",
        "pipeline: gpipe or 1f1b; with --engine torch also interleaved-1f1b, looped-bfs, "
        "zero-bubble, zbv, dualpipev.",
    )
    balance: str = opt(
        "auto", "pipeline: 'auto' (equalise measured layer time) or a list like 5,7."
    )
    rebalance: int = opt(
        1,
        "pipeline --balance auto: rounds of re-cutting from each stage's own measured time "
        "(0: keep the per-layer profile's cut).",
    )
    placement: str = opt(
        "pipeline", "pipeline: 'pipeline' (ranks, micro-batches) or 'manual' (GPUs of one process)."
    )
    # Model parallelism on torch's engines (strategies/pipeline/torch_engine.py, tensor_dtensor.py).
    engine: str = opt(
        "scalelab",
        "pipeline/tensor: 'scalelab' (the hand-written engines) or 'torch' "
        "(torch.distributed.pipelining schedules; DTensor tensor parallelism).",
    )
    virtual_stages: int = opt(
        1, "pipeline --engine torch: stages per rank (interleaved-1f1b, looped-bfs, zero-bubble)."
    )
    tp: int | None = opt(
        None, "tensor --engine torch: ranks per tensor-parallel group (default: --ranks / --dp)."
    )
    dp: int = opt(
        1, "--engine torch: data-parallel replicas of the pipeline or tensor group (2-D mesh)."
    )
    swap_relu_pool: bool = opt(False, "vgg16/alexnet: apply max-pool before ReLU (they commute).")

    # Instrumentation.
    trace: str | None = opt(None, "Folder for torch.profiler traces, one rank{r}.json.gz per rank.")
    timeline: bool = opt(
        False,
        "Record every rank's phases on one clock (the record's `timeline`; `scalelab timeline` "
        "draws it, `scalelab phases` splits communication into waiting and transfer). --trace "
        "records it too and writes DIR/timeline.json.",
    )
    nvml: bool = opt(False, "Sample GPU memory, power and utilisation with NVML during the run.")
    per_layer: bool = opt(False, "Time each layer and record its output bytes and peak memory.")
    fast: bool = opt(
        False, "Use the fast single-device path (fused kernels, graphs) where available."
    )

    extra: dict[str, Any] = field(default_factory=dict)
    """Strategy-specific options (ranks, split, ...), kept so records stay complete."""

    def __post_init__(self) -> None:
        if isinstance(self.model_arg, list):  # from TOML or a record's JSON
            self.model_arg = tuple(self.model_arg)
        _check_types(self)
        for name, (lo, hi) in INT_RANGES.items():
            value = getattr(self, name)
            if value is not None and not lo <= value <= hi:
                bound = f">= {lo}" if value < lo else f"<= {hi}"
                raise UsageError(f"--{_flag(name)} must be {bound}, got {value}")
        for name, (lo, hi, lo_open) in FLOAT_RANGES.items():
            value = getattr(self, name)
            inside = lo < value <= hi if lo_open else lo <= value <= hi
            if not (math.isfinite(value) and inside):
                span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
                raise UsageError(f"--{_flag(name)} must be in {span}, got {value}")
        if self.amp not in (None, "bf16", "fp16"):
            raise UsageError(f"--amp must be bf16 or fp16, got {self.amp!r}")
        if self.grad_compress not in (None, "bf16", "fp16"):
            raise UsageError(f"--grad-compress must be bf16 or fp16, got {self.grad_compress!r}")
        if self.dtype not in PRECISIONS:
            raise UsageError(f"unknown dtype {self.dtype!r} (known: {', '.join(PRECISIONS)})")
        if self.device not in DEVICES:
            raise UsageError(f"unknown device {self.device!r} (known: {', '.join(DEVICES)})")
        if self.data_dir is not None and not Path(self.data_dir).is_dir():
            raise UsageError(f"--data-dir {self.data_dir}: no such directory")
        for name in ("weights", "resume"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise UsageError(f"--{name} {value}: no such file")
        self._check_torch_engines()

    def _check_torch_engines(self) -> None:
        """--engine, --virtual-stages, --tp, --dp (the layouts on torch's engines)."""
        if self.engine not in ENGINES:
            raise UsageError(f"unknown --engine {self.engine!r} (known: {', '.join(ENGINES)})")
        if self.virtual_stages < 1 or self.dp < 1 or (self.tp is not None and self.tp < 1):
            raise UsageError("--virtual-stages, --dp and --tp must be >= 1")
        torch_only = {"--dp": self.dp != 1, "--virtual-stages": self.virtual_stages != 1,
                      "--tp": self.tp is not None}  # fmt: skip
        used = [flag for flag, on in torch_only.items() if on]
        if used and self.engine != "torch":
            raise UsageError(f"{', '.join(used)} need --engine torch")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _check_types(cfg: RunConfig) -> None:
    """Values from TOML or Python must have the field's type (an int field given 2.5 or
    True would pass the range checks and fail deep inside a strategy)."""
    hints = typing.get_type_hints(RunConfig)
    for f in fields(RunConfig):
        value, hint = getattr(cfg, f.name), hints[f.name]
        if value is None or f.name == "extra":
            continue
        kinds = tuple(a for a in typing.get_args(hint) if a is not type(None)) or (hint,)
        if typing.get_origin(hint) is tuple:  # tuple[str, ...]: every item a str
            kinds = (tuple,) if all(isinstance(v, str) for v in value) else (str,)
        ok = isinstance(value, kinds) and not (bool not in kinds and isinstance(value, bool))
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise UsageError(f"--{_flag(f.name)}: {value!r} is not {kinds[0].__name__}")
