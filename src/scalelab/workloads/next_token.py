"""Language models: a user model whose output is (B, T, V) logits for a (B, T) int64 input
learns the next token.

Targets travel with the items: a training item is T + 1 consecutive tokens, the model sees the
first T (x) and is scored on the last T (y: x shifted by one), so y is (N, T) int64 and every
strategy's data path (ddp's shares, mpi-dp's scatter, pipeline micro-batches, tensor's
broadcast, FSDP) moves it along dim 0 exactly as it moves a classifier's (N,) labels. A
pipeline's last stage scores its micro-batch without the input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TASK = "next-token"


def is_lm_output(out: torch.Tensor, shape: tuple[int, ...], int_input: bool) -> bool:
    """A (1, T, V) float output of a (1, T) int64 item: a language model's logits."""
    return (
        int_input
        and len(shape) == 1
        and out.dim() == 3
        and out.is_floating_point()
        and out.shape[1] == shape[0]
    )


def shifted(x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """(N, T) targets: x (N, T) shifted left by one, `last` (N, 1) the token after x."""
    return torch.cat([x[:, 1:], last], dim=1)


def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position: logits (B, T, V), y (B, T)."""
    wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    return F.cross_entropy(wide.reshape(-1, wide.shape[-1]), y.reshape(-1))


def loss_sum(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Summed over items of each item's mean token cross-entropy (held-out scoring: divided by
    the items it is the held-out loss, the same mean as `loss` since every item has T tokens)."""
    wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    per_token = F.cross_entropy(wide.transpose(1, 2), y.to(wide.device), reduction="none")
    return float(per_token.mean(dim=1).sum())
