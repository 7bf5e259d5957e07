"""The demo study: a small end-to-end run on whatever this machine has, then the report.

`run_demo(out_dir, data_dir, quick)` measures the ceilings, runs `versions alexnet` at a small
size, trains the MLP data-parallel (mpi-dp) on 1 and 2 ranks, runs a tiny AlexNet scaling
sweep and a per-layer run, and (unless quick) a small hidden x batch sweep for the system
roofline; then writes out_dir/report/index.html. Every run is its own `python -m scalelab`
process (launchers start exactly as on the command line) appending to out_dir/runs.jsonl; a
piece this install lacks, or one that fails, is skipped with a note that the report shows.
Re-running resumes: points already in runs.jsonl are not run again (force=True reruns).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scalelab.errors import UsageError
from scalelab.orchestration.sweep import Study, points, run_study
from scalelab.strategies import STRATEGIES

IMAGE = 67  # the smallest AlexNet input that keeps all five convs and three pools


@dataclass
class StepResult:
    name: str
    status: str  # ok | skipped | failed
    seconds: float
    note: str


class Demo:
    def __init__(
        self,
        out_dir: Path,
        data_dir: str | None,
        quick: bool,
        force: bool,
        echo: Callable[[str], None],
    ) -> None:
        self.out, self.data_dir, self.quick, self.force, self.echo = (
            out_dir,
            data_dir,
            quick,
            force,
            echo,
        )
        self.results = out_dir / "runs.jsonl"
        self.steps: list[StepResult] = []
        self.gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.max_ranks = max(2, min(4, self.gpus or os.cpu_count() or 2))

    def step(self, name: str, fn: Callable[[], str]) -> None:
        """Run one piece; UsageError means 'not possible here': skipped with its reason."""
        self.echo(f"\n== {name}")
        start = time.perf_counter()
        try:
            note, status = fn(), "ok"
        except UsageError as exc:
            note, status = str(exc), "skipped"
        except RuntimeError as exc:
            note, status = str(exc), "failed"
        self.steps.append(StepResult(name, status, time.perf_counter() - start, note))
        self.echo(f"   {status}: {note}" if status != "ok" else f"   done: {note}")

    # --- pieces ----------------------------------------------------------------------------
    def command(self, argv: list[str], what: str) -> str:
        code = subprocess.call([sys.executable, "-m", "scalelab", *argv])
        if code != 0:
            raise RuntimeError(f"`scalelab {' '.join(argv)}` exited with {code}")
        return what

    def ceilings(self) -> str:
        argv = ["ceilings", "-o", str(self.out / "ceilings.json"), "--quick", "--quiet"]
        if "mpi" in STRATEGIES:
            argv += ["--ranks", "2"]  # MPI all-reduce and p2p latency/bandwidth too
        return self.command(argv, f"{self.out / 'ceilings.json'}")

    def versions(self) -> str:
        argv = [
            "versions",
            "alexnet",
            "--image-size",
            str(IMAGE),
            "--batch",
            "4",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--out",
            str(self.results),
        ]
        return self.command(argv, f"alexnet {IMAGE}x{IMAGE} under every strategy, checked")

    def sweep(self, name: str, grid: dict[str, list[Any]], fixed: dict[str, Any]) -> str:
        missing = [s for s in grid.get("strategy", []) if s not in STRATEGIES]
        if missing:
            raise UsageError(f"strategy {', '.join(missing)} is not in this install yet")
        study = Study(name, grid, fixed, Path(f"<demo {name}>"), self.results)
        outcomes = run_study(study, self.force, echo=lambda line: self.echo("   " + line))
        failed = [o for o in outcomes if o.status == "failed"]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(outcomes)} runs failed: {failed[0].error}")
        return f"{len(points(study))} runs"

    def device(self) -> dict[str, Any]:
        """CPU runs: one torch thread per rank, so N ranks use N cores and a 1-rank baseline
        does not get every core to itself (the seed's one-process-per-core MPI versions)."""
        if not self.gpus:
            return {"device": "cpu", "threads": 1}
        return {"device": "cuda", "oversubscribe_gpus": self.gpus < 2}

    def training(self) -> str:
        fixed = {
            "workload": "mlp",
            "strategy": "mpi-dp",
            "train": True,
            "hidden": 128,
            "batch": 200,
            "lr": 0.5,
            "epochs": 2 if self.quick else 4,
            "train_size": 4000 if self.quick else 8000,
            "heldout_size": 1000,
            **self.device(),
        }
        if self.data_dir is not None:
            fixed["data_dir"] = str(self.data_dir)
        return self.sweep("demo-train", {"ranks": [1, 2]}, fixed)

    def scaling(self) -> str:
        ranks = [n for n in (1, 2, 4) if n <= self.max_ranks]
        cpu = not (self.gpus >= 2 and "mpi-gpu" in STRATEGIES)
        strategy = "mpi" if cpu else "mpi-gpu"
        fixed = {
            "workload": "alexnet",
            "strategy": strategy,
            "split": "batch",
            "batch": 8,
            "image_size": IMAGE,
            "iters": 2 if self.quick else 4,
            "warmup": 1,
            "timeline": True,  # every rank's phases on one clock: the report's waits per rank
            **self.device(),
        }
        if cpu:  # CPU ranks whatever the machine has
            fixed.update(device="cpu", threads=1)
            fixed.pop("oversubscribe_gpus", None)
        return self.sweep("demo-scaling", {"ranks": ranks}, fixed)

    def per_layer(self) -> str:
        if importlib.util.find_spec("scalelab.instrument.per_layer") is None:
            raise UsageError("--per-layer is not in this install yet")
        fixed = {
            "workload": "alexnet",
            "strategy": "local",
            "image_size": IMAGE,
            "batch": 8,
            "iters": 2,
            "warmup": 1,
            "per_layer": True,
            **self.device(),
        }
        fixed.pop("oversubscribe_gpus", None)
        fixed.pop("threads", None)
        return self.sweep("demo-layers", {"dtype": ["fp32"]}, fixed)

    def roofline_sweep(self) -> str:
        fixed = {
            "workload": "mlp",
            "strategy": "mpi-dp",
            "train": True,
            "ranks": 2,
            "steps": 20,
            "train_size": 4000,
            "heldout_size": 200,
            **self.device(),
        }
        return self.sweep("demo-roofline", {"hidden": [32, 512], "batch": [50, 800]}, fixed)

    def report(self) -> Path:
        from scalelab.analysis import html, load_records, plots
        from scalelab.analysis.report import write_report
        from scalelab.analysis.roofline import find_ceilings, read_ceilings
        from scalelab.orchestration.strategy_roles import strategy_roles

        records = load_records(self.results)
        path = find_ceilings(self.results, None)
        ceilings = read_ceilings(path) if path else None
        import pandas as pd

        table = pd.DataFrame([s.__dict__ for s in self.steps])
        steps = ("demo", "Demo steps", html.table(table, {"seconds": ".1f"}))
        return write_report(
            records,
            self.out / "report",
            ceilings,
            "scalelab demo",
            plots=plots.available(),
            extra=[steps],
            roles=strategy_roles(),
        )


def run_demo(
    out_dir: str | Path = "scalelab-results",
    data_dir: str | Path | None = None,
    quick: bool = False,
    force: bool = False,
    echo: Callable[[str], None] = lambda line: print(line, flush=True),
) -> int:
    """The whole study; returns 0 when the report was written and no piece failed."""
    demo = Demo(Path(out_dir), None if data_dir is None else str(data_dir), quick, force, echo)
    demo.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    demo.step("ceilings (quick)", demo.ceilings)
    demo.step(f"versions alexnet {IMAGE}x{IMAGE}", demo.versions)
    demo.step("mlp training, mpi-dp on 1 and 2 ranks", demo.training)
    demo.step("alexnet scaling sweep", demo.scaling)
    demo.step("alexnet per-layer run", demo.per_layer)
    if not quick:
        demo.step("mlp hidden x batch sweep (system roofline)", demo.roofline_sweep)
    try:
        page = demo.report()
    except UsageError as exc:  # nothing ran, or pandas is missing
        echo(f"\nno report: {exc}")
        return 1
    failed = [s.name for s in demo.steps if s.status == "failed"]
    echo("")
    echo(f"report: {page}  (records: {demo.results}; {time.perf_counter() - start:.0f} s)")
    if failed:
        echo(f"failed: {', '.join(failed)} (see the report's Demo steps)")
    return 1 if failed else 0
