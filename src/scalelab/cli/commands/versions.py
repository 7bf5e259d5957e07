"""`scalelab versions WORKLOAD`: the seed's V1..V5 comparison in one command.

Runs every strategy this machine can run on the same inputs (same seed, same batch) and prints
one table: strategy, ranks, wall, throughput, speedup vs serial, relerr vs the float64 oracle,
digest, dominant phase. One-process strategies go through the runner in this process;
multi-rank ones through `scalelab run --ranks N` (which starts mpiexec or torchrun), their
records read back from a temporary results file. What cannot run here is skipped with a
one-line reason. Every record is appended to --out, tagged with a shared `versions` id.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scalelab.cli.base import COMMANDS, Command
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
from scalelab.runner import execute

# Flags versions sets itself for every variant.
OWN = {"strategy", "split", "overlap", "ranks", "device", "check", "quiet", "extra"}
# Flags no variant reads: the variants are checked inference runs (serial, local, mpi,
# mpi-gpu, nccl), so training, checkpoints, weights written per variant, ddp and the
# pipeline/tensor strategies' own options do not apply (help leaves them out).
UNREAD = {
    "train", "epochs", "steps", "lr", "momentum", "l2", "train_size", "heldout_size",
    "global_batch", "amp", "bucket_mb", "grad_compress", "workers", "nonblocking", "compile",
    "ckpt_every", "ckpt_dir", "resume", "compare_devices", "save_weights", "oversubscribe_gpus",
    "stages", "microbatches", "schedule", "balance", "rebalance", "placement", "engine",
    "virtual_stages", "tp", "dp",
}  # fmt: skip


@dataclass(frozen=True)
class Variant:
    label: str
    strategy: str
    ranks: int = 1
    device: str = "cpu"
    split: str = "batch"
    overlap: bool = False

    @property
    def launched(self) -> bool:
        return self.ranks > 1 or self.strategy in ("mpi", "mpi-gpu", "nccl")


def variants(ranks: int) -> list[Variant]:
    """Serial, local CPU, MPI (three splits), local CUDA, MPI+GPU (plain, overlapped), NCCL."""
    gpu_ranks = ranks
    return [
        Variant("serial (V1)", "serial"),
        Variant("local cpu", "local"),
        *(
            Variant(f"mpi {s} (V2)", "mpi", ranks, split=s)
            for s in ("broadcast", "batch", "spatial")
        ),
        Variant("local cuda (V3)", "local", device="cuda"),
        Variant("mpi-gpu (V4)", "mpi-gpu", gpu_ranks, "cuda"),
        Variant("mpi-gpu --overlap", "mpi-gpu", gpu_ranks, "cuda", overlap=True),
        Variant("nccl (V5)", "nccl", gpu_ranks, "cuda"),
    ]


def unavailable(v: Variant, base: RunConfig) -> str | None:
    """Why v cannot run on this machine (None: it can)."""
    from scalelab.strategies import STRATEGIES

    cfg = variant_config(v, base)
    if v.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    if v.device == "cuda" and v.ranks > torch.cuda.device_count():
        return f"needs {v.ranks} GPUs, this machine has {torch.cuda.device_count()}"
    if STRATEGIES.get(v.strategy).launcher == "mpi":
        from scalelab.environment import mpi_problem

        problem = mpi_problem()
        if problem is not None:
            return problem
        from scalelab.comm.launch import find_mpiexec

        try:
            find_mpiexec()
        except UsageError as exc:
            return str(exc)
    try:
        preflight = getattr(STRATEGIES.get(v.strategy), "preflight", None)
        if preflight is not None:
            preflight(cfg)
        from scalelab.workloads import WORKLOADS

        if v.strategy == "serial" and not WORKLOADS.get(cfg.workload).has_reference():
            return f"{cfg.workload} has no NumPy float64 reference"
    except UsageError as exc:
        return str(exc)
    return None


def variant_config(v: Variant, base: RunConfig) -> RunConfig:
    return dataclasses.replace(
        base,
        strategy=v.strategy,
        ranks=v.ranks,
        device=v.device,
        split=v.split,
        overlap=v.overlap,
        check=True,
        quiet=True,
    )


def cli_flags(cfg: RunConfig) -> list[str]:
    """The command line that rebuilds cfg: every field that differs from its default."""
    out = []
    for f in dataclasses.fields(RunConfig):
        if f.name in ("workload", "extra"):
            continue
        value = getattr(cfg, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        out += [flag] if value is True else [] if value is False else [flag, str(value)]
    return out


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
    """The variant's record, or a stub with status failed and the reason."""
    cfg = variant_config(v, base)
    results = tmp / f"{uuid.uuid4().hex}.jsonl"
    if v.launched:
        code, err = launch_run(cfg, results, timeout)
        if results.exists():
            return read_records(results)[-1]
        last = [line for line in err.strip().splitlines() if line.strip()]
        return {"status": "failed", "error": f"exit {code}: {last[-1] if last else ''}"}
    return execute(cfg, results).record


def dominant(rec: dict[str, Any]) -> str:
    top = {k: v for k, v in rec.get("phases", {}).items() if "/" not in k}
    if not top:
        return "-"
    name = max(top, key=top.get)
    return f"{name} {top[name] / rec['wall_s']:.0%}"


def format_table(rows: list[tuple[Variant, dict[str, Any]]]) -> str:
    serial = next((r for v, r in rows if v.strategy == "serial" and r.get("status") == "ok"), None)
    head = (
        f"{'strategy':<20}{'ranks':>6}{'wall ms':>11}{'items/s':>11}{'speedup':>9}"
        f"{'relerr':>10}  {'digest':<18}{'dominant phase'}"
    )
    lines = [head, "-" * len(head)]
    for v, r in rows:
        if r.get("status") not in FINISHED:
            lines.append(f"{v.label:<20}{v.ranks:>6}  {r.get('status')}: {r.get('error')}")
            continue
        speed = f"{serial['wall_s'] / r['wall_s']:.2f}x" if serial else "-"
        mark = "" if r["digest"] == r["reference_digest"] else " (!)"
        lines.append(
            f"{v.label:<20}{r['ranks']:>6}{r['wall_s'] * 1e3:>11.2f}{r['throughput']:>11.1f}"
            f"{speed:>9}{r['relerr']:>10.1e}  {r['digest'] + mark:<18}{dominant(r)}"
            + ("  check-failed" if r["status"] == "check-failed" else "")
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_argument(p)
    add_config_options(p, skip=OWN | UNREAD)
    p.add_argument("--ranks", type=int, default=2, help="ranks of the MPI/NCCL runs (default 2)")
    p.add_argument(
        "--out",
        default=str(DEFAULT_RESULTS),
        help=f"results file every record is appended to (default: {DEFAULT_RESULTS})",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")


def run(args: argparse.Namespace) -> int:
    if args.ranks < 1:
        raise UsageError(f"--ranks must be >= 1, got {args.ranks}")
    base = config_from_args(args, workload=workload_name(args), quiet=True)
    from scalelab.workloads import WORKLOADS

    WORKLOADS.get(base.workload)(base)  # a bad workload option fails before anything runs
    tag = uuid.uuid4().hex[:12]
    plan = [(v, unavailable(v, base)) for v in variants(args.ranks)]
    todo = [v for v, why in plan if why is None]
    rows = []
    with tempfile.TemporaryDirectory(prefix="scalelab-versions-") as tmp:
        for i, v in enumerate(todo, 1):
            print(f"[{i}/{len(todo)}] {v.label} x{v.ranks}", file=sys.stderr, flush=True)
            rec = run_variant(v, base, Path(tmp), args.timeout)
            if "schema" in rec:
                rec["versions"] = tag
                append_record(args.out, rec)
            rows.append((v, rec))
    print(f"{base.workload}: batch {base.batch}, {base.dtype}, same inputs (seed {base.seed})")
    print(format_table(rows))
    for v, why in plan:
        if why is not None:
            print(f"skipped {v.label}: {why}")
    ok = [r for _, r in rows if r.get("status") in FINISHED]
    digests = {r["digest"] for r in ok}
    verdict = "all equal" if len(digests) == 1 else f"{len(digests)} different"
    print(f"digests: {verdict}; records appended to {args.out} (versions id {tag})")
    bad = [r for _, r in rows if r.get("status") != "ok" or not r.get("check_passed", True)]
    failed = sum(r.get("status") == "check-failed" for _, r in rows)
    if failed:
        print(f"check-failed: {failed} of {len(rows)} runs disagree with the float64 reference")
    return 1 if bad else 0


COMMANDS.register("versions", "every strategy this machine can run, one comparison table")(
    Command(add_arguments, run)
)
