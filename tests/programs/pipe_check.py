"""Run under torchrun (gloo, K ranks = K stages): the pipeline against one process.
Usage: pipe_check.py RESULTS_FILE [scenario indices...]

Every scenario runs the `pipeline` strategy over all ranks, then the root runs the `local`
strategy on a fresh copy of the same seeded model and compares: inference outputs (relative
error), training weights after the steps (largest |difference| / largest |weight|) and the
loss history. Prints one JSON line per scenario from the root, then 'rank R ok' per rank.
"""

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from scalelab.comm.base import even_counts
from scalelab.config import RunConfig
from scalelab.oracle.check import relative_error
from scalelab.run.runner import execute
from scalelab.strategies import STRATEGIES
from scalelab.strategies.local import LocalStrategy
from scalelab.strategies.pipeline import PipelineStrategy
from scalelab.workloads import WORKLOADS
from scalelab.workloads.base import Inputs, Workload

PipelineStrategy.close = lambda self: None  # one process group for every scenario

# seconds each sleep layer takes per micro-batch: long against the stages' CPU work and
# sends, which a loaded 2-core host delays (at 30/60 ms, 3 ranks beside another test
# process measured a bubble of 0.40 against the textbook 0.33)
T_FWD, T_BWD = 0.06, 0.12


class _Sleep(torch.autograd.Function):
    """Identity that sleeps: a stage time that does not depend on the 2 busy cores."""

    @staticmethod
    def forward(ctx, x):
        time.sleep(T_FWD)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(T_BWD)
        return grad


class Sleep(nn.Module):
    def forward(self, x):
        return _Sleep.apply(x)


@WORKLOADS.register("sleepstack", "test only: one linear + one sleeping layer per stage")
class SleepStack(Workload):
    """Equal, known stage times, so the measured bubble can be held to (K-1)/(M+K-1)."""

    name = "sleepstack"
    item = "inputs"

    def _build(self):
        return nn.Sequential(
            *[m for _ in range(self.cfg.stages) for m in (nn.Linear(4, 4), Sleep())]
        )

    def synthetic_inputs(self, n, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randint(0, 256, (n, 4), generator=gen, dtype=torch.uint8)
        return Inputs(x, torch.randint(0, 4, (n,), generator=gen))

    def prepare(self, x):
        return x.float() / 255

    def cost_table(self):
        return []


SHAPES = {
    "deepstack": {"image_size": 8, "convs": 3, "fcs": 1, "num_classes": 10},
    "vgg16": {"image_size": 32, "num_classes": 10},
    "alexnet": {"image_size": 67, "num_classes": 10},
    "sleepstack": {},
}
TRAIN = {"train": True, "train_size": 16, "heldout_size": 4, "momentum": 0.9, "balance": "even"}
# (workload, options, stage counts it runs at). Inference with the measured (auto) balance,
# training with an explicit one (the profile's backward passes cost seconds on 2 cores);
# "record": through runner.execute, which checks against the oracle and writes the record.
CL = {"channels_last": True}
SCENARIOS = [
    ("deepstack", {"dtype": "fp64", "batch": 7, "microbatches": 3, "record": True}, (2,)),
    ("deepstack", {"dtype": "fp64", "batch": 7, "microbatches": 3}, (3,)),
    ("vgg16", {"dtype": "fp32", "batch": 3, "microbatches": 3, **CL}, (2,)),
    ("vgg16", {"dtype": "fp64", "batch": 3, "microbatches": 2, "balance": "even"}, (3,)),
    ("sleepstack", {"batch": 8, "microbatches": 4, **TRAIN, "train_size": 40}, (3,)),
    ("deepstack", {"dtype": "fp64", "batch": 6, "microbatches": 3, "steps": 2, **TRAIN}, (2,)),
    (
        "deepstack",
        {"dtype": "fp64", "batch": 8, "microbatches": 4, "steps": 1, **TRAIN, "schedule": "1f1b"},
        (3,),
    ),
    (
        "deepstack",
        {
            "dtype": "fp32",
            "batch": 5,
            "microbatches": 5,
            "steps": 1,
            **TRAIN,
            "schedule": "1f1b",
            **CL,
        },
        (2,),
    ),
]


def even_balance(name: str, cfg: RunConfig, stages: int) -> str:
    workload = WORKLOADS.get(name)(cfg)
    with torch.device("meta"):  # shapes only: counting layers needs no weights
        n = len(workload.layers(workload.build_model()))
    return ",".join(map(str, even_counts(n, stages)))


def config(name: str, kw: dict, stages: int, strategy: str) -> RunConfig:
    kw = {k: v for k, v in kw.items() if k != "record"}
    kw = {**SHAPES[name], **kw, "quiet": True, "iters": 1, "warmup": 1, "seed": 3, "stages": stages}
    if kw.get("balance") == "even":
        kw["balance"] = even_balance(name, RunConfig(workload=name, **{**kw, "balance": "auto"}),
                                     stages)  # fmt: skip
    if strategy == "pipeline":
        kw.update(strategy="pipeline", stages=stages, ranks=stages, save_weights="unused")
    return RunConfig(workload=name, **kw)


def run(cfg: RunConfig, strategy, root: bool):
    workload = WORKLOADS.get(cfg.workload)(cfg)
    strategy.validate(workload)
    model = workload.build_model()
    if cfg.train:
        data = workload.training_data() if root or strategy.name == "local" else None
        return strategy.train(workload, model, data)
    return strategy.infer(workload, model, workload.inputs(cfg.batch) if root else None)


def recorded(name: str, kw: dict, stages: int, out: str) -> dict | None:
    """The whole runner path: oracle check, record (root only), every rank's phases."""
    cfg = config(name, kw, stages, "pipeline")
    cfg = dataclasses.replace(cfg, check=True, save_weights=None)
    report = execute(cfg, Path(out))
    if report.record is None:
        return None
    return {
        "workload": name,
        **kw,
        "check_passed": report.check.passed,
        "relerr": report.check.relerr,
    }


def compare(name: str, kw: dict, rank: int, stages: int) -> dict | None:
    pipe_cfg = config(name, kw, stages, "pipeline")
    pipe = run(pipe_cfg, STRATEGIES.get("pipeline").build(pipe_cfg), rank == 0)
    if rank != 0:
        return None
    local_cfg = config(name, kw, stages, "local")
    initial = WORKLOADS.get(name)(local_cfg).build_model().state_dict()
    local = run(local_cfg, LocalStrategy(local_cfg), True)
    notes = pipe.notes["pipeline"]
    result = {"workload": name, **kw, "balance": notes["balance"]}
    result["stage"] = [
        {
            k: s[k]
            for k in ("forward_s", "backward_s", "recv_s", "send_s", "wall_s", "span_s", "bubble")
        }
        for s in notes["stage"]
    ]
    for key in ("bubble_formula", "bubble_simulated", "bubble_measured"):
        result[key] = notes[key]
    if pipe_cfg.train:
        a, b = pipe.model.state_dict(), local.model.state_dict()
        assert a.keys() == b.keys()
        # How far the two runs' weights differ, against how far training moved them.
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        moved = max(float((b[k].double() - initial[k].double()).abs().max()) for k in b)
        result.update(weight_diff=diff, moved=moved, steps=pipe.history.steps)
        result["loss_pipe"], result["loss_local"] = pipe.history.loss, local.history.loss
        result["acc_pipe"], result["acc_local"] = pipe.history.accuracy, local.history.accuracy
    else:
        result["relerr"] = relative_error(pipe.output, local.output)
        result["shape"] = list(np.shape(pipe.output))
    return result


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out, only = sys.argv[1], sys.argv[2:]
    for i, (name, kw, sizes) in enumerate(SCENARIOS):
        if size not in sizes or (only and str(i) not in only):
            continue
        t0 = time.perf_counter()
        if kw.get("record"):
            result = recorded(name, kw, size, out)
        else:
            result = compare(name, kw, rank, size)
        if result is not None:
            result["elapsed_s"] = round(time.perf_counter() - t0, 2)
        if result is not None:
            print(json.dumps(result), flush=True)
        dist.barrier()
    print(f"rank {rank} ok", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    # Skip interpreter finalization: gloo's worker threads can still be releasing tensors
    # then, which aborts the process now and then (pytorch/pytorch#179291).
    os._exit(0)


if __name__ == "__main__":
    main()
