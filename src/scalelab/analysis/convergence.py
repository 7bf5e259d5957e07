"""Convergence of training runs: per-epoch loss and held-out accuracy from the records."""

from __future__ import annotations

from typing import Any

import pandas as pd

from scalelab.analysis.frame import differing_keys, label, ok_records

CURVE_COLUMNS = ["id", "run", "epoch", "loss", "accuracy"]
FINAL_COLUMNS = ["run", "epochs", "steps", "items", "wall_s", "final_loss", "final_accuracy"]


def training_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in ok_records(records) if r.get("mode") == "train" and r.get("loss")]


def _labels(recs: list[dict[str, Any]]) -> list[str]:
    """Run names that show the config keys telling the runs apart (lr, hidden, ranks...)."""
    keys = differing_keys(recs, frozenset({"ranks"}))
    names = [label(r, keys) + f" x{r.get('ranks', 1)}" for r in recs]
    seen: dict[str, int] = {}
    out = []
    for name in names:  # repeats of one config: number them so each curve keeps its name
        seen[name] = seen.get(name, 0) + 1
        out.append(name if names.count(name) == 1 else f"{name} #{seen[name]}")
    return out


def convergence_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Long form: one row per (run, epoch) with the epoch's mean training loss and the
    held-out accuracy after it (epochs count from 1)."""
    recs = training_records(records)
    rows = []
    for rec, name in zip(recs, _labels(recs)):
        acc = list(rec.get("accuracy") or [])
        for epoch, loss in enumerate(rec["loss"], 1):
            rows.append(
                {
                    "id": rec.get("id"),
                    "run": name,
                    "epoch": epoch,
                    "loss": float(loss),
                    "accuracy": float(acc[epoch - 1]) if epoch <= len(acc) else float("nan"),
                }
            )
    return pd.DataFrame(rows, columns=CURVE_COLUMNS)


def final_table(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per training run: where it ended and what it cost."""
    recs = training_records(records)
    rows = [
        {
            "run": name,
            "epochs": len(rec["loss"]),
            "steps": rec.get("steps"),
            "items": rec.get("items"),
            "wall_s": rec.get("wall_s"),
            "final_loss": float(rec["loss"][-1]),
            "final_accuracy": float((rec.get("accuracy") or [float("nan")])[-1]),
        }
        for rec, name in zip(recs, _labels(recs))
    ]
    return pd.DataFrame(rows, columns=FINAL_COLUMNS)
