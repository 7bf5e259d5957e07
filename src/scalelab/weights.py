"""Load and save model weights: torch state_dict files and safetensors, checked key by key.

Safetensors files are read by the `safetensors` library when it is installed; otherwise (and
for writing) by the format itself (8-byte little-endian header length, a JSON header of name ->
dtype, shape, byte offsets, then the raw buffer), so the dependency stays optional.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

import torch
from torch import nn

from scalelab.errors import UsageError

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if importlib.util.find_spec("safetensors") is not None:  # the library when installed
        return _read_with_library(path)
    data = path.read_bytes()
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        if not isinstance(header, dict):
            raise TypeError(f"header is a JSON {type(header).__name__}, not an object")
        base = 8 + size
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            buf = bytearray(data[base + begin : base + end])
            t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
            tensors[name] = t.reshape(info["shape"])
    except (struct.error, ValueError, KeyError, RuntimeError, TypeError, AttributeError) as exc:
        raise UsageError(f"--weights {path}: not a readable safetensors file ({exc})") from None
    return tensors


def _read_with_library(path: Path) -> dict[str, torch.Tensor]:
    """The `safetensors` package's reader (the hand reader above is its fallback)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UsageError(f"--weights {path}: not a readable safetensors file ({exc})") from None


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8-byte alignment
    _atomic_write(path, struct.pack("<Q", len(blob)) + blob + b"".join(chunks))


def load_weights(model: nn.Module, path: str) -> None:
    """Load a state_dict into model; a mismatch names the first wrong key and its shapes."""
    p = Path(path)
    if p.suffix == ".safetensors":
        state = read_safetensors(p)
    else:
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several unrelated types for a bad file
            raise UsageError(
                f"--weights {p}: not a torch state_dict ({type(exc).__name__})"
            ) from None
    if not isinstance(state, dict):
        raise UsageError(f"--weights {p}: holds a {type(state).__name__}, not a state_dict")
    check_state_dict(model.state_dict(), state, p)
    model.load_state_dict(state)


def check_state_dict(
    want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], path: Path
) -> None:
    for key, tensor in want.items():
        if key not in got:
            raise UsageError(f"--weights {path}: missing key {key!r} (shape {tuple(tensor.shape)})")
        if tuple(got[key].shape) != tuple(tensor.shape):
            raise UsageError(
                f"--weights {path}: key {key!r} has shape {tuple(got[key].shape)}, "
                f"the model needs {tuple(tensor.shape)}"
            )
    extra = [k for k in got if k not in want]
    if extra:
        raise UsageError(f"--weights {path}: unexpected key {extra[0]!r} (another workload?)")


def save_weights(model: nn.Module, path: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if p.suffix == ".safetensors":
        write_safetensors(p, state)
    else:
        tmp = p.with_name(p.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, p)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
