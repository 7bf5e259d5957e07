"""Autotuning results kept on disk, so a second process skips what the first one measured.

The fast path's setup times every candidate of every stage and Triton autotunes its kernels'
tile shapes: on an H100 the first AlexNet setup took 167 s. What those searches find depends
only on the GPU, its driver, torch, triton and the shapes, so it is cached under exactly that
key. A hit is still validated against the torch reference before use (pipeline.py); only the
timing is skipped.

Location: $SCALELAB_TUNING_CACHE, else $XDG_CACHE_HOME/scalelab/tuning, else
~/.cache/scalelab/tuning; SCALELAB_TUNING_CACHE=off disables it. One JSON file per machine
fingerprint, updated read-modify-write under an exclusive flock and replaced atomically, so
ranks that tune at the same time never lose each other's entries nor read a torn file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

OFF = "off"


def cache_dir() -> Path | None:
    given = os.environ.get("SCALELAB_TUNING_CACHE")
    if given == OFF:
        return None
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "scalelab" / "tuning"


@lru_cache(maxsize=8)
def fingerprint(device_type: str) -> dict[str, str]:
    """What a tuning result is only valid for: the device, its driver, torch and triton."""
    from scalelab.environment import nvidia_driver

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = torch.cuda.get_device_name() if device_type == "cuda" else device_type
    return {
        "device": gpu,
        "driver": str(nvidia_driver() if device_type == "cuda" else None),
        "torch": torch.__version__,
        "triton": triton_version,
        "interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }


def _file(folder: Path, device_type: str) -> Path:
    text = json.dumps(fingerprint(device_type), sort_keys=True)
    return folder / f"tuning-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def entry_key(*parts: Any) -> str:
    """One cache key from shapes, names and dtypes (stable across processes)."""
    return "|".join(str(p) for p in parts)


def lookup(device_type: str, key: str) -> Any | None:
    """The cached value for key on this machine, or None (no cache, no entry, unreadable)."""
    folder = cache_dir()
    if folder is None:
        return None
    return _read(_file(folder, device_type)).get(key)


def store(device_type: str, key: str, value: Any) -> None:
    """Add key -> value (JSON-serialisable). A cache that cannot be written is skipped: tuning
    again next time is the only cost."""
    folder = cache_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = _file(folder, device_type)
        with _locked(path.with_suffix(".lock")):
            entries = _read(path)
            entries[key] = value
            _replace(path, {"fingerprint": fingerprint(device_type), "entries": entries})
    except OSError:
        return


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    entries = doc.get("entries") if isinstance(doc, dict) else None
    return entries if isinstance(entries, dict) else {}


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _replace(path: Path, doc: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
