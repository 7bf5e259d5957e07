"""`pipeline --engine torch`: every torch.distributed.pipelining schedule on real gloo ranks
against one process (fp64 weights after 2 SGD steps), the executed action order against the
schedule's own lists, the replayed bubble against closed forms, and the one-line refusals
(tests/programs/torchpp_check.py runs the ranks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from programs.train_helpers import run
from scalelab.layout.torch_schedule import replay, simulated_bubble, stage_seconds, torch_order
from scalelab.strategies.pipeline.torch_stages import (
    ChannelsLast,
    OwnedOutput,
    whole_backward_stages,
)
from torchpp_helpers import check_training, torchrun

ROOT = Path(__file__).resolve().parents[1]
INTER = ("interleaved-1f1b", 2, 2, 8)


@pytest.mark.mpi
@pytest.mark.slow
def test_every_schedule_trains_like_one_process():
    """deepstack, mlp and VGG-16 at 32x32 (64-wide heads), each of the 7 schedules on 2
    ranks: the weights after 2 steps equal one process's; each rank ran exactly the schedule's
    action list; inference through interleaved-1f1b and zbv gives the one-process logits.
    The mlp in 4 stages and VGG-16 under zbv start with a parameter-free stage: the next
    stage trains only through torch_stages.whole_backward_stages; deepstack's split-backward
    cuts end stage 1 at a view (flatten), which only torch_stages.OwnedOutput lets torch
    detach. VGG-16 under 1f1b also runs its stages in channels_last (ChannelsLast)."""
    results = torchrun(2, "pp")
    assert len(results) == 24
    assert not [r for r in results if "refused" in r]
    for r in results:
        if not r["train"]:
            assert r["relerr"] < 1e-12, r
            continue
        check_training(r)
        assert r["executed"] == r["actions"], r["schedule"]
        # the order predict draws before anything runs (placeholder stages) is the one run,
        # and so are the transfers torch's runtime posted between them (what the replay of a
        # multi-stage schedule models; bubble_simulated below replays the run's own lists)
        assert r["drawn"] == r["actions"], r["schedule"]
        assert r["lowered_ran"] == r["lowered_drawn"], r["schedule"]
        multi = r["schedule"] not in ("gpipe", "1f1b")
        assert multi == any("SEND" in a for acts in r["lowered_ran"].values() for a in acts)
        assert 0.0 <= r["bubble_simulated"] < 1.0 and 0.0 <= r["bubble_measured"] < 1.0


@pytest.mark.parametrize(
    "holds, whole",
    [
        ([False, True, False, True], {1}),  # the mlp's cut: fc1 receives a grad-free input
        ([False, False, True], {1, 2}),
        ([True, False, True], set()),  # stage 0 is torch's own fallback
        ([False, False], set()),  # nothing to train
    ],
)
def test_stages_after_parameter_free_ones_run_the_whole_backward(holds, whole):
    assert whole_backward_stages(holds) == whole


def test_a_stage_output_is_never_a_view():
    x = torch.randn(2, 3, 1, 1, requires_grad=True)
    out = OwnedOutput(nn.Flatten())(x)
    assert not out._is_view() and torch.equal(out, x.flatten(1))
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    y = torch.randn(2, 3)
    assert OwnedOutput(nn.Identity())(y) is y  # no copy when the output is its own


def test_a_channels_last_stage_runs_nhwc_and_hands_on_nchw():
    seen = []
    conv = nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64)
    conv.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    out = ChannelsLast(conv.to(memory_format=torch.channels_last))(x)
    assert seen[0].is_contiguous(memory_format=torch.channels_last)
    assert not seen[0].is_contiguous() and out.is_contiguous()
    ref = nn.functional.conv2d(x, conv.weight, conv.bias, padding=1)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    assert x.grad.shape == x.shape and x.grad.is_contiguous()


def test_replay_of_equal_stages_gives_the_textbook_bubble():
    """GPipe on K ranks, M micro-batches, F = 1 s, B = 2 s: makespan (M + K - 1) * 3."""
    k, m = 3, 4
    actions = {r: [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)]
               for r in range(k)}  # fmt: skip
    seconds = {(s, kind): (1.0 if kind == "F" else 2.0) for s in range(k) for kind in "FB"}
    makespan, busy = replay(actions, seconds, k)
    assert makespan == pytest.approx((m + k - 1) * 3.0)
    bubble = simulated_bubble(actions, seconds, k)
    assert all(b == pytest.approx((k - 1) / (m + k - 1)) for b in bubble.values())


@pytest.mark.parametrize("k, m", [(2, 4), (4, 8)])
def test_torchs_orders_drawn_unrun_replay_to_their_closed_forms(k, m):
    """torch's own action lists (torch_order: the schedule built over placeholder stages),
    V stages per rank of t / V each (F a third, B two thirds; I and W half of B): GPipe
    (M + K - 1) t; interleaved 1F1B over V stages M t + (K - 1) t / V (Narayanan et al.
    2021); the zero-bubble schedules below that and above the busy M t. A send of d seconds
    between ranks adds to each, the more the more often the schedule crosses ranks."""
    t = 1.0

    def makespan(name: str, v: int, send: float = 0.0) -> float:
        n = k * v
        seconds = {
            (st, kind): t / v * share
            for st in range(n)
            for kind, share in (("F", 1 / 3), ("B", 2 / 3), ("I", 1 / 3), ("W", 1 / 3))
        }
        actions = torch_order(name, k, v, m)  # fmt: skip
        assert sorted(a for acts in actions.values() for a in acts if a[1] == "F") == sorted(
            (st, "F", i) for st in range(n) for i in range(m)
        )  # every stage's forward of every micro-batch, once
        return replay(actions, seconds, n, send)[0]

    assert makespan("gpipe", 1) == pytest.approx((m + k - 1) * t)
    assert makespan("1f1b", 1) == pytest.approx((m + k - 1) * t)
    for v in (2, 3):
        assert makespan("interleaved-1f1b", v) == pytest.approx(m * t + (k - 1) * t / v)
    for name in ("zero-bubble", "zbv", "dualpipev"):
        assert m * t < makespan(name, 2) < makespan("interleaved-1f1b", 2) - 1e-9, name
    # GPipe's sends sit on the fill and the drain: 2 (K - 1) of them
    assert makespan("gpipe", 1, 0.01) == pytest.approx((m + k - 1) * t + 2 * (k - 1) * 0.01)
    assert makespan("interleaved-1f1b", 2, 0.01) > makespan("interleaved-1f1b", 2)


def test_runtime_replay_serialises_a_pairs_transfers_and_syncs_on_them():
    """torch's runtime lists with their transfers, 2 ranks, 2 micro-batches, forwards only,
    F = 1 s on either stage, a transfer d = 2 s; rank 1 posts both recvs before computing:
        rank 0: F(0,0) SEND_F(0,0) F(0,1) SEND_F(0,1)
        rank 1: RECV_F(1,0) RECV_F(1,1) F(1,0) F(1,1)
    One stream per pair, in issue order: transfer 0 runs 1..3 (after F(0,0)); transfer 1
    waits for it on both ends, 3..5. F(1,0) 3..4, F(1,1) waits for transfer 1: 5..6 -> 6 s
    (the fused replay, transfers side by side: F(0,1) ends 2, arrives 4, F(1,1) 4..5 -> 5 s).
    With the device-wide sync before each compute, a compute waits for every transfer its
    rank posted: F(0,1) waits for transfer 0, 3..4; transfer 1 4..6; F(1,0) waits for both
    recvs, 6..7; F(1,1) 7..8 -> 8 s = M (F + d) + M F."""
    lists = {
        0: [(0, "F", 0), (0, "SEND_F", 0), (0, "F", 1), (0, "SEND_F", 1)],
        1: [(1, "RECV_F", 0), (1, "RECV_F", 1), (1, "F", 0), (1, "F", 1)],
    }
    seconds = {(0, "F"): 1.0, (1, "F"): 1.0}
    assert replay(lists, seconds, 2, 2.0) == (6.0, {0: 2.0, 1: 2.0})
    assert replay(lists, seconds, 2, 2.0, device_sync=True)[0] == 8.0
    compute = {r: [a for a in acts if a[1] == "F"] for r, acts in lists.items()}
    assert replay(compute, seconds, 2, 2.0)[0] == 5.0
    # the bubble replays free transfers: with the sync F(1,0) still waits for both recvs,
    # posted 1 and 2 (after F(0,0), F(0,1)): rank 1 computes 2..4, 2 s busy of 4
    assert simulated_bubble(lists, seconds, 2, device_sync=True) == {0: 0.5, 1: 0.5}
    # transfers crossed on one pair's stream wait for each other, as NCCL's would: a deadlock
    crossed = {
        0: [(0, "F", 0), (0, "SEND_F", 0), (0, "RECV_B", 1), (0, "B", 1)],
        1: [(1, "SEND_B", 1), (1, "RECV_F", 0), (1, "F", 0)],
    }
    with pytest.raises(RuntimeError, match="deadlock"):
        replay(crossed, seconds, 2)


@pytest.mark.parametrize("name, v", [("interleaved-1f1b", 2), ("looped-bfs", 2), ("zbv", 2),
                                     ("zero-bubble", 2), ("dualpipev", 2)])  # fmt: skip
def test_torchs_lowered_lists_replay_the_runtime(name, v):
    """The lists torch's runtime walks (pipeline_order_with_comms, drawn over placeholder
    stages), 2 ranks, 4 micro-batches, F 1 s, B 2 s (I, W 1 s): with free transfers and no
    sync the FIFO costs nothing (the compute-only replay's makespan; DualPipeV posts an
    OVERLAP_F_B pair's transfers after both halves, 1 s later); a device-wide sync never
    shortens it; transfers of d seconds cost more under the sync. Every stage's forward
    sends exactly where the next stage is on the other rank."""
    k, m, n = 2, 4, 2 * v
    seconds = {(st, kind): t for st in range(n)
               for kind, t in (("F", 1.0), ("B", 2.0), ("I", 1.0), ("W", 1.0))}  # fmt: skip
    lowered, compute = torch_order(name, k, v, m, comms=True), torch_order(name, k, v, m)
    assert {r: [a for a in acts if a[1] in "FBIW"] for r, acts in lowered.items()} == compute
    free = replay(lowered, seconds, n)[0]
    late = 1.0 if name == "dualpipev" else 0.0
    assert free == pytest.approx(replay(compute, seconds, n)[0] + late)
    synced = replay(lowered, seconds, n, device_sync=True)[0]
    assert synced >= free - 1e-9
    assert replay(lowered, seconds, n, 0.5, True)[0] > replay(lowered, seconds, n, 0.5)[0]
    sends = sorted(a for acts in lowered.values() for a in acts if a[1] == "SEND_F")
    holder = {a[0]: r for r, acts in compute.items() for a in acts}
    crossing = [s for s in range(n - 1) if holder[s] != holder[s + 1]]
    assert sends == sorted((s, "SEND_F", i) for s in crossing for i in range(m))


def test_the_runtime_replay_accounts_for_a_measured_interleaved_step():
    """A measured VGG-16 interleaved 1F1B step on 2 H200s (8 micro-batches, V = 2): its
    ranks computed 76 and 74 ms of a 156 ms span. Replayed with the record's own per-stage
    times and free transfers: the dependency replay gives 78 ms (bubble 0.045, what predict
    said); torch's lowered lists with the engine's device-wide sync give 128 ms, and 0.6 ms
    per transfer brings them to the measured span; without the sync the lists give 78 ms."""
    path = ROOT / "tests/fixtures/pipelining/interleaved_step_h200x2.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    pipe = next(r["pipeline"] for r in recs
                if r.get("pipeline", {}).get("schedule") == "interleaved-1f1b")  # fmt: skip
    seconds = stage_seconds(pipe["stage"], 8)
    span = max(r["span_s"] for r in pipe["stage"])
    lowered, compute = torch_order("interleaved-1f1b", 2, 2, 8, True), torch_order(*INTER)
    assert replay(compute, seconds, 4)[0] == pytest.approx(0.0785, abs=1e-3)
    assert replay(lowered, seconds, 4)[0] == pytest.approx(0.0785, abs=1e-3)
    assert replay(lowered, seconds, 4, device_sync=True)[0] == pytest.approx(0.128, abs=1e-3)
    assert replay(lowered, seconds, 4, 0.0006, True)[0] == pytest.approx(span, rel=0.02)


def test_the_single_stage_schedules_keep_the_fused_replay():
    """GPipe and 1F1B fuse each step's transfers (PipelineScheduleSingle): their lists carry
    no transfer, and the replay (bubble analysis) is the same with or without the sync."""
    seconds = {(s, kind): t for s in range(2) for kind, t in (("F", 1.0), ("B", 2.0))}
    for name in ("gpipe", "1f1b"):
        lists = torch_order(name, 2, 1, 4, comms=True)
        assert lists == torch_order(name, 2, 1, 4)
        assert replay(lists, seconds, 2, 0.1, True) == replay(lists, seconds, 2, 0.1)
        assert replay(lists, seconds, 2)[0] == pytest.approx((4 + 1) * 3.0)


def test_replay_detects_a_deadlocked_list():
    actions = {0: [(0, "B", 0), (0, "F", 0)], 1: [(1, "F", 0), (1, "B", 0)]}
    with pytest.raises(RuntimeError, match="deadlock"):
        replay(actions, {}, 2)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--schedule", "zbv", "--virtual-stages", "3"], "2 stages per rank"),
        (["--schedule", "gpipe", "--virtual-stages", "2"], "one stage per rank"),
        (["--schedule", "nope"], "unknown --schedule"),
        (["--batch", "6"], "equal parts"),
        (["--engine", "bogus"], "unknown --engine"),
    ],
)
def test_bad_torch_pipeline_options_one_line_exit_2(cli, tmp_path, args, needle):
    code, _, err = cli(
        "run", "deepstack", "--strategy", "pipeline", "--engine", "torch", "--stages", "1",
        "--image-size", "8", "--convs", "1", "--fcs", "1", "--batch", "8", "--microbatches",
        "4", "--out", tmp_path / "r.jsonl", *args,
    )  # fmt: skip
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.jsonl").exists()


def test_torch_only_flags_need_the_torch_engine(cli, tmp_path):
    code, _, err = cli("run", "mlp", "--strategy", "pipeline", "--dp", "2", "--no-record")
    assert code == 2 and "--dp needs --engine torch" in err


@pytest.mark.mpi
def test_a_traced_user_model_with_batchnorm_trains_like_one_process(tmp_path):
    """examples/models/rescnn.py (residual blocks with BatchNorm, cut by torch's tracer) on 2
    ranks, one micro-batch per step, stages in NHWC: weights AND buffers after 2 fp64 steps
    equal one float64 process's (`run --train --check`). The held-out passes once ran the
    training-mode trace (BatchNorm's batch statistics and running-stat updates are baked into
    the traced graph): 250 evaluation passes moved the running statistics (relerr 0.51) and
    the batch count (252 != 2)."""
    out = tmp_path / "r.jsonl"
    proc = run(
        [sys.executable, "-m", "scalelab", "run", "--model", "examples/models/rescnn.py:rescnn",
         "--input-shape", "3,16,16", "--strategy", "pipeline", "--engine", "torch", "--ranks", "2",
         "--microbatches", "1", "--schedule", "gpipe", "--channels-last", "--batch", "8",
         "--train", "--steps", "2", "--train-size", "16", "--heldout-size", "64", "--dtype",
         "fp64", "--check", "--quiet", "--out", str(out)],
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FutureWarning" not in proc.stderr  # torch's LeafSpec deprecation, once per rank
    rec = json.loads(out.read_text().splitlines()[-1])
    check = rec["train_check"]
    assert rec["check_passed"] and check["relerr"] < 1e-12 and not check["counts_differ"], check


def test_a_recut_of_a_traced_model_starts_its_stages_where_the_tracer_splits():
    """--rebalance's timed re-cut may put a stage boundary at a root op (path None); the
    tracer then raised on one run in four (rescnn, zbv). The re-cut moves to the next module
    the tracer splits before, or where none fits, the current cut stays."""
    from types import SimpleNamespace

    from scalelab.strategies.pipeline.torch_engine import TorchPipeline

    layers = [SimpleNamespace(path=p) for p in ("stem", None, "blocks.0", "blocks.1", "head")]
    me = SimpleNamespace(
        blocks=SimpleNamespace(cut_points=frozenset({"blocks.0", "blocks.1", "head"})),
        layers=layers,
        counts=[3, 2],
    )
    assert TorchPipeline._snapped(me, [1, 4]) == [2, 3]  # began at the root op
    assert TorchPipeline._snapped(me, [4, 1]) == [4, 1]  # began at head: kept
    assert TorchPipeline._snapped(me, [1, 1, 1, 1, 1]) == [3, 2]  # 5 stages cannot fit
    assert TorchPipeline._snapped(SimpleNamespace(blocks=None), [1, 4]) == [1, 4]
