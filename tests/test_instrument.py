"""--trace, --per-layer and --nvml end to end through `scalelab run`, and the NVML sampler's
attribution of samples to phases against closed forms (with a fake NVML: no GPU here)."""

import gzip
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from scalelab.comm.launch import find_mpiexec
from scalelab.config import RunConfig
from scalelab.instrument.nvml import NvmlSampler, Samples, summarize
from scalelab.instrument.profiler import TraceSchedule
from scalelab.instrument.timer import PhaseTimer
from scalelab.workloads import WORKLOADS

SMALL = ["--image-size", "67", "--batch", "2", "--iters", "2", "--warmup", "1", "--quiet"]


def _record(cli, *args):
    code, out, err = cli("run", *args, "--no-record", "--json")
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _trace_events(path):
    with gzip.open(path) as f:
        return json.load(f)


def _annotations(trace):
    return {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}


def test_trace_schedule_fits_the_run():
    assert TraceSchedule.fit(2, 5) == TraceSchedule(wait=1, warmup=1, active=3)
    assert TraceSchedule.fit(0, 1) == TraceSchedule(wait=0, warmup=0, active=1)
    assert TraceSchedule.fit(1, 2) == TraceSchedule(wait=0, warmup=1, active=2)


def test_trace_written_with_phase_labels(cli, tmp_path):
    rec = _record(cli, "alexnet", *SMALL, "--trace", tmp_path)
    path = tmp_path / "rank0.json.gz"
    assert rec["trace"]["files"] == [str(path)]
    trace = _trace_events(path)
    assert trace["distributedInfo"] == {"backend": "self", "rank": 0, "world_size": 1}
    names = _annotations(trace)
    assert {"h2d", "compute", "d2h"} <= names
    # Recorded steps are the timed ones only (warm-up 1 is the profiler's warm-up step).
    assert sum(n.startswith("ProfilerStep#") for n in names) == 2
    assert any(e.get("cat") == "cpu_op" and "conv" in e["name"] for e in trace["traceEvents"])


def test_trace_of_training_labels_nested_phases(cli, tmp_path):
    args = ["mlp", "--train", "--steps", "4", "--train-size", "64", "--heldout-size", "16"]
    rec = _record(cli, *args, "--batch", "16", "--hidden", "32", "--quiet", "--trace", tmp_path)
    names = _annotations(_trace_events(tmp_path / "rank0.json.gz"))
    assert {"compute/forward", "compute/backward", "compute/step"} <= names
    assert rec["trace"]["schedule"] == {"wait": 1, "warmup": 1, "active": 2}


@pytest.mark.mpi
def test_trace_one_file_per_rank_under_mpi(tmp_path):
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "scalelab", "run", "alexnet",
           "--strategy", "mpi", "--ranks", "2", *SMALL, "--trace", str(tmp_path),
           "--no-record", "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["trace"]["files"] == [str(tmp_path / f"rank{r}.json.gz") for r in range(2)]
    for r in range(2):
        trace = _trace_events(tmp_path / f"rank{r}.json.gz")
        assert trace["distributedInfo"] == {"backend": "mpi", "rank": r, "world_size": 2}
        assert "compute" in _annotations(trace)


def test_per_layer_rows_match_the_cost_table(cli):
    rec = _record(cli, "alexnet", *SMALL, "--per-layer")
    cfg = RunConfig(workload="alexnet", image_size=67)
    costs = [r for r in WORKLOADS.get("alexnet")(cfg).cost_table() if r.module is not None]
    rows = rec["layers"]
    # One row per module of the model, in execution order, named as in the cost table.
    assert [r["name"] for r in rows] == [c.name for c in costs]
    assert [r["name"] for r in rows] == ["c1", "lrn1", "c2", "lrn2", "c3", "c4", "c5",
                                         "fc6", "fc7", "fc8"]  # fmt: skip
    for row, cost in zip(rows, costs):
        assert row["out_bytes"] == cost.out_elems * 4 * 2, row  # fp32, batch 2
        assert row["kind"] == cost.kind and row["calls"] == 3  # warm-up + 2 timed
        assert row["seconds"] > 0 and row["peak_bytes"] is None  # no allocator peak on CPU
    # The layers ran inside the timed compute phase: their times cannot exceed it.
    assert sum(r["seconds"] for r in rows) < rec["phases"]["compute"] * 1.5


def test_per_layer_training_skips_evaluation(cli):
    args = ["mlp", "--train", "--steps", "3", "--train-size", "64", "--heldout-size", "16"]
    rec = _record(cli, *args, "--batch", "16", "--hidden", "32", "--quiet", "--per-layer")
    rows = rec["layers"]
    assert rows and all(r["calls"] == 3 for r in rows)  # 3 steps; held-out forwards skipped
    assert rows[0]["out_bytes"] == 16 * 32 * 4  # first layer: (batch 16, hidden 32) fp32


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_nvml_without_gpu_is_one_clear_line(cli, tmp_path):
    results = tmp_path / "runs.jsonl"
    code, out, err = cli("run", "mlp", "--batch", "4", "--nvml", "--out", results)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--nvml" in lines[0] and "Traceback" not in err
    assert not results.exists()


def test_nvml_attribution_closed_form():
    # 100 W constant, counter in J rising at 100 J/s; memory 1 GB with a 3 GB spike at t=2.5.
    t = [0.0, 1.0, 2.0, 2.5, 3.0, 4.0]
    s = Samples(t=t, mem=[1e9, 1e9, 1e9, 3e9, 1e9, 1e9], power=[100.0] * 6,
                util=[50.0] * 6, energy=[1000 + 100 * x for x in t])  # fmt: skip
    out = summarize(s, [("compute", 0.5, 1.5), ("compute", 2.2, 2.8), ("h2d", 3.2, 3.4)], 0.5)
    assert out["energy_j"] == pytest.approx(400.0) and out["peak_mem_bytes"] == 3e9
    compute, h2d = out["phases"]["compute"], out["phases"]["h2d"]
    assert compute["energy_j"] == pytest.approx(100 * (1.0 + 0.6))
    assert compute["power_w"] == pytest.approx(100.0) and compute["count"] == 2
    assert compute["peak_mem_bytes"] == 3e9  # the spike lies inside the second interval
    assert h2d["peak_mem_bytes"] == 1e9  # no sample inside: the nearest one (t=3.0)
    # Without an energy counter the power samples are integrated instead: same answer.
    s.energy = [float("nan")] * 6
    assert summarize(s, [], 0.5)["energy_j"] == pytest.approx(400.0)


class FakeNvml:
    """The five NVML calls the sampler makes, with fixed readings."""

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=2_000_000_000)

    def nvmlDeviceGetPowerUsage(self, h):
        return 250_000  # mW

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=80)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return int(time.perf_counter() * 250_000)  # mJ at 250 W


def test_nvml_sampler_thread_and_phase_intervals():
    sampler = NvmlSampler(torch.device("cuda"), 0.005, nvml=FakeNvml(), handle=object())
    timer = PhaseTimer()
    with sampler:
        for _ in range(3):
            with timer.phase("compute"):
                time.sleep(0.03)
    out = sampler.notes()
    assert out["samples"] >= 10 and out["mean_power_w"] == 250 and out["mean_sm_util"] == 80
    phase = out["phases"]["compute"]
    assert phase["count"] == 3 and phase["peak_mem_bytes"] == 2e9
    assert phase["power_w"] == pytest.approx(250, rel=0.05)
    assert phase["energy_j"] == pytest.approx(250 * sum(timer.lap().values()), rel=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvml_and_per_layer_on_gpu(cli):
    pytest.importorskip("pynvml")
    rec = _record(cli, "alexnet", *SMALL, "--device", "cuda", "--nvml", "--per-layer")
    nvml = rec["nvml"]
    assert nvml["samples"] > 0 and nvml["peak_mem_bytes"] > 0 and nvml["energy_j"] >= 0
    assert "compute" in nvml["phases"] and rec["device_phases"]["compute"] > 0
    assert all(r["peak_bytes"] >= r["out_bytes"] for r in rec["layers"])
    assert all("power_w" in r for r in rec["layers"])


def test_tick_reports_slow_loops_only(capsys, monkeypatch):
    """Progress.tick in a log (not a terminal): nothing for a fast loop; for a slow one a line
    each time `every_s` passed, and the last step."""
    import logging
    import time

    from scalelab.instrument.progress import Progress

    monkeypatch.setattr(logging.getLogger("scalelab"), "level", logging.INFO)
    fast = Progress(5, "infer", enabled=True)
    for i in range(5):
        fast.tick(i + 1, every_s=60.0)
    assert capsys.readouterr().err == ""
    slow = Progress(3, "infer", enabled=True)
    for i in range(3):
        time.sleep(0.06)
        slow.tick(i + 1, every_s=0.05)
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split()[1] for ln in lines] == ["1/3", "2/3", "3/3"], lines


def test_update_in_a_log_says_something_every_few_seconds(capsys, monkeypatch):
    """A long epoch in a log file is not silent: update() writes a line once LOG_EVERY_S
    passed (the live line is for terminals only), never for the last step (the epoch's
    milestone says that)."""
    import logging
    import time

    from scalelab.instrument import progress

    monkeypatch.setattr(logging.getLogger("scalelab"), "level", logging.INFO)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.05)
    bar = progress.Progress(4, "train", enabled=True)
    for i in range(4):
        time.sleep(0.06)
        bar.update(i + 1, loss=1.0)
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split()[1] for ln in lines] == ["1/4", "2/4", "3/4"], lines
    assert all("loss=1" in ln for ln in lines)
