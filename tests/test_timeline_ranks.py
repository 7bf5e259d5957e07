"""The timeline of real ranks: a 3-rank mpi spatial run with a rank slowed on purpose (it is
named the straggler, the others wait in halo), and a 2-stage gloo pipeline's micro-batches in
schedule order on the aligned clocks."""

from __future__ import annotations

import json
import re

import pytest

from scalelab.analysis.waits import run_summary, wait_table
from scalelab.layout.schedule import SCHEDULES
from scalelab.record import read_records
from timeline_helpers import _scalelab, check_trace_schema


@pytest.mark.mpi
def test_slowed_rank_is_the_straggler_and_the_others_wait_in_halo(tmp_path):
    """3 mpi ranks, spatial split; rank 2 sleeps 30 ms in every compute phase. Ranks 0 and 1
    spend most of their halo time waiting, rank 2 is named the straggler, and the clocks,
    measured through the comm, agree within half a round trip (one host: one clock)."""
    runs = tmp_path / "runs.jsonl"
    _scalelab(
        tmp_path,
        "run",
        "alexnet",
        "--image-size",
        "67",
        "--batch",
        "3",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--strategy",
        "mpi",
        "--split",
        "spatial",
        "--ranks",
        "3",
        "--timeline",
        "--quiet",
        "--out",
        runs,
        env={"SCALELAB_TEST_SLOW_RANK": "2:0.03"},
    )
    rec = read_records(runs)[-1]
    tl = rec["timeline"]
    assert all(abs(o) <= r / 2 + 1e-6 for o, r in zip(tl["offsets_s"], tl["rtt_s"]))
    summary = run_summary(rec)
    assert summary["straggler"] == 2
    halo = wait_table(rec).set_index(["rank", "op"])
    for r in (0, 1):
        row = halo.loc[(r, "halo")]
        assert row["wait_s"] > 0.5 * row["time_s"] and row["waited_for"] == 2
    assert halo.loc[(2, "halo"), "wait_s"] < 0.5 * halo.loc[(2, "halo"), "time_s"]
    assert halo.loc[(0, "halo"), "bytes"] > 0
    out = _scalelab(tmp_path, "phases", runs).stdout
    assert "straggler: rank 2" in out


@pytest.mark.mpi
def test_pipeline_timeline_shows_every_micro_batch_in_schedule_order(tmp_path):
    """2 gloo stages, 1F1B, 3 micro-batches: in the last training step each stage's F/B
    slices are the schedule's op list, and on the aligned clocks a micro-batch's forward on
    stage 1 starts after it ended on stage 0 (its backward the other way round)."""
    runs = tmp_path / "runs.jsonl"
    _scalelab(
        tmp_path,
        "run",
        "deepstack",
        "--image-size",
        "8",
        "--convs",
        "3",
        "--fcs",
        "1",
        "--num-classes",
        "10",
        "--strategy",
        "pipeline",
        "--ranks",
        "2",
        "--stages",
        "2",
        "--microbatches",
        "3",
        "--schedule",
        "1f1b",
        "--train",
        "--batch",
        "6",
        "--steps",
        "2",
        "--train-size",
        "12",
        "--heldout-size",
        "6",
        "--quiet",
        "--timeline",
        "--out",
        runs,
    )
    _scalelab(tmp_path, "timeline", runs, "-o", tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    check_trace_schema(trace)
    rtt = max(read_records(runs)[-1]["timeline"]["rtt_s"]) * 1e6
    ops = {}
    for pid in (0, 1):
        mine = [
            e
            for e in trace["traceEvents"]
            if e["ph"] == "X"
            and e["pid"] == pid
            and e["args"]["iteration"] == 1
            and re.fullmatch(r"[FB]\d+", e["name"])
        ]
        mine.sort(key=lambda e: e["ts"])
        assert [e["name"] for e in mine] == [
            f"{k}{m}" for k, m in SCHEDULES["1f1b"](pid, 2, 3, True)
        ]
        ops[pid] = {e["name"]: e for e in mine}
    for m in range(3):
        f0, f1 = ops[0][f"F{m}"], ops[1][f"F{m}"]
        b0, b1 = ops[0][f"B{m}"], ops[1][f"B{m}"]
        assert f1["ts"] >= f0["ts"] + f0["dur"] - rtt
        assert b0["ts"] >= b1["ts"] + b1["dur"] - rtt
