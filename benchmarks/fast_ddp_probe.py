"""Where a captured (--fast) DDP step departs from eager DDP: the weight update after a few
steps of ResNet-18 on 2 GPUs, eager against captured, and captured with one DDP option
changed at a time (the DDP constructor patched in the ranks, nothing else touched).

    python benchmarks/fast_ddp_probe.py OUT_DIR [--cpu] [--determinism]

Prints, per variant, the relative difference of its parameter update from eager's and the
record's `replica_max_rel_diff` (rank 1's parameters against rank 0's after training), and
writes OUT_DIR/fast_ddp_probe.json. --cpu: gloo ranks with the captured step run eagerly
(CUDA graphs need a GPU), to check the script itself. --determinism: eager DDP twice (does it
repeat itself?), twice under SCALELAB_DETERMINISTIC=1, and the captured step under it against
that (2x H200: 0.354 apart; 0.0; 0.0).

Worker mode (started by torchrun): `fast_ddp_probe.py --worker VARIANT CPU ARGS...`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# variant -> DDP keyword arguments replaced in the ranks ("fast": False: eager ddp, no --fast;
# "env": set in the ranks; "hook": a comm hook registered)
DET = {"env": {"SCALELAB_DETERMINISTIC": "1"}}
VARIANTS = {
    "eager": {"fast": False},
    "fast": {},
    "fast, gradient_as_bucket_view=False": {"gradient_as_bucket_view": False},
    "fast, static_graph=False": {"static_graph": False},
    # is the all-reduce ordered after the copies into its bucket, and the update
    # after the all-reduce? A hook whose all-reduce the hook's stream waits for (async_op off)
    "fast, all-reduce waited for in the hook": {"hook": "sync"},
    "fast, one bucket": {"bucket_cap_mb": 4096},
    "fast, TORCH_NCCL_ASYNC_ERROR_HANDLING=0": {"env": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}},
    # none of the above is eager's: is eager itself repeatable? (--determinism runs these)
    "eager, again": {"fast": False},
    "eager, SCALELAB_DETERMINISTIC=1": {"fast": False, **DET},
    "eager, SCALELAB_DETERMINISTIC=1, again": {"fast": False, **DET},
    "fast, SCALELAB_DETERMINISTIC=1": DET,
}
DETERMINISM = [
    "eager",
    "eager, again",
    "eager, SCALELAB_DETERMINISTIC=1",
    "eager, SCALELAB_DETERMINISTIC=1, again",
    "fast, SCALELAB_DETERMINISTIC=1",
]


def sync_allreduce_hook(state, bucket):
    """DDP comm hook: the bucket averaged by a blocking all_reduce (the current stream waits
    for NCCL's), returned as a completed future (torch's documented no-op hook's form)."""
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    dist.all_reduce(buf)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def worker(variant: str, cpu: bool, args: list[str]) -> int:
    import scalelab.strategies.ddp as ddp
    from scalelab.cli.main import main

    over = dict(VARIANTS[variant])
    over.pop("fast", None)
    os.environ.update(over.pop("env", {}))
    hook = over.pop("hook", None)
    real = ddp.DistributedDataParallel

    def build(*a, **kw):
        net = real(*a, **{**kw, **over})
        if hook == "sync":
            net.register_comm_hook(None, sync_allreduce_hook)
        return net

    ddp.DistributedDataParallel = build
    if cpu:
        import scalelab.fast.captured_step as fast_train

        fast_train.step_unsupported = lambda *a: None
    return main(args)


def update(w: dict, w0: dict):
    import torch

    keys = [k for k, v in w0.items() if v.is_floating_point() and "running_" not in k]
    return torch.cat([(w[k].double() - w0[k].double()).flatten() for k in keys])


def main() -> None:
    import torch

    out = Path(sys.argv[1])
    cpu = "--cpu" in sys.argv
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "NCCL_NVLS_ENABLE": "0",
           "SCALELAB_LAUNCHED": "1"}  # fmt: skip
    common = ["resnet18", "--num-classes", "10", "--seed", "3", "--no-record"]
    w0 = out / "w0.pt"
    first = [sys.executable, "-m", "scalelab", "run", *common, "--batch", "2", "--save-weights"]
    subprocess.run([*first, str(w0)], env=env, check=True, capture_output=True)
    train = [
        "run", *common, "--strategy", "ddp", "--train", "--device", "cpu" if cpu else "cuda",
        "--batch", "32" if cpu else "128", "--train-size", "96" if cpu else "1100",
        "--heldout-size", "16", "--steps", "3" if cpu else "6", "--lr", "0.05",
        "--momentum", "0.5", "--ranks", "2", "--json",
    ]  # fmt: skip
    rows = {}
    names = DETERMINISM if "--determinism" in sys.argv else list(VARIANTS)
    for variant in names:
        path = out / f"w_{len(rows)}.pt"
        extra = ["--fast"] if VARIANTS[variant].get("fast", True) else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", __file__, "--worker", variant, str(int(cpu)),
               *train, *extra, "--save-weights", str(path)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            rows[variant] = {"error": proc.stderr.strip().splitlines()[-1:]}
            print(f"{variant}: FAILED {rows[variant]['error']}", flush=True)
            continue
        rec = json.loads(proc.stdout.strip().splitlines()[-1])
        rows[variant] = {"replica_max_rel_diff": rec.get("replica_max_rel_diff"),
                         "loss": rec.get("loss"), "weights": str(path)}  # fmt: skip
    start = torch.load(w0)
    det = "eager, SCALELAB_DETERMINISTIC=1"
    for variant, row in rows.items():
        ref = det if "DETERMINISTIC" in variant and variant != det else "eager"
        if "weights" in row and "weights" in rows.get(ref, {}):
            base = update(torch.load(rows[ref]["weights"]), start)
            u = update(torch.load(row["weights"]), start)
            row["update_rel_diff"] = float((u - base).norm() / base.norm())
            row["against"] = ref
        print(f"{variant:40} update off {row.get('against')}'s {row.get('update_rel_diff')}  "
              f"replicas differ {row.get('replica_max_rel_diff')}  loss {row.get('loss')}",
              flush=True)  # fmt: skip
    (out / "fast_ddp_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3] == "1", sys.argv[4:]))
    main()
