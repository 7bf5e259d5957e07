"""`scalelab timeline RECORDS -o trace.json`: every rank of the runs on one Chrome trace
(Perfetto, chrome://tracing), from records written with --timeline or --trace."""

from __future__ import annotations

import argparse

from scalelab.cli.base import COMMANDS, Command
from scalelab.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="results file (.jsonl) or folder of them")
    p.add_argument("-o", "--out", default="trace.json", help="trace file to write")
    p.add_argument("--run", default=None, metavar="ID", help="this run only (default: all)")


def select(records: list[dict], run_id: str | None, results: str) -> list[dict]:
    """The records of --run (all when None); one line when it names none."""
    if run_id is None:
        return records
    chosen = [r for r in records if r.get("id") == run_id]
    if not chosen:
        raise UsageError(f"{results}: no run with id {run_id}")
    return chosen


def run(args: argparse.Namespace) -> int:
    from scalelab.instrument.trace_events import timeline_records, write_trace
    from scalelab.record import read_records

    records = timeline_records(select(read_records(args.results), args.run, args.results))
    path = write_trace(records, args.out)
    ranks = sum(len(r["timeline"]["ranks"]) for r in records)
    print(f"{path}: {len(records)} runs, {ranks} ranks (open in https://ui.perfetto.dev)")
    return 0


COMMANDS.register("timeline", "every rank's phases on one Chrome trace (Perfetto)")(
    Command(add_arguments, run)
)
