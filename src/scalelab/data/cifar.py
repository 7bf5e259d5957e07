"""CIFAR-10, "CIFAR-10 python version" (Krizhevsky 2009, cifar-10-python.tar.gz unpacked).

Each batch file (data_batch_1..5: 50,000 training images; test_batch: 10,000) is a pickled dict
written by Python 2: b"data" is a (10000, 3072) uint8 array, each row one 32x32 image stored
channel-major (1024 red, then 1024 green, then 1024 blue values, each plane row-major), and
b"labels" a list of 10000 ints in 0..9.

Unpickling can run arbitrary code, so the files are read with an unpickler that resolves only the
globals a NumPy array needs; anything else (os.system, ...) is refused with a UsageError.
"""

from __future__ import annotations

import codecs
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scalelab.errors import UsageError

CHANNELS, ROWS, COLS = 3, 32, 32
NUM_CLASSES = 10
BATCH_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch")  # read in this order
SUBDIR = "cifar-10-batches-py"  # what the archive unpacks to

# Per-channel mean and standard deviation of the 50,000 training images, pixels scaled to [0, 1]
# (computed over all 50000*32*32 pixels of each channel; the values widely quoted with the
# CIFAR-10 ResNet recipes, e.g. kuangliu/pytorch-cifar issue #19, which corrects the often
# copied (0.2023, 0.1994, 0.2010) that are not the per-pixel std).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

# The functions NumPy names in its pickles, taken from NumPy itself so that neither spelling of
# the module (numpy.core before NumPy 2, numpy._core after) has to be imported: protocol <= 4
# pickles rebuild arrays with _reconstruct + ndarray.__setstate__, protocol 5 with _frombuffer.
_RECONSTRUCT = np.zeros(1).__reduce__()[0]
_FROMBUFFER = np.zeros(1).__reduce_ex__(5)[0]
_ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    # Python 3 writes bytes as _codecs.encode(str, "latin1") under protocols 0-2.
    ("_codecs", "encode"): codecs.encode,
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """An unpickler whose only reachable globals are those that rebuild a NumPy array."""

    def __init__(self, path: Path, file: Any) -> None:
        # encoding="bytes": the batches are Python 2 pickles whose str keys arrive as bytes.
        super().__init__(file, encoding="bytes")
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UsageError(
                f"{self.path}: the CIFAR-10 reader refuses to load {module}.{name} "
                "(a CIFAR batch holds only arrays, lists and strings)"
            ) from None


def find_batches(data_dir: str | Path) -> list[Path]:
    """The batch files present in data_dir (or its cifar-10-batches-py/), in BATCH_FILES order."""
    root = Path(data_dir)
    if (root / SUBDIR).is_dir():
        root = root / SUBDIR
    found = [root / name for name in BATCH_FILES if (root / name).is_file()]
    if not found:
        raise UsageError(
            f"{data_dir}: no CIFAR-10 batches (expected {', '.join(BATCH_FILES)} "
            f"from cifar-10-python.tar.gz, directly or in {SUBDIR}/)"
        )
    return found


def _unpickle(path: Path) -> dict:
    with path.open("rb") as f:
        try:
            obj = _ArrayOnlyUnpickler(path, f).load()
        except UsageError:
            raise
        except Exception as err:  # a damaged pickle raises anything from EOFError to TypeError
            raise UsageError(f"{path}: not a readable CIFAR-10 batch ({err})") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{path}: a CIFAR-10 batch is a dict, found {type(obj).__name__}")
    return obj


def _field(batch: dict, key: str, path: Path) -> Any:
    """batch[key], whether the key was written as bytes (Python 2) or str (Python 3)."""
    for k in (key.encode(), key):
        if k in batch:
            return batch[k]
    raise UsageError(f"{path}: the batch has no {key!r} entry")


def read_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> images (n, 3, 32, 32) uint8 and labels (n,) int64 in 0..9."""
    path = Path(path)
    batch = _unpickle(path)
    data, labels = _field(batch, "data", path), _field(batch, "labels", path)
    per_image = CHANNELS * ROWS * COLS
    if not (
        isinstance(data, np.ndarray)
        and data.dtype == np.uint8
        and data.ndim == 2
        and data.shape[1] == per_image
    ):
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise UsageError(f"{path}: data must be (n, {per_image}) uint8, found {shape} {dtype}")
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"{path}: labels must be a list of integers") from None
    if labels.shape != (len(data),):
        raise UsageError(f"{path}: {len(data)} images but labels of shape {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise UsageError(f"{path}: labels must lie in 0..{NUM_CLASSES - 1}")
    # Row layout is channel-major then row-major, exactly (3, 32, 32) in C order.
    return data.reshape(-1, CHANNELS, ROWS, COLS), labels


def load_cifar10(data_dir: str | Path, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n images over the batches in BATCH_FILES order: (n, 3, 32, 32) uint8, (n,)."""
    images, labels, have = [], [], 0
    for path in find_batches(data_dir):
        if have >= n:
            break  # read no more files than needed
        x, y = read_batch(path)
        images.append(x)
        labels.append(y)
        have += len(y)
    if have < n:
        raise UsageError(f"{data_dir}: asked for {n} CIFAR-10 images, the batches hold {have}")
    x = np.concatenate(images)[:n]
    y = np.concatenate(labels)[:n]
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)


def pixel_table(mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """(C, 256) float32 with entry [c, v] = (v / 255 - mean[c]) / std[c], computed in float64
    and rounded once.

    prepare() gathers from this table instead of computing on the device: CUDA evaluates
    x / 255 as x * (1 / 255), which differs from CPU's and NumPy's true division in the last
    bit of some values, and that float32 noise would swamp every fp64 check against the oracle.
    A table lookup gives the same bits on every device, under autocast and torch.compile alike.
    """
    v = np.arange(256, dtype=np.float64) / 255
    m = np.asarray(mean, np.float64)[:, None]
    s = np.asarray(std, np.float64)[:, None]
    return ((v - m) / s).astype(np.float32)


def lookup_pixels(table: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """uint8 (N, C, ...) -> float32 table[c, x] on x's device; a 1-row table serves all C."""
    lut = torch.from_numpy(table).to(x.device)
    if lut.shape[0] == 1:
        return lut[0][x.int()]
    channel = torch.arange(lut.shape[0], device=x.device).view(1, -1, *([1] * (x.ndim - 2)))
    return lut[channel, x.int()]


def lookup_pixels_np(table: np.ndarray, x: np.ndarray) -> np.ndarray:
    """lookup_pixels() in NumPy, widened to float64 for the oracle."""
    x = np.asarray(x)
    if table.shape[0] == 1:
        return table[0][x].astype(np.float64)
    channel = np.arange(table.shape[0]).reshape(1, -1, *([1] * (x.ndim - 2)))
    return table[channel, x].astype(np.float64)
