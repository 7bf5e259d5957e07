"""The "Everyday use" lines of docs/USAGE.md (README's ten-line tour is ten of them), run in one
fresh clone per test run (conftest's session fixture `readme_clone`), each line at most once:
tests/test_readme.py runs every line in order
and asserts each exits 0; a test whose own measurement is what a README line does (the same
command, so the same assertions hold) reads that line's run instead of starting its own, so the
work is done once per test run whichever test asks first. Such a line must not read what an
earlier line wrote (INDEPENDENT), since it may run before them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Lines other tests read (and so may run before the lines above them): each reads nothing an
# earlier line wrote. test_readme.py checks every entry is an everyday line.
INDEPENDENT = (
    "scalelab versions alexnet",  # tests/test_versions.py
    "scalelab ceilings --quick",  # tests/test_ceilings.py (on a host without a GPU)
)


# What such a line writes that another test reads: kept as the line left it (a later line may
# rewrite it: plan --calibrate-missing measures the ceilings again into the same file).
WRITES = {"scalelab ceilings --quick": ("scalelab-results/ceilings.json",)}

USAGE = Path("docs") / "USAGE.md"  # holds the everyday block; README.md its tour


def everyday_commands(usage: str) -> list[tuple[str, bool]]:
    """(shell command, needs a GPU) per line of docs/USAGE.md's Everyday-use block."""
    return block_commands(usage, "## Everyday use")


def tour_commands(readme: str) -> list[tuple[str, bool]]:
    """The same for README's ten-line tour."""
    return block_commands(readme, "## A ten-line tour")


def block_commands(text: str, heading: str) -> list[tuple[str, bool]]:
    """(shell command, needs a GPU) per line of the first code block under heading,
    continuations joined."""
    block = text.split(heading, 1)[1].split("```", 2)[1]
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.strip().splitlines():
        command, _, comment = line.partition("#")
        if command.strip():
            out.append((command.strip(), "(GPU)" in comment))
    return out


class ReadmeClone:
    """A fresh clone (`path`) whose README lines run once each: `run(prefix)` runs the one
    line that starts with `prefix` (the clone's own code first on PYTHONPATH) and returns its
    CompletedProcess, the same object on every later call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.commands = everyday_commands((path / USAGE).read_text())
        self.env = {**os.environ, "PYTHONPATH": str(path / "src")}
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env['PATH']}"
        self._done: dict[str, subprocess.CompletedProcess] = {}
        self.status_at_start = self.status()  # the checkout's uncommitted changes, if any

    def status(self) -> str:
        return subprocess.run(
            ["git", "status", "--porcelain"], cwd=self.path, capture_output=True, text=True
        ).stdout.strip()

    def line(self, prefix: str) -> str:
        (command,) = [c for c, _ in self.commands if c.startswith(prefix)]
        return command

    def run(self, prefix: str) -> subprocess.CompletedProcess:
        command = self.line(prefix)
        if command not in self._done:
            # in order (later lines read what earlier ones wrote), but for INDEPENDENT ones
            order = [c for c, _ in self.commands]
            later = order[order.index(command) + 1 :]
            early = [c for c in later if self.ran(c) and not c.startswith(INDEPENDENT)]
            assert command.startswith(INDEPENDENT) or not early, (command, early)
            self._done[command] = subprocess.run(
                command, shell=True, cwd=self.path, env=self.env, capture_output=True,
                text=True, timeout=600,
            )  # fmt: skip
            writer = next((p for p in WRITES if command.startswith(p)), None)
            for rel in WRITES.get(writer, ()):
                if (self.path / rel).is_file():
                    kept = self._kept(writer, rel)
                    kept.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(self.path / rel, kept)
        return self._done[command]

    def written(self, prefix: str, rel: str) -> Path:
        """The file `rel` as the line starting with `prefix` left it (run it first)."""
        assert rel in WRITES[prefix] and self.line(prefix) in self._done, (prefix, rel)
        return self._kept(prefix, rel)

    def _kept(self, prefix: str, rel: str) -> Path:
        return self.path.parent / "kept" / str(list(WRITES).index(prefix)) / rel

    def ran(self, command: str) -> bool:
        return command in self._done
