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


def test_killed_writer_leaves_only_whole_lines(tmp_path):
    path = tmp_path / "runs.jsonl"
    proc = mp.get_context("fork").Process(target=_writer, args=(path, 0, 10_000))
    proc.start()
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    text = path.read_text()
    assert text.endswith("\n")
    assert all(json.loads(line)["tag"] == 0 for line in text.splitlines())


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
