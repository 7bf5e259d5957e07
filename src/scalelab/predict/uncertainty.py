"""How far to trust a prediction: a band from the validation errors of its strategy family,
and what it extrapolates beyond.

`scalelab predict --validate RESULTS -o DIR` writes DIR/bands.json: per family (validate.family
of the strategy label: ddp, fsdp, mpi, mpi-gpu, nccl, pipeline, tensor) the points, their
leave-one-out MAPE and the worst. A prediction reads it (--bands FILE, default
scalelab-results/validate/bands.json when present) and says `+-X%` with where it came from;
a family never validated says so. The extrapolation notes compare the scenario with the
runs it was calibrated on: more ranks than any measured run of the family, a schedule none
of them ran, a link between nodes no run crossed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from scalelab.predict.calibration import Pool
from scalelab.predict.model_registry import modelled_by
from scalelab.predict.scenario import Scenario
from scalelab.strategies import STRATEGIES

DEFAULT_BANDS = Path("scalelab-results/validate/bands.json")


def write_bands(families, path: Path) -> None:
    """families: validate.Validation.families()'s table."""
    out = {}
    for row in families.to_dict("records"):
        if not math.isnan(row["loo_mape_pct"]):
            out[row["family"]] = {
                "points": int(row["held_out"]),
                "loo_mape_pct": round(float(row["loo_mape_pct"]), 2),
                "worst_loo_pct": round(float(row["worst_loo_pct"]), 2),
            }
    path.write_text(json.dumps(out, indent=1) + "\n")


def band_note(family: str, path: str | None) -> str | None:
    """`uncertainty: +-12.5% (...)`, or None when no bands file is given or found."""
    where = Path(path) if path else DEFAULT_BANDS
    if not where.is_file():
        return None if path is None else f"uncertainty: no bands file at {where}"
    bands = json.loads(where.read_text())
    b = bands.get(family)
    if b is None:
        return f"uncertainty: unknown ({family} predictions were never validated in {where})"
    return (
        f"uncertainty: +-{b['loo_mape_pct']:.0f}% (the held-out MAPE of {family} predictions "
        f"over {b['points']} measured points, worst {b['worst_loo_pct']:.0f}%; {where})"
    )


def extrapolations(pool: Pool, s: Scenario, ranks: list[int]) -> list[str]:
    """What the predictions at `ranks` reach beyond the family's measured runs in the pool."""
    fam, strategy = s.family(), s.cfg.strategy
    runs = [m.scenario for m in pool.multis if m.scenario.family() == fam]
    runs += [Scenario(p.cfg, 1, 1) for p in pool.singles if p.family == fam and p.cfg]
    mine = [r for r in runs if modelled_by(r.cfg.strategy) == modelled_by(strategy)]
    out = []
    most = max((r.ranks for r in mine), default=0)
    beyond = [n for n in ranks if n > max(most, 1)]
    if beyond:
        seen = f"the most in a measured {strategy} run of this family: {most}" if most else (
            f"no measured {strategy} run of this family")  # fmt: skip
        out.append(f"extrapolates to {', '.join(map(str, beyond))} ranks ({seen})")
    schedules = {r.cfg.schedule for r in mine}
    if STRATEGIES.get(strategy).pipelined and s.cfg.schedule not in schedules:
        out.append(f"extrapolates to --schedule {s.cfg.schedule} (no measured run of it)")
    if any(s.at(n).nodes > 1 for n in ranks):
        out.append("extrapolates to a link between nodes (the network profile; no run here "
                   "crossed one)")  # fmt: skip
    return out
