"""Memory, time and power per layer, from records (the model-parallel seed's Tasks 2 and 3).

Two kinds of record feed it:

- `scalelab run ... --per-layer [--nvml]` records: per-layer rows (time, output bytes,
  allocator peak, power) from the forward hooks of instrument/per_layer.py, read through
  analysis.frame.layer_rows. `per_layer_frame` flattens them with their order;
  `kind_totals` sums them per layer kind; `swap_layers` / `swap_summary` set a run with
  `--swap-relu-pool` beside the same run without (Task 3: ReLU after the pool reads and
  writes a quarter of the activations).
- layer-study records (benchmarks/layer_memory_power.py, `kind: "layer_study"`): one row per
  layer type run alone on the seed's input sizes with NVML sampling: allocator peak, time,
  mean power and energy (Task 2). `layer_type_table` reads them.

Fields a run did not measure are missing values (NaN), never errors.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from scalelab.analysis.frame import config_of, experiment_key, label, layer_rows
from scalelab.record_schema import FINISHED

MB = 1e6
PER_LAYER_COLUMNS = [
    "run", "workload", "swap", "position", "layer", "kind", "ms", "out_MB", "peak_MB", "power_W",
]  # fmt: skip
LAYER_TYPE_COLUMNS = [
    "run", "kind", "input_shape", "ms", "out_MB", "peak_MB", "power_W", "energy_J", "device",
]  # fmt: skip


def _number(value: Any, scale: float = 1.0) -> float:
    return float(value) * scale if isinstance(value, (int, float)) else float("nan")


def _ok(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("status", "ok") in FINISHED]


def per_layer_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per layer of every --per-layer run, in execution order: median ms, output MB,
    allocator peak MB (CUDA) and mean power W (with --nvml)."""
    rows = []
    for rec in _ok(records):
        swap = bool(config_of(rec).get("swap_relu_pool", False))
        for i, layer in enumerate(layer_rows(rec)):
            rows.append(
                {
                    "run": label(rec, ["batch"]),
                    "workload": rec.get("workload"),
                    "swap": swap,
                    "position": i,
                    "layer": layer["name"] or "?",
                    "kind": layer["kind"] or "?",
                    "ms": _number(layer["seconds"], 1e3),
                    "out_MB": _number(layer["out_bytes"], 1 / MB),
                    "peak_MB": _number(layer["peak_bytes"], 1 / MB),
                    "power_W": _number(layer["power_w"]),
                }
            )
    return pd.DataFrame(rows, columns=PER_LAYER_COLUMNS)


def kind_totals(frame: pd.DataFrame) -> pd.DataFrame:
    """Per run and layer kind: layers, total ms, total output MB, largest peak MB."""
    if frame.empty:
        return pd.DataFrame(columns=["run", "kind", "layers", "ms", "out_MB", "peak_MB"])
    grouped = frame.groupby(["run", "kind"], sort=False)
    out = grouped.agg(
        layers=("layer", "size"),
        ms=("ms", "sum"),
        out_MB=("out_MB", "sum"),
        peak_MB=("peak_MB", "max"),
    )
    return out.reset_index()


def _swap_pairs(records: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """(normal, swapped) runs of the same experiment (config equal but swap_relu_pool)."""
    drop = frozenset({"swap_relu_pool"})
    runs = [r for r in _ok(records) if layer_rows(r)]
    normal = {experiment_key(r, drop): r for r in runs if not config_of(r).get("swap_relu_pool")}
    pairs = []
    for rec in runs:
        key = experiment_key(rec, drop)
        if config_of(rec).get("swap_relu_pool") and key in normal:
            pairs.append((normal[key], rec))
    return pairs


def swap_layers(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Both orders layer by layer, side by side by position (the names at a position differ
    where ReLU and pool traded places): ms and output MB of each."""
    frames = []
    for pair_id, (normal, swapped) in enumerate(_swap_pairs(records)):
        a, b = per_layer_frame([normal]), per_layer_frame([swapped])
        both = a.merge(b, on="position", suffixes=("_normal", "_swapped"))
        both.insert(0, "pair", pair_id)
        both.insert(1, "workload", normal.get("workload"))
        frames.append(
            both[
                [
                    "pair",
                    "workload",
                    "position",
                    "layer_normal",
                    "kind_normal",
                    "ms_normal",
                    "out_MB_normal",
                    "layer_swapped",
                    "kind_swapped",
                    "ms_swapped",
                    "out_MB_swapped",
                ]
            ]  # fmt: skip
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def swap_summary(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Per layer kind and in total: output MB and ms in each order, and the change (%)."""
    rows = []
    for pair_id, (normal, swapped) in enumerate(_swap_pairs(records)):
        a = per_layer_frame([normal]).groupby("kind")[["ms", "out_MB"]].sum()
        b = per_layer_frame([swapped]).groupby("kind")[["ms", "out_MB"]].sum()
        a.loc["total"], b.loc["total"] = a.sum(), b.sum()
        wall_a, wall_b = normal.get("wall_s"), swapped.get("wall_s")
        for kind in a.index:
            rows.append(
                {
                    "pair": pair_id,
                    "workload": normal.get("workload"),
                    "batch": config_of(normal).get("batch"),
                    "device": config_of(normal).get("device"),
                    "kind": kind,
                    "out_MB_normal": a.at[kind, "out_MB"],
                    "out_MB_swapped": b.at[kind, "out_MB"],
                    "ms_normal": a.at[kind, "ms"],
                    "ms_swapped": b.at[kind, "ms"],
                    "run_ms_normal": _number(wall_a, 1e3),
                    "run_ms_swapped": _number(wall_b, 1e3),
                }
            )
    out = pd.DataFrame(rows)
    if not out.empty:
        out["out_change_pct"] = 100 * (out["out_MB_swapped"] / out["out_MB_normal"] - 1)
        out["ms_change_pct"] = 100 * (out["ms_swapped"] / out["ms_normal"] - 1)
    return out


def layer_type_table(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per layer type of every layer-study record (memory, time, power, energy)."""
    rows = []
    for rec in _ok(records):
        if rec.get("kind") != "layer_study":
            continue
        for row in rec.get("layers", []):
            rows.append(
                {
                    "run": rec.get("label") or rec.get("id"),
                    "kind": row.get("kind"),
                    "input_shape": json.dumps(row.get("input_shape")),
                    "ms": _number(row.get("seconds"), 1e3),
                    "out_MB": _number(row.get("out_bytes"), 1 / MB),
                    "peak_MB": _number(row.get("peak_mem_bytes"), 1 / MB),
                    "power_W": _number(row.get("mean_power_w")),
                    "energy_J": _number(row.get("energy_j")),
                    "device": rec.get("device"),
                }
            )
    return pd.DataFrame(rows, columns=LAYER_TYPE_COLUMNS)
