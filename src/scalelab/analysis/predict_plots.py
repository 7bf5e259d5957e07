"""The figure of `scalelab predict`: predicted time per phase, throughput and efficiency vs N.
A leaf like plots.py (only the CLI imports it); it reads the DataFrame predict/frame.py returns.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from scalelab.analysis import require

PHASE_COLORS = {
    "launch": "#a1c9f4",
    "compute": "#4c72b0",
    "overhead": "#8c8c8c",
    "ddp_host": "#b0b0b0",
    "allreduce": "#dd8452",
    "halo": "#c44e52",
    "scatter": "#55a868",
    "gather": "#8fbc8f",
    "bcast": "#937860",
    "bubble": "#da8bc3",
    "p2p": "#ccb974",
}


def _plt():
    mpl = require("matplotlib", "plotting")
    mpl.use("Agg")  # files only, as plots.py
    import matplotlib.pyplot as plt

    return plt


def prediction_plot(
    table: pd.DataFrame, out_dir: Path, stem: str = "predict", title: str = ""
) -> Path:
    """Three panels: stacked ms per phase, throughput (ideal dashed), efficiency; rows that
    cannot run are left out. Writes <stem>.png (small: 90 dpi) and returns its path."""
    plt = _plt()
    ok = table[table["ms"].notna()].sort_values("ranks")
    fig, (ax_t, ax_x, ax_e) = plt.subplots(1, 3, figsize=(13, 3.9), layout="constrained")
    x = np.arange(len(ok))
    bottom = np.zeros(len(ok))
    for col in [c for c in ok.columns if c.endswith("_ms")]:
        phase = col.removesuffix("_ms")
        values = ok[col].fillna(0.0).to_numpy()
        if values.max() < 0.005 * ok["ms"].max():
            continue  # invisible at this scale
        ax_t.bar(x, values, bottom=bottom, label=phase, color=PHASE_COLORS.get(phase))
        bottom += values
    ax_t.set_xticks(x, [str(r) for r in ok["ranks"]], fontsize=7)
    ax_t.set_xlabel("ranks N")
    ax_t.set_ylabel("predicted ms per iteration")
    ax_t.legend(fontsize=7)
    ranks = ok["ranks"].to_numpy()
    ax_x.plot(ranks, ok["throughput"], "o-", label="predicted")
    ideal = ok["throughput"].iloc[0] / ranks[0] * ranks if ok["speedup"].notna().all() else None
    if ideal is not None:
        ax_x.plot(ranks, ideal, "k--", lw=1, label="ideal (linear)")
    ax_x.set_yscale("log")
    ax_x.set_ylabel("items per second")
    ax_x.legend(fontsize=7)
    ax_e.plot(ranks, ok["efficiency"], "o-", color="#c44e52")
    ax_e.axhline(1.0, color="k", ls="--", lw=1)
    ax_e.set_ylim(0, max(1.1, float(ok["efficiency"].max()) * 1.05))
    ax_e.set_ylabel("parallel efficiency")
    for ax in (ax_x, ax_e):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(r) for r in ranks], fontsize=7)
        ax.set_xlabel("ranks N")
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, 120)), fontsize=9)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
