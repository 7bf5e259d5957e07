"""`local`: torch on one device in one process (the seed's V3 on GPU, or plain CPU torch).

`--amp bf16` autocasts as ddp does (fp32 weights); `--compile` compiles per block
(compile_scope.py). Training on a GPU times its phases by CUDA events (EventTimer, as ddp):
a barrier per phase would leave the GPU idle while the host launches the next phase.
"""

from scalelab.instrument.timer import EventTimer
from scalelab.strategies.base import STRATEGIES
from scalelab.strategies.torch_base import TorchStrategy


@STRATEGIES.register("local", "torch on one device (--device cpu|cuda), inference or training")
class LocalStrategy(TorchStrategy):
    name = "local"
    reads = ("fast", "checkpoint", "compare", "amp", "compile")
    plain_local = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        if self.device.type == "cuda" and cfg.train:
            self.timer = EventTimer(self.device)
