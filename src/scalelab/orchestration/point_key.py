"""A point's identity as text, torch-free: a stopped Slurm job compares records with its point
in the seconds before SIGKILL, without importing RunConfig (and torch) to do it."""

from __future__ import annotations

import json
from typing import Any


def key_of(config: dict[str, Any], defaults: dict[str, Any]) -> str:
    """config's value (else the default) of each field in defaults, as sorted JSON: fields a
    record predates take their defaults, fields outside defaults do not count."""
    full = {name: config.get(name, default) for name, default in defaults.items()}
    return json.dumps(full, sort_keys=True, default=str)
