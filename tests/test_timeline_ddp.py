"""The timeline of DDP's gradient buckets: 2 gloo ranks' traces hold one all-reduce slice per
bucket with its bytes, and the profiler's traced work joins the timeline on its clock; on 2
GPUs (marked gpu) NCCL's buckets are timed by CUDA events."""

from __future__ import annotations

import json

import pytest
import torch

from scalelab.analysis.device_overlap import collective_bandwidth, step_breakdown
from scalelab.config import RunConfig
from scalelab.instrument.kernel_trace import with_kernels
from scalelab.record import read_records
from scalelab.workloads import WORKLOADS
from timeline_helpers import _scalelab, check_trace_schema


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
