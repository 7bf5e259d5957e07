"""Typed run configuration. The resolved config is written into every record.

One flat dataclass, so `dataclasses.replace(cfg, ...)` and the record's flat `config` dict
keep working; every field names its section (config_sections.py: the section's ranges and
rules, which strategies read it) in its metadata, and the CLI groups `--help` by section.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from scalelab import config_sections


def opt(default: Any, help: str, section: str) -> Any:
    """A config field with its help text and section; the CLI builds `--flag` options from
    these."""
    return field(default=default, metadata={"help": help, "section": section})


@dataclass(kw_only=True)
class RunConfig:
    """One run of one workload under one strategy."""

    workload: str = field(
        metadata={"help": "Registered workload name (`scalelab list`).", "section": "run"}
    )
    strategy: str = opt("local", "Registered strategy name.", section="run")
    batch: int = opt(
        8,
        "Global batch, the same for every strategy: items per forward pass (inference) or "
        "per optimizer step (training), all ranks together; data-parallel strategies split "
        "it over the ranks.",
        section="run",
    )
    device: str = opt("cpu", "Where the `local` strategy computes: cpu or cuda.", section="run")
    dtype: str = opt(
        "fp32",
        "Numeric precision: fp64, fp32, tf32, bf16 or fp16 (bf16/fp16 via autocast).",
        section="run",
    )
    iters: int = opt(5, "Timed iterations (inference); the median is reported.", section="timing")
    warmup: int = opt(
        2,
        "Untimed iterations before timing (allocator, cuDNN autotune, caches); training: the "
        "optimizer steps at least that steady_throughput leaves out.",
        section="timing",
    )
    check: bool = opt(
        False,
        "Compare the output with the float64 NumPy oracle (--train: the trained weights and "
        "buffers with one float64 process's); exit 1 if over tolerance.",
        section="run",
    )
    # The inference check's bound, its explanation and strict kernels (run/check.py).
    explain: bool = opt(
        False,
        "With --check: report each module's error against float64 and name where the error "
        "entered (always done when the check fails).",
        section="infer",
    )
    tolerance: float | None = opt(
        None,
        "With --check: the relerr bound, overriding the derived one (the per-dtype tolerance "
        "as a floor; for a distributed strategy, 10x the one-process run in the same dtype).",
        section="infer",
    )
    strict_fp32: bool = opt(
        False,
        "fp32 as IEEE fp32: TF32 off for matmul and cuDNN, the math attention (SDPA) backend; "
        "shows whether a kernel choice lost the precision.",
        section="run",
    )
    seed: int = opt(0, "Seeds weights, synthetic inputs and data splits.", section="run")
    quiet: bool = opt(False, "No progress lines on stderr.", section="run")
    threads: int | None = opt(
        None,
        "torch intra-op threads on CPU (None: the CPUs free for the run shared by its "
        "ranks on the host, at most torch's default, or a resume's checkpoint's count; the "
        "record's `threads` says why). A CPU run repeats its bits at one count: BLAS may sum "
        "in another order at another, so give it to compare runs on a busy host.",
        section="run",
    )

    # Workload shape options: each in a section that workloads declare they read
    # (Workload.reads); a non-default one the workload does not read is refused.
    image_size: int | None = opt(
        None,
        "Input height = width for image workloads (None: the workload's native size).",
        section="image",
    )
    num_classes: int | None = opt(
        None, "Output classes (None: the workload's native count).", section="classes"
    )
    hidden: int = opt(512, "Hidden width of the mlp.", section="hidden")
    convs: int = opt(8, "deepstack: number of identical conv layers.", section="stack")
    fcs: int = opt(2, "deepstack: number of identical linear layers.", section="stack")
    data_dir: str | None = opt(
        None, "Folder with the real data set; synthetic inputs when None.", section="workload"
    )
    # Your own model (workloads/user_model.py): workload `model`, built by MODULE:FACTORY.
    model: str | None = opt(
        None,
        "Your own network: MODULE:FACTORY (an importable module or a .py path) -> nn.Module.",
        section="user-model",
    )
    model_arg: tuple[str, ...] = opt(
        (), "KEY=VALUE passed to the factory (repeatable; literals).", section="user-model"
    )
    input_shape: str | None = opt(
        None, "--model: one item's shape, C,H,W or C,L or F.", section="user-model"
    )
    input_dtype: str = opt(
        "float32", "--model: float32 (N(0,1) inputs) or int64 (token ids).", section="user-model"
    )
    vocab: int | None = opt(
        None, "--model --input-dtype int64: token ids lie in [0, vocab).", section="user-model"
    )
    tokenizer: str | None = opt(
        None,
        "--model with --data-dir text: a Hugging Face tokenizer (local name or folder; never "
        "downloaded) instead of bytes (vocab 256).",
        section="user-model",
    )
    weights: str | None = opt(
        None,
        "state_dict (.pt) or safetensors file to load instead of seeded random weights.",
        section="workload",
    )
    save_weights: str | None = opt(
        None,
        "Write the weights here after the run (trained; inference: the weights it ran).",
        section="workload",
    )

    # Training.
    train: bool = opt(False, "Train instead of inference.", section="run")
    epochs: int = opt(1, "Passes over the training set.", section="train")
    steps: int | None = opt(
        None,
        "Stop after this many optimizer steps in total (None: run all epochs).",
        section="train",
    )
    lr: float = opt(0.1, "SGD learning rate.", section="train")
    momentum: float = opt(0.0, "SGD momentum.", section="train")
    l2: float = opt(
        1e-4,
        "L2 regularisation strength lambda: loss += lambda/2 * sum(W**2) over weight matrices.",
        section="train",
    )
    sync_bn: bool = opt(
        False,
        "ddp, mpi-dp: BatchNorm normalises over the whole batch, not each rank's share "
        "(torch's SyncBatchNorm on GPUs, an all-reduce of the statistics on CPU ranks).",
        section="train",
    )
    train_size: int | None = opt(
        None,
        "Items in the seeded training split (synthetic data, or a data set with one split; "
        "None: the workload's, 8000, deepstack 256 since its items are 0.8 MB of noise).",
        section="workload",
    )
    heldout_size: int | None = opt(
        None, "Items in the held-out split (None: the workload's, 2000, deepstack 64).",
        section="workload",
    )  # fmt: skip

    # Distributed execution (MPI, torch.distributed).
    ranks: int = opt(
        1,
        "Processes to run; scalelab starts mpiexec/torchrun when not already inside one.",
        section="run",
    )
    split: str = opt(
        "batch",
        "How mpi/nccl strategies divide inference: broadcast, batch or spatial.",
        section="split",
    )
    overlap: bool = opt(
        False,
        "mpi-gpu: pipeline copies, compute and MPI over chunks on CUDA streams.",
        section="split",
    )
    chunks: int = opt(4, "mpi-gpu --overlap: chunks per rank's batch.", section="split")
    oversubscribe_gpus: bool = opt(
        False,
        "mpi-gpu, nccl, pipeline: allow more ranks than GPUs on a node (warned).",
        section="gpus",
    )
    nonblocking: bool = opt(
        False,
        "mpi-dp: start layer 2's gradient reduction before layer 1's backward ends.",
        section="mpi-dp",
    )
    amp: str | None = opt(
        None,
        "local, ddp: autocast dtype bf16 or fp16 (fp32 weights; fp16 with a grad scaler).",
        section="amp",
    )
    bucket_mb: float = opt(25.0, "ddp: gradient bucket size in MB.", section="ddp")
    grad_compress: str | None = opt(
        None,
        "ddp: all-reduce gradients in bf16 or fp16 (half the bytes; a DDP comm hook).",
        section="ddp",
    )
    channels_last: bool = opt(
        False, "ddp, pipeline: channels_last memory format for image models.", section="layout"
    )
    compile: bool = opt(
        False,
        "torch.compile the model (local, ddp, fsdp: per repeated block, else whole; "
        "pipeline: each stage).",
        section="compile",
    )
    compile_backend: str = opt(
        "inductor",
        "--compile: torch.compile's backend. inductor generates kernels; aot_eager traces the "
        "same graphs (forward and backward) and runs them without generating code, in a "
        "fraction of inductor's compile time on a CPU.",
        section="compile",
    )
    workers: int = opt(0, "ddp: DataLoader worker processes.", section="ddp")
    # --- fsdp (strategies/fsdp.py): torch's fully_shard ---------------------------------------
    reshard_after_forward: str = opt(
        "auto",
        "fsdp: 'on' frees each unit's gathered parameters after its forward and gathers them "
        "again in backward (ZeRO-3); 'off' keeps them until backward (ZeRO-2-like); 'auto' "
        "(torchtitan's): on for every unit but the last, whose backward comes next.",
        section="fsdp",
    )
    fsdp_unit_mb: float = opt(
        200.0,
        "fsdp: join consecutive blocks into one unit until it gathers this many MB of "
        "parameters (in the dtype FSDP gathers): fewer hooks and collectives for the host "
        "per step, a little more memory. 200 (1e8 bf16 parameters: torch's "
        "size_based_auto_wrap_policy default) groups small blocks and leaves a block of "
        "200 MB or more a unit of its own; 0: one unit per block.",
        section="fsdp",
    )
    dp_replicate: int = opt(
        1,
        "fsdp: replicas of the sharded group (HSDP: shard within --ranks / R ranks, "
        "replicate across R groups).",
        section="fsdp",
    )
    ckpt_every: int | None = opt(
        None,
        "Write a checkpoint every N optimizer steps (and at the end).",
        section="checkpoint",
    )
    ckpt_dir: str | None = opt(
        None, "Folder for checkpoints (default: next to --out).", section="checkpoint"
    )
    resume: str | None = opt(None, "Checkpoint to resume training from.", section="checkpoint")
    compare_devices: bool = opt(
        False,
        "mlp: train on CPU and GPU from the same weights and report the difference.",
        section="compare",
    )

    # Model parallelism.
    stages: int = opt(
        2,
        "pipeline: number of stages (one rank or GPU each); from the command line without it, "
        "--ranks / --dp.",
        section="pipeline",
    )
    microbatches: int = opt(4, "pipeline: micro-batches per batch (GPipe).", section="pipeline")
    schedule: str = opt(
        "gpipe",
        "pipeline: gpipe or 1f1b; with --engine torch also interleaved-1f1b, looped-bfs, "
        "zero-bubble, zbv, dualpipev.",
        section="pipeline",
    )
    balance: str = opt(
        "auto",
        "pipeline: 'auto' (equalise measured layer time) or a list like 5,7.",
        section="pipeline",
    )
    cut: str | None = opt(
        None,
        "pipeline: cut before these modules, fully qualified names in forward order "
        "(body.layers.2,body.layers.4: 3 stages); instead of --balance.",
        section="pipeline",
    )
    rebalance: int = opt(
        1,
        "pipeline --balance auto: rounds of re-cutting from each stage's own measured time "
        "(0: keep the per-layer profile's cut).",
        section="pipeline",
    )
    placement: str = opt(
        "pipeline",
        "pipeline: 'pipeline' (ranks, micro-batches) or 'manual' (GPUs of one process).",
        section="placement",
    )
    # Model parallelism on torch's engines (strategies/pipeline/torch_engine.py, tensor_dtensor.py).
    engine: str = opt(
        "scalelab",
        "pipeline/tensor: 'scalelab' (the hand-written engines) or 'torch' "
        "(torch.distributed.pipelining schedules; DTensor tensor parallelism).",
        section="engine",
    )
    virtual_stages: int = opt(
        1,
        "pipeline --engine torch: stages per rank (interleaved-1f1b, looped-bfs, zero-bubble).",
        section="interleave",
    )
    tp: int | None = opt(
        None,
        "tensor --engine torch: ranks per tensor-parallel group (default: --ranks / --dp).",
        section="tensor",
    )
    tp_plan: str | None = opt(
        None,
        "tensor --engine torch: your own plan, MODULE:OBJECT (a dict of module-name patterns "
        "to torch ParallelStyles, or a callable taking the model and returning one).",
        section="tensor",
    )
    dp: int = opt(
        1,
        "--engine torch: data-parallel replicas of the pipeline or tensor group (2-D mesh).",
        section="mesh",
    )
    swap_relu_pool: bool = opt(
        False, "vgg16/alexnet: apply max-pool before ReLU (they commute).", section="swap"
    )

    # Instrumentation.
    trace: str | None = opt(
        None,
        "Folder for torch.profiler traces, one rank{r}.json.gz per rank.",
        section="instrument",
    )
    timeline: bool = opt(
        False,
        "Record every rank's phases on one clock (the record's `timeline`; `scalelab timeline` "
        "draws it, `scalelab phases` splits communication into waiting and transfer). --trace "
        "records it too and writes DIR/timeline.json.",
        section="instrument",
    )
    nvml: bool = opt(
        False,
        "Sample GPU memory, power and utilisation with NVML during the run.",
        section="instrument",
    )
    per_layer: bool = opt(
        False, "Time each layer and record its output bytes and peak memory.", section="instrument"
    )
    fast: bool = opt(
        False,
        "local, ddp: the fast path (fused kernels, CUDA graphs) where available.",
        section="fast",
    )

    def __post_init__(self) -> None:
        if isinstance(self.model_arg, list):  # from TOML or a record's JSON
            self.model_arg = tuple(self.model_arg)
        config_sections.validate(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def upgrade_record_config(
    config: dict[str, Any], trained_batch: int | None = None
) -> dict[str, Any]:
    """A record's `config` as this RunConfig reads it. Records written before the config had
    sections carry `extra` and `global_batch`, and their `batch` was per rank for a strategy
    that split it: the batch becomes the global one the config named (--global-batch) or else
    the one the record says it trained (`trained_batch`, a training record's top-level
    `global_batch`). Records written before --fsdp-unit-mb existed ran one FSDP unit per
    block: 0, not today's default."""
    config = {"fsdp_unit_mb": 0.0, **config}
    if "extra" not in config and "global_batch" not in config:
        return config
    out = {k: v for k, v in config.items() if k not in ("extra", "global_batch")}
    given = config.get("global_batch") or trained_batch
    if given and isinstance(out.get("batch"), int):
        out["batch"] = int(given)
    return out
