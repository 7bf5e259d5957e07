"""Every figure scalelab draws; the only module that imports matplotlib (a leaf: nothing in
the analysis layer imports it, and it only reads the DataFrames the analyses return).

Each function writes `<stem>.png` and `<stem>.svg` under out_dir and returns their paths.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from scalelab.analysis import require
from scalelab.analysis.phases import phase_order

FORMATS = ("png", "svg")


def _plt() -> Any:
    mpl = require("matplotlib", "plotting")
    mpl.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def available() -> bool:
    try:
        _plt()
    except Exception:
        return False
    return True


def _save(fig: Any, out_dir: Path, stem: str, formats: Sequence[str] = FORMATS) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out_dir / f"{stem}.{fmt}"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        paths.append(path)
    _plt().close(fig)
    return paths


def scaling(
    table: pd.DataFrame, out_dir: Path, stem: str = "scaling", formats: Sequence[str] = FORMATS
) -> list[Path]:
    """Throughput and efficiency vs ranks per series, each with its ideal (dashed)."""
    plt = _plt()
    fig, (ax_x, ax_e) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (family, series), g in table.groupby(["family", "series"], sort=False):
        g = g.sort_values("ranks")
        name = f"{family} ({series}, {g['mode'].iloc[0]})"
        line = ax_x.plot(g["ranks"], g["throughput"], "o-", label=name)[0]
        ax_x.plot(g["ranks"], g["ideal_throughput"], "--", color=line.get_color(), alpha=0.6)
        ax_e.plot(g["ranks"], g["efficiency"], "o-", color=line.get_color(), label=name)
    ranks = sorted(table["ranks"].unique())
    for ax in (ax_x, ax_e):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(r) for r in ranks])
        ax.set_xlabel("ranks N")
        ax.grid(True, alpha=0.3)
    ax_x.set_yscale("log")
    ax_x.set_ylabel("throughput (items/s); dashed: ideal N x T1")
    ax_e.axhline(1.0, color="k", ls="--", lw=1, label="ideal")
    ax_e.set_ylim(0, max(1.15, float(table["efficiency"].max()) * 1.1))
    ax_e.set_ylabel("parallel efficiency E")
    handles, labels = ax_x.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0))
    return _save(fig, out_dir, stem, formats)


def phase_bars(
    phases: pd.DataFrame,
    out_dir: Path,
    stem: str = "scaling_phases",
    formats: Sequence[str] = FORMATS,
) -> list[Path]:
    """Stacked per-phase milliseconds per iteration for each N, one panel per series (three
    panels a row); phases under 0.5% of every bar are left out of the legend's clutter."""
    plt = _plt()
    groups = list(phases.groupby(["family", "series"], sort=False))
    cols = min(len(groups), 3)
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.6 * cols + 1.6, 4.2 * rows), squeeze=False, layout="constrained"
    )
    palette = plt.get_cmap("tab20").colors
    names = sorted(dict.fromkeys(phases["phase"]), key=phase_order)
    colors = {n: palette[i % len(palette)] for i, n in enumerate(names)}
    for ax, ((family, series), g) in zip(axes.flat, groups):
        wide = g.pivot_table(index="ranks", columns="phase", values="seconds", aggfunc="mean")
        wide = wide.reindex(columns=[n for n in names if n in wide.columns]).fillna(0.0) * 1e3
        wide = wide.loc[:, wide.max() >= 0.005 * wide.sum(axis=1).max()]
        bottom = np.zeros(len(wide))
        for phase in wide.columns:
            x = [str(r) for r in wide.index]
            ax.bar(x, wide[phase], bottom=bottom, label=phase, color=colors[phase])
            bottom += wide[phase].to_numpy()
        ax.set_title("\n".join(textwrap.wrap(f"{family}, {series}", 48)), fontsize=8)
        ax.set_xlabel("ranks N")
        ax.set_ylabel("ms per iteration (mean over ranks)")
    for ax in list(axes.flat)[len(groups) :]:
        ax.set_visible(False)
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_legend_handles_labels()[0]}
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="outside right center")
    return _save(fig, out_dir, stem, formats)


def _roofs(ax: Any, roofs: list[tuple[float, float]], ai: np.ndarray) -> None:
    xs = np.logspace(np.log10(max(ai.min(), 1e-3) / 4), np.log10(ai.max() * 4), 200)
    for peak, bw in roofs:
        ax.plot(xs, np.minimum(peak, xs * bw), "k-", lw=1.2)
        ax.axvline(peak / bw, color="k", ls=":", lw=0.8)
        ax.annotate(
            f"{peak / 1e9:.3g} GFLOP/s", (xs[-1], peak), ha="right", va="bottom", fontsize=7
        )
        ax.annotate(f"{bw / 1e9:.3g} GB/s", (xs[0], xs[0] * bw), ha="left", va="bottom", fontsize=7)


def layer_roofline(
    df: pd.DataFrame, out_dir: Path, stem: str = "roofline_layers", formats: Sequence[str] = FORMATS
) -> list[Path]:
    """Achieved FLOP/s vs arithmetic intensity per layer, under the compute and memory roofs."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    roofs = sorted(set(zip(df["peak_flops"], df["mem_bw"])))
    _roofs(ax, roofs, df["ai"].to_numpy())
    for kind, g in df.groupby("kind"):
        ax.scatter(g["ai"], g["achieved"], label=kind, s=28, zorder=3)
        _label_points(ax, g["ai"], g["achieved"], g["layer"])
    over = df[df["flag"].str.contains("under-measured")] if "flag" in df else df.iloc[:0]
    if not over.empty:  # above the roof: the ceiling was measured too low; say so on the plot
        ax.scatter(over["ai"], over["achieved"], s=110, facecolors="none", edgecolors="red",
                   zorder=4, label="above roof: ceiling under-measured")  # fmt: skip
    _loglog(ax, "arithmetic intensity (FLOP/byte)", "achieved FLOP/s")
    return _save(fig, out_dir, stem, formats)


def _label_points(ax: Any, xs: Sequence, ys: Sequence, labels: Sequence[str]) -> None:
    for x, y, text in zip(xs, ys, labels):
        ax.annotate(text, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")


def _loglog(ax: Any, xlabel: str, ylabel: str) -> None:
    """Both axes logarithmic (a roofline), labelled, faint grid, legend."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=7)


MARKERS = {"compute": "o", "PCIe": "s", "network": "^"}


def system_roofline(
    points: pd.DataFrame,
    peaks: Any,
    out_dir: Path,
    stem: str = "roofline_system",
    formats: Sequence[str] = FORMATS,
) -> list[Path]:
    """The seed's model curve FLOP/s(AI) with each measured training run on it."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ai = points["ai"].to_numpy()
    xs = np.logspace(np.log10(ai.min() / 10), np.log10(ai.max() * 10), 200)
    ax.plot(xs, [peaks.model(x) for x in xs], "k-", lw=1.5, label="model AI/(AI/P_flops+1/P_comm)")
    ax.axhline(peaks.p_flops, color="k", ls=":", lw=1, label=f"P_flops {peaks.p_flops:.3g}")
    for bound, g in points.groupby("bound"):
        ax.scatter(
            g["ai"],
            g["measured"],
            marker=MARKERS.get(bound, "o"),
            s=40,
            zorder=3,
            label=f"measured, {bound}-bound",
        )
        labels = [f"H={r['hidden']} B={r['batch']} N={r['ranks']}" for _, r in g.iterrows()]
        _label_points(ax, g["ai"], g["measured"], labels)
    _loglog(ax, "arithmetic intensity F / (bytes_pci + bytes_mpi) (FLOP/byte)", "FLOP/s per rank")
    return _save(fig, out_dir, stem, formats)


def convergence(
    curves: pd.DataFrame, out_dir: Path, stem: str = "convergence", formats: Sequence[str] = FORMATS
) -> list[Path]:
    """Training loss (log) and held-out accuracy per epoch, one line per run."""
    plt = _plt()
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]  # identical curves stay visible
    for i, (run, g) in enumerate(curves.groupby("run", sort=False)):
        marker, ls = styles[i % len(styles)]
        kw = {"marker": marker, "ls": ls, "ms": 4, "label": run, "alpha": 0.85}
        ax_l.plot(g["epoch"], g["loss"], **kw)
        ax_a.plot(g["epoch"], g["accuracy"], **kw)
    ax_l.set_yscale("log")
    ax_l.set_ylabel("training loss (epoch mean)")
    ax_a.set_ylabel("held-out accuracy")
    for ax in (ax_l, ax_a):
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
    ax_a.legend(fontsize=7)
    return _save(fig, out_dir, stem, formats)


def layer_memory(
    df: pd.DataFrame, out_dir: Path, stem: str = "layer_memory", formats: Sequence[str] = FORMATS
) -> list[Path]:
    """Per-layer output and peak memory (MB), and power (W) where it was sampled."""
    plt = _plt()
    value_cols = [c for c in ("out_MB", "peak_MB", "power_W") if c in df and df[c].notna().any()]
    fig, axes = plt.subplots(1, len(value_cols), figsize=(5 * len(value_cols), 4), squeeze=False)
    for ax, col in zip(axes[0], value_cols):
        for run, g in df.groupby("run", sort=False):
            ax.bar(g["layer"], g[col], alpha=0.7, label=run)
        ax.set_ylabel(col.replace("_", " "))
        ax.tick_params(axis="x", rotation=60, labelsize=7)
    axes[0][0].legend(fontsize=7)
    return _save(fig, out_dir, stem, formats)


def wait_bars(
    parts: pd.DataFrame, title: str, out_dir: Path, formats: Sequence[str] = FORMATS
) -> list[Path]:
    """One stacked bar per rank: compute, transfer, wait, unmatched ms per iteration
    (analysis/waits.rank_breakdown)."""
    plt = _plt()
    wide = parts.pivot_table(index="rank", columns="part", values="seconds", aggfunc="sum") * 1e3
    fig, ax = plt.subplots(figsize=(1.2 * len(wide) + 3.5, 3.8), layout="constrained")
    colors = {"compute": "#4c72b0", "transfer": "#55a868", "wait": "#c44e52", "unmatched": "#999"}
    bottom = np.zeros(len(wide))
    for part in [p for p in colors if p in wide.columns]:
        ax.bar([str(r) for r in wide.index], wide[part], bottom=bottom, label=part,
               color=colors[part])  # fmt: skip
        bottom += wide[part].to_numpy()
    ax.set_title("\n".join(textwrap.wrap(title, 60)), fontsize=8)
    ax.set_xlabel("rank")
    ax.set_ylabel("ms per iteration")
    ax.legend(fontsize=7)
    stem = "waits_" + "".join(c if c.isalnum() else "_" for c in title)[:40]
    return _save(fig, out_dir, stem, formats)
