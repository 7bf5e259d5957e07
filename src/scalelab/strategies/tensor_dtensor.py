"""`tensor --engine torch`: tensor parallelism on DTensor, `--tp N` ranks per group, optionally
`--dp D` replicas of the group on a (dp, tp) device mesh (ranks = D x N).

Every Linear pair the workload marks is sharded with torch's `parallelize_module`: the first
column-wise (ColwiseParallel: its output features split, (B, F/N) per rank), the second
row-wise (RowwiseParallel: its input features split, the partial (B, K) outputs summed by one
all-reduce). Everything between the two must be elementwise (ReLU, sigmoid, dropout), so each
rank applies it to its own columns. Per pair a forward costs one all-reduce of (B, K) and a
backward one of the first layer's input gradient (B, D_in). The rest of the model is
replicated: every rank of a group computes it on the same items.

The pairs: mlp (fc1, fc2), alexnet (fc6, fc7), vgg16 (classifier.0, classifier.3), charcnn
(fc1, fc2), and for nn.Sequential models (deepstack, users' models) consecutive Linear
children joined by elementwise layers only, paired from the front. The hand-written MLP split
over MPI (strategies/tensor.py) stays as the reference.

A model built from repeated blocks (a transformer) is sharded by heads instead: the plan is a
user's `--tp-plan MODULE:OBJECT`, else the one the model declares (Hugging Face's), else one
derived from its blocks' attention and MLP modules (tensor_plans/); a fused qkv projection's
rows are kept in sharded order inside the run and go back to the user's order in every weight
or checkpoint that leaves it. `scalelab run` proves the plan before it launches the ranks
(tensor_plans/proof.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from scalelab.errors import UsageError
from scalelab.instrument.timer import timed_iterations
from scalelab.results import RunOutput
from scalelab.strategies import penalty as pen
from scalelab.strategies.mesh import Layout, MeshGroups
from scalelab.strategies.tensor_plans import derived as tp
from scalelab.strategies.tensor_plans import proof
from scalelab.strategies.torchdist_base import TorchDistStrategy
from scalelab.train.loop import default_plan, require_labels, run_training
from scalelab.workloads.base import Inputs, Workload

MARKED: dict[str, list[tuple[str, str]]] = {
    "mlp": [("fc1", "fc2")],
    "alexnet": [("fc6", "fc7")],
    "vgg16": [("classifier.0", "classifier.3")],
    "charcnn": [("fc1", "fc2")],
}
ELEMENTWISE = (nn.ReLU, nn.Sigmoid, nn.Tanh, nn.GELU, nn.Dropout, nn.Identity)


def linear_pairs(workload: Workload, model: nn.Module) -> list[tuple[str, str]]:
    """The (column-wise, row-wise) Linear pairs of a model, by module name."""
    if workload.name in MARKED:
        return MARKED[workload.name]
    if hasattr(workload, "linear_pairs"):  # a user's model: from its layers
        return workload.linear_pairs(model)
    if not isinstance(model, nn.Sequential):
        return []
    pairs, open_, between_ok = [], None, True
    for name, mod in model.named_children():
        if isinstance(mod, nn.Linear):
            if open_ is not None and between_ok:
                pairs.append((open_, name))
                open_ = None
            else:
                open_ = name
            between_ok = True
        elif not isinstance(mod, ELEMENTWISE):
            open_ = None
    return pairs


def _sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements)


class DTensorParallel(TorchDistStrategy):
    name = "tensor"
    reads = ("engine", "mesh", "tensor", "checkpoint")
    needs_data_everywhere = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        tp = cfg.tp if cfg.tp is not None else max(self.comm.size // cfg.dp, 1)
        self.layout = Layout(cfg.dp, tp, "tp")

    @classmethod
    def preflight(cls, cfg) -> int:
        if cfg.tp is not None and cfg.ranks > 1 and cfg.ranks != cfg.tp * cfg.dp:
            raise UsageError(
                f"tensor: --dp {cfg.dp} x --tp {cfg.tp} needs --ranks {cfg.tp * cfg.dp}"
            )
        if not proof.inside_ranks():
            proof.prove(cfg)  # the plan on a tiny forward before any rank starts
        return cfg.batch

    def validate(self, workload: Workload) -> None:
        self.layout.check(self.comm.size, "tensor --engine torch")
        self.heads = None  # a plan by heads (tensor_plans/): --tp-plan, declared, derived
        with torch.device("meta"):
            meta = workload.build_model()
            if proof.by_heads(self.cfg, workload, meta):
                self.heads = tp.derive_plan(meta, self.layout.inner, self.cfg.tp_plan)
                pairs = self.heads.pairs()
            else:
                pairs = linear_pairs(workload, meta)
        if not pairs:
            raise UsageError(
                f"tensor --engine torch: {workload.name} marks no Linear pair to shard"
            )
        if self.cfg.batch < self.cfg.dp:
            raise UsageError(f"--batch {self.cfg.batch} < --dp {self.cfg.dp}")
        self.pairs = pairs
        self.groups = MeshGroups(self.layout, self.device.type)

    def place(self, model: nn.Module) -> nn.Module:
        model = super().place(model)
        if self.heads is not None:  # the same plan, on the real model (swaps, head counts)
            self.heads = tp.derive_plan(model, self.layout.inner, self.cfg.tp_plan)
            self.orders = tp.param_orders(model, self.heads)
            return tp.parallelize(model, self.groups.inner_mesh, self.heads)
        plan = {}
        for col, row in self.pairs:
            plan[col], plan[row] = ColwiseParallel(), RowwiseParallel()
        return parallelize_module(model, self.groups.inner_mesh, plan)

    # --- hooks of the training loop -----------------------------------------------------------
    def shard(self, batch: Inputs) -> Inputs:
        share = self.groups.share(len(batch))
        return batch.slice(share.start, share.stop)

    def reduce_gradients(self, model: nn.Module, timer) -> None:
        with timer.phase("dp_allreduce"):
            sent = self.groups.all_reduce_grads(list(model.parameters()))
        timer.add_bytes("dp_allreduce", sent)

    def all_sum(self, value: float) -> float:
        """Over the dp group: the ranks of one tensor group hold the same loss."""
        t = torch.tensor([value], dtype=torch.float64, device=self.comm.device)
        dist.all_reduce(t, group=self.groups.dp_group)
        return float(t.cpu()[0])

    def loss(self, workload: Workload, model: nn.Module, z: torch.Tensor, y: torch.Tensor):
        """The workload's loss with its penalty taken over local pieces: the sharded weights'
        part summed over the tp group in value (its gradient is each rank's own)."""
        total = pen.item_loss(workload, z, y)
        named = list(model.named_parameters())
        shards = pen.penalty(workload, [(n, p.to_local()) for n, p in named if _sharded(p)])
        whole = pen.penalty(workload, [(n, p.to_local() if isinstance(p, DTensor) else p)
                                       for n, p in named if not _sharded(p)])  # fmt: skip
        if whole is not None:
            total = total + whole
        if shards is not None:
            summed = shards.detach().clone()
            dist.all_reduce(summed, group=self.groups.inner_group)
            total = total + shards + (summed - shards.detach())
        return total

    # --- inference ---------------------------------------------------------------------------
    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        x = self.comm.bcast_object(inputs.x if self.is_root else None)
        share = self.groups.share(len(x))
        model = self.place(model).eval()

        def step() -> torch.Tensor | None:
            with self.timer.phase("h2d"):
                xd = self.to_device(x[share])
            with self.timer.phase("compute"):
                out = self.forward(workload, model, xd)
            with self.timer.phase("gather"):
                return self.groups.gather_replicas(
                    self.comm, out if self.groups.inner_rank == 0 else None
                )

        timings, out = timed_iterations(
            step, self.timer, self.cfg.warmup, self.cfg.iters, barrier=self.comm.barrier
        )
        return RunOutput(
            timings,
            self.gather_phases(timings),
            None if out is None else np.asarray(out),
            len(x),
            self.timer.bytes_moved(),
            notes=self.notes(),
        )

    # --- training -----------------------------------------------------------------------------
    def train(
        self, workload: Workload, model: nn.Module, data: tuple[Inputs, Inputs] | None
    ) -> RunOutput:
        train, heldout = data
        require_labels(train, heldout)
        net = self.place(model)
        plan = default_plan(self, workload, net, train, heldout)
        plan.loss = lambda m, z, y: self.loss(workload, m, z, y)
        plan.export_state, plan.import_state = self.export_state, self.import_state
        plan.notes = self.notes()
        out = run_training(self, workload, net, plan)
        whole = self.export_state(net, None)
        out.model = None
        if whole is not None:
            fresh = workload.build_model().to(dtype=self.precision.storage)
            fresh.load_state_dict(whole[0])
            out.model = fresh
        return out

    def notes(self) -> dict[str, Any]:
        return {
            "tensor": {
                "engine": "torch",
                "mesh": self.layout.shape(),
                "plan": "pairs" if self.heads is None else self.heads.source,
                "pairs": [list(p) for p in self.pairs],
                # Per pair: one all-reduce of the row-wise output forward, one of the
                # column-wise input gradient backward, over the tp group; dp: gradients.
                "comm_groups": {"tp": {"size": self.layout.inner, "ops": "all-reduce per pair"},
                                "dp": {"size": self.layout.dp, "ops": "gradient all-reduce"}},
            }
        }  # fmt: skip

    # --- checkpoints: whole tensors on the root, this rank's shards on import -----------------
    def export_state(self, model: nn.Module, opt: torch.optim.Optimizer | None):
        full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()  # noqa: E731
        state = {k: full(v) for k, v in model.state_dict().items()}
        opt_state = None
        if opt is not None:
            sd = opt.state_dict()
            per = {i: {k: self._user_rows(i, full(v)) if torch.is_tensor(v) else v
                       for k, v in s.items()}
                   for i, s in sd["state"].items()}  # fmt: skip
            opt_state = {"state": per, "param_groups": sd["param_groups"]}
        if self.heads is not None:
            state = tp.to_user(state, self.heads, self.layout.inner)
        return (state, opt_state) if self.is_root else None

    def _user_rows(self, index: int, t: torch.Tensor) -> torch.Tensor:
        """A fused qkv parameter's optimizer state in the user's row order (tensor_plans)."""
        how = getattr(self, "orders", {}).get(index)
        return t if how is None else tp.permute(t, how, self.layout.inner, back=True)

    def import_state(self, model: nn.Module, opt, state: dict, opt_state: dict) -> None:
        if self.heads is not None:
            n = self.layout.inner
            state = tp.from_user(state, self.heads, n)
            opt_state = {**opt_state, "state": {
                i: {k: tp.permute(v, self.orders[i], n)
                    if i in self.orders and torch.is_tensor(v) else v
                    for k, v in s.items()}
                for i, s in opt_state["state"].items()}}  # fmt: skip
        params = list(model.parameters())
        with torch.no_grad():
            for k, t in model.state_dict().items():
                t.copy_(self._like(t, state[k]))
        per = {
            i: {k: self._like(params[i], v) if torch.is_tensor(v) and v.dim() else v
                for k, v in s.items()}
            for i, s in opt_state["state"].items()
        }  # fmt: skip
        opt.load_state_dict({"state": per, "param_groups": opt_state["param_groups"]})

    def _like(self, ref: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        whole = whole.to(device=self.device, dtype=ref.dtype)
        if isinstance(ref, DTensor):
            return distribute_tensor(whole, ref.device_mesh, ref.placements)
        return whole
