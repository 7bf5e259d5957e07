"""The study report: one self-contained HTML page (index.html) plus its PNGs and CSVs.

Sections: environment, ceilings, the versions table (every strategy against the float64
oracle), all runs, per-rank phase tables, scaling, roofline (per layer and the seed's
system model), convergence, memory and power per layer. A section without data says so, so
the reader knows what was not measured rather than wondering.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pandas as pd

from scalelab.analysis import convergence, html, layers, phases, roofline, scaling
from scalelab.analysis import system_roofline as sysroof
from scalelab.analysis.frame import experiment_key, ok_records, records_frame, sibling_labels
from scalelab.analysis.report_context import (
    ceilings_section,
    environment_section,
    versions_section,
)
from scalelab.analysis.report_waits import waits_section, with_phases
from scalelab.analysis.roles import StrategyRoles
from scalelab.errors import UsageError
from scalelab.instrument.progress import Progress

Section = tuple[str, str, str]


class Page:
    """Where figures and CSVs go, and whether figures are drawn at all."""

    def __init__(self, out_dir: Path, plots: bool) -> None:
        self.dir = out_dir
        self.plots = plots
        if plots:
            from scalelab.analysis import plots as plot_module  # the leaf, only when drawing

            self.draw = plot_module

    def figure(self, fn: str, caption: str, *args: Any) -> str:
        if not self.plots:
            return ""
        paths = getattr(self.draw, fn)(*args, self.dir, formats=("png",))
        return html.figure(paths[0], self.dir, caption)

    def csv(self, df: pd.DataFrame, name: str) -> str:
        df.to_csv(self.dir / name, index=False)
        return f'<p class="note">Data: <a href="{html.esc(name)}">{html.esc(name)}</a></p>'


def _ms(v: float) -> str:
    return f"{v * 1e3:.3f}"


def data_label(rec: dict[str, Any]) -> str:
    """'real: mnist' when the run read a data set (--data-dir), else 'synthetic'."""
    data_dir = (rec.get("config") or {}).get("data_dir")
    return f"real: {Path(data_dir).name}" if data_dir else "synthetic"


def _spread(rec: dict[str, Any], key: str) -> float | None:
    """The repetitions' IQR (seconds per iteration, like ms/iter beside it) or CV; None for
    fewer than two repetitions (one epoch has no spread, not a CV of 0.0%). A training
    record's spread is over its epochs: the IQR is put per step (epoch IQR / steps per epoch)."""
    stats = rec.get("wall_spread_s") or {}
    value, n = stats.get(key), stats.get("n") or 0
    if not isinstance(value, (int, float)) or n < 2:
        return None
    if key == "iqr" and rec.get("mode") == "train" and rec.get("steps"):
        value = value * n / int(rec["steps"])
    return value


def runs_section(records: list[dict[str, Any]], page: Page) -> Section:
    df = records_frame(records)
    df["run"] = sibling_labels(records, frozenset({"ranks"}))
    df["data"] = [data_label(r) for r in records]
    df["CV"] = [_spread(r, "cv") for r in records]
    df["IQR ms/iter"] = [_spread(r, "iqr") for r in records]
    df["steady/s"] = [r.get("steady_throughput") for r in records]
    df["warnings"] = ["; ".join(r.get("warnings") or []) for r in records]
    df["error"] = [r.get("error", "") for r in records]
    tokens = any("tokens_per_s" in r for r in records)  # token models (run/tokens.py)
    if tokens:
        df["tokens/s"] = [r.get("tokens_per_s") for r in records]
        df["MFU"] = [(r.get("mfu") or {}).get("measured") for r in records]
        df["MFU datasheet"] = [(r.get("mfu") or {}).get("datasheet") for r in records]
    cols = [
        "time",
        "run",
        "ranks",
        "data",
        "status",
        "iter_items",
        "iter_s",
        "IQR ms/iter",
        "CV",
        "throughput",
        "steady/s",
        "achieved_tflops",
        *(["tokens/s", "MFU", "MFU datasheet"] if tokens else []),
        "warnings",
        "error",
    ]
    if df["slurm_job"].notna().any():  # which job ran it, on how many nodes
        cols[2:2] = ["nodes", "slurm_job"]
    view = df[cols].rename(columns={"iter_s": "ms/iter", "achieved_tflops": "GFLOP/s"})
    view = view.rename(columns={"slurm_job": "Slurm job"})
    fmts = {
        "ms/iter": _ms,
        "IQR ms/iter": _ms,
        "CV": ".1%",
        "throughput": ".1f",
        "steady/s": ".1f",
        "GFLOP/s": lambda v: f"{v * 1e3:.2f}",
        "iter_items": ".0f",
        "tokens/s": ".4g",
        "MFU": ".1%",
        "MFU datasheet": ".1%",
    }
    css = {
        "status": lambda v: "good" if v == "ok" else "bad",
        "warnings": lambda v: "warn" if v else "",
    }
    warned = sum(bool(r.get("warnings")) for r in records)
    body = html.note(
        f"Every run ({len(records)}; {warned} with warnings: their times are suspect). Per "
        "iteration: one timed inference pass, or one optimizer step (training: the whole run "
        "over its steps; steady/s leaves the warm-up out). IQR and CV over the repetitions "
        "(training: over epochs, the IQR per step; none for one repetition). data: the data "
        "set read, or synthetic inputs."
        + (
            " tokens/s: all ranks; MFU: the model's FLOPs per token (x3 training) times tokens/s "
            "per device over the measured GEMM peak of the run's dtype (MFU datasheet: over the "
            "device's datasheet peak)."
            if tokens
            else ""
        )  # fmt: skip
    )
    table = html.table(view, fmts, classes=css, text_cols={"warnings", "error", "data"})
    return "runs", "All runs", body + table + page.csv(with_phases(df, records), "runs.csv")


def phase_section(records: list[dict[str, Any]]) -> Section:
    latest: dict[str, dict[str, Any]] = {}
    for rec in ok_records(records):
        latest[experiment_key(rec) + rec.get("mode", "")] = rec
    chosen = sorted(latest.values(), key=lambda r: -int(r.get("ranks", 1)))
    names = dict(zip(map(id, chosen), sibling_labels(chosen, frozenset({"ranks"}))))
    repeats = len(ok_records(records)) - len(chosen)
    parts = [
        html.note(
            "Milliseconds per iteration (per optimizer step when training) inside each phase, per "
            "rank: each rank's median-wall iteration (training: totals / steps); nested phases "
            "(a/b) are part of their parent; other = the rank's wall - its top-level phases "
            "(Python between phases, barriers); imbalance = max / mean over ranks. One table "
            f"per configuration, its latest run ({repeats} earlier repeat(s) are in All runs)."
        )
    ]
    for rec in chosen:
        table = phases.rank_phase_table(rec)
        if table.empty:
            continue
        shown = table.apply(lambda col: col.map(lambda v: f"{v * 1e3:.3f}"))  # pandas < 2.1
        if "imbalance" in table.index:
            shown.loc["imbalance"] = table.loc["imbalance"].map(lambda v: f"{v:.2f}x")
        parts.append(f"<h3>{html.esc(names[id(rec)])} x{rec.get('ranks', 1)}</h3>")
        parts.append(html.warning_list(_phase_problems(rec)))
        parts.append(html.table(shown.rename_axis("rank"), index=True, text_cols={"rank"}))
    return "phases", "Per-rank phases", "\n".join(parts)


def _phase_problems(rec: dict[str, Any]) -> list[str]:
    acc = phases.phase_accounting(rec)
    over = acc[acc["exceeds"]]
    return [
        f"rank {r.rank}: phases {r.phases_s * 1e3:.3f} ms exceed its wall {r.wall_s * 1e3:.3f} ms"
        for r in over.itertuples()
    ] + list(rec.get("warnings") or [])


def scaling_section(records: list[dict[str, Any]], page: Page, mode: str | None) -> Section:
    table = scaling.scaling_table(records, mode)
    spans = table.groupby(["family", "series"])["ranks"].transform("nunique") > 1
    table = table[spans]
    if table.empty:
        return "scaling", "Scaling", html.note("No series with more than one rank count.")
    fmts = {
        "seconds": _ms,
        "throughput": ".1f",
        "ideal_throughput": ".1f",
        "speedup": ".2f",
        "efficiency": ".3f",
        "global_batch": "g",
        "batch_per_rank": "g",
    }
    view = table.rename(columns={"seconds": "ms/iter"})
    fmts["ms/iter"] = fmts.pop("seconds")
    body = (
        html.note(
            "Strong scaling (fixed global batch): E = T1 / (N TN). Weak scaling (fixed batch per "
            "rank): E = T1 / TN. T = seconds per iteration, median over repeats."
        )
        + html.table(view, fmts)
        + page.csv(table, "scaling.csv")
    )
    body += page.figure("scaling", "Throughput (dashed: ideal) and efficiency vs ranks.", table)
    bars = scaling.scaling_phases(records, mode)
    bars = bars[
        bars.set_index(["family", "series"]).index.isin(table.set_index(["family", "series"]).index)
    ]
    if not bars.empty:
        body += page.figure("phase_bars", "Time per iteration by phase for each N.", bars)
    return "scaling", "Scaling", body


def roofline_section(
    records: list[dict[str, Any]], ceilings: dict | None, page: Page, roles: StrategyRoles
) -> Section:
    parts = []
    if ceilings is not None and roofline.layer_records(records):
        df = roofline.layer_roofline(records, ceilings)
        fmts = {
            c: ".3g" for c in ("flops", "bytes", "achieved", "peak_flops", "mem_bw", "attainable")
        }
        fmts.update(ai=".2f", seconds=_ms, fraction=".1%")
        parts += [
            "<h3>Per layer</h3>",
            html.warning_list(roofline.flag_lines(df)),  # above the roof: circled red
            html.table(df.rename(columns={"seconds": "ms"}), {**fmts, "ms": _ms}),
            page.csv(df, "roofline_layers.csv"),
            page.figure("layer_roofline", "Per-layer roofline under the measured ceilings.", df),
        ]
    else:
        parts.append(html.note("Per-layer roofline: needs --per-layer runs and ceilings."))
    parts.append(_system_roofline(records, ceilings, page, roles))
    return "roofline", "Roofline", "\n".join(parts)


def _system_roofline(
    records: list[dict[str, Any]], ceilings: dict | None, page: Page, roles: StrategyRoles
) -> str:
    if not sysroof.training_runs(records):
        return html.note("System roofline: needs distributed training runs (e.g. mlp, mpi-dp).")
    peaks = sysroof.estimate_peaks(records)
    pts = sysroof.system_points(records, peaks)
    lead = (
        f"P_flops = {peaks.p_flops:.3g} FLOP/s, P_pci = {_rate(peaks.p_pci)}, "
        f"P_mpi = {_rate(peaks.p_mpi)} (pooled over {peaks.runs} runs)"
    )
    if peaks.beta_Bps:
        fit = f"alpha = {peaks.alpha_s * 1e6:.1f} us, beta = {peaks.beta_Bps / 1e9:.3g} GB/s"
        lead += f"; all-reduce fit {fit}"
    backend = sysroof.ceiling_backend(records, roles)
    disagree = sysroof.against_ceilings(peaks, ceilings, backend)  # one quantity, two figures
    fmts = {
        c: ".3g"
        for c in (
            "flops",
            "bytes_pci",
            "bytes_mpi",
            "measured",
            "measured_phases",
            "model",
            "t_compute",
            "t_pci",
            "t_mpi",
        )
    }
    fmts["ai"] = ".2f"
    return (
        "<h3>System (the MNIST seed's model)</h3>"
        + html.note(lead)
        + html.warning_list(disagree)
        + html.table(pts.drop(columns=["id"]), fmts)
        + page.csv(pts, "roofline_system.csv")
        + page.figure(
            "system_roofline",
            "Measured training runs against "
            "AI / (AI / P_flops + 1 / P_comm); marker = modelled bound.",
            pts,
            peaks,
        )
    )


def _rate(v: float | None) -> str:
    return "not measured" if v is None else f"{v:.3g} B/s"


def convergence_section(records: list[dict[str, Any]], page: Page) -> Section:
    final = convergence.final_table(records)
    if final.empty:
        return "convergence", "Convergence", html.note("No training runs.")
    labels = {"final_loss": "training loss", "final_accuracy": "held-out accuracy"}
    fmts = {"wall_s": ".2f", "training loss": ".4f", "held-out accuracy": ".4f"}
    body = html.note(
        "training loss: the mean over the last epoch's steps; held-out accuracy: on the "
        "held-out items after the last epoch (--heldout-size)."
    ) + html.table(final.rename(columns=labels), fmts)
    curves = convergence.convergence_frame(records)
    body += page.figure("convergence", "Training loss and held-out accuracy per epoch.", curves)
    return "convergence", "Convergence", body


def memory_section(records: list[dict[str, Any]], page: Page) -> Section:
    df = layers.layer_table(records)
    nvml = layers.nvml_phase_table(records)
    if df.empty and nvml.empty:
        return "memory", "Memory and power per layer", html.note("No --per-layer or --nvml runs.")
    body = ""
    if not df.empty:
        df = df.dropna(axis=1, how="all")
        if not {"peak_MB", "power_W"} & set(df.columns) and nvml.empty:
            body += html.note(
                "No memory or power measured: the allocator's peak and NVML's power are "
                "CUDA-only; below, each layer's time and output size."
            )
        fmts = {"ms": ".3f", "out_MB": ".3f", "peak_MB": ".2f", "power_W": ".1f"}
        body += html.note(
            "--per-layer: median time per call, output size, and the allocator's peak while the "
            "layer ran (CUDA only); the hooks synchronise, so these times are a study of layers."
        ) + html.table(df, fmts)
        if {"out_MB", "peak_MB", "power_W"} & set(df.columns):
            body += page.figure("layer_memory", "Output and peak memory per layer.", df)
    if not nvml.empty:
        body += "<h3>NVML samples per phase</h3>" + html.table(
            nvml, {"peak_MB": ".1f", "J per call": ".3g", "run mean W": ".1f", "run max W": ".1f"}
        )
    return "memory", "Memory and power per layer", body


def write_report(
    records: list[dict[str, Any]],
    out_dir: str | Path,
    ceilings: dict[str, Any] | None = None,
    title: str = "scalelab report",
    plots: bool = True,
    mode: str | None = None,
    extra: list[Section] = (),
    progress: bool = False,
    *,
    roles: StrategyRoles,
) -> Path:
    """Write out_dir/index.html (+ PNGs, CSVs); returns the page's path. With `progress`, a
    line on stderr after each section once a few seconds passed (figures take seconds).
    roles: which strategy names are the reference, the plain local run, MPI's all-reduce
    (orchestration/strategy_roles.py; analyses import no strategy)."""
    if not records:
        raise UsageError("no records to report on")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    page = Page(out, plots)
    makers = {
        "environment": lambda: [environment_section(records)],
        "ceilings": lambda: [ceilings_section(ceilings, records), *extra],
        "versions": lambda: [versions_section(records, roles)],
        "runs": lambda: [runs_section(records, page)],
        "phases": lambda: [phase_section(records)],
        "waits": lambda: [waits_section(records, page)],
        "scaling": lambda: [scaling_section(records, page, mode)],
        "roofline": lambda: [roofline_section(records, ceilings, page, roles)],
        "convergence": lambda: [convergence_section(records, page)],
        "memory": lambda: [memory_section(records, page)],
    }
    sections: list[Section] = []
    bar = Progress(len(makers), "report", enabled=progress)
    for name, make in makers.items():
        sections += make()
        bar.step(name)
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    failed_checks = sum(r.get("status") == "check-failed" for r in records)
    lead = (
        f"{len(records)} records ({len(ok_records(records))} finished, {failed_checks} "
        f"check-failed), generated {now}."
    )
    path = out / "index.html"
    path.write_text(html.page(title, lead, sections))
    return path
