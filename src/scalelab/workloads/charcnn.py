"""Zhang, Zhao & LeCun's small character-level CNN ("Character-level Convolutional Networks
for Text Classification", NIPS 2015), inference form, as in the seed's MPI + CUDA study.

    one-hot (N, 70, 1014) -> 6 conv blocks -> (N, 256, 34) -> flatten 8704 -> fc 1024, 1024, 4

The seed's variant normalises conv blocks 1 and 6 with a LayerNorm over the whole
(channels, length) map, elementwise gamma/beta of that shape; dropout is absent (inference).
Texts travel as uint8 alphabet indices (scalelab.data.agnews: alphabet, backwards encoding);
prepare() expands them to one-hot columns on the compute device, index 70 to a zero column.
About 0.743 GFLOP per text (0.741 in conv and linear layers), 75% of it in conv1 and conv2;
11.9 M parameters, 75% of them in fc1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scalelab.data import agnews
from scalelab.errors import UsageError
from scalelab.oracle import ops
from scalelab.workloads.base import (
    WORKLOADS,
    Inputs,
    Workload,
)
from scalelab.workloads.layers import Layer, describe

V = len(agnews.ALPHABET)  # 70 input channels, one per alphabet entry
L = agnews.LENGTH  # 1014 characters
C = 4  # AG News classes
FEATURES = 256  # conv channels ("small" model)
HIDDEN = 1024  # fc width ("small" model)
POOL = 3  # max-pool kernel = stride
# LayerNorm per element: add into the mean, subtract the mean, square, add into the variance,
# multiply by 1/sqrt(var + eps) (computed once per map, not counted), by gamma, add beta.
LAYERNORM_FLOPS = 7
# (conv, input length, kernel, LayerNorm after it, max-pool after it): the seed's conv blocks.
CONV_BLOCKS = (
    ("conv1", L, 7, "ln1", True),  # (70, 1014) -> (256, 1008) -> pool (256, 336)
    ("conv2", 336, 7, None, True),  # -> (256, 330) -> pool (256, 110)
    ("conv3", 110, 3, None, False),  # -> (256, 108)
    ("conv4", 108, 3, None, False),  # -> (256, 106)
    ("conv5", 106, 3, None, False),  # -> (256, 104)
    ("conv6", 104, 3, "ln6", True),  # -> (256, 102) -> pool (256, 34)
)
FLAT = FEATURES * 34  # 8704


class CharCNN(nn.Module):
    """The seed's conv_block_1..6 and fc_block_1..3; FLOPs per text next to each layer."""

    def __init__(self, classes: int = C) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(V, FEATURES, 7)  # (N, 256, 1008)  2*256*70*7*1008
        self.ln1 = nn.LayerNorm((FEATURES, 1008))  # gamma, beta (256, 1008)
        self.conv2 = nn.Conv1d(FEATURES, FEATURES, 7)  # (N, 256, 330)  2*256*256*7*330
        self.conv3 = nn.Conv1d(FEATURES, FEATURES, 3)  # (N, 256, 108)  2*256*256*3*108
        self.conv4 = nn.Conv1d(FEATURES, FEATURES, 3)  # (N, 256, 106)  2*256*256*3*106
        self.conv5 = nn.Conv1d(FEATURES, FEATURES, 3)  # (N, 256, 104)  2*256*256*3*104
        self.conv6 = nn.Conv1d(FEATURES, FEATURES, 3)  # (N, 256, 102)  2*256*256*3*102
        self.ln6 = nn.LayerNorm((FEATURES, 102))  # gamma, beta (256, 102)
        self.fc1 = nn.Linear(FLAT, HIDDEN)  # (N, 1024)  2*8704*1024
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)  # (N, 1024)  2*1024*1024
        self.fc3 = nn.Linear(HIDDEN, classes)  # (N, 4)  2*1024*4

    def forward(self, x: Tensor) -> Tensor:
        # x: (N, 70, 1014) one-hot characters, the end of the text first
        x = F.max_pool1d(F.relu(self.ln1(self.conv1(x))), POOL)  # (N, 256, 336)
        x = F.max_pool1d(F.relu(self.conv2(x)), POOL)  # (N, 256, 110)
        x = F.relu(self.conv3(x))  # (N, 256, 108)
        x = F.relu(self.conv4(x))  # (N, 256, 106)
        x = F.relu(self.conv5(x))  # (N, 256, 104)
        x = F.max_pool1d(F.relu(self.ln6(self.conv6(x))), POOL)  # (N, 256, 34)
        x = x.flatten(1)  # (N, 8704), channel-major
        x = F.relu(self.fc1(x))  # (N, 1024)
        x = F.relu(self.fc2(x))  # (N, 1024)
        return self.fc3(x)  # (N, 4) logits


@WORKLOADS.register(
    "charcnn",
    "Zhang et al.'s small character CNN, AG News, 70x1014 -> 4 classes (~0.74 GFLOP/text)",
)
class CharCNNWorkload(Workload):
    item = "texts"
    reads = ("classes",)  # texts of a fixed length: no --image-size

    @property
    def classes(self) -> int:
        return C if self.cfg.num_classes is None else self.cfg.num_classes

    def validate(self) -> None:
        cfg = self.cfg
        if cfg.image_size is not None:
            raise UsageError(f"charcnn reads {L}-character texts; drop --image-size")
        if cfg.num_classes is not None and cfg.num_classes < 1:
            raise UsageError(f"--num-classes must be >= 1, got {cfg.num_classes}")
        if cfg.data_dir is not None:
            if self.classes != C:
                raise UsageError(f"AG News has {C} classes; drop --num-classes {cfg.num_classes}")
            self._csv_path()  # fail before anything runs, naming the expected files

    def _build(self) -> nn.Module:
        return CharCNN(self.classes)

    # --- inputs --------------------------------------------------------------------------
    def synthetic_inputs(self, n: int, seed: int) -> Inputs:
        """Uniform indices in [0, 70] (1 in 71 is padding, a zero column) and uniform labels."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, V + 1, (n, L), generator=g, dtype=torch.uint8)  # (n, 1014)
        y = torch.randint(0, self.classes, (n,), generator=g)  # (n,)
        return Inputs(x, y)

    def _csv_path(self) -> Path:
        """test.csv in data_dir if present (the copy shipped for tests), else train.csv."""
        if self.cfg.data_dir is None:
            raise UsageError("charcnn: real AG News data needs --data-dir")
        folder = Path(self.cfg.data_dir)
        for name in ("test.csv", "train.csv"):
            if (folder / name).is_file():
                return folder / name
        raise UsageError(
            f"--data-dir {folder}: no AG News test.csv or train.csv "
            "(CSV with fields label,title,description)"
        )

    def real_inputs(self, n: int) -> Inputs:
        """The first n texts of the CSV, quantized; labels 1..4 become 0..3."""
        path = self._csv_path()
        texts, labels = agnews.read_agnews(path)
        if n > len(texts):
            raise UsageError(
                f"asked for {n} texts but {path} has {len(texts)}; "
                "lower --batch (or --train-size/--heldout-size)"
            )
        x = torch.from_numpy(agnews.quantize(texts[:n], L))  # (n, 1014) uint8
        return Inputs(x, torch.from_numpy(labels[:n]))

    def prepare(self, x: Tensor) -> Tensor:
        """(N, 1014) uint8 indices -> (N, 70, 1014) float32 one-hot on x's device.

        Comparing against 0..69 is a one-hot that drops the padding class for free: an index
        >= 70 matches nothing and leaves its column zero.
        """
        alphabet = torch.arange(V, device=x.device, dtype=torch.int16).view(1, V, 1)
        return (x.to(torch.int16).unsqueeze(1) == alphabet).float()  # (N, 70, 1014)

    # --- layers (the cost table derives from them) -------------------------------------
    def layers(self, model: nn.Module) -> list[Layer]:
        return charcnn_layers(model)

    # --- oracle --------------------------------------------------------------------------
    def reference_forward(self, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """Float64 forward from transport-form indices, layer by layer as in the seed."""
        p = params
        h = ops.one_hot(np.asarray(x).astype(np.int64), V)  # (N, 70, 1014)
        for conv, _, _, norm, pool in CONV_BLOCKS:
            h = ops.conv1d(h, p[f"{conv}.weight"], p[f"{conv}.bias"])
            if norm is not None:
                h = ops.layernorm(h, p[f"{norm}.weight"], p[f"{norm}.bias"])
            h = ops.relu(h)
            if pool:
                h = ops.maxpool1d(h, POOL, POOL)
        h = h.reshape(h.shape[0], -1)  # (N, 8704), channel-major like torch's flatten
        h = ops.relu(ops.linear(h, p["fc1.weight"], p["fc1.bias"]))
        h = ops.relu(ops.linear(h, p["fc2.weight"], p["fc2.bias"]))
        return ops.linear(h, p["fc3.weight"], p["fc3.bias"])  # (N, 4)


def charcnn_layers(model: nn.Module) -> list[Layer]:
    """CharCNN.forward as layers: per conv block conv, [LayerNorm], ReLU, [max-pool]; then
    flatten and fc1..fc3 with relu7, relu8 between (the seed's names)."""
    out: list[Layer] = []
    for conv, _, _, norm, pool in CONV_BLOCKS:
        out.append(describe(conv, getattr(model, conv), conv))
        if norm is not None:  # LayerNorm over the whole (256, length) map
            out.append(describe(norm, getattr(model, norm), norm))
        out.append(describe(f"relu{conv[-1]}", nn.ReLU()))
        if pool:
            out.append(describe(f"pool{conv[-1]}", nn.MaxPool1d(POOL)))
    out.append(describe("flatten", nn.Flatten()))  # a view: no cost row
    for i, fc in enumerate(("fc1", "fc2", "fc3")):
        out.append(describe(fc, getattr(model, fc), fc))
        if i < 2:
            out.append(describe(f"relu{7 + i}", nn.ReLU()))
    return out
