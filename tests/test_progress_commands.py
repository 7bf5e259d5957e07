"""`report`, `roofline` and `bench` say where they are on stderr (what is done, i of n,
elapsed) and leave stdout as it was. TICK_EVERY_S = 0 makes every step print, as a slow run's
would after a few seconds."""

import re
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
LINE = r"^{}(?:: .+ done,)? (\d+)/(\d+) elapsed=\d+\.\ds eta="


@pytest.fixture
def every_step(monkeypatch):
    from scalelab.instrument import progress

    monkeypatch.setattr(progress, "TICK_EVERY_S", 0.0)


def _steps(err: str, label: str) -> list[tuple[int, int]]:
    found = re.findall(LINE.format(re.escape(label)), err, flags=re.M)
    return [(int(i), int(n)) for i, n in found]


def test_report_progress_on_stderr(cli, tmp_path, every_step):
    code, out, err = cli("report", FIXTURES / "layers.jsonl", "-o", tmp_path, "--no-plots")
    assert code == 0, err
    assert out == f"report: {tmp_path}/index.html (1 records)\n"
    steps = _steps(err, "report")
    assert steps == [(i, 10) for i in range(1, 11)], err  # every section, in order


def test_roofline_progress_on_stderr(cli, tmp_path, every_step, monkeypatch):
    args = ["roofline", FIXTURES / "system_roofline.jsonl", "-o", tmp_path, "--no-plots"]
    code, out, err = cli(*args)
    assert code == 0, err
    assert _steps(err, "roofline") == [(1, 1)] and "system table done" in err
    monkeypatch.undo()  # the default: a fast run prints no progress, and the same stdout
    code, quiet_out, quiet_err = cli(*args)
    assert code == 0 and quiet_out == out and not _steps(quiet_err, "roofline")


def test_bench_progress_on_stderr(cli, tmp_path, every_step):
    args = ["--iters", "2", "--warmup", "1", "--peers", "eager_fp32", "--out", tmp_path]
    code, out, err = cli("bench", "mlp", "--batch", "16", "--train-size", "32", "--hidden", "8",
                         *args)  # fmt: skip
    assert code == 0, err
    for mode in ("eager_fp32", "fast"):
        assert _steps(err, f"bench mlp: timing {mode}") == [(1, 3), (2, 3), (3, 3)], err
    assert "elapsed=" not in out and out.endswith(f"records written to {tmp_path}/\n")
