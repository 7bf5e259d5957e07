"""`scalelab fit WORKLOAD`: how large a model or batch fits on one device, and how many
pipeline stages a stack that does not fit needs (the model-parallel seed's Task 1).

  --find stack   deepstack: the largest (convs, fcs) whose training step runs (default there)
  --find batch   any workload: the largest batch (default elsewhere)
  --find stages  the given --convs/--fcs stack: try one device; if it runs out of memory,
                 measure every layer, propose the fewest stages whose split fits, and with
                 --run train it under `pipeline` on that many ranks

On CUDA the tries run for real (--mem-limit caps the allocator, to play a smaller GPU); on CPU
--mem-limit is required and charged against each try's estimated bytes (scalelab.orchestration.fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import os
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from scalelab import environment
from scalelab.cli.base import COMMANDS, Command
from scalelab.cli.options import (
    RUN_ONLY,
    SKIP,
    add_config_options,
    add_workload_argument,
    workload_config,
    workload_name,
)
from scalelab.comm.base import even_counts
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.layout import partition as part
from scalelab.layout import profiling
from scalelab.orchestration.fit import (
    FAKE_ALLOCATOR,
    DeviceTrial,
    EstimatedLimit,
    FitPoint,
    Search,
)
from scalelab.orchestration.jobs import relaunch
from scalelab.precision import get_precision
from scalelab.record import append_record, new_record
from scalelab.strategies.torch_base import resolve_device
from scalelab.workloads import WORKLOADS

log = logging.getLogger("scalelab.fit")

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str | None) -> float | None:
    """'10.91GiB', '512MB', '2e9' -> bytes."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in UNITS:
        raise UsageError(f"--mem-limit {text!r}: expected a size like 10.91GiB, 512MB or 2e9")
    return float(m.group(1)) * UNITS[m.group(2).lower()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_argument(p)
    # What a try reads: the model's shape and one training step (run-only fields hidden,
    # iters/warmup kept: a try times warm-up + iters steps).
    # (--run trains the proposal under `pipeline`: the other strategies' options are unread.)
    unread = {"strategy", "ranks", "split", "overlap", "chunks", "nonblocking", "global_batch",
              "amp", "bucket_mb", "grad_compress", "tp"}  # fmt: skip
    add_config_options(p, skip=(RUN_ONLY - {"iters", "warmup", "steps"}) | unread)
    p.add_argument("--find", choices=("stack", "batch", "stages", "ranks"), default=None)
    p.add_argument(
        "--mem-limit",
        "--memory-per-device",
        dest="mem_limit",
        default=None,
        help="bytes per device, e.g. 10.91GiB (default: the GPU's memory; on CPU the memory "
        "available now)",
    )
    p.add_argument("--most", type=int, default=None, help="largest size to try")
    p.add_argument("--max-stages", type=int, default=8, help="--find stages: most stages")
    p.add_argument("--run", action="store_true", help="--find stages: train the proposal")
    p.add_argument("--out", default=None, help="append a fit record to this results file")


def available_memory() -> int:
    """Bytes of memory available to a new allocation now (Linux MemAvailable; else free pages)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def run(args: argparse.Namespace) -> int:
    cfg = workload_config(args, workload=workload_name(args), train=True)
    workload = WORKLOADS.get(cfg.workload)(cfg)
    find = args.find or ("stack" if workload.name == "deepstack" else "batch")
    if find == "ranks":
        return _find_ranks(cfg, args)
    if find != "batch" and workload.name != "deepstack":
        raise UsageError(f"--find {find} sizes deepstack's layers; use --find batch")
    device = resolve_device(cfg.device)
    limit = parse_size(args.mem_limit)
    if device.type == "cpu" and limit is None:
        # A CPU has no allocator to run out of: each try's estimated bytes are charged
        # against the memory this machine has available now.
        limit = available_memory()
        log.info(
            f"fit: no --mem-limit: charging estimates against this machine's available memory "
            f"({limit / 2**30:.2f} GiB), without running the tries (no step times)"
        )
    trial = DeviceTrial(device, limit)
    if device.type == "cpu":  # from the machine: a try at many GiB would run for hours
        trial = EstimatedLimit(limit, trial if args.mem_limit is not None else None)
    search = Search(trial, cfg, report=_progress(cfg.quiet))
    answer = FINDERS[find](search, cfg, args, device, limit)
    print(format_table(search.points, find))
    print(answer["line"])
    if args.out:
        _record(args.out, cfg, find, limit, search.points, answer)
    return answer.get("exit_code", 0)


def _progress(quiet: bool):
    def report(point: FitPoint) -> None:
        if not quiet:
            verdict = fit_verdict(point)
            sys.stderr.write(
                f"fit: convs {point.convs} fcs {point.fcs} batch {point.batch}: {verdict}\n"
            )
            sys.stderr.flush()

    return report


def fit_verdict(point: FitPoint) -> str:
    """`fits, 3.2 ms`; a try that was estimated, not run, has no time to print (not `nan ms`)
    and says it was estimated, whichever way it went (the fake allocator refused it)."""
    if not point.fits:
        estimated = (point.error or "").startswith(FAKE_ALLOCATOR)
        return "over the limit (estimated, not run)" if estimated else "out of memory"
    return f"fits, {point.seconds * 1e3:.1f} ms" if _ran(point) else "fits (estimated, not run)"


def _ran(point: FitPoint) -> bool:
    return point.seconds is not None and math.isfinite(point.seconds)


def _largest(points: list[FitPoint], what: str, value: int, **key: int) -> str:
    """'largest batch that runs: 8', or '... estimated to fit: 8 (estimated, not run)' where
    that try was only charged against the limit."""
    point = next((p for p in points if p.fits and all(getattr(p, k) == v for k, v in key.items())),
                 None)  # fmt: skip
    if point is not None and _ran(point):
        return f"largest {what}: {value}"
    return f"largest {what.split(' that ')[0]} estimated to fit: {value} (estimated, not run)"


# --- the three searches -------------------------------------------------------------------


def _find_ranks(cfg: RunConfig, args: argparse.Namespace) -> int:
    """--find ranks: per strategy (ddp, fsdp, hsdp, pipeline, tensor) the fewest ranks whose
    estimated bytes per rank fit --memory-per-device (plan/memory.py's model; estimated, not
    run: nothing is allocated)."""
    from scalelab.plan import memory

    limit = parse_size(args.mem_limit)
    if limit is None:
        raise UsageError("--find ranks needs --memory-per-device (bytes per device, e.g. 80GB)")
    print(f"estimated, not run: bytes per rank for {cfg.workload} at global batch {cfg.batch}")
    heads = ("params", "grads", "buckets", "optim", "gathered", "acts", "peak")
    print(f"{'strategy':<9} {'ranks':>5} " + " ".join(f"{h:>10}" for h in heads))
    for name in memory.STRATEGIES:
        n = memory.smallest_ranks(cfg, name, limit, args.most or 4096)
        if n is None:
            print(f"{name:<9} {'-':>5}  does not fit at any rank count tried")
            continue
        here = memory.as_strategy(cfg, name, n)
        parts = memory.breakdown(here)
        cells = " ".join(f"{v / 2**20:>9.1f}M" for v in parts.values())
        print(f"{name:<9} {n:>5} {cells} {memory.device_bytes(here) / 2**20:>9.1f}M")
    return 0


def _find_stack(search: Search, cfg: RunConfig, args, device, limit) -> dict[str, Any]:
    convs, fcs = search.stack(args.most)
    line = _largest(search.points, "(n, n) stack that trains", convs, convs=convs, fcs=fcs)
    return {"convs": convs, "fcs": fcs, "line": line}


def _find_batch(search: Search, cfg: RunConfig, args, device, limit) -> dict[str, Any]:
    batch = search.batch(args.most)
    return {"batch": batch, "line": _largest(search.points, "batch that runs", batch, batch=batch)}


def _find_stages(search: Search, cfg: RunConfig, args, device, limit) -> dict[str, Any]:
    if search.fits():
        return {"stages": 1, "line": "fits one device: no pipeline needed"}
    capacity = profiling.device_capacity(device, limit)
    profiles = _profile(cfg, device)

    def mem(k: int) -> part.MemoryModel:
        return part.memory_model(capacity, k, cfg.microbatches, True, cfg.schedule, cfg.momentum)

    k = part.min_stages(profiles, mem, args.max_stages, least=2)  # one device just failed
    if k is None:
        return {"stages": None, "line": f"no split into <= {args.max_stages} stages fits"}
    counts = part.balance_auto(profiles, k, mem(k))
    est = [mem(k).stage_bytes(profiles[a:b], s) for s, (a, b) in enumerate(part.bounds(counts))]
    tried = search.points[-1] if search.points else None
    estimated = tried is not None and (tried.error or "").startswith(FAKE_ALLOCATOR)
    line = (
        f"{'estimated not to fit' if estimated else 'does not fit'} one device; fewest stages "
        f"that fit (modelled): {k} (balance "
        f"{','.join(map(str, counts))}, modelled GiB per stage "
        f"{', '.join(f'{b / 2**30:.2f}' for b in est)})"
    )
    answer = {"stages": k, "balance": counts, "stage_bytes": est, "line": line}
    if args.run:
        answer["exit_code"] = _run_pipeline(cfg, k, counts, device, limit, args.out)
    return answer


FINDERS = {"stack": _find_stack, "batch": _find_batch, "stages": _find_stages}


def _profile(cfg: RunConfig, device: torch.device) -> list[part.LayerProfile]:
    """Every layer measured on one micro-batch, one layer on the device at a time."""
    workload = WORKLOADS.get(cfg.workload)(cfg)
    precision = get_precision(cfg.dtype)
    layers = workload.layers(workload.build_model())
    micro = even_counts(cfg.batch, min(cfg.microbatches, cfg.batch))[0]
    x = workload.prepare(workload.synthetic_inputs(micro, cfg.seed).x.to(device))

    def autocast():
        if precision.autocast is None:
            return torch.autocast(device.type, enabled=False)
        return torch.autocast(device.type, dtype=precision.autocast)

    return profiling.profile_layers(
        layers, x.to(precision.storage), device, precision.storage, True, autocast
    )


def _run_pipeline(cfg, k, counts, device, limit, out) -> int:
    gpus = torch.cuda.device_count() if device.type == "cuda" else k
    if k > gpus:
        print(f"--run: {k} stages need {k} GPUs; this machine has {gpus}")
        return 0
    steps = cfg.steps or 3
    run_cfg = replace(
        cfg,
        strategy="pipeline",
        ranks=k,
        stages=k,
        balance=",".join(map(str, counts)),
        steps=steps,
        train_size=cfg.batch * steps,
        heldout_size=cfg.batch,
    )
    argv = ["run", cfg.workload, *config_argv(run_cfg)]
    if out:
        argv += ["--out", out]
    if limit is not None and device.type == "cuda":
        os.environ[profiling.MEM_LIMIT_ENV] = str(limit)
    gc.collect()  # hand this process's cached GPU memory back before the ranks start
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print("running: scalelab " + " ".join(argv), flush=True)
    return relaunch("torchrun", k, argv)


def config_argv(cfg: RunConfig) -> list[str]:
    """The `scalelab run` flags that reproduce cfg (fields left at their defaults omitted)."""
    argv = []
    for f in dataclasses.fields(RunConfig):
        value = getattr(cfg, f.name)
        if f.name in SKIP or value == f.default or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        argv += [flag] if value is True else [] if value is False else [flag, str(value)]
    return argv


# --- output -----------------------------------------------------------------------------------


def format_table(points: list[FitPoint], find: str) -> str:
    """The seed's table: convs, fcs (or batch), fits?, time of one training step."""
    lines = [f"{'convs':>6}{'fcs':>6}{'batch':>7}  {'fits?':<6}{'time (ms)':>11}{'peak GiB':>10}"]
    order = sorted(points, key=lambda p: (p.convs, p.fcs, p.batch))
    for p in order:
        ms = f"{p.seconds * 1e3:.2f}" if p.fits and p.seconds == p.seconds else "-"
        peak = f"{p.peak_bytes / 2**30:.2f}" if p.peak_bytes else "-"
        lines.append(
            f"{p.convs:>6}{p.fcs:>6}{p.batch:>7}  {'yes' if p.fits else 'no':<6}{ms:>11}{peak:>10}"
        )
    return "\n".join(lines)


def _record(out, cfg, find, limit, points, answer) -> None:
    rec = new_record(
        schema="scalelab.fit/1",
        kind="fit",
        workload=cfg.workload,
        find=find,
        mem_limit_bytes=limit,
        config=cfg.to_dict(),
        env=environment.collect(),
        **environment.git_commit(),
        points=[asdict(p) for p in points],
        answer={k: v for k, v in answer.items() if k != "exit_code"},
    )
    append_record(Path(out), rec)


COMMANDS.register("fit", "largest stack or batch that fits one device; fewest pipeline stages")(
    Command(add_arguments, run)
)
