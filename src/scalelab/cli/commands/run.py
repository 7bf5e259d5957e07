"""`scalelab run WORKLOAD`: one run under one strategy; also the per-rank entry point.

Numeric flags take comma lists (`--lr 0.01,0.1,0.5 --hidden 64,256`): one run per combination,
each its own record, every combination validated before the first starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from scalelab import environment
from scalelab.cli.base import COMMANDS, Command
from scalelab.cli.options import (
    add_config_options,
    add_workload_argument,
    config_from_args,
    expand_lists,
    flag_of,
    workload_name,
)
from scalelab.comm import job_status
from scalelab.comm.launch import (
    inside_launcher,
    refuse_nested_launch,
    settle_config,
    torchrun_command,
)
from scalelab.comm.slurm_env import step_tasks as srun_tasks
from scalelab.config import RunConfig
from scalelab.errors import EXIT_FAILED, UsageError
from scalelab.orchestration import srun_task
from scalelab.orchestration.jobs import JobOutcome, relaunch_job, run_job
from scalelab.outputs import check_run_outputs
from scalelab.record import DEFAULT_RESULTS, append_record, failed_record
from scalelab.run.runner import check_config, check_failure_line, execute, format_summary
from scalelab.strategies import STRATEGIES
from scalelab.train import checkpoint
from scalelab.train.guards import TrainingDiverged


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "Numeric flags take comma lists: --lr 0.01,0.1,0.5 --hidden 64,512 runs every "
        "combination, one record each."
    )
    add_workload_argument(p)
    add_config_options(p, lists=True)
    p.add_argument("--global-batch", help=argparse.SUPPRESS)  # gone: refused with a pointer
    p.add_argument(
        "--out",
        default=str(DEFAULT_RESULTS),
        help=f"results file the record is appended to (default: {DEFAULT_RESULTS})",
    )
    p.add_argument("--no-record", action="store_true", help="write no record")
    p.add_argument(
        "--json",
        action="store_true",
        help="stdout is exactly one JSON document: the record (a list of them for comma-list "
        "runs); the human summary goes to stderr",
    )
    rdzv = p.add_argument_group("torchrun (ddp) across nodes; run the same command on each node")
    rdzv.add_argument("--nnodes", type=int, default=1, help="nodes (--ranks counts all ranks)")
    rdzv.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (needed for --nnodes)")
    rdzv.add_argument("--rdzv-id", default="scalelab", help="rendezvous id shared by the nodes")
    rdzv.add_argument("--rdzv-backend", default="c10d", help="torchrun rendezvous backend")


def run(args: argparse.Namespace) -> int:
    if args.global_batch is not None:
        raise UsageError(
            "--global-batch is gone: --batch is the global batch for every strategy "
            "(ddp splits it over the ranks); pass --batch instead"
        )
    combos = expand_lists(args)
    if len(combos) == 1:
        code, record = run_one(args)
        if record is not None and not job_status.hand_over_record(record) and args.json:
            print(json.dumps(record))  # a rank of a launched job hands it over instead
        return code
    runs = [single_run(args, combo) for combo in combos]
    for one in runs:  # bad values fail before anything runs
        check_config(config_from_args(one, workload=workload_name(one)))
    rows = []
    root = job_status.this_rank() == 0  # under a launcher the user started: task 0 speaks
    for i, (one, combo) in enumerate(zip(runs, combos), 1):
        label = " ".join(f"{flag_of(k)} {v}" for k, v in combo.items())
        if root:
            print(f"[{i}/{len(runs)}] {label}", file=_human(args), flush=True)
        code, record = run_one(one)
        rows.append((label, code, record))
    if root:
        print(comparison_table(rows), file=_human(args), flush=True)
    if args.json and root:
        print(json.dumps([r for _, _, r in rows if r is not None]))
    return max(code for _, code, _ in rows)


def _human(args: argparse.Namespace):
    """Where the human summary goes: stderr under --json, so stdout is one JSON document."""
    return sys.stderr if getattr(args, "json", False) else sys.stdout


def comparison_table(rows: list[tuple[str, int, dict[str, Any] | None]]) -> str:
    """One line per run of a comma-list command, labelled by the values that differ."""
    width = max(len(label) for label, _, _ in rows)
    lines = [f"{'run':<{width}}  status        wall s   throughput   result"]
    for label, code, rec in rows:
        if rec is None:
            lines.append(f"{label:<{width}}  exit {code}")
            continue
        status = "check failed" if rec.get("check_passed") is False else rec.get("status", "?")
        result = ""
        if rec.get("accuracy"):
            result = f"loss {rec['loss'][-1]:.4f} acc {rec['accuracy'][-1]:.4f}"
        elif rec.get("heldout_loss"):  # a language model: its held-out loss
            result = f"loss {rec['loss'][-1]:.4f} held-out {rec['heldout_loss'][-1]:.4f}"
        elif "relerr" in rec:
            result = f"relerr {rec['relerr']:.2e}"
        lines.append(
            f"{label:<{width}}  {status:<12} {rec.get('wall_s', float('nan')):8.3f} "
            f"{rec.get('throughput', float('nan')):12.1f}   {result}"
        )
    return "\n".join(lines)


def single_run(args: argparse.Namespace, combo: dict[str, Any]) -> argparse.Namespace:
    """The parsed flags and command line of one combination of a study."""
    one = argparse.Namespace(**vars(args))
    argv = list(args.argv)
    for name, value in combo.items():
        setattr(one, name, value)
        argv = substitute(argv, flag_of(name), value)
    one.argv = argv
    return one


def substitute(argv: list[str], flag: str, value: Any) -> list[str]:
    """argv with the (last) value of flag replaced: `--lr 0.1,0.5` -> `--lr 0.5`."""
    out = list(argv)
    for i in reversed(range(len(out))):
        if out[i] == flag and i + 1 < len(out):
            out[i + 1] = str(value)
            return out
        if out[i].startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    raise UsageError(f"spell out {flag} in full to give it a list of values")


def run_one(args: argparse.Namespace) -> tuple[int, dict[str, Any] | None]:
    """(exit code, the record this process printed or None: launched jobs print their own)."""
    cfg = config_from_args(args, workload=workload_name(args), **_defaults(args))
    strategy = STRATEGIES.get(cfg.strategy)
    node_agent = srun_task.is_node_agent(strategy.launcher_for(cfg), args.nnodes)
    cfg = settle_config(cfg, None if node_agent else strategy.launcher)
    preflight(strategy, cfg)
    check_run_outputs(cfg, None if args.no_record else Path(args.out))
    if cfg.compare_devices:
        return _compare_devices(cfg, args)
    launcher = strategy.launcher_for(cfg)
    results = None if args.no_record else Path(args.out)
    if launcher is None and srun_tasks() is not None and srun_tasks() > 1:
        raise UsageError(
            f"strategy {cfg.strategy} runs in one process, but srun started {srun_tasks()} "
            "tasks (each would run it and append its own record): use srun -n 1"
        )
    if node_agent:  # srun's task on one node: this node's torchrun, watched
        return srun_task.agent(lambda: launch(launcher, cfg, args, say=False), cfg, results)
    if srun_task.should_watch(launcher):  # srun's task: run the rank as a watched child
        return srun_task.watch(args.argv, cfg, results)
    if launcher is not None and cfg.ranks > 1 and not inside_launcher(launcher):
        refuse_nested_launch(launcher, cfg.ranks)
        if srun_tasks() == 1:  # srun's one task starts the ranks: a stop is recorded, 143
            return srun_task.agent(lambda: launch(launcher, cfg, args, say=False), cfg, results)
        before = _lines(results)
        outcome = launch(launcher, cfg, args)  # the root rank hands its record over
        code = outcome.code
        if code not in (0, 2) and results is not None and _lines(results) == before:
            _record_lost_job(cfg, results, outcome.message or f"{launcher} failed")
        return code, outcome.record or _last_new_record(results, before)
    try:
        report = execute(cfg, None if args.no_record else Path(args.out))
    except TrainingDiverged as exc:
        sys.stderr.write(f"scalelab run: error: {exc}\n")
        return exc.exit_code, None
    if report.record is None:  # not the root rank
        return report.exit_code, None
    print(format_summary(report.record), file=_human(args))
    if not args.no_record:
        print(f"  record appended to {args.out}", file=_human(args))
    sys.stdout.flush()
    _say_check_failed(report.record)
    return report.exit_code, report.record


def _say_check_failed(record: dict[str, Any]) -> None:
    """The contract's one line for a failed check (exit 1); a rank of a launched job hands
    it to the launching process, which prints it instead of naming a dead rank."""
    what = check_failure_line(record)
    if what is None:
        return
    line = f"scalelab run{job_status.CHECK_FAILED}{what}"
    if not job_status.report(line, EXIT_FAILED):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _last_new_record(results: Path | None, before: int) -> dict[str, Any] | None:
    """The record a launched job appended (None: it wrote none, or records are off)."""
    if results is None or not results.exists():
        return None
    lines = results.read_bytes().splitlines()[before:]
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def _lines(path: Path | None) -> int:
    return len(path.read_bytes().splitlines()) if path is not None and path.exists() else 0


def _record_lost_job(cfg: RunConfig, results: Path, error: str) -> None:
    """A launched job failed and no rank wrote a record (a rank died or was killed, taking
    the root with it): the launching process records the failure, in the line it printed."""
    append_record(results, failed_record(cfg, error.removeprefix("scalelab: ")))


def _defaults(args: argparse.Namespace) -> dict[str, Any]:
    """Checkpoints go next to the results file unless --ckpt-dir says where."""
    if getattr(args, "ckpt_every", None) is not None and getattr(args, "ckpt_dir", None) is None:
        return {"ckpt_dir": str(Path(args.out).parent / "checkpoints")}
    return {}


def preflight(strategy: type, cfg: RunConfig) -> None:
    """Checks a strategy can make without ranks (so a launcher never starts for bad input)."""
    check_config(cfg)
    if strategy.launcher_for(cfg) == "mpi":  # mpi4py and a library it loads, or one line
        problem = environment.mpi_problem()
        if problem is not None:
            raise UsageError(problem)
    check = getattr(strategy, "preflight", None)
    global_batch = check(cfg) if check is not None else cfg.batch
    if cfg.resume is not None:
        checkpoint.preflight(cfg, cfg.ranks, global_batch)


def launch(launcher: str, cfg: RunConfig, args: argparse.Namespace, say: bool = True) -> JobOutcome:
    if launcher != "torchrun" or (args.nnodes == 1 and args.rdzv_endpoint is None):
        return relaunch_job(launcher, cfg.ranks, args.argv, say=say)
    if args.rdzv_endpoint is None or cfg.ranks % args.nnodes:
        raise UsageError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT and --ranks (all ranks, "
            f"now {cfg.ranks}) divisible by --nnodes"
        )
    cmd = torchrun_command(cfg.ranks // args.nnodes)
    cmd = [c for c in cmd if c != "--standalone"] + [
        f"--nnodes={args.nnodes}",
        f"--rdzv-backend={args.rdzv_backend}",
        f"--rdzv-endpoint={args.rdzv_endpoint}",
        f"--rdzv-id={args.rdzv_id}",
    ]
    env = {**os.environ, "SCALELAB_LAUNCHED": "1"}
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (shared hosts)
    return run_job([*cmd, "-m", "scalelab", *args.argv], env, launcher, say=say)


def _compare_devices(cfg: RunConfig, args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    from scalelab.orchestration.compare_devices import compare_devices

    report = compare_devices(cfg)
    print(report.table(), file=_human(args))
    if not args.no_record:
        append_record(args.out, report.record)
        print(f"  record appended to {args.out}", file=_human(args))
    return 0, report.record


COMMANDS.register("run", "run one workload under one strategy and append a record")(
    Command(add_arguments, run)
)
