"""Measuring a model's layers one at a time (seconds, parameter and activation bytes, what
autograd saves) for the pipeline's `--balance auto`, and the device capacity the memory model
may fill.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from scalelab.layout.partition import LayerProfile
from scalelab.layout.preserve import kept_state
from scalelab.workloads.layers import Layer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _SavedTensors:
    """Records the storages autograd saves for backward during one forward."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}  # data_ptr -> bytes

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _measure_layer(
    layer: Layer,
    x: torch.Tensor,
    train: bool,
    autocast,
    device: torch.device,
    reps: int,
    input_grad: bool = True,
) -> tuple[LayerProfile, torch.Tensor]:
    """Seconds of forward (+ backward of a ones gradient), the mean of reps calls issued back
    to back after one warm-up call (allocator, cuDNN autotune), which also records what the
    layer saves. Back to back, because that is how a pipeline stage runs: the host queues
    micro-batch after micro-batch, and a device sync around every call would add each
    kernel's launch latency to stages made of many small kernels. These times only seed the
    first cut: whole stages are re-timed in place (pipeline `_time_stage`; VGG-16's FC stage
    timed alone read ~1.5x its in-pipeline time on an H200, cause not found).
    input_grad: whether training computes the gradient of x (not before the model's first
    parameter: the input gradient of the first convolution, which training never computes,
    over-rated the first stage)."""
    module, saved, out = layer.module, _SavedTensors(), x
    start = 0.0
    for rep in range(reps + 1):
        inp = x.detach().requires_grad_(train and input_grad and x.is_floating_point())
        if rep == 1:
            _sync(device)
            start = time.perf_counter()
        watch = (
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
            if rep == 0
            else nullcontext()
        )
        with torch.set_grad_enabled(train), autocast(), watch:
            out = module(inp)
        if train and out.requires_grad:
            out.backward(torch.ones_like(out))
        if rep == 0:
            params = {_storage(p) for p in module.parameters()}
            kept = {ptr: n for ptr, n in saved.storages.items() if ptr not in params}
            inp_ptr, out_ptr = _storage(inp), _storage(out)
    _sync(device)
    seconds = (time.perf_counter() - start) / max(reps, 1)
    profile = LayerProfile(
        layer.name,
        seconds,
        sum(p.numel() * p.element_size() for p in module.parameters()),
        out.numel() * out.element_size(),
        x.numel() * x.element_size(),
        saved_input=inp_ptr in kept,
        saved_output=out_ptr in kept,
        saved_other=sum(n for ptr, n in kept.items() if ptr not in (inp_ptr, out_ptr)),
        view=out_ptr == inp_ptr,
    )
    return profile, out.detach()


def profile_layers(
    layers: Sequence[Layer],
    x: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
    train: bool,
    autocast,
    reps: int = 2,
    channels_last: bool = False,
) -> list[LayerProfile]:
    """Measure each layer on micro-batch x (already prepared, on device), moving one layer at
    a time onto the device and back, so a model too large for one device can be measured.
    channels_last: the layout the stages will run in (cuDNN picks other kernels for NHWC
    weights, so a layer timed in NCHW misleads the balance). Every layer's state (parameters,
    buffers, gradients) and the RNG are restored after its measurement."""
    out, grad_flows = [], False  # no gradient reaches a layer before the first parameter
    for layer in layers:
        # kept_state: BatchNorm's running statistics and batch count, the RNG (dropout) and
        # any gradients are as before (values; the module stays in dtype on the host)
        with kept_state([layer.module]):
            layer.module.to(device=device, dtype=dtype).train(train)
            if channels_last:
                layer.module.to(memory_format=torch.channels_last)
            profile, x = _measure_layer(
                layer, x, train, autocast, device, reps, input_grad=grad_flows
            )
            grad_flows = grad_flows or any(p.requires_grad for p in layer.module.parameters())
            out.append(profile)
            layer.module.to("cpu")
    return out


MEM_LIMIT_ENV = "SCALELAB_GPU_MEM_LIMIT"  # bytes: cap each process's CUDA allocator below the GPU


def env_mem_limit() -> float | None:
    """The GPU memory cap in bytes from SCALELAB_GPU_MEM_LIMIT (None when unset): `scalelab fit
    --mem-limit` sets it for the pipeline it launches, so an H200 can play a smaller GPU."""
    value = os.environ.get(MEM_LIMIT_ENV)
    return float(value) if value else None


def cap_allocator(device: torch.device, limit_bytes: float | None) -> None:
    """Make the CUDA caching allocator raise OutOfMemoryError beyond limit_bytes."""
    if device.type == "cuda" and limit_bytes is not None:
        # The allocator API wants an index: "cuda" alone means the current device.
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(limit_bytes / total, 1.0), index)


HEADROOM = 0.9  # of a device's memory for the modelled bytes: workspaces, buffers, fragmentation


def device_capacity(device: torch.device, limit_bytes: float | None = None) -> float | None:
    """Bytes the memory model may fill on one stage's device: HEADROOM of its memory, or of
    limit_bytes where the allocator was capped below it; None on CPU unless limited."""
    if device.type != "cuda":
        return None if limit_bytes is None else HEADROOM * limit_bytes
    total = float(torch.cuda.get_device_properties(device).total_memory)
    return HEADROOM * min(total, limit_bytes or total)
