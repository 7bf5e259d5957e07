"""Training checkpoints: written by rank 0 atomically, read by every rank on `--resume`.

A checkpoint holds the whole training state as one process would hold it (strategies that
split the model gather it first), so it loads under any strategy and rank count:

    model, optimizer, grad scaler   state_dicts, keys as the workload's model
    position                        epoch, step within it, steps so far, items of the epoch
    epoch_loss_sums, history        so a resumed run reports the same loss curve
    schedule                        seed, training items, global batch: the data order
    rng                             torch's CPU generator
    threads                         torch's intra-op threads: a CPU resume sums as before

Resuming mid-epoch continues the epoch's data order at the same item; that needs the same
seed and training set, and a global batch that divides the items already done. Anything else
is refused with one line; a different rank count is allowed and said. Writes go to a temporary
file that is renamed over the old one, so a run killed while writing leaves the previous
checkpoint whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from scalelab.config import RunConfig
from scalelab.errors import UsageError

if TYPE_CHECKING:
    from scalelab.results import TrainHistory
    from scalelab.train.host import TrainHost
    from scalelab.train.steps import TrainStep
    from scalelab.train.train_plan import Position, TrainPlan


class Trainer(Protocol):
    """What a checkpoint reads and restores of the loop's trainer (train/loop.Trainer)."""

    cfg: RunConfig
    plan: TrainPlan
    pos: Position
    history: TrainHistory
    stepper: TrainStep
    strategy: TrainHost


FORMAT = "scalelab.ckpt/1"
DEFAULT_DIR = Path("scalelab-results") / "checkpoints"
# Config fields that do not change what is trained (so a resumed run writes the same file).
VOLATILE = {"resume", "ckpt_every", "ckpt_dir", "quiet", "epochs", "steps", "save_weights"}
VOLATILE |= {"trace", "nvml", "per_layer", "extra", "ranks", "weights"}


def checkpoint_path(cfg: RunConfig) -> Path:
    """ckpt_dir / WORKLOAD-STRATEGY-DIGEST.pt; the digest covers the options that shape the
    run, so the runs of a --lr study do not overwrite each other."""
    fields = {k: v for k, v in cfg.to_dict().items() if k not in VOLATILE}
    digest = hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    folder = Path(cfg.ckpt_dir) if cfg.ckpt_dir is not None else DEFAULT_DIR
    return folder / f"{cfg.workload}-{cfg.strategy}-{digest[:8]}.pt"


@dataclass
class Checkpointer:
    """When to write (every N steps and after the last one) and where; rank 0 writes."""

    path: Path | None
    every: int | None
    is_root: bool
    written: bool = False

    @classmethod
    def for_run(cls, cfg: RunConfig, is_root: bool) -> Checkpointer:
        wanted = cfg.ckpt_every is not None or cfg.ckpt_dir is not None
        return cls(checkpoint_path(cfg) if wanted else None, cfg.ckpt_every, is_root)

    def due(self, step: int, last: bool) -> bool:
        if self.path is None:
            return False
        return last or (self.every is not None and step % self.every == 0)

    def save(self, state: dict[str, Any]) -> None:
        assert self.path is not None and self.is_root
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)  # atomic: readers see the old file or the new one
        finally:
            tmp.unlink(missing_ok=True)
        self.written = True


# --- reading and checking ------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--resume {p}: no such file")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types for a bad file
        raise UsageError(
            f"--resume {p}: not a readable checkpoint ({type(exc).__name__})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"--resume {p}: not a scalelab training checkpoint")
    return state


# key -> (kind, required sub-keys): the contents a resume reads, checked before it reads them.
CONTENTS = {
    "workload": (str, ()),
    "strategy": (str, ()),
    "world_size": (int, ()),
    "schedule": (dict, ("seed", "n_train", "global_batch")),
    "model": (dict, ()),
    "optimizer": (dict, ("state", "param_groups")),
    "scaler": (dict, ()),
    "position": (dict, ("epoch", "step", "steps", "items")),
    "epoch_loss_sums": (list, ()),
    "epoch_loss_total": (float, ()),
    "history": (dict, ("loss", "accuracy")),
    "rng": (torch.Tensor, ()),
}


def _shape_problem(state: dict[str, Any]) -> str | None:
    for key, (kind, inner) in CONTENTS.items():
        value = state.get(key)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"{key!r} is {type(value).__name__}, expected {kind.__name__}"
        missing = [k for k in inner if k not in value]
        if missing:
            return f"{key!r} lacks {missing[0]!r}"
    if not all(isinstance(v, torch.Tensor) for v in state["model"].values()):
        return "'model' holds values that are not tensors"
    ints = [state["position"][k] for k in ("epoch", "step", "steps", "items")]
    ints += [state["schedule"][k] for k in ("seed", "n_train", "global_batch")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        return "position and schedule must hold non-negative integers"
    curves = [state["epoch_loss_sums"], state["history"]["loss"], state["history"]["accuracy"]]
    if not all(isinstance(c, list) and all(_is_number(v) for v in c) for c in curves):
        return "epoch losses and history must be lists of numbers"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_model(state: dict[str, Any], cfg: RunConfig) -> None:
    """Same workload and the same tensor shapes as the model this run builds."""
    from scalelab.workloads import WORKLOADS

    wrong = _shape_problem(state)
    if wrong is not None:
        raise UsageError(
            f"--resume {cfg.resume}: a scalelab checkpoint with wrong contents: {wrong}"
        )
    if state["workload"] != cfg.workload:
        raise UsageError(
            f"--resume {cfg.resume}: the checkpoint trains {state['workload']}, "
            f"this run trains {cfg.workload}"
        )
    model = WORKLOADS.get(cfg.workload)(cfg).build_model()
    here = {k: list(v.shape) for k, v in model.state_dict().items()}
    there = {k: list(v.shape) for k, v in state["model"].items()}
    for key in [*here, *(k for k in there if k not in here)]:  # the model's order
        if here.get(key) != there.get(key):
            raise UsageError(
                f"--resume {cfg.resume}: {key} is {_shape(there.get(key))} in the checkpoint "
                f"but {_shape(here.get(key))} in this model (different --hidden, "
                "--num-classes or --image-size?)"
            )


def _shape(shape: list[int] | None) -> str:
    return "absent" if shape is None else "x".join(map(str, shape)) or "a scalar"


def resume_step(
    state: dict[str, Any], cfg: RunConfig, world: int, global_batch: int, n_train: int | None
) -> int:
    """The step within the checkpoint's epoch at which this run continues; refuses positions
    it cannot honour. n_train None: not known yet (the CLI's check before launching)."""
    pos, sched = state["position"], state["schedule"]
    if pos["step"] == 0:
        return 0
    same_data = sched["seed"] == cfg.seed and n_train in (None, sched["n_train"])
    if not same_data:
        raise UsageError(
            f"--resume {cfg.resume}: the checkpoint stopped mid-epoch with --seed "
            f"{sched['seed']} on {sched['n_train']} items; resuming mid-epoch needs the same "
            "seed and training set (the data order depends on both)"
        )
    if pos["items"] % global_batch:
        raise UsageError(
            f"--resume {cfg.resume}: cannot continue mid-epoch: {pos['items']} items of the "
            f"epoch are done, not a multiple of this run's global batch {global_batch} "
            f"(the checkpoint's was {sched['global_batch']} on {state['world_size']} ranks); "
            "keep the global batch (ddp: --global-batch) or resume from an epoch boundary"
        )
    return pos["items"] // global_batch


def world_size_note(state: dict[str, Any], world: int, global_batch: int) -> str | None:
    old_world, old_batch = state["world_size"], state["schedule"]["global_batch"]
    if old_world == world:
        return None
    batch = "the same" if old_batch == global_batch else f"{old_batch} -> {global_batch}"
    return (
        f"note: resuming a {old_world}-rank checkpoint on {world} ranks (allowed: the "
        f"checkpoint holds the whole model; global batch {batch}); the gradient sums run in "
        "a different order, so the result matches the uninterrupted run to rounding, not bitwise"
    )


def check_resume(state: dict[str, Any], trainer: Trainer) -> int:
    cfg, source = trainer.cfg, trainer.plan.source
    check_model(state, cfg)
    world = trainer.strategy.comm.size
    skip = resume_step(state, cfg, world, source.global_batch, trainer.plan.n_train)
    note = world_size_note(state, world, source.global_batch)
    if note is not None and trainer.strategy.is_root:
        print(note, file=sys.stderr)
    return skip


def preflight(cfg: RunConfig, world: int, global_batch: int) -> None:
    """The checks that need no data or ranks, run by the CLI before it starts a launcher."""
    state = load_checkpoint(cfg.resume)
    check_model(state, cfg)
    resume_step(state, cfg, world, global_batch, None)


def _loss_share(state: dict[str, Any], comm: Any) -> float:
    """This rank's part of the epoch's partial loss sum."""
    sums = state["epoch_loss_sums"]
    if len(sums) == comm.size:
        return sums[comm.rank]
    return state["epoch_loss_total"] if comm.is_root else 0.0


# --- the state itself ------------------------------------------------------------------------
def export_training_state(t: Trainer) -> dict[str, Any] | None:
    """The whole training state on the root rank (None elsewhere); collective."""
    # The epoch's partial loss: every rank's own sum (a resume on as many ranks continues
    # bit for bit) and the strategy's total over ranks (for a resume on a different count).
    mine = float(t.pos.loss_sum)
    sums = t.strategy.comm.gather_object(mine)
    total = t.strategy.all_sum(mine)
    pair = t.stepper.export_state()
    if pair is None:
        return None
    model_state, opt_state = pair
    cfg = t.cfg
    return {
        "format": FORMAT,
        "workload": cfg.workload,
        "strategy": cfg.strategy,
        "world_size": t.strategy.comm.size,
        "schedule": {
            "seed": cfg.seed,
            "n_train": t.plan.n_train,
            "global_batch": t.plan.source.global_batch,
        },
        "model": {k: v.detach().cpu().clone() for k, v in model_state.items()},
        "optimizer": opt_state,
        "scaler": t.stepper.scaler_state(),
        "position": {
            "epoch": t.pos.epoch,
            "step": t.pos.step,
            "steps": t.history.steps,
            "items": t.pos.items,
        },
        "epoch_loss_sums": sums,
        "epoch_loss_total": total,
        "history": {"loss": list(t.history.loss), "accuracy": list(t.history.accuracy)},
        "rng": torch.get_rng_state(),
        "threads": torch.get_num_threads(),  # a resume without --threads takes it (loop.py)
        "config": cfg.to_dict(),
    }


def import_training_state(t: Trainer, state: dict[str, Any], skip: int) -> None:
    """Load state into the trainer; the run's own hyperparameters (--lr, ...) win over the
    checkpoint's, the optimizer's buffers (momentum) come from it."""
    try:  # torch checks what the shape check cannot (groups, buffers): a refusal, not a bug
        t.stepper.import_state(state["model"], state["optimizer"])
        t.stepper.load_scaler(state["scaler"])
    except (ValueError, RuntimeError, KeyError, TypeError, IndexError, AttributeError) as exc:
        text = " ".join(str(exc).split())
        raise UsageError(f"--resume: a scalelab checkpoint with wrong contents: {text}") from None
    pos = state["position"]
    t.pos.epoch, t.pos.step, t.pos.items = pos["epoch"], skip, pos["items"]
    t.pos.loss_sum.fill_(_loss_share(state, t.strategy.comm))
    t.history.steps = pos["steps"]
    t.history.loss[:] = state["history"]["loss"]
    t.history.accuracy[:] = state["history"]["accuracy"]
    torch.set_rng_state(state["rng"])
