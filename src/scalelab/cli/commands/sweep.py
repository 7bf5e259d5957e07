"""`scalelab sweep STUDY.toml`: every point of a grid, one run each, resumable."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys

from scalelab.analysis.sweep import command, done_keys, load_study, points, run_study
from scalelab.cli.base import COMMANDS, Command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("study", help="study TOML: [study], [grid] lists, [fixed] values")
    p.add_argument(
        "--out",
        default=None,
        help="results file (default: [study] results, else scalelab-results/<name>.jsonl)",
    )
    p.add_argument("--force", action="store_true", help="rerun points already in the results")
    p.add_argument("--dry-run", action="store_true", help="list the points and run nothing")
    p.add_argument("--timeout", type=float, default=None, help="seconds per point (kill after)")


def run(args: argparse.Namespace) -> int:
    study = load_study(args.study, args.out)
    if args.timeout is not None:
        study = dataclasses.replace(study, timeout_s=args.timeout)
    if args.dry_run:
        return dry_run(study, args.force)
    print(f"study {study.name}: {len(points(study))} points -> {study.results}", flush=True)
    outcomes = run_study(study, args.force, echo=lambda line: print(line, flush=True))
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "done", "check failed")}
    failed = sum(o.status == "failed" for o in outcomes)
    print(
        f"study {study.name}: {counts['ok']} ran, {counts['done']} already done, "
        f"{counts['check failed']} failed the check, {failed} failed; records in {study.results}"
    )
    return 1 if failed or counts["check failed"] else 0


def dry_run(study, force: bool) -> int:
    done = set() if force else done_keys(study.results)
    pts = points(study)
    print(f"study {study.name}: {len(pts)} points -> {study.results} (dry run)")
    for p in pts:
        state = "done" if p.match_key() in done else "todo"
        cmd, _ = command(p, study.results)
        cmd = [os.path.basename(c) if c == sys.executable else c for c in cmd]
        print(f"[{p.index}/{len(pts)}] {state}  {shlex.join(cmd)}")
    return 0


COMMANDS.register("sweep", "run every point of a TOML grid study (resumable, --dry-run)")(
    Command(add_arguments, run)
)
