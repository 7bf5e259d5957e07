"""Tokens per second and MFU for a token model (an (N, T) int64 input: Workload.tokens_per_item).

    tokens_per_s             = items/s (all ranks; training: the steady part's) x T
    tokens_per_s_per_device  = tokens_per_s / ranks (one device per rank)
    flops_per_token          = the cost table's forward FLOPs per item (x 3 when training:
                               backward = 2 forwards, as achieved_tflops counts) / T
    mfu                      = flops_per_token x tokens_per_s_per_device / peak

Two peaks, each named in the record: `measured`, the ceilings file's GEMM rate for the run's
dtype (`scalelab ceilings`, the file beside the results, measured on this host and device),
and `datasheet`, the device's vendor figure (instrument/peaks.py) where the device has one.
A peak that is missing leaves its MFU out and says why (`measured_peak.missing`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scalelab.errors import UsageError
from scalelab.instrument import peaks
from scalelab.instrument.ceilings import mismatches, read_ceilings


def fields(rec: dict[str, Any], tokens_per_item: int, ceilings_path: Path | None) -> dict:
    """The record's `tokens_per_s`, `tokens_per_s_per_device` and `mfu`."""
    # training: the steady part's rate (the first steps pay for initialisation and compiling,
    # a whole 40-step run on one H200 read 13% MFU where its steady steps ran at 27%)
    steady = rec.get("steady_throughput")
    basis = "steady" if isinstance(steady, (int, float)) and steady > 0 else "whole run"
    tokens = (steady if basis == "steady" else rec["throughput"]) * tokens_per_item
    per_device = tokens / max(rec["ranks"], 1)
    per_token = rec["flops_per_item"] * (3 if rec["mode"] == "train" else 1) / tokens_per_item
    dtype = rec["precision"]
    gpu = rec["env"].get("gpu_name") if rec["config"]["device"] != "cpu" else None
    mfu = peaks.mfu(per_token, per_device, dtype, measured_peak(ceilings_path, dtype, rec), gpu)
    mfu["basis"] = basis
    return {"tokens_per_s": tokens, "tokens_per_s_per_device": per_device, "mfu": mfu}


def measured_peak(path: Path | None, dtype: str, rec: dict) -> tuple[float | None, str]:
    """(GEMM FLOP/s, where it comes from), or (None, why there is none)."""
    if path is None or not path.is_file():
        return None, f"no ceilings file at {path} (scalelab ceilings -o {path})"
    try:
        data = read_ceilings(path)
    except UsageError as exc:
        return None, str(exc)
    on = data.get("machine", {})
    diffs = mismatches(on, rec["env"])
    device = "cuda" if rec["config"]["device"] != "cpu" else "cpu"
    if diffs or data.get("device") != device:
        why = "; ".join(diffs) or f"measured on {data.get('device')}, the run on {device}"
        return None, f"{path} does not describe this device ({why})"
    rate = (data.get("gemm_flops") or {}).get(dtype)
    if not rate:
        return None, f"{path} holds no {dtype} GEMM rate"
    return (
        rate,
        f"{path}: gemm_flops.{dtype}, measured {on.get('date', '?')} on {on.get('hostname')}",
    )


def summary_line(rec: dict[str, Any]) -> str | None:
    """`  tokens: 1.2e+04 tok/s (6.1e+03 per device) | MFU 31.2% of the measured fp32 GEMM
    peak, 12.0% of H200 SXM's datasheet`, for a record that has them."""
    if "tokens_per_s" not in rec:
        return None
    mfu = rec["mfu"]
    parts = []
    if mfu.get("measured") is not None:
        parts.append(f"{mfu['measured']:.1%} of the measured {mfu['dtype']} GEMM peak")
    if mfu.get("datasheet") is not None:
        name = mfu["datasheet_peak"]["source"].split(":")[0]
        parts.append(f"{mfu['datasheet']:.1%} of {name}'s datasheet {mfu['dtype']} peak")
    text = "MFU " + ", ".join(parts) if parts else "MFU: no peak (scalelab ceilings measures it)"
    return (f"  tokens: {rec['tokens_per_s']:.4g} tok/s ({rec['tokens_per_s_per_device']:.4g}"
            f" per device) | {text}")  # fmt: skip
