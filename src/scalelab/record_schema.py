"""The shape of a run record, checked when a results file is read: a record whose fields have
the wrong kind (a hand-edited file, another tool's JSON under our schema tag) is refused with
one line naming the field, instead of failing deep inside an analysis."""

from __future__ import annotations

import math
from typing import Any

NUMBER = (int, float)
TEXT = (str,)
# Field -> the kinds it may hold (None is allowed where a run may not have measured it).
FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "id": (TEXT, True),
    "time": (TEXT, True),
    "status": (TEXT, False),
    "workload": (TEXT, True),
    "strategy": (TEXT, True),
    "mode": (TEXT, True),
    "ranks": ((int,), True),
    "precision": (TEXT, True),
    "config": ((dict,), True),
    "env": ((dict,), True),
    "items": (NUMBER, True),
    "iters": ((int,), True),
    "steps": ((int,), True),
    "wall_s": (NUMBER, True),
    "throughput": (NUMBER, True),
    "achieved_tflops": (NUMBER, True),
    "flops_per_item": (NUMBER, True),
    "item_unit": (TEXT, True),
    "phases": ((dict,), True),
    "rank_phases": ((list,), True),
    "bytes": ((dict,), True),
    "relerr": (NUMBER, True),
    "tolerance": (NUMBER, True),
    "check_passed": ((bool,), True),
    "tolerance_basis": (TEXT, True),
    "one_process_relerr": (NUMBER, True),
    "explain": ((dict,), True),
    "loss": ((list,), True),
    "accuracy": ((list,), True),
    "heldout_loss": ((list,), True),
    "perplexity": ((list,), True),
    "task": (TEXT, True),
    "tokens_per_s": (NUMBER, True),
    "tokens_per_s_per_device": (NUMBER, True),
    "mfu": ((dict,), True),
    "walls_s": ((list,), True),
    "wall_spread_s": ((dict,), True),
    "error": (TEXT, True),
}
# A run that finished carries its timings: "ok", or "check-failed" (it ran, and its output
# disagreed with the reference beyond the bound it was held to: exit 1). "failed" carries none.
FINISHED = ("ok", "check-failed")
REQUIRED_WHEN_OK = ("workload", "strategy", "mode", "ranks", "items", "wall_s", "config")
CONFIG_FIELDS = {"batch": (int,), "ranks": (int,), "hidden": (int,), "image_size": (int,),
                 "workload": TEXT, "strategy": TEXT, "device": TEXT, "dtype": TEXT,
                 "train": (bool,), "threads": (int,), "steps": (int,)}  # fmt: skip


def problem(rec: dict[str, Any]) -> str | None:
    """What is wrong with a run record's shape, or None."""
    for name, (kinds, nullable) in FIELDS.items():
        if name not in rec or (rec[name] is None and nullable):
            continue
        if not _is(rec[name], kinds):
            return f"field {name!r} holds {_kind(rec[name])}, expected {kinds[0].__name__}"
    if finished(rec):  # read as a run
        for name in REQUIRED_WHEN_OK:
            if rec.get(name) is None:
                return f"status {rec.get('status', 'ok')} but no {name!r}"
        if rec["ranks"] < 1 or not math.isfinite(rec["wall_s"]) or rec["items"] < 0:
            return "ranks < 1, items < 0 or a non-finite wall_s"
    for name, kinds in CONFIG_FIELDS.items():
        value = (rec.get("config") or {}).get(name)
        if value is not None and not _is(value, kinds):
            return f"config {name!r} holds {_kind(value)}, expected {kinds[0].__name__}"
    for name in ("phases", "bytes"):
        bad = [k for k, v in (rec.get(name) or {}).items() if v is not None and not _is(v, NUMBER)]
        if bad:
            return f"{name} {bad[0]!r} is not a number"
    for name in ("rank_phases",):
        for row in rec.get(name) or []:
            if not isinstance(row, dict) or not all(_is(v, NUMBER) for v in row.values()):
                return f"{name} holds a row that is not name -> seconds"
    for name in ("loss", "accuracy", "heldout_loss", "perplexity", "walls_s"):
        if not all(v is None or _is(v, NUMBER) for v in rec.get(name) or []):
            return f"{name} holds a value that is not a number"
    return None


def finished(rec: dict[str, Any]) -> bool:
    """A run that finished with timings (status ok or check-failed; old records without a
    status that carry a wall time)."""
    if "status" not in rec:
        return "wall_s" in rec
    return rec["status"] in FINISHED


def _is(value: Any, kinds: tuple[type, ...]) -> bool:
    """isinstance, with bool not counting as a number (JSON true is not 1 here)."""
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# --- ceilings files -----------------------------------------------------------------------
RATE_TABLES = ("gemm_flops", "cpu_gemm_flops", "cpu_mem_bw", "h2d", "d2h", "peaks")
COUNTS = ("cpu_cores", "gpu_count")  # machine's whole numbers


def ceilings_problem(data: dict[str, Any]) -> str | None:
    """What is wrong with a ceilings file's shape (rates are positive numbers), or None."""
    for name in ("machine", "comm", *RATE_TABLES):
        if data.get(name) is not None and not isinstance(data[name], dict):
            return f"{name!r} holds {_kind(data[name])}, expected an object"
    counts = [(f"machine.{k}", (data.get("machine") or {}).get(k)) for k in COUNTS]
    counts.append(("cpu_gemm_flops.cores", (data.get("cpu_gemm_flops") or {}).get("cores")))
    counts += [(f"comm.{b}.ranks", ops.get("ranks")) for b, ops in (data.get("comm") or {}).items()
               if isinstance(ops, dict)]  # fmt: skip
    for name, value in counts:  # cores and ranks size what a plan or prediction sets up
        if value is not None and not (_is(value, (int,)) and value >= 0):
            return f"{name} holds {value!r}, expected a whole number"
    if data.get("mem_bw") is not None and not _positive(data["mem_bw"]):
        return "'mem_bw' is not a positive number"
    for name in RATE_TABLES:
        for key, value in (data.get(name) or {}).items():
            if key in ("detail", "dtype", "match", "name", "source", "cores"):
                continue
            if value is not None and not _positive(value):
                return f"{name}.{key} is not a positive number"
    for backend, ops in (data.get("comm") or {}).items():
        if not isinstance(ops, dict):
            return f"comm.{backend} is not an object"
        for op, fit in ops.items():
            if op in ("device", "ranks"):
                continue
            if not isinstance(fit, dict) or not all(
                _is(fit.get(k), NUMBER) and math.isfinite(fit[k]) and fit[k] >= 0
                for k in ("alpha_s", "beta_Bps")
            ):
                return f"comm.{backend}.{op} lacks numeric alpha_s and beta_Bps"
            points = fit.get("points", [])
            if not isinstance(points, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(_is(v, NUMBER) for v in p)
                for p in points
            ):
                return f"comm.{backend}.{op}.points is not a list of [bytes, seconds]"
    return None


def _positive(value: Any) -> bool:
    return _is(value, NUMBER) and math.isfinite(value) and value > 0
