"""`run --train --check`: train the same steps under the strategy and in one float64
process (the same initial weights, the same batches in the same order, `local` on the CPU),
then compare the weights and buffers (oracle/train_compare.py).

The tolerance fits the run: fp64 is held to its floor (precision.py); a lower precision to
FACTOR x what one process in that dtype and device loses against float64 (a second one-process
run), or the dtype's floor where that is larger. What a strategy computes differently by
design is said, not failed silently: BatchNorm normalises over each rank's share (ddp,
mpi-dp, a mesh's replicas) or each micro-batch (pipeline), so the check names the modules
and the difference and offers `--sync-bn`; dropout masks are drawn per rank, so a checked
run trains with dropout off, and says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from scalelab import config_sections
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.oracle.train_compare import TrainCheck, bound, state_diff
from scalelab.precision import PRECISIONS
from scalelab.strategies import STRATEGIES, Strategy
from scalelab.train import sync_bn
from scalelab.workloads import WORKLOADS

_log = logging.getLogger("scalelab.run")
SYNC_BN = ("ddp", "mpi-dp")  # strategies whose ranks each normalise their share
# The sections a one-process `local` run of the same training reads from cfg.
SAME = {"run", "workload", "timing", "train", *config_sections.SHAPES}


@dataclass
class Prep:
    """What `prepare` changed in the model before training (for the record)."""

    dropout_off: list[str] = field(default_factory=list)
    synced: list[str] = field(default_factory=list)  # BatchNorm modules under --sync-bn


def refuse(cfg: RunConfig) -> None:
    """--sync-bn where it means something, --check where one process can follow the run."""
    if cfg.sync_bn and cfg.strategy not in SYNC_BN:
        hint = (
            "; each micro-batch is normalised on its own (--microbatches 1 normalises the "
            "whole batch)"
            if STRATEGIES.get(cfg.strategy).pipelined
            else ""
        )
        raise UsageError(f"--sync-bn: only {' and '.join(SYNC_BN)} normalise per rank{hint}")
    if cfg.train and cfg.check and cfg.resume is not None:
        raise UsageError("--check trains from the first step: it cannot follow --resume")


def prepare(cfg: RunConfig, strategy: Strategy, model: nn.Module) -> tuple[nn.Module, Prep]:
    """Every rank, before training: dropout off under --check, BatchNorm synced under
    --sync-bn (torch's SyncBatchNorm on GPUs under NCCL, AllReduceBatchNorm elsewhere)."""
    prep = Prep()
    if cfg.train and cfg.check:
        prep.dropout_off = dropout_off(model)
    if cfg.train and cfg.sync_bn:
        prep.synced = sync_bn.batchnorms(model)
        model = sync_bn.convert(model, _reduce(strategy))
    return model, prep


def _reduce(strategy: Strategy) -> sync_bn.Reduce | None:
    comm = strategy.comm
    if strategy.cfg.device == "cuda" and type(comm).__name__ == "TorchDistComm":
        return None  # NCCL: torch's SyncBatchNorm
    if comm.size == 1:
        return lambda t: t
    return lambda t: comm.allreduce(t.cpu()).to(t.device)


def dropout_off(model: nn.Module) -> list[str]:
    """Set every dropout probability to 0: nn.Dropout*, and the floats a module hands to
    F.dropout or a layer skip (MultiheadAttention's `dropout`; Hugging Face's OPT keeps
    `dropout`, `activation_dropout` and `layerdrop` as floats, so no nn.Dropout is there to
    find). The names of the modules whose dropout was on."""
    off = []
    for name, m in model.named_modules():
        on = False
        if isinstance(m, nn.modules.dropout._DropoutNd):
            on, m.p = bool(m.p), 0.0
        for attr, value in list(vars(m).items()):
            if _is_drop_probability(attr, value):
                on = True
                setattr(m, attr, 0.0)
        if on:
            off.append(name or type(m).__name__)
    return off


def _is_drop_probability(attr: str, value: object) -> bool:
    """A float attribute named for dropping (dropout, attention_dropout, resid_pdrop,
    layerdrop, drop_path_rate), in (0, 1]: a probability the forward draws masks from."""
    return "drop" in attr.lower() and isinstance(value, float) and 0.0 < value <= 1.0


def check(
    cfg: RunConfig, initial: dict[str, np.ndarray], trained: nn.Module, prep: Prep
) -> TrainCheck:
    """Root, after training: the verdict against one float64 process from `initial`."""
    ref = reference(cfg, initial, "fp64", "cpu")
    diff = state_diff(_state(trained), ref)
    same = None
    dtype = cfg.amp or cfg.dtype  # --amp bf16 computes as --dtype bf16 does (precision.py)
    if dtype != "fp64":
        here = reference(cfg, initial, dtype, cfg.device)
        same = state_diff(here, ref).relerr
    floor = PRECISIONS[dtype].tolerance
    tolerance, basis = bound(floor, dtype, same)
    notes: dict[str, Any] = {"dropout_off": prep.dropout_off, "one_process_relerr": same}
    result = TrainCheck(diff, tolerance, basis, "one float64 process (local, cpu)", notes)
    if dtype == "fp64" and not result.passed:
        _judge_float32_inside(cfg, initial, result)
    result.notes.update(batchnorm_notes(cfg, prep, ref, _state(trained), diff))
    if not result.passed and result.notes.get("batchnorm"):
        result.cause = by_design_line(result.notes["batchnorm"], diff.relerr)
    return result


def _judge_float32_inside(cfg: RunConfig, initial: dict[str, np.ndarray], result) -> None:
    """An fp64 run of a model that computes in float32 inside (Gemma's RMSNorm casts its input
    and weight to float32 and back) cannot hold the fp64 floor: a strategy that sums in
    another order (a pipeline's micro-batches) moves those modules' weights by fp32 rounding
    (5.8e-8 in Gemma's norms, relerr 3e-11 in all). Such a model is judged at the fp32 floor,
    said with the modules; a model computing in fp64 throughout keeps the fp64 floor."""
    _, workload, model = _one_process_model(cfg, initial, "fp64", "cpu")
    x = workload.prepare(workload.synthetic_inputs(1, cfg.seed).x)
    x = x.to(torch.float64) if x.is_floating_point() else x  # (1, ...) as the fp64 run's
    found = float32_inside(model.to(torch.float64), x)
    if not found:
        return
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    result.tolerance = max(result.tolerance, PRECISIONS["fp32"].tolerance)
    result.basis = f"the fp32 floor (precision.py): the model computes in float32 in {shown}"
    result.notes["float32_inside"] = found


def float32_inside(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The modules (innermost, by name) whose forward makes a float32 tensor when the model
    and x are float64: one forward, watched by a dispatch mode."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []
    found: dict[str, None] = {}

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            leaves = tree_leaves(out)
            if stack and any(torch.is_tensor(t) and t.dtype == torch.float32 for t in leaves):
                found[stack[-1]] = None
            return out

    hooks = []
    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(lambda mod, a: stack.append(names[id(mod)])))
        hooks.append(m.register_forward_hook(lambda mod, a, o: _drop(stack)))
    try:
        with torch.no_grad(), Watch():
            model(x)
    except Exception:  # noqa: BLE001 (a forward the watch upsets: nothing to say)
        return []
    finally:
        for h in hooks:
            h.remove()
    return [n for n in found if n]


def _drop(stack: list[str]) -> None:
    stack.pop()  # returns None: a forward hook's value would replace the module's output


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _one_process_model(
    cfg: RunConfig, initial: dict[str, np.ndarray], dtype: str, device: str
) -> tuple[RunConfig, Any, nn.Module]:
    """The one `local` process's config, workload and model at `initial`, dropout off."""
    keep = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.metadata["section"] in SAME}
    one = replace(
        RunConfig(**keep), strategy="local", ranks=1, dtype=dtype, device=device, check=False,
        quiet=True, weights=None, save_weights=None, sync_bn=False,
    )  # fmt: skip
    workload = WORKLOADS.get(one.workload)(one)
    model = workload.build_model()
    dropout_off(model)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    return one, workload, model


def reference(
    cfg: RunConfig, initial: dict[str, np.ndarray], dtype: str, device: str
) -> dict[str, torch.Tensor]:
    """The weights and buffers one `local` process trains from `initial` in dtype on device
    (the same batches in the same order: every strategy's data order is one process's)."""
    one, workload, model = _one_process_model(cfg, initial, dtype, device)
    strategy = STRATEGIES.get("local").build(one)
    try:
        out = strategy.train(workload, model, workload.training_data())
    finally:
        strategy.close()
    assert out.model is not None
    return _state(out.model)


def batchnorm_notes(
    cfg: RunConfig, prep: Prep, ref: dict, trained: dict, diff: Any
) -> dict[str, Any]:
    """Where BatchNorm normalises over a part of the batch in this run: which modules, over
    what, and how far its running statistics and the rest of the weights moved."""
    names = [n for n, k in _bn_modules(ref)]
    split = bn_split(cfg)
    if not names or split is None or prep.synced:
        return {"sync_bn": bool(prep.synced)} if prep.synced else {}
    stats = [k for k in ref if k.endswith(("running_mean", "running_var"))]
    rest = [k for k in ref if k not in stats and ref[k].is_floating_point()]
    return {
        "batchnorm": {
            "modules": names, "normalises_over": split,
            "running_stats_relerr": diff.over(stats, trained, ref),
            "other_weights_relerr": diff.over(rest, trained, ref),
        }
    }  # fmt: skip


def _bn_modules(state: dict) -> list[tuple[str, str]]:
    """(module, key) of each BatchNorm-like module, found by its running_mean buffer."""
    keys = [k for k in state if k.endswith("running_mean")]
    return [(k.rsplit(".", 1)[0] if "." in k else "", k) for k in keys]


def bn_split(cfg: RunConfig) -> str | None:
    """What this run's BatchNorm normalises over when that is less than the batch."""
    if cfg.strategy in SYNC_BN and cfg.ranks > 1:
        return f"each rank's share of the batch ({cfg.ranks} ranks)"
    if getattr(cfg, "dp", 1) > 1 and STRATEGIES.get(cfg.strategy).splits_model:
        return f"each data-parallel replica's share of the batch (--dp {cfg.dp})"
    if STRATEGIES.get(cfg.strategy).pipelined and min(cfg.microbatches, cfg.batch) > 1:
        return f"each micro-batch ({cfg.microbatches} per batch)"
    return None


def by_design_line(bn: dict[str, Any], relerr: float) -> str:
    mods = ", ".join(bn["modules"])
    offer = (
        "--sync-bn normalises over the whole batch"
        if "rank" in bn["normalises_over"] and "replica" not in bn["normalises_over"]
        else "--microbatches 1 normalises over the whole batch"
        if "micro" in bn["normalises_over"]
        else "one process normalises over the whole batch"
    )
    return (
        f"by design: BatchNorm ({mods}) normalises over {bn['normalises_over']}, not the "
        f"whole batch: running statistics differ by {bn['running_stats_relerr']:.1e}, the "
        f"other weights by {bn['other_weights_relerr']:.1e}; {offer}"
    )
