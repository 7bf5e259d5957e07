"""sbatch scripts for a study: one per point, or one job array.

Each point launches the way its strategy needs:

- MPI strategies (launcher "mpi"): `srun` starts the ranks itself (one task per rank); scalelab
  sees SLURM_PROCID and runs in place instead of starting mpiexec.
- torch.distributed strategies (launcher "torchrun"): one `torchrun` per node via
  `srun --ntasks-per-node=1`, meeting at a c10d rendezvous on the first node of the job.
- single-process strategies: one task.

Every argument is shell-quoted (shlex); the scheduler fields are checked, since `#SBATCH`
lines are not shell-parsed and cannot be quoted.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from scalelab.analysis.sweep import Point, Study, points
from scalelab.errors import UsageError
from scalelab.strategies import STRATEGIES

RDZV_PORT = 29500
SAFE_FIELD = re.compile(r"^[A-Za-z0-9_.,:+-]+$")
SAFE_PATH = re.compile(r"^[A-Za-z0-9_./+-]+$")
TIME = re.compile(r"^(\d+-)?\d+(:\d{2}){0,2}$")

COMM_ENV = """\
# --- communication settings: uncomment what your cluster needs ---------------------------
# export NCCL_DEBUG=INFO                 # print the transport NCCL chose (IB, sockets, NVLink)
# export NCCL_SOCKET_IFNAME=ib0          # interface NCCL bootstraps on (multi-homed nodes)
# export NCCL_IB_HCA=mlx5                # InfiniBand adapters NCCL may use
# export NCCL_NVLS_ENABLE=0              # NVLink SHARP multicast off (shared or MIG nodes)
# export UCX_TLS=rc,sm,cuda_copy,cuda_ipc   # UCX transports for CUDA-aware Open MPI over IB
# export UCX_NET_DEVICES=mlx5_0:1        # the IB port UCX uses
# export OMPI_MCA_pml=ucx                # Open MPI: UCX for point-to-point messages
# export SCALELAB_DEBUG=1                # full tracebacks instead of one-line errors
export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"   # torch intra-op threads per rank
"""


@dataclass(frozen=True)
class SlurmOptions:
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int | None = None  # ranks per node (default: GPUs per node, else spread)
    cpus_per_task: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str = "00:30:00"
    python: str = "python3"
    mpi_plugin: str | None = None  # srun --mpi=<plugin> (pmix, pmi2) when MPI needs it
    setup: tuple[str, ...] = ()  # shell lines run first (module load, venv activation)
    workdir: Path = Path(".")

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 0:
            raise UsageError("--nodes must be >= 1 and --gpus-per-node >= 0")
        if not TIME.match(self.time):
            raise UsageError(f"--time {self.time!r}: expected [D-]HH:MM:SS, e.g. 00:30:00")
        for name in ("partition", "account", "mpi_plugin"):
            value = getattr(self, name)
            if value is not None and not SAFE_FIELD.match(value):
                raise UsageError(f"--{name.replace('_', '-')} {value!r}: unexpected characters")


@dataclass(frozen=True)
class Layout:
    """How one point maps onto the allocation."""

    launcher: str | None
    ranks: int
    nodes: int
    per_node: int


def layout(point: Point, opts: SlurmOptions) -> Layout:
    cfg = point.config
    launcher = STRATEGIES.get(cfg.strategy).launcher
    ranks = cfg.ranks if launcher else 1
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
    return Layout(launcher, ranks, nodes, min(per_node, ranks))


def launch_line(point: Point, lay: Layout, opts: SlurmOptions, results: Path) -> str:
    """The shell line that runs one point inside its allocation."""
    run = [*point.argv(), "--out", str(results)]
    if lay.launcher == "torchrun":
        srun = ["srun", f"--nodes={lay.nodes}", f"--ntasks={lay.nodes}", "--ntasks-per-node=1"]
        torchrun = [
            opts.python,
            "-m",
            "torch.distributed.run",
            f"--nnodes={lay.nodes}",
            f"--nproc-per-node={lay.ranks // lay.nodes}",
            "--rdzv-backend=c10d",
        ]
        # The two $-expansions must reach the shell unquoted; everything else is quoted.
        rdzv = f'--rdzv-id="$SLURM_JOB_ID" --rdzv-endpoint="$head:{RDZV_PORT}"'
        return f"{shlex.join(srun + torchrun)} {rdzv} {shlex.join(['-m', 'scalelab', *run])}"
    srun = ["srun", f"--nodes={lay.nodes}", f"--ntasks={lay.ranks}"]
    if lay.launcher == "mpi":
        srun.append(f"--ntasks-per-node={lay.per_node}")
        if opts.mpi_plugin:
            srun.append(f"--mpi={opts.mpi_plugin}")
    return shlex.join([*srun, opts.python, "-m", "scalelab", *run])


def _header(job: str, lay: Layout, opts: SlurmOptions, log_dir: Path) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={lay.nodes}",
        f"#SBATCH --time={opts.time}",
        f"#SBATCH --output={log_dir}/%x-%j.out",
    ]
    if lay.launcher == "torchrun":
        lines.append("#SBATCH --ntasks-per-node=1")
    else:
        lines.append(f"#SBATCH --ntasks={lay.ranks}")
    if opts.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={opts.gpus_per_node}")
    if opts.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={opts.cpus_per_task}")
    if opts.partition:
        lines.append(f"#SBATCH --partition={opts.partition}")
    if opts.account:
        lines.append(f"#SBATCH --account={opts.account}")
    return lines


def _preamble(opts: SlurmOptions, torchrun: bool) -> list[str]:
    lines = ["set -euo pipefail", f"cd {shlex.quote(str(opts.workdir))}", *opts.setup, COMM_ENV]
    if torchrun:
        # The rendezvous host: the job's first node. sed reads every line (`head -n 1` could
        # SIGPIPE scontrol, which pipefail turns into a failed job).
        lines.append('head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)')
    return lines


def point_script(study: Study, point: Point, opts: SlurmOptions, log_dir: Path) -> str:
    lay = layout(point, opts)
    job = _job_name(study, point.index)
    lines = [
        *_header(job, lay, opts, log_dir),
        f"# scalelab study {study.name}, point {point.index}: {point.describe()}",
        *_preamble(opts, lay.launcher == "torchrun"),
        launch_line(point, lay, opts, study.results),
    ]
    return "\n".join(lines) + "\n"


def array_script(study: Study, pts: list[Point], opts: SlurmOptions, log_dir: Path) -> str:
    """One job array; every task gets the largest point's allocation."""
    lays = [layout(p, opts) for p in pts]
    torchrun = any(lay.launcher == "torchrun" for lay in lays)
    # Each task's srun names its own nodes and tasks, within the largest point's allocation.
    header_layout = Layout(
        "torchrun" if all(lay.launcher == "torchrun" for lay in lays) else "mpi",
        max(lay.ranks for lay in lays),
        max(lay.nodes for lay in lays),
        max(lay.per_node for lay in lays),
    )
    lines = [
        *_header(_job_name(study, None), header_layout, opts, log_dir),
        f"#SBATCH --array=1-{len(pts)}",
        f"# scalelab study {study.name}: {len(pts)} points, one array task each",
        *_preamble(opts, torchrun),
        'case "$SLURM_ARRAY_TASK_ID" in',
    ]
    for p, lay in zip(pts, lays):
        lines += [
            f"  {p.index})  # {p.describe()}",
            f"    {launch_line(p, lay, opts, study.results)}",
            "    ;;",
        ]
    lines += ['  *) echo "no point $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac"]
    return "\n".join(lines) + "\n"


def _job_name(study: Study, index: int | None) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", study.name)
    return f"scalelab-{safe}" + (f"-{index}" if index is not None else "")


def write_scripts(study: Study, opts: SlurmOptions, out_dir: Path, array: bool) -> list[Path]:
    """Write the scripts (and submit_all.sh for per-point scripts); returns what to submit."""
    pts = points(study)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir.resolve() / "logs"
    if not SAFE_PATH.match(str(log_dir)):
        raise UsageError(f"{log_dir}: #SBATCH --output cannot take this path; pick a plainer -o")
    log_dir.mkdir(exist_ok=True)
    if array:
        path = out_dir / "array.sbatch"
        path.write_text(array_script(study, pts, opts, log_dir))
        return [path]
    paths = []
    for p in pts:
        path = out_dir / f"point_{p.index:03d}.sbatch"
        path.write_text(point_script(study, p, opts, log_dir))
        paths.append(path)
    submit = out_dir / "submit_all.sh"
    body = "".join(f"sbatch {shlex.quote(str(p.resolve()))}\n" for p in paths)
    submit.write_text(f"#!/bin/bash\nset -euo pipefail\n{body}")
    submit.chmod(0o755)
    return paths
