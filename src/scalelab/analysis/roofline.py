"""Per-layer roofline: analytic FLOPs and bytes against measured time, under measured ceilings.

A layer doing F FLOPs while moving B bytes (read input and weights, write output: the cost
table's `bytes_moved`) has arithmetic intensity AI = F / B. Under a compute ceiling P (FLOP/s,
the measured GEMM rate for the run's dtype) and a memory ceiling W (bytes/s, the measured copy
bandwidth, read + write) it can reach at most min(P, AI * W): it is memory-bound left of the
ridge AI = P / W and compute-bound right of it. The achieved rate is F / measured seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from scalelab.analysis.frame import label, layer_rows, ok_records, per_iteration, run_config
from scalelab.errors import UsageError
from scalelab.precision import get_precision
from scalelab.record_schema import ceilings_problem
from scalelab.workloads import WORKLOADS

CEILINGS_SCHEMA = "scalelab.ceilings/1"
LAYER_COLUMNS = [
    "run",
    "layer",
    "kind",
    "flops",
    "bytes",
    "ai",
    "seconds",
    "achieved",
    "peak_flops",
    "mem_bw",
    "attainable",
    "bound",
    "fraction",
    "flag",
]
# A point above its roof means the ceiling was measured too low (noise only slows a ceiling's
# measurement down), never that the layer beat the machine: it is flagged, not drawn silently.
UNDER_MEASURED = "ceiling under-measured"
# Layers of one run doing the same work (kind, FLOPs, bytes within BYTES_NEAR: AlexNet's c3
# and c5, whose biases differ by 128 floats) should take
# about the same time; beyond this ratio one of them was disturbed (seen: 67.8 vs 1.08 ms).
SAME_SHAPE_RATIO = 3.0
BYTES_NEAR = 0.05


# --- ceilings ------------------------------------------------------------------------------
def read_ceilings(path: str | Path) -> dict[str, Any]:
    """A `scalelab ceilings` file; UsageError when missing or of another schema."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such ceilings file (write one with `scalelab ceilings`)")
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{path}: not JSON (is this a ceilings file?)") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != CEILINGS_SCHEMA:
        raise UsageError(f"{path}: schema {schema!r}, expected {CEILINGS_SCHEMA!r}")
    wrong = ceilings_problem(data)
    if wrong is not None:
        raise UsageError(f"{path}: malformed ceilings file: {wrong}")
    return data


def ceilings_mismatch(ceilings: dict[str, Any], records: list[dict[str, Any]]) -> str | None:
    """A warning line when the ceilings were measured on another machine than the runs."""
    machine = ceilings.get("machine") or {}
    host, gpu = machine.get("hostname"), machine.get("gpu")
    hosts = {(r.get("env") or {}).get("hostname") for r in records} - {None}
    gpus = {(r.get("env") or {}).get("gpu_name") for r in records} - {None}
    if host and hosts and host not in hosts:
        return f"ceilings measured on {host}, runs on {', '.join(sorted(hosts))}"
    if gpu and gpus and gpu not in gpus:
        return f"ceilings measured on GPU {gpu}, runs on {', '.join(sorted(gpus))}"
    return None


def _rate(value: Any) -> float | None:
    """A positive number, or the all-cores entry of a CPU section; None otherwise."""
    if isinstance(value, dict):
        value = value.get("all_cores")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def device_peaks(ceilings: dict[str, Any], device: str, dtype: str) -> tuple[float, float]:
    """(compute FLOP/s, memory bytes/s) for runs on `device` in `dtype`.

    The ceilings' own device section answers when it matches (falling back to the fp32 GEMM
    for a dtype that was not measured); CPU runs measured against GPU ceilings use the CPU
    section. UsageError when neither holds a rate.
    """
    same = ceilings.get("device", "cpu") == device
    gemm = ceilings.get("gemm_flops") or {}
    flops = (_rate(gemm.get(dtype)) or _rate(gemm.get("fp32"))) if same else None
    bw = _rate(ceilings.get("mem_bw")) if same else None
    if device == "cpu":
        flops = flops or _rate(ceilings.get("cpu_gemm_flops"))
        bw = bw or _rate(ceilings.get("cpu_mem_bw"))
    if flops is None or bw is None:
        raise UsageError(
            f"the ceilings hold no {dtype} GEMM rate and memory bandwidth for {device}"
        )
    return flops, bw


def classify(ai: float, peak_flops: float, mem_bw: float) -> str:
    """'compute' at or right of the ridge AI = P / W, 'memory' left of it."""
    return "compute" if ai >= peak_flops / mem_bw else "memory"


def attainable(ai: float, peak_flops: float, mem_bw: float) -> float:
    return min(peak_flops, ai * mem_bw)


# --- per-layer points ----------------------------------------------------------------------
def layer_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in ok_records(records) if layer_rows(r)]


def layer_roofline(records: list[dict[str, Any]], ceilings: dict[str, Any]) -> pd.DataFrame:
    """One row per measured layer of every --per-layer record (columns LAYER_COLUMNS)."""
    rows = []
    for rec in layer_records(records):
        cfg = rec.get("config") or {}
        dtype = rec.get("precision") or cfg.get("dtype", "fp32")
        peak, bw = device_peaks(ceilings, cfg.get("device", "cpu"), dtype)
        costs = _cost_rows(rec)
        for layer in layer_rows(rec):
            row = _layer_point(rec, layer, costs, get_precision(dtype).itemsize)
            if row is None:
                continue
            ai = row["ai"]
            row.update(
                peak_flops=peak,
                mem_bw=bw,
                attainable=attainable(ai, peak, bw),
                bound=classify(ai, peak, bw),
            )
            row["fraction"] = row["achieved"] / row["attainable"] if row["attainable"] else math.nan
            row["flag"] = UNDER_MEASURED if row["fraction"] > 1.0 else ""
            rows.append(row)
    return same_shape_flags(pd.DataFrame(rows, columns=LAYER_COLUMNS))


def flag_lines(df: pd.DataFrame) -> list[str]:
    """The warnings a per-layer table's flags add up to: points above their roof, layers far
    from a layer of the same shape."""
    flags = df["flag"].fillna("")
    over = int(flags.str.contains(UNDER_MEASURED).sum())
    apart = int(flags.str.contains("(same shape)", regex=False).sum())
    out = []
    if over:
        out.append(f"{over} point(s) above their roof: {UNDER_MEASURED} (re-measure the "
                   "ceilings on a quiet machine)")  # fmt: skip
    if apart:
        out.append(f"{apart} layer(s) more than {SAME_SHAPE_RATIO:g}x from a layer of the same "
                   "shape: one of them was disturbed (busy host?)")  # fmt: skip
    return out


def same_shape_flags(df: pd.DataFrame) -> pd.DataFrame:
    """Flag the layers of a run whose time differs more than SAME_SHAPE_RATIO from a layer of
    the same kind, FLOPs and bytes: the slower named on the faster and the other way round."""
    for _, group in df.groupby(["run", "kind", "flops"], sort=False):
        if len(group) < 2:
            continue
        fast, slow = group["seconds"].idxmin(), group["seconds"].idxmax()
        ratio = df.at[slow, "seconds"] / df.at[fast, "seconds"]
        near = abs(df.at[slow, "bytes"] / df.at[fast, "bytes"] - 1) <= BYTES_NEAR
        if ratio <= SAME_SHAPE_RATIO or not near:
            continue
        for i, other, how in ((slow, fast, "slower"), (fast, slow, "faster")):
            note = f"{ratio:.3g}x {how} than {df.at[other, 'layer']} (same shape)"
            df.at[i, "flag"] = "; ".join(x for x in (df.at[i, "flag"], note) if x)
    return df


def _cost_rows(rec: dict[str, Any]) -> dict[str, Any]:
    try:
        workload = WORKLOADS.get(rec["workload"])(run_config(rec))
    except (UsageError, KeyError, TypeError):
        return {}  # a workload this install lacks: only layers carrying their own counts plot
    # --per-layer names a row by its module's dotted path; the table by the seed's name.
    rows = workload.cost_table()
    return {**{r.name: r for r in rows}, **{r.module: r for r in rows if r.module}}


def _layer_point(
    rec: dict[str, Any], layer: dict[str, Any], costs: dict[str, Any], itemsize: int
) -> dict[str, Any] | None:
    """FLOPs and bytes from the layer entry when it carries them, else the cost table at the
    batch one process ran (items per iteration or optimizer step / ranks)."""
    seconds = layer.get("seconds")
    name = layer["name"]
    if not isinstance(seconds, (int, float)) or seconds <= 0:
        return None
    batch = max(round(per_iteration(rec)[0] / rec.get("ranks", 1)), 1)
    cost = costs.get(name)
    flops = layer.get("flops", cost.flops * batch if cost else None)
    nbytes = layer.get("bytes", cost.bytes_moved(batch, itemsize) if cost else None)
    if flops is None or not nbytes:
        return None
    return {
        "run": label(rec),
        "layer": name,
        "kind": cost.kind if cost else layer.get("kind") or "?",
        "flops": float(flops),
        "bytes": float(nbytes),
        "ai": flops / nbytes,
        "seconds": float(seconds),
        "achieved": flops / seconds,
    }


# --- latency-bandwidth fit -----------------------------------------------------------------
def fit_alpha_beta(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares (alpha seconds, beta bytes/s) of t(n) = alpha + n / beta."""
    n, t = np.asarray(sizes, float), np.asarray(seconds, float)
    if len(set(n.tolist())) < 2:
        raise UsageError("an alpha-beta fit needs at least two different message sizes")
    a = np.stack([np.ones_like(n), n], axis=1)  # (points, 2): [1, n] @ [alpha, 1/beta]
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, t, rcond=None)
    beta = 1.0 / inv_beta if inv_beta > 0 else math.inf
    return float(alpha), float(beta)


def find_ceilings(results: str | Path, explicit: str | Path | None) -> Path | None:
    """--ceilings when given, else a ceilings.json beside the results (None when absent)."""
    if explicit is not None:
        return Path(explicit)
    results = Path(results)
    beside = (results if results.is_dir() else results.parent) / "ceilings.json"
    return beside if beside.is_file() else None


def ceilings_for(
    results: str | Path, explicit: str | Path | None, records: list[dict[str, Any]]
) -> tuple[dict[str, Any] | None, str | None]:
    """(ceilings or None, a warning when they were measured on another machine than the
    runs); --ceilings when given, else a ceilings.json beside the results."""
    path = find_ceilings(results, explicit)
    if path is None:
        return None, None
    ceilings = read_ceilings(path)
    return ceilings, ceilings_mismatch(ceilings, records)
