"""Writing a study's sbatch scripts: one job per point or one array per allocation size,
a report job chained after them with --dependency=afterany, and submit_all.sh that submits
everything with the sbatch options it is given ("$@")."""

from __future__ import annotations

import re
import shlex
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from scalelab.comm import slurm_env as slurm
from scalelab.errors import UsageError
from scalelab.orchestration.slurm_jobs import (
    SAFE_PATH,
    Layout,
    SlurmOptions,
    check_plugin,
    default_mpi_plugin,
    header,
    launch_words,
    layout,
    rdzv_words,
)
from scalelab.orchestration.sweep import Point, Study, points

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
"""

# run_point: the arrays `launch` and `args` name one point. Skipped when it has an ok record.
# Every way the step ends leaves exactly one record of this attempt: the ranks' own (ok, a
# check failed, a failure, a dead rank named by its watcher) or, when the step left none (srun
# itself failed, a refusal, a signal), a failed record with the step's last scalelab or srun
# line; `point_helper failed` writes nothing where this attempt has a record. A job stopped by
# SIGTERM records why (`point_helper stopped` asks scontrol: its time limit, scancel, requeued)
# within Slurm's KillWait: it reads the record `point_helper prepare` wrote to $prepared at the
# start, not parsing the point again (that imports torch: seconds on a loaded node).
# USR1 (--signal ahead of the limit) only notes that the limit is near: the point runs on,
# and may still finish. srun runs in the
# background so the traps fire at once (bash runs traps only between foreground commands).
# The traps stay until the script ends: Slurm stopping the job just as its step ends (a
# requeue revokes the job's credential, so an srun still launching fails at once, before the
# script's SIGTERM) signals every process, `point_helper failed` too, and the shell died
# untrapped with no record of the attempt.
RUN_POINT = """\
point_helper() { "$PY" -m scalelab.cli.slurm_point "$@"; }
stopped() {
  point_helper stopped "$near_limit" "$prepared" "${args[@]}" || true
  exit 143
}
warned() { near_limit=1; woken=1; }
last_said() { grep -E '^(scalelab|srun: error)' "$1" | tail -n 1 || true; }
run_point() {
  trap stopped TERM
  trap warned USR1
  [ -z "$stop_early" ] || stopped
  if point_helper prepare "$prepared" "${args[@]}"; then
    echo "scalelab: this point has an ok record already: skipped"
    return 0
  fi
  local said code
  said=$(mktemp)
  "${launch[@]}" "${args[@]}" 2> >(tee "$said" >&2) &
  local step=$!
  while :; do
    woken="" code=0
    wait "$step" || code=$?
    [ -n "$woken" ] || break  # USR1 interrupted the wait: the step runs on
  done
  sleep 0.2  # tee's last lines
  if [ "$code" != 0 ]; then
    local why
    why=$(last_said "$said")
    point_helper failed "the job step exited with code $code${why:+: $why}" "${args[@]}" || true
  fi
  rm -f "$said"
  return "$code"
}
"""


def _words(words: list[str]) -> str:
    """shlex-quoted, except the expansions launch_words leaves for the shell."""
    return " ".join(f'"{w}"' if "$" in w else shlex.quote(w) for w in words)


def point_lines(point: Point, lay: Layout, opts: SlurmOptions, plugin: str, results: Path):
    args = shlex.join([*point.argv(), "--out", str(results)])
    rdzv = rdzv_words(lay)
    return [
        f"launch=({_words(launch_words(lay, opts, plugin))})",
        f"args=({args}{' ' + _words(rdzv) if rdzv else ''})",
    ]


def preamble(opts: SlurmOptions, lay: Layout) -> list[str]:
    lines = [
        "set -euo pipefail",
        # Stopped (or warned) before run_point's traps are set (the setup lines can take a
        # while): noted here, and run_point records the stop once the point is known.
        'near_limit="" stop_early=""',
        # What a stop records, written by `point_helper prepare`; gone with the script, and
        # with it the empty step folders of watchers SIGKILLed as a step ended (this node's).
        'prepared="${TMPDIR:-/tmp}/scalelab-point-${SLURM_JOB_ID:-0}.$$.json"',
        'trap \'rm -f "$prepared" "$prepared.part"; rmdir "${TMPDIR:-/tmp}"/scalelab-step-'
        '"${SLURM_JOB_ID:-0}".* 2>/dev/null || true\' EXIT',
        "trap 'stop_early=1' TERM",
        "trap 'near_limit=1' USR1",
        f"cd {shlex.quote(str(opts.workdir))}",
        *opts.setup,
        COMM_ENV,
        f"PY={shlex.quote(opts.python)}",
        f"export OMP_NUM_THREADS={lay.threads}   # torch intra-op threads per rank",
        "export SCALELAB_BATCH_RECORDS=1   # a stopped step: run_point's record, not the tasks'",
    ]
    if lay.launcher == "torchrun":
        # The rendezvous: the job's first node, a port from the job id. sed reads every line
        # (`head -n 1` could SIGPIPE scontrol, which pipefail turns into a failed job).
        lines += [
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
            slurm.RDZV_PORT_SHELL,
        ]
    return [*lines, RUN_POINT]


def point_script(
    study: Study, point: Point, lay: Layout, opts: SlurmOptions, plugin: str, logs: Path, tag=""
):
    """One point's job; tag (`n2`) names its node count where a study has several."""
    name = job_name(study, point.index) + (f"-{tag}" if tag else "")
    return "\n".join(
        [
            *header(name, lay, opts, f"{logs}/%x-%j.out"),
            f"# scalelab study {study.name}, point {point.index}: {point.describe()}",
            *preamble(opts, lay),
            *point_lines(point, lay, opts, plugin, study.results),
            "run_point",
        ]
    )


def array_script(study: Study, lay: Layout, pts: list[Point], opts, plugin, logs) -> str:
    """One job array for points of one layout: each task gets exactly its allocation."""
    lines = [
        *header(job_name(study, None), lay, opts, f"{logs}/%x-%A_%a.out"),
        f"#SBATCH --array={','.join(str(p.index) for p in pts)}",
        f"# scalelab study {study.name}: {len(pts)} points, one array task each",
        *preamble(opts, lay),
        'case "$SLURM_ARRAY_TASK_ID" in',
    ]
    for p in pts:
        body = point_lines(p, lay, opts, plugin, study.results)
        lines += [f"  {p.index})  # {p.describe()}", *(f"    {ln}" for ln in body), "    ;;"]
    lines += ['  *) echo "no point $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac", "run_point"]
    return "\n".join(lines)


def report_script(study: Study, opts: SlurmOptions, logs: Path, out: Path) -> str:
    """The report job: runs after every point job ended, however it ended (afterany)."""
    report = [opts.python, "-m", "scalelab", "report", str(study.results), "-o", str(out)]
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name(study, None)}-report",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        f"#SBATCH --time={opts.time}",
        f"#SBATCH --output={logs}/%x-%j.out",
    ]
    lines += [
        f"#SBATCH --{n}={getattr(opts, n)}"
        for n in ("partition", "account", "qos")
        if getattr(opts, n)
    ]
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(str(opts.workdir))}",
        *opts.setup,
        shlex.join(report),
    ]
    return "\n".join(lines)


def submit_script(jobs: list[Path], report: Path) -> str:
    """Submits every job with the options given to it ("$@": --qos, --reservation, ...), then
    the report job after all of them."""
    lines = ["#!/bin/bash", "set -euo pipefail", "ids=()"]
    for job in jobs:
        q = shlex.quote(str(job.resolve()))
        lines.append(f'ids+=("$(sbatch --parsable "$@" {q} | cut -d";" -f1)")')
    q = shlex.quote(str(report.resolve()))
    lines += [
        'deps=$(IFS=:; echo "${ids[*]}")',
        f'report=$(sbatch --parsable "$@" --dependency="afterany:$deps" {q} | cut -d";" -f1)',
        'echo "submitted ${ids[*]}; report job $report runs after them"',
    ]
    return "\n".join(lines)


def job_name(study: Study, index: int | None) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", study.name)
    return f"scalelab-{safe}" + (f"-{index}" if index is not None else "")


def write_scripts(
    study: Study, opts: SlurmOptions, out_dir: Path, array: bool, node_counts=None
) -> list[Path]:
    """Write the job scripts, report.sbatch and submit_all.sh; returns the job scripts.
    Every point's layout is checked before anything is written. node_counts (--nodes 1,2):
    each point once per node count it spreads over differently (a 1-rank point once); only
    `layout` reads the node count, so the rest of the script takes `opts` as given."""
    counts = sorted(set(node_counts or (opts.nodes,)))
    jobs: list[tuple[Point, Layout]] = []
    for p in points(study):
        for n in counts:
            lay = layout(p, replace(opts, nodes=n))
            if (p, lay) not in jobs:
                jobs.append((p, lay))
    log_dir = out_dir.resolve() / "logs"
    if not SAFE_PATH.match(str(log_dir)):
        raise UsageError(f"{log_dir}: #SBATCH --output cannot take this path; pick a plainer -o")
    needs_mpi = any(lay.launcher == "mpi" for _, lay in jobs)
    plugin = opts.mpi_plugin or (default_mpi_plugin() if needs_mpi else "pmi2")
    if needs_mpi:
        check_plugin(plugin)
    log_dir.mkdir(parents=True, exist_ok=True)
    texts: dict[str, str] = {}
    if array:
        groups: dict[Layout, list[Point]] = defaultdict(list)
        for p, lay in jobs:
            groups[lay].append(p)
        for k, (lay, group) in enumerate(groups.items(), 1):
            texts[f"array_{k:02d}.sbatch"] = array_script(study, lay, group, opts, plugin, log_dir)
    else:
        for p, lay in jobs:
            tag = f"n{lay.nodes}" if len(counts) > 1 else ""
            name = f"point_{p.index:03d}{'_' + tag if tag else ''}.sbatch"
            texts[name] = point_script(study, p, lay, opts, plugin, log_dir, tag)
    scripts = [out_dir / name for name in texts]
    for path, text in zip(scripts, texts.values()):
        path.write_text(text + "\n")
    report = out_dir / "report.sbatch"
    report.write_text(report_script(study, opts, log_dir, out_dir.resolve() / "report") + "\n")
    submit = out_dir / "submit_all.sh"
    submit.write_text(submit_script(scripts, report) + "\n")
    submit.chmod(0o755)
    return scripts
