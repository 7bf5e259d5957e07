"""What a generated sbatch script asks about its point (`python -m scalelab.cli.slurm_point`):

    done ARGS...            exit 0 when the results file has an ok record of this point
    failed REASON ARGS...   append a failed record for it, unless this job already wrote one
    stopped NEAR ARGS...    the same for a job Slurm is stopping (its SIGTERM): why, from
                            scontrol (NEAR: non-empty when the early time warning came)

ARGS are the point's `scalelab` arguments (`run WORKLOAD ... --out RESULTS`), parsed by the
`run` command itself, so the config compared and recorded is the one the run would have.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from scalelab.comm import slurm
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.orchestration.sweep import job_nodes, same_point
from scalelab.record import append_record, failed_record, read_records
from scalelab.record_schema import FINISHED


def point_config(argv: list[str]) -> tuple[RunConfig, Path]:
    from scalelab.cli.main import build_parser
    from scalelab.cli.options import config_from_args

    args = build_parser().parse_args(argv)
    return config_from_args(args, workload=args.workload), Path(args.out)


def _records(results: Path) -> list[dict[str, Any]]:
    try:
        return read_records(results) if results.exists() else []
    except UsageError:
        return []


def is_done(cfg: RunConfig, results: Path) -> bool:
    """A finished record (ok or check-failed) of this point on this job's node count."""
    nodes = job_nodes()
    return any(r.get("status") in FINISHED and same_point(cfg, r, nodes) for r in _records(results))


def record_failure(cfg: RunConfig, results: Path, reason: str) -> bool:
    """Append the failed record unless a record of this point from this attempt of this job
    exists (the ranks recorded how it ended, or a watcher named a dead rank)."""
    job = os.environ.get("SLURM_JOB_ID")
    attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)  # a requeued job's next attempt
    for r in _records(results):
        got = r.get("slurm") or {}
        ours = job is not None and got.get("job_id") == job
        if ours and int(got.get("restart") or 0) == attempt and same_point(cfg, r):
            return False
    append_record(results, failed_record(cfg, reason, source="slurm"))
    return True


def main(argv: list[str]) -> int:
    if argv[:1] == ["done"]:
        cfg, results = point_config(argv[1:])
        return 0 if is_done(cfg, results) else 1
    if argv[:1] == ["failed"] and len(argv) > 2:
        cfg, results = point_config(argv[2:])
        record_failure(cfg, results, argv[1])
        return 0
    if argv[:1] == ["stopped"] and len(argv) > 2:
        cfg, results = point_config(argv[2:])
        job = os.environ.get("SLURM_JOB_ID", "")
        cause = slurm.stop_cause(slurm.job_info(job), near_limit=bool(argv[1]))
        record_failure(cfg, results, f"job {job} was stopped by Slurm ({cause})")
        return 0
    sys.stderr.write(
        "usage: python -m scalelab.cli.slurm_point done|failed REASON|stopped NEAR ARGS\n"
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
