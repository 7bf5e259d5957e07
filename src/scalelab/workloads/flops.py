"""FLOP counting that never stops a run: torch.utils.flop_counter's formulas, guarded.

torch's counter asserts on some shapes its own kernels take: torch 2.11's `sdpa_flop_count`
raises on grouped-query attention (key/value with fewer heads than the query: "query/key/value
shapes are incompatible"), so an HF Llama failed its shape probe. Here the attention ops are
counted from their shapes by the closed form torch uses (torch's own count where it returns
one), and every other formula that raises counts its op as unknown: 0 FLOPs, the op named in
one warning, and the run goes on.

Attention (q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv)), as torch counts it with
the key/value heads broadcast to Hq and no discount for a causal mask:
forward QK^T + PV = 2 B Hq Tq Tk (D + Dv), i.e. 4 B Hq Tq Tk D;
backward (scores recomputed, dP, dV, dQ, dK) = 2 B Hq Tq Tk (3 D + 2 Dv), i.e. 2.5x forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger(__name__)

# torch's scaled_dot_product_attention kernels (CUDA: flash, efficient, cuDNN; CPU: flash)
SDPA_FORWARD = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_flash_attention_for_cpu")  # fmt: skip
SDPA_BACKWARD = tuple(f"{name}_backward" for name in SDPA_FORWARD)


def sdpa_forward_flops(q: tuple, k: tuple, v: tuple) -> int:
    """QK^T and PV over Hq heads (key/value heads broadcast): 2 B Hq Tq Tk (D + Dv)."""
    b, hq, tq, d = q
    tk, dv = k[2], v[3]
    return 2 * b * hq * tq * tk * (d + dv)


def sdpa_backward_flops(q: tuple, k: tuple, v: tuple) -> int:
    """The scores recomputed, then dP, dV, dQ, dK: 2 B Hq Tq Tk (3 D + 2 Dv)."""
    b, hq, tq, d = q
    tk, dv = k[2], v[3]
    return 2 * b * hq * tq * tk * (3 * d + 2 * dv)


def _sdpa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    try:
        return sdpa_flop_count(query_shape, key_shape, value_shape)
    except AssertionError:  # torch 2.11: grouped-query shapes
        return sdpa_forward_flops(query_shape, key_shape, value_shape)


def _sdpa_backward(grad_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                   **kwargs) -> int:  # fmt: skip
    from torch.utils.flop_counter import sdpa_backward_flop_count

    try:
        return sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape)
    except AssertionError:
        return sdpa_backward_flops(query_shape, key_shape, value_shape)


class GuardedCounter:
    """A FlopCounterMode (`.mode`) whose formulas never raise; `unknown` lists the ops whose
    formula failed (each counted 0), in order, with torch's message."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode, flop_registry, shape_wrapper

        self.unknown: list[tuple[str, str]] = []
        mapping: dict[Any, Callable] = dict(flop_registry)
        for names, formula in ((SDPA_FORWARD, _sdpa_forward), (SDPA_BACKWARD, _sdpa_backward)):
            for name in names:
                op = getattr(torch.ops.aten, name, None)
                if op is not None:
                    mapping[op] = shape_wrapper(formula)
        guarded = {op: self._guard(op, formula) for op, formula in mapping.items()}
        self.mode: FlopCounterMode = FlopCounterMode(display=False, custom_mapping=guarded)

    def _guard(self, op: Any, formula: Callable) -> Callable:
        def count(*args: Any, **kwargs: Any) -> int:
            try:
                return formula(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 (any formula's failure: the op is unknown)
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                self.unknown.append((str(op), why))
                return 0

        count._get_raw = True  # the mapping's formulas take the raw arguments already
        return count

    def warn(self, what: str) -> None:
        """One warning naming the ops torch's counter could not count (none: nothing)."""
        if self.unknown:
            ops = sorted({op for op, _ in self.unknown})
            log.warning(
                "FLOPs of %s: torch's counter failed on %s (%s); counted as 0 FLOPs",
                what, ", ".join(ops), self.unknown[0][1],
            )  # fmt: skip
