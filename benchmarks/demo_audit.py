"""Figures the demo prints side by side that could contradict each other, checked on what
`scalelab demo` wrote.

`audit(out_dir)` reads OUT/runs.jsonl, OUT/ceilings.json, OUT/report/index.html (and
OUT/demo.log when the run kept one) and returns one row per item: {item, status, evidence},
status one of ABSENT, FLAGGED, UNFLAGGED, NA. Each check finds the contradiction itself
(from the records' numbers) and then looks for the flag where the figure is printed: the
layer table's `flag`, the per-layer roofline's `flag` and roofline.flag_lines, the system
points' `flag`, the ceilings file's `warnings`, the records' `warnings`, the report's text.
"""

from __future__ import annotations

import html as stdhtml
import json
import re
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from scalelab.analysis import layers, roofline, scaling
from scalelab.analysis import system_roofline as sysroof
from scalelab.analysis.frame import ok_records, per_iteration
from scalelab.analysis.html import esc
from scalelab.instrument import ceiling_checks

ABSENT, FLAGGED, UNFLAGGED, NA = "absent", "flagged", "CONTRADICTION UNFLAGGED", "n/a"
SAME_SHAPE = 3.0  # seen: c3 and c5 of one shape, 67.8 vs 1.08 ms
SUPERLINEAR = 1.5  # a speedup above 1.5x the rank count: threads or load, not the ranks
STARTUP = 2.0  # a step time over 2x the steady step: start-up charged to the steps
MOVED = 0.10  # predict vs a measurement of its own configuration (crosscheck.AGREE)


def row(item: str, status: str, evidence: str) -> dict[str, str]:
    return {"item": item, "status": status, "evidence": evidence}


def verdict(found: list[str], unflagged: list[str]) -> str:
    return UNFLAGGED if unflagged else FLAGGED if found else ABSENT


class Tables(HTMLParser):
    """Every <table> of the page as (header, rows of cell texts), with the section it is in."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[str, list[str], list[list[str]]]] = []
        self.section, self.cell, self.row = "", None, None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "section":
            self.section = dict(attrs).get("id", "")
        elif tag == "table":
            self.tables.append((self.section, [], []))
        elif tag == "tr":
            self.row = []
        elif tag in ("td", "th"):
            self.cell = ""

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell += data

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self.row is not None:
            self.row.append((self.cell or "").strip())
            self.cell = None
        elif tag == "tr" and self.tables and self.row is not None:
            _, head, rows = self.tables[-1]
            if head:
                rows.append(self.row)
            else:
                head.extend(self.row)
            self.row = None


def page_tables(page: str) -> list[tuple[str, list[str], list[list[str]]]]:
    parser = Tables()
    parser.feed(page)
    return parser.tables


def shown(page: str, text: str) -> bool:
    return esc(text) in page or text in stdhtml.unescape(page)


# --- 1. threads ----------------------------------------------------------------------------
def check_threads(records: list[dict[str, Any]], page: str | None) -> dict[str, str]:
    """Every CPU run says how many threads it took and why; threads x ranks on the host fit
    its CPUs or the run is warned; a superlinear speedup is on warned runs only."""
    bad, kinds, worst = [], {}, 0.0
    for rec in ok_records(records):
        if (rec.get("config") or {}).get("device", "cpu") != "cpu":
            continue
        t, host = rec.get("threads") or {}, rec.get("host") or {}
        kinds[t.get("source")] = kinds.get(t.get("source"), 0) + 1
        if not t.get("why") or t.get("source") not in ("chosen", "--threads"):
            bad.append(f"{rec['id']}: threads {t or 'not recorded'}")
            continue
        need = int(t["threads"]) * int(host.get("ranks_here") or rec.get("ranks") or 1)
        cpus = float(host.get("allowed_cpus") or host.get("cpus") or 1)
        worst = max(worst, need / cpus)
        if need > cpus and not _warned(rec, "oversub"):
            bad.append(f"{rec['id']}: {need} threads on {cpus:g} CPUs, no warning")
    over = _superlinear(records, page)
    bad += [o for o in over if "unwarned" in o or "unflagged" in o]
    rest = "; ".join(b for b in bad if b not in over)
    evidence = (f"threads source {kinds}; most threads x ranks / CPUs {worst:.2f}; "
                f"superlinear speedups: {over or 'none'}; {rest}")  # fmt: skip
    return row("1 threads chosen and said why", verdict(over, bad), evidence)


def _warned(rec: dict[str, Any], word: str = "") -> bool:
    return any(word in w for w in rec.get("warnings") or [])


def _superlinear(records: list[dict[str, Any]], page: str | None) -> list[str]:
    """Scaling points faster than SUPERLINEAR x linear, and whether their runs (the N-rank
    and the baseline's) carry warnings."""
    table = scaling.scaling_table(records, None)
    fams = scaling.families(records)
    out = []
    for r in table.itertuples():
        if r.ranks > 1 and r.efficiency > SUPERLINEAR:
            base = table[(table.family == r.family) & (table.series == r.series)].ranks.min()
            recs = [x for x in fams[r.family] if x.get("ranks", 1) in (r.ranks, base)]
            how = "warned" if all(_warned(x) for x in recs) else "unwarned"
            out.append(f"{r.family} {r.series} x{r.ranks}: E={r.efficiency:.2f} ({how})")
    return out + _superlinear_versions(records, page)


def _superlinear_versions(records: list[dict[str, Any]], page: str | None) -> list[str]:
    """The same inside one `versions` table: an N-rank strategy more than SUPERLINEAR x N
    faster than the torch `local` run of the same dtype (seen: ddp x2 58x local)."""
    out = []
    for vid in {r.get("versions") for r in records if r.get("versions")}:
        group = [r for r in ok_records(records) if r.get("versions") == vid]
        local = {r.get("precision"): r for r in group if r.get("strategy") == "local"}
        for r in group:
            base = local.get(r.get("precision"))
            n = int(r.get("ranks") or 1)
            if base is None or n < 2 or base["wall_s"] <= SUPERLINEAR * n * r["wall_s"]:
                continue
            flag = f"superlinear: {n} ranks"  # the versions table's own flag (report)
            how = "flagged" if page is None or shown(page, flag) else "unflagged"
            x = base["wall_s"] / r["wall_s"]
            out.append(f"versions {r['strategy']} x{n}: {x:.2f}x local ({how})")
    return out


# --- 2. per-layer times --------------------------------------------------------------------
def check_layers(records, ceilings, page) -> dict[str, str]:
    table = layers.layer_table(records)
    if table.empty:
        return row("2 per-layer sum vs wall, same shape", NA, "no --per-layer run")
    rest = table[table["layer"] == layers.REST]
    found, bad = [], []
    for r in rest.itertuples():
        if r.ms < 0:
            what = f"{r.run}: layers exceed the wall by {-r.ms:.3g} ms"
            (found if r.flag else bad).append(what + (f" [{r.flag}]" if r.flag else ""))
    ev = [f"(wall - layers) {', '.join(f'{v:.3g}' for v in rest['ms'])} ms", *found]
    if ceilings is not None:
        df = roofline.layer_roofline(records, ceilings)
        pairs = _same_shape_pairs(df)
        named = [f"{df.at[a, 'layer']}/{df.at[b, 'layer']} {x:.3g}x" for _, a, b, x in pairs]
        ev.append(f"same-shape layers (slowest/fastest): {', '.join(named) or 'none'}")
        for _, a, b, ratio in pairs:
            if ratio <= SAME_SHAPE:
                continue
            flagged = all("(same shape)" in df.at[i, "flag"] for i in (a, b))
            lines = [x for x in roofline.flag_lines(df) if "same shape" in x]
            on_page = page is None or all(shown(page, x) for x in lines)
            what = f"{df.at[a, 'layer']} vs {df.at[b, 'layer']} {ratio:.3g}x"
            (found if flagged and lines and on_page else bad).append(what)
    return row("2 per-layer sum vs wall, same shape", verdict(found, bad), "; ".join(ev + bad))


def _same_shape_pairs(df) -> list[tuple[str, int, int, float]]:
    """(run, slowest index, fastest index, ratio) per group of one kind, FLOPs and bytes
    within 5%: found here, not by same_shape_flags, so a broken flag cannot hide one."""
    out = []
    for (run, _, _), g in df.groupby(["run", "kind", "flops"], sort=False):
        if len(g) < 2 or g["bytes"].max() > 1.05 * g["bytes"].min():
            continue
        slow, fast = g["seconds"].idxmax(), g["seconds"].idxmin()
        ratio = float(df.at[slow, "seconds"] / df.at[fast, "seconds"])
        out.append((run, int(slow), int(fast), ratio))
    return out


# --- 3. roofline points --------------------------------------------------------------------
def check_roofline(records, ceilings, page) -> dict[str, str]:
    found, bad, ev = [], [], []
    if ceilings is not None and roofline.layer_records(records):
        df = roofline.layer_roofline(records, ceilings)
        over = df[df["fraction"] > 1.0]
        ev.append(f"layers: max fraction of roof {df['fraction'].max():.3g}")
        for r in over.itertuples():
            ok = roofline.UNDER_MEASURED in r.flag
            (found if ok else bad).append(f"layer {r.layer} at {r.fraction:.3g} of its roof")
        if len(over) and not any(shown(page or "", x) for x in roofline.flag_lines(df)):
            bad.append("per-layer flag line missing from the report")
    if sysroof.training_runs(records):
        pts = sysroof.system_points(records, sysroof.estimate_peaks(records))
        top = pts[["measured", "measured_phases"]].max(axis=1) / pts["model"]
        ev.append(f"system: measured/model {', '.join(f'{v:.3g}' for v in top)}")
        for (_, p), ratio in zip(pts.iterrows(), top):
            if ratio > 1 + sysroof.ABOVE_SLACK:
                what = f"H={p['hidden']} B={p['batch']} at {ratio:.3g}x the model"
                ok = bool(p["flag"]) and (page is None or shown(page, p["flag"]))
                (found if ok else bad).append(what)
    if not ev:
        return row("3 roofline points above roof/model", NA, "no per-layer or training runs")
    flagged = [f + " (flagged)" for f in found]
    return row("3 roofline points above roof/model", verdict(found, bad),
               "; ".join(ev + flagged + bad))  # fmt: skip


# --- 4. start-up and rank skew -------------------------------------------------------------
def check_skew(records: list[dict[str, Any]]) -> dict[str, str]:
    found, bad, ev = [], [], []
    for rec in ok_records(records):
        walls = [w for w in rec.get("rank_walls_s") or rec.get("rank_wall_s") or [] if w]
        if walls and max(walls) > rec["wall_s"] * 1.25 and max(walls) - rec["wall_s"] > 0.002:
            what = f"{rec['id']}: rank wall {max(walls):.3g} s vs run's {rec['wall_s']:.3g} s"
            (found if _warned(rec, "rank skew") else bad).append(what)
        if rec.get("mode") == "train" and rec.get("steady_throughput"):
            items, step = per_iteration(rec)
            steady = items / rec["steady_throughput"]
            ev.append(f"{rec['workload']} x{rec.get('ranks', 1)} step/steady {step / steady:.2f}")
            if step > STARTUP * steady:
                what = f"{rec['id']}: step {step * 1e3:.3g} ms vs steady {steady * 1e3:.3g} ms"
                (found if rec.get("warnings") else bad).append(what)
    status = verdict(found, bad)
    return row("4 start-up/rank skew", status, "; ".join(ev + found + bad) or "none")


# --- 5. units ------------------------------------------------------------------------------
def check_units(records: list[dict[str, Any]], page: str | None) -> dict[str, str]:
    if page is None:
        return row("5 one unit per column, no CV for n=1", UNFLAGGED, "no report written")
    bad, ev = [], []
    for section, head, rows in page_tables(page):
        if "IQR ms" in head:
            bad.append(f"{section}: 'IQR ms' beside ms/iter")
        if "CV" in head:
            i = head.index("CV")
            shown_cv = sum(bool(r[i]) for r in rows if len(r) > i)
            ev.append(f"{section}: CV shown in {shown_cv} of {len(rows)} rows")
            if section == "runs":
                spread = [(r.get("wall_spread_s") or {}).get("n") or 0 for r in records]
                n2 = sum(n >= 2 for n in spread)
                if shown_cv > n2:
                    bad.append(f"runs: CV shown in {shown_cv} rows, {n2} runs have n >= 2")
    return row("5 one unit per column, no CV for n=1", UNFLAGGED if bad else ABSENT,
               "; ".join(ev + bad))  # fmt: skip


# --- 6. ceilings ---------------------------------------------------------------------------
def check_ceilings(ceilings: dict[str, Any] | None, page: str | None) -> dict[str, str]:
    if ceilings is None:
        return row("6 ceilings agree, unstable flagged", NA, "no ceilings.json")
    warnings = ceilings.get("warnings") or []
    found, bad = [], []
    for _, why in ceiling_checks.violations(ceilings):
        (found if any(why in w for w in warnings) else bad).append(why)
    for what, rate, spread in _spreads(ceilings):
        if spread > ceiling_checks.UNSTABLE:
            named = any(w.startswith(f"unstable ceiling: {what}") for w in warnings)
            (found if named else bad).append(f"{what} {rate:.3g} spread {spread:.0%}")
    for m in ceilings.get("moved") or []:  # against the file it replaced (a demo re-run)
        named = any(w.startswith(f"ceiling moved: {m['what']}") for w in warnings)
        (found if named else bad).append(
            f"{m['what']} moved {m['ratio']:.3g}x since {m['old_date']}"
        )
    for w in warnings:
        if page is not None and not shown(page, w):
            bad.append(f"warning not on the report: {w[:60]}")
    gemm = {k: f"{v:.3g}" for k, v in (ceilings.get("gemm_flops") or {}).items() if k != "detail"}
    ev = f"GEMM {gemm}; copy {ceilings.get('mem_bw', float('nan')):.3g} B/s; {len(warnings)} " \
         f"warning(s); " + "; ".join(found + bad)  # fmt: skip
    return row("6 ceilings agree, unstable flagged", verdict(found, bad), ev)


def _spreads(c: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(name, published figure, its best block's spread) for the GEMMs and the copy."""
    out = []
    for name, rows in ((c.get("gemm_flops") or {}).get("detail") or {}).items():
        rows = [r for r in rows if isinstance(r, dict) and "flops" in r]
        if rows:
            best = max(rows, key=lambda r: r["flops"])
            out.append((f"{name} GEMM", best["flops"], best.get("spread", 0.0)))
    rows = [r for r in c.get("mem_bw_detail") or [] if isinstance(r, dict) and "Bps" in r]
    if rows:
        best = max(rows, key=lambda r: r["Bps"])
        out.append(("memory copy", best["Bps"], best.get("spread", 0.0)))
    return out


# --- 7. predict ----------------------------------------------------------------------------
def check_predict(out: Path, records: list[dict[str, Any]]) -> dict[str, str]:
    """`predict --calibrate` on the demo's records for the demo's mpi-dp training family:
    names its runs, marks warned ones, and agrees with (or flags against) the measured
    2-rank run. The demo's report has no predict section: this is what a user does next."""
    train = [
        r
        for r in ok_records(records)
        if r.get("mode") == "train"
        and r.get("strategy") == "mpi-dp"
        and (r.get("config") or {}).get("hidden") == 128
    ]
    if not train:
        return row("7 predict names/prefers/flags", NA, "no mpi-dp training run")
    cfg = train[0]["config"]
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "scalelab", "predict", "mlp", "--strategy", "mpi-dp",
                "--train", "--ranks", "1,2", "--hidden", "128", "--batch", str(cfg["batch"]),
                "--threads", "1", "--device", "cpu", "--calibrate", str(out / "runs.jsonl"),
                "--ceilings", str(out / "ceilings.json"), "-o", tmp, "--no-plots"]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True)
        files = {p.name: p.read_text() for p in Path(tmp).glob("predict.*")}
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return row("7 predict names/prefers/flags", UNFLAGGED, f"predict failed: {text[-300:]}")
    return _predict_verdict(text, files, records, train)


def _predict_verdict(text: str, files: dict[str, str], records, train) -> dict[str, str]:
    found, bad, ev = [], [], []
    named = re.search(r"calibrated on: [^\n]*", text)
    ev.append(named.group(0)[:160] if named else "no 'calibrated on' line")
    if not named:
        bad.append("calibration runs not named")
    else:
        bad += _prefers_unwarned(named.group(0), records, train)
    for r in json.loads(files.get("predict.json", "{}")).get("rows", []):
        measured, ms = r.get("measured_ms"), r.get("ms")
        if not measured or not ms:
            continue
        what = f"x{r.get('ranks')}: predicted {ms:.4g} ms, measured {measured:.4g}"
        ev.append(what + (f" [{r['flag']}]" if r.get("flag") else ""))
        if abs(ms / measured - 1) > MOVED:
            (found if r.get("flag") else bad).append(what + ", no flag" * (not r.get("flag")))
    return row("7 predict names/prefers/flags", verdict(found, bad), "; ".join(ev + bad))


def _prefers_unwarned(line: str, records, train) -> list[str]:
    """A warned calibration run while an unwarned one of the same configuration was there,
    or a warned one not marked WARNED (runs.jsonl:N is the N-th of `records`)."""
    lines = dict(enumerate(records, start=1))
    out = []
    for part in re.finditer(r"runs\.jsonl:(\d+) \(([^)]*)\)?", line):
        rec = lines.get(int(part.group(1)))
        if rec is None or not rec.get("warnings"):
            continue
        if "WARNED" not in part.group(2):
            out.append(f"runs.jsonl:{part.group(1)} is warned, not marked WARNED")
        twins = [
            r
            for r in train
            if not r.get("warnings")
            and r["ranks"] == rec["ranks"]
            and r["config"].get("batch") == rec["config"].get("batch")
        ]
        if twins:
            out.append(
                f"calibrated on warned runs.jsonl:{part.group(1)} beside unwarned {twins[0]['id']}"
            )
    return out


# --- 8, 9 ----------------------------------------------------------------------------------
def check_attention(records: list[dict[str, Any]]) -> dict[str, str]:
    names = sorted({r.get("workload") for r in records})
    attn = [n for n in names if n and ("transformer" in n or "attn" in n or "gpt" in n)]
    status = NA if not attn else UNFLAGGED
    why = f"demo workloads {names}: no attention model" if not attn else f"unchecked: {attn}"
    return row("8 attention FLOPs", status, why)


def check_nan(page: str | None, log: str | None) -> dict[str, str]:
    """No 'nan' printed as a number on the page or in the demo's output (seen: fit's
    'fits, nan ms'); base64 figures are left out."""
    text = re.sub(r'src="data:[^"]*"', "", page or "") + "\n" + (log or "")
    text = re.sub(r"<[^>]+>", " ", text)
    hits = [m.group(0) for m in re.finditer(r".{0,40}\bnan\b.{0,20}", text, re.I)]
    return row(
        "9 nan printed",
        UNFLAGGED if hits else ABSENT,
        f"{len(hits)} 'nan' printed: {hits[:3]}" if hits else "no 'nan' on the page or log",
    )


def audit(out: Path) -> list[dict[str, str]]:
    out = Path(out)
    records = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines() if x.strip()]
    cpath, ppath, lpath = out / "ceilings.json", out / "report" / "index.html", out / "demo.log"
    ceilings = roofline.read_ceilings(cpath) if cpath.exists() else None
    page = ppath.read_text() if ppath.exists() else None
    log = lpath.read_text(errors="replace") if lpath.exists() else None
    return [
        check_threads(records, page),
        check_layers(records, ceilings, page),
        check_roofline(records, ceilings, page),
        check_skew(records),
        check_units(records, page),
        check_ceilings(ceilings, page),
        check_predict(out, records),
        check_attention(records),
        check_nan(page, log),
    ]
