"""`scalelab slurm STUDY.toml`: sbatch scripts launching each point with srun or torchrun,
a report job chained after them, and submit_all.sh."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scalelab.cli.base import COMMANDS, Command
from scalelab.errors import UsageError
from scalelab.orchestration.slurm_jobs import SlurmOptions
from scalelab.orchestration.slurm_scripts import write_scripts
from scalelab.orchestration.sweep import load_study
from scalelab.outputs import check_dir

SBATCH_PASSTHROUGH = {
    "--mem": "memory per node, e.g. 64G",
    "--qos": "quality of service",
    "--constraint": "node features, e.g. a100",
    "--gpus-per-task": "GPUs per task",
    "--gpu-bind": "GPU binding, e.g. closest",
    "--account": "Slurm account",
    "--partition": "Slurm partition",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("study", help="study TOML (the same file `scalelab sweep` runs)")
    p.add_argument(
        "--nodes",
        default="1",
        help="nodes available per job (default 1); a list (1,2) writes each point once per "
        "node count it spreads over differently",
    )
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0)")
    p.add_argument("--tasks-per-node", type=int, default=None, help="ranks per node")
    p.add_argument(
        "--cpus-per-task",
        type=int,
        default=None,
        help="CPU cores per rank (default: the point's --threads, else 1)",
    )
    for flag, what in SBATCH_PASSTHROUGH.items():
        p.add_argument(flag, default=None, help=f"sbatch {flag}: {what}")
    p.add_argument("--exclusive", action="store_true", help="sbatch --exclusive: whole nodes")
    p.add_argument("--time", default="00:30:00", help="time limit per job (default 00:30:00)")
    p.add_argument(
        "--python",
        default=sys.executable,
        help="Python on the nodes (default: the one scalelab runs in now, %(default)s)",
    )
    p.add_argument(
        "--mpi-plugin",
        default=None,
        help="srun --mpi=PLUGIN for MPI points (default: what the MPI library speaks and srun "
        "offers, pmix for Open MPI, pmi2 for MPICH)",
    )
    p.add_argument(
        "--setup",
        action="append",
        default=[],
        help="shell line run before the point, e.g. 'source .venv/bin/activate' (repeatable)",
    )
    p.add_argument(
        "--array",
        action="store_true",
        help="job arrays (one per allocation size) instead of one job per point",
    )
    p.add_argument("--out", default=None, help="results file the jobs append to")
    p.add_argument("-o", "--out-dir", default=None, help="folder for the scripts")


def run(args: argparse.Namespace) -> int:
    study = load_study(args.study, args.out)
    passthrough = {
        f[2:].replace("-", "_"): getattr(args, f[2:].replace("-", "_")) for f in SBATCH_PASSTHROUGH
    }
    counts = node_counts(args.nodes)
    opts = SlurmOptions(
        nodes=counts[0],
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task,
        exclusive=args.exclusive,
        time=args.time,
        python=args.python,
        mpi_plugin=args.mpi_plugin,
        setup=tuple(args.setup),
        workdir=Path.cwd(),
        **passthrough,
    )
    out_dir = check_dir(args.out_dir or Path("scalelab-results") / f"slurm-{study.name}", "-o")
    scripts = write_scripts(study, opts, out_dir, args.array, counts)
    if args.quiet:  # -q: warnings only
        return 0
    print(
        f"wrote {len(scripts)} job script(s), report.sbatch and submit_all.sh in {out_dir}: "
        f"submit with `{out_dir}/submit_all.sh [sbatch options]`"
    )
    print(f"records will be appended to {study.results}; the report job writes {out_dir}/report")
    return 0


def node_counts(text: str) -> tuple[int, ...]:
    """--nodes N or N,M,...: node counts, each >= 1 (one line for anything else)."""
    try:
        counts = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise UsageError(f"--nodes {text!r}: expected a node count >= 1 or a list such as 1,2")
    return counts


COMMANDS.register("slurm", "sbatch scripts for a study (srun for MPI, torchrun for DDP)")(
    Command(add_arguments, run)
)
