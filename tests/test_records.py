"""Records: atomic appends (concurrent writers, killed writers) and strict reading."""

import json
import multiprocessing as mp
import os
import signal
import time

import pytest

from scalelab.errors import UsageError
from scalelab.record import append_record, new_record, read_records


def _writer(path, tag, count):
    payload = "x" * 20000  # larger than a pipe buffer: a non-atomic write would interleave
    for i in range(count):
        append_record(path, new_record(tag=tag, i=i, payload=payload))


def test_concurrent_appends_never_interleave(tmp_path):
    path = tmp_path / "runs.jsonl"
    procs = [mp.get_context("fork").Process(target=_writer, args=(path, t, 30)) for t in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    lines = path.read_text().splitlines()
    assert len(lines) == 120
    recs = [json.loads(line) for line in lines]
    assert sorted((r["tag"], r["i"]) for r in recs) == [(t, i) for t in range(4) for i in range(30)]


def test_killed_writer_leaves_only_whole_records(tmp_path):
    """A writer killed at any point: readers see only whole records, and the next append
    leaves only whole lines (Linux can cut one write() of a 20 kB record short on SIGKILL,
    so a torn last line is possible; the next writer removes it under the lock)."""
    path = tmp_path / "runs.jsonl"
    proc = mp.get_context("fork").Process(target=_writer, args=(path, 0, 10_000))
    proc.start()
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    whole = read_records(path) if path.exists() and path.stat().st_size else []
    assert all(r["tag"] == 0 and len(r["payload"]) == 20000 for r in whole)
    append_record(path, new_record(tag=1, i=0))
    text = path.read_text()
    assert text.endswith("\n")
    assert [json.loads(line)["tag"] for line in text.splitlines()] == [0] * len(whole) + [1]


def test_torn_last_line_is_skipped_then_cut(tmp_path):
    """The torn tail a killed writer can leave, written by hand: skipped by readers, cut by
    the next append, which then follows the last whole record."""
    path = tmp_path / "runs.jsonl"
    append_record(path, new_record(n=1))
    with open(path, "a") as f:
        f.write('{"schema": "scalelab.run/1", "n": 2, "payl')  # no newline: torn
    assert [r["n"] for r in read_records(path)] == [1]
    append_record(path, new_record(n=3))
    assert [r["n"] for r in read_records(path)] == [1, 3]
    assert path.read_text().count("\n") == 2
    # A whole last record that only lacks its newline (edited by hand) is kept, and completed.
    path.write_text(path.read_text().rstrip("\n"))
    assert [r["n"] for r in read_records(path)] == [1, 3]
    append_record(path, new_record(n=4))
    assert [r["n"] for r in read_records(path)] == [1, 3, 4]


def test_read_records_rejects_foreign_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hello": 1}\n')
    with pytest.raises(UsageError, match="not a scalelab record"):
        read_records(bad)
    bad.write_text("not json\n")
    with pytest.raises(UsageError, match="not JSON"):
        read_records(bad)
    with pytest.raises(UsageError, match="no such"):
        read_records(tmp_path / "missing.jsonl")


def test_read_records_from_folder(tmp_path):
    append_record(tmp_path / "a" / "runs.jsonl", new_record(n=1))
    append_record(tmp_path / "b.jsonl", new_record(n=2))
    assert sorted(r["n"] for r in read_records(tmp_path)) == [1, 2]
