"""Measured ceilings of this machine: `scalelab ceilings` writes them, analyses read them.

Default path: scalelab-results/ceilings.json (DEFAULT_PATH; `scalelab ceilings -o PATH`).
Format (schema "scalelab.ceilings/1"); every rate is measured here: warm-up, synchronise,
time repeated blocks of calls, keep the best block (a ceiling is what the machine can reach;
noise on a shared machine only adds time); GEMM keeps the best size:

    {
      "schema": "scalelab.ceilings/1",
      "machine": {                      # machine_fingerprint()
        "hostname": str, "cpu": str, "cpu_cores": int,
        "gpu": str | None, "gpu_count": int,          # torch.cuda device 0 name, count
        "torch": str, "numpy": str, "date": str       # ISO-8601 UTC
      },
      "quick": bool,                    # measured with --quick (smaller sizes, fewer repeats)
      "notes": [str, ...],              # caveats, e.g. "tf32 = fp32 on CPU (no TF32 units)"
      "device": "cuda" | "cpu",         # where gemm_flops / mem_bw were measured
      "gemm_flops": {                   # torch.matmul FLOP/s (2*m*n*k / s), best over sizes
        "fp64": float, "fp32": float, "tf32": float, "bf16": float, "fp16": float,
        "detail": {dtype: [{"n": int, "threads": int | None, "seconds": float,
                            "flops": float}, ...]}  # threads: torch CPU threads (None: GPU)
      },                                # on CPU: torch GEMM on the CPU; tf32 == fp32 there,
                                        # fp16 may be absent (a dtype is left out, never 0)
      "mem_bw": float,                  # device copy bytes/s, counting read + write (2*bytes),
                                        # of the largest copy (past the caches)
      "mem_bw_detail": [{"bytes": int, "threads": int | None, "seconds": float, "Bps": float}],
      "h2d": {"pinned": float, "pageable": float},    # bytes/s host->device (GPU only)
      "d2h": {"pinned": float, "pageable": float},    # bytes/s device->host (GPU only)
      "cpu_gemm_flops": {"one_core": float, "all_cores": float, "cores": int,
                         "dtype": "fp64"},           # NumPy float64 GEMM FLOP/s
      "cpu_mem_bw": {"one_core": float, "all_cores": float},  # NumPy copy, read+write bytes/s
                                        # both: "all_cores_threads" (cores, or 1 when one
                                        # thread beat all of them: then the n-thread figure is
                                        # in "all_threads_measured")
      "passes": {"gemm": int, "host": int},   # measurement passes (ceiling_checks re-measures
                                        # what breaks a sanity relation; best of each kept)
      "warnings": [str, ...],           # relations still broken, busy-host signs
      "cpu_concurrency": {              # k single-threaded processes computing at once
        "ranks": [1, 2, 4, ..., cores], "slowdown": [1.0, ...],  # median time at k / at 1
        "slowdown_max": [...], "seconds": [...], "kernel": str, "method": str
      },                                # (instrument/concurrency.py)
      "comm": {                         # only when measured under a launcher (--ranks N)
        backend ("mpi" | "gloo" | "nccl"): {
          "ranks": int, "device": "cpu" | "cuda",   # where the message buffers lived
          op ("allreduce" | "p2p"): {
            "alpha_s": float,           # latency: t(n) = alpha + n / beta (least squares)
            "beta_Bps": float,          # bandwidth, bytes/s of message size n
            "points": [[bytes, seconds], ...]   # time per message size
          }
        }
      },
      "peaks": {...}                    # peaks.datasheet_peak(gpu name).to_dict(), when known
    }

`scalelab ceilings` measures "comm.mpi" over 2 ranks by default when MPI is installed.
Sections that were not measured (no GPU: "h2d", "d2h"; no launcher: "comm"; `--comm-only`:
every local section) are absent, so readers test `"h2d" in ceilings`. A later run writing
the same file keeps the `comm` entries of other backends measured on the same host.
For p2p, t is the one-way time of an n-byte message (half a ping-pong round trip); for
allreduce, t is the time of an n-byte sum all-reduce (beta is then the "algorithm bandwidth"
n / (t - alpha), not bus bandwidth).

`load_ceilings(path)` reads a file back: UsageError when it is not a ceilings file, a warning
when it was measured on another machine (hostname or GPU differ from this one).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scalelab.environment import cpu_model, usable_cpus
from scalelab.errors import UsageError
from scalelab.instrument import concurrency
from scalelab.instrument.ceiling_timing import Plan, best_and_spread, seconds_per_call
from scalelab.instrument.comm_bench import fit_alpha_beta  # noqa: F401  (part of this API)
from scalelab.instrument.host_ceilings import host_ceilings  # noqa: F401  (part of this API)
from scalelab.instrument.peaks import datasheet_peak
from scalelab.instrument.progress import Progress
from scalelab.instrument.timer import device_sync
from scalelab.record_schema import ceilings_problem

SCHEMA = "scalelab.ceilings/1"
DEFAULT_PATH = Path("scalelab-results") / "ceilings.json"
DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "tf32": torch.float32,  # with TF32 tensor cores allowed
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def machine_fingerprint() -> dict[str, Any]:
    """What identifies the machine a ceilings file belongs to."""
    cuda = torch.cuda.is_available()
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu_cores": usable_cpus(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


# --- device (torch) ------------------------------------------------------------------------
def gemm_flops(device: torch.device, plan: Plan, dtype_names: list[str]) -> dict[str, Any]:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs) per dtype, best over sizes."""
    out: dict[str, Any] = {"detail": {}}
    sync = device_sync(device)
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    try:
        for name in dtype_names:
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            rows = _gemm_rows(device, DTYPES[name], plan, sync)
            if rows:
                out["detail"][name] = rows
                out[name] = max(r["flops"] for r in rows)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    return out


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to n for the block (None: unchanged)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def thread_counts(device: torch.device) -> list[int | None]:
    """CPU: torch's default thread count and 1. On a busy machine the multi-threaded kernel
    can be 100x slower than one thread (a worker waits for a core), so a ceiling keeps the
    better of the two; the detail rows say which it was."""
    if device.type == "cuda":
        return [None]
    return sorted({torch.get_num_threads(), 1}, reverse=True)


def _gemm_rows(device: torch.device, dtype: torch.dtype, plan: Plan, sync) -> list[dict]:
    rows: list[dict] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for n in plan.gemm_sizes:
        a = torch.randn(n, n, device=device, dtype=torch.float32, generator=gen).to(dtype)
        b = torch.randn(n, n, device=device, dtype=torch.float32, generator=gen).to(dtype)
        for threads in thread_counts(device):
            with torch_threads(threads):
                try:
                    seconds, spread = best_and_spread(lambda a=a, b=b: torch.mm(a, b), sync, plan)
                except RuntimeError:  # no kernel for this dtype on this device
                    return rows
            flops = 2 * n**3 / seconds
            rows.append({"n": n, "threads": threads, "seconds": seconds, "flops": flops,
                         "spread": spread, "repeats": plan.repeats})  # fmt: skip
        fastest = min(r["seconds"] for r in rows if r["n"] == n)
        nxt = [m for m in plan.gemm_sizes if m > n]
        if nxt and fastest * (nxt[0] / n) ** 3 > plan.max_call_s:
            break  # a slow dtype (fp16 on many CPUs): larger sizes would only cost time
    return rows


def copy_bandwidth(device: torch.device, plan: Plan) -> list[dict[str, float]]:
    """Device-to-device copy, bytes/s counting the read and the write (2 * nbytes)."""
    rows, sync = [], device_sync(device)
    for nbytes in plan.copy_bytes:
        src = torch.ones(nbytes // 4, device=device)
        dst = torch.empty_like(src)
        for threads in thread_counts(device):
            with torch_threads(threads):
                seconds, spread = best_and_spread(lambda s=src, d=dst: d.copy_(s), sync, plan)
            rows.append(
                {
                    "bytes": nbytes,
                    "threads": threads,
                    "seconds": seconds,
                    "Bps": 2 * nbytes / seconds,
                    "spread": spread,
                    "repeats": plan.repeats,
                }
            )
        del src, dst
    return rows


def transfer_bandwidth(device: torch.device, plan: Plan) -> dict[str, dict[str, float]]:
    """Host<->device copies of plan.transfer_bytes, bytes/s of payload (one direction)."""
    sync, n = device_sync(device), plan.transfer_bytes
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out: dict[str, dict[str, float]] = {"h2d": {}, "d2h": {}}
    for kind, pin in (("pinned", True), ("pageable", False)):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
        host.fill_(1)  # touch every page before timing
        out["h2d"][kind] = n / seconds_per_call(lambda h=host: dev.copy_(h), sync, plan)
        out["d2h"][kind] = n / seconds_per_call(lambda h=host: h.copy_(dev), sync, plan)
    return out


# --- the whole measurement -----------------------------------------------------------------
def measure_local(device: torch.device, quick: bool, quiet: bool = False) -> dict[str, Any]:
    """Every single-process section of ceilings.json (see the module docstring)."""
    plan = Plan.make(device, quick)
    cuda = device.type == "cuda"
    names = list(DTYPES) if cuda else ["fp64", "fp32", "bf16", "fp16"]
    steps = [
        ("gemm", lambda: {"gemm_flops": gemm_flops(device, plan, names)}),
        ("copy", lambda: _mem_section(copy_bandwidth(device, plan))),
        ("host", lambda: host_ceilings(plan)),
        ("cpu concurrency", lambda: {"cpu_concurrency": concurrency.measure(usable_cpus(), quick)}),
    ]
    if cuda:
        steps.insert(2, ("h2d/d2h", lambda: transfer_bandwidth(device, plan)))
    progress = Progress(len(steps), "ceilings", enabled=not quiet)
    out: dict[str, Any] = {"device": device.type, "quick": quick, "notes": []}
    for done, (label, measure) in enumerate(steps, 1):
        out.update(measure())
        progress.label = f"ceilings: {label} done,"
        progress.milestone(done)
    if not cuda:
        out["gemm_flops"]["tf32"] = out["gemm_flops"]["fp32"]
        out["notes"].append("tf32 = fp32 on CPU (no TF32 units)")
    return out


def _mem_section(rows: list[dict[str, float]]) -> dict[str, Any]:
    largest = max(r["bytes"] for r in rows)  # past the caches
    return {"mem_bw": max(r["Bps"] for r in rows if r["bytes"] == largest), "mem_bw_detail": rows}


def new_ceilings(local: dict[str, Any] | None) -> dict[str, Any]:
    machine = machine_fingerprint()
    peak = datasheet_peak(machine["gpu"])
    return {
        "schema": SCHEMA,
        "machine": machine,
        **(local or {}),
        **({"peaks": peak.to_dict()} if peak is not None else {}),
    }


# --- files ---------------------------------------------------------------------------------
def write_ceilings(path: str | os.PathLike, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)  # readers never see half a file


def read_ceilings(path: str | os.PathLike) -> dict[str, Any]:
    """The file's content; UsageError when missing, not JSON, or not a ceilings file."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such ceilings file (measure one: scalelab ceilings -o PATH)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{path}: not JSON (is this a scalelab ceilings file?)") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise UsageError(f"{path}: not a ceilings file (schema {found!r}, expected {SCHEMA!r})")
    wrong = ceilings_problem(data)
    if wrong is not None:
        raise UsageError(f"{path}: malformed ceilings file: {wrong}")
    return data


def mismatches(measured_on: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """How two machine descriptions differ in what matters for ceilings: host and GPU. Takes
    a ceilings `machine` dict or a record's `env` (gpu_name, hostname) on either side."""
    diffs = []
    for key, alt in (("hostname", "hostname"), ("gpu", "gpu_name")):
        a = measured_on.get(key, measured_on.get(alt))
        b = here.get(key, here.get(alt))
        if a != b:
            diffs.append(f"{key} {a!r} vs {b!r}")
    return diffs


def load_ceilings(path: str | os.PathLike, warn: bool = True) -> dict[str, Any]:
    """Read a ceilings file; warn (one stderr line) when it was measured on another machine."""
    data = read_ceilings(path)
    diffs = mismatches(data.get("machine", {}), machine_fingerprint())
    if warn and diffs:
        sys.stderr.write(
            f"scalelab: warning: {path} was measured on another machine "
            f"({'; '.join(diffs)}, file vs here)\n"
        )
    return data
