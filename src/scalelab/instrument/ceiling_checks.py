"""Ceilings that check themselves before they are written.

A ceiling is what the machine can reach, so noise (another process on our cores, a thread
waiting for a core) can only make one too low, and a too-low ceiling puts measured points
above their roof. These relations hold on any machine, so a violation means under-measurement:

- fp32 GEMM >= fp64 GEMM on the same device (half the bytes, at least the same units);
- n cores >= one core, for the NumPy GEMM and copy (n threads could idle all but one);
- measured <= datasheet (GEMM per dtype, memory copy read + write) where a peak is cited;
- on a CPU, torch's fp64 GEMM >= NumPy's fp64 GEMM on one core (torch has at least that core:
  issue 38's 20.8 GF/s below NumPy's 46.3 was torch's threads waiting for busy cores).

Each GEMM and copy figure is the best of repeated blocks; one whose blocks spread more than
UNSTABLE (the median block that much slower than the best) is named in `warnings` too.

`scalelab ceilings` re-measures the sections a violation names (up to RETRIES more passes,
keeping each figure's best over the passes: the best stable figure), and whatever still
fails is written into the file's `warnings` and printed on stderr, never silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RETRIES = 2
# A measurement may exceed a datasheet figure by this much (clock boost, rounding) before it is
# implausible.
DATASHEET_SLACK = 1.05
# n cores may fall this far below one core before it is a violation (timer noise).
CORES_SLACK = 0.98
# The median of a ceiling's timed blocks this much slower than its best: an unstable figure.
UNSTABLE = 0.25


def violations(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(section to re-measure, what is wrong) for every relation the ceilings break."""
    out = []
    gemm = data.get("gemm_flops") or {}
    dev = data.get("device", "?")
    if "fp32" in gemm and "fp64" in gemm and gemm["fp32"] < gemm["fp64"]:
        out.append(("gemm", f"{dev} fp32 GEMM {gemm['fp32']:.3g} FLOP/s below fp64 "
                            f"{gemm['fp64']:.3g}"))  # fmt: skip
    for key, what in (("cpu_gemm_flops", "NumPy fp64 GEMM"), ("cpu_mem_bw", "NumPy copy")):
        sec = data.get(key) or {}
        one, many = sec.get("one_core"), sec.get("all_cores")
        if one and many is not None and many < CORES_SLACK * one:
            out.append(("host", f"{what} on all cores {many:.3g}/s below one core {one:.3g}/s"))
    one = (data.get("cpu_gemm_flops") or {}).get("one_core")
    if dev == "cpu" and "fp64" in gemm and one and gemm["fp64"] < CORES_SLACK * one:
        out.append(("gemm", f"torch fp64 GEMM {gemm['fp64']:.3g} FLOP/s below NumPy fp64 on "
                            f"one core {one:.3g}"))  # fmt: skip
    out += _over_datasheet(data)
    return out


def unstable_notes(data: dict[str, Any]) -> list[str]:
    """The published GEMM and copy figures whose repeated blocks spread beyond UNSTABLE."""
    out = []
    gemm = data.get("gemm_flops") or {}
    for name, rows in (gemm.get("detail") or {}).items():
        best = max((r for r in rows if isinstance(r, dict) and "flops" in r),
                   key=lambda r: r["flops"], default=None)  # fmt: skip
        if best is not None and best.get("spread", 0.0) > UNSTABLE:
            out.append(_unstable(f"{name} GEMM", best["flops"], "FLOP/s", best))
    rows = [r for r in data.get("mem_bw_detail") or [] if isinstance(r, dict) and "Bps" in r]
    best = max(rows, key=lambda r: r["Bps"], default=None)
    if best is not None and best.get("spread", 0.0) > UNSTABLE:
        out.append(_unstable("memory copy", best["Bps"], "B/s", best))
    return out


def _unstable(what: str, rate: float, unit: str, row: dict[str, Any]) -> str:
    blocks = row.get("repeats", "?")
    return (f"unstable ceiling: {what} {rate:.3g} {unit} is the best of {blocks} blocks whose "
            f"median was {row['spread']:.0%} slower (host busy? re-measure)")  # fmt: skip


def _over_datasheet(data: dict[str, Any]) -> list[tuple[str, str]]:
    peaks = data.get("peaks") or {}
    out = []
    for name, rate in (data.get("gemm_flops") or {}).items():
        peak = peaks.get(name)
        if isinstance(rate, (int, float)) and peak and rate > DATASHEET_SLACK * peak:
            out.append(("datasheet", f"{name} GEMM {rate:.3g} FLOP/s above the datasheet's "
                                     f"{peak:.3g}"))  # fmt: skip
    bw, peak = data.get("mem_bw"), peaks.get("mem_Bps")
    if isinstance(bw, (int, float)) and peak and bw > DATASHEET_SLACK * peak:
        out.append(("datasheet", f"memory copy {bw:.3g} B/s above the datasheet's {peak:.3g}"))
    return out


def keep_best(old: Any, new: Any) -> Any:
    """Merge two passes of a section: the larger of every rate (dicts key by key); detail
    rows (lists) of both passes are kept."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {k: keep_best(old.get(k), new.get(k)) if k in old else new[k] for k in new} | {
            k: v for k, v in old.items() if k not in new
        }
    if isinstance(old, list) and isinstance(new, list):
        return old + new
    if (
        isinstance(old, (int, float))
        and isinstance(new, (int, float))
        and not isinstance(old, bool)
    ):
        return max(old, new)
    return new if old is None else old


def self_check(
    data: dict[str, Any], remeasure: dict[str, Callable[[], dict[str, Any]]]
) -> dict[str, Any]:
    """Re-measure the sections that break a relation (keeping the best of every pass), then
    put what still fails in data["warnings"]; returns data."""
    passes = {name: 1 for name in remeasure}
    for _ in range(RETRIES):
        redo = {s for s, _ in violations(data) if s in remeasure}
        if not redo:
            break
        for section in sorted(redo):
            for key, value in remeasure[section]().items():
                data[key] = keep_best(data.get(key), value)
            passes[section] += 1
    data["passes"] = passes
    data["warnings"] = [f"implausible ceiling: {why}" for _, why in violations(data)]
    data["warnings"] += busy_host_notes(data)
    data["warnings"] += unstable_notes(data)
    return data


def busy_host_notes(data: dict[str, Any]) -> list[str]:
    """n threads slower than one: the all-cores ceiling kept one thread's figure, a sign
    the host was busy (the figure is a floor of what n cores reach on a quiet host)."""
    out = []
    for key, what in (("cpu_gemm_flops", "NumPy fp64 GEMM"), ("cpu_mem_bw", "NumPy copy")):
        sec = data.get(key) or {}
        if "all_threads_measured" in sec:
            out.append(
                f"{what} on {sec.get('cores', 'all')} threads measured "
                f"{sec['all_threads_measured']:.3g}/s, below one thread's {sec['one_core']:.3g}/s:"
                " the host is busy; all_cores keeps one thread's figure"
            )
    return out
