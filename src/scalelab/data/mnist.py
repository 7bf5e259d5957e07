"""MNIST in its original IDX format (LeCun, Cortes & Burges), gzip-compressed or raw.

An IDX file is a big-endian header followed by a dense payload:
    magic (4 bytes: 0, 0, dtype code, number of dims) | one uint32 per dim | prod(dims) items.
MNIST uses dtype 0x08 (unsigned byte): images have magic 2051 (0x00000803, dims N, 28, 28),
labels magic 2049 (0x00000801, dims N). Every check below turns a damaged or mismatched file
into one UsageError line naming the file, never a NumPy reshape traceback.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scalelab.errors import UsageError

IMAGES_MAGIC = 2051  # uint8, 3 dims
LABELS_MAGIC = 2049  # uint8, 1 dim
ROWS = COLS = 28
NUM_CLASSES = 10
GZIP_MAGIC = b"\x1f\x8b"
SPLITS = ("train", "t10k")  # searched in this order


@dataclass(frozen=True)
class MnistSplit:
    """One split in transport form: images (N, 784) uint8, labels (N,) int64 in 0..9."""

    name: str  # "train" or "t10k"
    images: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def _read_bytes(path: Path) -> bytes:
    """The file's content, gunzipped when it starts with the gzip magic (whatever its name)."""
    data = path.read_bytes()
    if data[:2] != GZIP_MAGIC:
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as err:
        raise UsageError(f"{path}: corrupt gzip stream ({err})") from None


def _parse_idx(path: Path, magic: int, ndim: int) -> tuple[tuple[int, ...], np.ndarray]:
    """Check the header of an IDX file and return (dims, flat uint8 payload)."""
    data = _read_bytes(path)
    header = 4 + 4 * ndim
    if len(data) < header:
        raise UsageError(f"{path}: {len(data)} bytes is shorter than an IDX header")
    found = struct.unpack(">I", data[:4])[0]
    if found != magic:
        raise UsageError(f"{path}: IDX magic number {found}, expected {magic}")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected = int(np.prod(dims, dtype=np.int64))
    if len(data) - header != expected:
        raise UsageError(
            f"{path}: payload has {len(data) - header} bytes but the header {dims} "
            f"promises {expected} (truncated or padded file)"
        )
    return dims, np.frombuffer(data, np.uint8, offset=header)


def read_images(path: str | Path) -> np.ndarray:
    """An IDX image file -> (N, 784) uint8, each row one 28x28 image in row-major order."""
    path = Path(path)
    (n, rows, cols), payload = _parse_idx(path, IMAGES_MAGIC, 3)
    if (rows, cols) != (ROWS, COLS):
        raise UsageError(f"{path}: images are {rows}x{cols}, MNIST images are {ROWS}x{COLS}")
    return payload.reshape(n, rows * cols)


def read_labels(path: str | Path) -> np.ndarray:
    """An IDX label file -> (N,) int64, every label in 0..9."""
    path = Path(path)
    _, payload = _parse_idx(path, LABELS_MAGIC, 1)
    if payload.size and payload.max() >= NUM_CLASSES:
        raise UsageError(f"{path}: label {payload.max()} outside 0..{NUM_CLASSES - 1}")
    return payload.astype(np.int64)


def _stems(split: str) -> tuple[str, str]:
    """File names of a split's images and labels, without the optional .gz."""
    return f"{split}-images-idx3-ubyte", f"{split}-labels-idx1-ubyte"


def _split_files(data_dir: Path, split: str) -> tuple[Path | None, Path | None]:
    """(images, labels) paths of a split, raw name preferred over .gz; None where absent."""

    def find(stem: str) -> Path | None:
        for name in (stem, stem + ".gz"):
            if (data_dir / name).is_file():
                return data_dir / name
        return None

    images, labels = _stems(split)
    return find(images), find(labels)


def available_splits(data_dir: str | Path) -> list[str]:
    """The splits whose image and label files are both in data_dir, train first.

    A split with only one of its two files is an error (a half-copied data set), and so is a
    folder with no split at all; both errors name the files expected.
    """
    data_dir = Path(data_dir)
    found = []
    for split in SPLITS:
        images, labels = _split_files(data_dir, split)
        if (images is None) != (labels is None):
            missing = _stems(split)[0 if images is None else 1]
            raise UsageError(f"{data_dir}: has {(images or labels).name} but no {missing}[.gz]")
        if images is not None:
            found.append(split)
    if not found:
        expected = " and ".join(f"{stem}[.gz]" for stem in _stems("train"))
        fallback = " and ".join(f"{stem}[.gz]" for stem in _stems("t10k"))
        raise UsageError(f"{data_dir}: no MNIST files; expected {expected}, or {fallback}")
    return found


def load_split(data_dir: str | Path, split: str) -> MnistSplit:
    """Read one split's images and labels and check that they describe the same items."""
    images_path, labels_path = _split_files(Path(data_dir), split)
    if images_path is None or labels_path is None:
        raise UsageError(f"{data_dir}: MNIST split {split!r} is incomplete or absent")
    images, labels = read_images(images_path), read_labels(labels_path)
    if len(images) != len(labels):
        raise UsageError(
            f"{data_dir}: {images_path.name} has {len(images)} images but "
            f"{labels_path.name} has {len(labels)} labels"
        )
    return MnistSplit(split, images, labels)
