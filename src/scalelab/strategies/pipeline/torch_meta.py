"""torch's PipelineStage learns the shapes crossing each boundary by running its stage's
module once, the first time a schedule runs (`_forward_metadata_inference`, torch 2.13): on
the first stage on the real micro-batch, on later stages on uninitialised tensors of the
received shapes, in whatever mode the module is in. In training mode that forward updates
BatchNorm's running statistics (with garbage on later stages: NaN seen in a residual block's
running mean) and its batch count, and draws dropout masks: a pass outside the training that
changed the model. `keep_inference_state` restores the stage module's state and the RNG
after that one forward (layout/preserve.kept_state).
"""

from __future__ import annotations

import functools
from typing import Any

from scalelab.layout.preserve import kept_state

_INFER = "_forward_metadata_inference"  # torch 2.13's name; absent elsewhere: nothing to do


def keep_inference_state(stage: Any) -> None:
    """Make this PipelineStage's shape inference leave its module's state as it was."""
    infer = getattr(stage, _INFER, None)
    if infer is None:
        return

    @functools.wraps(infer)
    def kept(*args: Any, **kwargs: Any) -> Any:
        with kept_state([stage.submod]):
            return infer(*args, **kwargs)

    setattr(stage, _INFER, kept)
