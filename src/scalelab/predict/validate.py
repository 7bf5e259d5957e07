"""Every measured point under a folder against the model: predicted vs measured time, the error
per point and the mean absolute percentage error, with the calibration points named.

Each results file is paired with the ceilings of its machine: --ceilings when given; else
the ceilings files measured on the same host (hosts.py: hostname, CPU count, GPU name and
count, as the records' `env` and the ceilings' `machine` give them), a full one first; sections
they lack, or every section when the host has no ceilings file, are taken from the other
ceilings in the nearest folder up (the name closest to the results file's first:
mpi_scaling_h200x2.jsonl -> ceilings_h200x2.json), and the files that borrowed another host's
figures are named with what they borrowed. A point is predicted
from the measurements of its own machine only; the one-rank points it is calibrated on (and
the multi-GPU run that sets DDP's host cost) match by construction and are marked: the
headline MAPE is over the points that calibrated nothing (the MAPE over all follows). Points
from runs whose records carry warnings are shown with them, or left out with drop_warned.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from pathlib import Path

import pandas as pd

from scalelab.errors import UsageError
from scalelab.predict.calibration import Pool
from scalelab.predict.figures import Figures
from scalelab.predict.frame import predict_one
from scalelab.predict.hosts import Host
from scalelab.predict.models import Context
from scalelab.predict.network import NetworkProfile
from scalelab.predict.points import Found, Measured, discover
from scalelab.strategies import STRATEGIES

LIMIT = 0.15  # the per-point bound predictions are held to: within 15 % of the measured time
# A point with no one-rank measurement of its configuration on its machine: its compute is the
# roofline's lower bound, not a calibrated prediction. Listed, but outside the MAPE and the
# 15% bound (deepstack's 64-channel convolutions run at a fraction of the bf16 peak).
UNCALIBRATED = "bound (no calibration)"


@dataclass
class Validation:
    table: pd.DataFrame
    skipped: dict[str, int]
    ceilings: dict[str, str]  # results file -> ceilings file used
    borrowed: dict[str, str] = field(default_factory=dict)  # results file -> another host's

    @property
    def scored(self) -> pd.DataFrame:
        """The points the model claims to predict (every one but the uncalibrated bounds)."""
        return self.table[self.table["role"] != UNCALIBRATED]

    def mape(self, predicted_only: bool = False) -> float:
        t = self.scored
        t = t[t["role"] == "predicted"] if predicted_only else t
        return float(t["error_pct"].abs().mean()) if len(t) else math.nan

    def held_out(self) -> pd.Series:
        """Every scored point's leave-one-out error (NaN where nothing else calibrates it)."""
        return self.scored["held_out_pct"].dropna()

    def families(self) -> pd.DataFrame:
        """Per strategy family: points, leave-one-out MAPE, in-sample MAPE, the worst."""
        t = self.scored.assign(family=self.scored["strategy"].map(family))
        rows = []
        for fam, g in t.groupby("family", sort=True):
            loo = g["held_out_pct"].dropna()
            rows.append({"family": fam, "points": len(g), "held_out": len(loo),
                         "loo_mape_pct": loo.abs().mean() if len(loo) else math.nan,
                         "in_sample_mape_pct": g["error_pct"].abs().mean(),
                         "worst_loo_pct": loo.abs().max() if len(loo) else math.nan})  # fmt: skip
        return pd.DataFrame(rows)

    def summary(self) -> str:
        """The last line, the headline first: the leave-one-out MAPE (each point predicted
        from calibration without it and its configuration), then the in-sample MAPE over
        every point (the calibration points nearly match by construction, so it flatters):
        `MAPE held out: 8.1% over 70 points (leave-one-out); in sample: 4.1% over 92; ...`."""
        loo, n = self.held_out(), len(self.scored)
        bounds = len(self.table) - n
        tail = f"; {bounds} uncalibrated bound(s) left out" if bounds else ""
        tail += f"; {n - len(loo)} with nothing else to calibrate them" if n > len(loo) else ""
        warned = int((self.scored["warnings"] != "").sum()) if "warnings" in self.table else 0
        tail += f"; {warned} point(s) from warned runs (--drop-warned)" if warned else ""
        return (
            f"MAPE held out: {loo.abs().mean():.1f}% over {len(loo)} points (leave-one-out); "
            f"in sample: {self.mape():.1f}% over {n}{tail}"
        )

    def outside(self) -> pd.DataFrame:
        t = self.scored
        return t[t["error_pct"].abs() > 100 * LIMIT]


def validate(
    root: str | Path,
    ceilings: str | None,
    network: NetworkProfile | None,
    drop_warned: bool = False,
    held_out: bool = True,
) -> Validation:
    """drop_warned: leave out the points whose runs carry warnings (oversubscribed, busy
    host, unstable timing); otherwise they are kept and their warnings shown. held_out:
    predict every calibration point again without it (leave-one-out; a third more time)."""
    root = Path(root)
    if not root.exists():
        raise UsageError(f"{root}: no such results file or folder")
    found = discover(root)
    _count_once(found)
    if drop_warned:
        kept = [p for p in found.points if not p.warnings]
        dropped = len(found.points) - len(kept)
        if dropped:
            found.skipped["points from warned runs (--drop-warned)"] += dropped
        found.points = kept
    if not found.points:
        raise UsageError(
            f"{root}: no measured point the model covers (skipped: {dict(found.skipped)})"
        )
    explicit = _explicit(ceilings)
    origins = dict.fromkeys(p.origin for p in found.points)  # each file once, in order
    pairs = {origin: explicit or _pair(origin, found) for origin in origins}
    rows = []
    for origin, (cpath, cdata) in sorted(pairs.items()):
        pool = _pool(found, pairs, cpath)
        pool.prefer = found.labels[origin]  # a file's own runs calibrate it first
        ctx = Context(Figures(cdata, str(cpath)), network, pool)
        for point in (p for p in found.points if p.origin == origin):
            row, why = _row(ctx, point)
            if row is None:
                found.skipped[why] += 1
            else:
                loo = _held_out(ctx, point, row) if held_out else math.nan
                rows.append({**row, "held_out_pct": loo})
    if not rows:
        raise UsageError(f"{root}: no point could be predicted ({dict(found.skipped)})")
    _some_held_out(root, rows)
    used = {str(o.name): _named(c, d) for o, (c, d) in pairs.items()}
    borrowed = {o.name: d["_borrowed"] for o, (_, d) in pairs.items() if d.get("_borrowed")}
    return Validation(pd.DataFrame(rows), dict(found.skipped), used, borrowed)


def _count_once(found: Found) -> None:
    """Each measurement one point: a record copied into several results files (a calibration
    run filed beside each study that used it) is scored where it is first found (files in
    path order); its copies still calibrate, as every file's runs do."""
    seen: set[tuple] = set()
    kept = []
    for point in found.points:
        if point.key and point.key in seen:
            found.skipped["copies of a measurement counted once (the same record elsewhere)"] += 1
            continue
        seen.add(point.key)
        kept.append(point)
    found.points = kept


def _some_held_out(root: Path, rows: list[dict]) -> None:
    """A validation needs a point the model predicts without having been fitted to it: with
    none (every point calibrated it, or has no one-rank run to calibrate from), the MAPE would
    be over nothing."""
    if any(r["role"] == "predicted" for r in rows):
        return
    roles = ", ".join(f"{n} {role}" for role, n in sorted(Counter(r["role"] for r in rows).items()))
    raise UsageError(
        f"{root}: nothing to validate: no point the model did not calibrate from ({roles}); "
        "add runs at more ranks than the one-rank runs of the same configuration"
    )


def _explicit(path: str | None):
    if path is None:
        return None
    from scalelab.instrument.ceilings import read_ceilings

    return Path(path), read_ceilings(path)


def _pair(origin: Path, found: Found) -> tuple[Path, dict]:
    """The ceilings of origin's machine: its own host's files (a full one first, measured on
    the GPU where origin's runs used one), then the
    other ceilings in the nearest folder up from it, the name closest to origin's first; each
    later file fills the sections the earlier ones lack (a `--comm-only` file beside a full
    one). What came from another host's file is noted under "_borrowed"."""
    if not found.ceilings:
        raise UsageError(
            f"no ceilings file for {origin.name}: give --ceilings or put the machine's "
            "ceilings.json (from `scalelab ceilings`) in the folder"
        )
    host = found.hosts.get(origin, Host())
    by_name = lambda c: (-SequenceMatcher(None, c.stem, origin.stem).ratio(), str(c))  # noqa: E731
    # A file of GPU runs takes a file measured on its GPU first (one measured on the host's
    # CPU holds no cuda GEMM or memory figure): that one also holds the host's CPU figures.
    gpu = any(p.scenario.cfg.device == "cuda" for p in found.points if p.origin == origin)
    off_device = lambda c: gpu and found.ceilings[c].get("device") == "cpu"  # noqa: E731
    own = [c for c in found.ceilings if host.same(Host.of_ceilings(found.ceilings[c]))]
    own.sort(key=lambda c: ("gemm_flops" not in found.ceilings[c], by_name(c)))
    near = _nearest(origin, list(found.ceilings))
    files = own + sorted((c for c in near if c not in own), key=by_name)
    files.sort(key=off_device)  # a CPU-measured file last, even where it is the host's own
    first = found.ceilings[files[0]]
    merged = {**first, "comm": dict(first.get("comm") or {})}
    taken = {files[0]: ["all sections"]} if files[0] not in own else {}
    for other in files[1:]:
        added = _fill(merged, found.ceilings[other])
        if added:
            merged.setdefault("_filled_from", []).append(other.name)
            if other not in own:
                taken[other] = added
    if taken and host.known:
        merged["_borrowed"] = _borrowing(host, taken, found)
    return files[0], merged


def _borrowing(host: Host, taken: dict[Path, list[str]], found: Found) -> str:
    """`ran on (vm, 64 cpus, 4x NVIDIA H200); took cpu_gemm_flops, comm.mpi from x.json (...)`."""
    parts = [
        f"{', '.join(keys)} from {c.name} ({Host.of_ceilings(found.ceilings[c]).describe()})"
        for c, keys in taken.items()
    ]
    return f"ran on ({host.describe()}); took " + "; ".join(parts)


def _nearest(origin: Path, files: list[Path]) -> list[Path]:
    for folder in origin.parents:
        here = [c for c in files if c.parent == folder]
        if here:
            return here
    return files


BOOKKEEPING = frozenset({"schema", "machine", "quick", "notes", "device", "mem_bw_detail", "peaks"})
# How a host's processes slow each other is that host's alone (cores, memory channels,
# neighbours on a shared machine): never taken from another host's file, so a host without
# the curve is predicted with its stated no-contention assumption instead.
HOST_ONLY = frozenset({"cpu_concurrency"})


def _fill(into: dict, other: dict) -> list[str]:
    """Copy the sections `into` lacks from `other`; the figures copied (bookkeeping keys that
    come along are not listed)."""
    added = []
    for key, value in other.items():
        if key == "comm":
            for backend, fit in (value or {}).items():
                if backend not in into["comm"]:
                    into["comm"][backend] = fit
                    added.append(f"comm.{backend}")
        elif key not in into and key not in HOST_ONLY:
            into[key] = value
            added += [] if key in BOOKKEEPING else [key]
    return added


def _named(path: Path, data: dict) -> str:
    extra = data.get("_filled_from")
    return path.name + (f" (+ {', '.join(extra)})" if extra else "")


def _pool(found: Found, pairs: dict, cpath: Path) -> Pool:
    """Every file's measurements that were made on the same machine (same ceilings)."""
    pool = Pool()
    for origin, (c, _) in pairs.items():
        if c == cpath and origin in found.pools:
            pool.extend(found.pools[origin])
    return pool


def _row(ctx: Context, point: Measured) -> tuple[dict | None, str]:
    """(the table row, "") or (None, why the point was passed over)."""
    try:
        pred = predict_one(ctx, point.scenario)
    except UsageError as exc:
        return None, f"points that cannot be predicted: {exc}"
    if pred.feasible is not None:
        return None, f"points the model calls not runnable: {pred.feasible}"
    s, cfg = point.scenario, point.scenario.cfg
    role = pred.calibration.get(point.source)
    if role:
        label = f"calibration ({role})"
    elif "compute" in pred.calibration.values():
        label = "predicted"
    else:
        label = UNCALIBRATED
    row = {
        "source": point.source,
        "workload": cfg.workload,
        "strategy": strategy_label(cfg),
        "ranks": s.ranks,
        "rank_batch": int(s.rank_batch) if float(s.rank_batch).is_integer() else s.rank_batch,
        "measured_ms": point.seconds * 1e3,
        "predicted_ms": pred.seconds * 1e3,
        "error_pct": 100 * (pred.seconds / point.seconds - 1),
        "role": label,
        "warnings": "; ".join(point.warnings),
    }
    return row, ""


def _held_out(ctx: Context, point: Measured, row: dict) -> float:
    """The point's error predicted from calibration without it and its configuration (every
    run of the same configuration and rank count, whichever file holds it: the committed
    results copy calibration runs between folders); NaN when nothing else calibrates it.
    A point that calibrated nothing is already held out."""
    if row["role"] == "predicted":
        return row["error_pct"]
    if row["role"] == UNCALIBRATED:
        return math.nan
    pool = ctx.pool
    same = lambda s: s.ranks == point.scenario.ranks and s.cfg == point.scenario.cfg  # noqa: E731
    singles = [p for p in pool.singles if p.source != point.source
               and not (p.cfg is not None and point.scenario.ranks == 1
                        and p.cfg == point.scenario.cfg)]  # fmt: skip
    multis = [m for m in pool.multis if m.source != point.source and not same(m.scenario)]
    held = Context(ctx.figures, ctx.network, Pool(singles, multis, pool.prefer))
    try:
        pred = predict_one(held, point.scenario)
    except UsageError:
        return math.nan
    if pred.feasible is not None or "compute" not in pred.calibration.values():
        return math.nan
    return 100 * (pred.seconds / point.seconds - 1)


def family(label: str) -> str:
    """A strategy label's family row: `mpi --split batch` -> `mpi`, `nccl ...` -> `nccl`."""
    return label.split(" --")[0]


def strategy_label(cfg) -> str:
    label = cfg.strategy
    if STRATEGIES.get(cfg.strategy).takes_split:
        label += f" --split {cfg.split}" + (" --overlap" if cfg.overlap else "")
    return label
