"""`scalelab bench WORKLOAD...`: the fast path against eager, torch.compile and max-autotune.

One process, the same inputs and weights for every mode; prints throughput, the ratio to the
best peer, achieved TFLOP/s, the fraction of the measured GEMM ceiling and the check against
float64, and writes one JSON record per workload (schema scalelab.bench/1) to --out. A fast
path over its tolerance makes its record `failed` and the command exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from scalelab import environment
from scalelab.cli.base import COMMANDS, Command
from scalelab.cli.options import add_config_options
from scalelab.errors import UsageError
from scalelab.record import new_record
from scalelab.workloads import WORKLOADS

SCHEMA = "scalelab.bench/1"
MODEL_FIELDS = {"model", "model_arg", "input_shape", "input_dtype", "vocab"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "workloads", nargs="*", help="workload names, or 'all' for charcnn, alexnet, resnet18, mlp"
    )
    p.add_argument("--mode", choices=("infer", "train"), help="default: per workload")
    p.add_argument(
        "--batch", type=int, help="items per call (default: per workload and device; CPU: small)"
    )
    p.add_argument("--image-size", type=int, help="image workloads: height = width")
    p.add_argument("--hidden", type=int, help="mlp hidden width")
    add_config_options(p, only=MODEL_FIELDS)  # --model MODULE:FACTORY and its input
    p.add_argument("--train-size", type=int, help="training: items per epoch")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when present")
    p.add_argument("--iters", type=int, default=20, help="timed calls, median reported")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    p.add_argument("--oracle-items", type=int, default=8, help="items checked against fp64")
    p.add_argument(
        "--peers",
        help="comma list of eager_fp32, eager, compile, max-autotune (default on a GPU: all; "
        "on a CPU: eager_fp32, and eager (bf16) where the CPU has bf16 units; Inductor "
        "compiles for minutes on few cores)",
    )
    p.add_argument("--out", default="scalelab-results/bench", help="folder for the JSON records")
    p.add_argument("--table", metavar="DIR", help="only print the table of the records in DIR")
    p.add_argument("--quiet", action="store_true", help="no fast-path lines on stderr")


def run(args: argparse.Namespace) -> int:
    if args.table is not None:
        print(format_table(read_bench_records(Path(args.table))))
        return 0
    names = ["model"] if args.model is not None and not args.workloads else _names(args.workloads)
    if args.iters < 2 or args.warmup < 0 or args.oracle_items < 1:
        raise UsageError("--iters must be >= 2 (a spread), --oracle-items >= 1, --warmup >= 0")
    opts = _options(args)
    from scalelab.fast.bench import bench_workload, gemm_ceiling  # torch-heavy: load when running

    strict = len(names) == 1  # a flag one of several workloads rejects fails only that one
    checked = bench_workload(names[0], opts) if strict else None  # bad input: before any work
    ceiling, how = gemm_ceiling(torch.device(opts["device"]))
    _say(f"bench: GEMM ceiling {ceiling / 1e12:.3g} TFLOP/s ({how}) on {opts['device']}")
    records = [_one(name, opts, ceiling, Path(args.out), strict, checked) for name in names]
    print(format_table(records))
    print(f"records written to {args.out}/")
    return 0 if all(r["status"] == "ok" for r in records) else 1


def read_bench_records(folder: Path) -> list[dict[str, Any]]:
    """The bench records (*.json with the bench schema) in folder; other files are skipped."""
    if not folder.is_dir():
        raise UsageError(f"--table {folder}: no such folder")
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict) and rec.get("schema") == SCHEMA:
            records.append(rec)
    if not records:
        raise UsageError(f"--table {folder}: holds no scalelab bench records")
    return records


def _names(given: list[str]) -> list[str]:
    from scalelab.fast.bench import DEFAULTS

    if not given:
        raise UsageError("name at least one workload (or 'all')")
    names = list(DEFAULTS) if given == ["all"] else given
    for name in names:
        WORKLOADS.get(name)  # one line naming the known ones if unknown
    return names


def _options(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible to torch on this machine")
    peers = _peers(args.peers, device)  # validated before anything is said or measured
    if device == "cpu":
        _say("bench: no CUDA GPU; measuring on cpu (the fast path falls back to plain torch)")
    config = {
        "batch": args.batch,
        "image_size": args.image_size,
        "hidden": args.hidden,
        "train_size": args.train_size,
        **{name: getattr(args, name) for name in MODEL_FIELDS},
    }
    return {
        "mode": args.mode,
        "device": device,
        "iters": args.iters,
        "warmup": args.warmup,
        "oracle_items": args.oracle_items,
        "peers": peers,
        "quiet": args.quiet,
        "config": config,
    }


def _peers(given: str | None, device: str) -> list[str]:
    from scalelab.fast.bench import GPU_PEERS, PEER_NAMES, default_peers

    if given is None:
        return list(default_peers(device))
    by_name = {PEER_NAMES.get(k, k): k for k in GPU_PEERS}
    names = [n.strip() for n in given.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise UsageError(f"--peers {given!r}: choose from {', '.join(by_name)}")
    return [by_name[n] for n in dict.fromkeys(names)]


def _one(
    name: str, opts: dict[str, Any], ceiling: float, out: Path, strict: bool, workload=None
) -> dict[str, Any]:
    from scalelab.fast.bench import run_bench

    _say(f"bench {name}: measuring {', '.join(opts['peers'])} and fast ...")
    try:
        fields = _checked(run_bench(name, opts, ceiling, workload))
    except UsageError as exc:
        if strict:
            raise
        fields = _failed(name, opts, exc)
    except Exception as exc:  # one workload failing must not lose the others' numbers
        fields = _failed(name, opts, exc)
    rec = new_record(schema=SCHEMA, **fields, env=environment.collect(), **environment.git_commit())
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{rec.get('mode') or 'default'}.json"
    path.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    return rec


def _checked(fields: dict[str, Any]) -> dict[str, Any]:
    """status ok, or failed when the fast path is over its tolerance (or not finite)."""
    err, tol = fields["relerr"], fields["tolerance"]
    if err <= tol:
        return {"status": "ok", **fields}
    _say(f"bench {fields['workload']}: check failed: fast relerr {err:.2e} over {tol:.2e}")
    return {"status": "failed", "error": f"check failed: relerr {err:.2e} over {tol:.2e}", **fields}


def _failed(name: str, opts: dict[str, Any], exc: Exception) -> dict[str, Any]:
    text = str(exc).strip()
    error = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    _say(f"bench {name}: failed: {error[:300]}")
    return {"status": "failed", "workload": name, "mode": opts["mode"], "error": error}


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def format_table(records: list[dict[str, Any]]) -> str:
    head = (
        f"{'workload':<10}{'mode':<6}{'batch':>6}{'eager bf16/s':>14}{'best peer/s':>13}"
        f"{'(which)':>13}{'fast/s':>12}{'ratio':>7}{'TFLOP/s':>9}{'of GEMM':>9}{'check':>17}"
    )
    lines = [head, "-" * len(head)]
    lines += [_row(r) for r in records]
    ok = [r for r in records if r.get("relerr") is not None]
    units = sorted({f"{r['workload']}: {r['item_unit']}/s" for r in ok})
    gpus = sorted({str(r.get("gpu") or r.get("device")) for r in ok})
    lines.append(
        f"(throughput in items/s: {', '.join(units)}; device: {', '.join(gpus)}; "
        "ratio = fast / best peer; check = fast's deviation from float64 / its tolerance)"
    )
    lines += [_parts(r) for r in ok]
    lines += [_tokens(r) for r in ok if "tokens_per_s" in r]
    return "\n".join(lines)


def _tokens(r: dict[str, Any]) -> str:
    """A token model's line: tokens/s beside its best peer's, and MFU against each peak."""
    mfu = r["mfu"]
    peaks = [f"{mfu['measured']:.1%} of this run's {mfu['dtype']} GEMM ceiling"]
    if mfu.get("datasheet") is not None:
        name = mfu["datasheet_peak"]["source"].split(":")[0]
        peaks.append(f"{mfu['datasheet']:.1%} of {name}'s datasheet {mfu['dtype']} peak")
    return (f"  {r['workload']}: {r['tokens_per_s']:,.0f} tok/s (best peer "
            f"{r['peer_tokens_per_s']:,.0f}) | MFU {', '.join(peaks)}")  # fmt: skip


def _row(r: dict[str, Any]) -> str:
    if r.get("relerr") is None:
        mode = str(r.get("mode") or "")
        return f"{r.get('workload', '?'):<10}{mode:<6}  FAILED: {str(r.get('error', ''))[:90]}"
    best = r.get("best_peer") or "eager"
    eager = r.get("eager_throughput")
    flag = "" if r.get("status") == "ok" else " FAIL"
    check = f"{r['relerr']:.1e}/{r['tolerance']:.0e}{flag}"
    return (
        f"{r['workload']:<10}{r['mode']:<6}{r['batch']:>6}"
        f"{(f'{eager:,.0f}' if eager else '-'):>14}{r[f'{best}_throughput']:>13,.0f}"
        f"{_peer_name(best):>13}{r['fast_throughput']:>12,.0f}{r['ratio']:>6.2f}x"
        f"{r['tflops']:>9.1f}{r['ceiling_fraction']:>9.1%}{check:>17}"
    )


def _peer_name(key: str) -> str:
    from scalelab.fast.bench import PEER_NAMES

    return PEER_NAMES.get(key, key)


def _parts(r: dict[str, Any]) -> str:
    """How the fast path ran: each stage's implementation and (GPU) its time."""
    ms = r.get("fast_stage_ms") or {}
    parts = [
        f"{k}={v}" + (f" {ms[k]:.2f}ms" if k in ms else "")
        for k, v in (r.get("fast_parts") or {}).items()
    ]
    setup = f", setup {r['fast_setup_s']:.1f}s" if "fast_setup_s" in r else ""
    cached = r.get("fast_tuned_from_cache")
    tuned = f" ({len(cached)} stages from the tuning cache)" if cached else ""
    peers = ", ".join(f"{_peer_name(k)} {r[f'{k}_throughput']:,.0f}/s" for k in r.get("peers", []))
    return f"  {r['workload']}: {', '.join(parts)}{setup}{tuned}; peers: {peers}"


COMMANDS.register("bench", "the fast path against eager, torch.compile and max-autotune peers")(
    Command(add_arguments, run)
)
