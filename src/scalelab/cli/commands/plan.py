"""`scalelab plan WORKLOAD --ranks-max N` (or `--model MODULE:FACTORY --input-shape ...`,
your own network): every way scalelab could run the workload on this
hardware, predicted by the calibrated model and ranked; `--calibrate-missing` measures what
the ranking lacks first, `--verify K` measures the top K and the plain choice and reports
the regret. The method: scalelab.plan (docs/PLAN.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from scalelab.cli.base import COMMANDS, Command
from scalelab.cli.options import (
    add_config_options,
    add_workload_argument,
    config_from_args,
    workload_name,
)
from scalelab.errors import UsageError

DEFAULT_OUT = Path("scalelab-results") / "plan"
# Flags the planner chooses itself (the rest of `scalelab run`'s flags fix the workload).
CHOSEN = {"ranks", "strategy", "split", "threads", "global_batch", "dtype", "amp", "stages",
          "microbatches", "schedule", "nonblocking", "bucket_mb", "grad_compress", "engine",
          "virtual_stages", "dp", "tp"}  # fmt: skip
SHOWN = ["rank", "candidate", "ms", "throughput", "tokens_per_s", "efficiency", "mem_MiB",
         "bottleneck", "basis"]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_argument(p)  # or --model MODULE:FACTORY [--model-arg K=V] --input-shape
    p.add_argument("--ranks-max", type=int, required=True, help="most ranks a candidate may use")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="ranks per node (default: 8 GPUs; CPU: the ceilings machine's cores)",
    )
    p.add_argument("--nodes", type=int, default=1, help="nodes available (default 1)")
    p.add_argument("--network", default=None, help="inter-node network profile or JSON file")
    p.add_argument("--ceilings", default=None, help="ceilings.json from `scalelab ceilings`")
    p.add_argument(
        "--calibrate",
        default=None,
        metavar="RESULTS",
        help="results file or folder with measurements to calibrate on",
    )
    p.add_argument(
        "--memory-per-device",
        default=None,
        metavar="BYTES",
        help="bytes a rank may hold, e.g. 16GiB (default: no memory filter)",
    )
    batch = p.add_mutually_exclusive_group()
    batch.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="items per iteration/step over all ranks (default: --batch)",
    )
    batch.add_argument("--per-rank-batch", type=int, default=None, help="items per rank")
    p.add_argument(
        "--precisions",
        default=None,
        help="precisions a candidate may use, comma list (default: --dtype, fp32)",
    )
    p.add_argument(
        "--strategies",
        default=None,
        help="candidate sources to use, comma list (default: all that apply)",
    )
    p.add_argument(
        "--calibrate-missing",
        action="store_true",
        help="first run the one-rank measurements the ranking lacks",
    )
    p.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="K",
        help="measure the top K and the plain configuration; report the regret",
    )
    p.add_argument("--repeats", type=int, default=3, help="--verify: runs per candidate")
    p.add_argument("--timeout", type=float, default=600, help="seconds per measured run")
    p.add_argument(
        "-o",
        "--out",
        default=str(DEFAULT_OUT),
        help=f"folder for plan.csv/.json, measurements (default {DEFAULT_OUT})",
    )
    add_config_options(p, skip=CHOSEN)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from scalelab.analysis import require

    require("pandas", "scalelab plan")
    from scalelab.plan import candidates, rank
    from scalelab.predict.figures import figures_at
    from scalelab.predict.models import Context
    from scalelab.predict.network import load_network

    network = load_network(args.network)
    if args.calibrate_missing and args.ceilings is None:
        _measure_ceilings(args)
    figures = figures_at(args.ceilings)
    spec = _spec(args, figures)
    out = Path(args.out)
    cfgs = candidates.candidates(spec)
    if not cfgs:
        raise UsageError(f"no candidate applies to {spec.base.workload} with these options")
    pool = _pool(args.calibrate, out)
    if args.calibrate_missing:
        pool = _calibrate(spec, pool, cfgs, args, out)
    figures = _contention(figures, spec, args, out)
    ctx = Context(figures, network, pool)
    ranked = rank.rank(ctx, spec, cfgs)
    if args.calibrate_missing and _measure_comm(ranked, figures.path):
        # the ceilings file now holds the fits; the curve measured above is still this host's
        figures = _contention(figures_at(figures.path), spec, args, out, measure=False)
        ranked = rank.rank(Context(figures, network, pool), spec, cfgs)
    _print_plan(spec, ranked, figures.path)
    out.mkdir(parents=True, exist_ok=True)
    rank.shown(ranked).to_csv(out / "plan.csv", index=False)
    summary = {
        "schema": "scalelab.plan/1",
        "spec": _spec_dict(spec),
        "ceilings": figures.path,
        "rows": _records(ranked),
    }
    if args.verify > 0:
        summary["verify"] = _verify(spec, ranked, ctx, args, out)
    (out / "plan.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"wrote {out}/: plan.csv, plan.json" + (", verify.csv" if args.verify else ""))
    return 0 if (ranked["status"] == rank.OK).any() else 1


def _spec(args: argparse.Namespace, figures):
    from scalelab.environment import usable_cpus
    from scalelab.plan.space import PlanSpec

    base = config_from_args(args, workload=workload_name(args))
    cores = int((figures.data.get("machine") or {}).get("cpu_cores") or usable_cpus())
    # the ceilings may describe a larger machine, but --calibrate-missing and --verify run the
    # candidates on this one: one of more cores than it has would time its oversubscription
    here = usable_cpus()
    capped = (args.calibrate_missing or args.verify > 0) and cores > here
    described, cores = cores, here if capped else cores
    per_node = args.gpus_per_node or (8 if base.device == "cuda" else cores)
    if args.ranks_max > per_node * args.nodes:
        raise UsageError(
            f"--ranks-max {args.ranks_max} > {args.nodes} node(s) x {per_node} ranks per node"
        )
    if args.verify < 0 or args.repeats < 1:
        raise UsageError("--verify must be >= 0 and --repeats >= 1")
    if capped:  # after the refusals: a refused plan says one line
        logging.getLogger("scalelab.plan").warning(
            f"the ceilings describe {described} CPU cores, this host has {here}: candidates "
            f"use at most {here} (--calibrate-missing and --verify run here)"
        )
    given = args.global_batch is None and args.per_rank_batch is None
    precisions = tuple((args.precisions or base.dtype).split(","))
    return PlanSpec(
        base=base, ranks_max=args.ranks_max, per_node=per_node, cores=cores,
        global_batch=base.batch if given else args.global_batch,
        per_rank_batch=args.per_rank_batch, precisions=precisions,
        memory_per_device=_bytes(args.memory_per_device),
        strategies=tuple(args.strategies.split(",")) if args.strategies else None,
    )  # fmt: skip


def _bytes(text: str | None) -> float | None:
    from scalelab.cli.commands.fit import parse_size

    try:
        return parse_size(text)
    except UsageError:
        raise UsageError(f"--memory-per-device {text!r}: expected a size like 16GiB") from None


def _pool(calibrate: str | None, out: Path):
    from scalelab.cli.commands.predict import _calibration_pool

    pool = _calibration_pool(calibrate)
    own = out / "calibration.jsonl"
    if own.exists():
        pool.extend(_calibration_pool(str(own)))
    return pool


def _calibrate(spec, pool, cfgs, args, out: Path):
    from scalelab.plan.calibrate import measure, measure_medians, missing

    todo = missing(spec, pool, cfgs, spec.per_node)
    print(f"calibrate: {len(todo)} measurement(s) missing, {args.repeats} runs each", flush=True)
    if todo:
        scratch = out / "calibration_runs.jsonl"  # every run; the medians go on

        def run(cfg):
            return measure(cfg, scratch, args.timeout)

        echo = Progress("calibrate", len(todo) * args.repeats)
        measure_medians(todo, out / "calibration.jsonl", args.repeats, run, echo)
    return _pool(args.calibrate, out)


def _measure_ceilings(args: argparse.Namespace) -> None:
    """--calibrate-missing on a fresh machine (no --ceilings, no scalelab-results/ceilings.json):
    measure this machine's ceilings first, as `scalelab ceilings --quick` does, so the plan
    needs no command run before it (the communication fits it lacks come after the ranking)."""
    from scalelab.instrument.ceilings import DEFAULT_PATH

    if DEFAULT_PATH.is_file():
        return
    device = "cuda" if getattr(args, "device", None) == "cuda" else "cpu"
    command = ["scalelab", "ceilings", "--quick", "--device", device, "-o", str(DEFAULT_PATH)]
    _calibration_command(command, "no ceilings here yet: ", "this machine's ceilings")
    if not DEFAULT_PATH.is_file():
        raise UsageError(f"measuring this machine's ceilings failed: {' '.join(command)}")


def _measure_comm(ranked, ceilings: str) -> bool:
    """--calibrate-missing: measure the communication fits whose absence left candidates
    out, into the ceilings file (so no candidate family is dropped on a fresh machine)."""
    from scalelab.plan.calibrate import comm_command, lacking_comm

    backends = lacking_comm(list(ranked["status"]))
    for backend in backends:
        _calibration_command(comm_command(backend, ceilings), "", f"comm.{backend}")
    return bool(backends)


def _calibration_command(command: list[str], why: str, what: str) -> None:
    """Run a `scalelab ...` measuring command in this Python, said first on stdout; a failure
    is one line naming the command to paste."""
    import subprocess

    print(f"calibrate: {why}{' '.join(command)}", flush=True)
    done = subprocess.run([sys.executable, "-m", "scalelab", *command[1:]], check=False)
    if done.returncode != 0:
        raise UsageError(f"measuring {what} failed: {' '.join(command)}")


def _contention(figures, spec, args, out: Path, measure: bool = True):
    """CPU ranks: the host's cpu_concurrency curve measured by this plan (now, with
    --calibrate-missing and `measure`; else the one this plan or an earlier one wrote in the
    same folder), else the ceilings'."""
    from scalelab.plan.calibrate import with_contention

    path = out / "concurrency.json"
    if spec.gpu or spec.ranks_max < 2:
        return figures
    if args.calibrate_missing and measure:
        return _host_contention(figures, spec, path, args.repeats, echo=True)
    return with_contention(figures, path) if path.exists() else figures


def _host_contention(figures, spec, path: Path, repeats: int, echo: bool = False):
    """The contention curves measured now with the plan's own step, for its thread counts."""
    from scalelab.plan.calibrate import contention_kernel, contention_threads, host_contention

    kernel, threads = contention_kernel(spec), contention_threads(spec)
    if echo:
        print(f"calibrate: this host's cpu_concurrency, now ({repeats} curves of "
              f"{kernel.describe()}; threads per process {threads})", flush=True)  # fmt: skip
    return host_contention(figures, spec.cores, path, repeats, kernel, threads)


def _print_plan(spec, ranked, ceilings: str) -> None:
    from scalelab.plan.rank import OK

    base = spec.base
    batch = f"global batch {spec.global_batch}" if spec.global_batch else (
        f"{spec.per_rank_batch} per rank")  # fmt: skip
    print(
        f"plan: {base.workload} {'training' if base.train else 'inference'} on {base.device}, "
        f"{batch}, up to {spec.ranks_max} ranks ({spec.per_node} per node, {spec.cores} cores); "
        f"ceilings {ceilings}"
    )
    ok = ranked[ranked["status"] == OK]
    cols = [c for c in SHOWN if c in ranked]
    print(ok[cols].to_string(index=False, float_format="{:.4g}".format, max_colwidth=90))
    out = ranked[ranked["status"] != OK]
    for _, row in out.iterrows():
        print(f"  left out: {row['candidate']}: {row['status']}")
    bounds = int(ok["basis"].str.startswith("bound").sum())
    if bounds:
        print(f"  {bounds} candidate(s) rest on an uncalibrated roofline bound: "
              "--calibrate-missing measures what they need")  # fmt: skip


class Progress:
    """One stderr line per measured run: the phase, run i of n, seconds since the phase began,
    and the run's own line (round, candidate, throughput); stdout keeps the tables."""

    def __init__(self, phase: str, total: int) -> None:
        self.phase, self.total, self.done = phase, total, 0
        self.start = time.perf_counter()

    def __call__(self, line: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        head = f"plan: {self.phase} {self.done}/{self.total}, {elapsed:.0f} s:"
        print(f"{head} {line.strip()}", file=sys.stderr, flush=True)


def _verify(spec, ranked, ctx, args, out: Path) -> dict:
    from scalelab.plan.calibrate import missing
    from scalelab.plan.candidates import plain
    from scalelab.plan.verify import measured, picks, runner, verify
    from scalelab.predict.calibration import Pool

    chosen = picks(ranked, args.verify, plain(spec))
    # the calibration runs these candidates' predictions lean on, measured again alongside
    anchors = missing(spec, Pool(), list(chosen["cfg"]), spec.per_node)
    runs = len(measured(list(chosen["cfg"]), anchors))
    print(f"verify: {len(chosen)} candidate(s) and {runs - len(chosen)} calibration run(s) "
          f"x {args.repeats} runs, interleaved", flush=True)  # fmt: skip
    run = runner(out / "verify.jsonl", args.timeout)
    v = verify(chosen, args.repeats, run, Progress("verify", runs * args.repeats), anchors)
    _predict_alongside(v, list(chosen["cfg"]), spec, ctx, args, out)
    print(v.table.to_string(index=False, float_format="{:.4g}".format))
    for failure in v.failures:
        print(f"  failed: {failure}")
    print(v.summary())
    v.table.to_csv(out / "verify.csv", index=False)
    rows = json.loads(v.table.to_json(orient="records"))
    return {"chosen": v.chosen, "best": v.best, "regret": v.regret, "rows": rows}


def _predict_alongside(v, cfgs, spec, ctx, args, out: Path) -> None:
    """Each verified candidate predicted once more, from the calibration runs measured in the
    verification's own rounds (and, for CPU ranks, the host's contention curve measured right
    after them): the `predicted_alongside` and `alongside_error_pct` columns (verify.py)."""
    import dataclasses
    import math

    from scalelab.cli.commands.predict import _calibration_pool
    from scalelab.plan.rank import predict
    from scalelab.record import append_record

    path = out / "verify_calibration.jsonl"
    path.unlink(missing_ok=True)
    for rec in filter(None, v.anchors):
        append_record(path, rec)
    if not path.exists():  # every calibration run failed (listed among the failures)
        return
    figures = ctx.figures
    if not spec.gpu and spec.ranks_max > 1:
        figures = _host_contention(figures, spec, out / "concurrency_verify.json", args.repeats)
    now = dataclasses.replace(ctx, figures=figures, pool=_calibration_pool(str(path)))
    again = [predict(now, spec, cfg)[0] for cfg in cfgs]  # the table's rows, in order
    v.alongside([p.throughput if p else math.nan for p in again])


def _spec_dict(spec) -> dict:
    keys = ("ranks_max", "per_node", "cores", "global_batch", "per_rank_batch", "precisions")
    d = {k: getattr(spec, k) for k in (*keys, "memory_per_device")}
    return {**d, "base": spec.base.to_dict()}


def _records(ranked) -> list[dict]:
    from scalelab.plan.rank import shown

    return json.loads(shown(ranked).to_json(orient="records"))


COMMANDS.register(
    "plan", "choose the fastest configuration with the calibrated model; --verify measures it"
)(Command(add_arguments, run))
