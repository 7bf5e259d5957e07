"""`scalelab versions WORKLOAD`: the seed's V1..V5 comparison in one command, and every other
strategy and engine the machine can run (versions_variants.py says which).

Runs each on the same inputs (same seed, same batch) and prints one table: strategy, ranks,
wall, throughput, speedup vs the plain one-GPU run (`local cuda`; serial without a GPU), relerr
vs the float64 oracle, digest, dominant phase. `--train` trains a few steps under each
training strategy, checked against one float64 process (run/train_check.py), and prints the
step time and that check instead. One-process strategies go through the runner in this
process; multi-rank ones through `scalelab run --ranks N` (which starts mpiexec or torchrun),
their records read back from a temporary results file. What cannot run here, or what a
strategy refuses for this workload, is skipped with its one-line reason. Every record is
appended to --out, tagged with a shared `versions` id.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from scalelab.cli.base import COMMANDS, Command
from scalelab.cli.commands.versions_table import (
    Rows,
    baseline_line,
    format_table,
    format_train_table,
)
from scalelab.cli.commands.versions_variants import (
    Variant,
    cli_flags,
    unavailable,
    variant_config,
    variants,
)
from scalelab.cli.options import (
    add_config_options,
    add_workload_argument,
    config_from_args,
    workload_name,
)
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.record import DEFAULT_RESULTS, append_record, read_records
from scalelab.record_schema import FINISHED
from scalelab.run.runner import execute

REFUSED = "refused"  # a strategy refused the variant on its ranks (exit 2): listed as skipped

# Flags versions sets itself for every variant.
OWN = {"strategy", "split", "overlap", "ranks", "device", "check", "quiet", "extra", "engine",
       "dp", "stages"}  # fmt: skip
# Flags no variant reads: the variants are checked runs of the strategies with their default
# options, so checkpoints, weights written per variant, ddp's, mpi-dp's and the
# pipeline/tensor strategies' own options do not apply (help leaves them out). The training
# options (--steps, --lr, ...) are read under --train.
UNREAD = {
    "global_batch", "amp", "bucket_mb", "grad_compress", "workers", "nonblocking", "compile",
    "ckpt_every", "ckpt_dir", "resume", "compare_devices", "save_weights", "oversubscribe_gpus",
    "microbatches", "schedule", "balance", "rebalance", "placement", "virtual_stages", "tp",
}  # fmt: skip
TRAIN_STEPS = 3  # --train without --steps or --epochs: a few steps, the check's point


def train_defaults(base: RunConfig, args: argparse.Namespace) -> RunConfig:
    """--train: TRAIN_STEPS steps over a training split of just those batches and one batch
    held out, unless the flags say otherwise (the workloads' 8000 synthetic items would
    take longer to make than to train on)."""
    if not base.train:
        return base
    given = {f: getattr(args, f, None) for f in ("steps", "epochs", "train_size", "heldout_size")}
    steps = given["steps"] if given["steps"] is not None else TRAIN_STEPS
    if given["epochs"] is not None and given["steps"] is None:
        return base  # whole epochs of the workload's split: the user asked
    return dataclasses.replace(
        base,
        steps=steps,
        train_size=given["train_size"] or base.batch * steps,
        heldout_size=given["heldout_size"] or base.batch,
    )


def launch_run(cfg: RunConfig, results: Path, timeout: float) -> tuple[int, str]:
    """`scalelab run` in a subprocess (it starts mpiexec/torchrun itself); (exit code, stderr)."""
    cmd = [sys.executable, "-m", "scalelab", "run", cfg.workload, *cli_flags(cfg)]
    cmd += ["--out", str(results)]
    env = {k: v for k, v in os.environ.items() if k != "SCALELAB_LAUNCHED"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    return proc.returncode, proc.stderr


def run_variant(v: Variant, base: RunConfig, tmp: Path, timeout: float) -> dict[str, Any]:
    """The variant's record; a stub with status `refused` and the strategy's one-line refusal
    (exit 2: a check only the ranks could make), or `failed` and the reason."""
    cfg = variant_config(v, base)
    results = tmp / f"{uuid.uuid4().hex}.jsonl"
    if not v.launched:
        try:
            return execute(cfg, results).record
        except UsageError as exc:
            return {"status": REFUSED, "error": str(exc)}
    code, err = launch_run(cfg, results, timeout)
    if results.exists():
        return read_records(results)[-1]
    last = [line for line in err.strip().splitlines() if line.strip()]
    line = last[-1] if last else ""
    if code == 2:
        return {"status": REFUSED, "error": line.removeprefix("scalelab run: error: ")}
    return {"status": "failed", "error": f"exit {code}: {line}"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_argument(p)
    add_config_options(p, skip=OWN | UNREAD)
    p.add_argument("--ranks", type=int, default=2, help="ranks of the multi-rank runs (default 2)")
    p.add_argument(
        "--all",
        action="store_true",
        help="also the model-parallel and sharded strategies (pipeline, tensor, fsdp) on CPU "
        "ranks: one more launch each",
    )
    p.add_argument(
        "--out",
        default=str(DEFAULT_RESULTS),
        help=f"results file every record is appended to (default: {DEFAULT_RESULTS})",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    p.add_argument(
        "--only",
        action="append",
        metavar="TEXT",
        help="run only the variants whose label contains TEXT (repeatable: any of them), "
        "e.g. --only cuda --only nccl",
    )


def _selected(todo: list[Variant], only: list[str] | None) -> list[Variant]:
    """The variants --only keeps; a TEXT no label contains is refused, with the labels."""
    if not only:
        return todo
    for text in only:
        if not any(text in v.label for v in todo):
            labels = ", ".join(v.label for v in todo)
            raise UsageError(f"--only {text!r} matches no variant; the variants: {labels}")
    return [v for v in todo if any(text in v.label for text in only)]


def _base(args: argparse.Namespace) -> RunConfig:
    """The config every variant starts from; a bad workload option or one no run of this mode
    reads fails here, before anything runs."""
    if args.ranks < 1:
        raise UsageError(f"--ranks must be >= 1, got {args.ranks}")
    base = train_defaults(config_from_args(args, workload=workload_name(args), quiet=True), args)
    from scalelab.run.runner import check_config
    from scalelab.workloads import WORKLOADS

    WORKLOADS.get(base.workload)(base)
    check_config(variant_config(variants(args.ranks, base.train)[0], base))
    return base


def _run_all(
    todo: list[Variant], base: RunConfig, args: argparse.Namespace, tag: str, skipped: dict
) -> Rows:
    """Every record carries the variants skipped here (`versions_skipped`: label -> why)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="scalelab-versions-") as tmp:
        for i, v in enumerate(todo, 1):
            print(f"[{i}/{len(todo)}] {v.label} x{v.ranks}", file=sys.stderr, flush=True)
            rec = run_variant(v, base, Path(tmp), args.timeout)
            if "schema" in rec:
                rec["versions"] = tag
                rec["versions_skipped"] = skipped
                append_record(args.out, rec)
            rows.append((v, rec))
    return rows


def _title(base: RunConfig) -> str:
    what = f"{base.workload}: batch {base.batch}, {base.dtype}, same inputs (seed {base.seed})"
    if base.train:
        what += f"; training {base.steps} steps, checked against one float64 process"
    return what


def run(args: argparse.Namespace) -> int:
    base = _base(args)
    tag = uuid.uuid4().hex[:12]
    todo = _selected(variants(args.ranks, base.train), args.only)
    plan = [(v, unavailable(v, base, args.all)) for v in todo]
    skipped = {v.label: why for v, why in plan if why is not None}
    ran = _run_all([v for v, why in plan if why is None], base, args, tag, skipped)
    rows = [(v, r) for v, r in ran if r.get("status") != REFUSED]
    refused = {v.label: r["error"] for v, r in ran if r.get("status") == REFUSED}
    print(_title(base))
    print(baseline_line(rows))
    print(format_train_table(rows) if base.train else format_table(rows))
    print(skipped_lines({**skipped, **refused}, set(refused), args.verbose), end="")
    ok = [r for _, r in rows if r.get("status") in FINISHED]
    if not base.train:
        digests = {r["digest"] for r in ok}
        print(f"digests: {'all equal' if len(digests) == 1 else f'{len(digests)} different'}",
              end="; ")  # fmt: skip
    print(f"records appended to {args.out} (versions id {tag})")
    bad = [r for _, r in rows if r.get("status") != "ok" or not r.get("check_passed", True)]
    failed = sum(r.get("status") == "check-failed" for _, r in rows)
    if failed:
        print(f"check-failed: {failed} of {len(rows)} runs disagree with the float64 reference")
    return 1 if bad else 0


def skipped_lines(skipped: dict[str, str], refused: set[str], verbose: int) -> str:
    """A refusal (the strategy's own, for this workload) gets its line; what this machine or
    mode cannot run folds into one line of reasons with counts, every variant with -v."""
    if verbose:
        return "".join(f"skipped {label}: {why}\n" for label, why in skipped.items())
    lines = [f"skipped {label}: {skipped[label]}\n" for label in skipped if label in refused]
    counts: dict[str, int] = {}
    for label, why in skipped.items():
        if label not in refused:
            counts[why] = counts.get(why, 0) + 1
    if counts:
        reasons = "; ".join(f"{why} ({n})" for why, n in counts.items())
        lines.append(f"skipped {sum(counts.values())} variants: {reasons} (-v: each)\n")
    return "".join(lines)


COMMANDS.register("versions", "every strategy this machine can run, one comparison table")(
    Command(add_arguments, run)
)
