"""`scalelab bench`: the fast path against the peers a user would try first, in one process,
on the same inputs and weights.

Peers (`--peers`): plain eager fp32 and bf16 autocast (`model(prepare(x))`, nothing else: no
channels_last, no cudnn.benchmark), `torch.compile(model)` and `torch.compile(model,
mode="max-autotune")` under bf16 autocast; for training the same step loop around the eager or
compiled model (forward, loss, backward, SGD). The headline ratio is fast over the best peer
measured. Inputs are resident on the device in transport form (host-to-device copies excluded)
and rotate over three batches; training runs epochs over a GPU-resident data set.

Timing: warm-up calls (a compiled peer's first call, its compilation, is recorded as its
setup), then CUDA events around each call, median of many with the IQR.
Checking (bench_check.py): inference logits against the float64 NumPy oracle; training loss
trajectories against float64 torch, tolerance from the eager bf16 loop of the same run. A
fast path over its tolerance makes the record `failed` and the command exit 1.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from scalelab.config import RunConfig
from scalelab.fast import accelerate, bench_check, stderr_log
from scalelab.fast.captured_step import GraphStep
from scalelab.fast.timing import sync, time_calls
from scalelab.instrument import peaks
from scalelab.instrument.progress import Progress
from scalelab.oracle.check import relative_error
from scalelab.precision import get_precision
from scalelab.train.sources import batch_order, batch_slices
from scalelab.workloads import WORKLOADS, Workload
from scalelab.workloads.base import state_dict_float64

BF16 = torch.bfloat16


@dataclass(frozen=True)
class BenchDefaults:
    mode: str
    batch: int
    overrides: dict[str, Any]


# The GPU reference points: each workload's mode, batch size (those of the speed table in
# docs/PERFORMANCE.md) and data set shape.
DEFAULTS = {
    "charcnn": BenchDefaults("infer", 4096, {}),
    "alexnet": BenchDefaults("infer", 1024, {}),
    "resnet18": BenchDefaults("train", 512, {"train_size": 512 * 12, "heldout_size": 100}),
    "mlp": BenchDefaults("train", 3000, {"train_size": 60000, "heldout_size": 100, "hidden": 512}),
}
FALLBACK = BenchDefaults("infer", 256, {})
# On a CPU the GPU sizes run for many minutes (charcnn at 4096: 16 min on 2 cores); these
# finish in seconds and still exercise every mode.
CPU_DEFAULTS = {
    "charcnn": BenchDefaults("infer", 16, {}),
    "alexnet": BenchDefaults("infer", 8, {}),
    "resnet18": BenchDefaults("train", 32, {"train_size": 32 * 4, "heldout_size": 16}),
    "mlp": BenchDefaults("train", 100, {"train_size": 2000, "heldout_size": 100, "hidden": 512}),
}
CPU_FALLBACK = BenchDefaults("infer", 8, {})


@dataclass(frozen=True)
class Peer:
    amp: torch.dtype | None  # autocast dtype (None: fp32)
    compile_mode: str | None  # torch.compile mode, None: eager


# key -> peer; keys are record field prefixes (<key>_throughput, <key>_relerr)
PEERS = {
    "eager_fp32": Peer(None, None),
    "eager": Peer(BF16, None),
    "compile": Peer(BF16, "default"),
    "compile_max": Peer(BF16, "max-autotune"),
}
PEER_NAMES = {"compile_max": "max-autotune"}  # what the CLI and tables call them
GPU_PEERS = ("eager_fp32", "eager", "compile", "compile_max")
CPU_PEERS = ("eager_fp32", "eager")  # Inductor's C++ compile is minutes per mode on 2 cores


def computes_bf16(device: str) -> bool:
    """Whether bf16 runs natively: a GPU, or a CPU with bf16 units (oneDNN's check: AVX512-BF16
    or AMX). Elsewhere it is emulated, ~16x slower than fp32 (charcnn at batch 16 on 2 AVX2
    cores: 10 s a call against 0.6 s)."""
    if device == "cuda":
        return True
    return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())


def default_peers(device: str) -> tuple[str, ...]:
    """The peers a bench measures unless told: all on a GPU; on a CPU no Inductor compile, and
    the bf16 eager peer only where bf16 is native (an emulated one is a peer no user picks)."""
    if device == "cuda":
        return GPU_PEERS
    return CPU_PEERS if computes_bf16(device) else ("eager_fp32",)


def defaults_for(name: str, device: str) -> BenchDefaults:
    if device == "cuda":
        return DEFAULTS.get(name, FALLBACK)
    return CPU_DEFAULTS.get(name, CPU_FALLBACK)


def compiled(model: nn.Module, peer: Peer) -> nn.Module:
    """model itself (eager) or a fresh torch.compile of it (dynamo state reset, so one mode's
    guards and caches do not leak into the next)."""
    if peer.compile_mode is None:
        return model
    _reset_dynamo()
    return torch.compile(model, mode=peer.compile_mode)


def _reset_dynamo() -> None:
    """A compiled peer's caches and guards cleared before the next mode; nothing to clear (and
    no dynamo to import, ~2 s of CPU) where nothing compiled."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


def gemm_ceiling(device: torch.device) -> tuple[float, str]:
    """Best measured matmul FLOP/s: bf16 8192^3 on a GPU, fp32 1024^3 on a CPU."""
    n, dtype = (8192, BF16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = time_calls(lambda _: torch.mm(a, b), [None], device, warmup=3, iters=10)
    return 2 * n**3 / min(times), f"{str(dtype).removeprefix('torch.')} mm {n}^3"


def _stats(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    median = statistics.median(times)
    return {
        "median_s": median,
        "iqr_s": q[2] - q[0],
        "cv": statistics.pstdev(times) / median if median > 0 else 0.0,
        "min_s": min(times),
        "max_s": max(times),
        "n": len(times),
    }


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


def eager_forward(workload: Workload, model: nn.Module, amp: torch.dtype | None) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), _autocast(x.device, amp):
            return model(workload.prepare(x))

    return forward


def bench_inference(
    workload: Workload, cfg: RunConfig, device: torch.device, opts: dict[str, Any]
) -> dict[str, Any]:
    model = workload.build_model().to(device)
    inputs = [workload.synthetic_inputs(cfg.batch, cfg.seed + 1 + i).x.to(device) for i in range(3)]
    k = min(opts["oracle_items"], cfg.batch)
    ref = workload.reference_forward(state_dict_float64(model), inputs[0][:k].cpu().numpy())
    out: dict[str, Any] = {"timing": {}, "peer_setup_s": {}}
    torch.backends.cudnn.benchmark = False  # the baseline a user gets by default
    for key in opts["peers"]:
        peer = PEERS[key]
        fwd = eager_forward(workload, compiled(model, peer), peer.amp)
        first = _timed_first(fwd, inputs[0], device)
        out["peer_setup_s"][key], out[f"{key}_relerr"] = first[0], _relerr(first[1][:k], ref)
        _time_mode(out, key, fwd, inputs, device, opts, workload, cfg.batch)
    _reset_dynamo()
    fast = accelerate(workload, model, cfg, device, log=stderr_log(opts["quiet"]))
    out["fast_setup_s"], first = _timed_first(fast, inputs[0], device)
    out["fast_relerr"] = _relerr(first[:k], ref)
    _time_mode(out, "fast", fast, inputs, device, opts, workload, cfg.batch)
    out.update(_fast_details(fast), relerr_basis=f"float64 NumPy oracle on the first {k} items")
    out["tolerance"] = get_precision("bf16").tolerance
    return out


def _timed_first(fn: Callable, arg: Any, device: torch.device) -> tuple[float, Any]:
    """(seconds, result) of the first call: compilation, autotuning, graph capture."""
    start = time.perf_counter()
    result = fn(arg)
    sync(device)
    return time.perf_counter() - start, result


def _progress(opts: dict[str, Any], workload: Workload, key: str, items: int, st: dict) -> None:
    """One line per measured mode, so a long benchmark shows where it is."""
    rate = items / st["median_s"]
    stderr_log(opts["quiet"])(
        f"bench {workload.cfg.workload}: {PEER_NAMES.get(key, key):<12} {rate:>12,.0f} "
        f"{workload.item}/s "
        f"(median of {st['n']}, {st['median_s'] * 1e3:.2f} ms per call)"
    )


def _relerr(out: torch.Tensor, ref: np.ndarray) -> float:
    return relative_error(out.detach().to("cpu", torch.float64).numpy(), ref)


def _fast_details(fast: Any) -> dict[str, Any]:
    details = getattr(fast, "describe", None)
    if details is None:  # the CPU fallback: a plain function
        return {"fast_parts": {"all": "plain torch (no CUDA GPU)"}, "unavailable": ["no CUDA GPU"]}
    return {
        "fast_parts": fast.parts,
        "fast_notes": fast.plan.notes,
        "unavailable": fast.unavailable,
        "fast_stage_ms": {k: v * 1e3 for k, v in fast.stage_seconds().items()},
        "fast_tuned_from_cache": fast.tuned_from_cache(),
        "fast_rejected": {c.stage: c.rejected for c in fast.choices if c.rejected},
    }


# --- training ------------------------------------------------------------------------------
def eager_train_step(
    workload: Workload,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: tuple[torch.Tensor, torch.Tensor],
    amp: torch.dtype | None,
    input_dtype: torch.dtype = torch.float32,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The loop a user writes: gather, prepare, forward + loss under autocast, backward, step."""
    x_all, y_all = data

    def step(idx: torch.Tensor) -> None:
        x = workload.prepare(x_all[idx]).to(input_dtype)
        with _autocast(idx.device, amp):
            loss = workload.loss(model, model(x), y_all[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().double().clone() for k, p in model.named_parameters()}


def _update_relerr(model: nn.Module, before: dict, ref_delta: dict) -> float:
    """relerr of model's parameter change since `before` against the float64 step's change."""
    after = _params(model)
    delta = torch.cat([(after[k] - before[k]).flatten() for k in before])
    ref = torch.cat([ref_delta[k].flatten() for k in before])
    return float((delta - ref).norm() / ref.norm())


def bench_training(
    workload: Workload, cfg: RunConfig, device: torch.device, opts: dict[str, Any]
) -> dict[str, Any]:
    model = workload.build_model().to(device).train()
    train, _ = workload.training_data()
    data = (train.x.to(device), train.y.to(device))
    n = len(train)
    orders = [batch_order(n, e, cfg.seed).to(device) for e in range(3)]  # rotate epochs
    batches = [orders[0][part] for part in batch_slices(n, cfg.batch)][: bench_check.STEPS]
    ref = bench_check.float64_trajectory(workload, model, data, batches, eager_train_step)
    out: dict[str, Any] = {"timing": {}, "peer_setup_s": {}, "losses_float64": ref}
    torch.backends.cudnn.benchmark = False
    for key in opts["peers"]:
        peer, m = PEERS[key], copy.deepcopy(model)
        step = eager_train_step(workload, compiled(m, peer), workload.optimizer(m), data, peer.amp)
        start = time.perf_counter()
        out[f"losses_{key}"] = bench_check.trajectory(step, batches)
        out["peer_setup_s"][key] = time.perf_counter() - start
        out[f"{key}_relerr"] = bench_check.deviation(out[f"losses_{key}"], ref)
        _time_mode(out, key, _epoch(step, n, cfg.batch), orders, device, opts, workload, n)
    _reset_dynamo()
    m = copy.deepcopy(model)
    start = time.perf_counter()
    step, details = _fast_step(workload, m, cfg, data, device, opts)
    sync(device)
    out["fast_setup_s"] = time.perf_counter() - start
    out["losses_fast"] = bench_check.trajectory(step, batches, summed=details.pop("summed"))
    out["fast_relerr"] = bench_check.deviation(out["losses_fast"], ref)
    _time_mode(out, "fast", _epoch(step, n, cfg.batch), orders, device, opts, workload, n)
    eager_dev = out.get("eager_relerr", out.get("eager_fp32_relerr", 0.0))
    out.update(details, relerr_basis=bench_check.TRAIN_BASIS)
    out["tolerance"] = bench_check.train_tolerance(eager_dev)
    return out


def _time_mode(out, key, fn, args, device, opts, workload, items) -> None:
    """Time fn over the rotating args into out["timing"][key] and say how fast it was."""
    label = f"bench {workload.cfg.workload}: timing {PEER_NAMES.get(key, key)}"
    runs = opts["warmup"] + opts["iters"]
    bar = Progress(runs, label, enabled=not opts["quiet"])  # a line every few s of a slow mode
    out["timing"][key] = _stats(time_calls(fn, args, device, opts["warmup"], opts["iters"], bar))
    _progress(opts, workload, key, items, out["timing"][key])


def _epoch(step: Callable[[torch.Tensor], None], n: int, batch: int) -> Callable:
    def epoch(order: torch.Tensor) -> None:
        for part in batch_slices(n, batch):
            step(order[part])

    return epoch


def _fast_step(workload, model, cfg, data, device, opts) -> tuple[Callable, dict[str, Any]]:
    opt = workload.optimizer(model)
    if device.type != "cuda":
        stderr_log(opts["quiet"])(
            f"fast training on {device.type}: CUDA graphs unavailable (no CUDA GPU); "
            f"running the plain {cfg.dtype} step"
        )
        details = {"fast_parts": {"step": f"eager {cfg.dtype}"}, "unavailable": ["no CUDA GPU"]}
        amp = BF16 if cfg.dtype == "bf16" else None
        return eager_train_step(workload, model, opt, data, amp), {**details, "summed": False}
    torch.backends.cudnn.benchmark = True
    trainer = GraphStep(model, opt, workload.prepare, workload.loss, data, cfg.batch, BF16)
    parts = {"data": "GPU resident, prepared once", "step": "CUDA graph", "amp": "bf16"}
    if trainer.channels_last:
        parts["layout"] = "channels_last"
    return trainer.step, {"fast_parts": parts, "unavailable": [], "summed": True}


# --- one workload, end to end --------------------------------------------------------------
def bench_workload(name: str, opts: dict[str, Any]) -> Workload:
    """The workload a bench of `name` measures, its options checked (a UsageError for bad
    ones, before anything is measured); its cfg holds the mode and sizes."""
    defaults = defaults_for(name, opts["device"])
    mode = opts.get("mode") or defaults.mode
    given = {k: v for k, v in opts["config"].items() if v is not None}
    fields = {**defaults.overrides, "batch": defaults.batch, **given}
    # the fast path computes in bf16; its plain fallback on a CPU that emulates bf16 runs fp32
    dtype = "bf16" if computes_bf16(opts["device"]) else "fp32"
    cfg = RunConfig(workload=name, dtype=dtype, train=mode == "train", quiet=True, **fields)
    return WORKLOADS.get(name)(cfg)


def run_bench(
    name: str, opts: dict[str, Any], ceiling: float, workload: Workload | None = None
) -> dict[str, Any]:
    """Measure one workload (bench_workload's, or the one given); returns the record fields
    (without environment and ids)."""
    workload = workload or bench_workload(name, opts)
    cfg = workload.cfg
    mode = "train" if cfg.train else "infer"
    device = torch.device(opts["device"])
    runner = bench_training if mode == "train" else bench_inference
    res = runner(workload, cfg, device, opts)
    items = workload.train_size if mode == "train" else cfg.batch
    flops = workload.flops_per_item() * (3 if mode == "train" else 1)
    rates = {k: items / v["median_s"] for k, v in res["timing"].items()}
    peers = {k: v for k, v in rates.items() if k != "fast"}
    best = max(peers, key=peers.get)
    rec = {
        "workload": name,
        "mode": mode,
        "batch": cfg.batch,
        "items_per_call": items,
        "item_unit": workload.item,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "peers": list(peers),
        **{f"{k}_throughput": v for k, v in rates.items()},
        "best_peer": best,
        "fast_dtype": cfg.dtype,  # bf16; fp32 where a CPU would emulate bf16
        "ratio": rates["fast"] / peers[best],
        "ratio_eager": rates["fast"] / rates["eager"] if "eager" in rates else None,
        "flops_per_item": flops,
        "tflops": rates["fast"] * flops / 1e12,
        "peer_tflops": peers[best] * flops / 1e12,
        "gemm_ceiling_tflops": ceiling / 1e12,
        "ceiling_fraction": rates["fast"] * flops / ceiling,
        "relerr": res.pop("fast_relerr"),
        **res,
        "config": cfg.to_dict(),
    }
    if workload.tokens_per_item:  # a language model's readers count tokens and MFU
        rec.update(token_fields(rec, workload.tokens_per_item, ceiling))
    return rec


def token_fields(rec: dict[str, Any], tokens_per_item: int, ceiling: float) -> dict[str, Any]:
    """tokens/s of the fast path and of its best peer, and the fast path's MFU against the
    GEMM rate measured in this run and, where the GPU has one, its datasheet peak (the
    dtype the fast path computes in; run/tokens.py's definition, instrument/peaks.mfu)."""
    per_token = rec["flops_per_item"] / tokens_per_item  # x3 already where training
    tokens = rec["fast_throughput"] * tokens_per_item
    measured = (ceiling, "this bench's GEMM ceiling")
    mfu = peaks.mfu(per_token, tokens, rec["fast_dtype"], measured, rec["gpu"])
    best = rec[f"{rec['best_peer']}_throughput"] * tokens_per_item
    return {"tokens_per_s": tokens, "peer_tokens_per_s": best, "mfu": mfu}
