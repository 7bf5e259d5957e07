"""ResNet-18 (He, Zhang, Ren & Sun 2015, "Deep Residual Learning for Image Recognition", Table 1)
on CIFAR-10-shaped inputs, written here with torchvision's module names (conv1, bn1,
layer1.0.conv1, ..., layer2.0.downsample.0, fc) so a torchvision state_dict loads unchanged.

resnet18        the ImageNet layout: 7x7/2 stem conv + 3x3/2 max-pool; a 32x32 image is 8x8
                entering layer1 and 1x1 leaving layer4 (torchvision.models.resnet18).
resnet18-cifar  the usual CIFAR variant: 3x3/1 stem conv, no max-pool; 32x32 stays 32x32 into
                layer1 and leaves layer4 at 4x4, 15x the FLOPs for the same parameters.

Four stages of two BasicBlocks (64, 128, 256, 512 channels; first-block strides 1, 2, 2, 2); a
block whose shape changes takes a 1x1 strided conv + BN on its shortcut. Convs carry no bias
(BN follows). FLOPs count multiply and add separately (2 * MACs), as torch.utils.flop_counter.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from scalelab.data.cifar import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    load_cifar10,
    lookup_pixels,
    lookup_pixels_np,
    pixel_table,
)
from scalelab.errors import UsageError
from scalelab.oracle import ops
from scalelab.workloads.base import (
    WORKLOADS,
    Inputs,
    LayerCost,
    Workload,
    conv_cost,
    elementwise_cost,
)
from scalelab.workloads.layers import Layer, MatchDtype, describe

NATIVE_SIZE = 32  # CIFAR-10 images
NATIVE_CLASSES = 10
STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))  # (channels, stride of the stage's first block)
BLOCKS_PER_STAGE = 2  # ResNet-18: [2, 2, 2, 2]
BN_FLOPS_PER_ELEM = 2  # inference batch norm folds to x * scale + shift
# (3, 256) float32: (v / 255 - mean) / std per channel, the same bits on every device.
PIXELS = pixel_table(CIFAR10_MEAN, CIFAR10_STD)


@dataclass(frozen=True)
class Stem:
    """The first conv (3 -> 64, square kernel) and whether a 3x3/2 pad-1 max-pool follows."""

    kernel: int
    stride: int
    pad: int
    maxpool: bool


IMAGENET_STEM = Stem(kernel=7, stride=2, pad=3, maxpool=True)
CIFAR_STEM = Stem(kernel=3, stride=1, pad=1, maxpool=False)


def _out(size: int, kernel: int, stride: int, pad: int) -> int:
    """Floor-mode output size of a conv or pool, as torch computes it."""
    return (size + 2 * pad - kernel) // stride + 1


def _blocks() -> Iterator[tuple[str, int, int, int]]:
    """(module prefix, c_in, c_out, stride) of the 8 BasicBlocks in execution order."""
    c_in = 64
    for i, (c_out, stride) in enumerate(STAGES, start=1):
        for j in range(BLOCKS_PER_STAGE):
            yield f"layer{i}.{j}", c_in, c_out, stride if j == 0 else 1
            c_in = c_out


def _conv3x3(c_in: int, c_out: int, stride: int) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), torchvision's BasicBlock."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv3x3(c_in, c_out, stride)  # 2 * c_out * c_in * 9 * Ho * Wo
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()  # used twice, as in torchvision
        self.conv2 = _conv3x3(c_out, c_out, 1)  # 2 * c_out * c_out * 9 * Ho * Wo
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            # Projection shortcut ("option B" of the paper): 2 * c_out * c_in * Ho * Wo.
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet-18; forward takes prepare()'s normalised float images, returns logits (N, K)."""

    def __init__(self, num_classes: int, stem: Stem) -> None:
        super().__init__()
        k = stem.kernel
        self.conv1 = nn.Conv2d(3, 64, k, stride=stem.stride, padding=stem.pad, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        # The CIFAR variant keeps the attribute (as nn.Identity) so the state_dict keys and the
        # module tree stay torchvision's.
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1) if stem.maxpool else nn.Identity()
        c_in = 64
        for i, (c_out, stride) in enumerate(STAGES, start=1):
            blocks = [BasicBlock(c_in, c_out, stride)]
            blocks += [BasicBlock(c_out, c_out, 1) for _ in range(BLOCKS_PER_STAGE - 1)]
            self.add_module(f"layer{i}", nn.Sequential(*blocks))
            c_in = c_out
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)  # 2 * 512 * K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes at 32x32 for resnet18 [resnet18-cifar]. prepare() hands over float32; an
        # fp64 model needs fp64 inputs.
        x = x.to(self.conv1.weight.dtype)  # (N, 3, 32, 32)
        x = self.relu(self.bn1(self.conv1(x)))  # (N, 64, 16, 16) [(N, 64, 32, 32)]
        x = self.maxpool(x)  # (N, 64, 8, 8) [unchanged]
        x = self.layer1(x)  # (N, 64, 8, 8) [(N, 64, 32, 32)]
        x = self.layer2(x)  # (N, 128, 4, 4) [(N, 128, 16, 16)]
        x = self.layer3(x)  # (N, 256, 2, 2) [(N, 256, 8, 8)]
        x = self.layer4(x)  # (N, 512, 1, 1) [(N, 512, 4, 4)]
        return self.fc(torch.flatten(self.avgpool(x), 1))  # (N, K)


@WORKLOADS.register(
    "resnet18", "ResNet-18 (torchvision layout), 32x32x3 CIFAR-10 -> 10 classes (~0.08 GFLOP/image)"
)
class ResNet18(Workload):
    name = "resnet18"
    item = "images"
    reads = ("image", "classes")
    stem = IMAGENET_STEM

    native_size = NATIVE_SIZE
    native_classes = NATIVE_CLASSES

    def _build(self) -> nn.Module:
        return ResNet(self.num_classes, self.stem)

    # --- inputs --------------------------------------------------------------------------
    def synthetic_inputs(self, n: int, seed: int) -> Inputs:
        """Uniform noise pixels (N, 3, S, S) uint8 and uniform labels in 0..K-1."""
        gen = torch.Generator().manual_seed(seed)
        s = self.image_size
        x = torch.randint(0, 256, (n, 3, s, s), generator=gen, dtype=torch.uint8)
        y = torch.randint(0, self.num_classes, (n,), generator=gen, dtype=torch.int64)
        return Inputs(x, y)

    def real_inputs(self, n: int) -> Inputs:
        if self.image_size != NATIVE_SIZE:
            raise UsageError(f"CIFAR-10 images are 32x32; drop --image-size {self.image_size}")
        if self.num_classes < 10:
            raise UsageError(f"CIFAR-10 has 10 classes; --num-classes {self.num_classes} is short")
        x, y = load_cifar10(self.cfg.data_dir, n)
        return Inputs(x, y)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 -> float32 (x / 255 - mean) / std per channel, CIFAR-10's statistics, by
        table lookup (see pixel_table: bit-identical on every device)."""
        return lookup_pixels(PIXELS, x)

    # --- layers (the cost table derives from them) -------------------------------------
    def layers(self, model: nn.Module) -> list[Layer]:
        return resnet_layers(model)

    # --- oracle --------------------------------------------------------------------------
    def reference_forward(self, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        st = self.stem
        h = lookup_pixels_np(PIXELS, x)  # prepare()'s float32 values, widened
        h = ops.conv2d(h, params["conv1.weight"], None, stride=st.stride, pad=st.pad)
        h = ops.relu(_bn_np(params, "bn1", h))
        if st.maxpool:
            h = ops.maxpool2d(h, 3, 2, pad=1)  # padding counts as -inf, as torch
        for prefix, _, _, stride in _blocks():
            h = _block_np(params, prefix, h, stride)
        return ops.linear(ops.avgpool_global(h), params["fc.weight"], params["fc.bias"])


@WORKLOADS.register(
    "resnet18-cifar",
    "ResNet-18, CIFAR variant (3x3/1 stem, no max-pool), 32x32x3 -> 10 classes (~1.1 GFLOP/image)",
)
class ResNet18Cifar(ResNet18):
    name = "resnet18-cifar"
    stem = CIFAR_STEM


def resnet_layers(model: nn.Module) -> list[Layer]:
    """ResNet.forward as layers: cast, the stem (conv1, bn1, relu, maxpool unless the CIFAR
    variant's Identity), the 8 BasicBlocks whole (kind "block": a residual reaches around its
    convs, so it is neither cut inside nor split spatially), avgpool, flatten, fc."""
    out = [describe("cast", MatchDtype())]
    out += [describe(n, getattr(model, n), n) for n in ("conv1", "bn1", "relu")]
    if isinstance(model.maxpool, nn.MaxPool2d):
        out.append(describe("maxpool", model.maxpool, "maxpool"))
    for prefix, _, _, stride in _blocks():
        block = model.get_submodule(prefix)
        cost = functools.partial(_block_rows, prefix, stride)
        out.append(describe(prefix, block, prefix, kind="block", cost=cost))
    out.append(describe("avgpool", model.avgpool, "avgpool"))
    return out + [describe("flatten", nn.Flatten()), describe("fc", model.fc, "fc")]


def _block_rows(prefix: str, stride: int, in_shape: tuple, out_shape: tuple) -> list[LayerCost]:
    return _block_cost(prefix, in_shape[0], out_shape[0], stride, in_shape[1])[0]


def _bn_cost(name: str, c: int, size: int) -> LayerCost:
    """Inference BN: 2 FLOPs per element; params are the learnable gamma and beta (2 * C)."""
    return elementwise_cost(name, "batchnorm", (c, size, size), BN_FLOPS_PER_ELEM, params=2 * c)


def _block_cost(
    prefix: str, c_in: int, c_out: int, stride: int, s_in: int
) -> tuple[list[LayerCost], int]:
    """Rows of one BasicBlock in forward order, and its output size."""
    s = _out(s_in, 3, stride, 1)
    shape = (c_out, s, s)

    def conv(name: str, c: int, size: int, kernel: int) -> LayerCost:
        return conv_cost(name, name, c, (size, size), c_out, (kernel, kernel), (s, s), bias=False)

    rows = [
        conv(f"{prefix}.conv1", c_in, s_in, 3),
        _bn_cost(f"{prefix}.bn1", c_out, s),
        elementwise_cost(f"{prefix}.relu1", "relu", shape),
        conv(f"{prefix}.conv2", c_out, s, 3),
        _bn_cost(f"{prefix}.bn2", c_out, s),
    ]
    if stride != 1 or c_in != c_out:
        rows.append(conv(f"{prefix}.downsample.0", c_in, s_in, 1))
        rows.append(_bn_cost(f"{prefix}.downsample.1", c_out, s))
    n = c_out * s * s
    rows.append(LayerCost(f"{prefix}.add", "add", shape, 0, n, 2 * n, n))  # reads two operands
    rows.append(elementwise_cost(f"{prefix}.relu2", "relu", shape))
    return rows, s


def _bn_np(params: dict[str, np.ndarray], name: str, h: np.ndarray) -> np.ndarray:
    mean, var = params[f"{name}.running_mean"], params[f"{name}.running_var"]
    return ops.batchnorm_eval(h, mean, var, params[f"{name}.weight"], params[f"{name}.bias"])


def _block_np(params: dict[str, np.ndarray], prefix: str, x: np.ndarray, stride: int) -> np.ndarray:
    """One BasicBlock in float64 NumPy; the shortcut is projected where the block has one."""
    h = ops.conv2d(x, params[f"{prefix}.conv1.weight"], None, stride=stride, pad=1)
    h = ops.relu(_bn_np(params, f"{prefix}.bn1", h))
    h = ops.conv2d(h, params[f"{prefix}.conv2.weight"], None, stride=1, pad=1)
    h = _bn_np(params, f"{prefix}.bn2", h)
    if f"{prefix}.downsample.0.weight" in params:
        x = ops.conv2d(x, params[f"{prefix}.downsample.0.weight"], None, stride=stride)
        x = _bn_np(params, f"{prefix}.downsample.1", x)
    return ops.relu(h + x)
