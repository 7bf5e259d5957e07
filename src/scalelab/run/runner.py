"""One run, end to end: workload -> strategy -> timings -> check -> record.

Every rank executes this; only the root rank checks, writes the record and prints.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scalelab import config_sections, environment
from scalelab.comm import job_status
from scalelab.config import RunConfig
from scalelab.errors import RunFailed, UsageError
from scalelab.instrument import host_checks
from scalelab.oracle.check import CheckResult
from scalelab.oracle.explain import explanation_lines
from scalelab.oracle.train_compare import summary_line as train_check_line
from scalelab.precision import strict_fp32
from scalelab.record import append_record, failed_record, new_record
from scalelab.results import RunOutput
from scalelab.run import tokens, train_check
from scalelab.run.check import InferenceCheck, inference_check
from scalelab.run.numbers import numbers_lines
from scalelab.run.session import instrumented
from scalelab.strategies import STRATEGIES, Strategy
from scalelab.strategies.serial import single_blas_thread
from scalelab.train.headline import headline
from scalelab.weights import load_weights, save_weights
from scalelab.workloads import WORKLOADS, Inputs, Workload
from scalelab.workloads.base import state_dict_float64

_log = logging.getLogger("scalelab.run")


@dataclass
class RunReport:
    record: dict[str, Any] | None  # None on non-root ranks
    check: CheckResult | train_check.TrainCheck | None

    @property
    def exit_code(self) -> int:
        return 1 if self.check is not None and not self.check.passed else 0


def execute(cfg: RunConfig, results: Path | None) -> RunReport:
    """Run cfg; append the record to results (root rank) unless results is None."""
    check_config(cfg)  # every rank alike, before any process group or work
    workload = WORKLOADS.get(cfg.workload)(cfg)
    strategy = STRATEGIES.get(cfg.strategy).build(cfg)
    try:
        _check(cfg, workload, strategy)
    except UsageError:
        strategy.close()  # every rank refused alike: nobody to abort
        raise
    try:
        with strict_fp32(cfg.strict_fp32):  # the run and its check alike
            return _execute(cfg, workload, strategy, results)
    except BaseException as exc:
        if strategy.comm.size > 1 and not isinstance(exc, (SystemExit, RunFailed)):
            # One rank failing alone would leave the others blocked in a collective.
            code, line = rank_failure_line(strategy.comm.rank, exc)
            if os.environ.get("SCALELAB_DEBUG"):  # the one line's traceback, as main's
                traceback.print_exc()
            if not job_status.report(line, code):
                sys.stderr.write(f"{line}; aborting all ranks\n")
                sys.stderr.flush()
            else:  # a watcher or launcher has the line: a dead peer's side may name it first
                job_status.before_abort(code)
            strategy.comm.abort(code)
        raise
    finally:
        strategy.close()


def rank_failure_line(rank: int, exc: BaseException) -> tuple[int, str]:
    """(exit code, one line) for a rank that fails alone: a refusal stays a refusal (2)."""
    if isinstance(exc, UsageError):
        return exc.exit_code, f"scalelab run: error: {exc}"
    oom = isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
    code = 1 if oom or getattr(exc, "exit_code", None) == 1 else 3
    return code, f"scalelab run: rank {rank} failed: {type(exc).__name__}: {exc}"


def check_config(cfg: RunConfig) -> None:
    """The config under its strategy and workload (config_sections.check): no option they would
    ignore, and the rules of the sections it reads. `scalelab run` calls this before it
    starts a launcher, the runner again on every rank."""
    strategy = STRATEGIES.get(cfg.strategy)
    if cfg.ranks > 1 and strategy.launcher_for(cfg) is None:
        # refused here, not on the rank: a comma list (`--ranks 1,2`) ran its first value
        # before the second was refused
        raise UsageError(
            f"strategy {cfg.strategy} runs in one process: --ranks {cfg.ranks} needs a strategy "
            "of ranks (scalelab list)"
        )
    config_sections.check(cfg, strategy, WORKLOADS.get(cfg.workload))
    train_check.refuse(cfg)


def _check(cfg: RunConfig, workload: Workload, strategy: Strategy) -> None:
    """The strategy's refusals (config, world size, each rank's devices), agreed by all ranks:
    when any rank refuses, every rank raises the first refusal, so the job ends with the
    one-line error and exit 2 and nobody is aborted. (MPI_Abort races the launcher's stderr
    forwarding and could swallow that line: seen under MPICH's mpiexec.)"""
    refusal: UsageError | None = None
    try:
        if cfg.ranks > 1 and strategy.comm.size != cfg.ranks:
            raise UsageError(f"--ranks {cfg.ranks} but the launcher started {strategy.comm.size}")
        workload.check_strategy(
            strategy.name, cfg, **STRATEGIES.get(strategy.name).model_needs(cfg)
        )
        strategy.validate(workload)
    except UsageError as exc:
        refusal = exc
    comm = strategy.comm
    if comm.size > 1:
        said = comm.gather_object(None if refusal is None else str(refusal))
        first = comm.bcast_object(next((r for r in said if r), None) if said else None)
        if first is not None and refusal is None:
            refusal = UsageError(first)
    if refusal is not None:
        raise refusal


def _execute(
    cfg: RunConfig, workload: Workload, strategy: Strategy, results: Path | None
) -> RunReport:
    model = workload.build_model()
    if cfg.weights is not None:
        load_weights(model, cfg.weights)
    model, prep = train_check.prepare(cfg, strategy, model)  # --train: --check, --sync-bn
    reference_params = state_dict_float64(model) if cfg.check else None
    try:
        probe = host_checks.HostProbe.start()
        with instrumented(cfg, strategy, model, workload) as inst:  # --trace, --nvml, --per-layer
            output, inputs = _run_mode(strategy, workload, model)
        output.notes.update(inst.notes(output))
        load, rank_walls, places = _rank_numbers(strategy, probe, output)
    except UsageError:
        raise
    except Exception as exc:
        _record_failure(strategy, cfg, results, exc)
        raise
    if not strategy.is_root:
        return RunReport(None, None)
    bad = nonfinite(output)
    if bad is not None:  # a diverged or poisoned run: failed, and its weights are not kept
        _record_failure(strategy, cfg, results, RunFailed(bad))
        raise RunFailed(bad)
    check: CheckResult | train_check.TrainCheck | None = None
    verdict: InferenceCheck | None = None
    if cfg.check and cfg.train:
        check = _slow_note(
            "check: training the same steps in one float64 process...",
            lambda: train_check.check(cfg, reference_params, _trained(output, model), prep),
        )
    elif cfg.check:
        verdict = _inference_check(workload, strategy, model, output, inputs, reference_params)
        check = verdict.result
    if cfg.save_weights is not None:  # inference: the weights it ran (they are unchanged)
        save_weights(output.model if output.model is not None else model, cfg.save_weights)
    record = build_record(cfg, workload, strategy, output, check)
    if verdict is not None:
        record.update(verdict.fields)
    if isinstance(check, train_check.TrainCheck):
        record.update(check.fields())
        record["status"] = "ok" if check.passed else "check-failed"
    if workload.tokens_per_item is not None:  # a token model: tokens/s and MFU
        beside = results.parent / "ceilings.json" if results is not None else None
        record.update(tokens.fields(record, workload.tokens_per_item, beside))
    _add_checks(record, strategy, output, load, places)
    record["rank_wall_s"] = rank_walls
    record["warnings"] += host_checks.rank_wall_warning(record["wall_s"], rank_walls)
    if results is not None:
        append_record(results, record)
    host_checks.emit(record["warnings"])
    return RunReport(record, check)


def _inference_check(
    workload: Workload,
    strategy: Strategy,
    model: Any,
    output: RunOutput,
    inputs: Inputs,
    params: dict[str, np.ndarray],
) -> InferenceCheck:
    """run/check.py's verdict: the output against the float64 reference, held to the bound
    derived for the model (explained when it fails or --explain asks)."""
    ref = _slow_note(
        f"check: the float64 oracle's forward pass over {len(inputs.x)} items...",
        lambda: _one_blas_thread(workload.reference_forward, params, inputs.x.numpy()),
    )
    return _slow_note(
        "check: the one-process run in the same dtype, the bound, the explanation...",
        lambda: inference_check(workload, strategy, model, output.output, inputs, params, ref),
    )


def _one_blas_thread(forward: Any, *args: Any) -> Any:
    """The float64 reference on one BLAS thread, as the serial strategy computes it: a GEMM
    split over threads sums in another order, and serial's output would differ from its own
    oracle in the last bits (relerr 4e-16 on 2 cores)."""
    with single_blas_thread():
        return forward(*args)


def _trained(output: RunOutput, model: Any) -> Any:
    """The trained model on the root: the strategy's whole model where it hands one back."""
    return output.model if output.model is not None else model


def _slow_note(line: str, work: Callable[[], Any], after_s: float = 3.0) -> Any:
    """work(), saying `line` on stderr if it is still going after `after_s` seconds."""
    note = threading.Timer(after_s, _log.info, args=(line,))
    note.daemon = True
    note.start()
    try:
        return work()
    finally:
        note.cancel()


def _rank_numbers(
    strategy: Strategy, probe: host_checks.HostProbe, output: RunOutput
) -> tuple[dict[str, Any] | None, list[float | None] | None, list[host_checks.Place]]:
    """On the root: (what other processes did on our CPUs while the run ran, each rank's wall
    that its rank_phases lie inside, where each rank ran). Every rank's place (host, affinity
    mask, CPU seconds) is gathered: the root's host's ranks' CPU seconds do not count as load,
    and their masks together are the CPUs the run had there (a launcher may bind each rank to
    its own cores). Collective."""
    walls = output.timings.walls
    if not walls:
        wall = None
    else:  # training: the whole run; inference: the median-wall iteration (iteration_phases)
        wall = sum(walls) if output.history is not None else output.timings.iteration_wall()
    mine = (probe.place(), wall)
    got = strategy.comm.gather_object(mine) if strategy.comm.size > 1 else [mine]
    if not strategy.is_root:
        return None, None, []
    places = [p for p, _ in got]
    here, cpus = host_checks.local(places, mine[0].host)
    load = probe.host_load(sum(p.cpu_s for p in here), cpus)
    return load, [w for _, w in got], places


def _add_checks(
    record: dict[str, Any],
    strategy: Strategy,
    output: RunOutput,
    load: dict[str, Any] | None,
    places: list[host_checks.Place],
) -> None:
    """The record's `warnings` (oversubscription, host load, spread) and `host` numbers."""
    import torch  # already imported by every strategy

    # serial: one BLAS thread; on a GPU the CPU threads mostly wait for the device
    cpu_threads = not strategy.reference and strategy.cfg.device == "cpu"
    threads = torch.get_num_threads() if cpu_threads else 1
    what = "epochs" if output.history is not None else "iterations"
    warnings, host = host_checks.run_checks(
        strategy.comm.size, threads, output.timings.walls, load, what, places
    )
    record["warnings"] = warnings
    record["host"] = host
    choice = getattr(strategy, "thread_choice", None)  # torch strategies: what set the threads
    if choice is not None:
        record["threads"] = choice.as_record()


def nonfinite(output: RunOutput) -> str | None:
    """What is NaN or inf in the run's final weights or gathered output (root), else None."""
    if output.output is not None and not np.isfinite(output.output).all():
        return "the output holds NaN or inf; no weights written"
    if output.model is not None:
        for name, tensor in output.model.state_dict().items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return f"the final weights hold NaN or inf ({name}); no weights written"
    return None


def _run_mode(
    strategy: Strategy, workload: Workload, model: Any
) -> tuple[RunOutput, Inputs | None]:
    cfg = strategy.cfg
    if cfg.train:
        data = (
            workload.training_data() if strategy.is_root or strategy.needs_data_everywhere else None
        )
        return strategy.train(workload, model, data), None
    inputs = workload.inputs(cfg.batch) if strategy.is_root else None
    return strategy.infer(workload, model, inputs), inputs


def _record_failure(
    strategy: Strategy, cfg: RunConfig, results: Path | None, exc: BaseException
) -> None:
    if results is None or not strategy.is_root:
        return
    error = str(exc) if isinstance(exc, RunFailed) else f"{type(exc).__name__}: {exc}"
    if job_status.launcher_records(error):  # one record per job: the dead rank's
        return
    tb = traceback.format_exc(limit=8)
    append_record(results, failed_record(cfg, error, strategy.comm.size, traceback=tb))


def build_record(
    cfg: RunConfig,
    workload: Workload,
    strategy: Strategy,
    out: RunOutput,
    check: CheckResult | None,
) -> dict[str, Any]:
    timings = out.timings
    if out.history is not None:  # training: the whole run (evaluation excluded) is one wall
        wall = sum(timings.walls)
        items = out.history.items
        phases = timings.phase_totals()
        statistic = "totals over the run (every epoch), per rank"
    else:
        wall = timings.wall_median
        items = out.items_per_iter
        phases = timings.iteration_phases()
        statistic = "the median-wall iteration of each rank (rank 0 in phases)"
    # A training step costs ~3 forwards (backward = grad wrt activations + grad wrt weights).
    flops = workload.flops_per_item() * items * (3 if out.history is not None else 1)
    rec = new_record(
        status="ok" if check is None or check.passed else "check-failed",
        workload=cfg.workload,
        strategy=cfg.strategy,
        mode="train" if cfg.train else "infer",
        ranks=strategy.comm.size,
        precision=strategy.precision.name,
        config=cfg.to_dict(),
        env=environment.collect(),
        **environment.git_commit(),
        items=items,
        iters=len(timings.walls),
        wall_s=wall,
        wall_spread_s=timings.spread(),
        walls_s=timings.walls,
        throughput=items / wall if wall > 0 else float("nan"),
        item_unit=workload.item,
        phases=phases,
        phases_statistic=statistic,
        rank_phases=out.rank_phases,
        bytes=out.bytes_moved,
        flops_per_item=workload.flops_per_item(),
        achieved_tflops=flops / wall / 1e12 if wall > 0 else float("nan"),
        **out.notes,
    )
    if workload.task != "classify":
        rec["task"] = workload.task
    if isinstance(check, CheckResult):
        rec.update(
            relerr=check.relerr,
            tolerance=check.tolerance,
            digest=check.digest,
            reference_digest=check.reference_digest,
            check_passed=check.passed,
            reference=workload.reference_kind,
        )
    if out.history is not None:
        rec.update(loss=out.history.loss, steps=out.history.steps)
        if workload.task == "next-token":  # the held-out figure is the loss (Workload.score)
            held = out.history.accuracy
            rec.update(heldout_loss=held, perplexity=[math.exp(min(v, 700.0)) for v in held])
        else:
            rec.update(accuracy=out.history.accuracy)
        rec.update(headline(timings, items, cfg.warmup))
    return rec


def check_failure_line(rec: dict[str, Any]) -> str | None:
    """The one line naming a failed check (None when it passed or did not run): what was
    compared with what, the error and the bound it broke."""
    if rec.get("status") != "check-failed":
        return None
    cause = (rec.get("explain") or {}).get("cause")
    where = ""
    if cause:
        kernel = f", {cause['kernel']}" if cause.get("kernel") else ""
        where = f"; the error enters at {cause['module'] or 'the model'} ({cause['kind']}{kernel})"
    elif (rec.get("explain") or {}).get("notes"):
        where = "; " + rec["explain"]["notes"][0]
    return (
        f"{rec['workload']} under {rec['strategy']} x{rec['ranks']} ({rec['precision']}): "
        f"relerr {rec['relerr']:.2e} against the {rec.get('reference', 'float64')} reference "
        f"exceeds the tolerance {rec['tolerance']:.1e}{where}"
    )


def format_summary(rec: dict[str, Any]) -> str:
    """A few human lines for the terminal; the record holds everything else."""
    cfg = rec["config"]
    head = (
        f"{rec['workload']} | {rec['strategy']} x{rec['ranks']} | {cfg['device']} "
        f"{rec['precision']} | batch {cfg['batch']}"
    )
    unit = rec["item_unit"]
    if rec["mode"] == "train":
        timing = (
            f"  trained {rec['items']} {unit} in {rec['steps']} steps: "
            f"{rec['wall_s']:.3f} s, {rec['throughput']:.1f} {unit}/s"
        )
    else:
        spread = rec["wall_spread_s"]
        timing = (
            f"  wall {rec['wall_s'] * 1e3:.2f} ms (median of {rec['iters']}, "
            f"min {spread['min'] * 1e3:.2f}, max {spread['max'] * 1e3:.2f}) | "
            f"{rec['throughput']:.1f} {unit}/s | {rec['achieved_tflops'] * 1e3:.2f} GFLOP/s"
        )
    top = {k: v for k, v in rec["phases"].items() if "/" not in k}
    lines = [
        head,
        timing,
        "  phases: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in top.items()),
    ]
    if "train_check" in rec:
        lines.append(train_check_line(rec["train_check"]))
    elif "relerr" in rec:
        verdict = "ok" if rec["check_passed"] else "FAILED"
        basis = f": {rec['tolerance_basis']}" if rec.get("tolerance_basis") else ""
        lines.append(
            f"  check: relerr {rec['relerr']:.2e} (tolerance {rec['tolerance']:.1e}{basis}) "
            f"{verdict} | digest {rec['digest']} (float64 oracle {rec['reference_digest']})"
        )
        lines += explanation_lines(rec.get("explain"))
    if rec["mode"] == "train" and rec.get("heldout_loss"):
        lines.append(
            f"  final loss {rec['loss'][-1]:.4f} | held-out loss {rec['heldout_loss'][-1]:.4f}"
            f" (perplexity {rec['perplexity'][-1]:.2f})"
        )
    elif rec["mode"] == "train":
        lines.append(
            f"  final loss {rec['loss'][-1]:.4f} | held-out accuracy {rec['accuracy'][-1]:.4f}"
        )
    if tokens.summary_line(rec) is not None:
        lines.append(tokens.summary_line(rec))
    lines += numbers_lines(rec)  # spread, phase statistic, steady rate, warnings
    return "\n".join(lines)
