"""Shared fixtures: paths to the real data sets beside the checkout, and a CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SCALELAB_TEST_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    path = SHARED_DATA / "mnist"
    if not (path / "t10k-images-idx3-ubyte.gz").exists():
        pytest.skip(f"real MNIST test set not found under {path}")
    return path


@pytest.fixture(scope="session")
def agnews_dir() -> Path:
    path = SHARED_DATA / "ag_news"
    if not (path / "test.csv").exists():
        pytest.skip(f"real AG News test set not found under {path}")
    return path


@pytest.fixture
def cli(capsys):
    """Run `scalelab ARGS...` in-process; returns (exit code, stdout, stderr)."""
    from scalelab.cli.main import main

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse exits for bad flags
            code = exc.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(autouse=True)
def _no_leaked_torch_settings():
    """Fail a test that leaves torch's process-wide settings changed (thread count, default
    dtype, grad mode): the next test, whichever the random order picks, would inherit them.
    The settings are put back first, so one leak fails one test, not every later one."""
    import torch

    before = (torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled())
    yield
    after = (torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled())
    if after != before:
        torch.set_num_threads(before[0])
        torch.set_default_dtype(before[1])
        torch.set_grad_enabled(before[2])
        pytest.fail(f"test left torch settings (threads, dtype, grad) {after}, was {before}")
