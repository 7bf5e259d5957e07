"""The fused operations of the fast path written with plain torch ops, on any device.

Each function is the specification its Triton kernel is tested against, the CPU path, and the
fallback when a kernel is unavailable or fails on a GPU. Activations are channels last:
1-D maps (N, L, C), 2-D maps (N, H, W, C) as a channels_last (N, C, H, W) tensor's storage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_table(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """conv1 weight (C, V, K) -> T (K, V + 1, C), T[k, v] = W[:, v, k], row V zero (padding)."""
    c, v, k = weight.shape
    table = torch.zeros(k, v + 1, c, device=weight.device, dtype=dtype)
    table[:, :v] = weight.permute(2, 1, 0).to(dtype)
    return table


def block1(
    idx: torch.Tensor,
    table: torch.Tensor,
    bias: torch.Tensor,
    gamma_t: torch.Tensor,
    beta_t: torch.Tensor,
    eps: float,
    pool: int,
) -> torch.Tensor:
    """Indices (N, L_IN) -> (N, L_RAW // pool, C): gather-conv1 + bias, LayerNorm, ReLU, pool.

    Computed in fp32 from the same (bf16) table the kernel reads, output in the table's dtype.
    """
    k, v1, c = table.shape
    l_raw = idx.shape[1] - k + 1
    v = idx.long().clamp(max=v1 - 1)  # (N, L_IN)
    x = bias.float().view(1, 1, c).expand(idx.shape[0], l_raw, c).clone()  # (N, L_RAW, C)
    for j in range(k):
        x += table[j].float()[v[:, j : j + l_raw]]
    x = F.layer_norm(x, (l_raw, c), gamma_t.float(), beta_t.float(), eps)
    return pool_relu_1d(x, pool).to(table.dtype)


def pool_relu_1d(x: torch.Tensor, pool: int) -> torch.Tensor:
    """(N, L, C) -> (N, L // pool, C): max over windows of `pool` positions, then ReLU."""
    if pool > 1:
        x = F.max_pool1d(x.transpose(1, 2), pool).transpose(1, 2)
    return torch.relu(x)


def conv1d(
    x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor, pool: int, relu: bool
) -> torch.Tensor:
    """Channels-last conv1d + bias (+ max-pool) (+ ReLU): x (N, L, Ci), w_t (K, Ci, Co).

    Returns (N, (L - K + 1) // pool, Co) in x's dtype; fp32 accumulation inside cuDNN/cuBLAS.
    """
    w = w_t.permute(2, 1, 0)  # (Co, Ci, K)
    y = F.conv1d(x.transpose(1, 2), w, bias.to(x.dtype))  # (N, Co, L_out)
    if pool > 1:
        y = F.max_pool1d(y, pool)
    if relu:
        y = torch.relu(y)
    return y.transpose(1, 2)


def layernorm_relu_pool(
    x: torch.Tensor, gamma_t: torch.Tensor, beta_t: torch.Tensor, eps: float, pool: int
) -> torch.Tensor:
    """(N, L, C) -> (N, L // pool, C): LayerNorm over the whole (L, C) map, ReLU, pool."""
    y = F.layer_norm(x.float(), tuple(x.shape[1:]), gamma_t.float(), beta_t.float(), eps)
    return pool_relu_1d(y, pool).to(x.dtype)


def epilogue2d(
    y: torch.Tensor,
    bias: torch.Tensor,
    lrn: tuple[int, float, float, float] | None,
    pool: tuple[int, int] | None,
) -> torch.Tensor:
    """Conv output (N, C, H, W) without bias -> ReLU(y + bias), then LRN, then max-pool.

    lrn = (size, alpha, beta, k) as nn.LocalResponseNorm; pool = (kernel, stride). Computed in
    fp32, returned channels_last in y's dtype.
    """
    z = torch.relu(y.float() + bias.float().view(1, -1, 1, 1))
    if lrn is not None:
        z = F.local_response_norm(z, *lrn)
    if pool is not None:
        z = F.max_pool2d(z, *pool)
    return z.to(y.dtype).contiguous(memory_format=torch.channels_last)
