"""`scalelab report RESULTS -o DIR`: a self-contained HTML page with tables and figures."""

from __future__ import annotations

import argparse

from scalelab.analysis import load_for_roofline
from scalelab.cli.base import COMMANDS, Command
from scalelab.errors import UsageError
from scalelab.outputs import check_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="results file (.jsonl) or folder of them")
    p.add_argument(
        "-o",
        "--out-dir",
        default="scalelab-results/report",
        help="output folder (default: scalelab-results/report/)",
    )
    p.add_argument(
        "--ceilings", default=None, help="ceilings.json (default: one beside the results)"
    )
    p.add_argument("--title", default="scalelab report", help="page title")
    p.add_argument("--mode", choices=("strong", "weak"), default=None, help="force scaling mode")
    p.add_argument("--no-plots", action="store_true", help="tables only (no matplotlib needed)")
    p.add_argument(
        "--drop-warned", action="store_true",
        help="leave out runs whose records carry warnings (busy host, oversubscribed, unstable)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    check_dir(args.out_dir, "-o")  # before any work: a bad folder fails first
    records, ceilings = load_for_roofline(args.results, args.ceilings, not args.no_plots)
    from scalelab.analysis.plan_report import plan_sections
    from scalelab.analysis.report import write_report
    from scalelab.orchestration.strategy_roles import strategy_roles

    if args.drop_warned:
        kept = [r for r in records if not r.get("warnings")]
        print(f"report: left out {len(records) - len(kept)} warned run(s)")
        if not kept:
            raise UsageError(f"{args.results}: every run carries warnings (drop --drop-warned)")
        records = kept

    path = write_report(
        records, args.out_dir, ceilings, args.title, plots=not args.no_plots, mode=args.mode,
        extra=plan_sections(args.results), progress=True, roles=strategy_roles(),
    )  # fmt: skip
    print(f"report: {path} ({len(records)} records)")
    return 0


COMMANDS.register("report", "a self-contained HTML report of a results file")(
    Command(add_arguments, run)
)
