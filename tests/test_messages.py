"""Refusals a new user meets first: each names the strategy and the option the user gave,
suggests the option meant, and comes before any rank starts (one line, exit 2, nothing
written), so no launcher's or rank's line reaches stderr beside it."""

import pytest

from scalelab.config import RunConfig
from scalelab.errors import UsageError


@pytest.mark.parametrize(
    "args, meant",
    [
        (["run", "alexnet", "--stratgy", "pipeline"], "--strategy"),
        (["versions", "alexnet", "--batchh", "3"], "--batch"),
        (["run", "mlp", "--hiden=64"], "--hidden"),
    ],
)
def test_an_unknown_option_suggests_the_closest_one_the_command_takes(cli, args, meant):
    code, out, err = cli(*args)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"scalelab: error: unrecognized arguments: {' '.join(args[2:])} (did you mean {meant}?)"
    ]


def test_an_unknown_option_like_none_says_only_that(cli):
    code, _, err = cli("run", "alexnet", "--zzzzzzzz")
    assert code == 2 and err == "scalelab: error: unrecognized arguments: --zzzzzzzz\n"


def test_a_batch_the_ranks_do_not_share_equally_names_the_strategy_given(cli, tmp_path):
    out = tmp_path / "r.jsonl"
    for strategy in ("fsdp", "ddp"):
        code, _, err = cli(
            "run", "mlp", "--strategy", strategy, "--train", "--batch", "15", "--ranks", "2",
            "--out", out,
        )  # fmt: skip
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"({strategy} gives every rank the same share)" in err
    assert not out.exists()


@pytest.mark.parametrize("balance", ["x,y", "0,3", "3,,4", "2.5,3"])
def test_a_balance_that_is_not_layer_counts_is_refused_by_the_config(balance):
    with pytest.raises(UsageError, match="--balance must be 'auto' or layer counts like 5,7"):
        RunConfig(workload="alexnet", strategy="pipeline", balance=balance)
    RunConfig(workload="alexnet", strategy="pipeline", balance=" 11, 11")  # counts pass


@pytest.mark.parametrize(
    "balance, line",
    [
        ("x,y", "--balance must be 'auto' or layer counts like 5,7; got 'x,y'"),
        ("3,3", "--balance 3,3: need 2 counts >= 1 summing to the model's 22 layers"),
    ],
)
def test_a_bad_balance_is_one_line_before_any_rank_starts(cli, tmp_path, monkeypatch, balance,
                                                           line):  # fmt: skip
    from scalelab.cli.commands import run

    def no_launch(*args, **kwargs):
        raise AssertionError("a launcher started")

    monkeypatch.setattr(run, "run_job", no_launch)
    monkeypatch.setattr(run, "relaunch_job", no_launch)
    code, _, err = cli(
        "run", "alexnet", "--strategy", "pipeline", "--balance", balance, "--ranks", "2",
        "--image-size", "67", "--batch", "4", "--out", tmp_path / "r.jsonl",
    )  # fmt: skip
    assert code == 2 and err.strip().splitlines() == [f"scalelab run: error: {line}"]
    assert not (tmp_path / "r.jsonl").exists()
