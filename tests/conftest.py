"""Shared fixtures: paths to the real data sets beside the checkout, a CLI runner, and README's
lines run once per test run in one fresh clone."""

from __future__ import annotations

import compileall
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scalelab.comm.launch import MPICH_YIELD_VAR

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SCALELAB_TEST_DATA", ROOT.parent / "shared" / "data"))

# The suite runs two test processes on as many cores, each launching jobs of two to four ranks,
# so every MPI job shares its cores with another: MPICH ranks waiting in a collective sleep
# between polls, as scalelab's own launch does when a job alone has more ranks than cores
# (comm/launch.py), instead of polling a core away from the rank they wait for.
os.environ.setdefault(MPICH_YIELD_VAR, "1")

# When the run is spread over processes (README's test command: pytest-xdist `-n 2 --dist
# loadfile`), each file goes whole to one process (module fixtures launch ranks once), and
# the files that share one thing per test run go to the same process: every file that drives
# Slurm (one cluster, on fixed ports) and every file that reads the README clone (its lines
# run once). pytest 9 ignores xdist's own `xdist_group` (xdist 3.8 renames `item._nodeid`).
FILE_GROUPS = {
    "slurm": ("test_slurm.py", "test_slurm_script_ends.py", "test_slurm_launch.py",
              "test_slurm_ends.py", "test_slurm_cluster.py", "test_slurm_cluster_ends.py",
              "test_slurm_stop_record.py"),
    "readme": ("test_readme.py", "test_versions.py", "test_ceilings.py"),
}  # fmt: skip


def compile_sources(*dirs: Path) -> None:
    """Bytecode for the project's own modules, written once before any test process starts.
    Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it) Python never caches
    what it compiles, so every rank, launcher and CLI process of the run compiled the ~160
    modules it imports again (0.15-0.2 s of CPU each, about 500 processes a run). A cached
    file is read only while its source is unchanged (timestamp check), as Python does itself."""
    if sys.dont_write_bytecode:
        for d in dirs:
            compileall.compile_dir(str(d), quiet=1)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controlling process, before the workers
        compile_sources(ROOT / "src", ROOT / "tests" / "programs")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    # xdist's default re-sorts the files by how many tests each holds, which put the README
    # group (4 tests, a fifth of the run) among the last and left one process alone at the
    # end: keep the order pytest_collection_modifyitems gives (the longest work first)
    config.option.loadscopereorder = False

    class GroupedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            name = Path(file).name
            return next((g for g, files in FILE_GROUPS.items() if name in files), file)

    return GroupedFiles(config, log)


def pytest_collection_modifyitems(config, items):
    """The longest work first, so a spread run does not end on one long test alone: the
    grouped files (the README group alone is a fifth of the run), then the files holding a
    `slow` test, then the rest; within a tier the files with a slow test first, and in a file
    its slow tests first. xdist hands a process its next file when the current one has two
    tests left, so a long test last in its file would hold the next file back behind it.
    A stable sort after pytest-randomly's shuffle (its hook wraps this one): each file stays
    whole, and the order within each tier, and within a file otherwise, stays random."""
    grouped = {name for files in FILE_GROUPS.values() for name in files}
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    place = {}
    for item in items:
        place.setdefault(item.path, len(place))

    def key(item) -> tuple[int, int, int, int]:
        tier = 0 if item.path.name in grouped else (1 if item.path in slow else 2)
        first = 0 if item.get_closest_marker("slow") else 1
        return (tier, 0 if item.path in slow else 1, place[item.path], first)

    items.sort(key=key)


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


def can_clone() -> bool:
    return shutil.which("git") is not None and (ROOT / ".git").exists()


@pytest.fixture(scope="session")
def readme_clone(tmp_path_factory):
    """One fresh clone of this checkout per test run, ../shared/data beside it (the lines that
    read it skip without it: test_readme.py), whose README
    lines run at most once each (tests/readme_lines.py). The clone holds the tracked files as
    they are now (HEAD and any uncommitted change to them), never an untracked file: what a
    fresh clone of the next commit would hold."""
    from readme_lines import ReadmeClone

    if not can_clone():
        pytest.skip("needs git and a git checkout")
    base = tmp_path_factory.mktemp("fresh")
    repo = base / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=ROOT, capture_output=True,
                          check=True).stdout  # fmt: skip
    if diff:
        subprocess.run(["git", "apply", "--binary", "-"], cwd=repo, input=diff, check=True)
    compile_sources(repo / "src")
    (base / "shared").mkdir()
    (base / "shared" / "data").symlink_to(SHARED_DATA.resolve())
    return ReadmeClone(repo)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The two-node Slurm cluster (tests/slurm/cluster.sh), brought up once per test run for
    every module that uses it; its SLURM_CONF path. Stopped at the end only if it was started
    here (a cluster someone brought up stays up)."""
    cluster = ROOT / "tests" / "slurm" / "cluster.sh"
    proc = subprocess.run(["bash", str(cluster), "up"], capture_output=True, text=True)
    if proc.returncode == 77:
        pytest.skip(f"no Slurm here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    yield proc.stdout.split("SLURM_CONF=")[-1].strip()
    if "started" in proc.stdout.splitlines():
        subprocess.run(["bash", str(cluster), "down"], check=True)


@pytest.fixture(scope="module")
def slurm_conf(slurm_cluster):
    """The shared cluster's SLURM_CONF, set in the environment while this module's tests run
    (and put back after them: other modules' tests see no cluster)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", slurm_cluster)
        yield slurm_cluster


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


@pytest.fixture(autouse=True)
def _no_kept_worker_pools():
    """A test that measured a cpu_concurrency curve in this process leaves no worker pool for
    the next one (`Workers.kept` keeps pools for the process's life: a command's, not a test
    run's)."""
    yield
    concurrency = sys.modules.get("scalelab.instrument.concurrency")
    if concurrency is not None:
        concurrency.Workers.close_kept()
