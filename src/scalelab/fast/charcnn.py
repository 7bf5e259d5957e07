"""charcnn's fast forward: character indices in, logits out, activations bf16 channels last.

    block1  idx (N, 1014) uint8 -> (N, 336, 256)   gather-conv1 + bias + LayerNorm + ReLU + pool
    conv2   -> (N, 110, 256)                       conv k7 + bias + pool 3 + ReLU
    conv3-5 -> (N, 108 / 106 / 104, 256)           conv k3 + bias + ReLU
    conv6   -> (N, 102, 256)                       conv k3 + bias
    ln6     -> (N, 34, 256)                        LayerNorm + ReLU + pool 3
    fc      -> (N, 4)                              fc1 (columns permuted for the (L, C)
                                                   flatten) + ReLU, fc2 + ReLU, fc3

Each stage offers plain torch (cuDNN on a channels-last view, so no layout copies) and Triton
kernels; pipeline.py keeps the fastest that agrees with torch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from scalelab.fast import reference
from scalelab.fast.kernels import INTERPRET
from scalelab.fast.registry import FAST_PATHS, Candidate, Plan, Stage, dense_head_stage
from scalelab.workloads.base import Workload
from scalelab.workloads.charcnn import CONV_BLOCKS, POOL

BF16 = torch.bfloat16


def conv1d_cudnn(
    x: torch.Tensor, w4: torch.Tensor, bias: torch.Tensor, pool: int, relu: bool
) -> torch.Tensor:
    """x (N, L, Ci) -> (N, L_out // pool, Co) through cuDNN's NHWC convolution.

    x.transpose(1, 2).unsqueeze(2) is (N, Ci, 1, L) with channels_last strides, so cuDNN reads
    the buffer as it is; w4 is the (Co, Ci, 1, K) weight, channels_last.
    """
    y = F.conv2d(x.transpose(1, 2).unsqueeze(2), w4, bias)  # (N, Co, 1, L_out) channels_last
    if pool > 1:
        y = F.max_pool2d(y, (1, pool))
    if relu:
        y = torch.relu_(y)
    return y.squeeze(2).transpose(1, 2)  # (N, L_out // pool, Co), contiguous


def _conv_stage(name: str, conv: nn.Conv1d, pool: int, relu: bool) -> Stage:
    w = conv.weight.detach()
    w4 = w.to(BF16).unsqueeze(2).contiguous(memory_format=torch.channels_last)
    bias = conv.bias.detach()
    torch_fn = functools.partial(conv1d_cudnn, w4=w4, bias=bias.to(BF16), pool=pool, relu=relu)
    cands = [Candidate("cudnn", torch_fn)]
    w_t = w.permute(2, 1, 0).contiguous().to(BF16)  # (K, Ci, Co)
    b32 = bias.float().contiguous()
    for cfg in _conv_configs(pool):
        if cfg.fits(w.shape[1], w.shape[0]):
            fn = functools.partial(_triton_conv, w_t=w_t, bias=b32, pool=pool, relu=relu, cfg=cfg)
            cands.append(Candidate(f"triton-{cfg.label}", fn, kernel="conv1d"))
    return Stage(name, cands)


def _conv_configs(pool: int):
    from scalelab.fast.kernels import conv1d

    if INTERPRET:
        return (conv1d.INTERPRET_CONFIG,)
    return conv1d.GPU_CONFIGS if pool > 1 else conv1d.GPU_CONFIGS_UNPOOLED


def _triton_conv(x, w_t, bias, pool, relu, cfg):
    from scalelab.fast.kernels.conv1d import conv1d

    return conv1d(x, w_t, bias, pool, relu, cfg)


def _block1_stage(workload: Workload, model: nn.Module) -> Stage:
    conv, ln = model.conv1, model.ln1
    w, b = conv.weight.detach(), conv.bias.detach()
    gamma, beta = ln.weight.detach(), ln.bias.detach()  # (C, L_RAW)
    w_b, b_b, g_b, be_b = (t.to(BF16) for t in (w, b, gamma, beta))

    def torch_onehot(idx: torch.Tensor) -> torch.Tensor:
        y = F.conv1d(workload.prepare(idx).to(BF16), w_b, b_b)  # (N, C, L_RAW)
        y = F.layer_norm(y, tuple(gamma.shape), g_b, be_b, ln.eps)
        return F.max_pool1d(torch.relu_(y), POOL).transpose(1, 2).contiguous()

    table = reference.gather_table(w, BF16)  # (K, V + 1, C)
    g_t, be_t = (t.t().contiguous().to(BF16) for t in (gamma, beta))  # (L_RAW, C)
    cands = [Candidate("torch-onehot", torch_onehot)]
    for bc, bt in ((256, 256),) if INTERPRET else ((32, 64), (64, 32)):
        fn = functools.partial(
            _triton_block1,
            table=table,
            bias=b.float(),
            g_t=g_t,
            be_t=be_t,
            eps=ln.eps,
            bc=bc,
            bt=bt,
        )
        cands.append(Candidate(f"triton-gather-c{bc}", fn, kernel="block1"))
    return Stage("block1", cands)


def _triton_block1(idx, table, bias, g_t, be_t, eps, bc, bt):
    from scalelab.fast.kernels.charcnn_block1 import block1

    return block1(idx, table, bias, g_t, be_t, eps, POOL, bc=bc, bt=bt)


def _ln6_stage(ln: nn.LayerNorm) -> Stage:
    g_t, be_t = (t.detach().t().contiguous().to(BF16) for t in (ln.weight, ln.bias))
    torch_fn = functools.partial(
        reference.layernorm_relu_pool, gamma_t=g_t, beta_t=be_t, eps=ln.eps, pool=POOL
    )
    triton_fn = functools.partial(_triton_ln, g_t=g_t, be_t=be_t, eps=ln.eps)
    return Stage("ln6", [Candidate("torch", torch_fn), Candidate("triton", triton_fn, "layernorm")])


def _triton_ln(x, g_t, be_t, eps):
    from scalelab.fast.kernels.layernorm1d import layernorm_relu_pool

    return layernorm_relu_pool(x, g_t, be_t, eps, POOL)


def _fc_stage(model: nn.Module, length: int) -> Stage:
    """fc1's columns reordered from the model's (C, L) flatten to the (L, C) one we hold."""
    w1 = model.fc1.weight.detach()
    hidden, flat = w1.shape
    channels = flat // length
    w1p = w1.view(hidden, channels, length).transpose(1, 2).reshape(hidden, flat)
    params = [(w1p, model.fc1.bias)] + [(m.weight, m.bias) for m in (model.fc2, model.fc3)]
    # (N, L, C) -> (N, L * C), position-major, matching w1p's column order.
    return dense_head_stage(params, lambda x: x.reshape(x.shape[0], -1), BF16)


@FAST_PATHS.register("charcnn", "gather-conv1 + LayerNorm/ReLU/pool fused; fused conv epilogues")
def build(workload: Workload, model: nn.Module, device: torch.device) -> Plan:
    stages = [_block1_stage(workload, model)]
    for conv, _, _, norm, pool in CONV_BLOCKS[1:]:
        layer = getattr(model, conv)
        if norm is None:
            stages.append(_conv_stage(conv, layer, POOL if pool else 1, relu=True))
        else:  # conv6: LayerNorm needs the whole map first
            stages.append(_conv_stage(conv, layer, 1, relu=False))
            stages.append(_ln6_stage(getattr(model, norm)))
    final_length = model.ln6.weight.shape[1] // POOL
    stages.append(_fc_stage(model, final_length))
    return Plan(stages)
