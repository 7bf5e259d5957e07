"""Memory and power per layer from `--per-layer` records.

A per-layer record carries `per_layer`: [{layer, kind, seconds, out_bytes, peak_mem_bytes}]
(peak memory on CUDA only); an `--nvml` record carries `nvml` with whole-run power and per-phase
peak memory and energy. Entries are read defensively (frame.layer_rows): a field the run did
not measure is a missing value, never an error.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from scalelab.analysis.frame import label, layer_rows, ok_records, per_iteration

COLUMNS = ["run", "layer", "kind", "ms", "out_MB", "peak_MB", "power_W", "flag"]
# The row that makes a run's layers add up to the wall they are shown with (seen: AlexNet's
# layer medians summed to 492 ms in a 286.85 ms wall, and nothing said so).
REST = "(wall - layers)"
EXCEEDS = "layers exceed the wall"


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else float("nan")


def layer_table(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per measured layer: time (ms), output and peak memory (MB), power (W); then
    per run a REST row: the wall of one iteration (training: one step) less the layers, so
    the column adds up to the wall, flagged EXCEEDS when the layers' medians sum above it."""
    rows = []
    for rec in ok_records(records):
        mine = [
            {
                "run": label(rec),
                "layer": layer["name"] or "?",
                "kind": layer["kind"] or "?",
                "ms": _number(layer["seconds"]) * 1e3,
                "out_MB": _number(layer["out_bytes"]) / 1e6,
                "peak_MB": _number(layer["peak_bytes"]) / 1e6,
                "power_W": _number(layer["power_w"]),
                "flag": "",
            }
            for layer in layer_rows(rec)
        ]
        rows += mine + ([rest_row(rec, mine)] if mine else [])
    return pd.DataFrame(rows, columns=COLUMNS)


def rest_row(rec: dict[str, Any], layers: list[dict[str, Any]]) -> dict[str, Any]:
    """The wall less the layers' medians: what no layer accounts for (the loss, backward,
    glue between modules), or a flagged negative when the medians sum above the wall (each a
    median over its own calls, with the hooks' synchronisation: not one iteration)."""
    wall_ms = per_iteration(rec)[1] * 1e3
    rest = wall_ms - sum(r["ms"] for r in layers if r["ms"] == r["ms"])
    flag = f"{EXCEEDS} {wall_ms:.4g} ms by {-rest:.4g} ms" if rest < 0 else ""
    nan = float("nan")
    return {"run": layers[0]["run"], "layer": REST, "kind": "other", "ms": rest, "out_MB": nan,
            "peak_MB": nan, "power_W": nan, "flag": flag}  # fmt: skip


def nvml_phase_table(records: list[dict[str, Any]]) -> pd.DataFrame:
    """NVML (`--nvml`) per phase: peak device memory and energy, with the run's mean power."""
    rows = []
    for rec in ok_records(records):
        nvml = rec.get("nvml")
        if not isinstance(nvml, dict):
            continue
        for phase, v in (nvml.get("phases") or {}).items():
            count = max(int(v.get("count") or 1), 1)
            rows.append(
                {
                    "run": label(rec),
                    "phase": phase,
                    "calls": count,
                    "peak_MB": _number(v.get("peak_mem_bytes")) / 1e6,
                    "J per call": _number(v.get("energy_j")) / count,
                    "run mean W": _number(nvml.get("mean_power_w")),
                    "run max W": _number(nvml.get("max_power_w")),
                }
            )
    return pd.DataFrame(rows)
