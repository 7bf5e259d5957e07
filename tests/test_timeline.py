"""Where the time went across ranks, without launching any: span recording, wait/transfer
attribution and the device-time interval union checked against closed forms, the Chrome trace
against the Trace Event Format (and HTA's parser when installed), and a one-process run's
timeline through `run --trace`, `report` and `timeline`."""

from __future__ import annotations

import json

import pytest

from scalelab.analysis.device_overlap import collective_bandwidth, step_breakdown
from scalelab.analysis.waits import attribute, overlap, rank_breakdown, run_summary, wait_table
from scalelab.instrument.spans import SPANS, SpanLog, annotate, slow_rank_delay
from scalelab.instrument.timer import PhaseTimer
from scalelab.instrument.trace_events import trace_events, write_trace
from scalelab.record import read_records
from timeline_helpers import check_trace_schema

MS = 1e-3


# --- spans from the phase timer ---------------------------------------------------------------
def test_phases_become_nested_spans_with_their_annotations(monkeypatch):
    log = SpanLog()
    monkeypatch.setattr(SPANS, "log", log)
    timer = PhaseTimer()
    with timer.phase("compute"), timer.phase("forward"):
        annotate(mb=3)
    log.step()
    with timer.phase("halo"):
        annotate(bytes=128, peers=[1])
    annotate(ignored=True)  # no phase open: nothing to annotate
    names = [(s[0], s[4], s[5]) for s in log.rows(0.0, 0.0)]
    assert names == [
        ("compute", 0, {}),
        ("compute/forward", 0, {"mb": 3}),
        ("halo", 1, {"bytes": 128, "peers": [1]}),
    ]
    outer, inner = log.spans[1], log.spans[0]  # closed inner first
    assert outer[1] <= inner[1] <= inner[2] <= outer[2]


def test_no_log_costs_nothing_and_bad_hook_value_is_one_line(monkeypatch):
    monkeypatch.setattr(SPANS, "log", None)
    annotate(bytes=1)  # no log installed: a no-op
    monkeypatch.setenv("SCALELAB_TEST_SLOW_RANK", "1:0.25")
    assert slow_rank_delay(1) == 0.25 and slow_rank_delay(0) == 0.0
    monkeypatch.setenv("SCALELAB_TEST_SLOW_RANK", "one")
    with pytest.raises(Exception, match="RANK:SECONDS"):
        slow_rank_delay(0)


# --- attribution against closed forms ---------------------------------------------------------
def _record(ranks: list[list[list]], warmup: int = 0) -> dict:
    return {
        "id": "t",
        "workload": "w",
        "strategy": "s",
        "ranks": len(ranks),
        "mode": "infer",
        "config": {"warmup": warmup},
        "timeline": {"ranks": ranks},
    }


def _span(path, start_ms, dur_ms, it=1, lane="main", **args):
    return [path, start_ms * MS, dur_ms * MS, lane, it, args]


def test_wait_is_arrival_to_last_arrival_clipped_to_the_phase():
    """Ranks reach a halo at 0, 1 and 4 ms; the rank arriving last (2) waits for nobody.
    The second halo: rank 1 arrives 10 ms late but rank 0's span is only 3 ms long, so all
    of it is wait. Iteration 0 is warm-up and ignored."""
    ranks = [
        [_span("halo", 0, 5), _span("halo", 20, 3), _span("halo", 0, 99, it=0)],
        [_span("halo", 1, 4.5), _span("halo", 30, 1)],
        [_span("halo", 4, 1.0), _span("halo", 21, 9.5)],
    ]
    rec = _record(ranks, warmup=1)
    df = attribute(rec).sort_values(["key", "rank"])
    assert df["wait_s"].round(9).tolist() == pytest.approx([4 * MS, 3 * MS, 0, 3 * MS, 0, 9 * MS])
    assert df["last_rank"].tolist() == [2, 2, 2, 1, 1, 1]
    assert (df["wait_s"] + df["transfer_s"]).tolist() == pytest.approx(df["dur_s"].tolist())
    table = wait_table(rec).set_index("rank")
    assert table.loc[0, "calls"] == 2 and table.loc[0, "wait_s"] == pytest.approx(7 * MS)
    assert table.loc[0, "waited_for"] == 2  # 4 ms for rank 2 beats 3 ms for rank 1
    summary = run_summary(rec)
    assert summary["blame_s"] == pytest.approx({0: 0.0, 1: 12 * MS, 2: 7 * MS})
    assert summary["straggler"] == 1


def test_point_to_point_receives_stay_unmatched():
    ranks = [[_span("recv", 0, 2, op="recv B", mb=0)], [_span("recv", 0, 5, op="recv F", mb=0)]]
    df = attribute(_record(ranks))
    assert not df["matched"].any() and (df["wait_s"] == 0).all() and (df["transfer_s"] == 0).all()
    assert run_summary(_record(ranks))["straggler"] is None


def test_overlap_counts_comm_while_computing_until_the_last_hand_over():
    """backward 0-10 ms hands buckets over at 2 and 6 ms; their all-reduces run 2-5 and 6-12.
    Computing lasts until 6 ms (the last hand-over): overlap (5-2) + (6-6) = 3 ms of 9 ms."""
    spans = [
        _span("compute/backward", 0, 10),
        _span("allreduce", 2, 3, lane="comm", bucket=0),
        _span("allreduce", 6, 6, lane="comm", bucket=1),
        _span("halo", 20, 2),  # phase-lane comm: never overlapped
    ]
    busy, hidden = overlap(spans)
    assert busy == pytest.approx(11 * MS) and hidden == pytest.approx(3 * MS)


def test_rank_breakdown_adds_up_to_the_top_level_phases():
    ranks = [
        [_span("compute", 0, 4), _span("halo", 4, 5)],
        [_span("compute", 0, 8), _span("halo", 8, 1)],
    ]
    df = rank_breakdown(_record(ranks)).pivot(index="rank", columns="part", values="seconds")
    assert df.loc[0, "wait"] == pytest.approx(4 * MS) and df.loc[0, "transfer"] == pytest.approx(MS)
    assert df.sum(axis=1).tolist() == pytest.approx([9 * MS, 9 * MS])


# --- the trace ----------------------------------------------------------------------------------
def test_trace_follows_the_event_format_and_names_micro_batches(tmp_path):
    ranks = [
        [_span("forward", 0, 1, mb=0), _span("compute", 1, 3), _span("compute/forward", 1, 2)],
        [
            _span("recv", 0, 1, op="recv F", bytes=64, peer=0),
            _span("allreduce", 0, 2, lane="comm", bytes=40, bucket=0),
        ],
    ]
    trace = trace_events([_record(ranks)])
    check_trace_schema(trace)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in slices] == ["F0", "compute", "forward", "recv", "allreduce"]
    assert slices[3]["args"]["bytes"] == 64 and slices[3]["cat"] == "comm"
    assert slices[4]["tid"] == 1 and slices[4]["args"]["bucket"] == 0
    assert slices[1]["ts"] == pytest.approx(1000.0) and slices[1]["dur"] == pytest.approx(3000.0)
    with pytest.raises(Exception, match="--timeline"):
        trace_events([{"id": "x"}])


def test_hta_parses_the_trace(tmp_path):
    parser = pytest.importorskip("hta.common.trace_parser")
    from hta.configs.parser_config import ParserBackend, ParserConfig

    ranks = [[_span("compute", 0, 4), _span("halo", 4, 5, bytes=8)], [_span("compute", 0, 8)]]
    path = write_trace([_record(ranks)], tmp_path / "trace.json")
    cfg = ParserConfig.get_default_cfg()
    cfg.parser_backend = ParserBackend.JSON
    meta, df, symbols = parser.parse_trace_dataframe(str(path), cfg)
    names = [symbols.sym_table[i] for i in df["name"]]
    assert sorted(names) == ["compute", "compute", "halo"]
    assert sorted(df["dur"].tolist()) == [4000, 5000, 8000]


def test_timeline_command_refuses_records_without_one(cli, tmp_path):
    runs = tmp_path / "runs.jsonl"
    code, _, err = cli("run", "mlp", "--hidden", "8", "--batch", "4", "--iters", "1", "--out", runs)
    assert code == 0, err
    code, _, err = cli("timeline", runs, "-o", tmp_path / "t.json")
    assert code == 2 and "--timeline" in err and not (tmp_path / "t.json").exists()


def test_one_process_run_records_its_timeline_and_trace(cli, tmp_path):
    """--trace writes DIR/timeline.json beside the profiler's files; runs.csv flattens phases."""
    runs, trace_dir = tmp_path / "runs.jsonl", tmp_path / "tr"
    code, _, err = cli(
        "run",
        "mlp",
        "--hidden",
        "8",
        "--batch",
        "4",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--trace",
        trace_dir,
        "--out",
        runs,
    )
    assert code == 0, err
    rec = read_records(runs)[-1]
    spans = rec["timeline"]["ranks"][0]
    assert {s[4] for s in spans} == {0, 1, 2} and rec["timeline"]["offsets_s"] == [0.0]
    check_trace_schema(json.loads((trace_dir / "timeline.json").read_text()))
    code, _, err = cli("report", runs, "-o", tmp_path / "rep", "--no-plots")
    assert code == 0, err
    header = (tmp_path / "rep" / "runs.csv").read_text().splitlines()[0].split(",")
    assert {f"phase.{k}" for k in rec["phases"]} <= set(header)


def _dev(name, start, dur, lane, it=0, **args):
    return [name, start, dur, lane, it, args]


def test_device_time_is_an_interval_union_and_busbw_follows_nccl_tests():
    """Two compute kernels on two streams at once count once; communication while computing
    is hidden, the rest exposed; a rank that starts a collective 2 ms before its peer waited
    2 ms; busbw of an all-reduce of 8 MB moved in 1 ms on 2 ranks = 8e9 B/s x 2(n-1)/n."""
    ar = {"collective": "allreduce", "bytes": 8_000_000, "group": 2}
    rank0 = [_dev("k1", 0.000, 0.004, "device", stream=7), _dev("k2", 0.001, 0.002, "device"),
             _dev("ncclAllReduce", 0.003, 0.003, "device-comm", **ar)]  # fmt: skip
    rank1 = [_dev("k1", 0.000, 0.005, "device"),
             _dev("ncclAllReduce", 0.005, 0.001, "device-comm", **ar)]  # fmt: skip
    rec = {"timeline": {"ranks": [rank0, rank1]}}
    steps = step_breakdown(rec).set_index("rank")
    assert steps.loc[0, "compute_s"] == pytest.approx(0.004)  # [0, 4] ms, k2 inside it
    assert steps.loc[0, "comm_s"] == pytest.approx(0.003)
    assert steps.loc[0, "overlap_s"] == pytest.approx(0.001)  # [3, 4] ms
    assert steps.loc[0, "exposed_comm_s"] == pytest.approx(0.002)
    assert steps.loc[0, "step_s"] == pytest.approx(0.006) and steps.loc[0, "idle_s"] == 0
    assert steps.loc[0, "wait_s"] == pytest.approx(0.002) and steps.loc[1, "wait_s"] == 0
    bw = collective_bandwidth(rec).set_index("rank")
    assert bw.loc[0, "transfer_s"] == pytest.approx(0.001)
    assert bw.loc[0, "busbw_Bps"] == pytest.approx(8e9 * 2 * (2 - 1) / 2)
