"""sbatch scripts for a study: one job per point, or job arrays (one per allocation size).

Each point launches the way its strategy needs:

- MPI strategies (launcher "mpi"): `srun --mpi=PLUGIN` starts the ranks itself (one task per
  rank); the plugin is one the MPI library speaks (pmix for Open MPI, pmi2 for MPICH).
- torch.distributed strategies (launcher "torchrun"): one `torchrun` per node via
  `srun --ntasks-per-node=1`, meeting at a c10d rendezvous on the first node of the job, on a
  port derived from the job id (two jobs sharing a node do not collide).
- single-process strategies: one task.

Every point runs through `run_point` (scripts.py): a point that already has an ok record is
skipped, and a job stopped by its time limit or scancel, or a step that dies, leaves a failed
record. Every argument is shell-quoted (shlex); the scheduler fields are checked, since
`#SBATCH` lines are not shell-parsed and cannot be quoted.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from scalelab.errors import UsageError
from scalelab.orchestration.sweep import Point
from scalelab.strategies import STRATEGIES

SAFE_FIELD = re.compile(r"^[A-Za-z0-9_.,:+=-]+$")
SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+-]+$")
TIME = re.compile(r"^(\d+-)?\d+(:\d{2}){0,2}$")
UNLIMITED = ("UNLIMITED", "INFINITE")
MEM = re.compile(r"^\d+[KMGT]?$")
# sbatch options passed through as given (value checked, then one #SBATCH line each)
PASSTHROUGH = ("mem", "qos", "constraint", "gpus_per_task", "gpu_bind", "account", "partition")


@dataclass(frozen=True)
class SlurmOptions:
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int | None = None  # ranks per node (default: GPUs per node, else spread)
    cpus_per_task: int | None = None  # CPUs per rank (default: the point's --threads, else 1)
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    mem: str | None = None
    gpus_per_task: str | None = None
    gpu_bind: str | None = None
    exclusive: bool = False
    time: str = "00:30:00"
    python: str = sys.executable  # the interpreter scalelab runs in (has scalelab)
    mpi_plugin: str | None = None  # srun --mpi=<plugin>; None: chosen by default_mpi_plugin
    setup: tuple[str, ...] = ()  # shell lines run first (module load, venv activation)
    workdir: Path = Path(".")

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 0:
            raise UsageError("--nodes must be >= 1 and --gpus-per-node >= 0")
        for name in ("tasks_per_node", "cpus_per_task"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.time.upper() not in UNLIMITED and not (
            TIME.match(self.time) and _fields_ok(self.time)
        ):
            raise UsageError(
                f"--time {self.time!r}: expected a limit above 0 as [D-]HH:MM:SS (minutes and "
                "seconds below 60), MM, MM:SS, D-HH or UNLIMITED, e.g. 00:30:00"
            )
        if self.mem is not None and not MEM.match(self.mem):
            raise UsageError(f"--mem {self.mem!r}: expected a size such as 64G or 4000M")
        for name in (*PASSTHROUGH, "mpi_plugin"):
            value = getattr(self, name)
            if value is not None and not SAFE_FIELD.match(value):
                raise UsageError(f"--{name.replace('_', '-')} {value!r}: unexpected characters")

    def minutes(self) -> float:
        """The time limit in minutes (inf for UNLIMITED)."""
        if self.time.upper() in UNLIMITED:
            return math.inf
        return _minutes(self.time)


def _hms(time: str) -> tuple[int, int, int, int]:
    """(days, hours, minutes, seconds) of Slurm's MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM,
    D-HH:MM:SS."""
    days, sep, rest = time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if sep:
        h, m, s = (parts + [0, 0])[:3]
    else:
        h, m, s = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return int(days or 0), h, m, s


def _minutes(time: str) -> float:
    d, h, m, s = _hms(time)
    return (d * 24 + h) * 60 + m + s / 60


def _fields_ok(time: str) -> bool:
    """Slurm reads 00:61:00 as 01:01:00 and 0 as no limit at all: neither is what was meant."""
    _, h, m, s = _hms(time)
    clock = ":" in time and (time.count(":") == 2 or "-" in time)  # minutes is a clock field
    return s < 60 and (m < 60 or not clock) and _minutes(time) > 0


@dataclass(frozen=True)
class Layout:
    """How one point maps onto an allocation; points with equal layouts share an array."""

    launcher: str | None
    ranks: int
    nodes: int
    per_node: int
    threads: int  # CPUs per rank

    @property
    def tasks(self) -> int:
        """Slurm tasks: one torchrun per node, else one per rank."""
        return self.nodes if self.launcher == "torchrun" else self.ranks

    @property
    def cpus_per_task(self) -> int:
        return self.threads * (self.per_node if self.launcher == "torchrun" else 1)


def layout(point: Point, opts: SlurmOptions) -> Layout:
    cfg = point.config
    launcher = STRATEGIES.get(cfg.strategy).launcher_for(cfg)
    ranks = cfg.ranks if launcher else 1
    if cfg.device == "cuda" and not (opts.gpus_per_node or opts.gpus_per_task):
        raise UsageError(
            f"point {point.index} ({point.describe()}) runs on --device cuda but the jobs ask "
            "for no GPU: give --gpus-per-node N"
        )
    per_node = opts.tasks_per_node or opts.gpus_per_node or math.ceil(ranks / opts.nodes)
    nodes = min(opts.nodes, math.ceil(ranks / per_node))
    if ranks > nodes * per_node:
        raise UsageError(
            f"point {point.index} ({point.describe()}) needs {ranks} ranks but "
            f"{opts.nodes} nodes x {per_node} per node give {opts.nodes * per_node}"
        )
    if launcher == "torchrun" and ranks % nodes:
        raise UsageError(
            f"point {point.index}: torchrun needs ranks ({ranks}) divisible by nodes ({nodes})"
        )
    threads = cfg.threads or opts.cpus_per_task or 1
    return Layout(launcher, ranks, nodes, min(per_node, ranks), threads)


def srun_mpi_plugins() -> list[str] | None:
    """The MPI plugins this Slurm's srun offers (`srun --mpi=list`); None without srun."""
    try:
        out = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout + out.stderr
    names = re.findall(r"^\s*(?:srun:\s*)?(pmix|pmi2|cray_shasta|none)\s*$", text, re.M)
    return names or None


def default_mpi_plugin() -> str:
    """The first PMI the MPI library speaks that srun offers (pmix where both have it, else
    pmi2); pmi2 when neither can be asked."""
    from scalelab.environment import mpi_info

    speaks = mpi_info().get("mpi_pmi") or ["pmi2"]
    offered = srun_mpi_plugins()
    if offered is None:
        return speaks[-1]
    return next((p for p in speaks if p in offered), speaks[-1])


def launch_words(lay: Layout, opts: SlurmOptions, plugin: str) -> list[str]:
    """The command before the point's `run ...` arguments. A torchrun point runs one
    `scalelab run ... --nnodes N` per node (rdzv_words): scalelab starts that node's torchrun
    and watches it, so a dead rank or a refusal ends the step with one line and one record."""
    if lay.launcher == "torchrun":
        srun = ["srun", f"--nodes={lay.nodes}", f"--ntasks={lay.nodes}", "--ntasks-per-node=1"]
        return [*srun, opts.python, "-m", "scalelab"]
    srun = ["srun", f"--nodes={lay.nodes}", f"--ntasks={lay.ranks}"]
    if lay.launcher == "mpi":
        srun += [f"--ntasks-per-node={lay.per_node}", f"--mpi={plugin}"]
    return [*srun, opts.python, "-m", "scalelab"]


def rdzv_words(lay: Layout) -> list[str]:
    """`run` options after the point's own: the nodes meet at a c10d rendezvous on the first
    node. `$head`, `$port` and `$SLURM_JOB_ID` stay shell expansions (scripts.py writes them
    unquoted)."""
    if lay.launcher != "torchrun" or lay.nodes == 1:
        return []
    return ["--nnodes", str(lay.nodes), "--rdzv-endpoint=$head:$port", "--rdzv-id=$SLURM_JOB_ID"]


def check_plugin(plugin: str) -> None:
    """An srun --mpi plugin this Slurm lacks fails every MPI step at once: refused here, before
    anything is queued (where srun can be asked)."""
    offered = srun_mpi_plugins()
    if offered is not None and plugin not in offered:
        raise UsageError(f"--mpi-plugin {plugin}: this Slurm's srun offers {', '.join(offered)}")


def per_torchrun(gpus_per_rank: str, ranks_per_node: int) -> str:
    """--gpus-per-task is per rank; a torchrun point's task is a node's torchrun, which runs
    ranks_per_node ranks: `1` over 4 ranks per node is 4 (`a100:1`: `a100:4`)."""
    kind, _, count = gpus_per_rank.rpartition(":")
    if not count.isdigit():
        raise UsageError(f"--gpus-per-task {gpus_per_rank!r}: expected N or TYPE:N")
    return (f"{kind}:" if kind else "") + str(int(count) * ranks_per_node)


def header(job: str, lay: Layout, opts: SlurmOptions, log: str) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={lay.nodes}",
        f"#SBATCH --time={opts.time}",
        f"#SBATCH --output={log}",
        "#SBATCH --open-mode=append",  # a requeued job's log keeps its earlier attempts
        f"#SBATCH --cpus-per-task={lay.cpus_per_task}",
    ]
    if lay.launcher == "torchrun":
        lines.append("#SBATCH --ntasks-per-node=1")
    else:
        lines.append(f"#SBATCH --ntasks={lay.tasks}")
    if opts.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={opts.gpus_per_node}")
    for name in PASSTHROUGH:
        value = getattr(opts, name)
        if value is not None and name == "gpus_per_task" and lay.launcher == "torchrun":
            value = per_torchrun(value, lay.per_node)
        if value is not None:
            lines.append(f"#SBATCH --{name.replace('_', '-')}={value}")
    if opts.exclusive:
        lines.append("#SBATCH --exclusive")
    if 10 <= opts.minutes() < math.inf:  # the limit is near: noted, the point runs on
        lines.append("#SBATCH --signal=B:USR1@120")
    return lines
