"""`--sync-bn`: BatchNorm over the whole global batch, not over each rank's share.

On GPUs under NCCL torch's own `nn.SyncBatchNorm` does it. SyncBatchNorm does not run on CPU
tensors (gloo, or mpi-dp's MPI ranks), so there `AllReduceBatchNorm` takes its place: the
smallest correct equivalent, ordinary torch ops around a differentiable all-reduce (sum
forward, sum of the gradients backward: every rank's output depends on every rank's items),
so autograd derives the backward that one process over the whole batch would have. Two passes
(the mean, then the squared deviations from it) instead of sum and sum of squares, which
cancel in fp32. State-dict keys stay those of the BatchNorm it replaces (checkpoints, saved
weights and the train check read them unchanged).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Reduce = Callable[[torch.Tensor], torch.Tensor]  # sum over ranks, a new tensor on every rank


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, reduce: Reduce) -> torch.Tensor:  # type: ignore[override]
        ctx.reduce = reduce
        return reduce(x.detach().clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.reduce(grad.detach().clone()), None


def all_sum(x: torch.Tensor, reduce: Reduce) -> torch.Tensor:
    return _AllReduceSum.apply(x, reduce)


class AllReduceBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm{1,2,3}d whose training statistics cover every rank's items (x: (N, C, ...));
    in eval mode, or without a reduce, plain BatchNorm."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, reduce: Reduce) -> None:
        super().__init__(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
        self.load_state_dict(bn.state_dict())
        self.to(device=bn.running_mean.device if bn.running_mean is not None else None)
        self.reduce = reduce

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an (N, C, ...) input, got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        shape = (1, -1, *([1] * (x.dim() - 2)))
        count = torch.tensor([x.numel() / max(x.shape[1], 1)], dtype=x.dtype, device=x.device)
        n = self.reduce(count)  # items x positions over all ranks (no gradient)
        mean = all_sum(x.sum(dims), self.reduce) / n  # (C,)
        dev = x - mean.reshape(shape)
        var = all_sum(dev.square().sum(dims), self.reduce) / n  # biased: what normalises
        y = dev * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        if self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), float(n))
        return y

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        self.num_batches_tracked += 1
        m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        self.running_mean.mul_(1 - m).add_(m * mean)
        self.running_var.mul_(1 - m).add_(m * var * n / max(n - 1, 1))  # unbiased, as torch


def batchnorms(model: nn.Module) -> list[str]:
    """Dotted names of the model's BatchNorm modules (any dimensionality, synced or not)."""
    return [name for name, m in model.named_modules() if isinstance(m, _BN_TYPES)]


_BN_TYPES = (nn.modules.batchnorm._BatchNorm,)


def convert(model: nn.Module, reduce: Reduce | None) -> nn.Module:
    """Every BatchNorm in the model made to normalise over all ranks: torch's SyncBatchNorm
    when reduce is None (GPUs under NCCL), else AllReduceBatchNorm over reduce (CPU ranks)."""
    if reduce is None:
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _swap(model, reduce)


def _swap(module: nn.Module, reduce: Reduce) -> nn.Module:
    if isinstance(module, _BN_TYPES) and not isinstance(module, AllReduceBatchNorm):
        return AllReduceBatchNorm(module, reduce).to(dtype=_dtype(module))
    for name, child in module.named_children():
        module.add_module(name, _swap(child, reduce))
    return module


def _dtype(module: nn.Module) -> torch.dtype:
    tensors = [*module.parameters(), *module.buffers()]
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    return floats[0] if floats else torch.get_default_dtype()
