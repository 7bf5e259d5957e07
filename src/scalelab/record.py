"""Run records: one JSON object per line in a results file, appended atomically.

A record is the unit every analysis reads: config, environment, git commit, metrics and the
per-rank phases. Appends are a single O_APPEND write under an exclusive lock, so concurrent
ranks or a crash mid-run never leave half a line.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scalelab.errors import UsageError
from scalelab.record_schema import problem

if TYPE_CHECKING:
    from scalelab.config import RunConfig

SCHEMA = "scalelab.run/1"
DEFAULT_RESULTS = Path("scalelab-results") / "runs.jsonl"


def new_record(**fields: Any) -> dict[str, Any]:
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return {"schema": SCHEMA, "id": uuid.uuid4().hex[:12], "time": now, **fields, **slurm_job()}


def slurm_job() -> dict[str, Any]:
    """`slurm`: the job a record was made in (job id, array task, node list, partition,
    nodes, tasks); nothing outside Slurm."""
    from scalelab.comm.slurm_env import job_fields

    job = job_fields()
    return {} if job is None else {"slurm": job}


def failed_record(cfg: RunConfig, error: str, ranks: int | None = None, **extra: Any) -> dict:
    """A `status: failed` record for a run that produced no result of its own (an exception
    after setup, a launched job whose ranks died, a sweep point that wrote nothing): what was
    asked (config, environment, git commit) and why it failed; extra: fields beside `error`."""
    from scalelab import environment  # torch and friends: only when a failure is recorded

    return new_record(
        status="failed",
        error=error,
        **extra,
        workload=cfg.workload,
        strategy=cfg.strategy,
        mode="train" if cfg.train else "infer",
        ranks=cfg.ranks if ranks is None else ranks,
        config=cfg.to_dict(),
        env=environment.collect(),
        **environment.git_commit(),
    )


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    line = (json.dumps(record, default=_jsonable, allow_nan=True) + "\n").encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _drop_torn_tail(fd)
        written = os.write(fd, line)
        if written != len(line):  # disk full: cut back to the last whole line
            os.ftruncate(fd, os.fstat(fd).st_size - written)
            raise OSError(f"short write to {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_torn_tail(fd: int) -> None:
    """End the file with a whole line. One write() is not atomic against SIGKILL: Linux stops
    a write between pages when the writer is killed, so a writer killed mid-record (a record of
    more than a page) leaves an unterminated last line. The next writer, holding the lock,
    cuts it off before appending (readers skip it until then); a last line that is whole JSON
    and only lacks its newline (a file edited by hand) gets the newline instead."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    start = size
    while start > 0:
        lo = max(0, start - 65536)
        newline = os.pread(fd, start - lo, lo).rfind(b"\n")
        if newline >= 0:
            start = lo + newline + 1
            break
        start = lo
    if _is_json(os.pread(fd, size - start, start)):
        os.write(fd, b"\n")
    else:
        os.ftruncate(fd, start)


def _is_json(data: bytes | str) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records from a .jsonl file or every .jsonl/.json record file under a folder."""
    path = Path(path)
    if path.is_dir():
        files = sorted([*path.rglob("*.jsonl"), *path.rglob("*.json")])
    elif path.is_file():
        files = [path]
    else:
        raise UsageError(f"{path}: no such results file or folder")
    records = [rec for f in files for rec in _read_file(f)]
    if not records:
        raise UsageError(f"{path}: holds no scalelab records")
    return records


def _read_file(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text (is this a scalelab results file?)") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from None
    if path.suffix == ".json":
        lines = [text]
    else:  # an unterminated last line that is not JSON is a killed writer's torn record
        lines = text.splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n") and not _is_json(lines[-1]):
            lines.pop()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise UsageError(f"{path}:{n}: not JSON (is this a scalelab results file?)") from None
        items = rec if isinstance(rec, list) else [rec]
        for item in items:
            if not isinstance(item, dict) or not str(item.get("schema", "")).startswith(
                "scalelab."
            ):
                raise UsageError(f"{path}:{n}: not a scalelab record (no scalelab schema field)")
            wrong = problem(item) if item.get("schema") == SCHEMA else None
            if wrong is not None:
                raise UsageError(f"{path}:{n}: malformed record: {wrong}")
            out.append(item)
    return out


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in a record")
