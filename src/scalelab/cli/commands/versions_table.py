"""The tables `scalelab versions` prints: inference (wall, throughput, relerr and digest against
the float64 oracle) and --train (time per optimizer step, the training check's error against
one float64 process). Speedup is against the plain one-GPU run (`local cuda`) where this table
has one, else the one-process CPU run (serial for inference, local for training)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scalelab.cli.commands.versions_variants import Variant
from scalelab.record_schema import FINISHED

Rows = list[tuple[Variant, dict[str, Any]]]
WIDTH = 22  # the strategy column: the longest label, "pipeline torch cuda", and a gap


def _ok(r: dict[str, Any]) -> bool:
    return r.get("status") in FINISHED


def baseline(rows: Rows) -> tuple[Variant, dict[str, Any]] | None:
    """The row speedups are against: local cuda where it ran, else serial (inference) or
    local cpu (training)."""
    train = any(v.train for v, _ in rows)
    for want in (("local", "cuda"), ("local" if train else "serial", "cpu")):
        for v, r in rows:
            if (v.strategy, v.device) == want and _ok(r):
                return v, r
    return None


def baseline_line(rows: Rows) -> str:
    base = baseline(rows)
    return f"speedup vs {base[0].label}" if base else "speedup: no baseline ran"


def dominant(rec: dict[str, Any]) -> str:
    top = {k: v for k, v in rec.get("phases", {}).items() if "/" not in k}
    if not top:
        return "-"
    name = max(top, key=top.get)
    return f"{name} {top[name] / rec['wall_s']:.0%}"


def _failed(v: Variant, r: dict[str, Any]) -> str:
    return f"{v.label:<{WIDTH}}{v.ranks:>6}  {r.get('status')}: {r.get('error')}"


def _lines(rows: Rows, head: str, line: Callable[[Variant, dict[str, Any]], str]) -> str:
    """The header, a rule, and one line a variant (a failed run: its status and error)."""
    lines = [head, "-" * len(head)]
    lines += [line(v, r) if _ok(r) else _failed(v, r) for v, r in rows]
    return "\n".join(lines)


def format_table(rows: Rows) -> str:
    """Inference: one line a variant, speedup against baseline()."""
    base = baseline(rows)
    head = (
        f"{'strategy':<{WIDTH}}{'ranks':>6}{'wall ms':>11}{'items/s':>11}{'speedup':>9}"
        f"{'relerr':>10}  {'digest':<18}{'dominant phase'}"
    )

    def line(v: Variant, r: dict[str, Any]) -> str:
        speed = _times(base[1]["wall_s"] / r["wall_s"]) if base else "-"
        mark = "" if r["digest"] == r["reference_digest"] else " (!)"
        return (
            f"{v.label:<{WIDTH}}{r['ranks']:>6}{r['wall_s'] * 1e3:>11.2f}{r['throughput']:>11.1f}"
            f"{speed:>9}{r['relerr']:>10.1e}  {r['digest'] + mark:<18}{dominant(r)}"
            + ("  check-failed" if r["status"] == "check-failed" else "")
        )

    return _lines(rows, head, line)


def step_seconds(rec: dict[str, Any]) -> float:
    """Seconds per optimizer step over the steady part of the run (the record's `steady`:
    the steps after warm-up, or the whole run when it had too few)."""
    steady = rec.get("steady") or {}
    batch = rec.get("global_batch") or (rec.get("config") or {}).get("batch") or 1
    steps = (steady.get("items") or 0) / batch
    if steps > 0 and steady.get("seconds"):
        return steady["seconds"] / steps
    return rec["wall_s"] / max(rec.get("steps") or 1, 1)


def format_train_table(rows: Rows) -> str:
    """--train: step time, steady items/s, speedup against baseline(), the training check's
    relerr against one float64 process and its verdict."""
    base = baseline(rows)
    head = (
        f"{'strategy':<{WIDTH}}{'ranks':>6}{'step ms':>11}{'items/s':>11}{'speedup':>9}"
        f"{'relerr':>10}{'tolerance':>11}  check"
    )

    def line(v: Variant, r: dict[str, Any]) -> str:
        step = step_seconds(r)
        speed = _times(step_seconds(base[1]) / step) if base else "-"
        rate = r.get("steady_throughput") or r.get("throughput") or 0.0
        verdict = "passed" if r.get("check_passed") else "FAILED"
        cause = (r.get("train_check") or {}).get("cause")
        return (
            f"{v.label:<{WIDTH}}{r['ranks']:>6}{step * 1e3:>11.2f}{rate:>11.1f}{speed:>9}"
            f"{r.get('relerr', float('nan')):>10.1e}{r.get('tolerance', float('nan')):>11.0e}"
            f"  {verdict}" + (f" ({cause})" if cause and not r.get("check_passed") else "")
        )

    return _lines(rows, head, line)


def _times(ratio: float) -> str:
    """A speedup with 3 significant digits: serial float64 on a GPU host is 0.000859x."""
    return f"{ratio:.2f}x" if ratio >= 0.995 else f"{ratio:.3g}x"
