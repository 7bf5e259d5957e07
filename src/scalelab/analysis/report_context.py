"""Report sections on what was measured where: the environment, the machine's ceilings and
the versions table (every strategy against the float64 oracle)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from scalelab.analysis import html, roofline
from scalelab.analysis.frame import nodes_of, ok_records
from scalelab.analysis.roles import StrategyRoles

# N ranks more than this x N faster than one `local` process: a contradiction to flag.
SUPERLINEAR = 1.5
Section = tuple[str, str, str]


def environment_section(records: list[dict[str, Any]]) -> Section:
    keys = [
        "hostname",
        "cpu",
        "cpu_count",
        "gpu_name",
        "gpu_count",
        "driver",
        "cuda",
        "torch",
        "mpi_library",
        "git_commit",
        "git_dirty",
    ]
    rows: dict[str, dict[str, Any]] = {}
    for rec in records:  # one row per host: a run that left a field unset (a one-process
        # run loads no MPI library) does not make the host a second row
        env = {k: (rec.get("env") or {}).get(k) for k in keys}
        env["git_commit"] = (env["git_commit"] or rec.get("git_commit") or "")[:10] or None
        row = rows.setdefault(str(env["hostname"]), {"runs": 0})
        row["runs"] += 1
        for k, v in env.items():
            seen = row.setdefault(k, [])
            if v is not None and v not in seen:
                seen.append(v)
    df = pd.DataFrame(
        [{k: _merged(v) for k, v in row.items()} for row in rows.values()],
        columns=[*keys, "runs"],
    )
    return "env", "Environment", html.table(df.dropna(axis=1, how="all"), text_cols=set(keys))


def _merged(values: Any) -> Any:
    """A field's distinct values over a host's records: one value as itself, several joined
    (two torch versions on one host are worth seeing), none as missing."""
    if not isinstance(values, list):
        return values
    return None if not values else values[0] if len(values) == 1 else " / ".join(map(str, values))


def ceilings_section(ceilings: dict[str, Any] | None, records: list[dict[str, Any]]) -> Section:
    if ceilings is None:
        return (
            "ceilings",
            "Ceilings",
            html.note("No ceilings: run `scalelab ceilings -o ceilings.json` and pass --ceilings."),
        )
    rows = _ceiling_rows(ceilings)
    machine = ceilings.get("machine") or {}
    lead = (
        f"Measured on {machine.get('hostname', '?')} ({machine.get('cpu', '?')}, "
        f"GPU {machine.get('gpu') or 'none'}) {machine.get('date', '')}"
        + (" with --quick" if ceilings.get("quick") else "")
    )
    body = html.note(lead) + html.table(pd.DataFrame(rows, columns=["ceiling", "value", "unit"]))
    warning = roofline.ceilings_mismatch(ceilings, records)
    if warning:
        body = html.note(f"Warning: {warning}.") + body
    # what the ceilings' own checks found (a relation broken, an unstable figure): never silent
    body = html.warning_list(list(ceilings.get("warnings") or [])) + body
    return "ceilings", "Ceilings", body


def _ceiling_rows(c: dict[str, Any]) -> list[tuple[str, str, str]]:
    dev = c.get("device", "?")
    rows = [
        (f"GEMM {k} ({dev})", f"{v / 1e12:.3f}", "TFLOP/s")
        for k, v in (c.get("gemm_flops") or {}).items()
        if isinstance(v, (int, float))
    ]
    if isinstance(c.get("mem_bw"), (int, float)):
        size = _mib(max((r.get("bytes", 0) for r in c.get("mem_bw_detail") or []), default=0))
        rows.append(
            (f"memory copy ({dev}, read + write{size})", f"{c['mem_bw'] / 1e9:.1f}", "GB/s")
        )
    for way in ("h2d", "d2h"):
        for kind, v in (c.get(way) or {}).items():
            rows.append((f"{way} {kind}", f"{v / 1e9:.2f}", "GB/s"))
    for key, what, scale, unit in (
        ("cpu_gemm_flops", "CPU GEMM fp64", 1e9, "GFLOP/s"),
        ("cpu_mem_bw", "CPU memory copy", 1e9, "GB/s"),
    ):
        for cores in ("one_core", "all_cores"):
            v = (c.get(key) or {}).get(cores)
            if isinstance(v, (int, float)):
                size = _mib((c.get(key) or {}).get("bytes_per_thread", 0), " per thread")
                rows.append((f"{what}, {cores.replace('_', ' ')}{size}", f"{v / scale:.2f}", unit))
    for backend, ops in (c.get("comm") or {}).items():
        for op, fit in ops.items():
            if isinstance(fit, dict) and "alpha_s" in fit:
                n = ops.get("ranks", "?")
                rows.append(
                    (f"{backend} {op} latency ({n} ranks)", f"{fit['alpha_s'] * 1e6:.2f}", "us")
                )
                rows.append((f"{backend} {op} bandwidth", f"{fit['beta_Bps'] / 1e9:.2f}", "GB/s"))
    return rows


def _mib(nbytes: Any, tail: str = "") -> str:
    """', 16 MiB' (the working set of a copy ceiling: a demo showed torch's copy at
    16 MiB, 22.6 GB/s, beside NumPy's at 8 MiB per thread, 38.8 GB/s: cache vs memory)."""
    return f", {nbytes / (1 << 20):g} MiB{tail}" if isinstance(nbytes, int) and nbytes else ""


def versions_section(records: list[dict[str, Any]], roles: StrategyRoles) -> Section:
    """One table per `scalelab versions` invocation (its shared `versions` id), else per
    workload / input / batch, of the checked inference runs."""
    checked = [r for r in ok_records(records) if r.get("mode") != "train" and "relerr" in r]
    if not checked:
        return "versions", "Versions", html.note("No checked inference runs (run with --check).")
    groups: dict[str, list[dict[str, Any]]] = {}
    for rec in checked:
        cfg = rec.get("config") or {}
        key = rec.get("versions") or f"{rec['workload']}/{cfg.get('image_size')}/{cfg.get('batch')}"
        groups.setdefault(key, []).append(rec)
    parts = [
        html.note(
            "Every strategy on the same inputs, checked against the float64 NumPy oracle; "
            "speedup against the serial run of the same table (the slowest run without one)."
        )
    ]
    for recs in groups.values():  # every table: no silent cap
        cfg = recs[0].get("config") or {}
        size = cfg.get("image_size")
        title = f"{recs[0]['workload']} {f'{size}x{size}' if size else '(native size)'}, "
        parts.append(f"<h3>{html.esc(title)}batch {cfg.get('batch')}</h3>")
        parts.append(_versions_table(recs, roles))
    return "versions", "Versions", "\n".join(parts)


def _cv(spread: dict[str, Any]) -> float | None:
    """The repetitions' CV; none for one repetition (not a CV of 0.0%)."""
    return spread.get("cv") if (spread.get("n") or 0) >= 2 else None


def _versions_table(recs: list[dict[str, Any]], roles: StrategyRoles) -> str:
    rows = []
    for rec in recs:
        cfg = rec.get("config") or {}
        rows.append(
            {
                "strategy": rec["strategy"],
                "split": cfg.get("split") if rec.get("ranks", 1) > 1 else "",
                "ranks": rec.get("ranks", 1),
                "dtype": rec.get("precision"),
                "device": cfg.get("device"),
                "wall ms": rec["wall_s"] * 1e3,
                "CV": _cv(rec.get("wall_spread_s") or {}),
                "items/s": rec.get("throughput"),
                "relerr": rec["relerr"],
                "digest": rec.get("digest"),
                "check": "ok" if rec.get("check_passed") else "FAILED",
                "warnings": "; ".join(rec.get("warnings") or []),
            }
        )
    df = pd.DataFrame(rows)
    nodes = [nodes_of(r) for r in recs]
    if max(nodes) > 1:  # one config on 1 and on 2 nodes: two rows, told apart
        df.insert(3, "nodes", nodes)
    serial = df.loc[df["strategy"].isin(roles.reference), "wall ms"]
    base = serial.iloc[-1] if len(serial) else df["wall ms"].max()
    df.insert(df.columns.get_loc("CV") + 2, "speedup", base / df["wall ms"])
    df["warnings"] = [
        "; ".join(x for x in pair if x) for pair in zip(_superlinear(df, roles), df["warnings"])
    ]
    fmts = {"wall ms": ".2f", "CV": ".1%", "items/s": ".1f", "speedup": lambda v: f"{v:.1f}x",
            "relerr": ".1e"}  # fmt: skip
    bad = {
        "check": lambda v: "good" if v == "ok" else "bad",
        "warnings": lambda v: "warn" if v else "",
    }
    return html.table(df, fmts, classes=bad, text_cols={"digest"} | text_columns(df))


def _superlinear(df: pd.DataFrame, roles: StrategyRoles) -> list[str]:
    """Per row: a note when N ranks ran more than SUPERLINEAR x N faster than the table's
    torch `local` run of the same dtype and device. On a busy host N ranks get N shares of
    the CPUs against local's one (seen: `ddp --ranks 2` 58x `local`; the demo beside two
    busy processes per core: mpi x2 4.5x local, each row warned only 'host busy')."""
    keys = list(zip(df["dtype"], df["device"]))
    base = {
        k: wall
        for k, wall, strategy, n in zip(keys, df["wall ms"], df["strategy"], df["ranks"])
        if strategy in roles.plain_local and n == 1
    }
    out = []
    for k, wall, n in zip(keys, df["wall ms"], df["ranks"]):
        x = base[k] / wall if k in base and n > 1 else 0.0
        out.append(f"superlinear: {n} ranks {x:.1f}x local (over {SUPERLINEAR:g} x ranks: "
                   "the ranks got more of the CPUs than local did; a busy host?)"
                   if x > SUPERLINEAR * n else "")  # fmt: skip
    return out


def text_columns(df: pd.DataFrame) -> set[str]:
    return {c for c in df.columns if not pd.api.types.is_numeric_dtype(df[c])}
