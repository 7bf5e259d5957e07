"""The plain-PyTorch peer of benchmarks/transformer_speed.py: the example GPT
(examples/models/gpt.py, the same class scalelab trains) trained as a user writes it with
torch's own engines, no scalelab import.

    torchrun --nproc-per-node N benchmarks/peer_gpt_train.py --runs ddp,fsdp,ddp+compile \
        --width 768 --depth 12 --heads 12 --seq 1024 --vocab 50304 --per-gpu 16 --out F.jsonl

Every run in --runs trains a fresh model in this one launch (one process group):
  ddp      fp32 weights, bf16 autocast, DistributedDataParallel (one GPU: the bare model),
           25 MB buckets, gradient_as_bucket_view, static_graph;
  fsdp     FSDP2: fully_shard per block with MixedPrecisionPolicy(param_dtype=bf16,
           reduce_dtype=fp32) over fp32 sharded weights, reshard_after_forward on for every
           block but the last, then the root (torchtitan's llama recipe);
  +compile each block compiled in place (`block.compile()`) before DDP/FSDP wrap it;
           +fwdcompile: each block's forward compiled instead (the module's hooks, FSDP's
           among them, stay outside the compiled frame); +wrapcompile: each block replaced
           by torch.compile(block) (torchtitan's apply_compile);
  fsdp's levers, each a "+" suffix (several may be joined: fsdp+noreshard+units3):
  +noreshard  no unit frees its gathered weights after forward (ZeRO-2-like);
  +unitsK     K consecutive blocks per FSDP unit (fully_shard of a list of blocks);
  +unitmbM    as many blocks per unit as gather M MB (in the gathered dtype);
  +localopt   the optimizer steps each rank's local shards (plain tensors: no DTensor
              dispatch per optimizer op), their gradients handed over after backward;
  ddp's levers: +bucketN  N MB gradient buckets (25 by default);
                +bf16grad  gradients all-reduced in bf16 (torch's bf16_compress_hook).
Same loss (cross-entropy of the last position's fp32 logits against uniform labels), same
optimizer (SGD with momentum, foreach), token ids resident on the GPU, SDPA's causal kernel
(the model's own). Steady sequences/s: --warmup untimed steps, then --steps timed between
two device syncs, no host sync inside. One JSON line per run from rank 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

GPT_FILE = Path(__file__).resolve().parents[1] / "examples" / "models" / "gpt.py"


def load_gpt():
    spec = importlib.util.spec_from_file_location("peer_gpt_model", GPT_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.GPT


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="ddp,fsdp", help="comma list: ddp, fsdp, ddp+compile, ...")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--per-gpu", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--amp", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--out", required=True, help="JSON lines file (appended, rank 0)")
    p.add_argument("--profile", help="folder: rank 0's trace of 3 steps after the timed ones")
    return p.parse_args()


def setup() -> tuple[torch.device, int, int]:
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    else:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return device, dist.get_rank(), dist.get_world_size()


def build(a: argparse.Namespace, kind: str, extras: set[str], device: torch.device, world: int):
    """The model as the run trains it, and its autocast context."""
    torch.manual_seed(0)
    model = load_gpt()(a.vocab, a.seq, a.width, a.heads, a.depth).to(device)
    low = torch.bfloat16 if a.amp == "bf16" else None
    if "compile" in extras:
        for block in model.blocks:
            block.compile()
    if "fwdcompile" in extras:
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    if "wrapcompile" in extras:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        blocks = list(model.blocks)
        k = next((int(e[5:]) for e in extras if e.startswith("units")), 1)
        for e in (e for e in extras if e.startswith("unitmb")):
            block = sum(p.numel() for p in blocks[0].parameters()) * (2 if low else 4)
            k = min(len(blocks), max(1, -(-int(float(e[6:]) * 2**20) // block)))
        groups = [blocks[i : i + k] for i in range(0, len(blocks), k)]
        for i, group in enumerate(groups):
            reshard = i < len(groups) - 1 and "noreshard" not in extras
            fully_shard(group if k > 1 else group[0], mesh=mesh, mp_policy=mp,
                        reshard_after_forward=reshard)  # fmt: skip
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward="noreshard" not in extras)
        return model, nullcontext
    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        mb = next((int(e[6:]) for e in extras if e.startswith("bucket")), 25)
        net = DistributedDataParallel(
            model, device_ids=ids, bucket_cap_mb=mb, gradient_as_bucket_view=True,
            static_graph=True,
        )  # fmt: skip
        if "bf16grad" in extras:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            net.register_comm_hook(None, default_hooks.bf16_compress_hook)
    if low is None:
        return net, nullcontext
    return net, lambda: torch.autocast(device.type, dtype=low)


def train(a: argparse.Namespace, name: str, device: torch.device, rank: int, world: int) -> dict:
    kind, *extras = name.split("+")
    model, autocast = build(a, kind, set(extras), device, world)
    params = list(model.parameters())
    local = [getattr(p, "_local_tensor", p) for p in params] if "localopt" in extras else None
    opt = torch.optim.SGD(local or params, lr=a.lr, momentum=a.momentum)
    g = torch.Generator().manual_seed(1 + rank)
    n = a.warmup + a.steps
    x = torch.randint(0, a.vocab, (n, a.per_gpu, a.seq), generator=g).to(device)
    y = torch.randint(0, a.vocab, (n, a.per_gpu), generator=g).to(device)

    def step(i: int) -> torch.Tensor:
        with autocast():
            logits = model(x[i])  # (per_gpu, vocab): the last position's
        loss = F.cross_entropy(logits.float(), y[i])
        loss.backward()
        if local is not None:  # the shard's gradient, as the optimizer's plain tensor's
            for p, t in zip(params, local):
                t.grad = None if p.grad is None else getattr(p.grad, "_local_tensor", p.grad)
            model.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    t_compile = time.perf_counter()
    for i in range(a.warmup):
        step(i)
    sync(device)
    warm_s = time.perf_counter() - t_compile
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(a.warmup, n):
        loss = step(i)
    sync(device)
    seconds = time.perf_counter() - t0
    seqs = a.steps * a.per_gpu * world
    if a.profile:
        profile(a, name, rank, device, step)
    peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {
        "run": name, "gpus": world, "steps": a.steps, "warmup": a.warmup,
        "seconds": seconds, "warmup_s": warm_s, "sequences_per_s": seqs / seconds,
        "tokens_per_s": seqs * a.seq / seconds, "step_ms": 1e3 * seconds / a.steps,
        "loss": float(loss), "peak_allocated": peak_mem,
    }  # fmt: skip


def profile(a: argparse.Namespace, name: str, rank: int, device: torch.device, step) -> None:
    """3 more steps under torch.profiler (CPU and CUDA); rank 0 writes a chrome trace."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for i in range(a.warmup, a.warmup + 3):  # inputs already made: those of timed steps
            step(i)
        sync(device)
    if rank == 0:
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(a.profile) / f"peer_{name.replace('+', '_')}.json"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    a = parse()
    device, rank, world = setup()
    for name in a.runs.split(","):
        try:
            rec = train(a, name, device, rank, world)
        except Exception as exc:  # a lever this torch lacks: said, and the next run goes on
            rec = {"run": name, "gpus": world, "error": f"{type(exc).__name__}: {exc}"[:300]}
        if rank == 0:
            shape = {k: getattr(a, k) for k in ("width", "depth", "heads", "seq", "vocab")}
            rec.update(shape=shape, per_gpu=a.per_gpu, amp=a.amp, torch=torch.__version__)
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            said = rec.get("error") or f"{rec['sequences_per_s']:.1f} seq/s"
            print(f"peer {name} x{world}: {said}", flush=True)
        torch._dynamo.reset()  # the next run compiles as a fresh process would
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
