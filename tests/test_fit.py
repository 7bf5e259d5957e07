"""The fit finder: doubling + bisection against brute force, the fake allocator's limit and its
release discipline, the memory estimate against a hand count, and `scalelab fit` end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from scalelab.cli.commands.fit import config_argv, parse_size
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.orchestration.fit import EstimatedLimit, Search, attempt, estimate_bytes, largest
from scalelab.record import read_records

MiB = 2**20


@pytest.mark.parametrize("most", [None, 7, 64, 1000])
def test_largest_agrees_with_brute_force_in_log_tries(most):
    for threshold in [0, 1, 2, 3, 5, 8, 13, 64, 99, 100]:
        calls = []

        def fits(n, t=threshold, calls=calls):
            calls.append(n)
            return n <= t

        want = threshold if most is None else min(threshold, most)
        assert largest(fits, most=most) == want
        assert len(calls) <= 2 * math.log2(max(want, 2)) + 3, calls


class _Linear:
    """A trial whose bytes are a * convs + b * fcs + c * batch; runs nothing."""

    def __init__(self, a: int, b: int, c: int) -> None:
        self.a, self.b, self.c = a, b, c

    def __call__(self, cfg: RunConfig) -> tuple[int, int]:
        return self.a * cfg.convs + self.b * cfg.fcs, self.c * cfg.batch


def _fake(limit: float, a: int = 49, b: int = 128, c: int = 0) -> EstimatedLimit:
    return EstimatedLimit(limit, estimate=_Linear(a, b, c))


def test_stack_search_finds_the_closed_form_boundary():
    """(n, n) fits while 177 n <= limit: the seed's table has one kind of layer tip it over."""
    limit = 10_910
    search = Search(_fake(limit), RunConfig(workload="deepstack", batch=16), report=lambda p: None)
    n, _ = search.stack()
    assert n == limit // (49 + 128) == 61
    table = {(p.convs, p.fcs): p.fits for p in search.points}
    assert table[(61, 61)] and not table[(62, 62)]
    assert table[(62, 61)] == (limit >= 62 * 49 + 61 * 128)  # 10,846: fits
    assert table[(61, 62)] == (limit >= 61 * 49 + 62 * 128)  # 10,925: does not
    assert all(p.error and "fake allocator" in p.error for p in search.points if not p.fits)


def test_batch_search_and_its_cap():
    search = Search(_fake(1000, 0, 0, 7), RunConfig(workload="deepstack"), report=lambda p: None)
    assert search.batch() == 1000 // 7
    search = Search(_fake(1000, 0, 0, 7), RunConfig(workload="deepstack"), report=lambda p: None)
    assert search.batch(most=50) == 50


def test_memory_left_by_a_failed_try_must_be_released():
    """The fake allocator keeps a failed try's parameters: without release() the next try
    that would fit runs out of memory, as a GPU would after an unfreed OOM."""
    trial = _fake(1000)
    small = RunConfig(workload="deepstack", convs=1, fcs=1)  # 177 bytes
    big = RunConfig(workload="deepstack", convs=1, fcs=7)  # 945 bytes: fits an empty 1000
    trial(small)
    with pytest.raises(torch.OutOfMemoryError):
        trial(big)
    trial.release()
    assert trial.live == 0
    trial(big)  # fits once released
    point = attempt(_fake(100), small)  # attempt always releases
    assert not point.fits and point.error


def test_estimate_counts_weights_grads_momentum_and_activations():
    cfg = RunConfig(workload="deepstack", image_size=8, convs=2, fcs=1, batch=4, num_classes=10)
    params, acts = estimate_bytes(cfg)
    n_params = 2 * (64 * 64 * 9 + 64) + (64 * 4096 + 4096) + (4096 * 4096 + 4096) + 40970
    assert params == 2 * 4 * n_params  # fp32 weights + grads
    momentum = estimate_bytes(RunConfig(**{**cfg.to_dict(), "momentum": 0.9}))[0]
    assert momentum == 3 * 4 * n_params
    outputs = 4 * 64 * 64 + 64 + 4096 * 2 + 4096 * 2 + 10  # 2x(conv, relu), pool, proj...
    assert acts == 4 * 4 * (64 * 64 + outputs)  # batch 4, fp32, input + every output


def test_parse_size_and_config_argv():
    assert parse_size("10.91GiB") == pytest.approx(10.91 * 2**30)
    assert parse_size("512MB") == 512e6 and parse_size("2e9") == 2e9
    with pytest.raises(UsageError, match="mem-limit"):
        parse_size("lots")
    cfg = RunConfig(workload="deepstack", convs=3, train=True, channels_last=False, image_size=8)
    assert config_argv(cfg) == ["--image-size", "8", "--convs", "3", "--train"]


def test_cli_stack_search_on_cpu_with_a_limit(cli, tmp_path):
    out = tmp_path / "fit.jsonl"
    small = ["--image-size", "4", "--batch", "2", "--iters", "1", "--warmup", "0", "--quiet"]
    cfg = RunConfig(workload="deepstack", image_size=4, batch=2, convs=2, fcs=2)
    limit = sum(estimate_bytes(cfg)) + MiB  # (2, 2) fits, (3, 3) cannot
    code, stdout, err = cli("fit", "deepstack", "--mem-limit", str(limit), *small, "--out", out)
    assert code == 0, err
    assert "largest (n, n) stack that trains: 2" in stdout
    assert stdout.splitlines()[0].split()[:4] == ["convs", "fcs", "batch", "fits?"]
    (rec,) = read_records(out)
    assert rec["schema"] == "scalelab.fit/1" and rec["answer"]["convs"] == 2
    fits = {(p["convs"], p["fcs"]): p["fits"] for p in rec["points"]}
    assert fits[(2, 2)] and not fits[(3, 3)] and len(fits) == len(rec["points"])


def test_cli_proposes_the_fewest_stages(cli, tmp_path):
    out = tmp_path / "fit.jsonl"
    args = ["fit", "deepstack", "--find", "stages", "--convs", "2", "--fcs", "4"]
    args += ["--image-size", "4", "--batch", "2", "--microbatches", "2", "--quiet"]
    code, stdout, err = cli(*args, "--mem-limit", "500MiB", "--out", out)
    assert code == 0, err
    (rec,) = read_records(out)
    answer = rec["answer"]
    # 5 linear layers of 64 MiB kept twice (weights, grads): 640 MiB > 500 MiB on one device;
    # the model's budget per stage is 90% of 500 MiB = 450 MiB, so three fit on a stage.
    assert answer["stages"] == 2 and sum(answer["balance"]) == 2 * 2 + 1 + 2 + 2 * 4 + 2 + 1
    assert all(b <= 0.9 * 500 * MiB for b in answer["stage_bytes"])
    assert "estimated not to fit one device; fewest stages that fit (modelled): 2" in stdout
    assert json.dumps(rec)  # a plain JSON record


def test_a_try_the_fake_allocator_refused_is_an_estimate_not_an_out_of_memory():
    from scalelab.cli.commands.fit import fit_verdict
    from scalelab.orchestration.fit import EstimatedLimit, FitPoint

    trial = EstimatedLimit(MiB, estimate=lambda cfg: (MiB, MiB))
    with pytest.raises(torch.OutOfMemoryError) as refused:
        trial(RunConfig(workload="deepstack"))
    point = FitPoint(convs=3, fcs=3, batch=8, fits=False, error=str(refused.value))
    assert fit_verdict(point) == "over the limit (estimated, not run)"
    ran = FitPoint(convs=3, fcs=3, batch=8, fits=False, error="CUDA out of memory. Tried ...")
    assert fit_verdict(ran) == "out of memory"
    assert fit_verdict(FitPoint(2, 2, 8, True, seconds=float("nan"))) == "fits (estimated, not run)"


def test_cli_fit_refusals(cli):
    # No --mem-limit on CPU: the machine's available memory, tries estimated, not run.
    code, out, err = cli("fit", "deepstack", "--find", "stack", "--most", "4")
    assert code == 0 and "available memory" in err
    assert "largest (n, n) stack estimated to fit: 4 (estimated, not run)" in out
    assert "trains" not in out and "out of memory" not in err  # estimates are called estimates
    code, _, err = cli("fit", "vgg16", "--find", "stack", "--mem-limit", "1GB")
    assert code == 2 and "--find batch" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_oom_is_caught_and_freed_on_cuda(cli):
    """Under a 2 GiB allocator cap the search meets real OutOfMemoryErrors and still ends
    with the GPU's memory back where it started."""
    before = torch.cuda.memory_allocated()
    code, stdout, err = cli(
        "fit",
        "deepstack",
        "--device",
        "cuda",
        "--mem-limit",
        "2GiB",
        "--batch",
        "4",
        "--image-size",
        "32",
        "--iters",
        "1",
        "--warmup",
        "1",
    )
    assert code == 0, err
    n = int(stdout.split("stack that trains: ")[1].split()[0])
    assert 2 <= n < 40 and " no " in stdout
    # Back where it started, up to the cuBLAS/cuDNN workspaces the first GEMMs leave in the
    # caching allocator for good (65 MiB on 2x H200 with torch 2.11), far below the 2 GiB the
    # failed tries held.
    assert torch.cuda.memory_allocated() - before < 128 * 2**20
    torch.cuda.set_per_process_memory_fraction(1.0)
