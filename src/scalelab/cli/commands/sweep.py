"""`scalelab sweep STUDY.toml`: every point of a grid, one run each, resumable."""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import shutil
import sys
from pathlib import Path

from scalelab.cli.base import COMMANDS, Command
from scalelab.errors import UsageError
from scalelab.orchestration.sweep import (
    finished,
    is_done,
    job_nodes,
    load_study,
    points,
    run_study,
)
from scalelab.outputs import check_file


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
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a study field (TOML value; a list sets that grid axis), e.g. "
        "--set data_dir=../shared/data/mnist --set ranks=[1,2]; repeatable",
    )


def run(args: argparse.Namespace) -> int:
    study = load_study(args.study, args.out, args.set)
    if args.timeout is not None:
        if not (math.isfinite(args.timeout) and args.timeout > 0):
            raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
        study = dataclasses.replace(study, timeout_s=args.timeout)
    if not args.dry_run:
        check_file(study.results, "results")
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


def scalelab_executable() -> str:
    """What runs as printed: `scalelab` when that is the one on PATH, else its full path
    beside this Python (a venv not activated)."""
    beside = Path(sys.executable).parent / "scalelab"
    on_path = shutil.which("scalelab")
    if on_path and (not beside.exists() or Path(on_path).resolve() == beside.resolve()):
        return "scalelab"
    return str(beside) if beside.exists() else f"{sys.executable} -m scalelab"


def dry_run(study, force: bool) -> int:
    pts = points(study)
    ok, nodes = ([] if force else finished(study.results)), job_nodes()
    print(f"study {study.name}: {len(pts)} points -> {study.results} (dry run)")
    for p in pts:
        state = "done" if is_done(p, ok, nodes) else "todo"
        cmd = [scalelab_executable(), *p.argv(), "--out", str(study.results)]
        print(f"[{p.index}/{len(pts)}] {state}  {shlex.join(cmd)}")
    return 0


COMMANDS.register("sweep", "run every point of a TOML grid study (resumable, --dry-run)")(
    Command(add_arguments, run)
)
