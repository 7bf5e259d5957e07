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
