"""What compiling a language model's loss buys on one GPU: the example GPT with every
position's logits (`lm=True`), bf16 autocast, SGD with momentum, trained as a plain loop with
the model compiled whole or block by block, its next-token cross-entropy eager or compiled.

    python benchmarks/compiled_loss_probe.py --out F.jsonl [--runs whole,blocks,...]

A step's (B, T, V) logits at GPT-2 small's shape are 16 x 1024 x 50304: 1.65 GB in bf16, 3.3
GB once upcast to fp32 for the softmax. Eager cross-entropy writes the fp32 copy, its log-
softmax and their gradients; a compiled one reads the bf16 logits and writes their bf16
gradient. Runs (each a fresh model, the same seed):
  whole        torch.compile(model), loss eager (scalelab bench's compiled peer)
  whole+loss   torch.compile(model), the loss compiled as its own function
  fused        one compiled function: model and loss (nanoGPT's forward returns the loss)
  blocks       each block compiled in place, the rest eager (scalelab's --compile)
  blocks+loss  each block compiled, the loss compiled
A run named NAME@MODE compiles with torch.compile's mode MODE (fused@max-autotune-no-cudagraphs,
fused@reduce-overhead: CUDA graphs around the compiled forward and backward).
--profile NAME traces 3 of that run's steps after timing and adds the step's GPU time by kernel
family (GEMM, attention, Triton-fused, optimizer, other) to its line: where an MFU goes.
Steady sequences/s over --steps after --warmup, between two device syncs; rounds alternate.
One JSON line per run and round.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

GPT_FILE = Path(__file__).resolve().parents[1] / "examples" / "models" / "gpt.py"


def load_gpt():
    spec = importlib.util.spec_from_file_location("probe_gpt_model", GPT_FILE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dynamo resolves the model's globals through its module
    spec.loader.exec_module(mod)
    return mod.GPT


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """scalelab's next-token loss: logits (B, T, V) upcast, y (B, T)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


FAMILIES = (  # kernel name fragments, first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")),
    ("optimizer", ("multi_tensor", "foreach")),
    ("triton", ("triton",)),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    for family, keys in FAMILIES:
        if any(k in low for k in keys):
            return family
    return "other"


def profile_steps(step, steps: int = 3) -> dict:
    """GPU ms per step by kernel family over `steps` traced steps, and the traced wall."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    by: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if ev.device_type.name == "CUDA" and us:
            fam = kernel_family(ev.key)
            by[fam] = by.get(fam, 0.0) + us / 1e3 / steps
    return {
        "traced_step_ms": round(wall / steps * 1e3, 2),
        "kernel_ms": {k: round(v, 2) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
        "kernel_ms_total": round(sum(by.values()), 2),
    }


def one_run(name: str, args: argparse.Namespace, rnd: int) -> dict:
    name, _, mode = name.partition("@")
    mode = mode or None
    torch._dynamo.reset()
    torch.manual_seed(0)
    gpt = load_gpt()(args.vocab, args.seq, args.width, args.heads, args.depth, lm=True).cuda()
    opt = torch.optim.SGD(gpt.parameters(), lr=0.01, momentum=0.9, foreach=True)
    loss_fn = lm_loss
    if name.startswith("whole"):
        model = torch.compile(gpt, mode=mode)
    else:
        model = gpt
        for block in gpt.blocks:
            block.compile(mode=mode)
    if name.endswith("+loss"):
        loss_fn = torch.compile(lm_loss, mode=mode)

    def step_loss(x, y):
        return loss_fn(model(x), y)

    if name == "fused":
        step_loss = torch.compile(lambda x, y: lm_loss(gpt(x), y), mode=mode)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    label = name + (f"@{mode}" if mode else "")
    row = {
        "run": label,
        "round": rnd,
        "seq_per_s": round(args.batch * args.steps / dt, 1),
        "step_ms": round(dt / args.steps * 1e3, 2),
        "warmup_s": round(warm_s, 1),
        "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
    }
    if label in args.profile.split(","):
        row.update(profile_steps(step))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="whole,whole+loss,fused,blocks,blocks+loss")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile", default="", help="comma list of runs to trace after timing")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with open(args.out, "a") as f:
        for rnd in range(args.rounds):
            for name in args.runs.split(","):
                row = one_run(name, args, rnd)
                print(json.dumps(row), flush=True)
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
