"""DDP scaling of ResNet-18 (bf16, channels_last) on 1..N GPUs: our `ddp --fast` against
the plain DDP loop a user would write, both measured here, in one script.

    python benchmarks/ddp_scaling.py [OUT_DIR] [--gpus 1,2,4] [--configs weak-512,...]
                                     [--cifar] [--variants] [--variant-config weak-512]
                                     [--repeat N]

Configurations (synthetic CIFAR-shaped data, SGD momentum 0.9), at g GPUs:
    weak-512      512 images per GPU       global 512 g
    weak-128      128 images per GPU       global 128 g
    strong-1024   global batch 1024        1024 / g per GPU
    strong-4096   global batch 4096        4096 / g per GPU  (ours only)
Throughput: images per second over the epochs after the first (the first pays cuDNN
autotuning, allocator growth, graph capture and DataLoader start-up), median over those
epochs. Efficiency at g GPUs: thr(g) / (g * thr(1)), each configuration against its own 1-GPU
run (weak: same per-GPU batch; strong: same global batch).

ours   `scalelab run resnet18 --strategy ddp --train --fast --device cuda --amp bf16
       --channels-last`: the training set resident on each GPU, the whole step (forward,
       backward with DDP's bucketed all-reduces, SGD) replayed from one CUDA graph per rank.
plain  DistributedDataParallel with default options, a TensorDataset on the host through
       DataLoader + DistributedSampler (4 workers, pinned memory), normalisation on the GPU,
       bf16 autocast, channels_last, and `loss.item()` each step for the running loss.
--cifar also runs ours for `resnet18-cifar` (3x3 stem, no max-pool: 14x the FLOPs) at weak-512
and strong-1024 (those of --configs). --repeat N runs every point of ours N times and keeps the
median (row "ours_runs" lists them).
--variants also runs ours on 2 GPUs at --variant-config (default weak-512) with --bucket-mb 5
and 100, with the gradients all-reduced in bf16 (--grad-compress bf16), with NCCL limited to 4
channels (fewer SMs taken from the overlapping backward), and without --fast (eager DDP), to
show what each choice is worth.

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
CONFIGS = {  # name -> (per-GPU batch or None, global batch or None): one of the two is fixed
    "weak-512": (512, None),
    "weak-128": (128, None),
    "strong-1024": (None, 1024),
    "strong-4096": (None, 4096),
}
PLAIN = ("weak-512", "weak-128", "strong-1024")  # the configurations plain DDP also runs
PLAIN_GPUS = (1, 2)  # ... on 1 and 2 GPUs only
TARGETS = {"weak-512": 0.95, "weak-128": 0.85, "strong-1024": 0.90, "strong-4096": 0.90}


def batches(config: str, gpus: int) -> tuple[int, int]:
    """(per-GPU batch, global batch) of a configuration on `gpus` GPUs."""
    per_gpu, global_batch = CONFIGS[config]
    return (per_gpu, per_gpu * gpus) if per_gpu else (global_batch // gpus, global_batch)


def env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "NCCL_NVLS_ENABLE": "0"}


def steady_throughput(walls: list[float], items_per_epoch: int) -> float:
    return items_per_epoch / statistics.median(walls[1:])


# --- ours ---------------------------------------------------------------------------------------
def ours(
    gpus: int, global_batch: int, *extra: str, workload: str = "resnet18", nccl: dict | None = None
) -> dict:
    n = global_batch * STEPS_PER_EPOCH
    cmd = [
        sys.executable, "-m", "scalelab", "run", workload, "--strategy", "ddp", "--train",
        "--fast", "--device", "cuda", "--amp", "bf16", "--channels-last", "--momentum", "0.9",
        "--ranks", str(gpus), "--batch", str(global_batch), "--train-size", str(n),
        "--heldout-size", "512", "--epochs", str(EPOCHS), "--quiet", "--no-record", "--json",
        *extra,
    ]  # fmt: skip
    if "--no-fast" in extra:
        cmd = [c for c in cmd if c not in ("--fast", "--no-fast")]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**env(), **(nccl or {})}, timeout=600
    )
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
def measure(gpu_counts: list[int], cifar: bool, variants: bool) -> dict:
    rows = []
    for name in CONFIGS:
        for gpus in gpu_counts:
            plain_too = name in PLAIN and gpus in PLAIN_GPUS
            rows.append(point("resnet18", name, gpus, plain_too=plain_too))
    if cifar:
        names = [name for name in CONFIGS if name in CIFAR_CONFIGS]
        rows += [point("resnet18-cifar", n, gpus, False) for n in names for gpus in gpu_counts]
    result = {"rows": rows, "efficiency": efficiencies(rows), "targets": TARGETS}
    if variants:
        result["variants"] = run_variants()
    return result


PARTIAL: dict = {"rows": [], "partial": True, "file": None}  # kept if the run is cut short


def point(workload: str, name: str, gpus: int, plain_too: bool) -> dict:
    per_gpu, global_batch = batches(name, gpus)
    row = {"workload": workload, "config": name, "gpus": gpus, "per_gpu": per_gpu,
           "global": global_batch}  # fmt: skip
    # --repeat N: N runs, the median kept (two identical runs have differed by 2.7%).
    row["ours_runs"] = [
        ours(gpus, global_batch, workload=workload)["img_s"] for _ in range(REPEAT[0])
    ]
    row["ours"] = statistics.median(row["ours_runs"])
    row["plain"] = plain(gpus, per_gpu)["img_s"] if plain_too else None
    print(f"  {workload} {name} x{gpus}: ours {row['ours']:.0f} img/s, plain {row['plain']}",
          file=sys.stderr, flush=True)  # fmt: skip
    PARTIAL["rows"].append(row)
    if PARTIAL["file"] is not None:
        PARTIAL["file"].write_text(json.dumps({k: v for k, v in PARTIAL.items() if k != "file"}))
    return row


def efficiencies(rows: list[dict]) -> dict:
    """workload/config -> GPUs -> {ours, plain}: thr(g) / (g * thr(1))."""
    out: dict = {}
    for r in rows:
        one = next((o for o in rows if o["workload"] == r["workload"]
                    and o["config"] == r["config"] and o["gpus"] == 1), None)  # fmt: skip
        if r["gpus"] == 1 or one is None:
            continue
        eff = {k: r[k] / (r["gpus"] * one[k]) for k in ("ours", "plain") if r[k] and one[k]}
        out.setdefault(f"{r['workload']}/{r['config']}", {})[str(r["gpus"])] = eff
    return out


VARIANT_CONFIG = ["weak-512"]  # --variant-config
REPEAT = [1]  # --repeat
CIFAR_CONFIGS = ("weak-512", "strong-1024")  # --cifar: resnet18-cifar at these (of --configs)


def run_variants() -> dict:
    """ours at VARIANT_CONFIG on 2 GPUs: what graph capture, the bucket size, gradient
    compression and NCCL's channel count (SMs its kernels take from the backward) are worth."""
    runs = {
        "--fast (25 MB buckets)": ((), None),
        "--fast --bucket-mb 5": (("--bucket-mb", "5"), None),
        "--fast --bucket-mb 100": (("--bucket-mb", "100"), None),
        "--fast --grad-compress bf16": (("--grad-compress", "bf16"), None),
        "--fast NCCL_MAX_NCHANNELS=4": ((), {"NCCL_MAX_NCHANNELS": "4"}),
        "--fast --grad-compress bf16 --bucket-mb 5": (
            ("--grad-compress", "bf16", "--bucket-mb", "5"),
            None,
        ),
        "eager (no --fast)": (("--no-fast",), None),
    }
    _, global_batch = batches(VARIANT_CONFIG[0], 2)
    out = {}
    for label, (extra, nccl) in runs.items():
        out[label] = ours(2, global_batch, *extra, nccl=nccl)["img_s"]
        print(f"  variant {label}: {out[label]:.0f} img/s", file=sys.stderr, flush=True)
    return out


def table(result: dict) -> str:
    lines = [f"{'workload':<15} {'config':<12} {'GPUs':>4} {'per GPU':>8} {'global':>7} "
             f"{'ours img/s':>11} {'plain img/s':>12} {'ours/plain':>10}"]  # fmt: skip
    for r in result["rows"]:
        plain_s = f"{r['plain']:>12.0f}" if r["plain"] else f"{'-':>12}"
        ratio = f"{r['ours'] / r['plain']:>10.2f}" if r["plain"] else f"{'-':>10}"
        lines.append(f"{r['workload']:<15} {r['config']:<12} {r['gpus']:>4} {r['per_gpu']:>8} "
                     f"{r['global']:>7} {r['ours']:>11.0f} {plain_s} {ratio}")  # fmt: skip
    lines.append(f"\n{'efficiency':<28} {'GPUs':>4} {'ours':>6} {'plain':>6} {'target':>7}")
    for key, by_gpus in result["efficiency"].items():
        target = TARGETS[key.split("/")[1]]
        for gpus, eff in by_gpus.items():
            ok = "ok" if eff["ours"] >= target else "MISSED"
            plain_e = f"{eff['plain']:>6.2f}" if "plain" in eff else f"{'-':>6}"
            lines.append(f"{key:<28} {gpus:>4} {eff['ours']:>6.2f} {plain_e} "
                         f"{'>= ' + str(target):>7} {ok}")  # fmt: skip
    for label, img_s in result.get("variants", {}).items():
        lines.append(f"variant {VARIANT_CONFIG[0]} x2 {label:<42} {img_s:>9.0f} img/s")
    return "\n".join(lines)


def take_option(argv: list[str], flag: str, default: str) -> str:
    """Remove `flag VALUE` from argv and return VALUE (default when absent)."""
    if flag not in argv:
        return default
    i = argv.index(flag)
    value = argv.pop(i + 1)
    argv.pop(i)
    return value


def main(argv: list[str]) -> int:
    if argv[:1] == ["--plain-worker"]:
        plain_worker(int(argv[1]))
        return 0
    gpus = [int(g) for g in take_option(argv, "--gpus", "1,2").split(",")]
    VARIANT_CONFIG[0] = take_option(argv, "--variant-config", VARIANT_CONFIG[0])
    REPEAT[0] = int(take_option(argv, "--repeat", "1"))
    for name in set(CONFIGS) - set(take_option(argv, "--configs", ",".join(CONFIGS)).split(",")):
        del CONFIGS[name]
    args = [a for a in argv if not a.startswith("--")]
    out = Path(args[0] if args else os.environ.get("OUT", ROOT / "benchmarks" / "results"))
    out.mkdir(parents=True, exist_ok=True)
    PARTIAL["file"] = out / "ddp_scaling.partial.json"
    start = time.time()
    result = measure(gpus, cifar="--cifar" in argv, variants="--variants" in argv)
    result["wall_s"] = time.time() - start
    import torch

    result["device"] = torch.cuda.get_device_name(0)
    result["torch"] = torch.__version__
    print(table(result))
    out.mkdir(parents=True, exist_ok=True)
    (out / "ddp_scaling.json").write_text(json.dumps(result, indent=1))
    PARTIAL["file"].unlink(missing_ok=True)
    print(f"wrote {out / 'ddp_scaling.json'} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
