"""Analyses: pure functions over run records that return pandas DataFrames.

Nothing here touches a live run. `plots` is the only module that imports matplotlib, and no
other analysis module imports `plots`; `report` composes tables and plots into HTML.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from scalelab.errors import UsageError

EXTRA_HINT = "pip install 'scalelab[plot]'"


def require(module: str, purpose: str) -> ModuleType:
    """Import an optional dependency or fail with one line naming what needs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f"{purpose} needs {module} ({EXTRA_HINT})") from None


def require_plotting() -> None:
    """Fail early, before any analysis runs, when figures were asked for but cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            f"plots need matplotlib ({EXTRA_HINT}); pass --no-plots for tables only"
        ) from None


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Run records from a results file or folder; other scalelab files there (a ceilings.json
    beside the results) are passed over, and a path holding no run record is a UsageError."""
    from scalelab.record import SCHEMA, read_records

    records = read_records(path)
    family = SCHEMA.split("/")[0] + "/"
    runs = [r for r in records if str(r.get("schema", "")).startswith(family)]
    if not runs:
        schemas = ", ".join(sorted({str(r.get("schema")) for r in records}))
        raise UsageError(f"{path}: holds no run records (schema {schemas}; expected {SCHEMA})")
    return runs


def load_for_roofline(
    results: str | Path, ceilings_path: str | None, plots: bool
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """What `roofline` and `report` start from: checked dependencies, the run records, and
    the ceilings (warning on stderr when they were measured on another machine)."""
    import sys

    from scalelab.analysis.roofline import ceilings_for

    require("pandas", "the analysis")
    if plots:
        require_plotting()
    records = load_records(results)
    ceilings, warning = ceilings_for(results, ceilings_path, records)
    if warning:
        sys.stderr.write(f"scalelab: warning: {warning}\n")
    return records, ceilings
