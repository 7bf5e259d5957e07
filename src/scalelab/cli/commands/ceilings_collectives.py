"""`ceilings --comm-only`'s collectives and `ceilings --nccl-tests FILE...`: nccl-tests' algbw
and busbw per collective in ceilings.json's `collectives` section, keyed by where they came
from (the backend measured here, or "nccl-tests" for files read):

    "collectives": {"gloo": {"ranks": 2, "source": "scalelab", "ops": {name: [rows]}},
                    "nccl-tests": {"ranks": 8, "source": [files], "ops": {...}}}

rows: {bytes, time_s, algbw_Bps, busbw_Bps} (instrument/collective_bench.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from scalelab.errors import UsageError
from scalelab.instrument import ceilings as C
from scalelab.instrument.collective_bench import format_collectives, parse_nccl_tests


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nccl-tests",
        nargs="+",
        metavar="FILE",
        help="read these nccl-tests outputs (all_reduce_perf, ...) into the ceilings file's "
        "collectives instead of measuring",
    )


def file_comm(data: dict[str, Any], backend: str, result: dict[str, Any]) -> None:
    """A communication measurement into the ceilings data: alpha-beta under comm[backend],
    and a --comm-only run's collectives under collectives[backend]."""
    ops = result.pop("collectives", None)
    data.setdefault("comm", {})[backend] = result
    if ops is not None:
        entry = {"ranks": result["ranks"], "source": "scalelab", "ops": ops}
        data.setdefault("collectives", {})[backend] = entry


def print_collectives(data: dict[str, Any]) -> None:
    for key, entry in data.get("collectives", {}).items():
        print(format_collectives(entry["ops"], f"{key} x{entry['ranks']}"))


def read_nccl_tests(args: argparse.Namespace, kept: dict[str, Any]) -> dict[str, Any]:
    """The ceilings data with the files' collectives under "nccl-tests"; one line per bad file."""
    ops: dict[str, list[dict[str, float]]] = {}
    ranks = 0
    for name in args.nccl_tests:
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"--nccl-tests {path}: no such file")
        try:
            collective, n, rows = parse_nccl_tests(path.read_text(errors="replace"), path.stem)
        except ValueError as exc:
            raise UsageError(f"--nccl-tests {path}: not nccl-tests output ({exc})") from None
        ops[collective] = rows
        ranks = max(ranks, n)
    data = kept or C.new_ceilings(None)
    files = [str(f) for f in args.nccl_tests]
    data.setdefault("collectives", {})["nccl-tests"] = {"ranks": ranks, "source": files, "ops": ops}
    return data
