"""Figures for analysis/memory.py's tables: a leaf, like plots.py (nothing imports it but
reports and benchmarks). Each function writes `<stem>.png` and `.svg` and returns the paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from scalelab.analysis.plots import _plt, _save


def layer_types(table: pd.DataFrame, out_dir: Path, stem: str = "layer_types") -> list[Path]:
    """Memory (allocator peak, output) and power per layer type, one bar group per type."""
    plt = _plt()
    fig, (ax_m, ax_p) = plt.subplots(1, 2, figsize=(10, 4))
    kinds = list(table["kind"])
    x = np.arange(len(kinds))
    ax_m.bar(x - 0.2, table["peak_MB"], 0.4, label="allocator peak")
    ax_m.bar(x + 0.2, table["out_MB"], 0.4, label="output")
    ax_m.set_ylabel("MB")
    ax_m.legend(fontsize=8)
    ax_p.bar(x, table["power_W"], 0.6, color="tab:red")
    ax_p.set_ylabel("mean power (W)")
    for ax in (ax_m, ax_p):
        ax.set_xticks(x, kinds)
        ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, out_dir, stem)


def swap(summary: pd.DataFrame, out_dir: Path, stem: str = "swap_relu_pool") -> list[Path]:
    """Output MB and ms per layer kind, normal order against max-pool-before-ReLU."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    kinds = list(summary["kind"])
    x = np.arange(len(kinds))
    for ax, col, unit in zip(axes, ("out_MB", "ms"), ("output MB", "ms")):
        ax.bar(x - 0.2, summary[f"{col}_normal"], 0.4, label="ReLU, pool")
        ax.bar(x + 0.2, summary[f"{col}_swapped"], 0.4, label="pool, ReLU")
        ax.set_xticks(x, kinds, rotation=20)
        ax.set_ylabel(unit)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, out_dir, stem)
