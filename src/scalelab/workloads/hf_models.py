"""Hugging Face causal language models without a wrapper: `--model hf:SPEC`.

SPEC is a model type (llama, gpt2, mistral, qwen2, ...: `AutoConfig.for_model` at SMALL's
size), a config.json, or a folder holding one (and, when it holds weights, a local checkpoint:
`from_pretrained(folder, local_files_only=True)`); `--model-arg KEY=VALUE` overrides config
fields. The model is `AutoModelForCausalLM.from_config` (random weights, drawn from the run's
seeded RNG) wrapped in `CausalLM`, whose forward returns the logits (B, T, V), so scalelab sees
a language model (workloads/next_token.py). Nothing is ever downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scalelab.errors import UsageError

PREFIX = "hf:"
INSTALL = 'pip install "scalelab[hf]"'
# A model type's default size: small enough to check in float64 on a CPU. Fields a type does
# not have are mapped by its config (gpt2: hidden_size -> n_embd) or kept unused.
SMALL: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, use_cache=False,
)  # fmt: skip
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
           "pytorch_model.bin.index.json")  # fmt: skip
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


class CausalLM(nn.Module):
    """(B, T) ids -> (B, T, V) logits: the ModelOutput unwrapped, no key/value cache."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits  # (B, T, V)


def is_hf(spec: str) -> bool:
    return spec.startswith(PREFIX)


def factory(spec: str) -> Callable[..., nn.Module]:
    """The builder an `hf:SPEC` names: (**config overrides) -> CausalLM. Refuses a missing
    transformers, a missing config file and an unknown model type in one line each."""
    body = spec[len(PREFIX) :]
    transformers = _transformers(spec)
    if not body:
        raise UsageError(f"--model {spec}: name a model type (hf:llama) or a config.json")
    path = Path(body)
    if path.suffix == ".json" or "/" in body or path.exists():
        folder = path if path.is_dir() else path.parent
        config = path / "config.json" if path.is_dir() else path
        if not config.is_file():
            raise UsageError(f"--model {spec}: no such config file {config}")
        weights = path.is_dir() and any((folder / name).is_file() for name in WEIGHTS)
        return lambda **over: _from_file(transformers, spec, config, folder if weights else None,
                                         over)  # fmt: skip
    if body not in transformers.CONFIG_MAPPING:
        raise UsageError(
            f"--model {spec}: unknown model type {body!r} for transformers "
            f"{transformers.__version__} (e.g. llama, gpt2, mistral, qwen2)"
        )
    return lambda **over: _from_type(transformers, spec, body, over)


def _transformers(spec: str):
    try:
        import transformers
    except ImportError:
        raise UsageError(f"--model {spec}: needs transformers: {INSTALL}") from None
    transformers.logging.set_verbosity_error()  # config warnings about unused fields
    return transformers


def _from_type(transformers, spec: str, kind: str, over: dict[str, Any]) -> nn.Module:
    # SMALL's fields a type derives (falcon's head_dim is a read-only property) stay derived
    cls = transformers.CONFIG_MAPPING[kind]
    small = {k: v for k, v in SMALL.items() if not _read_only(cls, k)}
    fields = {**small, **over}
    try:
        config = transformers.AutoConfig.for_model(kind, **fields)
    except Exception as exc:
        raise UsageError(f"--model {spec}: config {kind} refused {_line(exc)}") from None
    return _build(transformers, spec, config)


def _read_only(cls: type, name: str) -> bool:
    attr = getattr(cls, name, None)
    return isinstance(attr, property) and attr.fset is None


def _from_file(
    transformers, spec: str, config: Path, weights: Path | None, over: dict
) -> nn.Module:
    try:
        if weights is not None:  # a local checkpoint: its weights, in float32
            model = transformers.AutoModelForCausalLM.from_pretrained(
                weights, local_files_only=True, dtype=torch.float32, **over
            )
            return CausalLM(model)
        loaded = transformers.AutoConfig.from_pretrained(config, local_files_only=True, **over)
    except Exception as exc:
        raise UsageError(f"--model {spec}: {_line(exc)}") from None
    return _build(transformers, spec, loaded)


def _build(transformers, spec: str, config) -> nn.Module:
    vocab = getattr(config, "vocab_size", None)
    for name in SPECIAL_IDS:  # a small vocabulary: the type's default ids fall outside it
        value = getattr(config, name, None)
        if isinstance(value, int) and vocab is not None and value >= vocab:
            setattr(config, name, None)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:
        raise UsageError(f"--model {spec}: building the model raised {_line(exc)}") from None
    return CausalLM(model)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
