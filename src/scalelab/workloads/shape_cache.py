"""Layer shapes kept on disk, so a second process skips the meta-device shape probe.

The probe (layers.layer_shapes) costs ~1 s per process however small the model: torch's meta
kernels for addmm and relu are Python decompositions wrapped in `torch._disable_dynamo`, whose
first call imports torch._dynamo. Every process that builds a cost table (run, predict, plan)
paid it. The shapes depend only on the layers' code and state and the item shape, so they are
cached under a key made of exactly those: torch's version, the source of scalelab and of every
file defining a module class of the layers, each submodule's type, attributes (by value or
repr) and parameter/buffer shapes, the layer names and the item shape. A layer the key cannot
describe (a module without a source file, a forward hook) probes every time.

Location: $SCALELAB_SHAPE_CACHE, else $XDG_CACHE_HOME/scalelab/shapes, else
~/.cache/scalelab/shapes; SCALELAB_SHAPE_CACHE=off disables it. One small JSON file per key,
written to a temporary file and renamed into place, so concurrent writers (ranks, pytest
workers) never leave a torn file; they would write the same content anyway.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
from collections.abc import Sequence
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

OFF = "off"
Shapes = list[tuple[tuple[int, ...], tuple[int, ...]]]
_PLAIN = (bool, int, float, str, type(None))


def cache_dir() -> Path | None:
    given = os.environ.get("SCALELAB_SHAPE_CACHE")
    if given == OFF:
        return None
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "scalelab" / "shapes"


@cache
def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@lru_cache(maxsize=1)
def _scalelab_digest() -> str:
    """Every .py file of the installed scalelab package (the glue modules' forwards live here)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(_file_digest(str(path)).encode())
    return h.hexdigest()


def _plain(value: Any) -> Any:
    """A JSON form of a plain attribute value, or None where it is not plain."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return None if any(i is None for i in items) else items
    if isinstance(value, torch.dtype):
        return str(value)
    return None


def _describe(module: Any) -> list[Any] | None:
    """What the module's output shape can depend on, or None when the key cannot say it."""
    if not isinstance(module, nn.Module):
        return None
    parts: list[Any] = []
    for name, m in module.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return None
        try:
            source = inspect.getsourcefile(type(m))
        except TypeError:
            return None
        if source is None or not os.path.exists(source):
            return None
        attrs = {}
        for key, value in sorted(vars(m).items()):
            if key.startswith("_") or isinstance(value, (nn.Module, torch.Tensor)):
                continue
            # an object's repr (an HF config prints its fields); one showing an address
            # (a function, a plain object) changes every process: a miss, never a stale hit
            attrs[key] = _plain(value) if _plain(value) is not None else repr(value)
        tensors = [
            (n, list(t.shape), str(t.dtype))
            for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
            if t is not None
        ]
        qualname = f"{type(m).__module__}.{type(m).__qualname__}"
        parts.append([name, qualname, _file_digest(source), attrs, tensors])
    return parts


def key(names: Sequence[str], modules: Sequence[Any], item_shape: tuple[int, ...]) -> str | None:
    """The cache key of these layers on this item shape, or None when it cannot be formed."""
    described = [_describe(m) for m in modules]
    if any(d is None for d in described):
        return None
    text = json.dumps(
        [torch.__version__, _scalelab_digest(), list(item_shape), list(names), described],
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def lookup(cache_key: str) -> Shapes | None:
    folder = cache_dir()
    if folder is None:
        return None
    try:
        rows = json.loads((folder / f"{cache_key}.json").read_text())
        return [(tuple(i), tuple(o)) for i, o in rows]
    except (OSError, ValueError, TypeError):
        return None


def store(cache_key: str, shapes: Shapes) -> None:
    """Write the shapes; a cache that cannot be written is skipped (the next process probes)."""
    folder = cache_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump([[list(i), list(o)] for i, o in shapes], f)
        os.replace(tmp, folder / f"{cache_key}.json")
    except OSError:
        return
