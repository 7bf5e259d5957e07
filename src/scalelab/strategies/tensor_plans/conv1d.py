"""transformers' Conv1D (y = x @ W + b, W stored (in, out), GPT-2's c_attn/c_proj/c_fc) sharded
as the Linear it is. torch's ColwiseParallel/RowwiseParallel accept nn.Linear and nn.Embedding
only, and shard a Linear's (out, in) weight; a Conv1D's placements are the transposes:
column-wise W Shard(1), b Shard(0); row-wise W Shard(0), b replicated. Inputs and outputs are
handled as torch's styles do (same layouts, same local outputs).

Inside the forward the parameters and the input are DTensors, so Conv1D's own
`x.size()[:-1] + (self.nf,)` reads global shapes and needs no attribute changed.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from scalelab.strategies.tensor_plans.attention import is_conv1d


def _distribute_conv1d(style, module: nn.Module, mesh, placements: dict[str, object]):
    """distribute_module with the Conv1D's parameters placed as given, inputs and outputs as
    the torch style it extends handles them."""

    def partition(_name: str, m: nn.Module, mesh) -> None:
        kw = {"src_data_rank": style.src_data_rank} if hasattr(style, "src_data_rank") else {}
        for name, place in placements.items():
            p = getattr(m, name, None)
            if p is not None:
                dist = distribute_tensor(p, mesh, [place], **kw)
                m.register_parameter(name, nn.Parameter(dist, requires_grad=p.requires_grad))

    inp = partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts)
    out = partial(style._prepare_output_fn, style.output_layouts, style.use_local_output)
    return distribute_module(module, mesh, partition, inp, out)


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel that also shards a Conv1D: its output features, W's dim 1."""

    def _apply(self, module: nn.Module, device_mesh):
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return _distribute_conv1d(self, module, device_mesh, {"weight": Shard(1), "bias": Shard(0)})


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel that also shards a Conv1D: its input features, W's dim 0."""

    def _apply(self, module: nn.Module, device_mesh):
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        placements = {"weight": Shard(0), "bias": Replicate()}
        return _distribute_conv1d(self, module, device_mesh, placements)


def for_module(style: ParallelStyle, module: nn.Module) -> ParallelStyle:
    """The style as a Conv1D takes it (the same layouts), or style itself."""
    if not is_conv1d(module) or isinstance(style, (Conv1DColwise, Conv1DRowwise)):
        return style
    if isinstance(style, ColwiseParallel):
        cls = Conv1DColwise
    elif isinstance(style, RowwiseParallel):
        cls = Conv1DRowwise
    else:
        return style
    new = cls.__new__(cls)
    new.__dict__.update(style.__dict__)
    return new
