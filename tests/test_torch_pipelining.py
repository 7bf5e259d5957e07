"""`pipeline --engine torch`: every torch.distributed.pipelining schedule on real gloo ranks
against one process (fp64 weights after 2 SGD steps), the executed action order against the
schedule's own lists, the replayed bubble against closed forms, and the one-line refusals
(tests/programs/torchpp_check.py runs the ranks)."""

from __future__ import annotations

import pytest

from scalelab.strategies.pipeline.torch_sim import replay, simulated_bubble
from torchpp_helpers import check_training, torchrun

# torch 2.13: with the split backward (I then W) the mlp's cut into 4 stages, three of them
# without parameters, trained differently from one process (weights off by 2.6e-3 to 6.2e-3
# after 2 steps); deepstack and VGG-16 cut into 4 stages agree to 1e-17. Such a cut is now
# refused with one line (pipeline_torch._refuse_split_backward_without_parameters).
SPLIT_BACKWARD_MLP = {("mlp", "zero-bubble"), ("mlp", "zbv"), ("mlp", "dualpipev")}


@pytest.mark.mpi
@pytest.mark.slow
def test_every_schedule_trains_like_one_process():
    """deepstack, mlp and VGG-16 at 32x32 (64-wide heads), each of the 7 schedules on 2
    ranks: the weights after 2 steps equal one process's; each rank ran exactly the schedule's
    action list; inference through interleaved-1f1b and zbv gives the one-process logits."""
    results = torchrun(2, "pp")
    assert len(results) == 23
    refused = {(r["workload"], r["schedule"]) for r in results if "refused" in r}
    assert refused == SPLIT_BACKWARD_MLP
    for r in results:
        if "refused" in r:
            assert "without parameters" in r["refused"] and "stage" in r["refused"], r
            continue
        if not r["train"]:
            assert r["relerr"] < 1e-12, r
            continue
        check_training(r)
        assert r["executed"] == r["actions"], r["schedule"]
        assert 0.0 <= r["bubble_simulated"] < 1.0 and 0.0 <= r["bubble_measured"] < 1.0


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
