"""Records -> one flat DataFrame row per run, plus the per-iteration quantities analyses share.

A record's times mean different things by mode: inference records hold the median wall of
one timed iteration (`wall_s`) and `items` per iteration; training records hold the whole
run (`wall_s` over `steps` optimizer steps, `items` trained on in total). `per_iteration`
puts both on one footing: items and seconds of one step/iteration, all ranks together.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pandas as pd

from scalelab.config import RunConfig, upgrade_record_config
from scalelab.record_schema import finished

# Config fields that do not change what is measured, so runs differing only in them are
# repeats of the same experiment (paths, verbosity, checkpointing, repetition counts).
NOT_EXPERIMENT = frozenset(
    {
        "quiet",
        "check",
        "iters",
        "warmup",
        "seed",
        "data_dir",
        "weights",
        "save_weights",
        "ckpt_every",
        "ckpt_dir",
        "resume",
        "trace",
        "nvml",
        "per_layer",
        "extra",
    }
)

IN_LABEL = frozenset({"workload", "strategy", "dtype", "device", "train"})  # always in a label
COLUMNS = [
    "id",
    "time",
    "status",
    "workload",
    "strategy",
    "mode",
    "ranks",
    "precision",
    "device",
    "batch",
    "iter_items",
    "iter_s",
    "wall_s",
    "throughput",
    "achieved_tflops",
    "relerr",
    "check_passed",
    "digest",
    "hostname",
    "gpu_name",
    "slurm_job",
    "nodes",
]


def ok_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Finished runs only (ok or check-failed: their timings stand; the check columns say
    the verdict): failed points carry no timings."""
    return [r for r in records if finished(r) and "wall_s" in r]


def per_iteration(rec: dict[str, Any]) -> tuple[float, float]:
    """(items, seconds) of one timed iteration (inference) or one optimizer step (training)."""
    if rec.get("mode") == "train":
        steps = max(int(rec.get("steps") or 1), 1)
        return rec["items"] / steps, rec["wall_s"] / steps
    return float(rec["items"]), float(rec["wall_s"])


def phase_scale(rec: dict[str, Any]) -> float:
    """Factor turning a record's phase seconds into seconds per iteration (training phases
    are totals over the run, inference phases medians of one iteration)."""
    if rec.get("mode") == "train":
        return 1.0 / max(int(rec.get("steps") or 1), 1)
    return 1.0


def config_of(rec: dict[str, Any]) -> dict[str, Any]:
    """The record's config as today's RunConfig reads it (older records upgraded: a per-rank
    batch becomes the global batch the record trained)."""
    return upgrade_record_config(rec.get("config") or {}, rec.get("global_batch"))


def experiment_key(rec: dict[str, Any], drop: frozenset[str] = frozenset()) -> str:
    """A hashable identity of what a run measured, ignoring NOT_EXPERIMENT and `drop` keys."""
    cfg = {k: v for k, v in config_of(rec).items() if k not in NOT_EXPERIMENT | drop}
    cfg.update(workload=rec.get("workload"), strategy=rec.get("strategy"))
    if nodes_of(rec) > 1:  # the same config over more nodes is another experiment
        cfg["nodes"] = nodes_of(rec)
    return json.dumps(cfg, sort_keys=True, default=str)


def nodes_of(rec: dict[str, Any]) -> int:
    """The nodes of the Slurm job the record ran in (1 outside Slurm)."""
    return int((rec.get("slurm") or {}).get("nodes") or 1)


def slurm_job(rec: dict[str, Any]) -> str | None:
    """`JOB`, `ARRAYJOB_TASK` for an array task, `+N` for a requeued job's attempt N."""
    job = rec.get("slurm") or {}
    if not job.get("job_id"):
        return None
    name = str(job["job_id"])
    if job.get("array_job_id") and job.get("array_task_id") is not None:
        name = f"{job['array_job_id']}_{job['array_task_id']}"
    return name + (f"+{job['restart']}" if job.get("restart") else "")


def differing_keys(records: list[dict[str, Any]], drop: frozenset[str] = frozenset()) -> list[str]:
    """Config keys (outside NOT_EXPERIMENT | drop) whose values differ between records."""
    cfgs = [config_of(r) for r in records]
    keys = sorted({k for c in cfgs for k in c} - NOT_EXPERIMENT - drop)
    return [k for k in keys if len({json.dumps(c.get(k), default=str) for c in cfgs}) > 1]


# Config keys that tell runs apart most often, named first when a label must stay short.
TELLING = (
    "split",
    "hidden",
    "batch",
    "image_size",
    "lr",
    "ranks",
    "threads",
    "overlap",
    "nonblocking",
    "amp",
    "bucket_mb",
    "grad_compress",
    "channels_last",
    "compile",
    "chunks",
    "epochs",
)
LABEL_KEYS = 4


def label(rec: dict[str, Any], keys: list[str] = (), nodes: bool = False) -> str:
    """Short human name of a run: workload, strategy, dtype, device, its node count when
    `nodes` (where siblings ran on different node layouts) and up to LABEL_KEYS of the given
    config keys (the most telling first; keys the run left unset are not named)."""
    cfg = config_of(rec)
    rank = {k: i for i, k in enumerate(TELLING)}
    keys = sorted(
        (k for k in keys if k not in IN_LABEL and cfg.get(k) is not None),
        key=lambda k: (rank.get(k, len(TELLING)), k),
    )[:LABEL_KEYS]
    parts = [
        rec.get("workload", "?"),
        rec.get("strategy", "?"),
        rec.get("precision") or cfg.get("dtype", "?"),
        cfg.get("device", "cpu"),
    ]
    if rec.get("mode") == "train":
        parts.append("train")
    if nodes:
        parts.append(f"nodes={nodes_of(rec)}")
    parts += [f"{k}={cfg.get(k)}" for k in keys]
    return " ".join(str(p) for p in parts)


def records_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per record: the headline metrics, then every config field as `cfg.<name>`."""
    rows = []
    for rec in records:
        cfg, env = config_of(rec), rec.get("env") or {}
        ok = "wall_s" in rec
        items, secs = per_iteration(rec) if ok else (float("nan"), float("nan"))
        row = {
            "id": rec.get("id"),
            "time": rec.get("time"),
            "status": rec.get("status", "ok"),
            "workload": rec.get("workload"),
            "strategy": rec.get("strategy"),
            "mode": rec.get("mode"),
            "ranks": rec.get("ranks"),
            "precision": rec.get("precision") or cfg.get("dtype"),
            "device": cfg.get("device"),
            "batch": cfg.get("batch"),
            "iter_items": items,
            "iter_s": secs,
            "wall_s": rec.get("wall_s"),
            "throughput": rec.get("throughput"),
            "achieved_tflops": rec.get("achieved_tflops"),
            "relerr": rec.get("relerr"),
            "check_passed": rec.get("check_passed"),
            "digest": rec.get("digest"),
            "hostname": env.get("hostname"),
            "gpu_name": env.get("gpu_name"),
            "slurm_job": slurm_job(rec),
            "nodes": nodes_of(rec),
        }
        row.update({f"cfg.{k}": _scalar(v) for k, v in cfg.items()})
        rows.append(row)
    return pd.DataFrame(rows, columns=None if rows else COLUMNS)


def _scalar(v: Any) -> Any:
    return json.dumps(v) if isinstance(v, (dict, list)) else v


def run_config(rec: dict[str, Any]) -> RunConfig:
    """The record's RunConfig with file paths dropped, so a workload's analytic cost table can
    be rebuilt on a machine that lacks the data or weights files the run used."""
    names = {f.name for f in dataclasses.fields(RunConfig)}
    cfg = {k: v for k, v in config_of(rec).items() if k in names}
    for path_field in ("data_dir", "weights", "resume", "save_weights", "ckpt_dir", "trace"):
        cfg[path_field] = None
    cfg.setdefault("workload", rec.get("workload"))
    return RunConfig(**cfg)


def layer_rows(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """A record's per-layer rows (`--per-layer`: `per_layer`, rows keyed `layer`), normalised
    to name, kind, seconds, out_bytes, peak_bytes, power_w (+ flops/bytes when carried)."""
    rows = rec.get("per_layer")
    if not isinstance(rows, list):
        rows = rec.get("layers")
    if not isinstance(rows, list):
        return []
    out = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        norm = {
            "name": row.get("layer", row.get("name")),
            "kind": row.get("kind"),
            "seconds": row.get("seconds"),
            "out_bytes": row.get("out_bytes"),
            "peak_bytes": row.get("peak_mem_bytes", row.get("peak_bytes")),
            "power_w": next((row[k] for k in ("power_w", "power_W", "watts") if k in row), None),
        }
        norm.update({k: row[k] for k in ("flops", "bytes") if k in row})
        out.append(norm)
    return out


def sibling_labels(records: list[dict[str, Any]], drop: frozenset[str] = frozenset()) -> list[str]:
    """label() of each record, naming the config keys (outside `drop`) in which it differs
    from the other records of its workload, strategy and mode (split, hidden, lr, ...), and
    the node count where they ran on different numbers of nodes (a layout is its own run)."""
    kin: dict[tuple, list[dict[str, Any]]] = {}
    for rec in records:
        kin.setdefault(_kin(rec), []).append(rec)
    keys = {k: differing_keys(group, drop) for k, group in kin.items()}
    layouts = {k: len({nodes_of(r) for r in group}) > 1 for k, group in kin.items()}
    return [label(rec, keys[_kin(rec)], layouts[_kin(rec)]) for rec in records]


def _kin(rec: dict[str, Any]) -> tuple:
    return rec.get("workload"), rec.get("strategy"), rec.get("mode")


def distinct(names: list[str]) -> list[str]:
    """The names with a repeat made distinct (` #2`, ` #3`): labels name at most LABEL_KEYS
    differing keys, and a dict keyed by them must not keep only the last of two groups."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} #{seen[name]}")
    return out
