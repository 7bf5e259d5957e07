"""Output locations checked before any work: a run that would fail to write its record,
weights, checkpoints or traces at the end is refused at the start (exit 2, nothing written).

A location is writable when its nearest existing ancestor is a directory we may write into
and no path component on the way is a regular file. Nothing is created here.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from scalelab.errors import UsageError


def check_file(path: str | os.PathLike, flag: str) -> Path:
    """path will be created or appended to as a regular file."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {p}: is a directory (give a file name)")
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{flag} {p}: not writable")
    _check_parent(p.parent, flag, p)
    return p


def check_dir(path: str | os.PathLike, flag: str) -> Path:
    """path is a folder that will be created if needed and written into."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {p}: exists and is not a directory")
    if p.is_dir():
        if not _can_create_in(p):
            raise UsageError(f"{flag} {p}: not writable")
        return p
    _check_parent(p.parent, flag, p)
    return p


def _check_parent(parent: Path, flag: str, target: Path) -> None:
    existing = parent if str(parent) else Path(".")
    while not existing.exists():
        if existing.is_symlink():  # a dangling link: mkdir would fail at the end
            raise UsageError(f"{flag} {target}: {existing} is a broken link")
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {target}: {existing} is a file, not a directory")
    if not _can_create_in(existing):
        raise UsageError(f"{flag} {target}: cannot create files under {existing} (not writable)")


def _can_create_in(folder: Path) -> bool:
    """Try it (root passes every os.access test, /proc refuses anyway): an anonymous file
    that vanishes when closed, so nothing is left behind."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def check_run_outputs(cfg, results: Path | None) -> None:
    """Every place a run writes: the record, --save-weights, checkpoints, traces."""
    if results is not None:
        check_file(results, "--out")
    if cfg.save_weights is not None:
        check_file(cfg.save_weights, "--save-weights")
    if cfg.ckpt_dir is not None and cfg.ckpt_every is not None:
        check_dir(cfg.ckpt_dir, "--ckpt-dir")
    if cfg.trace is not None:
        check_dir(cfg.trace, "--trace")


def inside(folder: Path, name: str, what: str) -> Path:
    """folder / name, refused when name (user text) would leave folder (`../../x`, `/etc`)."""
    candidate = (folder / name).resolve()
    if candidate != folder.resolve() and folder.resolve() not in candidate.parents:
        raise UsageError(f"{what} {name!r} leaves {folder}/ (use a plain name)")
    if not name or name.strip(". ") == "" or "/" in name or "\\" in name:
        raise UsageError(f"{what} {name!r} must be a plain name without '/'")
    return folder / name
