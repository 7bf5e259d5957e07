"""The report's plan section: every `scalelab plan` summary (plan.json, recognised by its
schema) under the results path: the ranked candidates and, where the plan was verified,
predicted against measured and the regret of the choice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from scalelab.analysis import html

SCHEMA = "scalelab.plan/1"
RANKED = ["rank", "candidate", "ms", "throughput", "efficiency", "mem_MiB", "bottleneck", "basis"]
VERIFIED = ["role", "candidate", "predicted", "measured", "low", "high", "runs", "error_pct"]


def plans_under(results: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    root = Path(results)
    files = sorted(root.rglob("*.json")) if root.is_dir() else []
    found = []
    for f in files:
        try:
            obj = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict) and obj.get("schema") == SCHEMA:
            found.append((f, obj))
    return found


def plan_sections(results: str | Path) -> list[tuple[str, str, str]]:
    """One "Plan" section when the results hold plan summaries, else none."""
    plans = plans_under(results)
    if not plans:
        return []
    return [("plan", "Plan: the fastest configuration, predicted then measured",
             "".join(_one(path, plan) for path, plan in plans))]  # fmt: skip


def _one(path: Path, plan: dict[str, Any]) -> str:
    base = plan["spec"]["base"]
    head = (
        f"{path}: {base['workload']} {'training' if base['train'] else 'inference'} on "
        f"{base['device']}, up to {plan['spec']['ranks_max']} ranks; ceilings {plan['ceilings']}"
    )
    ranked = pd.DataFrame(plan["rows"])
    ranked = ranked[ranked["status"] == "ok"][[c for c in RANKED if c in ranked]]
    fmt = {"ms": ".4g", "throughput": ".4g", "efficiency": ".3f", "mem_MiB": ".0f"}
    body = html.note(head) + html.table(ranked, fmt)
    verify = plan.get("verify")
    if verify:
        table = pd.DataFrame(verify["rows"])[VERIFIED]
        fmt = {c: ".4g" for c in ("predicted", "measured", "low", "high")}
        body += html.table(table, {**fmt, "error_pct": "+.1f"}) + html.note(
            f"chosen: {verify['chosen']}; best measured: {verify['best']}; "
            f"regret {100 * verify['regret']:.1f}% (paired within rounds)"
        )
    return body
