"""`scalelab roofline RESULTS --ceilings ceilings.json`: per-layer and system rooflines."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scalelab.analysis import load_for_roofline
from scalelab.cli.base import COMMANDS, Command
from scalelab.errors import UsageError
from scalelab.instrument.progress import Progress
from scalelab.outputs import check_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="results file (.jsonl) or folder of them")
    p.add_argument(
        "--ceilings",
        default=None,
        help="ceilings.json from `scalelab ceilings` (default: one beside the results); "
        "needed for the per-layer roofline",
    )
    p.add_argument(
        "--reference",
        default=None,
        metavar="ID",
        help="estimate P_flops/P_pci/P_mpi from this run only (default: pooled over all)",
    )
    p.add_argument(
        "--run",
        default=None,
        metavar="ID",
        help="per-layer points of this run only (default: every --per-layer run)",
    )
    p.add_argument(
        "-o",
        "--out-dir",
        default="scalelab-results/roofline",
        help="folder for CSVs and plots",
    )
    p.add_argument("--no-plots", action="store_true", help="tables and CSVs only")


def run(args: argparse.Namespace) -> int:
    check_dir(args.out_dir, "-o")  # before any work: a bad folder fails first
    records, ceilings = load_for_roofline(args.results, args.ceilings, not args.no_plots)
    from scalelab.analysis import roofline, system_roofline

    layer_runs = roofline.layer_records(records)
    if args.run is not None:
        layer_runs = [r for r in layer_runs if r.get("id") == args.run]
        if not layer_runs:
            raise UsageError(f"{args.results}: no --per-layer run with id {args.run}")
    has_layers = bool(layer_runs)
    has_system = bool(system_roofline.training_runs(records))
    if not has_layers and not has_system:
        raise UsageError(
            f"{args.results}: no --per-layer runs and no distributed training runs: "
            "nothing to put on a roofline"
        )
    if has_layers and ceilings is None:
        raise UsageError("the per-layer roofline needs --ceilings (from `scalelab ceilings`)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # a step per table and per figure; a line on stderr once a few seconds passed
    bar = Progress((has_layers + has_system) * (1 if args.no_plots else 2), "roofline")
    if has_layers:
        layer_roofline(layer_runs, ceilings, out, args.no_plots, bar)
    if has_system:
        system(records, args.reference, out, args.no_plots, bar)
    return 0


def layer_roofline(records: list, ceilings: dict, out: Path, no_plots: bool, bar: Progress) -> None:
    from scalelab.analysis.roofline import layer_roofline as table_of

    df = table_of(records, ceilings)
    bar.step("per-layer table")
    df.to_csv(out / "roofline_layers.csv", index=False)
    cols = ["run", "layer", "kind", "ai", "achieved", "attainable", "bound", "fraction", "flag"]
    print(df[cols].to_string(index=False, float_format="{:.4g}".format))
    from scalelab.analysis.roofline import flag_lines

    for line in flag_lines(df):  # never silently above the roof, nor far from a twin layer
        print(f"warning: {line}", file=sys.stderr)
    if not no_plots:
        from scalelab.analysis import plots

        plots.layer_roofline(df, out)
        bar.step("per-layer figure")
    print(f"per-layer roofline: {out}/roofline_layers.csv" + _figs(no_plots, "roofline_layers"))


def system(records: list, reference: str | None, out: Path, no_plots: bool, bar: Progress) -> None:
    from scalelab.analysis.system_roofline import estimate_peaks, system_points

    peaks = estimate_peaks(records, reference)
    pts = system_points(records, peaks)
    bar.step("system table")
    pts.to_csv(out / "roofline_system.csv", index=False)
    print(
        f"P_flops {peaks.p_flops:.4g} FLOP/s | P_pci {_rate(peaks.p_pci)} | "
        f"P_mpi {_rate(peaks.p_mpi)} | PCIe share of bytes {peaks.pci_share:.2f} "
        f"({peaks.runs} runs)"
    )
    cols = ["hidden", "batch", "ranks", "ai", "measured", "measured_phases", "model", "bound",
            "flag"]  # fmt: skip
    print(pts[cols].to_string(index=False, float_format="{:.4g}".format))
    if not no_plots:
        from scalelab.analysis import plots

        plots.system_roofline(pts, peaks, out)
        bar.step("system figure")
    print(f"system roofline: {out}/roofline_system.csv" + _figs(no_plots, "roofline_system"))


def _rate(v: float | None) -> str:
    return "not measured" if v is None else f"{v:.4g} B/s"


def _figs(no_plots: bool, stem: str) -> str:
    return "" if no_plots else f", {stem}.png/.svg"


COMMANDS.register("roofline", "per-layer and system roofline of runs against measured ceilings")(
    Command(add_arguments, run)
)
