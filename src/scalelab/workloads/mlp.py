"""Two-layer perceptron on MNIST, as in the seed's profiling and roofline study.

    x (N, D=784) -> fc1 (D -> H) -> sigmoid -> fc2 (H -> C=10) -> logits; softmax in the loss.

Training minimises mean cross-entropy + l2/2 * (||W1||^2 + ||W2||^2) (weights, not biases)
with plain SGD. Per batch B the forward matmuls cost 2*B*H*(D + C) FLOPs and the backward
ones about as much again (the seed's model). reference_sgd_step below is the same training
step in float64 NumPy with the gradients derived by hand, the oracle for every strategy's
training run.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from scalelab.data import mnist
from scalelab.errors import UsageError
from scalelab.oracle import ops
from scalelab.workloads.base import (
    WORKLOADS,
    Inputs,
    LayerCost,
    Workload,
    elementwise_cost,
    split_seeded,
)
from scalelab.workloads.layers import Layer, MatchDtype, describe

D = mnist.ROWS * mnist.COLS  # 784 input pixels
C = mnist.NUM_CLASSES  # 10 digits
SIGMOID_FLOPS = 4  # per element: negate, exp, add 1, divide
SOFTMAX_FLOPS = 5  # per element: max, subtract, exp, sum, divide
PIXEL_SCALE = 1 / 255  # prepare() multiplies by its float32 rounding
SYNTH_NOISE = 64.0  # std of the pixel noise around each synthetic class prototype


class MLP(nn.Module):
    """784 -> H sigmoid -> 10, named W1/b1 = fc1 and W2/b2 = fc2 as in the seed."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, hidden)  # 2*D*H FLOPs per image
        self.fc2 = nn.Linear(hidden, C)  # 2*H*C FLOPs per image

    def forward(self, x: Tensor) -> Tensor:
        # prepare() hands over float32; an fp64 model needs fp64 inputs (under autocast the
        # weights stay fp32, and autocast still lowers the matmuls).
        x = x.flatten(1).to(self.fc1.weight.dtype)  # (N, 784)
        a1 = torch.sigmoid(self.fc1(x))  # (N, H)
        return self.fc2(a1)  # (N, 10) logits


@WORKLOADS.register("mlp", "MNIST 784 -> hidden sigmoid -> 10 softmax, L2 + SGD (the seed's MLP)")
class MnistMLP(Workload):
    item = "images"
    reads = ("image", "classes", "hidden")  # image and classes: only MNIST's 28 and 10

    def validate(self) -> None:
        cfg = self.cfg
        if cfg.image_size not in (None, mnist.ROWS):
            raise UsageError(f"mlp reads 28x28 MNIST images; drop --image-size {cfg.image_size}")
        if cfg.num_classes not in (None, C):
            raise UsageError(f"mlp has 10 classes (digits); drop --num-classes {cfg.num_classes}")
        if cfg.l2 < 0:
            raise UsageError(f"--l2 must be >= 0, got {cfg.l2}")
        if cfg.data_dir is not None:
            mnist.available_splits(cfg.data_dir)  # fail before anything runs, naming the files

    def _build(self) -> nn.Module:
        return MLP(self.cfg.hidden)

    # --- inputs --------------------------------------------------------------------------
    def synthetic_inputs(self, n: int, seed: int) -> Inputs:
        """n noisy copies of 10 class prototypes: labels are a learnable function of pixels.

        Each class gets a random "ink" pattern (30% of pixels at 255, the rest 0); an item is
        its class's prototype plus Gaussian noise (std SYNTH_NOISE), rounded to uint8. A
        nearest-prototype rule recovers the label, so training on synthetic data converges.
        """
        g = torch.Generator().manual_seed(seed)
        prototypes = (torch.rand(C, D, generator=g) < 0.3).float() * 255  # (10, 784)
        y = torch.randint(0, C, (n,), generator=g)  # (n,)
        noise = torch.randn(n, D, generator=g) * SYNTH_NOISE
        x = (prototypes[y] + noise).clamp(0, 255).round().to(torch.uint8)  # (n, 784)
        return Inputs(x, y)

    def _split(self, name: str) -> Inputs:
        data = mnist.load_split(self._data_dir(), name)
        return Inputs(torch.from_numpy(data.images.copy()), torch.from_numpy(data.labels))

    def _data_dir(self) -> str:
        if self.cfg.data_dir is None:
            raise UsageError("mlp: real MNIST data needs --data-dir")
        return self.cfg.data_dir

    def real_inputs(self, n: int) -> Inputs:
        """The first n items of the training split if present, else of the t10k split."""
        data = self._split(mnist.available_splits(self._data_dir())[0])
        if n > len(data):
            raise UsageError(f"asked for {n} MNIST images but the data has {len(data)}")
        return data.slice(0, n)

    def training_data(self) -> tuple[Inputs, Inputs]:
        """Official train split for training and t10k held out, when both are present.

        Otherwise (only one split in data_dir, or synthetic data) the base class's seeded
        train_size / heldout_size split of that one set.
        """
        if self.cfg.data_dir is None:
            return super().training_data()
        splits = mnist.available_splits(self.cfg.data_dir)
        if splits != list(mnist.SPLITS):
            data = self._split(splits[0])
            return split_seeded(data, self.train_size, self.heldout_size, self.cfg.seed)
        return self._split("train"), self._split("t10k")

    def prepare(self, x: Tensor) -> Tensor:
        """uint8 -> float32 in [0, 1] on x's device (N, 784); the model casts to its dtype.

        Times fp32(1/255), not / 255: CUDA turns division by a scalar into this product, CPU
        does not, and the two differ in the last bit for 126 of the 256 pixel values (seen on
        an H100), enough to fail an fp64 check. The product is the same on CPU, CUDA and NumPy.
        """
        return x.float() * PIXEL_SCALE

    # --- cost model ----------------------------------------------------------------------
    def layers(self, model: nn.Module) -> list[Layer]:
        """MLP.forward: flatten, cast, fc1, sigmoid, fc2 (the seed's W1/b1, W2/b2)."""
        return [
            describe("flatten", nn.Flatten()),
            describe("cast", MatchDtype()),
            describe("fc1", model.fc1, "fc1"),  # 2*D*H
            describe("sigmoid", nn.Sigmoid()),
            describe("fc2", model.fc2, "fc2"),  # 2*H*C
        ]

    def tail_costs(self) -> list[LayerCost]:
        return [elementwise_cost("softmax", "softmax", (C,), SOFTMAX_FLOPS)]

    # --- oracle and training -------------------------------------------------------------
    def reference_forward(self, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        return reference_logits(params, scale_pixels(x))

    def reference_train_step(
        self, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
    ) -> float:
        """reference_sgd_step on transport-form x; replaces params' arrays, returns the loss."""
        if self.cfg.momentum:
            raise UsageError("the float64 mlp reference trains with plain SGD; drop --momentum")
        new, loss = reference_sgd_step(params, scale_pixels(x), y, self.cfg.lr, self.cfg.l2)
        params.update(new)  # new arrays, not writes into the old ones (they may alias a model)
        return loss

    def loss(self, model: nn.Module, logits: Tensor, y: Tensor) -> Tensor:
        """Mean cross-entropy + l2/2 * (||W1||^2 + ||W2||^2), biases not regularised.

        Half-precision logits (autocast) are lifted to fp32; fp64 stays fp64 so a float64
        training run can match reference_sgd_step to rounding.
        """
        ce = nn.functional.cross_entropy(_at_least_fp32(logits), y)
        # By name, not model.fc1: a DDP or FSDP wrapper prefixes the names but hides the attrs.
        weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
        penalty = sum(_at_least_fp32(w).square().sum() for w in weights)
        return ce + self.cfg.l2 / 2 * penalty


def _at_least_fp32(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def scale_pixels(x: np.ndarray) -> np.ndarray:
    """Transport-form uint8 pixels (N, 784) -> float64 in [0, 1], exactly prepare()'s values.

    Scaled in float32 as prepare() does (times fp32(1/255)), then widened: every strategy
    sees those rounded values, and the exact k/255 would put a 6e-8 error into fp64 checks.
    """
    x = np.asarray(x).reshape(len(x), -1)
    return (x.astype(np.float32) * np.float32(PIXEL_SCALE)).astype(np.float64)


def _forward(params: dict[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a1, z2): hidden activations (N, H) and logits (N, C) for float inputs x (N, D)."""
    a1 = ops.sigmoid(ops.linear(x, params["fc1.weight"], params["fc1.bias"]))  # (N, H)
    z2 = ops.linear(a1, params["fc2.weight"], params["fc2.bias"])  # (N, C)
    return a1, z2


def reference_logits(params: dict[str, np.ndarray], x_float: np.ndarray) -> np.ndarray:
    """Float64 logits (N, C) of the MLP for float inputs (N, D) already scaled to [0, 1]."""
    return _forward(params, x_float)[1]


def reference_loss_and_grads(
    params: dict[str, np.ndarray], x_float: np.ndarray, y: np.ndarray, l2: float
) -> tuple[float, dict[str, np.ndarray]]:
    """Loss L = mean_i -log softmax(z2_i)[y_i] + l2/2 (||W1||^2 + ||W2||^2) and dL/dparams.

    Backprop by hand, from the chain rule:
        dz2 = (softmax(z2) - onehot(y)) / N             (N, C)
        dW2 = dz2^T a1 + l2 W2,   db2 = sum_i dz2       (C, H), (C,)
        dz1 = (dz2 W2) * a1 (1 - a1)                    (N, H), sigmoid' = a (1 - a)
        dW1 = dz1^T x + l2 W1,    db1 = sum_i dz1       (H, D), (H,)
    """
    w1, w2 = params["fc1.weight"], params["fc2.weight"]
    n = x_float.shape[0]
    a1, z2 = _forward(params, x_float)
    shifted = z2 - z2.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))  # log softmax
    rows = np.arange(n)
    loss = -log_p[rows, y].mean() + l2 / 2 * (np.square(w1).sum() + np.square(w2).sum())
    dz2 = np.exp(log_p)
    dz2[rows, y] -= 1.0
    dz2 /= n
    dz1 = (dz2 @ w2) * a1 * (1.0 - a1)
    grads = {
        "fc1.weight": dz1.T @ x_float + l2 * w1,
        "fc1.bias": dz1.sum(axis=0),
        "fc2.weight": dz2.T @ a1 + l2 * w2,
        "fc2.bias": dz2.sum(axis=0),
    }
    return float(loss), grads


def reference_sgd_step(
    params: dict[str, np.ndarray], x_float: np.ndarray, y: np.ndarray, lr: float, l2: float
) -> tuple[dict[str, np.ndarray], float]:
    """One plain SGD step in float64: (params - lr * grad, loss before the step).

    x_float: (N, 784) pixels scaled to [0, 1] (scale_pixels); y: (N,) integer labels.
    Keys are the MLP's state_dict keys: fc1.weight, fc1.bias, fc2.weight, fc2.bias.
    """
    x_float, y = np.asarray(x_float, np.float64), np.asarray(y)
    loss, grads = reference_loss_and_grads(params, x_float, y, l2)
    return {k: params[k] - lr * grads[k] for k in params}, loss
