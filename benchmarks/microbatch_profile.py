"""Where VGG-16 training loses time when a batch of 256 is run as micro-batches (one GPU).

    python benchmarks/microbatch_profile.py [OUT_DIR] [--no-compile]
    (OUT_DIR defaults to $OUT or .)

The question behind the pipeline's `--compile`: a 2-stage pipeline at M=8 can only
beat one GPU by 1.6x if a micro-batch of 32 costs about what 1/8 of a batch of 256 does.
Each variant below runs the same training step (bf16 autocast, channels_last, SGD momentum):
plain at batch 256 and 32; M=8 micro-batches with autocast per micro-batch (what the pipeline
stage does), with autocast's weight-cast cache kept across micro-batches, with each
micro-batch's forward and backward CUDA-graphed (torch.cuda.make_graphed_callables), and with
torch.compile (also at M=1). Median step time over 8 steps after 3 warm-up steps, and a
torch.profiler kernel-time breakdown by kernel family for the main variants. Writes
OUT_DIR/microbatch_profile.json and prints a table. ~1.5 minutes on an H100.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from scalelab.workloads.vgg import VGG

BATCH = 256
# First match wins: "cast" must not see at::native's "gpu_kernel_impl_nocast" (the broadcast
# bias add), so elementwise adds are named before it.
FAMILIES = [
    ("wgrad", r"wgrad"),
    ("dgrad", r"dgrad"),
    ("conv fprop / gemm", r"fprop|gemm|cutlass|nvjet|xmma"),
    ("bias add (broadcast)", r"CUDAFunctor_add<c10::BFloat16"),
    ("grad accumulation (fp32 add)", r"CUDAFunctor_add<float"),
    ("pool", r"pool"),
    ("relu / threshold", r"threshold|relu|clamp"),
    ("cast / copy", r"copy|to_copy|bfloat16_copy"),
    ("reduce (bias grad)", r"reduce_kernel"),
    ("optimizer", r"foreach|multi_tensor"),
    ("triton (fused)", r"^triton_"),
]


def autocast(cache: bool = True):
    return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)


class Bench:
    def __init__(self, device: torch.device) -> None:
        self.x = torch.randn(BATCH, 3, 224, 224, device=device)
        self.x = self.x.contiguous(memory_format=torch.channels_last)
        self.y = torch.randint(0, 1000, (BATCH,), device=device)
        self.device = device
        self.results: dict = {}

    def model(self):
        torch.manual_seed(0)
        m = VGG(512 * 7 * 7, 1000).to(self.device, memory_format=torch.channels_last).train()
        return m, torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)

    def plain(self, m, opt, b):
        def step():
            with autocast():
                loss = F.cross_entropy(m(self.x[:b]).float(), self.y[:b])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def micro(self, m, opt, micro, cached=False, forward=None):
        """M micro-batches, gradients accumulated, one optimizer step. cached: one outer
        autocast region keeps the bf16 weight casts across micro-batches (backward runs with
        autocast off, as the pipeline's does)."""
        forward = m if forward is None else forward
        n = BATCH // micro

        def step():
            outer = autocast() if cached else torch.autocast("cuda", enabled=False)
            with outer:
                for i in range(micro):
                    part = slice(i * n, (i + 1) * n)
                    with autocast():
                        loss = F.cross_entropy(forward(self.x[part]).float(), self.y[part])
                    with torch.autocast("cuda", enabled=False):
                        (loss / micro).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def time(self, name, step, images=BATCH, steps=8, warmup=3):
        for _ in range(warmup):
            step()
        times = []
        for _ in range(steps):
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            step()
            torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - start)
        med = statistics.median(times)
        self.results[name] = {"ms": med * 1e3, "img_s": images / med}
        print(f"{name:42s} {med * 1e3:8.2f} ms {images / med:8.0f} img/s", flush=True)

    def breakdown(self, name, step):
        from torch.profiler import ProfilerActivity, profile

        step()
        torch.cuda.synchronize(self.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize(self.device)
        per_kernel: dict[str, float] = defaultdict(float)
        for e in prof.events():
            if e.device_type.name == "CUDA":
                per_kernel[e.name] += e.device_time_total / 1e3
        families: dict[str, float] = defaultdict(float)
        for kernel, ms in per_kernel.items():
            family = next((f for f, rx in FAMILIES if re.search(rx, kernel, re.I)), "other")
            families[family] += ms
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
        self.results[name]["kernel_ms"] = sum(per_kernel.values())
        self.results[name]["families_ms"] = dict(families)
        self.results[name]["top_kernels_ms"] = top


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    out = Path(args[0] if args else os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.benchmark = True
    bench = Bench(torch.device("cuda", 0))
    m, opt = bench.model()
    bench.time("plain b256", bench.plain(m, opt, BATCH))
    bench.time("plain b32", bench.plain(m, opt, 32), images=32)
    bench.time("M=8, autocast per micro-batch", bench.micro(m, opt, 8))
    bench.time("M=8, weight casts cached", bench.micro(m, opt, 8, cached=True))
    bench.breakdown("plain b256", bench.plain(m, opt, BATCH))
    bench.breakdown("M=8, autocast per micro-batch", bench.micro(m, opt, 8))
    with autocast(cache=False):  # graphs need autocast's cache off
        graphed = torch.cuda.make_graphed_callables(m, (bench.x[: BATCH // 8].clone(),))

    def graphed_forward(x):
        with autocast(cache=False):
            return graphed(x)

    bench.time("M=8, graphed fwd/bwd", bench.micro(m, opt, 8, forward=graphed_forward))
    if "--no-compile" not in argv:
        m2, opt2 = bench.model()
        compiled = torch.compile(m2, dynamic=False)
        bench.time("M=8, torch.compile", bench.micro(m2, opt2, 8, forward=compiled))
        bench.breakdown("M=8, torch.compile", bench.micro(m2, opt2, 8, forward=compiled))
        bench.time("b256, torch.compile", bench.micro(m2, opt2, 1, forward=compiled))
    bench.results["gpu"] = torch.cuda.get_device_name(0)
    bench.results["torch"] = torch.__version__
    (out / "microbatch_profile.json").write_text(json.dumps(bench.results, indent=1))
    print(f"wrote {out / 'microbatch_profile.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
