"""A deep synthetic stack of identical layers, for finding where a model stops fitting one GPU
and for splitting layers across GPUs (the model-parallel seed, Task 1).

    input (N, C, S, S)                 seed: inpSize = (16, 64, 112, 112), so C = 64, S = 112
    conv1 .. conv{convs}: C -> C, 3x3/1 pad 1, + ReLU      2 * C * C * 9 * S * S FLOPs each
    pool: global average over S x S -> (N, C)
    proj: C -> F + ReLU                bridges the conv stack to the linear stack
    fc1 .. fc{fcs}: F -> F, + ReLU     2 * F * F FLOPs, F * (F + 1) params each
    classifier: F -> K

The seed does not print its linear width; F = 4096 is the fully connected width of the seed's
own layer table (nn.Linear(512 * 7 * 7, 4096), VGG-16's classifier). With it one linear layer
holds 16.8 M parameters (64 MiB in fp32) and one conv 36,928, while one conv's activations at the
seed's batch 16 take 16 * 64 * 112 * 112 * 4 B = 49 MiB: parameters dominate the linear stack,
activations the conv stack, the two sides of the seed's 61/62 conv/fc out-of-memory table.
K defaults to 1000 (the seed's VGG output classes). --image-size overrides S.

The model is one flat nn.Sequential with named children (cast, conv1, conv1_relu, ...,
classifier), so a pipeline split can cut it anywhere by slicing, and the names in the cost table
are the module paths.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from scalelab.data.cifar import lookup_pixels, lookup_pixels_np, pixel_table
from scalelab.oracle import ops
from scalelab.workloads.base import (
    WORKLOADS,
    Inputs,
    Workload,
)
from scalelab.workloads.layers import MatchDtype

CHANNELS = 64  # seed inpSize (16, 64, 112, 112)
NATIVE_SIZE = 112
FC_WIDTH = 4096  # the seed's nn.Linear(512 * 7 * 7, 4096)
NATIVE_CLASSES = 1000
PIXELS = pixel_table((0.0,), (1.0,))  # (1, 256) float32: v / 255, same bits on every device


def build_deepstack(convs: int, fcs: int, num_classes: int) -> nn.Sequential:
    """cast, convs x (conv + ReLU), global pool, proj + ReLU, fcs x (linear + ReLU), classifier.

    A plain nn.Sequential, so slicing it (model[:k], model[k:]) gives runnable stages; the
    forward takes prepare()'s float input (N, C, S, S) and returns logits (N, K).
    """
    c, f = CHANNELS, FC_WIDTH
    layers: OrderedDict[str, nn.Module] = OrderedDict(cast=MatchDtype())
    for i in range(1, convs + 1):
        layers[f"conv{i}"] = nn.Conv2d(c, c, 3, padding=1)  # (N, C, S, S)
        layers[f"conv{i}_relu"] = nn.ReLU()
    layers["pool"] = nn.AdaptiveAvgPool2d(1)  # (N, C, 1, 1)
    layers["flatten"] = nn.Flatten()  # (N, C)
    layers["proj"] = nn.Linear(c, f)  # (N, F)
    layers["proj_relu"] = nn.ReLU()
    for i in range(1, fcs + 1):
        layers[f"fc{i}"] = nn.Linear(f, f)  # (N, F)
        layers[f"fc{i}_relu"] = nn.ReLU()
    layers["classifier"] = nn.Linear(f, num_classes)  # (N, K)
    return nn.Sequential(layers)


def random_bytes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Uniform uint8 of `shape`, drawn as int64 over their whole range and read as 8 bytes
    each: ~4x faster than randint(0, 256) on uint8, the same bits on every little-endian host."""
    count = math.prod(shape)
    words = torch.randint(-(2**63), 2**63 - 1, (-(-count // 8),), generator=gen, dtype=torch.int64)
    return words.view(torch.uint8)[:count].reshape(shape)


@WORKLOADS.register(
    "deepstack",
    "synthetic stack: --convs x conv 64->64 3x3 on 112x112, --fcs x linear 4096->4096 (fit/split)",
)
class DeepStackWorkload(Workload):
    name = "deepstack"
    item = "inputs"
    reads = ("image", "classes", "stack")

    native_size = NATIVE_SIZE
    native_classes = NATIVE_CLASSES
    # One item is 64 x 112 x 112 B = 0.8 MB of noise: the general 8000 + 2000 would be 8 GB
    # made on the root before the first step (minutes on a CPU, past gloo's timeout).
    native_split = (256, 64)

    def _build(self) -> nn.Module:
        return build_deepstack(self.cfg.convs, self.cfg.fcs, self.num_classes)

    # --- inputs --------------------------------------------------------------------------
    def synthetic_inputs(self, n: int, seed: int) -> Inputs:
        """Uniform noise (N, 64, S, S) as uint8 (a quarter of float32's bytes on the wire);
        uniform labels in 0..K-1."""
        gen = torch.Generator().manual_seed(seed)
        s = self.image_size
        x = random_bytes((n, CHANNELS, s, s), gen)
        y = torch.randint(0, self.num_classes, (n,), generator=gen, dtype=torch.int64)
        return Inputs(x, y)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 -> float32 x / 255 by table lookup (see pixel_table), on x's device."""
        return lookup_pixels(PIXELS, x)

    # The cost table derives from the nn.Sequential's children (Workload.layers): one row
    # per layer with its parameter count, so a fit estimate can sum params (weights, grads,
    # optimizer state) and out_elems (activations) per layer.

    # --- oracle --------------------------------------------------------------------------
    def reference_forward(self, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        h = lookup_pixels_np(PIXELS, x)  # prepare()'s float32 values, widened
        for i in range(1, self.cfg.convs + 1):
            w, b = params[f"conv{i}.weight"], params[f"conv{i}.bias"]
            h = ops.relu(ops.conv2d(h, w, b, stride=1, pad=1))
        h = ops.avgpool_global(h)  # (N, C)
        h = ops.relu(ops.linear(h, params["proj.weight"], params["proj.bias"]))
        for i in range(1, self.cfg.fcs + 1):
            h = ops.relu(ops.linear(h, params[f"fc{i}.weight"], params[f"fc{i}.bias"]))
        return ops.linear(h, params["classifier.weight"], params["classifier.bias"])
