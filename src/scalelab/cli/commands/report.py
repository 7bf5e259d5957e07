"""`scalelab report RESULTS -o DIR`: a self-contained HTML page with tables and figures."""

from __future__ import annotations

import argparse

from scalelab.analysis import load_for_roofline
from scalelab.cli.base import COMMANDS, Command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="results file (.jsonl) or folder of them")
    p.add_argument("-o", "--out-dir", default="report", help="output folder (default: report/)")
    p.add_argument(
        "--ceilings", default=None, help="ceilings.json (default: one beside the results)"
    )
    p.add_argument("--title", default="scalelab report", help="page title")
    p.add_argument("--mode", choices=("strong", "weak"), default=None, help="force scaling mode")
    p.add_argument("--no-plots", action="store_true", help="tables only (no matplotlib needed)")


def run(args: argparse.Namespace) -> int:
    records, ceilings = load_for_roofline(args.results, args.ceilings, not args.no_plots)
    from scalelab.analysis.plan_report import plan_sections
    from scalelab.analysis.report import write_report

    path = write_report(
        records, args.out_dir, ceilings, args.title, plots=not args.no_plots, mode=args.mode,
        extra=plan_sections(args.results),
    )  # fmt: skip
    print(f"report: {path} ({len(records)} records)")
    return 0


COMMANDS.register("report", "a self-contained HTML report of a results file")(
    Command(add_arguments, run)
)
