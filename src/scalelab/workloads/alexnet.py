"""AlexNet inference (Krizhevsky, Sutskever & Hinton 2012), the single-tower network.

227x227x3 -> five convolutions (c1..c5) with ReLU, LRN after c1 and c2, max-pools after
c1, c2 and c5 -> three fully connected layers (fc6..fc8) -> logits. No dropout (inference),
no grouped convolutions (the paper's two GPU towers merged: ~2.3 GFLOP, 62.4 M params).
FLOPs count multiply and add separately (2 * MACs), as torch.utils.flop_counter does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from scalelab.errors import UsageError
from scalelab.oracle import ops
from scalelab.workloads.base import (
    WORKLOADS,
    Inputs,
    LayerCost,
    Workload,
    elementwise_cost,
)
from scalelab.workloads.layers import Layer, MatchDtype, describe

NATIVE_SIZE = 227
NATIVE_CLASSES = 1000
FC_WIDTH = 4096

# LRN(5) with torch's (and Caffe's) convention: the denominator uses alpha / size.
LRN_SIZE, LRN_ALPHA, LRN_BETA, LRN_K = 5, 1e-4, 0.75, 2.0
# Per element: square, size-1 adds of the window, * alpha/size, + k, ** beta, divide.
LRN_FLOPS_PER_ELEM = LRN_SIZE + 4
# Per logit: subtract max, exp, add to the sum, divide (the max scan adds one compare).
SOFTMAX_FLOPS_PER_ELEM = 5


@dataclass(frozen=True)
class TrunkLayer:
    """One step of the convolution trunk, as a height-wise domain decomposition sees it.

    kernel, stride and pad are spatial and square. ReLU and LRN act pointwise in space
    (kernel 1): LRN's 5-wide window runs across channels, so it needs no halo rows.
    """

    name: str  # c1, relu1, lrn1, pool1, ... (the model's attribute name for conv/lrn)
    kind: str  # conv, relu, lrn, maxpool
    kernel: int
    stride: int
    pad: int
    out_channels: int

    def out_size(self, size: int) -> int:
        """Output height (= width) for input height `size`: floor mode, as torch."""
        return (size + 2 * self.pad - self.kernel) // self.stride + 1


# The trunk in execution order: (name, kind, kernel, stride, pad, out_channels).
TRUNK: tuple[TrunkLayer, ...] = (
    TrunkLayer("c1", "conv", 11, 4, 0, 96),  # (N, 96, 55, 55)
    TrunkLayer("relu1", "relu", 1, 1, 0, 96),
    TrunkLayer("lrn1", "lrn", 1, 1, 0, 96),
    TrunkLayer("pool1", "maxpool", 3, 2, 0, 96),  # (N, 96, 27, 27)
    TrunkLayer("c2", "conv", 5, 1, 2, 256),  # (N, 256, 27, 27)
    TrunkLayer("relu2", "relu", 1, 1, 0, 256),
    TrunkLayer("lrn2", "lrn", 1, 1, 0, 256),
    TrunkLayer("pool2", "maxpool", 3, 2, 0, 256),  # (N, 256, 13, 13)
    TrunkLayer("c3", "conv", 3, 1, 1, 384),  # (N, 384, 13, 13)
    TrunkLayer("relu3", "relu", 1, 1, 0, 384),
    TrunkLayer("c4", "conv", 3, 1, 1, 384),  # (N, 384, 13, 13)
    TrunkLayer("relu4", "relu", 1, 1, 0, 384),
    TrunkLayer("c5", "conv", 3, 1, 1, 256),  # (N, 256, 13, 13)
    TrunkLayer("relu5", "relu", 1, 1, 0, 256),
    TrunkLayer("pool5", "maxpool", 3, 2, 0, 256),  # (N, 256, 6, 6)
)


def trunk_out_size(size: int) -> int:
    """Height (= width) of the trunk's final map for a size x size input (<= 0: empty)."""
    for layer in TRUNK:
        size = max(0, layer.out_size(size))
    return size


def min_image_size() -> int:
    """Smallest input whose trunk leaves a 1x1 map (67).

    Walks the trunk backwards: `out` output rows need (out - 1) * stride + kernel - 2 * pad
    input rows, the exact inverse of floor-mode out_size.
    """
    size = 1
    for layer in reversed(TRUNK):
        size = max(1, (size - 1) * layer.stride + layer.kernel - 2 * layer.pad)
    return size


class AlexNetModule(nn.Module):
    """The network; forward takes prepare()'s float images and returns logits (N, classes).

    swap_relu_pool: pool5 before relu5 (they commute: identical output, the ReLU reads a
    quarter of the map). relu1/relu2 stay put: an LRN sits between them and their pools, and
    LRN does not commute with ReLU.
    """

    def __init__(self, fc6_in: int, num_classes: int, swap_relu_pool: bool = False) -> None:
        super().__init__()
        self.swap_relu_pool = swap_relu_pool
        # FLOPs at 227: 2 * C_out * C_in * R * S * Ho * Wo.
        self.c1 = nn.Conv2d(3, 96, 11, stride=4)  # 2*96*3*11*11*55*55    = 211 M
        self.lrn1 = nn.LocalResponseNorm(LRN_SIZE, LRN_ALPHA, LRN_BETA, LRN_K)
        self.c2 = nn.Conv2d(96, 256, 5, padding=2)  # 2*256*96*5*5*27*27  = 896 M
        self.lrn2 = nn.LocalResponseNorm(LRN_SIZE, LRN_ALPHA, LRN_BETA, LRN_K)
        self.c3 = nn.Conv2d(256, 384, 3, padding=1)  # 2*384*256*3*3*13*13 = 299 M
        self.c4 = nn.Conv2d(384, 384, 3, padding=1)  # 2*384*384*3*3*13*13 = 449 M
        self.c5 = nn.Conv2d(384, 256, 3, padding=1)  # 2*256*384*3*3*13*13 = 299 M
        # FLOPs: 2 * n_in * n_out.
        self.fc6 = nn.Linear(fc6_in, FC_WIDTH)  # 2*9216*4096 = 75.5 M
        self.fc7 = nn.Linear(FC_WIDTH, FC_WIDTH)  # 2*4096*4096 = 33.6 M
        self.fc8 = nn.Linear(FC_WIDTH, num_classes)  # 2*4096*1000 = 8.2 M

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # prepare() hands over float32; an fp64 model needs fp64 inputs (autocast still
        # lowers the convolutions, since the weights stay fp32 there).
        x = x.to(self.c1.weight.dtype)  # (N, 3, 227, 227)
        x = F.max_pool2d(self.lrn1(F.relu(self.c1(x))), 3, 2)  # (N, 96, 27, 27)
        x = F.max_pool2d(self.lrn2(F.relu(self.c2(x))), 3, 2)  # (N, 256, 13, 13)
        x = F.relu(self.c3(x))  # (N, 384, 13, 13)
        x = F.relu(self.c4(x))  # (N, 384, 13, 13)
        if self.swap_relu_pool:
            x = F.relu(F.max_pool2d(self.c5(x), 3, 2))  # (N, 256, 6, 6)
        else:
            x = F.max_pool2d(F.relu(self.c5(x)), 3, 2)  # (N, 256, 6, 6)
        x = torch.flatten(x, 1)  # (N, 9216), channel-major
        x = F.relu(self.fc6(x))  # (N, 4096)
        x = F.relu(self.fc7(x))  # (N, 4096)
        return self.fc8(x)  # (N, classes); softmax left to the loss / the reader


@WORKLOADS.register("alexnet", "AlexNet inference, 227x227x3 -> 1000 classes (~2.3 GFLOP/image)")
class AlexNet(Workload):
    name = "alexnet"
    item = "images"
    reads = ("image", "classes", "swap")

    native_size = NATIVE_SIZE
    native_classes = NATIVE_CLASSES

    def validate(self) -> None:
        if trunk_out_size(self.image_size) < 1:
            raise UsageError(
                f"alexnet needs --image-size >= {min_image_size()}, got {self.image_size}: "
                "smaller images leave an empty feature map before fc6"
            )
        if self.num_classes < 1:
            raise UsageError(f"--num-classes must be >= 1, got {self.num_classes}")

    def trunk_layers(self) -> list[TrunkLayer]:
        """The convolution trunk (c1 .. pool5) in execution order, for halo planning."""
        return list(TRUNK)

    def fc6_in(self) -> int:
        """FC6 input width: 256 * s * s, s the final pooled size (6 at 227 -> 9216)."""
        return TRUNK[-1].out_channels * trunk_out_size(self.image_size) ** 2

    def _build(self) -> nn.Module:
        return AlexNetModule(self.fc6_in(), self.num_classes, self.cfg.swap_relu_pool)

    # --- inputs --------------------------------------------------------------------------
    def synthetic_inputs(self, n: int, seed: int) -> Inputs:
        """Uniform noise pixels (N, 3, S, S) uint8; no labels (inference)."""
        gen = torch.Generator().manual_seed(seed)
        s = self.image_size
        return Inputs(torch.randint(0, 256, (n, 3, s, s), generator=gen, dtype=torch.uint8))

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        # * (1/255), not / 255: CUDA turns a scalar division into a reciprocal multiply, so
        # only the multiply gives the same float32 bits on CPU, CUDA and NumPy.
        return x.float() * (1 / 255)  # on x's device; the model casts to its own dtype

    # --- layers and cost model ---------------------------------------------------------
    def layers(self, model: nn.Module) -> list[Layer]:
        return alexnet_layers(model)

    def tail_costs(self) -> list[LayerCost]:
        k = self.num_classes
        return [elementwise_cost("softmax", "softmax", (k,), SOFTMAX_FLOPS_PER_ELEM)]

    # --- oracle --------------------------------------------------------------------------
    def reference_forward(self, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        # Start from prepare()'s float32 pixels, not the exact x/255: every strategy sees
        # those rounded values, and the 6e-8 input rounding would swamp an fp64 comparison.
        h = (np.asarray(x).astype(np.float32) * np.float32(1 / 255)).astype(np.float64)
        for layer in TRUNK:
            h = _reference_step(layer, params, h)
        h = h.reshape(h.shape[0], -1)  # (N, 256*s*s), channel-major as torch.flatten
        h = ops.relu(ops.linear(h, params["fc6.weight"], params["fc6.bias"]))
        h = ops.relu(ops.linear(h, params["fc7.weight"], params["fc7.bias"]))
        return ops.linear(h, params["fc8.weight"], params["fc8.bias"])


def _trunk_layer(model: nn.Module, t: TrunkLayer) -> Layer:
    """The Layer of one TRUNK entry: the model's conv / LRN, or the ReLU / max-pool its
    forward calls functionally."""
    if t.kind in ("conv", "lrn"):
        return describe(t.name, getattr(model, t.name), t.name)
    if t.kind == "maxpool":
        return describe(t.name, nn.MaxPool2d(t.kernel, t.stride, t.pad))
    return describe(t.name, nn.ReLU())


def alexnet_layers(model: nn.Module) -> list[Layer]:
    """AlexNetModule.forward as layers: cast, c1 .. pool5 (pool5 before relu5 when the model
    swaps them), flatten, fc6 .. fc8. The one place besides the forward that knows the swap."""
    trunk = [_trunk_layer(model, t) for t in TRUNK]
    if getattr(model, "swap_relu_pool", False):  # c5 -> pool5 -> relu5
        trunk[-2], trunk[-1] = trunk[-1], trunk[-2]
    head = [describe(n, getattr(model, n), n) for n in ("fc6", "fc7", "fc8")]
    return [
        describe("cast", MatchDtype()),
        *trunk,
        describe("flatten", nn.Flatten()),
        head[0],
        describe("relu6", nn.ReLU()),
        head[1],
        describe("relu7", nn.ReLU()),
        head[2],
    ]


def _reference_step(layer: TrunkLayer, params: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    """One trunk layer in float64 NumPy, from its TrunkLayer spec."""
    if layer.kind == "conv":
        w, b = params[f"{layer.name}.weight"], params[f"{layer.name}.bias"]
        return ops.conv2d(h, w, b, stride=layer.stride, pad=layer.pad)
    if layer.kind == "relu":
        return ops.relu(h)
    if layer.kind == "lrn":
        return ops.lrn(h, LRN_SIZE, LRN_ALPHA, LRN_BETA, LRN_K)
    if layer.kind == "maxpool":
        return ops.maxpool2d(h, layer.kernel, layer.stride, layer.pad)
    raise ValueError(f"unknown trunk layer kind {layer.kind!r}")
