"""DDP scaling of ResNet-18 (bf16, channels_last) on 1 and 2 GPUs: our `ddp` against the
plain DDP loop a user would write, both measured here, in one script.

    python benchmarks/ddp_scaling.py [OUT_DIR] [--variants]      (2 GPUs, ~5 min)

Configurations (synthetic CIFAR-shaped data, SGD momentum 0.9):
    weak-512      512 images per GPU      1 GPU: global 512,  2 GPUs: global 1024
    weak-128      128 images per GPU      1 GPU: global 128,  2 GPUs: global 256
    strong-1024   global batch 1024       1 GPU: 1024 per GPU, 2 GPUs: 512 per GPU
Throughput: images per second over the epochs after the first (the first pays cuDNN
autotuning, allocator growth and DataLoader start-up), median over those epochs.
Efficiency: E = thr(2 GPUs) / (2 * thr(1 GPU)) for every configuration (weak: same per-GPU
batch; strong: same global batch), each against its own 1-GPU run.

ours   `scalelab run resnet18 --strategy ddp --train --device cuda --amp bf16 --channels-last`
plain  DistributedDataParallel with default options, a TensorDataset on the host through
       DataLoader + DistributedSampler (4 workers, pinned memory), normalisation on the GPU,
       bf16 autocast, channels_last, and `loss.item()` each step for the running loss.
--variants also runs ours at weak-128 on 2 GPUs with --bucket-mb 5 and 100, without
channels_last, and with --compile, to show what each choice is worth.

Prints a table and writes OUT_DIR/ddp_scaling.json (OUT_DIR: argument, else $OUT, else
benchmarks/results).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_EPOCH = 30
EPOCHS = 3  # the first is warm-up
CONFIGS = {  # name -> {gpus: (per-GPU batch, global batch)}
    "weak-512": {1: (512, 512), 2: (512, 1024)},
    "weak-128": {1: (128, 128), 2: (128, 256)},
    "strong-1024": {1: (1024, 1024), 2: (512, 1024)},
}
TARGETS = {"weak-512": 0.95, "weak-128": 0.85, "strong-1024": 0.90}


def env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "NCCL_NVLS_ENABLE": "0"}


def steady_throughput(walls: list[float], items_per_epoch: int) -> float:
    return items_per_epoch / statistics.median(walls[1:])


# --- ours ---------------------------------------------------------------------------------------
def ours(gpus: int, global_batch: int, *extra: str) -> dict:
    n = global_batch * STEPS_PER_EPOCH
    cmd = [
        sys.executable, "-m", "scalelab", "run", "resnet18", "--strategy", "ddp", "--train",
        "--device", "cuda", "--amp", "bf16", "--channels-last", "--momentum", "0.9",
        "--ranks", str(gpus), "--global-batch", str(global_batch), "--train-size", str(n),
        "--heldout-size", "512", "--epochs", str(EPOCHS), "--quiet", "--no-record", "--json",
        *extra,
    ]  # fmt: skip
    if "--no-channels-last" in extra:
        cmd = [c for c in cmd if c not in ("--channels-last", "--no-channels-last")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"img_s": steady_throughput(rec["walls_s"], n), "walls_s": rec["walls_s"]}


# --- plain DDP, the loop a user writes ------------------------------------------------------------
def plain(gpus: int, per_gpu: int) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={gpus}", __file__, "--plain-worker", str(per_gpu),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plain_worker(per_gpu: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from scalelab.data.cifar import CIFAR10_MEAN, CIFAR10_STD
    from scalelab.workloads.resnet import IMAGENET_STEM, ResNet

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = ResNet(10, IMAGENET_STEM).cuda().to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    n = per_gpu * world * STEPS_PER_EPOCH
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data)
    loader = DataLoader(
        data, batch_size=per_gpu, sampler=sampler, num_workers=4, pin_memory=True,
        persistent_workers=True, drop_last=True,
    )  # fmt: skip
    mean = torch.tensor(CIFAR10_MEAN, device="cuda").view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, device="cuda").view(1, 3, 1, 1)
    walls = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        running = 0.0
        torch.cuda.synchronize()
        start = time.perf_counter()
        for xb, yb in loader:
            xb = xb.cuda(non_blocking=True).float().div_(255).sub_(mean).div_(std)
            xb = xb.contiguous(memory_format=torch.channels_last)
            yb = yb.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += loss.item()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps({"img_s": steady_throughput(walls, n), "walls_s": walls}), flush=True)
    dist.destroy_process_group()


# --- the study ------------------------------------------------------------------------------------
def measure(variants: bool) -> dict:
    rows = []
    for name, by_gpus in CONFIGS.items():
        for gpus, (per_gpu, global_batch) in by_gpus.items():
            row = {"config": name, "gpus": gpus, "per_gpu": per_gpu, "global": global_batch}
            row["ours"] = ours(gpus, global_batch)["img_s"]
            row["plain"] = plain(gpus, per_gpu)["img_s"]
            rows.append(row)
            print(f"  {name} x{gpus}: ours {row['ours']:.0f}, plain {row['plain']:.0f} img/s",
                  file=sys.stderr, flush=True)  # fmt: skip
    result = {"rows": rows, "efficiency": efficiencies(rows), "targets": TARGETS}
    if variants:
        result["variants"] = run_variants()
    return result


def efficiencies(rows: list[dict]) -> dict:
    out = {}
    for name in CONFIGS:
        one, two = (next(r for r in rows if r["config"] == name and r["gpus"] == g) for g in (1, 2))
        out[name] = {k: two[k] / (2 * one[k]) for k in ("ours", "plain")}
    return out


def run_variants() -> dict:
    """ours at weak-128 on 2 GPUs: what bucket size, channels_last and compile are worth."""
    runs = {
        "default (25 MB)": (),
        "--bucket-mb 5": ("--bucket-mb", "5"),
        "--bucket-mb 100": ("--bucket-mb", "100"),
        "no channels_last": ("--no-channels-last",),
        "--compile": ("--compile",),
    }
    return {label: ours(2, 256, *extra)["img_s"] for label, extra in runs.items()}


def table(result: dict) -> str:
    lines = [f"{'config':<12} {'GPUs':>4} {'per GPU':>8} {'global':>7} {'ours img/s':>11} "
             f"{'plain img/s':>12} {'ours/plain':>10}"]  # fmt: skip
    for r in result["rows"]:
        ratio = r["ours"] / r["plain"]
        lines.append(f"{r['config']:<12} {r['gpus']:>4} {r['per_gpu']:>8} {r['global']:>7} "
                     f"{r['ours']:>11.0f} {r['plain']:>12.0f} {ratio:>10.2f}")  # fmt: skip
    lines.append(f"\n{'efficiency':<12} {'ours':>6} {'plain':>6} {'target':>7}")
    for name, eff in result["efficiency"].items():
        ok = "ok" if eff["ours"] >= TARGETS[name] else "MISSED"
        lines.append(f"{name:<12} {eff['ours']:>6.2f} {eff['plain']:>6.2f} "
                     f"{'>= ' + str(TARGETS[name]):>7} {ok}")  # fmt: skip
    for label, img_s in result.get("variants", {}).items():
        lines.append(f"variant weak-128 x2 {label:<18} {img_s:>9.0f} img/s")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--plain-worker"]:
        plain_worker(int(argv[1]))
        return 0
    args = [a for a in argv if not a.startswith("--")]
    out = Path(args[0] if args else os.environ.get("OUT", ROOT / "benchmarks" / "results"))
    start = time.time()
    result = measure(variants="--variants" in argv)
    result["wall_s"] = time.time() - start
    import torch

    result["device"] = torch.cuda.get_device_name(0)
    result["torch"] = torch.__version__
    print(table(result))
    out.mkdir(parents=True, exist_ok=True)
    (out / "ddp_scaling.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'ddp_scaling.json'} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
