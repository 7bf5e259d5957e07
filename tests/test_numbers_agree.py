"""Issue 38: a figure scalelab prints agrees with the figures beside it, or carries a flag
saying which assumption broke. One test (or a few) per numbered case of the issue, on
constructed records or cheap real runs (tiny fp64 models, one thread)."""

from __future__ import annotations

import pytest
import torch

from scalelab.instrument import threads as T
from scalelab.record import read_records


# --- 1. threads chosen from the CPUs free for the run -----------------------------------------
@pytest.mark.parametrize(
    "allowed, ranks, others, default, want, busy",
    [
        (2, 1, 1.95, 2, 1, True),  # the 2-core host under load: one thread
        (2, 1, 0.0, 2, 2, False),  # an idle host: torch's default
        (4, 2, 0.0, 4, 2, False),  # two ranks share four idle CPUs
        (4, 2, 3.5, 4, 1, True),  # ... a busy host: one per rank
        (16, 1, 0.0, 4, 4, False),  # never above torch's default
        (2, 4, 0.0, 2, 1, False),  # more ranks than CPUs: one each (oversubscription warns)
        (8, 2, None, 8, 4, False),  # no /proc/stat: the allowance shared
    ],
)
def test_threads_are_the_free_cpus_share(allowed, ranks, others, default, want, busy):
    got = T.choose(allowed, "affinity", ranks, others, default)
    assert got.threads == want and got.source == "chosen"
    assert got.why.startswith("host busy") == busy, got.why
    assert f"torch's default {default}" in got.why


def test_threads_given_or_on_a_gpu_are_not_chosen():
    assert T.pick(3, "cpu", 1, 2).threads == 3
    assert T.pick(None, "cuda", 1, 8) == T.ThreadChoice(
        threads=8, source="torch default", why=T.pick(None, "cuda", 1, 8).why
    )


def test_a_run_on_a_busy_host_takes_one_thread_and_says_why(cli, tmp_path, monkeypatch):
    """No --threads, others keep every CPU busy: the run takes one thread (torch's default is
    put back after it), the record and the summary say what was chosen and why."""
    from scalelab.instrument import host_checks

    allowed = host_checks.cpu_allowance()[0]
    monkeypatch.setattr(T, "others_busy", lambda cpus, seconds=0.1: allowed)
    before = torch.get_num_threads()
    out = tmp_path / "runs.jsonl"
    code, stdout, err = cli("run", "mlp", "--hidden", 16, "--batch", 8, "--iters", 2,
                            "--dtype", "fp64", "--out", out)  # fmt: skip
    assert code == 0, err
    assert torch.get_num_threads() == before
    (rec,) = read_records(out)
    assert rec["threads"]["threads"] == 1 == rec["host"]["torch_threads"]
    assert rec["threads"]["source"] == "chosen" and "host busy" in rec["threads"]["why"]
    assert "threads: 1 per rank (chosen: host busy" in stdout
    code, stdout, err = cli("run", "mlp", "--hidden", 16, "--batch", 8, "--iters", 2,
                            "--dtype", "fp64", "--threads", 1, "--out", out)  # fmt: skip
    assert code == 0, err
    assert read_records(out)[-1]["threads"]["source"] == "--threads"
