"""Where the time went across ranks: span recording, wait/transfer attribution
checked against closed forms, the Chrome trace against the Trace Event Format (and HTA's
parser when installed), and real ranks: a 3-rank mpi spatial run with a rank slowed on
purpose, a 2-rank ddp gloo run's bucket all-reduces, a 2-stage gloo pipeline's micro-batches
in schedule order, and the five collectives of `ceilings --comm-only` on gloo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from scalelab.analysis.device_overlap import collective_bandwidth, step_breakdown
from scalelab.analysis.waits import attribute, overlap, rank_breakdown, run_summary, wait_table
from scalelab.config import RunConfig
from scalelab.instrument.collective_bench import bandwidths, parse_nccl_tests
from scalelab.instrument.kernel_trace import with_kernels
from scalelab.instrument.spans import SPANS, SpanLog, annotate, slow_rank_delay
from scalelab.instrument.timer import PhaseTimer
from scalelab.instrument.trace_events import trace_events, write_trace
from scalelab.layout.schedule import SCHEDULES
from scalelab.record import read_records
from scalelab.workloads import WORKLOADS

MS = 1e-3


# --- the trace-event schema, written from the Trace Event Format document ------------------
def check_trace_schema(trace: dict) -> None:
    """JSON object format: traceEvents; complete events ("X") carry name, cat, ts, dur >= 0
    (microseconds), pid, tid and an args object; metadata events ("M") name processes and
    threads. Slices on one thread must nest (Chrome's rule for complete events)."""
    json.dumps(trace)  # serialisable
    assert isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit") in (None, "ms", "ns")
    threads: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for ev in trace["traceEvents"]:
        assert ev["ph"] in ("X", "M"), ev
        assert isinstance(ev["name"], str) and ev["name"]
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        assert isinstance(ev.get("args", {}), dict)
        if ev["ph"] == "M":
            assert ev["name"] in ("process_name", "process_sort_index", "thread_name")
            continue
        assert isinstance(ev["cat"], str)
        assert isinstance(ev["ts"], (int, float)) and isinstance(ev["dur"], (int, float))
        assert ev["dur"] >= 0
        threads.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
    for (pid, tid), slices in threads.items():
        if tid != 0:  # the comm lane's slices may overlap (buckets in flight together)
            continue
        open_ends: list[float] = []
        for start, end in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start + 1e-3:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-3, (pid, start, end)
            open_ends.append(end)


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


# --- nccl-tests numbers -------------------------------------------------------------------------
NCCL_TESTS_OUT = """# Collective test starting: all_gather_perf
# nThread 1 nGpus 1 minBytes 8 maxBytes 1024 step: 2(factor) warmup iters: 5 iters: 20
#  Rank  0 Group  0 Pid   6899 on host device  0 [0000:04:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   6900 on host device  1 [0000:05:00] NVIDIA H100 80GB HBM3
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
        1024           128     float    none      -1    10.00    0.10    0.05      0     9.00    0.11    0.06      0
     1048576        131072     float    none      -1    20.00   52.43   26.21    N/A    19.00   55.19   27.59    N/A
"""  # noqa: E501


def test_bus_bandwidth_follows_nccl_tests_and_its_output_is_read():
    n = 8
    assert bandwidths("all_reduce", 10**9, 1.0, n) == (1e9, pytest.approx(1e9 * 2 * 7 / 8))
    assert bandwidths("broadcast", 10**9, 2.0, n) == (5e8, 5e8)
    assert bandwidths("alltoall", 10**9, 1.0, n)[1] == pytest.approx(1e9 * 7 / 8)
    name, ranks, rows = parse_nccl_tests(NCCL_TESTS_OUT)
    assert (name, ranks, len(rows)) == ("all_gather", 2, 2)
    assert rows[1] == {
        "bytes": 1048576,
        "time_s": pytest.approx(20e-6),
        "algbw_Bps": pytest.approx(52.43e9),
        "busbw_Bps": pytest.approx(26.21e9),
    }
    # nccl-tests' own numbers agree with the definitions: algbw = size / time, busbw = algbw/2
    assert rows[1]["bytes"] / rows[1]["time_s"] == pytest.approx(rows[1]["algbw_Bps"], rel=1e-3)
    assert bandwidths("all_gather", 1048576, 20e-6, 2)[1] == pytest.approx(26.21e9, rel=1e-3)


def test_nccl_tests_files_become_a_ceilings_source(cli, tmp_path):
    src = tmp_path / "all_gather_perf.txt"
    src.write_text(NCCL_TESTS_OUT.replace("# Collective test starting: all_gather_perf\n", ""))
    out = tmp_path / "c.json"
    code, stdout, err = cli("ceilings", "--nccl-tests", src, "-o", out)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["collectives"]["nccl-tests"]["ops"]["all_gather"][0]["bytes"] == 1024
    assert "busbw" in stdout
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n")
    code, _, err = cli("ceilings", "--nccl-tests", bad, "-o", tmp_path / "d.json")
    assert code == 2 and "not nccl-tests output" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d.json").exists()


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


def test_safetensors_library_and_hand_reader_agree(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    import importlib.util

    from scalelab import weights

    tensors = {"w": torch.randn(3, 2, dtype=torch.float64), "b": torch.arange(4)}
    weights.write_safetensors(tmp_path / "t.safetensors", tensors)
    by_library = weights.read_safetensors(tmp_path / "t.safetensors")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "safetensors" else real(n, *a)
    )
    by_hand = weights.read_safetensors(tmp_path / "t.safetensors")
    assert all(torch.equal(by_library[k], by_hand[k]) for k in tensors)
    monkeypatch.undo()
    (tmp_path / "bad.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{notjson}")
    with pytest.raises(Exception, match="not a readable safetensors"):
        weights.read_safetensors(tmp_path / "bad.safetensors")


# --- real ranks ---------------------------------------------------------------------------------
def _scalelab(tmp_path, *args, env=None, timeout=600):
    cmd = [sys.executable, "-m", "scalelab", *map(str, args)]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


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
def test_ddp_trace_has_one_slice_per_bucket_with_its_bytes(tmp_path):
    """2 gloo ranks of DDP with small buckets: in the last step every rank's comm lane holds
    one all-reduce slice per bucket (indices 0..n-1, more than one), whose bytes add up to
    the model's parameters in fp32."""
    args = [
        "deepstack",
        "--image-size",
        "4",
        "--convs",
        "6",
        "--fcs",
        "1",
        "--num-classes",
        "10",
        "--train",
        "--strategy",
        "ddp",
        "--ranks",
        "2",
        "--batch",
        "4",
        "--steps",
        "3",
        "--train-size",
        "12",
        "--heldout-size",
        "4",
        "--bucket-mb",
        "0.25",
        "--quiet",
    ]
    runs, trace_dir = tmp_path / "runs.jsonl", tmp_path / "tr"
    _scalelab(tmp_path, "run", *args, "--trace", trace_dir, "--out", runs)
    cfg = RunConfig(workload="deepstack", image_size=4, convs=6, fcs=1, num_classes=10)
    params = sum(p.numel() for p in WORKLOADS.get("deepstack")(cfg).build_model().parameters())
    trace = json.loads((trace_dir / "timeline.json").read_text())
    check_trace_schema(trace)
    buckets = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
    for pid in (0, 1):
        last = [e for e in buckets if e["pid"] == pid and e["args"]["iteration"] == 2]
        assert all(e["name"] == "allreduce" and e["cat"] == "comm" for e in last)
        assert sorted(e["args"]["bucket"] for e in last) == list(range(len(last)))
        assert len(last) > 1 and sum(e["args"]["bytes"] for e in last) == 4 * params
    for totals in read_records(runs)[-1]["ddp_comm"]:  # the record's per-rank totals
        assert sum(totals["bucket_bytes"]) == 4 * params and totals["calls"] >= 3
    _check_traced_work_placed(read_records(runs)[-1], tmp_path, runs)


def _check_traced_work_placed(rec, tmp_path, runs):
    """The profiler traces' work joins the timeline on its clock: every rank gains device
    and device-comm spans; each traced operator lies inside a phase of its own iteration, or
    before its first one where the batch is assembled (the clocks are aligned to well under a
    step); the step table's union arithmetic holds;
    `scalelab timeline` draws the two lanes and prints the table."""
    merged, notes = with_kernels(rec)
    assert notes == []
    for spans in merged["timeline"]["ranks"]:
        phases = [(s[1], s[1] + s[2], s[4]) for s in spans if s[3] == "main" and "/" not in s[0]]
        device = [s for s in spans if s[3] == "device"]
        assert device and any(s[3] == "device-comm" for s in spans)
        for _, start, dur, _, it, _ in device:
            mine = [(a, b) for a, b, i in phases if i == it]
            inside = any(a - 1e-3 <= start and start + dur <= b + 1e-3 for a, b in mine)
            # or the batch's assembly (the source slices this rank's share: aten::select,
            # index) between the last iteration's phases and this one's first, in no phase
            last = max((b for _, b, i in phases if i < it), default=float("-inf"))
            first = min(a for a, _ in mine)
            assembling = last - 1e-3 <= start and start + dur <= first + 1e-3
            assert inside or assembling, (start, dur, it, last, first)
    steps = step_breakdown(merged)
    assert set(steps["rank"]) == {0, 1} and len(steps) >= 2
    tol = 1e-9
    assert (steps["overlap_s"] <= steps[["compute_s", "comm_s"]].min(axis=1) + tol).all()
    assert (steps["exposed_comm_s"] - (steps["comm_s"] - steps["overlap_s"])).abs().max() < tol
    assert (
        steps["compute_s"] + steps["comm_s"] - steps["overlap_s"] <= steps["step_s"] + tol
    ).all()
    out = _scalelab(tmp_path, "timeline", runs, "-o", tmp_path / "merged.json").stdout
    assert "device time per traced step" in out and "exposed_comm ms" in out
    # The collectives' busbw is printed where the trace gives their bytes (NCCL's kernels on
    # a GPU; gloo's calls here carry none).
    assert ("busbw GB/s" in out) == (not collective_bandwidth(merged).empty)
    trace = json.loads((tmp_path / "merged.json").read_text())
    check_trace_schema(trace)
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} >= {0, 1, 2, 3}


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


@pytest.mark.mpi
def test_comm_only_ceilings_print_the_five_collectives_on_gloo(tmp_path):
    out = tmp_path / "c.json"
    proc = _scalelab(
        tmp_path,
        "ceilings",
        "--comm-only",
        "--ranks",
        "2",
        "--backend",
        "gloo",
        "--quick",
        "--quiet",
        "-o",
        out,
    )
    data = json.loads(out.read_text())["collectives"]["gloo"]
    assert data["ranks"] == 2
    for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "alltoall"):
        rows = data["ops"][name]
        assert rows and all(r["algbw_Bps"] > 0 for r in rows)
        for r in rows:  # the definitions, from the stored time
            algbw, busbw = bandwidths(name, r["bytes"], r["time_s"], 2)
            assert r["algbw_Bps"] == pytest.approx(algbw) and r["busbw_Bps"] == pytest.approx(busbw)
        assert f"  {name}\n" in proc.stdout
    assert "algbw" in proc.stdout and "busbw" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
def test_nccl_buckets_timed_by_cuda_events(tmp_path):
    """2 GPUs of DDP under NCCL with --timeline: the bucket timer switches to CUDA events and
    the last step's slices still add up to the parameters' bytes."""
    runs = tmp_path / "runs.jsonl"
    _scalelab(
        tmp_path,
        "run",
        "resnet18",
        "--train",
        "--strategy",
        "ddp",
        "--device",
        "cuda",
        "--ranks",
        "2",
        "--batch",
        "32",
        "--steps",
        "4",
        "--train-size",
        "128",
        "--heldout-size",
        "16",
        "--bucket-mb",
        "1",
        "--quiet",
        "--timeline",
        "--out",
        runs,
    )
    rec = read_records(runs)[-1]
    assert all(r["clock"] == "cuda events" and r["allreduce_s"] > 0 for r in rec["ddp_comm"])
    cfg = RunConfig(workload="resnet18")
    params = sum(p.numel() for p in WORKLOADS.get("resnet18")(cfg).build_model().parameters())
    for spans in rec["timeline"]["ranks"]:
        comm = [s for s in spans if s[3] == "comm"]
        # 4 steps: DDP's static graph reduces every gradient at once in its first two steps
        # (recording the graph, then rebuilding its buckets), bucket by bucket after that
        steps = sorted({s[4] for s in comm})
        assert len(steps) == 4, steps
        last = [s for s in comm if s[4] == steps[-1]]
        assert len(last) > 1 and sum(s[5]["bytes"] for s in last) == 4 * params
