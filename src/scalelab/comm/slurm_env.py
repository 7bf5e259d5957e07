"""What Slurm tells a process about where it runs: job, step, task, node, CPUs.

Slurm's batch script (the "batch step") sees SLURM_JOB_ID and SLURM_PROCID=0 but no
SLURM_STEP_ID: it is one process, not a launcher. A task started by `srun` sees SLURM_STEP_ID,
its rank SLURM_PROCID among SLURM_STEP_NUM_TASKS (SLURM_NTASKS), SLURM_LOCALID on its node and
the step's nodes in SLURM_STEP_NODELIST (a compressed host list such as `n[1-2]`).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping

# Set (to the count) where scalelab took the thread count from the CPUs Slurm gave the task,
# not from --threads: the record then says so.
THREADS_VAR = "SCALELAB_THREADS_FROM_SLURM"
# Per-job rendezvous ports, BASE + job id % SPAN: 20000-31999, below Linux's default range
# for outgoing connections' local ports (ip_local_port_range, 32768-60999). A port in that
# range may be held by any client socket on the head node; both nodes' torchrun agents then
# found it taken, each took itself for a client and waited 60 s for a store nobody served.
RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 12000
# The same port, computed by a batch script in the shell (its torchrun's --rdzv-endpoint).
RDZV_PORT_SHELL = f"port=$(({RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN}))"


def in_job(env: Mapping[str, str] | None = None) -> bool:
    return "SLURM_JOB_ID" in (os.environ if env is None else env)


def step_tasks(env: Mapping[str, str] | None = None) -> int | None:
    """Tasks of the srun step this process is one of; None outside an srun step (no job, or
    the batch script itself)."""
    env = os.environ if env is None else env
    if env.get("SLURM_STEP_ID") in (None, "", "batch", "4294967294"):
        return None
    return int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)


def srun_launched(env: Mapping[str, str] | None = None) -> bool:
    """True when srun started this process as one of several tasks: srun is the launcher."""
    return (step_tasks(env) or 1) > 1


def rendezvous_port(job_id: str | int) -> int:
    """A port derived from the job id, so two jobs sharing a node do not collide."""
    return RDZV_PORT_BASE + int(job_id) % RDZV_PORT_SPAN


def expand_hostlist(spec: str) -> list[str]:
    """`n[1-3,7],gpu01` -> ['n1', 'n2', 'n3', 'n7', 'gpu01'] (Slurm's compressed host lists,
    one bracket group per name; zero padding kept)."""
    hosts: list[str] = []
    for name in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", spec):
        m = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", name)
        if m is None:
            hosts.append(name)
            continue
        head, ranges, tail = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{head}{i:0{len(lo)}d}{tail}")
    return hosts


def first_node(env: Mapping[str, str] | None = None) -> str:
    """The first node of this step (of the job outside a step)."""
    env = os.environ if env is None else env
    spec = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
    try:  # scontrol knows every host-list syntax; the parser above is the fallback
        out = subprocess.run(
            ["scontrol", "show", "hostnames", spec], capture_output=True, text=True, timeout=20
        )
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return expand_hostlist(spec)[0]


def torch_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """torch.distributed's env:// variables for an srun task: rank, world and local rank from
    Slurm, the rendezvous on the step's first node at a port derived from the job id."""
    env = os.environ if env is None else env
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(step_tasks(env) or 1),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": first_node(env),
        "MASTER_PORT": str(rendezvous_port(env["SLURM_JOB_ID"])),
    }


def tasks_on_this_node(env: Mapping[str, str] | None = None) -> int:
    """Tasks of this step on this node, from SLURM_STEP_TASKS_PER_NODE (`2(x3),1`)."""
    env = os.environ if env is None else env
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return 1
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else counts[-1]


def cpus_per_task(env: Mapping[str, str] | None = None) -> int | None:
    """The CPUs Slurm gave this task: --cpus-per-task when the job asked for it, else this
    node's CPUs shared by the step's tasks on it; None outside a job."""
    env = os.environ if env is None else env
    if not in_job(env):
        return None
    if env.get("SLURM_CPUS_PER_TASK"):
        return max(1, int(env["SLURM_CPUS_PER_TASK"]))
    on_node = env.get("SLURM_CPUS_ON_NODE")
    if not on_node:
        return None
    local = tasks_on_this_node(env) if step_tasks(env) is not None else 1
    return max(1, int(on_node) // max(1, local))


def job_fields(env: Mapping[str, str] | None = None) -> dict[str, object] | None:
    """The job a record was made in (None outside Slurm): id, array task, nodes, partition."""
    env = os.environ if env is None else env
    if not in_job(env):
        return None
    array = env.get("SLURM_ARRAY_TASK_ID")
    return {
        "job_id": env["SLURM_JOB_ID"],
        "array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
        "array_task_id": int(array) if array and array.isdigit() else None,
        "step_id": env.get("SLURM_STEP_ID"),
        "node_list": env.get("SLURM_JOB_NODELIST"),
        "partition": env.get("SLURM_JOB_PARTITION"),
        "nodes": int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1),
        "tasks": step_tasks(env) or int(env.get("SLURM_NTASKS") or 1),
        "cpus_per_task": cpus_per_task(env),
        "restart": int(env.get("SLURM_RESTART_COUNT") or 0),  # a requeued job's attempt
    }


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job -o JOB` as fields (empty when scontrol cannot say; no id: not every
    job's fields, as `scontrol show job ""` would print)."""
    if not job_id.strip():
        return {}
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out))


def stop_cause(
    info: Mapping[str, str], near_limit: bool = False, env: Mapping[str, str] | None = None
) -> str:
    """Why Slurm is stopping this job, read in its SIGTERM (the job is COMPLETING by then):
    requeued (Restarts past this attempt's), its time limit (Reason=TimeLimit), else a
    cancel (scancel: Reason=None; preemption or a node's failure name their own reason).
    Without scontrol's word: the early time warning (USR1) came, or it cannot be told."""
    env = os.environ if env is None else env
    if not info:
        return "its time limit" if near_limit else "time limit or scancel"
    if int(info.get("Restarts") or 0) > int(env.get("SLURM_RESTART_COUNT") or 0):
        return "requeued: it runs again"
    reason = info.get("Reason", "None")
    if reason == "TimeLimit":
        return "its time limit"
    return "scancel" if reason == "None" else f"cancelled: {reason}"
