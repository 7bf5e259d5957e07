"""Every line of README's "Everyday use" runs, as written, in a fresh clone (the data sets
beside it as `../shared/data`, as on this project's machines): exit 0 and no internal error.
Lines marked `(GPU)` run only where a GPU is present. Slow (a few minutes on 2 cores).

The clone and each line's run are shared with the rest of the test run (conftest's
`readme_clone`, tests/readme_lines.py): a line another test reads (readme_lines.INDEPENDENT,
`scalelab versions`, `scalelab ceilings --quick`) runs once, whichever test asks first, and
both tests assert on that one run."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT, SHARED_DATA
from readme_lines import INDEPENDENT, everyday_commands


def test_the_readme_block_is_parsed():
    commands = everyday_commands((ROOT / "README.md").read_text())
    assert commands[0] == ("scalelab list", False)
    assert ("scalelab run vgg16 --batch 2 --device cuda --dtype bf16", True) in commands
    predict = next(c for c, _ in commands if c.startswith("scalelab predict resnet18"))
    assert predict.endswith("--calibrate benchmarks/results")
    for prefix in INDEPENDENT:  # each line another test reads is one README line, CPU-only
        assert [gpu for c, gpu in commands if c.startswith(prefix)] == [False], prefix


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
    # outputs land in ignored folders: the clone stays as it was cloned
    assert readme_clone.status() == readme_clone.status_at_start
