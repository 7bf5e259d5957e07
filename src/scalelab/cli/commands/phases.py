"""`scalelab phases RECORDS`: per rank and communication operation, how long it took, how much
of it was waiting for the last peer to arrive and how much was transfer; per run the straggler
and each rank's comm/compute overlap. Needs records written with --timeline or --trace."""

from __future__ import annotations

import argparse

from scalelab.cli.base import COMMANDS, Command
from scalelab.cli.commands.timeline import select


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="results file (.jsonl) or folder of them")
    p.add_argument("--run", default=None, metavar="ID", help="this run only (default: all)")
    p.add_argument("--csv", default=None, help="also write the table here")


def format_run(rec: dict, table, summary: dict) -> str:
    """The table in ms and MB, with the run's straggler and overlap lines."""
    shown = table.assign(
        **{c.replace("_s", "_ms"): table[c] * 1e3 for c in table.columns if c.endswith("_s")},
        MB=table["bytes"] / 1e6,
    ).drop(columns=[c for c in table.columns if c.endswith("_s")] + ["bytes"])
    head = f"run {rec.get('id')}: {rec.get('workload')} {rec.get('strategy')} x{rec.get('ranks')}"
    # MB to 4 significant digits: a 12 kB scatter at 3 decimals read 0.000 MB
    mb = {"MB": lambda v: "-" if v != v else f"{v:.4g}"}
    body = shown.to_string(index=False, float_format="{:.3f}".format, na_rep="-", formatters=mb)
    lines = [head, body if len(shown) else "  no communication phases in the timed iterations"]
    who = summary["straggler"]
    owed = ", ".join(f"rank {r} {s * 1e3:.2f} ms" for r, s in summary["blame_s"].items())
    lines.append(f"straggler: {'none' if who is None else f'rank {who}'} (waited for: {owed})")
    fractions = summary["overlap_fraction"]
    lines.append(
        "comm/compute overlap: "
        + ", ".join(f"rank {r} {'-' if f is None else f'{f:.0%}'}" for r, f in enumerate(fractions))
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from scalelab.analysis.waits import run_summary, wait_table
    from scalelab.instrument.trace_events import timeline_records
    from scalelab.record import read_records

    records = timeline_records(select(read_records(args.results), args.run, args.results))
    tables = []
    for rec in records:
        table = wait_table(rec)
        print(format_run(rec, table, run_summary(rec)), end="\n\n")
        tables.append(table.assign(run=rec.get("id")))
    if args.csv:
        pd.concat(tables).to_csv(args.csv, index=False)
    return 0


COMMANDS.register("phases", "communication split into waiting and transfer; the straggler")(
    Command(add_arguments, run)
)
