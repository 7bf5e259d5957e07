"""`scalelab bench`: plain PyTorch eager (fp32, bf16 autocast) against the fast path, in one
process, on the same inputs and weights.

Inference: the workload's own model in eval mode, `model(prepare(x))` under
torch.autocast(bf16) or in fp32, nothing else (no channels_last, no cudnn.benchmark, no
compile) is the baseline; the fast path is `accelerate()`. Inputs are resident on the device
in transport form (host-to-device copies excluded from both) and rotate over three batches.
Training: one epoch over a GPU-resident data set, the same batches for both; the eager loop
is forward, loss, backward, SGD step under autocast, the fast one fast/train.py's graph.

Timing: warm-up calls, then CUDA events around each call, median of many. relerr is against
float64: the NumPy oracle on the first items (inference), or the parameter update of the
first step against the same step in float64 torch (training).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from scalelab.config import RunConfig
from scalelab.fast import accelerate, stderr_log
from scalelab.fast.timing import sync, time_calls
from scalelab.fast.train import GraphStep
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


# The reference points: batch sizes and data set shapes of the target table.
DEFAULTS = {
    "charcnn": BenchDefaults("infer", 4096, {}),
    "alexnet": BenchDefaults("infer", 1024, {}),
    "resnet18": BenchDefaults("train", 512, {"train_size": 512 * 12, "heldout_size": 100}),
    "mlp": BenchDefaults("train", 3000, {"train_size": 60000, "heldout_size": 100, "hidden": 512}),
}
FALLBACK = BenchDefaults("infer", 256, {})


def gemm_ceiling(device: torch.device) -> tuple[float, str]:
    """Best measured matmul FLOP/s: bf16 8192^3 on a GPU, fp32 1024^3 on a CPU."""
    n, dtype = (8192, BF16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = time_calls(lambda _: torch.mm(a, b), [None], device, warmup=3, iters=10)
    return 2 * n**3 / min(times), f"{str(dtype).removeprefix('torch.')} mm {n}^3"


def _stats(times: list[float]) -> dict[str, float]:
    return {
        "median_s": statistics.median(times),
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
    out: dict[str, Any] = {"timing": {}}
    torch.backends.cudnn.benchmark = False  # the baseline a user gets by default
    runs = [(key, eager_forward(workload, model, amp)) for key, amp in _eager_modes(opts)]
    if opts.get("compile"):  # torch.compile of the same model, the same loop around it
        runs.append(("compile", eager_forward(workload, torch.compile(model), BF16)))
    for key, fwd in runs:
        out[f"{key}_relerr"] = _relerr(fwd(inputs[0])[:k], ref)
        _time_mode(out, key, fwd, inputs, device, opts, workload, cfg.batch)
    start = time.perf_counter()  # choosing stages (compiling kernels) and graph capture
    fast = accelerate(workload, model, cfg, device, log=stderr_log(opts["quiet"]))
    first = fast(inputs[0])
    sync(device)
    out["fast_setup_s"] = time.perf_counter() - start
    out["fast_relerr"] = _relerr(first[:k], ref)
    _time_mode(out, "fast", fast, inputs, device, opts, workload, cfg.batch)
    out.update(_fast_details(fast), relerr_basis=f"float64 NumPy oracle on the first {k} items")
    return out


def _progress(opts: dict[str, Any], workload: Workload, key: str, items: int, st: dict) -> None:
    """One line per measured mode, so a long benchmark shows where it is."""
    rate = items / st["median_s"]
    stderr_log(opts["quiet"])(
        f"bench {workload.cfg.workload}: {key:<10} {rate:>12,.0f} {workload.item}/s "
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
) -> Callable[[torch.Tensor], None]:
    """The loop a user writes: gather, prepare, forward + loss under autocast, backward, step."""
    x_all, y_all = data

    def step(idx: torch.Tensor) -> None:
        x = workload.prepare(x_all[idx]).to(input_dtype)
        with _autocast(idx.device, amp):
            loss = workload.loss(model, model(x), y_all[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().double().clone() for k, p in model.named_parameters()}


def _update_relerr(model: nn.Module, before: dict, ref_delta: dict) -> float:
    """relerr of model's parameter change since `before` against the float64 step's change."""
    after = _params(model)
    delta = torch.cat([(after[k] - before[k]).flatten() for k in before])
    ref = torch.cat([ref_delta[k].flatten() for k in before])
    return float((delta - ref).norm() / ref.norm())


def fp64_update(workload: Workload, model: nn.Module, data, idx: torch.Tensor) -> dict:
    """The parameter change of one training step in float64 from model's current weights."""
    m64 = copy.deepcopy(model).double().train()
    before = _params(m64)
    # prepare() gives float32; the float64 step starts from those same values
    step = eager_train_step(workload, m64, workload.optimizer(m64), data, None, torch.float64)
    step(idx)
    after = _params(m64)
    return {k: after[k] - before[k] for k in before}


def bench_training(
    workload: Workload, cfg: RunConfig, device: torch.device, opts: dict[str, Any]
) -> dict[str, Any]:
    model = workload.build_model().to(device).train()
    train, _ = workload.training_data()
    data = (train.x.to(device), train.y.to(device))
    n = len(train)
    orders = [batch_order(n, e, cfg.seed).to(device) for e in range(3)]  # rotate epochs
    first = orders[0][: cfg.batch]
    ref_delta, before = fp64_update(workload, model, data, first), _params(model)
    out: dict[str, Any] = {"timing": {}}
    torch.backends.cudnn.benchmark = False
    for key, amp in _eager_modes(opts):
        m = copy.deepcopy(model)
        step = eager_train_step(workload, m, workload.optimizer(m), data, amp)
        step(first)
        out[f"{key}_relerr"] = _update_relerr(m, before, ref_delta)
        _time_mode(out, key, _epoch(step, n, cfg.batch), orders, device, opts, workload, n)
    m = copy.deepcopy(model)
    start = time.perf_counter()
    step, details = _fast_step(workload, m, cfg, data, device, opts)
    sync(device)
    out["fast_setup_s"] = time.perf_counter() - start
    step(first)
    out["fast_relerr"] = _update_relerr(m, before, ref_delta)
    _time_mode(out, "fast", _epoch(step, n, cfg.batch), orders, device, opts, workload, n)
    out.update(details, relerr_basis="update of step 1 against the same step in float64 torch")
    return out


def _eager_modes(opts: dict[str, Any]) -> list[tuple[str, torch.dtype | None]]:
    return [("eager_fp32", None), ("eager", BF16)] if opts["fp32"] else [("eager", BF16)]


def _time_mode(out, key, fn, args, device, opts, workload, items) -> None:
    """Time fn over the rotating args into out["timing"][key] and say how fast it was."""
    out["timing"][key] = _stats(time_calls(fn, args, device, opts["warmup"], opts["iters"]))
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
            "running the plain bf16 step"
        )
        details = {"fast_parts": {"step": "eager bf16"}, "unavailable": ["no CUDA GPU"]}
        return eager_train_step(workload, model, opt, data, BF16), details
    torch.backends.cudnn.benchmark = True
    trainer = GraphStep(model, opt, workload.prepare, workload.loss, data, cfg.batch, BF16)
    parts = {"data": "GPU resident, prepared once", "step": "CUDA graph", "amp": "bf16"}
    if trainer.channels_last:
        parts["layout"] = "channels_last"
    return trainer.step, {"fast_parts": parts, "unavailable": []}


# --- one workload, end to end --------------------------------------------------------------
def run_bench(name: str, opts: dict[str, Any], ceiling: float) -> dict[str, Any]:
    """Measure one workload; returns the record fields (without environment and ids)."""
    defaults = DEFAULTS.get(name, FALLBACK)
    mode = opts.get("mode") or defaults.mode
    given = {k: v for k, v in opts["config"].items() if v is not None}
    fields = {**defaults.overrides, "batch": defaults.batch, **given}
    cfg = RunConfig(workload=name, dtype="bf16", train=mode == "train", quiet=True, **fields)
    device = torch.device(opts["device"])
    workload = WORKLOADS.get(name)(cfg)
    runner = bench_training if mode == "train" else bench_inference
    res = runner(workload, cfg, device, opts)
    items = cfg.train_size if mode == "train" else cfg.batch
    flops = workload.flops_per_item() * (3 if mode == "train" else 1)
    rates = {k: items / v["median_s"] for k, v in res["timing"].items()}
    rec = {
        "workload": name,
        "mode": mode,
        "batch": cfg.batch,
        "items_per_call": items,
        "item_unit": workload.item,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "eager_fp32_throughput": rates.get("eager_fp32"),
        "compile_throughput": rates.get("compile"),
        "eager_throughput": rates["eager"],
        "fast_throughput": rates["fast"],
        "ratio": rates["fast"] / rates["eager"],
        "ratio_fp32": rates["fast"] / rates["eager_fp32"] if "eager_fp32" in rates else None,
        "flops_per_item": flops,
        "tflops": rates["fast"] * flops / 1e12,
        "eager_tflops": rates["eager"] * flops / 1e12,
        "gemm_ceiling_tflops": ceiling / 1e12,
        "ceiling_fraction": rates["fast"] * flops / ceiling,
        "relerr": res.pop("fast_relerr"),
        "tolerance": get_precision("bf16").tolerance,
        **res,
        "config": cfg.to_dict(),
    }
    return rec
