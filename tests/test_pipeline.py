"""The pipeline strategy: schedules and their bubble against closed forms, the layer lists
against the models' own forward, the auto split against brute force, manual placement against
`local`, and 2 and 3 real gloo ranks against one process (tests/programs/pipe_check.py)."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

from scalelab.comm.launch import torchrun_command
from scalelab.config import RunConfig
from scalelab.layout import partition as part
from scalelab.layout import profiling
from scalelab.layout.schedule import (
    SCHEDULES,
    bubble_formula,
    simulate,
)
from scalelab.record import read_records
from scalelab.run.runner import execute
from scalelab.strategies.pipeline.report import stage_summary
from scalelab.workloads import WORKLOADS
from scalelab.workloads.layers import describe

PROGRAM = str(Path(__file__).parent / "programs" / "pipe_check.py")
STACK = {"image_size": 8, "convs": 3, "fcs": 1, "num_classes": 10}


def _workload(name: str, **kw):
    return WORKLOADS.get(name)(RunConfig(workload=name, **kw))


# --- schedules and the bubble -----------------------------------------------------------------


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("k, m", [(1, 1), (2, 1), (2, 4), (3, 4), (4, 8), (4, 2)])
def test_op_lists_are_complete_and_respect_dependencies(schedule, k, m):
    for s in range(k):
        ops = SCHEDULES[schedule](s, k, m, True)
        assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(m))
        # Activations alive at once: all M for GPipe, at most K - s for 1F1B.
        alive = max(
            sum(1 for op in ops[: n + 1] if op[0] == "F")
            - sum(1 for op in ops[: n + 1] if op[0] == "B")
            for n in range(len(ops))
        )
        assert alive == (m if schedule == "gpipe" else min(k - s, m))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("k, m", [(2, 1), (2, 8), (3, 4), (4, 16), (8, 8)])
def test_equal_stages_leave_the_formula_bubble(schedule, k, m):
    sim = simulate(schedule, m, [1.0] * k, [2.0] * k)
    assert sim.makespan == pytest.approx((m + k - 1) * 3.0)
    assert sim.mean_bubble == pytest.approx(bubble_formula(k, m))
    assert bubble_formula(k, m) == pytest.approx((k - 1) / (m + k - 1))


def test_unequal_stages_match_the_fill_drain_closed_form():
    """Forward-only pipelining of M items through stages taking t_s each ends at
    sum(t) + (M - 1) * max(t): the slowest stage paces the steady state."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        k, m = int(rng.integers(1, 6)), int(rng.integers(1, 10))
        t = list(rng.uniform(0.1, 2.0, size=k))
        sim = simulate("gpipe", m, t, [0.0] * k, train=False)
        assert sim.makespan == pytest.approx(sum(t) + (m - 1) * max(t))


def test_communication_delays_every_hop():
    sim = simulate("gpipe", 1, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], t_comm=0.5)
    assert sim.makespan == pytest.approx(6 * 1.0 + 4 * 0.5)


class _FakeStrategy:
    """Just what stage_summary reads."""

    def __init__(self, train: bool) -> None:
        self.cfg = RunConfig(workload="deepstack", train=train)
        self.device = torch.device("cpu")
        self.layers = [describe(f"l{i}", torch.nn.Identity()) for i in range(4)]
        self.counts = [3, 1]
        self.stage = torch.nn.Linear(2, 2)

        class _Comm:
            rank = 0

        self.comm = _Comm()


def test_measured_bubble_from_synthetic_phases():
    """A stage that computed 1.8 s of a 2.0 s schedule idled 10%; the optimizer step and the
    first (warm-up) training step stay out of the account."""
    lap = {"forward": 0.6, "backward": 1.2, "recv": 0.2, "step": 0.1, "h2d": 0.05}
    laps = [{"forward": 9.0, "step": 9.0}] + [lap] * 3
    walls = [20.0] + [2.15] * 3
    fake = _FakeStrategy(train=True)
    names = [layer.name for layer in fake.layers[:3]]
    row = stage_summary(fake.cfg, 0, fake.device, names, 6, laps, walls)
    assert row["span_s"] == pytest.approx(2.0)
    assert row["bubble"] == pytest.approx(0.1)
    assert row["layers"] == ["l0", "l2"] and row["n_layers"] == 3
    assert row["step_s"] == [2.15] * 3


# --- layer lists -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, kw",
    [
        ("deepstack", STACK),
        ("vgg16", {"image_size": 32, "num_classes": 10}),
        ("vgg16", {"image_size": 32, "num_classes": 5, "swap_relu_pool": True}),
        ("alexnet", {"image_size": 67, "num_classes": 10}),
        ("alexnet", {"image_size": 67, "num_classes": 10, "swap_relu_pool": True}),
    ],
)
def test_layer_lists_compose_to_the_models_forward(name, kw):
    w = _workload(name, **kw)
    model = w.build_model().double()
    layers = w.layers(model)
    x = w.prepare(w.synthetic_inputs(2, seed=1).x)
    with torch.no_grad():
        want = model(x)
        h = x
        for layer in layers:
            h = layer.module.double()(h)
    assert torch.equal(h, want)
    params = {id(p) for layer in layers for p in layer.module.parameters()}
    assert params == {id(p) for p in model.parameters()}  # the model's own weights


def test_unsequential_model_is_refused():
    from scalelab.errors import UsageError
    from scalelab.workloads.base import Workload

    class Wrapped(torch.nn.Module):  # one child, a forward of its own: no layer list
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

    w = _workload("deepstack", **STACK)
    with pytest.raises(UsageError, match="not a sequence of layers"):
        Workload.layers(w, Wrapped())  # the base default, as a workload without layers()


# --- splitting --------------------------------------------------------------------------------


def _random_profiles(rng, n):
    return [
        part.LayerProfile(
            f"l{i}",
            float(rng.uniform(0.1, 3.0)),
            int(rng.integers(0, 100)),
            int(rng.integers(1, 50)),
            in_bytes=int(rng.integers(1, 50)),
            saved_input=bool(rng.integers(0, 2)),
            saved_output=bool(rng.integers(0, 2)),
            saved_other=int(rng.integers(0, 10)),
        )
        for i in range(n)
    ]


def _brute_force(profiles, k, mem):
    """Every split into k non-empty parts: the smallest slowest stage among those that fit."""
    n, best = len(profiles), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = list(zip((0, *cuts), (*cuts, n)))
        if all(mem.fits(profiles[a:b], s) for s, (a, b) in enumerate(bounds)):
            t = max(sum(p.seconds for p in profiles[a:b]) for a, b in bounds)
            best = t if best is None else min(best, t)
    return best


def test_auto_balance_matches_brute_force_within_memory():
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(60):
        n, k = int(rng.integers(2, 9)), int(rng.integers(1, 4))
        if k > n:
            continue
        profiles = _random_profiles(rng, n)
        cap = float(rng.uniform(200, 900))
        mem = part.memory_model(cap, k, 3, True, "1f1b" if rng.integers(0, 2) else "gpipe")
        want = _brute_force(profiles, k, mem)
        if want is None:
            continue
        counts = part.balance_auto(profiles, k, mem)
        assert len(counts) == k and min(counts) >= 1 and sum(counts) == n
        got = [profiles[a:b] for a, b in part.bounds(counts)]
        assert all(mem.fits(stage, s) for s, stage in enumerate(got))
        assert max(sum(p.seconds for p in stage) for stage in got) == pytest.approx(want)
        checked += 1
    assert checked > 20


def test_balance_auto_splits_whatever_the_float_sum_rounds_to():
    """Layer times whose running float sum (2.45) rounds above their exact sum
    (2.4499999999999997, math.fsum and Python 3.12's sum()): a time bound of the exact sum
    must not leave the last layer out (VGG-16's 1-stage prediction failed so on Python 3.12)."""
    seconds = [0.7, 0.7, 0.05, 0.7, 0.2, 0.1]
    profiles = [part.LayerProfile(f"l{i}", t, 0, 0) for i, t in enumerate(seconds)]
    mem = part.memory_model(None, 1, 4, True, "gpipe")
    assert part._pack(profiles, 1, mem, math.fsum(seconds)) == [6]
    assert part.balance_auto(profiles, 1, mem) == [6]
    assert part.balance_auto(profiles, 2, part.memory_model(None, 2, 4, True, "gpipe")) == [2, 4]


def test_rebalance_scales_each_stage_by_its_measured_time():
    """Six layers profiled at 1 s each, cut 3 | 3; the stages then time themselves at 6 s and
    3 s: layers of stage 0 are worth 2 s, of stage 1 1 s. Over [2, 2, 2, 1, 1, 1] the cuts
    1 | 5, 2 | 4, 3 | 3 give slowest stages of 7, 5 and 6 s: 2 | 4. Equal measured times keep
    the cut."""
    profiles = [part.LayerProfile(f"l{i}", 1.0, 0, 0) for i in range(6)]
    mem = part.memory_model(None, 2, 4, True, "gpipe")
    assert part.balance_auto(profiles, 2, mem) == [3, 3]
    assert part.rebalance(profiles, [([3, 3], [6.0, 3.0])], mem) == [2, 4]
    assert part.rebalance(profiles, [([3, 3], [3.0, 3.0])], mem) == [3, 3]
    # A stage with nothing measured (0 s) keeps its profiled times.
    assert part.rebalance(profiles, [([3, 3], [0.0, 3.0])], mem) == [3, 3]


def test_rebalance_fits_every_cut_timed():
    """True layer seconds [1, 1, 3, 3, 1, 1], profiled at 1 s each. Cut 3 | 3 times 5 | 5:
    one ratio per stage (5/3 each) keeps 3 | 3. Add cut 2 | 4 (2 | 8): the segments
    [0,2) [2,3) [3,6) are then fitted exactly, to 1, 3 and 5/3 s per layer (the last is the
    segment's mean), which reproduce every stage timed and which 3 | 3 (5 | 5) balances."""
    profiles = [part.LayerProfile(f"l{i}", 1.0, 0, 0) for i in range(6)]
    mem = part.memory_model(None, 2, 4, True, "gpipe")
    timed = [([3, 3], [5.0, 5.0]), ([2, 4], [2.0, 8.0])]
    fitted = [p.seconds for p in part.fit_layer_seconds(profiles, timed)]
    np.testing.assert_allclose(fitted, [1, 1, 3, 5 / 3, 5 / 3, 5 / 3])
    for counts, measured in timed:
        got = [sum(fitted[a:b]) for a, b in part.bounds(counts)]
        np.testing.assert_allclose(got, measured)
    assert part.rebalance(profiles, timed, mem) == [3, 3]
    # Inconsistent times (one stage 12% slow): least squares relative to each measurement
    # spreads the misfit, every stage within it, instead of trusting one of them.
    noisy = [([3, 3], [5.0, 5.0]), ([2, 4], [2.0, 9.0])]
    fitted = [p.seconds for p in part.fit_layer_seconds(profiles, noisy)]
    for counts, measured in noisy:
        got = [sum(fitted[a:b]) for a, b in part.bounds(counts)]
        np.testing.assert_allclose(got, measured, rtol=0.07)
    assert part.rebalance(profiles, noisy, mem) == [3, 3]


@pytest.mark.mpi
def test_compiled_stages_train_like_one_eager_process(tmp_path):
    """--compile on 2 gloo ranks: Inductor really compiled each stage (graphs counted in the
    record), the re-cut timed the compiled stages, and in fp64 the losses equal an eager
    single process's to rounding (fusion reorders no reduction across the batch here)."""
    stack = ["deepstack", "--image-size", "8", "--convs", "3", "--fcs", "1", "--num-classes", "10"]
    common = ["--train", "--batch", "6", "--steps", "2", "--train-size", "12",
              "--heldout-size", "6", "--dtype", "fp64", "--quiet"]  # fmt: skip
    local = _cli(tmp_path, *stack, "--strategy", "local", *common)
    pipe = _cli(tmp_path, *stack, "--strategy", "pipeline", "--ranks", "2", "--stages", "2",
                "--microbatches", "3", "--compile", *common)  # fmt: skip
    assert pipe["pipeline"]["compiled"] and pipe["pipeline"]["balance_rounds"]
    assert all(s["compiled_graphs"] >= 1 for s in pipe["pipeline"]["stage"])
    np.testing.assert_allclose(pipe["loss"], local["loss"], rtol=1e-12)


def test_compile_is_refused_by_eager_strategies(cli, tmp_path):
    results = tmp_path / "runs.jsonl"
    code, _, err = cli("run", "mlp", "--strategy", "mpi", "--compile", "--out", results)
    assert code == 2 and "ddp, fsdp, local, pipeline" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not results.exists()


@pytest.mark.mpi
def test_rebalance_round_recorded_and_training_unchanged(tmp_path):
    """--balance auto with up to two re-cut rounds on 2 gloo ranks: the record lists each cut
    timed (each once) with both stages' seconds from a real pipelined pass, the run keeps the
    cut whose slowest stage was fastest, and the losses still equal one process's (a cut
    changes where the arithmetic runs, never the arithmetic)."""
    stack = ["deepstack", "--image-size", "8", "--convs", "3", "--fcs", "1", "--num-classes", "10"]
    common = ["--train", "--batch", "6", "--steps", "2", "--train-size", "12",
              "--heldout-size", "6", "--dtype", "fp64", "--quiet"]  # fmt: skip
    local = _cli(tmp_path, *stack, "--strategy", "local", *common)
    pipe = _cli(tmp_path, *stack, "--strategy", "pipeline", "--ranks", "2", "--stages", "2",
                "--microbatches", "3", "--rebalance", "2", *common)  # fmt: skip
    rounds = pipe["pipeline"]["balance_rounds"]
    assert 1 <= len(rounds) <= 3 and sum(rounds[0]["balance"]) == sum(pipe["pipeline"]["balance"])
    assert all(len(r["stage_s"]) == 2 and min(r["stage_s"]) > 0 for r in rounds)
    cuts = [tuple(r["balance"]) for r in rounds]
    assert len(set(cuts)) == len(cuts)
    fastest = min(rounds, key=lambda r: max(r["stage_s"]))
    assert pipe["pipeline"]["balance"] == fastest["balance"]
    np.testing.assert_allclose(pipe["loss"], local["loss"], rtol=1e-12)


def test_saved_activations_counted_once_per_tensor():
    """conv saves its input, ReLU its output, the next conv that same output as its input:
    one conv + ReLU pair keeps one map per micro-batch, not two."""
    w = _workload("deepstack", **STACK)
    model = w.build_model()
    layers = w.layers(model)[:7]  # cast, 3 x (conv, relu)
    x = w.prepare(w.synthetic_inputs(4, seed=0).x)
    cpu = torch.device("cpu")
    prof = profiling.profile_layers(layers, x, cpu, torch.float32, True, nullcontext)
    one_map = 4 * 64 * 8 * 8 * 4  # batch 4, 64 x 8 x 8, fp32
    assert [p.saved_input for p in prof[1:]] == [True, False] * 3
    assert [p.saved_output for p in prof[1:]] == [False, True] * 3
    mem = part.memory_model(None, 1, 1, True, "gpipe")
    acts = mem.stage_bytes(prof, 0) - 2 * sum(p.param_bytes for p in prof) - 2 * one_map
    assert acts == 4 * one_map  # the input, then each ReLU's output


class _SeesGrad(torch.nn.Module):
    """Identity that notes whether its input carries a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.requires_grad)
        return x * 1.0


def test_profile_asks_for_input_gradients_only_after_the_first_parameter():
    """Training never computes the gradient of the model's input, so the profile must not
    time it either (for VGG-16 it was the first conv's dgrad, ~1 ms a micro-batch)."""
    before, after = _SeesGrad(), _SeesGrad()
    mods = [before, torch.nn.Linear(3, 3), after]
    layers = [describe(str(i), m) for i, m in enumerate(mods)]
    x = torch.randn(4, 3)
    profiling.profile_layers(layers, x, torch.device("cpu"), torch.float32, True, nullcontext)
    assert before.seen and not any(before.seen)
    assert after.seen and all(after.seen)


def test_explicit_balance_is_checked():
    from scalelab.errors import UsageError

    assert part.parse_balance("5,7", 12, 2) == [5, 7]
    assert part.parse_balance("auto", 12, 2) is None
    for bad in ("5,6", "12", "0,12", "a,b"):
        with pytest.raises(UsageError, match="balance"):
            part.parse_balance(bad, 12, 2)


def test_min_stages_is_the_fewest_that_fit():
    profiles = [part.LayerProfile(f"l{i}", 1.0, 100, 0) for i in range(10)]  # params only

    def mem(k):
        return part.memory_model(450.0, k, 1, False, "gpipe")

    assert part.min_stages(profiles, mem, 8) == 3  # 4 layers (400 B) per stage at most
    assert part.min_stages(profiles, mem, 2) is None


# --- one-process paths ------------------------------------------------------------------------


def _run(**kw):
    base = dict(workload="deepstack", quiet=True, iters=1, warmup=0, **STACK)
    return execute(RunConfig(**{**base, **kw}), None)


def test_manual_placement_matches_the_oracle_and_local_training(tmp_path):
    rec = _run(strategy="pipeline", placement="manual", stages=3, dtype="fp64", check=True).record
    assert rec["relerr"] < 1e-12
    notes = rec["pipeline"]
    assert notes["placement"] == "manual" and len(notes["stage_layers"]) == 3
    assert 0 < sum(notes["stage_busy"]) <= 1.0  # one stage works at a time
    train = dict(train=True, steps=2, train_size=8, heldout_size=2, batch=4, dtype="fp64")
    a = _run(strategy="pipeline", placement="manual", stages=2, balance="5,9", **train)
    b = _run(strategy="local", **train)
    np.testing.assert_allclose(a.record["loss"], b.record["loss"], rtol=1e-12)


def test_one_stage_pipeline_runs_in_process():
    rec = _run(strategy="pipeline", stages=1, microbatches=3, batch=5, dtype="fp64", check=True)
    assert rec.record["relerr"] < 1e-12
    assert rec.record["pipeline"]["bubble_formula"] == 0.0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--stages", "2"], "pass --ranks 2"),
        (["--stages", "1", "--balance", "3,4"], "--balance 3,4"),
        (["--stages", "1", "--microbatches", "9", "--batch", "4"], "smaller than --microbatches"),
        (["--stages", "1", "--schedule", "zigzag"], "unknown --schedule"),
        (["--placement", "telepathy"], "unknown --placement"),
    ],
)
def test_bad_pipeline_options_one_line_exit_2(cli, tmp_path, args, needle):
    results = tmp_path / "runs.jsonl"
    code, out, err = cli("run", "deepstack", "--strategy", "pipeline", *args, "--out", results)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not results.exists()


def test_regularised_loss_is_refused(cli, tmp_path):
    code, _, err = cli(
        "run", "mlp", "--strategy", "pipeline", "--stages", "1", "--train", "--no-record"
    )
    assert code == 2 and "cross-entropy" in err


# --- real ranks -------------------------------------------------------------------------------


def _torchrun(ranks: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [*torchrun_command(ranks), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_pipeline_over_gloo_equals_one_process(ranks, tmp_path):
    """Inference: the same logits; training: the same weights after the same steps, the same
    losses; a sleeping stack: the textbook bubble; through the runner: the oracle check and
    a record with every stage (tests/programs/pipe_check.py)."""
    results = tmp_path / "runs.jsonl"
    proc = _torchrun(ranks, PROGRAM, str(results))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # Ranks print concurrently: their lines can interleave mid-line, so find the words.
    assert sorted(re.findall(r"rank (\d+) ok", proc.stdout)) == [str(r) for r in range(ranks)]
    lines = proc.stdout.splitlines()
    outcomes = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(outcomes) == 4
    for r in outcomes:
        tol = 1e-10 if r.get("dtype", "fp32") == "fp64" else 1e-5
        if "check_passed" in r:
            assert r["check_passed"] and r["relerr"] < 1e-12, r
            continue
        assert len(r["balance"]) == ranks, r
        if "weight_diff" not in r:
            assert r["relerr"] < tol, r
            continue
        assert r["moved"] > 1e-3 and r["weight_diff"] < tol * r["moved"], r
        np.testing.assert_allclose(r["loss_pipe"], r["loss_local"], rtol=tol)
        assert r["acc_pipe"] == r["acc_local"]
        if r["workload"] == "sleepstack":  # equal stage times: the textbook bubble
            assert r["bubble_simulated"] == pytest.approx(r["bubble_formula"], abs=0.02), r
            assert r["bubble_formula"] - 0.01 < r["bubble_measured"] < r["bubble_formula"] + 0.06
    if ranks == 2:
        (rec,) = read_records(results)
        assert rec["strategy"] == "pipeline" and rec["ranks"] == 2 and rec["check_passed"]
        assert len(rec["rank_phases"]) == 2 and rec["bytes"]["send"] > 0
        notes = rec["pipeline"]
        assert notes["bubble_formula"] == pytest.approx(1 / 4)
        assert [s["rank"] for s in notes["stage"]] == [0, 1]
        assert sum(notes["balance"]) == len(notes["layer_profile"])


# --- GPUs --------------------------------------------------------------------------------------

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


def _cli(tmp_path, *args):
    out = tmp_path / "runs.jsonl"
    cmd = [sys.executable, "-m", "scalelab", "run", *args, "--out", str(out)]
    try:
        # bounded well inside the GPU suite's 300 s: once a 2-GPU run of this file
        # (62 s alone) was still running when the suite was killed, its output lost with it
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"scalelab run {' '.join(args)} ran past 180 s; stderr ends:\n{err[-3000:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_records(out)[-1]


@pytest.mark.gpu
@two_gpus
def test_pipeline_on_two_gpus_agrees_with_one(tmp_path):
    common = ["deepstack", "--device", "cuda", "--dtype", "fp64", "--batch", "6"]
    common += ["--image-size", "16", "--convs", "4", "--fcs", "2", "--num-classes", "10"]
    pipe = ["--strategy", "pipeline", "--ranks", "2", "--stages", "2", "--microbatches", "3"]
    rec = _cli(tmp_path, *common, *pipe, "--check")
    assert rec["check_passed"] and rec["relerr"] < 1e-12
    assert [s["device"] for s in rec["pipeline"]["stage"]] == ["cuda:0", "cuda:1"]
    train = ["--train", "--steps", "2", "--train-size", "12", "--heldout-size", "6"]
    a, b = tmp_path / "pipe.pt", tmp_path / "local.pt"
    _cli(tmp_path, *common, *pipe, *train, "--schedule", "1f1b", "--save-weights", str(a))
    _cli(tmp_path, *common, *train, "--save-weights", str(b))
    wa, wb = torch.load(a), torch.load(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@two_gpus
def test_vgg16_bf16_channels_last_pipeline_and_manual_split_on_two_gpus(tmp_path):
    common = ["vgg16", "--device", "cuda", "--image-size", "64", "--num-classes", "10"]
    rec = _cli(
        tmp_path,
        *common,
        "--strategy",
        "pipeline",
        "--ranks",
        "2",
        "--stages",
        "2",
        "--dtype",
        "bf16",
        "--channels-last",
        "--batch",
        "16",
        "--microbatches",
        "4",
        "--check",
    )
    assert rec["check_passed"]
    compiled = _cli(tmp_path, *common, "--strategy", "pipeline", "--ranks", "2", "--stages", "2",
                    "--dtype", "bf16", "--channels-last", "--batch", "16", "--microbatches", "4",
                    "--compile", "--check")  # fmt: skip
    assert compiled["check_passed"]
    assert all(s["compiled_graphs"] >= 1 for s in compiled["pipeline"]["stage"])
    manual = _cli(
        tmp_path,
        *common,
        "--strategy",
        "pipeline",
        "--placement",
        "manual",
        "--stages",
        "2",
        "--dtype",
        "fp32",
        "--check",
        "--batch",
        "8",
    )
    assert manual["check_passed"] and manual["pipeline"]["devices"] == ["cuda:0", "cuda:1"]


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 4])
def test_gpipe_training_on_gpus_does_not_hang_and_equals_1f1b(stages, tmp_path):
    """GPipe's first backward send meets a receive posted long before (in a group with the
    last forward send): without the links opened at setup, NCCL hung here on 2 H200s."""
    if torch.cuda.device_count() < stages:
        pytest.skip(f"needs {stages} CUDA GPUs")
    common = ["vgg16", "--device", "cuda", "--image-size", "64", "--num-classes", "10"]
    common += ["--strategy", "pipeline", "--ranks", str(stages), "--stages", str(stages)]
    common += ["--dtype", "fp32", "--channels-last", "--train", "--batch", "32"]
    common += ["--microbatches", "8", "--steps", "3", "--train-size", "96", "--heldout-size", "32"]
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        runs[schedule] = _cli(tmp_path, *common, "--schedule", schedule, "--json")
    assert runs["gpipe"]["steps"] == runs["1f1b"]["steps"] == 3
    np.testing.assert_allclose(runs["gpipe"]["loss"], runs["1f1b"]["loss"], rtol=1e-3)
    for stage in runs["1f1b"]["pipeline"]["stage"]:  # the median step's timeline, in order
        spans = stage["timeline_ms"]
        names = [name for name, _, _ in spans]
        assert names.count("forward") == names.count("backward") == 8, names
        assert [a for _, a, _ in spans] == sorted(a for _, a, _ in spans)
        assert all(b >= a for _, a, b in spans)
