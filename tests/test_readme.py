"""Every line of README's "Everyday use" runs, as written, in a fresh clone (the data sets
beside it as `../shared/data`, as on this project's machines): exit 0 and no internal error.
Lines marked `(GPU)` run only where a GPU is present. Slow (a few minutes on 2 cores)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, SHARED_DATA


def everyday_commands(readme: str) -> list[tuple[str, bool]]:
    """(shell command, needs a GPU) per line of the Everyday-use block, continuations joined."""
    block = readme.split("## Everyday use", 1)[1].split("```", 2)[1]
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.strip().splitlines():
        command, _, comment = line.partition("#")
        if command.strip():
            out.append((command.strip(), "(GPU)" in comment))
    return out


def test_the_readme_block_is_parsed():
    commands = everyday_commands((ROOT / "README.md").read_text())
    assert commands[0] == ("scalelab list", False)
    assert ("scalelab run vgg16 --batch 2 --device cuda --dtype bf16", True) in commands
    predict = next(c for c, _ in commands if c.startswith("scalelab predict resnet18"))
    assert predict.endswith("--calibrate benchmarks/results")


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone of this checkout's HEAD with ../shared/data beside it."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    if not (SHARED_DATA / "mnist").is_dir() or not (SHARED_DATA / "ag_news").is_dir():
        pytest.skip(f"the README's data sets are not under {SHARED_DATA}")
    base = tmp_path_factory.mktemp("fresh")
    subprocess.run(["git", "clone", "-q", str(ROOT), str(base / "repo")], check=True)
    (base / "shared").mkdir()
    (base / "shared" / "data").symlink_to(SHARED_DATA.resolve())
    return base / "repo"


@pytest.mark.slow
@pytest.mark.mpi
def test_every_everyday_line_runs_from_a_fresh_clone(clone):
    """In order (later lines read what earlier ones wrote), the clone's own code first."""
    env = {**os.environ, "PYTHONPATH": str(clone / "src")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    gpu = torch.cuda.is_available()
    ran = []
    for command, needs_gpu in everyday_commands((clone / "README.md").read_text()):
        if needs_gpu and not gpu:
            continue
        done = subprocess.run(
            command, shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
        assert "internal error" not in done.stderr, command
        ran.append(command)
    assert len(ran) >= 17
    assert not subprocess.run(  # outputs land in ignored folders: the clone stays clean
        ["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True
    ).stdout.strip()
