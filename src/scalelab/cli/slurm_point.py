"""What a generated sbatch script asks about its point (`python -m scalelab.cli.slurm_point`):

    prepare FILE ARGS...        write what a stop needs to FILE (the point's failed record
                                but its reason, the results path); exit 0 when the results
                                file has a finished record of this point
    failed REASON ARGS...       append a failed record for it, unless this job already wrote one
    stopped NEAR FILE ARGS...   the same for a job Slurm is stopping (its SIGTERM): why, from
                                scontrol (NEAR: non-empty when the early time warning came)

ARGS are the point's `scalelab` arguments (`run WORKLOAD ... --out RESULTS`), parsed by the
`run` command itself, so the config compared and recorded is the one the run would have.
Parsing them imports torch (seconds on a loaded node), more than Slurm's KillWait may leave
between SIGTERM and SIGKILL: `stopped` reads FILE instead and stays torch-free (only when a
stop came before `prepare` wrote FILE does it parse ARGS).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from scalelab.comm import slurm_env as slurm
from scalelab.errors import UsageError
from scalelab.orchestration.point_key import key_of
from scalelab.record import append_record, new_record, read_records
from scalelab.record_schema import FINISHED

# Set by new_record as each record is made: not part of a prepared one.
MADE_PER_RECORD = ("schema", "id", "time", "slurm")


def point_config(argv: list[str]):
    from scalelab.cli.main import build_parser
    from scalelab.cli.options import config_from_args

    args = build_parser().parse_args(argv)
    return config_from_args(args, workload=args.workload), Path(args.out)


def prepared(cfg, results: Path) -> dict[str, Any]:
    """What recording the point's failure needs, as JSON: its results file, its identity (key,
    field defaults, whether threads were asked for) and its failed record but the reason."""
    from scalelab.orchestration.sweep import config_key, match_defaults
    from scalelab.record import failed_record

    body = failed_record(cfg, "", source="slurm")
    return {
        "results": str(results),
        "key": config_key(cfg.to_dict()),
        "defaults": json.loads(json.dumps(match_defaults(), default=str)),
        "threads_set": cfg.threads is not None,
        "record": {k: v for k, v in body.items() if k not in MADE_PER_RECORD},
    }


def write_prepared(path: Path, prep: dict[str, Any]) -> None:
    """Whole or not at all: a SIGTERM mid-write leaves no half file for `stopped` to read."""
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(prep, default=str))
    os.replace(tmp, path)


def read_prepared(path: str) -> dict[str, Any] | None:
    try:
        prep = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return prep if isinstance(prep, dict) and "record" in prep else None


def _records(results: Path) -> list[dict[str, Any]]:
    try:
        return read_records(results) if results.exists() else []
    except UsageError:
        return []


def same_point(prep: dict[str, Any], record: dict[str, Any]) -> bool:
    """sweep.same_point (any node count) for a prepared point. The records compared are this
    job's, written by this scalelab, so none needs upgrade_record_config."""
    got = dict(record.get("config") or {})
    if not prep["threads_set"]:
        got["threads"] = None
    return key_of(got, prep["defaults"]) == prep["key"]


def is_done(cfg, results: Path) -> bool:
    """A finished record (ok or check-failed) of this point on this job's node count."""
    from scalelab.orchestration.sweep import job_nodes
    from scalelab.orchestration.sweep import same_point as same_config

    nodes = job_nodes()
    return any(
        r.get("status") in FINISHED and same_config(cfg, r, nodes) for r in _records(results)
    )


def record_failure(prep: dict[str, Any], reason: str) -> bool:
    """Append the failed record unless a record of this point from this attempt of this job
    exists (the ranks recorded how it ended, or a watcher named a dead rank)."""
    job = os.environ.get("SLURM_JOB_ID")
    attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)  # a requeued job's next attempt
    results = Path(prep["results"])
    for r in _records(results):
        got = r.get("slurm") or {}
        ours = job is not None and got.get("job_id") == job
        if ours and int(got.get("restart") or 0) == attempt and same_point(prep, r):
            return False
    append_record(results, new_record(**{**prep["record"], "error": reason}))
    return True


def main(argv: list[str]) -> int:
    if argv[:1] == ["prepare"] and len(argv) > 2:
        cfg, results = point_config(argv[2:])
        write_prepared(Path(argv[1]), prepared(cfg, results))
        return 0 if is_done(cfg, results) else 1
    if argv[:1] == ["failed"] and len(argv) > 2:
        record_failure(prepared(*point_config(argv[2:])), argv[1])
        return 0
    if argv[:1] == ["stopped"] and len(argv) > 3:
        prep = read_prepared(argv[2]) or prepared(*point_config(argv[3:]))
        job = os.environ.get("SLURM_JOB_ID", "")
        cause = slurm.stop_cause(slurm.job_info(job), near_limit=bool(argv[1]))
        record_failure(prep, f"job {job} was stopped by Slurm ({cause})")
        return 0
    sys.stderr.write(
        "usage: python -m scalelab.cli.slurm_point prepare FILE|failed REASON|stopped NEAR FILE"
        " ARGS\n"
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
