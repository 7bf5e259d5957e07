"""`local`: torch on one device in one process (the seed's V3 on GPU, or plain CPU torch)."""

from scalelab.strategies.base import STRATEGIES
from scalelab.strategies.torch_base import TorchStrategy


@STRATEGIES.register("local", "torch on one device (--device cpu|cuda), inference or training")
class LocalStrategy(TorchStrategy):
    name = "local"
    reads = ("fast", "checkpoint", "compare")
