"""Studies: a TOML grid of run configurations, each point one `scalelab run`.

    [study]
    name = "alexnet-mpi"            # results default to scalelab-results/<name>.jsonl
    timeout_s = 600                 # optional: per point

    [grid]                          # the Cartesian product of these lists
    workload = ["alexnet"]
    strategy = ["mpi"]
    ranks = [1, 2, 4]
    batch = [8]
    split = ["spatial"]

    [fixed]                         # the same for every point
    image_size = 99
    iters = 3

Keys are RunConfig fields (`scalelab run --help`), plus `batch_per_rank` (grid or fixed),
which sets batch = batch_per_rank * ranks for weak scaling. Each point runs as its own
`python -m scalelab run ...` process, so strategies that need ranks start their launcher
exactly as on the command line, and a crash stays with its point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalelab import config_sections
from scalelab.comm.launch import mpiexec_command, refuse_nested_launch, torchrun_command
from scalelab.config import RunConfig, upgrade_record_config
from scalelab.errors import UsageError
from scalelab.orchestration.jobs import NOISE
from scalelab.orchestration.point_key import key_of
from scalelab.outputs import inside
from scalelab.record import append_record, failed_record, read_records
from scalelab.record_schema import FINISHED
from scalelab.strategies import STRATEGIES
from scalelab.workloads import WORKLOADS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

DEFAULT_FOLDER = Path("scalelab-results")
STUDY_KEYS = {"name", "description", "results", "timeout_s"}
TABLES = {"study", "grid", "fixed"}
DERIVED = {"batch_per_rank"}
NOT_FLAGS = {"workload", "extra"}
IGNORED_IN_MATCH = {"quiet"}  # a point is done whatever the verbosity it ran with


@dataclass(frozen=True)
class Study:
    name: str
    grid: dict[str, list[Any]]  # TOML order: the last key varies fastest
    fixed: dict[str, Any]
    source: Path
    results: Path
    timeout_s: float | None = None


@dataclass(frozen=True)
class Point:
    index: int  # 1-based position in the grid
    values: dict[str, Any]  # this point's grid values (what distinguishes it)
    config: RunConfig

    def argv(self) -> list[str]:
        """`scalelab` arguments reproducing config: only fields that differ from defaults."""
        args = ["run", self.config.workload]
        defaults = RunConfig(workload=self.config.workload)
        for f in dataclasses.fields(RunConfig):
            value = getattr(self.config, f.name)
            if f.name in NOT_FLAGS or value == getattr(defaults, f.name) or value is None:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, tuple):  # --model-arg a=1 --model-arg b=2
                args += [a for item in value for a in (flag, item)]
                continue
            args += [flag] if value is True else [flag, str(value)]
        return args

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values.items())

    def match_key(self) -> str:
        return config_key(self.config.to_dict())


def config_key(config: dict[str, Any], trained_batch: int | None = None) -> str:
    """Identity of a resolved config. Fields a record predates take their defaults and fields
    it has that RunConfig lost are dropped, so records survive new config fields (an old
    record's per-rank batch reads as the global batch it trained, `trained_batch`)."""
    return key_of(upgrade_record_config(config, trained_batch), match_defaults())


def match_defaults() -> dict[str, Any]:
    """Each RunConfig field a point's identity counts, with its default."""
    out = {}
    for f in dataclasses.fields(RunConfig):
        if f.name not in IGNORED_IN_MATCH:
            dflt = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            out[f.name] = dflt() if dflt is not None else f.default
    return out


# --- reading a study -----------------------------------------------------------------------
def load_study(
    path: str | Path, results: str | Path | None = None, overrides: list[str] = ()
) -> Study:
    """Parse and validate a study file; UsageError names the first problem. overrides are
    `KEY=VALUE` (a TOML value; a bare word is a string) replacing a field of [fixed] or
    [grid] (a list value becomes that key's list)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such study file")
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text (is this a study TOML?)") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: invalid TOML: {exc}") from None
    _only(data, TABLES, f"{path}: unknown table")
    for table in ("grid", "fixed"):
        _only(data.get(table, {}), set(data.get(table, {})), f"{path}: [{table}]")
    for item in overrides:
        _override(data, item)
    study = data.get("study", {})
    _only(study, STUDY_KEYS, f"{path}: unknown key in [study]")
    grid, fixed = data.get("grid", {}), data.get("fixed", {})
    _check_grid(path, grid, fixed)
    timeout = study.get("timeout_s")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise UsageError(f"{path}: [study] timeout_s must be a positive number of seconds")
    name = study.get("name", path.stem)
    if not isinstance(name, str):
        raise UsageError(f"{path}: [study] name must be a string")
    default_results = inside(DEFAULT_FOLDER, name, f"{path}: [study] name").with_suffix(".jsonl")
    out = Path(results or study.get("results") or default_results)
    if not isinstance(study.get("results", ""), str):
        raise UsageError(f"{path}: [study] results must be a file name")
    return Study(name, grid, fixed, path, out, timeout)


def _override(data: dict[str, Any], item: str) -> None:
    """--set KEY=VALUE into the study's tables: grid if the key varies there, else fixed."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set data_dir=data/mnist")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word or path: a string
    grid, fixed = data.setdefault("grid", {}), data.setdefault("fixed", {})
    if key in grid or isinstance(value, list):
        fixed.pop(key, None)
        grid[key] = value if isinstance(value, list) else [value]
    else:
        fixed[key] = value


def _only(table: Any, allowed: set[str], what: str) -> None:
    if not isinstance(table, dict):
        raise UsageError(f"{what.rsplit(':', 1)[0]}: expected a table")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise UsageError(f"{what} {unknown[0]!r} (known: {', '.join(sorted(allowed))})")


def _check_grid(path: Path, grid: dict[str, Any], fixed: dict[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(RunConfig)} - {"extra"} | DERIVED
    for table, name in ((grid, "grid"), (fixed, "fixed")):
        _only(table, known, f"{path}: unknown key in [{name}]")
    if not grid:
        raise UsageError(f"{path}: empty grid: [grid] needs at least one key with a list of values")
    for key, values in grid.items():
        if not isinstance(values, list):
            raise UsageError(f"{path}: [grid] {key} must be a list, e.g. {key} = [{values!r}]")
        if not values:
            raise UsageError(f"{path}: empty grid: [grid] {key} = [] has no values")
        for v in values:
            _check_type(path, key, v)
    for key, v in fixed.items():
        if key in grid:
            raise UsageError(f"{path}: {key} is in both [grid] and [fixed]")
        _check_type(path, key, v)
    if "batch_per_rank" in {**grid, **fixed} and "batch" in {**grid, **fixed}:
        raise UsageError(f"{path}: give batch or batch_per_rank, not both")
    if "workload" not in grid and "workload" not in fixed and "model" not in {**grid, **fixed}:
        raise UsageError(f"{path}: no workload: set workload in [grid] or [fixed]")


def _field_type(key: str) -> type:
    if key in DERIVED:
        return int
    hint = typing.get_type_hints(RunConfig)[key]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return list if typing.get_origin(hint) is tuple else hint  # model_arg = ["width=8"]


def _check_type(path: Path, key: str, value: Any) -> None:
    want = _field_type(key)
    ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
    if want is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise UsageError(f"{path}: {key} = {value!r} should be {want.__name__}")


# --- points --------------------------------------------------------------------------------
def points(study: Study) -> list[Point]:
    """Every grid point as a validated RunConfig (bad values fail here, before any run)."""
    keys = list(study.grid)
    out = []
    for i, combo in enumerate(itertools.product(*study.grid.values()), 1):
        values = dict(zip(keys, combo))
        merged = {**study.fixed, **values, "quiet": True}
        if "model" in merged:  # your own network (model = "MODULE:FACTORY") runs as `model`
            merged.setdefault("workload", "model")
        # TOML 1 for a float field: store 1.0, as the CLI would, so records match the point.
        merged = {k: float(v) if _field_type(k) is float else v for k, v in merged.items()}
        per_rank = merged.pop("batch_per_rank", None)
        if per_rank is not None:
            merged["batch"] = per_rank * merged.get("ranks", 1)
        try:
            cfg = RunConfig(**merged)
            workload = WORKLOADS.get(cfg.workload)  # the name exists
            strategy = STRATEGIES.get(cfg.strategy)
            config_sections.check(cfg, strategy, workload)  # options read
            check = getattr(strategy, "preflight", None)  # what `run` refuses before ranks
            if check is not None:
                check(cfg)
        except UsageError as exc:
            desc = " ".join(f"{k}={v}" for k, v in values.items())
            raise UsageError(f"{study.source}: point {i} ({desc}): {exc}") from None
        out.append(Point(i, values, cfg))
    return out


def job_nodes(record: dict[str, Any] | None = None) -> int:
    """The nodes of the Slurm job a record ran in (of the job this process is in, for None);
    1 outside Slurm."""
    if record is None:
        from scalelab.comm.slurm_env import job_fields

        job = job_fields() or {}
    else:
        job = record.get("slurm") or {}
    return int(job.get("nodes") or 1)


def same_point(cfg: RunConfig, record: dict[str, Any], nodes: int | None = None) -> bool:
    """record ran cfg, on `nodes` nodes (any, for None): a point's identity is everything that
    changes its result, its node layout included. Threads a point leaves unset are whatever
    the run settled on (the CPUs Slurm gave it), so they do not tell runs apart."""
    got = dict(record.get("config") or {})
    if cfg.threads is None:
        got["threads"] = None
    if config_key(got, record.get("global_batch")) != config_key(cfg.to_dict()):
        return False
    return nodes is None or job_nodes(record) == nodes


def finished(results: Path) -> list[dict[str, Any]]:
    """The finished records (ok or check-failed) in the results file (none when it holds
    no scalelab records)."""
    if not results.exists():
        return []
    try:
        records = read_records(results)
    except UsageError as exc:
        if "holds no scalelab records" in str(exc):
            return []
        raise
    return [r for r in records if r.get("status") in FINISHED]


def is_done(point: Point, ok: list[dict[str, Any]], nodes: int) -> bool:
    return any(same_point(point.config, r, nodes) for r in ok)


def command(point: Point, results: Path) -> tuple[list[str], dict[str, str] | None]:
    """(argv, environment or None to inherit) of one point: `python -m scalelab run ...`,
    started straight under mpiexec / torchrun when its strategy needs ranks (what `scalelab
    run --ranks N` would do itself, minus one Python process per point)."""
    run = ["-m", "scalelab", *point.argv(), "--out", str(results)]
    launcher = _launcher(point)
    ranks = point.config.ranks
    if launcher is None or ranks == 1:
        return [sys.executable, *run], None
    if launcher == "mpi":
        cmd, env = mpiexec_command(ranks)
        cmd += [sys.executable]
    else:
        cmd, env = torchrun_command(ranks), dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # as comm.launch.relaunch: NVLink multicast off
    env["SCALELAB_LAUNCHED"] = "1"
    return [*cmd, *run], env


def _launcher(point: Point) -> str | None:
    return STRATEGIES.get(point.config.strategy).launcher_for(point.config)


# --- running -------------------------------------------------------------------------------
@dataclass
class Outcome:
    point: Point
    status: str  # ok | done (already in the results) | check failed | failed
    seconds: float = 0.0
    record: dict[str, Any] | None = None
    error: str | None = None


def _records(results: Path) -> list[dict[str, Any]]:
    try:
        return read_records(results) if results.exists() else []
    except UsageError:
        return []


def _run_process(
    cmd: list[str], timeout: float | None, env: dict[str, str] | None = None
) -> tuple[int | None, str]:
    """(exit code or None on timeout, stderr); a timed-out point loses its whole process
    group, launcher and ranks included."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, f"timed out after {timeout:g} s"


def _last_line(text: str) -> str:
    """The point's own last line: scalelab's line when there is one, never a launcher's
    banner (torchrun's ChildFailedError box, MPICH's BAD TERMINATION lines)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    ours = [ln for ln in lines if ln.startswith("scalelab")]
    if ours:
        return ours[-1]
    plain = [ln for ln in lines if not any(p.search(ln) for p in NOISE)]
    return (plain or lines or ["no output"])[-1]


def run_point(point: Point, results: Path, timeout: float | None = None) -> Outcome:
    """Run one point; a point that leaves no finished record gets a failed record."""
    before = len(_records(results))
    start = time.perf_counter()
    cmd, env = command(point, results)
    code, err = _run_process(cmd, timeout, env)
    seconds = time.perf_counter() - start
    new = [r for r in _records(results)[before:] if same_point(point.config, r)]
    done = [r for r in new if r.get("status") in FINISHED]
    if done:
        rec = done[-1]
        status = "check failed" if rec.get("check_passed") is False else "ok"
        return Outcome(point, status, seconds, rec)
    error = _last_line(err) if code != 0 else "exited 0 but wrote no record"
    if not any(r.get("status") == "failed" for r in new):
        append_record(results, _failure(point, error, code))
    return Outcome(point, "failed", seconds, None, error)


def _failure(point: Point, error: str, code: int | None) -> dict[str, Any]:
    return failed_record(point.config, error, exit_code=code, source="sweep")


SLOW_POINT_S = 5.0


@contextlib.contextmanager
def slow_note(echo: Callable[[str], None], line: str, after_s: float = SLOW_POINT_S):
    """echo(line) once if the block is still running after `after_s` seconds."""
    note = threading.Timer(after_s, echo, args=(line,))
    note.daemon = True
    note.start()
    try:
        yield
    finally:
        note.cancel()


def run_study(
    study: Study, force: bool = False, echo: Callable[[str], None] = print
) -> list[Outcome]:
    """Every point not yet in the results (all with force), one line of progress each."""
    todo = points(study)
    for point in todo:  # before any point runs: a launch that would hang is refused
        if point.config.ranks > 1:
            refuse_nested_launch(_launcher(point), point.config.ranks)
    ok, nodes = ([] if force else finished(study.results)), job_nodes()
    done = {p.index for p in todo if is_done(p, ok, nodes)}
    outcomes: list[Outcome] = []
    spent, ran = 0.0, 0
    for point in todo:
        head = f"[{point.index}/{len(todo)}] {point.describe()}"
        if point.index in done:
            echo(f"{head}: in {study.results} already, skipped")
            outcomes.append(Outcome(point, "done"))
            continue
        with slow_note(echo, f"{head}: running..."):  # the point's own output is --quiet
            out = run_point(point, study.results, study.timeout_s)
        spent, ran = spent + out.seconds, ran + 1
        left = sum(1 for p in todo[point.index :] if p.index not in done)
        echo(f"{head}: {_summary(out)} | eta {spent / ran * left:.0f} s")
        outcomes.append(out)
    return outcomes


def _summary(out: Outcome) -> str:
    if out.record is None:
        return f"FAILED after {out.seconds:.1f} s: {out.error}"
    rec = out.record
    rate = f"{rec.get('throughput', float('nan')):.1f} {rec.get('item_unit', 'items')}/s"
    return f"{out.status} in {out.seconds:.1f} s ({rate}, wall {rec.get('wall_s', 0):.4g} s)"
