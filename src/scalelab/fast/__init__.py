"""The fast single-device path (`--fast`): fused Triton kernels, bf16, channels_last, cuDNN
autotuning and CUDA graphs, with plain torch as the fallback for every part.

    accelerate(workload, model, cfg, device) -> callable: transport-form x -> fp32 logits
    fast.train.local_fast_trainer(...)      -> a Trainer whose step replays a CUDA graph

Where a part is unavailable (no GPU, no Triton, a kernel failing validation) the path says so
in one line and uses plain torch for that part.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.fast import alexnet, charcnn, generic, resnet  # noqa: F401  (fill FAST_PATHS)
from scalelab.fast.forward import FastForward
from scalelab.fast.kernels import INTERPRET, triton_unavailable
from scalelab.fast.registry import FAST_PATHS
from scalelab.precision import get_precision
from scalelab.workloads.base import Workload

__all__ = [
    "FAST_PATHS",
    "FastForward",
    "accelerate",
    "build_fast",
    "stderr_log",
]


def stderr_log(quiet: bool) -> Callable[[str], None]:
    def log(line: str) -> None:
        if not quiet:
            sys.stderr.write(f"scalelab: {line}\n")
            sys.stderr.flush()

    return log


def accelerate(
    workload: Workload,
    model: nn.Module,
    cfg: RunConfig,
    device: torch.device,
    log: Callable[[str], None] | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fast forward of model (on device; never modified) for workload's transport form."""
    log = log or stderr_log(cfg.quiet)
    if device.type != "cuda" and not INTERPRET:
        log(
            f"fast path on {device.type}: Triton kernels, CUDA graphs and bf16 tensor cores "
            "unavailable (no CUDA GPU); running the plain torch path"
        )
        return plain_forward(workload, model, cfg.dtype)
    if not own_model(workload, model):
        log(
            "fast path unavailable: the model is not the workload's own module "
            f"({type(model).__name__}, e.g. sharded by strategy {cfg.strategy}); "
            "running the plain torch path"
        )
        return plain_forward(workload, model, cfg.dtype)
    if cfg.dtype != "bf16":
        raise UsageError(
            f"--fast computes in bf16 (fp32 accumulation); use --dtype bf16, not {cfg.dtype}"
        )
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # cuDNN times its algorithms on first use
        # bf16 GEMMs must accumulate in fp32 throughout (no reduced-precision split-K sums).
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    reason = triton_unavailable(device.type)
    return build_fast(
        workload,
        model,
        device,
        reason is None,
        device.type == "cuda",
        log,
        [reason] if reason else [],
    )


def own_model(workload: Workload, model: nn.Module) -> bool:
    """Whether model is workload's module with every parameter whole (not a shard or wrapper):
    the fast paths read its weights by name. The reference is built on the meta device."""
    with torch.device("meta"):
        ref = workload._build()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return type(model) is type(ref) and shapes == {
        k: tuple(v.shape) for k, v in ref.state_dict().items()
    }


def build_fast(
    workload: Workload,
    model: nn.Module,
    device: torch.device,
    kernels: bool,
    graphs: bool,
    log: Callable[[str], None],
    unavailable: list[str] | None = None,
) -> FastForward:
    """The workload's registered fast path (or the generic one), stages chosen on first call.

    kernels: whether Triton candidates may run; graphs: capture the forward (CUDA only).
    """
    if any(p.device != device for p in model.parameters()):
        model = copy.deepcopy(model).to(device)
    name = workload.cfg.workload
    builder = FAST_PATHS.get(name) if name in FAST_PATHS else generic.build
    with torch.no_grad():
        plan = builder(workload, model, device)
    return FastForward(plan, device, kernels, graphs, log, unavailable or [], tag=name)


def plain_forward(
    workload: Workload, model: nn.Module, dtype: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The torch path a `local` run takes without --fast (the CPU fallback)."""
    precision = get_precision(dtype)

    def forward(x: torch.Tensor) -> torch.Tensor:
        cast = precision.autocast
        ctx = torch.autocast(x.device.type, dtype=cast) if cast is not None else nullcontext()
        with torch.inference_mode(), ctx:
            return model(workload.prepare(x).to(precision.storage)).float()

    return forward
