"""One model per strategy, registered in MODELS by the strategy's name; importing this package
registers them all."""

from scalelab.predict.models import (  # noqa: F401
    ddp,
    fsdp,
    model_parallel,
    pipeline,
    spatial,
    split,
)
from scalelab.predict.models.base import MODELS, Context, model_for  # noqa: F401
