"""AlexNet's fast forward: uint8 pixels in, logits out, activations bf16 channels_last.

    c1    pixels (N, 3, S, S) uint8 -> conv 11x11/4, no bias     (N, 96, 55, 55)
    epi1  bias + ReLU + LRN + max-pool 3/2, one pass             (N, 96, 27, 27)
    c2    conv 5x5 pad 2, no bias; epi2 as epi1                  (N, 256, 13, 13)
    c3/c4 conv 3x3; epi3/epi4 bias + ReLU                        (N, 384, 13, 13)
    c5    conv 3x3; epi5 bias + ReLU + max-pool 3/2              (N, 256, 6, 6)
    fc    fc6 (columns permuted to the NHWC flatten) + ReLU, fc7 + ReLU, fc8

The convolutions are cuDNN's (NHWC, bf16 in, fp32 accumulation); their epilogues are one Triton
pass each instead of PyTorch's bias add, ReLU, ~6-kernel LRN and max-pool. c1 is offered three
ways: directly (3 input channels, a poor fit for tensor cores) and as space-to-depth, a 3x3
stride-1 conv over 4x4 pixel blocks with 48 channels (19% more FLOPs, all on tensor cores),
its input made by a torch copy or by one Triton pass (kernels/space_to_depth.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from scalelab.errors import UsageError
from scalelab.fast import reference
from scalelab.fast.registry import FAST_PATHS, Candidate, Plan, Stage, dense_head_stage
from scalelab.layout.trunk import dense_head
from scalelab.workloads.alexnet import LRN_ALPHA, LRN_BETA, LRN_K, LRN_SIZE
from scalelab.workloads.base import Workload
from scalelab.workloads.layers import Layer, layer_shapes

BF16 = torch.bfloat16
CL = torch.channels_last
LRN = (LRN_SIZE, LRN_ALPHA, LRN_BETA, LRN_K)
S2D = 4  # c1's stride: space-to-depth block size


def s2d_weight(w: torch.Tensor, block: int = S2D) -> torch.Tensor:
    """(O, C, R, R) stride-`block` kernel -> (O, block^2 C, Rb, Rb) stride-1 kernel, Rb = ceil(R/b).

    Tap (i, j) = (block*ky + dy, block*kx + dx) of channel c moves to channel
    (dy*block + dx)*C + c at tap (ky, kx); taps past R are zero.
    """
    o, c, r, _ = w.shape
    rb = -(-r // block)
    wp = w.new_zeros(o, c, rb * block, rb * block)
    wp[:, :, :r, :r] = w
    wp = wp.view(o, c, rb, block, rb, block)  # [o, c, ky, dy, kx, dx]
    return wp.permute(0, 3, 5, 1, 2, 4).reshape(o, block * block * c, rb, rb)


def s2d_input(x: torch.Tensor, out_size: int, rb: int, block: int = S2D) -> torch.Tensor:
    """uint8 (N, C, H, W) -> bf16 (N, block^2 C, Hb, Hb) channels_last, Hb = out_size + rb - 1,
    pixel values 0..255 (exact in bf16; the 1/255 is folded into the weights).

    Rows past 4*Hb are never read by an output; missing rows are zero padding (only ever
    multiplied by the zero taps of s2d_weight). The permuted view and the conversion are one
    strided copy (kernels/space_to_depth.py does the same in one coalesced pass).
    """
    n, c, h, w = x.shape
    hb = out_size + rb - 1
    rows = hb * block
    x = F.pad(x[:, :, :rows, :rows], (0, max(0, rows - w), 0, max(0, rows - h)))
    x6 = x.reshape(n, c, hb, block, hb, block).permute(0, 2, 4, 3, 5, 1)  # (N, Hb, Hb, dy, dx, C)
    out = torch.empty(n, hb, hb, block, block, c, device=x.device, dtype=BF16)
    out.copy_(x6)
    return out.view(n, hb, hb, block * block * c).permute(0, 3, 1, 2)


def _c1_stage(conv: nn.Conv2d, out_size: int) -> Stage:
    w = conv.weight.detach()
    w_cl = w.to(BF16).contiguous(memory_format=CL)
    ws = (s2d_weight(w) / 255).to(BF16).contiguous(memory_format=CL)  # pixels stay 0..255
    rb = ws.shape[-1]

    def direct(x: torch.Tensor) -> torch.Tensor:
        xp = (x.float() / 255).to(BF16).contiguous(memory_format=CL)  # prepare(), in bf16
        return F.conv2d(xp, w_cl, None, stride=conv.stride)

    def space_to_depth(x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(s2d_input(x, out_size, rb), ws, None)

    def triton_space_to_depth(x: torch.Tensor) -> torch.Tensor:
        from scalelab.fast.kernels.space_to_depth import space_to_depth as s2d

        return F.conv2d(s2d(x, out_size + rb - 1, S2D), ws, None)

    return Stage(
        "c1",
        [
            Candidate("cudnn-nhwc", direct),
            Candidate("cudnn-s2d", space_to_depth),
            Candidate("triton-s2d", triton_space_to_depth, "space_to_depth"),
        ],
    )


def _conv_stage(name: str, conv: nn.Conv2d) -> Stage:
    w_cl = conv.weight.detach().to(BF16).contiguous(memory_format=CL)
    fn = functools.partial(
        F.conv2d, weight=w_cl, bias=None, stride=conv.stride, padding=conv.padding
    )
    return Stage(name, [Candidate("cudnn-nhwc", lambda x: fn(x))])


def _epilogue_stage(
    name: str, bias: torch.Tensor, lrn: bool, pool: tuple[int, int] | None
) -> Stage:
    b32 = bias.detach().float().contiguous()
    spec = dict(lrn=LRN if lrn else None, pool=pool)
    torch_fn = functools.partial(reference.epilogue2d, bias=b32, **spec)
    kernel = "lrn_pool2d" if lrn else "epilogue2d"
    triton_fn = functools.partial(_triton_epilogue, bias=b32, **spec)
    return Stage(name, [Candidate("torch", torch_fn), Candidate("triton", triton_fn, kernel)])


def _triton_epilogue(y, bias, lrn, pool):
    """bias + ReLU (+ LRN) (+ max-pool): LRN needs every channel of a pixel in one program,
    so it has its own kernel."""
    if lrn is not None:
        from scalelab.fast.kernels.lrn_pool2d import lrn_pool2d

        return lrn_pool2d(y, bias, lrn, pool)
    from scalelab.fast.kernels.epilogue2d import epilogue2d

    return epilogue2d(y, bias, pool)


def _fc_stage(linears: list[nn.Linear], channels: int) -> Stage:
    w6 = linears[0].weight.detach()
    out, flat = w6.shape
    side = round((flat // channels) ** 0.5)
    # The model flattens (C, H, W); our last trunk output is NHWC, so reorder fc6's columns.
    w6p = w6.view(out, -1, side, side).permute(0, 2, 3, 1).reshape(out, flat)
    params = [(w6p, linears[0].bias)] + [(m.weight, m.bias) for m in linears[1:]]
    # NHWC storage: the flatten is a view.
    flatten = lambda x: x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)  # noqa: E731
    return dense_head_stage(params, flatten, BF16)


def conv_groups(layers: list[Layer]) -> tuple[list[list[Layer]], list[Layer]]:
    """The trunk as groups led by a convolution (conv, then what its epilogue fuses: ReLU,
    LRN, max-pool, in either order of ReLU and pool), and the layers after the trunk."""
    groups: list[list[Layer]] = []
    for i, layer in enumerate(layers):
        if layer.reach == "global":
            return groups, layers[i:]
        if layer.kind == "conv":
            groups.append([layer])
        elif groups and layer.kind in ("relu", "lrn", "maxpool"):
            groups[-1].append(layer)
        elif layer.kind != "cast":
            raise UsageError(f"fast path: layer {layer.name} ({layer.kind}) has no fused form")
    return groups, []


def _group_stages(i: int, group: list[Layer], c1_out: int) -> list[Stage]:
    """conv i + its fused epilogue (bias + ReLU (+ LRN) (+ max-pool)); the first conv as
    c1's two candidates."""
    conv = group[0].module
    pools = [(x.kernel, x.stride) for x in group if x.kind == "maxpool"]
    lrn = any(x.kind == "lrn" for x in group)
    first = _c1_stage(conv, c1_out) if i == 1 else _conv_stage(group[0].name, conv)
    return [first, _epilogue_stage(f"epi{i}", conv.bias, lrn, pools[0] if pools else None)]


@FAST_PATHS.register("alexnet", "cuDNN NHWC convs; bias+ReLU+LRN+max-pool fused epilogues")
def build(workload: Workload, model: nn.Module, device: torch.device) -> Plan:
    """The stage list from the workload's layers: per conv group a conv and an epilogue stage
    (c1 .. c5, epi1 .. epi5), then the dense head (fc6 .. fc8)."""
    groups, rest = conv_groups(workload.layers(model))
    meta = workload.layers(workload.meta_model())
    shapes = dict(zip((x.name for x in meta), layer_shapes(meta, workload.item_shape())))
    c1_out = shapes[groups[0][0].name][1][1]
    stages = [st for i, g in enumerate(groups, 1) for st in _group_stages(i, g, c1_out)]
    linears = [lin for lin, _ in dense_head(rest) or []]
    stages.append(_fc_stage(linears, shapes[groups[-1][-1].name][1][0]))
    return Plan(stages)
