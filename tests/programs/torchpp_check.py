"""Run under torchrun (gloo): `pipeline --engine torch` and `tensor --engine torch` against one
process. Usage: torchpp_check.py SUITE [names...]; SUITE pp (world = stages), pp2d (dp2 x pp2),
tp (world = tp), tp2d (dp2 x tp2). Prints one JSON line per scenario from the root, then
'rank R ok' per rank.

Training compares weights after 2 SGD steps (momentum 0.9, fp64) with the `local` strategy on
a fresh copy of the same seeded model; inference compares logits. VGG-16's dropout is set to 0
here for both runs: a pipeline stage or tensor shard draws other dropout masks than one process;
the 4096-wide heads are 64 wide (SHAPES note below).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import scalelab.workloads.deepstack as deepstack
import scalelab.workloads.vgg as vgg
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.oracle.check import relative_error
from scalelab.strategies import STRATEGIES
from scalelab.strategies.local import LocalStrategy
from scalelab.workloads import WORKLOADS

vgg.DROPOUT = 0.0
# CI-sized heads: VGG-16's and deepstack's 4096-wide linear layers at 64 (fp64 SGD over 17 M
# parameters per layer costs seconds per step on 2 shared cores); the layer structure is kept.
vgg.FC_WIDTH = deepstack.FC_WIDTH = 64
SHAPES = {
    "deepstack": {"image_size": 8, "convs": 3, "fcs": 2, "num_classes": 10},
    "vgg16": {"image_size": 32, "num_classes": 10},
    "mlp": {"hidden": 16},
    "alexnet": {"image_size": 67, "num_classes": 10},
}
TRAIN = {"train": True, "train_size": 16, "heldout_size": 8, "momentum": 0.9, "steps": 2}
# Explicit cuts (the others are --balance auto, timed, so they move with the machine's load):
# - the mlp's and VGG-16's zbv cuts start with a parameter-free stage, whose successor needs
#   the whole backward under the split schedules (torch_stages.whole_backward_stages);
#   without it fc1 / conv1_1 never trained;
# - deepstack's split-backward cuts end stage 1 at `flatten`, whose output is a view:
#   torch's stage_backward_input detach_()es it and raised (torch_stages.OwnedOutput).
BALANCE = {
    ("mlp", 4): "2,1,1,1",  # [flatten cast | fc1 | sigmoid | fc2]
    ("vgg16", "zbv"): "1,17,14,8",  # [cast | conv1_1 .. conv3_3 | .. | ..]
    **{("deepstack", s): "6,3,4,3" for s in ("zero-bubble", "zbv", "dualpipev")},
}
PP_SCHEDULES = [
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "looped-bfs",
    "zero-bubble",
    "zbv",
    "dualpipev",
]


def scenarios(suite: str, world: int) -> list[tuple[str, dict]]:
    if suite == "pp":
        out = []
        for name in ("deepstack", "mlp", "vgg16"):
            for sched in PP_SCHEDULES:
                v = 2 if sched in ("interleaved-1f1b", "looped-bfs", "zero-bubble") else 1
                out.append((name, {"schedule": sched, "virtual_stages": v, **TRAIN,
                                   "balance": balance(name, sched, world)}))  # fmt: skip
        # VGG-16's stages in NHWC (ChannelsLast), boundaries NCHW
        out.append(("vgg16", {"schedule": "1f1b", **TRAIN, "channels_last": True}))
        out.append(("deepstack", {"schedule": "interleaved-1f1b", "virtual_stages": 2}))
        out.append(("deepstack", {"schedule": "zbv"}))  # inference through a training schedule
        return [(n, {"balance": "auto", **kw, "strategy": "pipeline", "stages": world,
                     "rebalance": 0}) for n, kw in out]  # fmt: skip
    if suite == "pp2d":
        return [("deepstack", {"strategy": "pipeline", "stages": 2, "dp": 2, "schedule": s,
                               "virtual_stages": v, **TRAIN})
                for s, v in (("1f1b", 1), ("interleaved-1f1b", 2))]  # fmt: skip
    if suite == "tp":
        # alexnet's synthetic inputs carry no labels: inference only.
        cases = [("mlp", {}), ("mlp", TRAIN), ("alexnet", {}), ("vgg16", {}), ("vgg16", TRAIN),
                 ("deepstack", TRAIN)]  # fmt: skip
        return [(n, {"strategy": "tensor", "tp": world, **t}) for n, t in cases]
    if suite == "tp2d":
        return [(n, {"strategy": "tensor", "tp": 2, "dp": 2, **TRAIN}) for n in ("mlp", "vgg16")]
    raise SystemExit(f"unknown suite {suite}")


def balance(name: str, schedule: str, world: int) -> str:
    n_stages = world * (1 if schedule in ("gpipe", "1f1b") else 2)
    if world != 2:
        return "auto"
    return BALANCE.get((name, schedule), BALANCE.get((name, n_stages), "auto"))


def config(name: str, kw: dict, world: int, parallel: bool) -> RunConfig:
    base = {**SHAPES[name], "dtype": "fp64", "batch": 8, "microbatches": 4, "quiet": True,
            "iters": 1, "warmup": 1, "seed": 3}  # fmt: skip
    if not parallel:
        keep = {k: v for k, v in kw.items() if k in TRAIN}
        return RunConfig(workload=name, **base, **keep)
    return RunConfig(workload=name, **base, **kw, engine="torch", ranks=world)


def run(cfg: RunConfig, strategy, root: bool):
    workload = WORKLOADS.get(cfg.workload)(cfg)
    strategy.validate(workload)
    model = workload.build_model()
    if cfg.train:
        return strategy.train(workload, model, workload.training_data())
    return strategy.infer(workload, model, workload.inputs(cfg.batch) if root else None)


REFERENCES: dict = {}


def reference(cfg: RunConfig):
    """The one-process run of cfg and the model's initial state_dict, once per config: every
    schedule of a workload compares with the same run (VGG-16's costs seconds)."""
    key = repr(cfg)
    if key not in REFERENCES:
        initial = WORKLOADS.get(cfg.workload)(cfg).build_model().state_dict()
        REFERENCES[key] = run(cfg, LocalStrategy(cfg), True), initial
    return REFERENCES[key]


def _text(lists: dict) -> dict:
    return {str(r): [f"{s}{k}{m}" for s, k, m in a] for r, a in lists.items()}


def compare(name: str, kw: dict, rank: int, world: int) -> dict | None:
    cfg = config(name, kw, world, True)
    strategy = STRATEGIES.get(cfg.strategy).build(cfg)
    strategy.close = lambda: None
    try:
        out = run(cfg, strategy, rank == 0)
    except UsageError as exc:  # a refused configuration: every rank refuses the same cut
        return {"workload": name, "schedule": kw.get("schedule"), "refused": str(exc)}
    if rank != 0:
        return None
    ref_cfg = config(name, kw, world, False)
    ref, initial = reference(ref_cfg)
    result = {"workload": name, **{k: v for k, v in kw.items() if k not in TRAIN}}
    result["train"] = cfg.train
    notes = out.notes.get("pipeline") or out.notes.get("tensor") or {}
    for key in ("bubble_formula", "bubble_simulated", "bubble_measured", "mesh", "actions"):
        if key in notes:
            result[key] = notes[key]
    if "actions" in notes and "virtual_stages" in notes:  # the order predict draws, unrun
        from scalelab.layout.torch_schedule import schedule_actions, torch_order

        sched, k, v, m = (notes[key] for key in ("schedule", "stages", "virtual_stages",
                                                 "microbatches"))  # fmt: skip
        result["drawn"] = _text(torch_order(sched, k, v, m))
        # the lists the runtime walked, transfers included, beside those the replay draws
        # (the record's bubble_simulated replays the run's own: torch_report)
        main = strategy.passes.get((cfg.batch // cfg.dp, cfg.train))
        main = main or next(iter(strategy.passes.values()))
        result["lowered_ran"] = _text(schedule_actions(main.schedule, sched, k, m, comms=True))
        result["lowered_drawn"] = _text(torch_order(sched, k, v, m, comms=True))
    if "stage" in notes:
        result["executed"] = {str(r["pp_rank"]): [e[0] for e in r["timeline_ms"] or []]
                              for r in notes["stage"] if r["dp_rank"] == 0}  # fmt: skip
    if cfg.train:
        a, b = out.model.state_dict(), ref.model.state_dict()
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in b)
        moved = max(float((b[k].double() - initial[k].double()).abs().max()) for k in b)
        result.update(
            weight_diff=diff, moved=moved, loss=out.history.loss, ref_loss=ref.history.loss
        )
    else:
        result["relerr"] = relative_error(out.output, ref.output)
    return result


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    suite, only = sys.argv[1], sys.argv[2:]
    for i, (name, kw) in enumerate(scenarios(suite, world)):
        if only and str(i) not in only:
            continue
        t0 = time.perf_counter()
        result = compare(name, kw, rank, world)
        if result is not None and (rank == 0 or "refused" not in result):
            result["elapsed_s"] = round(time.perf_counter() - t0, 2)
            print(json.dumps(result), flush=True)
        dist.barrier()
    print(f"rank {rank} ok", flush=True)
    sys.stdout.flush()
    # Rank 0 leaves last: a peer that exits while rank 0 still reads the last barrier's message
    # resets the connection ("Connection closed by peer" on rank 0, seen once in ~10 runs).
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("torchpp/rank0-done", "1")
    else:
        store.wait(["torchpp/rank0-done"])
    os._exit(0)  # gloo's threads can still release tensors at finalization (pytorch#179291)


if __name__ == "__main__":
    main()
