"""`scalelab timeline RECORDS -o trace.json`: every rank of the runs on one Chrome trace
(Perfetto, chrome://tracing), from records written with --timeline or --trace. A run traced
with --trace also brings each rank's profiler trace: its kernels (NCCL's apart) join the
rank's phases on one clock, and a table per run says, per rank and traced step, how much of
the device time was compute, communication, both at once, and communication left exposed."""

from __future__ import annotations

import argparse

from scalelab.cli.base import COMMANDS, Command
from scalelab.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="results file (.jsonl) or folder of them")
    p.add_argument("-o", "--out", default="trace.json", help="trace file to write")
    p.add_argument("--run", default=None, metavar="ID", help="this run only (default: all)")
    p.add_argument(
        "--no-kernels",
        action="store_true",
        help="leave the profiler traces' kernels out (--trace runs): scalelab's phases only",
    )


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
    if not args.no_kernels:
        records = [_with_kernels(r) for r in records]
    path = write_trace(records, args.out)
    ranks = sum(len(r["timeline"]["ranks"]) for r in records)
    print(f"{path}: {len(records)} runs, {ranks} ranks (open in https://ui.perfetto.dev)")
    return 0


def _with_kernels(rec: dict) -> dict:
    """The record with its ranks' traced kernels, and the device-time table printed."""
    import sys

    from scalelab.analysis.device_overlap import collective_bandwidth, summary
    from scalelab.instrument.kernel_trace import with_kernels

    rec, notes = with_kernels(rec)
    for note in notes:
        print(f"scalelab: timeline: {note}", file=sys.stderr)
    table = summary(rec)
    if not table.empty:
        ms = table.drop(columns=["kernels", "comm_kernels"]).copy()
        for col in [c for c in ms.columns if c.endswith("_s")]:
            ms[col.removesuffix("_s") + " ms"] = ms.pop(col) * 1e3
        print(f"device time per traced step (median), {rec.get('workload')} {rec.get('strategy')}:")
        print(ms.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    bw = collective_bandwidth(rec)
    if not bw.empty:  # per rank and collective: medians over the traced steps' kernels
        by = bw.groupby(["rank", "collective"])
        table = by.agg(
            calls=("bytes", "size"),
            MB=("bytes", "median"),
            transfer_ms=("transfer_s", "median"),
            busbw=("busbw_Bps", "median"),
        )
        table["MB"] /= 1e6
        table["transfer_ms"] *= 1e3
        table["busbw GB/s"] = table.pop("busbw") / 1e9
        print(
            "collectives (median per kernel; busbw as nccl-tests, over the transfer less the "
            "wait for the last rank):"
        )
        print(table.reset_index().to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return rec


COMMANDS.register("timeline", "every rank's phases on one Chrome trace (Perfetto)")(
    Command(add_arguments, run)
)
