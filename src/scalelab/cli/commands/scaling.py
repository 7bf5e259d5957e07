"""`scalelab scaling RESULTS`: strong/weak efficiency per series, phase bars, plots."""

from __future__ import annotations

import argparse
from pathlib import Path

from scalelab.analysis import load_records, require, require_plotting
from scalelab.cli.base import COMMANDS, Command
from scalelab.errors import UsageError
from scalelab.outputs import check_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="results file (.jsonl) or folder of them, e.g. a sweep's")
    p.add_argument(
        "--mode",
        choices=("strong", "weak"),
        default=None,
        help="force strong (fixed global batch) or weak (fixed batch per rank) scaling; "
        "default: read off the sweep",
    )
    p.add_argument(
        "-o", "--out-dir", default="scalelab-results/scaling", help="folder for CSV and plots"
    )
    p.add_argument("--no-plots", action="store_true", help="table and CSV only")


def run(args: argparse.Namespace) -> int:
    check_dir(args.out_dir, "-o")  # before any work: a bad folder fails first
    require("pandas", "the analysis")
    if not args.no_plots:
        require_plotting()
    from scalelab.analysis.frame import ok_records
    from scalelab.analysis.scaling import scaling_phases, scaling_table

    records = load_records(args.results)
    if not ok_records(records):
        raise UsageError(f"{args.results}: no finished runs (every record failed)")
    table = scaling_table(records, args.mode)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "scaling.csv", index=False)
    spanning = table.groupby(["family", "series"])["ranks"].transform("nunique") > 1
    shown = table[spanning] if spanning.any() else table
    shown = shown.drop(columns=["ideal_throughput"]).assign(ms=shown["seconds"] * 1e3)
    print(shown.drop(columns=["seconds"]).to_string(index=False, float_format="{:.4g}".format))
    single = len(table) - int(spanning.sum())
    if not spanning.any():
        print("no series has more than one rank count: nothing to scale (add ranks to the grid)")
    elif single:
        print(f"({single} runs in series with a single rank count: only in the CSV)")
    if spanning.any() and not args.no_plots:
        from scalelab.analysis import plots

        plots.scaling(table[spanning], out)
        phases = scaling_phases(records, args.mode)
        keep = table[spanning].set_index(["family", "series"]).index
        plots.phase_bars(phases[phases.set_index(["family", "series"]).index.isin(keep)], out)
    print(
        f"scaling: {out}/scaling.csv"
        + ("" if args.no_plots else ", scaling.png/.svg, scaling_phases.png/.svg")
    )
    return 0


COMMANDS.register("scaling", "strong/weak scaling efficiency and per-phase bars from records")(
    Command(add_arguments, run)
)
