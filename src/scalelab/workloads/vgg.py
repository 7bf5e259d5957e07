"""VGG-16, configuration D of Simonyan & Zisserman 2014 ("Very Deep Convolutional Networks for
Large-Scale Image Recognition", Table 1), with torchvision's module names (features.N,
classifier.N) so a torchvision vgg16 state_dict loads unchanged.

13 convolutions 3x3/1 pad 1, each + ReLU, in five blocks closed by a 2x2/2 max-pool, then
fc6 (512*s*s -> 4096) + ReLU + dropout, fc7 (4096 -> 4096) + ReLU + dropout, fc8 (-> classes).
s = S // 32 for an S x S input: 7 at the native 224 (25088 into fc6), 1 at CIFAR's 32. Unlike
torchvision there is no adaptive 7x7 average pool before fc6 (at 224 it is the identity), so
small images give a small fc6 instead of a 49-fold replicated one.
FLOPs count multiply and add separately (2 * MACs), as torch.utils.flop_counter does.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from scalelab.data.cifar import lookup_pixels, lookup_pixels_np, pixel_table
from scalelab.errors import UsageError
from scalelab.oracle import ops
from scalelab.workloads.base import (
    WORKLOADS,
    Inputs,
    Workload,
)
from scalelab.workloads.layers import Layer, MatchDtype, describe

NATIVE_SIZE = 224
NATIVE_CLASSES = 1000
FC_WIDTH = 4096
MIN_SIZE = 32  # five 2x2/2 pools: 2**5
DROPOUT = 0.5  # the paper's, on fc6 and fc7 (identity in eval mode)
# Configuration D: output channels of each 3x3 conv, "M" a 2x2/2 max-pool.
CFG_D = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
# ImageNet per-channel statistics of pixels in [0, 1] (torchvision's ImageNet transforms).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
PIXELS = pixel_table(IMAGENET_MEAN, IMAGENET_STD)  # (3, 256) float32, same bits everywhere
# classifier.N indices, as torchvision: Linear, ReLU, Dropout, Linear, ReLU, Dropout, Linear.
FC6, FC7, FC8 = "classifier.0", "classifier.3", "classifier.6"


def _trunk() -> Iterator[tuple[str, int, int | None]]:
    """(paper name, index in `features`, out channels or None for a pool) in execution order.

    Each conv occupies two slots of `features` (conv, ReLU), each pool one, as in torchvision:
    conv1_1 is features.0, pool1 features.4, ..., conv5_3 features.28, pool5 features.30.
    """
    index, block, conv = 0, 1, 0
    for v in CFG_D:
        if v == "M":
            yield f"pool{block}", index, None
            index, block, conv = index + 1, block + 1, 0
        else:
            conv += 1
            yield f"conv{block}_{conv}", index, int(v)
            index += 2


class VGG(nn.Module):
    """VGG-16; forward takes prepare()'s normalised float images and returns logits (N, K).

    swap_relu_pool: each block's last ReLU runs after its max-pool instead of before. They
    commute (max is monotone, ReLU is max(., 0)), so the output is identical, and the ReLU
    then reads and writes a quarter of the activations.
    """

    def __init__(self, fc6_in: int, num_classes: int, swap_relu_pool: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for _, _, c_out in _trunk():
            if c_out is None:
                layers.append(nn.MaxPool2d(2, stride=2))
            else:
                # 2 * c_out * c_in * 9 * S * S at this block's resolution S.
                layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
                c_in = c_out
        if swap_relu_pool:  # features.{i-1}, features.{i}: ReLU, pool -> pool, ReLU (no params)
            for i, layer in enumerate(layers):
                if isinstance(layer, nn.MaxPool2d):
                    layers[i - 1], layers[i] = layer, layers[i - 1]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(fc6_in, FC_WIDTH),  # fc6: 2 * 25088 * 4096 = 205.5 M at 224
            nn.ReLU(),
            nn.Dropout(DROPOUT),
            nn.Linear(FC_WIDTH, FC_WIDTH),  # fc7: 2 * 4096 * 4096 = 33.6 M
            nn.ReLU(),
            nn.Dropout(DROPOUT),
            nn.Linear(FC_WIDTH, num_classes),  # fc8: 2 * 4096 * K = 8.2 M for K = 1000
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # prepare() hands over float32; an fp64 model needs fp64 inputs.
        x = x.to(self.classifier[0].weight.dtype)  # (N, 3, 224, 224)
        x = self.features(x)  # (N, 512, 7, 7): 224 -> 112 -> 56 -> 28 -> 14 -> 7
        x = torch.flatten(x, 1)  # (N, 25088), channel-major
        return self.classifier(x)  # (N, K)


@WORKLOADS.register("vgg16", "VGG-16 (config D), 224x224x3 -> 1000 classes (~31 GFLOP/image)")
class VGG16(Workload):
    name = "vgg16"
    item = "images"
    reads = ("image", "classes", "swap")

    native_size = NATIVE_SIZE
    native_classes = NATIVE_CLASSES

    def validate(self) -> None:
        if self.image_size < MIN_SIZE:
            raise UsageError(
                f"vgg16 needs --image-size >= {MIN_SIZE}, got {self.image_size}: "
                "its five 2x2 max-pools leave an empty map before fc6"
            )
        if self.num_classes < 1:
            raise UsageError(f"--num-classes must be >= 1, got {self.num_classes}")

    def fc6_in(self) -> int:
        """fc6 input width 512 * s * s, s = S // 32 (floor-mode pools): 25088 at 224."""
        return 512 * (self.image_size // MIN_SIZE) ** 2

    def _build(self) -> nn.Module:
        return VGG(self.fc6_in(), self.num_classes, self.cfg.swap_relu_pool)

    # --- inputs --------------------------------------------------------------------------
    def synthetic_inputs(self, n: int, seed: int) -> Inputs:
        """Uniform noise pixels (N, 3, S, S) uint8 and uniform labels in 0..K-1."""
        gen = torch.Generator().manual_seed(seed)
        s = self.image_size
        x = torch.randint(0, 256, (n, 3, s, s), generator=gen, dtype=torch.uint8)
        y = torch.randint(0, self.num_classes, (n,), generator=gen, dtype=torch.int64)
        return Inputs(x, y)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 -> float32 (x / 255 - mean) / std per channel, ImageNet statistics, by table
        lookup (see pixel_table: bit-identical on every device)."""
        return lookup_pixels(PIXELS, x)

    # --- layers (the cost table derives from them) -------------------------------------
    def layers(self, model: nn.Module) -> list[Layer]:
        return vgg_layers(model)

    # --- oracle --------------------------------------------------------------------------
    def reference_forward(self, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        h = lookup_pixels_np(PIXELS, x)  # prepare()'s float32 values, widened
        for _, index, c_out in _trunk():
            if c_out is None:
                h = ops.maxpool2d(h, 2, 2)
            else:
                w, b = params[f"features.{index}.weight"], params[f"features.{index}.bias"]
                h = ops.relu(ops.conv2d(h, w, b, stride=1, pad=1))
        h = h.reshape(h.shape[0], -1)  # (N, 512*s*s), channel-major as torch.flatten
        h = ops.relu(ops.linear(h, params[f"{FC6}.weight"], params[f"{FC6}.bias"]))
        h = ops.relu(ops.linear(h, params[f"{FC7}.weight"], params[f"{FC7}.bias"]))
        return ops.linear(h, params[f"{FC8}.weight"], params[f"{FC8}.bias"])


def vgg_layers(model: nn.Module) -> list[Layer]:
    """VGG.forward as layers named as in the paper: cast, conv1_1, relu1_1, ..., pool5 (in
    the model's order, which --swap-relu-pool already changed), flatten, fc6, relu6, drop6, ...,
    fc8; paths are torchvision's features.N / classifier.N."""
    out, block, conv, last = [describe("cast", MatchDtype())], 1, 0, ""
    for i, m in enumerate(model.features):
        if isinstance(m, nn.Conv2d):
            conv += 1
            last = f"{block}_{conv}"
            name = f"conv{last}"
        elif isinstance(m, nn.ReLU):
            name = f"relu{last}"  # the ReLU of the last conv, before or after its pool
        else:
            name, block, conv = f"pool{block}", block + 1, 0
        out.append(describe(name, m, f"features.{i}"))
    out.append(describe("flatten", nn.Flatten()))
    names = ("fc6", "relu6", "drop6", "fc7", "relu7", "drop7", "fc8")
    out += [
        describe(n, m, f"classifier.{i}") for i, (n, m) in enumerate(zip(names, model.classifier))
    ]
    return out
