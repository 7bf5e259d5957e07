"""Every line of docs/USAGE.md's "Everyday use" runs, as written, in a fresh clone (the data
sets beside it as `../shared/data`, as on this project's machines): exit 0 and no internal
error. README's ten-line tour is ten of those lines, so it runs with them; README's test
command is what .ci/run runs. Lines marked `(GPU)` run only where a GPU is present. Slow
(several minutes on 2 cores).

The clone and each line's run are shared with the rest of the test run (conftest's
`readme_clone`, tests/readme_lines.py): a line another test reads (readme_lines.INDEPENDENT,
`scalelab versions`, `scalelab ceilings --quick`) runs once, whichever test asks first, and
both tests assert on that one run."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import ROOT, SHARED_DATA
from readme_lines import INDEPENDENT, USAGE, everyday_commands, tour_commands


def test_the_readme_block_is_parsed():
    commands = everyday_commands((ROOT / USAGE).read_text())
    assert commands[0] == ("scalelab list", False)
    assert ("scalelab run vgg16 --batch 2 --device cuda --dtype bf16", True) in commands
    predict = next(c for c, _ in commands if c.startswith("scalelab predict resnet18"))
    assert predict.endswith("--calibrate benchmarks/results")
    for prefix in INDEPENDENT:  # each line another test reads is one README line, CPU-only
        assert [gpu for c, gpu in commands if c.startswith(prefix)] == [False], prefix


def test_the_readme_tour_is_ten_everyday_lines_in_their_order():
    """So the tour runs (test below) without a run of its own: the same lines, CPU-only."""
    tour = [c for c, _ in tour_commands((ROOT / "README.md").read_text())]
    everyday = [c for c, gpu in everyday_commands((ROOT / USAGE).read_text()) if not gpu]
    assert len(tour) == 10 and all(c in everyday for c in tour), set(tour) - set(everyday)
    assert tour == sorted(tour, key=everyday.index)  # later lines read what earlier ones wrote


def test_ci_runs_the_readme_test_command_exactly():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```\n(.*?)\n```", readme.split("## Two commands", 1)[1], re.S)
    test_command = next(b for b in blocks if "pytest" in b)
    assert '".[mpich,test,hf]"' in test_command  # transformers: the hf extra
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test_command


@pytest.mark.slow
@pytest.mark.mpi
def test_every_everyday_line_runs_from_a_fresh_clone(readme_clone):
    """In order (later lines read what earlier ones wrote), the clone's own code first."""
    if not (SHARED_DATA / "mnist").is_dir() or not (SHARED_DATA / "ag_news").is_dir():
        pytest.skip(f"the README's data sets are not under {SHARED_DATA}")
    gpu = torch.cuda.is_available()
    ran = []
    for command, needs_gpu in readme_clone.commands:
        if needs_gpu and not gpu:
            continue
        done = readme_clone.run(command)
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
        assert "internal error" not in done.stderr, command
        ran.append(command)
    assert len(ran) >= 17
    # the plan that measures a missing comm fit after ranking measures the host's contention
    # curve once (the fit changes the ceilings file, not the host)
    plan = readme_clone.run("scalelab plan alexnet")
    assert "calibrate: scalelab ceilings --ranks 2 --backend gloo" in plan.stdout, plan.stdout
    assert plan.stdout.count("this host's cpu_concurrency, now") == 1, plan.stdout
    # outputs land in ignored folders: the clone stays as it was cloned
    assert readme_clone.status() == readme_clone.status_at_start
