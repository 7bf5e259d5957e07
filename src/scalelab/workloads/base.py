"""What every workload provides: a model, inputs in their transport form, a cost table and
(where one exists) a float64 NumPy oracle. A workload never knows which strategy runs it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from scalelab import eager_process
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.registry import Registry
from scalelab.workloads.costs import (  # noqa: F401  (re-exported: the workloads' formulas)
    LayerCost,
    conv_cost,
    elementwise_cost,
    layer_costs,
    linear_cost,
)
from scalelab.workloads.layers import Layer, sequential_layers


@dataclass
class Inputs:
    """A batch in its transport form: the smallest faithful encoding that crosses a wire.

    x: (N, ...) uint8 pixels, uint8 character indices, or float32 where the source is float.
    y: (N,) int64 labels, or None for unlabeled synthetic inference inputs.
    """

    x: torch.Tensor
    y: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.x.shape[0]

    def slice(self, start: int, stop: int) -> Inputs:
        return Inputs(self.x[start:stop], None if self.y is None else self.y[start:stop])


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch inside a forked RNG so building a model leaves the global stream alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class Workload(ABC):
    """A model plus its inputs, its cost model and its oracle."""

    name: ClassVar[str]
    item: ClassVar[str] = "images"  # what throughput counts: images, inputs, ...
    native_size: ClassVar[int | None] = None  # input height = width when --image-size is unset
    native_classes: ClassVar[int | None] = None  # output width when --num-classes is unset
    native_split: ClassVar[tuple[int, int]] = (8000, 2000)  # (train, held-out) items by default
    # The shape sections (config_sections.SHAPES) this workload reads; a run refuses a
    # non-default option of any other one (`--hidden` on alexnet) before any work.
    reads: ClassVar[tuple[str, ...]] = ()
    reference_kind: ClassVar[str] = "numpy-fp64"  # what --check compares with (the record's)
    loss_reads_output_only: ClassVar[bool] = False  # loss() needs no weights (a pipeline can)
    tokens_per_item: ClassVar[int | None] = None  # T of an (N, T) int64 input: tokens/s, MFU
    task: ClassVar[str] = "classify"  # or "next-token": (B, T, V) logits (workloads/next_token.py)

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.validate()

    @property
    def image_size(self) -> int:
        return self.native_size if self.cfg.image_size is None else self.cfg.image_size

    @property
    def num_classes(self) -> int:
        return self.native_classes if self.cfg.num_classes is None else self.cfg.num_classes

    @staticmethod
    def readers(section: str) -> list[str]:
        """The registered workloads that read a shape section (named in a refusal)."""
        return [name for name in WORKLOADS.names() if section in WORKLOADS.get(name).reads]

    @property
    def train_size(self) -> int:
        """Items in the training split: --train-size, else native_split's."""
        return self.native_split[0] if self.cfg.train_size is None else self.cfg.train_size

    @property
    def heldout_size(self) -> int:
        return self.native_split[1] if self.cfg.heldout_size is None else self.cfg.heldout_size

    def validate(self) -> None:
        """Raise UsageError for options this workload cannot honour (e.g. image too small).

        The base checks the generic sizes; workloads with a tighter bound extend it."""
        if self.native_size is not None and self.image_size < 1:
            raise UsageError(f"{self.name} needs --image-size >= 1, got {self.image_size}")
        if self.native_classes is not None and self.num_classes < 1:
            raise UsageError(f"--num-classes must be >= 1, got {self.num_classes}")

    # --- the model -----------------------------------------------------------------------
    @abstractmethod
    def _build(self) -> nn.Module:
        """Construct the module; weights are drawn from torch's (seeded) default init."""

    def check_strategy(
        self, strategy: str, cfg: RunConfig, *, stages: bool = False, tensor_pairs: bool = False
    ) -> None:
        """Raise UsageError, one line naming the layer that stops it, for a strategy this
        workload's model cannot run under (the shipped workloads: the strategies decide).
        What the strategy needs of the model comes as data (Strategy.model_needs): `stages`,
        it cuts the model into pipeline stages; `tensor_pairs`, DTensor shards Linear pairs."""

    def build_model(self) -> nn.Module:
        with seeded(self.cfg.seed):
            model = self._build()
        return model.eval()

    # --- inputs --------------------------------------------------------------------------
    @abstractmethod
    def synthetic_inputs(self, n: int, seed: int) -> Inputs:
        """n items of the right shape and transport dtype, deterministic in seed."""

    def real_inputs(self, n: int) -> Inputs:
        """The first n items of the real data set in cfg.data_dir."""
        raise UsageError(f"workload {self.name} reads no data set; drop --data-dir")

    def inputs(self, n: int) -> Inputs:
        if self.cfg.data_dir is not None:
            return self.real_inputs(n)
        return self.synthetic_inputs(n, self.cfg.seed + 1)

    def training_data(self) -> tuple[Inputs, Inputs]:
        """(train, held-out) sets for --train; synthetic unless cfg.data_dir names real data."""
        n_train, n_held = self.train_size, self.heldout_size
        if self.cfg.data_dir is not None:
            data = self.real_inputs(n_train + n_held)
        else:
            data = self.synthetic_inputs(n_train + n_held, self.cfg.seed + 1)
        return split_seeded(data, n_train, n_held, self.cfg.seed)

    # prepare() hands token ids over as float32 (exact below 2**24): a strategy that casts a
    # model's inputs to a lower precision leaves these alone (bf16 is exact only below 256)
    ids_as_floats: bool = False

    @abstractmethod
    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Transport form -> model input, on x's device: uint8 -> float, indices -> one-hot."""

    # --- layers and cost model ----------------------------------------------------------
    def layers(self, model: nn.Module) -> list[Layer]:
        """The model as layers whose modules, run in order on prepare()'s output, give its
        forward (workloads/layers.py); the default reads an nn.Sequential's children."""
        return sequential_layers(model)

    def meta_model(self) -> nn.Module:
        """The model on the meta device: its structure and shapes, no weights allocated. Built
        once per instance (a GPT-2's is 0.08 s of module construction): callers only read it."""
        if getattr(self, "_meta_model", None) is None:
            with torch.device("meta"):
                self._meta_model = self.build_model()
        return self._meta_model

    def item_shape(self) -> tuple[int, ...]:
        """prepare()'s output shape per item, e.g. (3, 227, 227)."""
        return tuple(self.prepare(self.synthetic_inputs(1, 0).x).shape[1:])

    def layer_costs(self) -> list[tuple[Layer, LayerCost]]:
        """(layer, row) for every cost row a layer computes, in execution order."""
        return layer_costs(self.layers(self.meta_model()), self.item_shape())

    def tail_costs(self) -> list[LayerCost]:
        """Rows no layer computes (a softmax left to the loss), appended to the table."""
        return []

    def cost_table(self) -> list[LayerCost]:
        """Per-layer analytic costs for one item, in execution order, derived from layers();
        computed once per instance (the shapes come from a forward on the meta device)."""
        if getattr(self, "_cost_table", None) is None:
            self._cost_table = (*(row for _, row in self.layer_costs()), *self.tail_costs())
        return list(self._cost_table)

    def flops_per_item(self) -> int:
        return sum(layer.flops for layer in self.cost_table())

    # --- oracle --------------------------------------------------------------------------
    def reference_forward(self, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """Float64 NumPy forward from the layer definitions, independent of torch.

        params: the model's state_dict as float64 arrays; x: transport-form inputs (N, ...).
        Returns the same quantity the model's forward returns (logits), shape (N, classes).
        """
        raise UsageError(f"workload {self.name} has no NumPy float64 reference")

    @classmethod
    def has_reference(cls) -> bool:
        return cls.reference_forward is not Workload.reference_forward

    def reference_train_step(
        self, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
    ) -> float:
        """One float64 SGD step on transport-form x, labels y, updating params in place.

        Returns the batch's mean loss before the update. Only workloads with a hand-written
        NumPy backward implement it (the `serial` strategy's training path).
        """
        raise UsageError(f"workload {self.name} has no NumPy float64 training reference")

    # --- training ------------------------------------------------------------------------
    def loss(self, model: nn.Module, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the batch (workloads add regularisation terms here)."""
        # Half-precision logits are upcast for a stable softmax; fp64 stays fp64 (oracle runs).
        wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        return nn.functional.cross_entropy(wide, y)

    def compile_loss(self, backend: str) -> bool:
        """--compile: compile this workload's loss where that pays (a language model's
        cross-entropy over its (B, T, V) logits); whether it did. A classifier's (N, K)
        cross-entropy is too small to pay its compile."""
        return False

    def blank_targets(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """n placeholder targets of the right shape (a pipeline's shape pass): (n,) labels."""
        return torch.zeros(n, dtype=torch.int64, device=device)

    def score(self, logits: torch.Tensor, y: torch.Tensor) -> float:
        """The held-out score summed over a batch's items (divided by the items: the epoch's
        held-out figure): items whose arg-max class is the label; a next-token model's
        summed loss instead."""
        return float((logits.argmax(dim=1).to(y.device) == y).sum())

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(model.parameters(), lr=self.cfg.lr, momentum=self.cfg.momentum)
        return eager_process.eager_step(opt)  # no torch._dynamo import for its step


def split_seeded(data: Inputs, n_train: int, n_held: int, seed: int) -> tuple[Inputs, Inputs]:
    """A seeded random split into (train, held-out); refuses to invent items."""
    if n_train + n_held > len(data):
        raise UsageError(
            f"need {n_train} training + {n_held} held-out items but the data has {len(data)}; "
            "lower --train-size/--heldout-size"
        )
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    train_idx, held_idx = perm[:n_train], perm[n_train : n_train + n_held]
    pick = lambda idx: Inputs(data.x[idx], None if data.y is None else data.y[idx])  # noqa: E731
    return pick(train_idx), pick(held_idx)


def state_dict_float64(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's parameters and buffers as float64 NumPy arrays, for the oracle."""
    # .copy(): for a float64 CPU model .double().numpy() is a view an optimizer would mutate.
    return {k: v.detach().cpu().double().numpy().copy() for k, v in model.state_dict().items()}


# Workload classes by name; each workload module registers itself with
# @WORKLOADS.register("name", "one-line description").
WORKLOADS: Registry[type[Workload]] = Registry("workload")
