"""The on-disk tuning cache (fast/tuning.py): a second process reuses the first one's stage
choices without timing, entries survive concurrent writers, and a cache that is corrupt,
switched off or from another machine is never trusted."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

from scalelab.fast import tuning
from scalelab.fast.pipeline import choose
from scalelab.fast.registry import Candidate, Plan, Stage

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALELAB_TUNING_CACHE", str(tmp_path))
    return tmp_path


def _plan() -> Plan:
    def slow(x):  # the torch reference: the same function, in many small kernels
        out = x.clone()
        for _ in range(50):
            out = out * 1.0
        return out * 2

    return Plan([Stage("double", [Candidate("torch", slow), Candidate("add", lambda x: x + x)])])


def test_second_choice_comes_from_the_cache_without_timing(cache):
    x = torch.randn(64, 64)
    _, first = choose(_plan(), x, CPU, kernels=True, timing=True, log=print, tag="t")
    assert not first[0].cached and set(first[0].seconds) == {"torch", "add"}
    files = list(cache.glob("tuning-*.json"))
    assert len(files) == 1
    entries = json.loads(files[0].read_text())["entries"]
    assert list(entries.values()) == [first[0].name]
    pipe, again = choose(_plan(), x, CPU, kernels=True, timing=True, log=print, tag="t")
    assert again[0].cached and again[0].seconds == {} and again[0].name == first[0].name
    assert torch.equal(pipe(x), x * 2)
    # another shape is another key: timed again
    _, other = choose(_plan(), torch.randn(8, 8), CPU, kernels=True, timing=True, log=print)
    assert not other[0].cached and other[0].seconds


def test_a_cached_winner_that_disagrees_is_timed_again(cache):
    x = torch.randn(16, 16)
    key = tuning.entry_key("t", "double", tuple(x.shape), x.dtype, ["add"])
    tuning.store("cpu", key, "add")
    wrong = Plan(
        [Stage("double", [Candidate("torch", lambda v: v * 2), Candidate("add", torch.neg)])]
    )
    _, choices = choose(wrong, x, CPU, kernels=True, timing=True, log=lambda _: None, tag="t")
    assert choices[0].name == "torch" and "add" in choices[0].rejected
    assert not choices[0].cached


def test_cache_off_corrupt_and_foreign_are_misses(cache, monkeypatch):
    tuning.store("cpu", "k", 1)
    assert tuning.lookup("cpu", "k") == 1
    path = next(cache.glob("tuning-*.json"))
    path.write_bytes(b"\xff\xfe not json")
    assert tuning.lookup("cpu", "k") is None
    tuning.store("cpu", "k", 2)  # a corrupt file is replaced whole
    assert json.loads(path.read_text())["entries"] == {"k": 2}
    other = {**tuning.fingerprint("cpu"), "torch": "0.0"}
    monkeypatch.setattr(tuning, "fingerprint", lambda _d: other)
    assert tuning.lookup("cpu", "k") is None  # another torch: another file
    monkeypatch.setenv("SCALELAB_TUNING_CACHE", "off")
    tuning.store("cpu", "k", 3)
    assert tuning.lookup("cpu", "k") is None


def _writer(folder: str, rank: int) -> None:
    import os

    os.environ["SCALELAB_TUNING_CACHE"] = folder
    for i in range(20):
        tuning.store("cpu", f"r{rank}-{i}", i)


def test_concurrent_writers_lose_nothing(cache):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(cache), r)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    entries = json.loads(next(cache.glob("tuning-*.json")).read_text())["entries"]
    assert entries == {f"r{r}-{i}": i for r in range(4) for i in range(20)}
