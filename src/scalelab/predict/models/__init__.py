"""One model per strategy, registered in MODELS by the strategy's name; importing this package
registers them all."""

from scalelab.predict.models import ddp, model_parallel, pipeline, spatial, split  # noqa: F401
from scalelab.predict.models.base import MODELS, Context, model_for  # noqa: F401
