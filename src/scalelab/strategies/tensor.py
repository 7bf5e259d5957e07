"""`tensor`: the model-parallel MLP of the MNIST seed, over MPI ranks.

W1 (H x D) is split by rows and W2 (C x H) by the same columns: rank r owns the hidden units
h_r (even_counts of H). The inputs are replicated once (one Bcast of the training and held-out
sets); then per step

    forward   a1_r = sigmoid(x W1_r^T + b1_r)           (N, H_r)  local
              z_r  = a1_r W2_r^T                         (N, C)    rank r's part of sum over k
              z    = Allreduce_sum(z_r) + b2             (N, C)    the step's one message
    backward  dz   = (softmax(z) - onehot(y)) / N        the same on every rank (same z, y)
              dW2_r = dz^T a1_r,  da1_r = dz W2_r,  dW1_r = (da1_r * a1_r (1 - a1_r))^T x
              no communication: the Allreduce's gradient with respect to z_r is dz itself.

The loss's L2 term sums every rank's squares; the one scalar rides along in the logits'
Allreduce. Bytes per step: (N * C + 1) values against mpi-dp's P = H (D + C + 1) + C; both go
into the record (`bytes_per_step`). Checkpoints and --save-weights hold the whole MLP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from scalelab.comm import Comm, even_counts
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.instrument.timer import PhaseTimer, timed_iterations
from scalelab.results import RunOutput
from scalelab.strategies.base import STRATEGIES
from scalelab.strategies.mpi_dp import OnMPIRanks, host_stage, staged_allreduce
from scalelab.train.loop import default_plan, require_labels, run_training
from scalelab.workloads.base import Inputs, Workload

# How each MLP tensor is split over ranks: dim 0 (rows), dim 1 (columns) or replicated.
LAYOUT: dict[str, int | None] = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None}
PARAMS = list(LAYOUT)  # parameter order of the MLP and of ShardedMLP (optimizer state keys)


class _SumOverRanks(torch.autograd.Function):
    """Forward: Allreduce(sum) of the partial logits. Backward: identity (every rank already
    holds the full dL/dz, so each partial's gradient is dL/dz with no message)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, reduce: Callable) -> torch.Tensor:
        return reduce(partial)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ShardedMLP(nn.Module):
    """Rank r's hidden units of the MLP; parameter names and order as the full MLP's."""

    def __init__(self, full: nn.Module, rows: slice, comm: Comm, timer: PhaseTimer) -> None:
        super().__init__()
        w1, w2 = full.fc1.weight, full.fc2.weight  # (H, D), (C, H)
        self.fc1 = nn.Linear(w1.shape[1], rows.stop - rows.start)
        self.fc2 = nn.Linear(rows.stop - rows.start, w2.shape[0])
        self.to(device=w1.device, dtype=w1.dtype)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(slice_for(full.state_dict()[name], LAYOUT[name], rows))
        self.comm, self.timer = comm, timer
        self.penalty_rest = torch.zeros((), dtype=w1.dtype, device=w1.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1).to(self.fc1.weight.dtype)  # (N, D)
        a1 = torch.sigmoid(self.fc1(x))  # (N, H_r)
        partial = a1 @ self.fc2.weight.T  # (N, C)
        return _SumOverRanks.apply(partial, self._reduce) + self.fc2.bias

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(partial.dtype, torch.float32)  # MPI sums fp32/fp64
        weights = (self.fc1.weight, self.fc2.weight)
        own = sum(w.detach().to(dtype).square().sum() for w in weights)  # this rank's L2 part
        buf = torch.cat([partial.detach().reshape(-1).to(dtype), own.to(dtype).reshape(1)])
        # Evaluation forwards are not booked: the record's phases and bytes are training's.
        timer = self.timer if self.training else PhaseTimer(enabled=False)
        with timer.phase("allreduce"):
            staged_allreduce(self.comm, buf, host_stage(buf, self.comm), timer)
        timer.add_bytes("allreduce", buf.nbytes)
        self.penalty_rest = (buf[-1] - own).to(self.fc1.weight.dtype)
        return buf[:-1].view_as(partial).to(partial.dtype)


def slice_for(t: torch.Tensor, dim: int | None, rows: slice) -> torch.Tensor:
    """Rank's part of a whole tensor (rows or columns rows of it), or all of a replicated one."""
    if dim is None or t.dim() == 0:
        return t
    return t[rows] if dim == 0 else t[:, rows]


@STRATEGIES.register(
    "tensor",
    "tensor parallel: --engine torch shards any model's Linear pairs and attention heads "
    "(DTensor, torchrun); the default engine splits the MLP's W1 rows / W2 columns over MPI ranks",
)
class TensorParallel(OnMPIRanks):
    name = "tensor"
    reads = ("engine", "checkpoint")
    splits_model = True
    by_heads = True
    trains_only = True  # the hand-written engine trains only (DTensor's also infers)

    @classmethod
    def reads_for(cls, cfg: RunConfig) -> tuple[str, ...]:
        if cfg.engine == "torch":
            from scalelab.strategies.tensor_dtensor import DTensorParallel

            return DTensorParallel.reads
        return cls.reads

    @classmethod
    def describe(cls, cfg: RunConfig) -> str:
        return f"the tensor strategy with --engine {cfg.engine}"

    @classmethod
    def read_with(cls, cfg: RunConfig, section: str) -> str | None:
        from scalelab.strategies.tensor_dtensor import DTensorParallel

        if cfg.engine != "torch" and section in DTensorParallel.reads:
            return "--engine torch"
        return None

    @classmethod
    def build(cls, cfg: RunConfig):
        """DTensor's ColwiseParallel/RowwiseParallel under torchrun with --engine torch."""
        if cfg.engine == "torch":
            from scalelab.strategies.tensor_dtensor import DTensorParallel

            return DTensorParallel(cfg)
        return cls(cfg)

    @classmethod
    def launcher_for(cls, cfg: RunConfig) -> str | None:
        return "torchrun" if cfg.engine == "torch" else cls.launcher

    def __init__(self, cfg: RunConfig) -> None:
        self.preflight(cfg)
        super().__init__(cfg)
        counts = even_counts(cfg.hidden, self.comm.size)
        start = sum(counts[: self.comm.rank])
        self.rows = slice(start, start + counts[self.comm.rank])

    @classmethod
    def preflight(cls, cfg: RunConfig) -> int:
        """Checks that need no ranks; returns the global batch."""
        if cfg.engine == "torch":
            from scalelab.strategies.tensor_dtensor import DTensorParallel

            return DTensorParallel.preflight(cfg)
        if cfg.workload != "mlp":
            raise UsageError(
                f"tensor splits the seed's MLP only (mlp), not {cfg.workload}; --engine torch "
                "shards other models' Linear pairs"
            )
        if cfg.hidden < cfg.ranks:
            raise UsageError(f"--hidden {cfg.hidden} < {cfg.ranks} ranks: a rank would own no unit")
        return cfg.batch

    def validate(self, workload: Workload) -> None:
        if self.cfg.hidden < self.comm.size:
            raise UsageError(
                f"--hidden {self.cfg.hidden} < {self.comm.size} ranks: a rank would own no unit"
            )

    def shard_model(self, model: nn.Module) -> ShardedMLP:
        return ShardedMLP(self.place(model), self.rows, self.comm, self.timer)

    def replicate(self, data: Inputs | None) -> Inputs:
        """The root's items on every rank (one Bcast each of pixels and labels)."""
        root = self.comm.is_root
        with self.timer.phase("bcast"):
            x = self.comm.bcast(data.x if root else None)
            y = self.comm.bcast(data.y if root else None) if self._labelled(data) else None
        self.timer.add_bytes("bcast", x.nbytes + (0 if y is None else y.nbytes))
        return Inputs(x, y)

    def _labelled(self, data: Inputs | None) -> bool:
        return self.comm.bcast_object(data.y is not None if self.comm.is_root else None)

    # --- inference (checked against the float64 oracle like any strategy) -------------------
    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        x = self.replicate(inputs).x
        sharded = self.shard_model(model).eval()

        def step() -> torch.Tensor:
            with self.timer.phase("h2d"):
                xd = self.to_device(x)
            with self.timer.phase("compute"):
                out = self.forward(workload, sharded, xd)
            with self.timer.phase("d2h"):
                return out.to("cpu", torch.float64)

        cfg = self.cfg
        timings, out = timed_iterations(step, self.timer, cfg.warmup, cfg.iters, self.comm.barrier)
        output = out.numpy() if self.is_root else None
        bytes_moved = self.timer.bytes_moved()
        return RunOutput(timings, self.gather_phases(timings), output, len(x), bytes_moved)

    # --- training ----------------------------------------------------------------------------
    def train(
        self, workload: Workload, model: nn.Module, data: tuple[Inputs, Inputs] | None
    ) -> RunOutput:
        if self.is_root:
            require_labels(*data)
        train, heldout = (self.replicate(d) for d in (data if data else (None, None)))
        sharded = self.shard_model(model)
        l2 = self.cfg.l2
        plan = default_plan(self, workload, sharded, train, heldout)
        plan.loss = lambda m, z, y: workload.loss(m, z, y) + l2 / 2 * m.penalty_rest
        plan.export_state, plan.import_state = self.export_state, self.import_state
        plan.notes = {"bytes_per_step": self.bytes_per_step(model)}
        out = run_training(self, workload, sharded, plan, result_model=model)
        whole = self.export_state(sharded, None)
        if whole is not None:
            model.load_state_dict(whole[0])
        return out

    def bytes_per_step(self, model: nn.Module) -> dict[str, int]:
        item = self.precision.storage.itemsize
        n_params = sum(p.numel() for p in model.parameters())
        classes = model.fc2.weight.shape[0]
        return {"allreduce": (self.cfg.batch * classes + 1) * item, "mpi_dp": n_params * item}

    # --- checkpoints: the whole MLP on the root, this rank's part on import ------------------
    def _gather(self, t: torch.Tensor, dim: int | None) -> torch.Tensor | None:
        t = t.detach().cpu()
        if dim is None or t.dim() == 0:
            return t
        whole = self.comm.gatherv((t.T if dim == 1 else t).contiguous())
        return None if whole is None else (whole.T.contiguous() if dim == 1 else whole)

    def export_state(self, model: nn.Module, opt: torch.optim.Optimizer | None):
        state = {k: self._gather(v, LAYOUT[k]) for k, v in model.state_dict().items()}
        opt_state = None
        if opt is not None:
            full = opt.state_dict()
            per_param = {
                i: {
                    k: self._gather(v, LAYOUT[PARAMS[i]]) if torch.is_tensor(v) else v
                    for k, v in s.items()
                }
                for i, s in full["state"].items()
            }
            opt_state = {"state": per_param, "param_groups": full["param_groups"]}
        return (state, opt_state) if self.is_root else None

    def import_state(self, model: nn.Module, opt, state: dict, opt_state: dict) -> None:
        model.load_state_dict({k: slice_for(v, LAYOUT[k], self.rows) for k, v in state.items()})
        per_param = {
            i: {
                k: slice_for(v, LAYOUT[PARAMS[i]], self.rows) if torch.is_tensor(v) else v
                for k, v in s.items()
            }
            for i, s in opt_state["state"].items()
        }
        opt.load_state_dict({"state": per_param, "param_groups": opt_state["param_groups"]})
