"""Ceilings that check themselves before they are written.

A ceiling is what the machine can reach, so noise (another process on our cores, a thread
waiting for a core) can only make one too low, and a too-low ceiling puts measured points
above their roof. These relations hold on any machine, so a violation means under-measurement:

- fp32 GEMM >= fp64 GEMM on the same device (half the bytes, at least the same units);
- n cores >= one core, for the NumPy GEMM and copy (n threads could idle all but one);
- measured <= datasheet (GEMM per dtype, memory copy read + write) where a peak is cited;
- on a CPU, torch's fp64 GEMM >= NumPy's fp64 GEMM on one core (torch has at least that core:
  a loaded host's 20.8 GF/s below NumPy's 46.3 was torch's threads waiting for busy cores).

Each GEMM and copy figure is the best of repeated blocks; one whose blocks spread more than
UNSTABLE (the median block that much slower than the best) is named in `warnings` too.

Across runs: a GEMM or copy figure that moved from the file it replaces (same host, device
and --quick) by more than its blocks' spread allows (and at least MOVED) is named in
`warnings` and listed in `moved` (seen: two `ceilings --quick` runs minutes apart gave
fp32 GEMM 194 vs 94.8 GF/s, memory copy 46.7 vs 6.41 GB/s, and neither said so).

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
# A figure this much (max / min - 1) away from the previous file's, or its spread if larger.
MOVED = 0.25


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


def published(data: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """What the file publishes with a spread: {name: (figure, its best block's spread)}."""
    out = {}
    gemm = data.get("gemm_flops") or {}
    for name, rows in (gemm.get("detail") or {}).items():
        rows = [r for r in rows if isinstance(r, dict) and "flops" in r]
        if rows and isinstance(gemm.get(name), (int, float)):
            best = min(rows, key=lambda r: abs(r["flops"] - gemm[name]))  # the one published
            out[f"{name} GEMM"] = (float(gemm[name]), float(best.get("spread", 0.0)))
    rows = [r for r in data.get("mem_bw_detail") or [] if isinstance(r, dict) and "Bps" in r]
    if rows and isinstance(data.get("mem_bw"), (int, float)):
        best = min(rows, key=lambda r: abs(r["Bps"] - data["mem_bw"]))
        out["memory copy"] = (float(data["mem_bw"]), float(best.get("spread", 0.0)))
    return out


def moved(new: dict[str, Any], old: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures of `new` that moved from `old` (the file it replaces: same host, device
    and --quick, else nothing to compare) beyond max(MOVED, either file's spread)."""
    if not old or _setup(new) != _setup(old):
        return []
    before, out = published(old), []
    for what, (rate, spread) in published(new).items():
        if what not in before or min(rate, before[what][0]) <= 0:
            continue
        ratio = max(rate, before[what][0]) / min(rate, before[what][0])
        allowed = max(MOVED, spread, before[what][1])
        if ratio - 1 > allowed:
            out.append({"what": what, "new": rate, "old": before[what][0],
                        "ratio": round(ratio, 3), "allowed": round(allowed, 3),
                        "old_date": (old.get("machine") or {}).get("date")})  # fmt: skip
    return out


def _setup(data: dict[str, Any]) -> tuple[Any, ...]:
    return (data.get("machine") or {}).get("hostname"), data.get("device"), data.get("quick")


def moved_note(m: dict[str, Any]) -> str:
    unit = "B/s" if m["what"] == "memory copy" else "FLOP/s"
    return (f"ceiling moved: {m['what']} {m['new']:.3g} {unit} is {m['ratio']:.2f}x off the "
            f"{m['old']:.3g} of the file it replaces ({m['old_date']}), beyond the "
            f"{m['allowed']:.0%} its spread allows: the host changed between runs (busy?); "
            "re-measure on a quiet host")  # fmt: skip


def flag_moved(data: dict[str, Any], previous: dict[str, Any]) -> None:
    """Name in data's `warnings` (and list in `moved`) what moved from `previous`."""
    found = moved(data, previous)
    if found:
        data["moved"] = found
        data["warnings"] = [*data.get("warnings", []), *map(moved_note, found)]


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
