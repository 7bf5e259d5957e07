"""Finding a user's model: `--model MODULE:FACTORY` and the `scalelab.workloads` entry points.

MODULE is an importable module (`torchvision.models`, `mypkg.nets`) or a path to a .py file
(`examples/models/rescnn.py`); FACTORY is a callable in it returning an nn.Module, called with
the `--model-arg KEY=VALUE` pairs as keyword arguments (values read as Python literals, else
kept as text). Every way this can go wrong is one UsageError line naming the spec.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scalelab.errors import UsageError
from scalelab.workloads import hf_models

GROUP = "scalelab.workloads"  # entry-point group: name -> "module:factory"


def parse_model_args(items: tuple[str, ...]) -> dict[str, Any]:
    """("width=8", "name=tiny") -> {"width": 8, "name": "tiny"}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise UsageError(f"--model-arg {item!r}: expected KEY=VALUE, KEY a Python name")
        try:
            out[key.strip()] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key.strip()] = text  # plain words stay text: name=tiny
    return out


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable a MODULE:FACTORY spec names (a dotted FACTORY walks attributes); an
    `hf:SPEC` names a Hugging Face causal LM's builder (hf_models.py)."""
    if hf_models.is_hf(spec):
        return hf_models.factory(spec)
    obj = load_object(spec)
    if not callable(obj):
        attr = spec.rpartition(":")[2]
        raise UsageError(f"--model {spec}: {attr} is a {type(obj).__name__}, not a callable")
    return obj


def load_object(spec: str, flag: str = "--model") -> Any:
    """The object a MODULE:NAME spec names (a dotted NAME walks attributes)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        what = "MODULE:FACTORY" if flag == "--model" else "MODULE:NAME"
        raise UsageError(f"{flag} {spec!r}: expected {what} (module or .py path)")
    module = _import(spec, module_name)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{flag} {spec}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


# Packages a README line's model comes from that scalelab's own install does not bring.
OPTIONAL = {
    "torchvision": 'pip install "scalelab[vision]" (torchvision, the build that matches '
    "your torch)",
}


def _import(spec: str, name: str):
    if name.endswith(".py") or "/" in name or "\\" in name:
        return _import_path(spec, Path(name))
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        fix = f": {OPTIONAL[top]}" if top in OPTIONAL else ""
        raise UsageError(f"--model {spec}: no module named {exc.name!r}{fix}") from None
    except Exception as exc:  # the user's module failed while importing
        raise UsageError(f"--model {spec}: importing {name} raised {_one_line(exc)}") from None


def _import_path(spec: str, path: Path):
    """A .py file as a module, under a name unique to its resolved path (imported once)."""
    if not path.is_file():
        raise UsageError(f"--model {spec}: no such file {path}")
    resolved = path.resolve()
    name = f"scalelab_user_{path.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise UsageError(f"--model {spec}: importing {path} raised {_one_line(exc)}") from None
    return module


def call_factory(spec: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> nn.Module:
    """factory(**kwargs), refused in one line unless it returns an nn.Module."""
    try:
        module = factory(**kwargs)
    except Exception as exc:
        raise UsageError(f"--model {spec}: the factory raised {_one_line(exc)}") from None
    if not isinstance(module, nn.Module):
        raise UsageError(
            f"--model {spec}: the factory returned {type(module).__name__}, not a torch.nn.Module"
        )
    return module


def check_vocab(spec: str, model: nn.Module, top: torch.Tensor, vocab: int) -> None:
    """One item of the largest token id --vocab allows (top: (1, L), every id vocab - 1)
    through the model: refused in one line, naming the embedding it overflows, before any
    work (it would end in an IndexError deep inside a strategy)."""
    over: list[tuple[str, int]] = []

    def look(name: str) -> Callable[..., None]:
        def hook(module: nn.Embedding, args: tuple) -> None:
            ids = args[0] if args else None
            if not torch.is_tensor(ids) or ids.is_floating_point() or not ids.numel():
                return
            if int(ids.max()) >= module.num_embeddings:
                over.append((name, module.num_embeddings))

        return hook

    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    handles = [m.register_forward_pre_hook(look(n)) for n, m in embeddings]
    failed = None
    try:
        with torch.no_grad():
            model.eval()(top)
    except (IndexError, RuntimeError) as exc:
        failed = exc
    finally:
        for h in handles:
            h.remove()
    if over:
        name, rows = over[0]
        raise UsageError(
            f"--vocab {vocab}: token ids reach {vocab - 1} but the model's embedding {name!r} has "
            f"{rows} rows; pass --vocab {rows} or less"
        )
    if failed is not None:
        raise UsageError(
            f"--model {spec}: token id {vocab - 1} (--vocab {vocab}) fails in its forward: "
            f"{_one_line(failed)}; pass a smaller --vocab"
        )


def registered_models() -> dict[str, str]:
    """Entry points of group `scalelab.workloads`: workload name -> "module:factory"."""
    return {ep.name: ep.value for ep in entry_points(group=GROUP)}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
