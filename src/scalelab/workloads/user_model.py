"""Your own network as a workload: `--model MODULE:FACTORY` (or an entry point of group
`scalelab.workloads`), run under every strategy that applies and checked against float64.

Inputs (`--input-shape C,H,W` / `C,L` / `F` per item):
  --input-dtype float32  synthetic N(0, 1) float32 values, seeded by the run's seed; they cross
                         the wire as float32 and reach the model in its precision (fp64 runs
                         widen them exactly, so the float64 reference sees the same values)
  --input-dtype int64    token ids uniform in [0, --vocab), int64 on the wire; the model gets
                         them as integers (a forward pre-hook turns the strategies' float cast
                         back into exact ids: < 2**24, exact in float32)
Labels are uniform in [0, K) where K, the number of classes, is read from the output (N, K).
A model whose output is (N, T, V) for an (N, T) int64 input is a language model
(workloads/next_token.py): it learns the next token, its held-out figure is the loss, and
`--data-dir` names a text corpus (data/corpus.py).

The reference is the module itself: the same weights loaded into a fresh build, in float64 on
the CPU in eval mode (record field `reference: "module-fp64"`); for training, one float64
process is the reference the tests compare ranks with. Training minimises the module's own
`loss(output, target)` when it defines one, else cross-entropy over the output.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from scalelab.data import corpus
from scalelab.errors import UsageError
from scalelab.workloads import block_layers as bl
from scalelab.workloads import hf_models, model_spec, next_token
from scalelab.workloads import module_layers as ml
from scalelab.workloads.base import WORKLOADS, Inputs, LayerCost, Workload
from scalelab.workloads.layers import Layer

DTYPES = {"float32": torch.float32, "int64": torch.int64}
# Probes of the models this process has validated, by what builds them (the spec, its
# arguments, one item's shape and dtype, the vocabulary, the seed): plan and predict make a
# workload per candidate, and each would otherwise build and trace the same model again.
_PROBES: dict[tuple, ml.Call] = {}
_PROBES_KEPT = 8


class TokenIds(nn.Module):
    """Glue: the strategies hand every input over as floats; token ids go back to int64."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if not x.is_floating_point() else x.round().long()


def _ids_hook(module: nn.Module, args: tuple) -> tuple:
    return (TokenIds()(args[0]), *args[1:])


def _dtype_hook(module: nn.Module, args: tuple) -> tuple:
    """Float inputs in the weights' precision (the training loop hands prepare()'s float32 to
    an fp64 model), as the shipped workloads' forwards do."""
    x = args[0]
    weight = next((p for p in module.parameters() if p.is_floating_point()), None)
    if weight is None or not x.is_floating_point() or x.dtype == weight.dtype:
        return None
    return (x.to(weight.dtype), *args[1:])


@WORKLOADS.register("model", "your own nn.Module: --model MODULE:FACTORY --input-shape C,H,W")
class UserModel(Workload):
    name = "model"
    item = "items"
    reads = ("user-model",)  # its shape comes from --input-shape and the module
    reference_kind: ClassVar[str] = "module-fp64"
    loss_reads_output_only = True  # loss(output, target): a pipeline's last stage computes it
    default_spec: ClassVar[str | None] = None  # set for entry-point workloads

    @property
    def spec(self) -> str:
        return self.cfg.model or self.default_spec

    def validate(self) -> None:
        if self.spec is None:
            raise UsageError("workload model needs --model MODULE:FACTORY")
        if hf_models.is_hf(self.spec) and self.cfg.input_dtype != "int64":
            raise UsageError(f"--model {self.spec} reads token ids: pass --input-dtype int64 "
                             "--vocab N --input-shape T")  # fmt: skip
        if self.cfg.input_dtype not in DTYPES:
            raise UsageError(f"--input-dtype must be float32 or int64, got {self.cfg.input_dtype}")
        if (self.cfg.vocab is None) == (self.cfg.input_dtype == "int64"):
            raise UsageError("--vocab N goes with --input-dtype int64 (token ids in [0, N))")
        self.shape  # noqa: B018 (parses --input-shape)
        if self.cfg.tokenizer is not None and self.cfg.data_dir is None:
            raise UsageError("--tokenizer reads a text corpus: give it --data-dir")
        if self.cfg.data_dir is not None:  # the corpus reads and fits --vocab, before any work
            corpus.check(self.cfg.data_dir, self.cfg.tokenizer, self.cfg.vocab)
        key = (self.spec, tuple(self.cfg.model_arg or ()), self.shape, self.cfg.input_dtype,
               self.cfg.vocab, self.cfg.seed)  # fmt: skip
        if key in _PROBES:  # validated before in this process
            self.__dict__["probe"] = _PROBES[key]
            return
        self.probe  # noqa: B018 (one item through the model, the largest id --vocab allows in it)
        if len(_PROBES) >= _PROBES_KEPT:
            _PROBES.pop(next(iter(_PROBES)))
        _PROBES[key] = self.probe

    def _check_vocab(self, model: nn.Module) -> None:
        """One item of the largest id --vocab allows through model (refused in one line
        naming the embedding it overflows)."""
        top = torch.full((1, *self.shape), self.cfg.vocab - 1)
        model_spec.check_vocab(self.spec, model, self.prepare(top), self.cfg.vocab)

    # --- the model -----------------------------------------------------------------------
    @cached_property
    def factory(self):
        return model_spec.load_factory(self.spec)

    def _build(self) -> nn.Module:
        kwargs = model_spec.parse_model_args(self.cfg.model_arg)
        if hf_models.is_hf(self.spec):  # config fields the run's flags fix, unless overridden
            sized = {"vocab_size": self.cfg.vocab, "max_position_embeddings": self.shape[0]}
            kwargs = {**{k: v for k, v in sized.items() if v is not None}, **kwargs}
        module = model_spec.call_factory(self.spec, self.factory, kwargs)
        hook = _ids_hook if self.cfg.input_dtype == "int64" else _dtype_hook
        module.register_forward_pre_hook(hook)
        return module

    @cached_property
    def shape(self) -> tuple[int, ...]:
        text = self.cfg.input_shape
        if text is None:
            raise UsageError(f"--model {self.spec}: give one item's shape, --input-shape C,H,W")
        try:
            shape = tuple(int(part) for part in text.split(","))
        except ValueError:
            raise UsageError(f"--input-shape {text!r}: expected sizes like 3,32,32") from None
        if not shape or min(shape) < 1:
            raise UsageError(f"--input-shape {text!r}: sizes must be >= 1")
        return shape

    @cached_property
    def probe(self) -> ml.Call:
        """One item through the model in eval mode: the call tree every view derives from."""
        model = self.build_model()
        x = self.synthetic_inputs(1, self.cfg.seed).x
        if self.cfg.input_dtype == "int64":
            # the largest id --vocab allows, in the item: an embedding it overflows fails this
            # forward (an IndexError on the CPU), before any work, with no second forward
            x[(0, *(s - 1 for s in self.shape))] = self.cfg.vocab - 1
        x = self.prepare(x)
        try:
            call = ml.trace(model, x)
        except Exception as exc:
            if self.cfg.input_dtype == "int64":  # ids past an embedding: said as such
                self._check_vocab(model)
            got = f"({', '.join(map(str, x.shape))}) {self.cfg.input_dtype}"
            raise UsageError(
                f"--model {self.spec}: a {got} input fails in its forward: "
                f"{model_spec._one_line(exc)} (check --input-shape/--input-dtype)"
            ) from None
        out = call.output
        ids = self.cfg.input_dtype == "int64"
        if torch.is_tensor(out) and next_token.is_lm_output(out, self.shape, ids):
            return call
        if not torch.is_tensor(out) or out.dim() != 2 or not out.is_floating_point():
            what = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
            raise UsageError(
                f"--model {self.spec}: the output is {what}; scalelab needs (N, K), or "
                "(N, T, V) next-token logits for an (N, T) int64 input"
            )
        return call

    @property
    def task(self) -> str:  # type: ignore[override]
        """ "next-token" for a language model's (N, T, V) output, else "classify"."""
        return next_token.TASK if self.probe.output.dim() == 3 else "classify"

    @property
    def tokens_per_item(self) -> int | None:  # type: ignore[override]
        """T for an (N, T) int64 input (a token model), else None."""
        return self.shape[0] if self.cfg.input_dtype == "int64" and len(self.shape) == 1 else None

    @property
    def num_classes(self) -> int:
        return self.probe.output.shape[-1]

    @property
    def image_size(self) -> int | None:
        return self.shape[1] if len(self.shape) >= 2 else None

    # --- inputs --------------------------------------------------------------------------
    def synthetic_inputs(self, n: int, seed: int) -> Inputs:
        gen = torch.Generator().manual_seed(seed)
        if self.cfg.input_dtype == "int64":
            x = torch.randint(0, self.cfg.vocab, (n, *self.shape), generator=gen)
        else:
            x = torch.randn((n, *self.shape), generator=gen, dtype=torch.float32)
        # Labels after the inputs: the classes come from the probe, which needs inputs first.
        classes = self.num_classes if "probe" in self.__dict__ else 1
        if classes > 1 and self.task == next_token.TASK:  # x continued by one token
            last = torch.randint(0, self.cfg.vocab, (n, 1), generator=gen)
            return Inputs(x, next_token.shifted(x, last))
        return Inputs(x, torch.randint(0, classes, (n,), generator=gen))

    def real_inputs(self, n: int) -> Inputs:
        """The first n sequences of the text corpus in --data-dir (a language model's)."""
        if self.task != next_token.TASK:
            raise UsageError(
                f"--data-dir with --model: a text corpus trains a language model (an (N, T, V) "
                f"output); {self.spec} returns (N, K)"
            )
        cfg = self.cfg
        return Inputs(*corpus.sequences(cfg.data_dir, self.shape[0], n, cfg.vocab, cfg.tokenizer))

    @property
    def ids_as_floats(self) -> bool:
        return self.cfg.input_dtype == "int64"

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Transport form -> model input: float32 stays; token ids become float32 (exact below
        2**24; a strategy that casts inputs to bf16/fp16 leaves them: `ids_as_floats`), turned
        back into ids by the model's hook."""
        return x if x.is_floating_point() else x.to(torch.float32)

    # --- the one layer description ---------------------------------------------------------
    @cached_property
    def view(self) -> tuple[list[Layer], list[ml.Call | None], str | None]:
        """(layers, the call each computes, why the model is not a chain): the chain of its
        children where the forward is one, else the block view (block_layers) where the
        module tree holds a stack of repeated blocks, else the model as one block."""
        layers, calls, why = ml.derive_layers(self.probe)
        if len(layers) == 1 and why is not None and self.blocks is not None:
            return self.blocks.layers, self.blocks.calls, None
        return layers, calls, why

    @cached_property
    def blocks(self) -> bl.BlockView | None:
        """The block view, when the root's forward is not a chain and its blocks are."""
        found = bl.block_view(self.probe)
        if isinstance(found, str):
            self._blocks_why = found
            return None
        return found

    def layers(self, model: nn.Module) -> list[Layer]:
        """model's layers in forward order (its own submodules, same parameters)."""
        layers, _, _ = self.view
        modules = dict(model.named_modules())
        out = [replace(x, module=modules[x.path]) if x.path is not None else x for x in layers]
        if self.blocks is not None:
            params = dict(model.named_parameters())
            out = [replace(x, module=bl.RootParams({n: params[n] for n in x.module.names}))
                   if isinstance(x.module, bl.RootParams) else x for x in out]  # fmt: skip
        if self.cfg.input_dtype == "int64":
            out.insert(0, Layer("ids", "cast", TokenIds(), "point"))
        return out

    def chain_problem(self) -> str | None:
        """Why the model is not a chain of layers a pipeline can cut (None: it is one, or its
        blocks are)."""
        layers, _, why = self.view
        if len(layers) == 1 and why is not None and getattr(self, "_blocks_why", None):
            return f"{why}; {self._blocks_why}"
        return why if len(layers) == 1 else None

    def check_strategy(
        self, strategy: str, cfg, *, stages: bool = False, tensor_pairs: bool = False
    ) -> None:
        """One line naming the layer that stops a strategy this model cannot run under."""
        if stages and self.chain_problem() is not None:
            raise UsageError(
                f"{strategy}: cannot cut the model into stages: {self.chain_problem()}"
            )
        if stages and self.blocks is not None:
            self._check_block_pipeline(cfg)
        by_heads = cfg.tp_plan is not None or bl.repeated_blocks(self.probe.module) is not None
        pairs = by_heads or self.linear_pairs(None)
        if tensor_pairs and not pairs:
            raise UsageError(f"{strategy}: nothing to shard: {self._why_no_pairs()}")

    def linear_pairs(self, model: nn.Module | None) -> list[tuple[str, str]]:
        """(column-wise, row-wise) Linear pairs joined by element-wise layers only, from the
        front: what tensor parallelism (DTensor) shards. By module path."""
        pairs, open_ = [], None
        if self.blocks is not None:  # the root's own ops sit between these layers
            return pairs
        for layer in ml.derive_layers(self.probe)[0]:
            if layer.kind == "linear":
                if open_ is not None:
                    pairs.append((open_, layer.path))
                open_ = None if open_ is not None else layer.path
            elif not ml.is_elementwise(layer):
                open_ = None
        return pairs

    def _why_no_pairs(self) -> str:
        layers = ml.derive_layers(self.probe)[0]
        linear = [i for i, x in enumerate(layers) if x.kind == "linear"]
        inside = [n for n, m in self.probe.module.named_modules() if isinstance(m, nn.Linear)]
        if not linear and inside:  # every Linear sits in a block scalelab cannot split
            why = ml.derive_layers(self.probe)[2]
            return f"its Linear layers ({', '.join(inside[:3])}) sit inside a block: {why}"
        if not linear:
            kinds = sorted({x.kind for x in layers})
            return f"the model has no Linear layer (its layers: {', '.join(kinds)})"
        for i in linear:
            nxt = next((x for x in layers[i + 1 :] if not ml.is_elementwise(x)), None)
            if nxt is not None and nxt.kind != "linear":
                return (f"{layers[i].name} is followed by {nxt.name} ({nxt.kind}), not another "
                        "Linear through element-wise layers only")  # fmt: skip
        return f"{layers[linear[-1]].name} is the last Linear, with none to pair it with"

    def first_nonlocal(self) -> Layer | None:
        """The first layer that reads beyond a window along the split axis (None: none)."""
        layers, _, _ = self.view
        return next((x for x in layers if x.reach not in ("window", "point")), None)

    # --- cost model: FlopCounter per module, from the traced forward ----------------------
    def layer_costs(self) -> list[tuple[Layer, LayerCost]]:
        layers, calls, _ = self.view
        if self.blocks is not None:
            return self._block_costs()
        out, counted = [], set()
        prev = self.probe.inputs[0]
        if self.cfg.input_dtype == "int64":  # the ids cast: layers() starts with it
            ids = Layer("ids", "cast", TokenIds(), "point")
            n = ml.per_item_elems(prev)
            out.append((ids, LayerCost("ids", "cast", tuple(prev.shape[1:]), 0, 0, n, n)))
        for layer, call in zip(layers, calls):
            params = 0
            if call is not None and id(call.module) not in counted:
                counted.add(id(call.module))
                params = sum(p.numel() for p in call.module.parameters())
            after = call.output if call is not None else prev.reshape(1, *layer.module.shape)
            out.append((layer, LayerCost(
                layer.name, layer.kind, tuple(after.shape[1:]), params,
                ml.layer_flops(layer, call), ml.per_item_elems(prev), ml.per_item_elems(after),
                layer.path)))  # fmt: skip
            prev = after
        return out

    def _block_costs(self) -> list[tuple[Layer, LayerCost]]:
        """The block view's rows: each call's own input and output, FlopCounter's count."""
        out, counted = [], set()
        x = self.probe.inputs[0]
        if self.cfg.input_dtype == "int64":
            n = ml.per_item_elems(x)
            ids = Layer("ids", "cast", TokenIds(), "point")
            out.append((ids, LayerCost("ids", "cast", tuple(x.shape[1:]), 0, 0, n, n)))
        for layer, call in zip(self.blocks.layers, self.blocks.calls):
            fresh = [p for p in layer.module.parameters() if id(p) not in counted]
            counted.update(id(p) for p in fresh)
            params = sum(p.numel() for p in fresh)
            if call is None:  # the root's parameters: used by the root's own ops
                shape = tuple(next(layer.module.parameters()).shape)
                out.append((layer, LayerCost(layer.name, layer.kind, shape, params, 0, 0, 0)))
                continue
            first = call.inputs[0] if call.inputs else None
            after = bl.carried(call.output)  # a tuple's first element flows on
            shape = tuple(after.shape[1:]) if torch.is_tensor(after) else ()
            out.append((layer, LayerCost(
                layer.name, layer.kind, shape, params, ml.layer_flops(layer, call),
                ml.per_item_elems(first), ml.per_item_elems(after), layer.path)))  # fmt: skip
        return out

    def _check_block_pipeline(self, cfg) -> None:
        """A block model's pipeline: torch's tracer cuts it (the torch engine)."""
        if cfg.engine != "torch" or cfg.placement == "manual":
            raise UsageError(
                f"pipeline: the model's forward is not a chain of its layers (its blocks "
                f"{self.blocks.stack}.* are); cut it with --engine torch (torch's tracer)"
            )

    # --- oracle: the module itself in float64 --------------------------------------------
    def reference_forward(self, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """The same module, a fresh build with these weights, float64, CPU, eval mode."""
        model = self.build_model().double().eval()
        model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()}, strict=True)
        inputs = torch.from_numpy(x)
        inputs = inputs.double() if inputs.is_floating_point() else inputs
        with torch.no_grad():
            return model(inputs).numpy()

    # --- training ------------------------------------------------------------------------
    def loss(self, model: nn.Module, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The module's own loss(output, target) where it defines one, else cross-entropy."""
        own = self._own_loss(model)
        if own is not None:
            return own(logits, y)
        if logits.dim() == 3:  # next-token logits (B, T, V), targets (B, T)
            return self._token_loss(logits, y)
        return super().loss(model, logits, y)

    _token_loss = staticmethod(next_token.loss)  # compile_loss: a compiled one instead

    def _own_loss(self, model: nn.Module | None = None):
        """The module's own loss(output, target) (model's, else the probe's), or None."""
        for owner in (getattr(model, "module", model), self._loss_owner):
            own = getattr(owner, "loss", None)
            if callable(own):
                return own
        return None

    def compile_loss(self, backend: str) -> bool:
        """A language model's next-token cross-entropy compiled (its module's own loss, where
        it has one, stays as written): the (B, T, V) logits are then read in their own dtype
        instead of upcast, log-softmaxed and kept in fp32 (at GPT-2 small's 16 x 1024 x 50304,
        6.6 GB written and read again in backward)."""
        if self.task != next_token.TASK or self._own_loss() is not None:
            return False
        self._token_loss = torch.compile(next_token.loss, backend=backend)
        return True

    def blank_targets(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        if self.task == next_token.TASK:  # (n, T) next tokens
            return torch.zeros((n, self.shape[0]), dtype=torch.int64, device=device)
        return super().blank_targets(n, device)

    def score(self, logits: torch.Tensor, y: torch.Tensor) -> float:
        if logits.dim() == 3:  # a language model's held-out figure: its loss
            return next_token.loss_sum(logits, y)
        return super().score(logits, y)

    @cached_property
    def _loss_owner(self) -> nn.Module:
        return self.probe.module


def entry_point_workloads() -> dict[str, type[UserModel]]:
    """A workload class per `scalelab.workloads` entry point (a name -> MODULE:FACTORY)."""
    out: dict[str, type[UserModel]] = {}
    for name, value in model_spec.registered_models().items():
        if name in WORKLOADS:
            continue  # a shipped name wins
        cls = type(f"UserModel[{name}]", (UserModel,), {"default_spec": value})
        out[name] = WORKLOADS.register(name, f"entry point {value} (scalelab.workloads)")(cls)
    return out
