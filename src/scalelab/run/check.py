"""The inference check (`--check`): the bound a run is held to, derived for its model and
saying how, and, when the check fails or `--explain` asks, where the error entered.

The bound (record: `tolerance`, `tolerance_basis`):
  --tolerance X   X, as given
  one process     max(the dtype's fixed tolerance (precision.py, the floor), the a-priori
                  bound APRIORI * u * sqrt(sum over leaf modules of their reduction length))
  a strategy      max(the floor, FACTOR x the relerr of the plain one-process run in the
                  same dtype and device on the same inputs): the split must not lose what one
                  process keeps. When that one process itself exceeds its own bound, the
                  dtype (or a kernel) lost the precision, not the split: the strategy is held
                  to the one-process bound and fails with it.
Training checks are not done here (the training check reads its own bound).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from scalelab.oracle import explain as ex
from scalelab.oracle.check import CheckResult, check_output, relative_error
from scalelab.precision import PRECISIONS, Precision, unit_roundoff
from scalelab.strategies import Strategy
from scalelab.strategies.torch_base import TorchStrategy
from scalelab.workloads import Inputs, Workload

_log = logging.getLogger("scalelab.run")
FACTOR = 10.0  # a strategy may be this much worse than one process in the same dtype


@dataclass
class Bound:
    value: float
    basis: str


@dataclass
class InferenceCheck:
    result: CheckResult
    fields: dict[str, Any]  # for the record: bound's basis, one-process relerr, explanation
    lines: list[str]  # for the summary: the explanation, briefly


def digest_tolerance(precision: Precision) -> float:
    """fp64 and fp32 runs share the fp32 digest grid, so serial and local digests compare."""
    return max(precision.tolerance, PRECISIONS["fp32"].tolerance)


def derive_bound(
    given: float | None, floor: float, a_priori: float, single: float | None, dtype: str
) -> Bound:
    """The bound and its basis (module docstring)."""
    if given is not None:
        return Bound(given, "--tolerance")
    own = Bound(floor, f"the {dtype} tolerance {floor:.0e}")
    if a_priori > floor:
        how = f"a-priori: {ex.APRIORI:g} u sqrt(sum of reduction lengths), u of {dtype}"
        own = Bound(a_priori, how)
    if single is None:
        return own
    if single > own.value:
        return Bound(own.value, f"{own.basis} (one process in {dtype} already exceeds it)")
    split = FACTOR * single
    if split > floor:
        return Bound(split, f"{FACTOR:g}x one process in {dtype} ({single:.1e})")
    return Bound(floor, f"the {dtype} tolerance {floor:.0e} (>= {FACTOR:g}x one process)")


def inference_check(
    workload: Workload,
    strategy: Strategy,
    model: torch.nn.Module,
    out: np.ndarray,
    inputs: Inputs,
    params: dict[str, np.ndarray],
    ref: np.ndarray,
) -> InferenceCheck:
    """The run's output against the float64 reference ref, held to the derived bound;
    explained when it fails or --explain asks. model: the run's (its structure sets the
    a-priori bound); fresh copies are built only for a comparison. Root rank only."""
    cfg, precision = strategy.cfg, strategy.precision
    if not isinstance(strategy, TorchStrategy):  # serial: the float64 NumPy forward itself
        bound = derive_bound(cfg.tolerance, precision.tolerance, 0.0, None, precision.name)
        result = check_output(out, ref, bound.value, digest_tolerance(precision))
        return InferenceCheck(result, {"tolerance_basis": bound.basis}, [])
    u = unit_roundoff(precision, strategy.device.type)
    built: list[torch.nn.Module] = []

    def pair() -> list[torch.nn.Module]:  # (run-dtype copy, float64 copy), built on first use
        built[:] = built or models(workload, params, strategy)
        return built

    single = None
    if not strategy.plain_local or cfg.fast:  # the run was not the plain one-process run
        single = _or_none(lambda: relative_error(one_process(workload, strategy, pair()[0],
                                                             inputs.x), ref))  # fmt: skip
    prior = ex.a_priori(model, u)
    bound = derive_bound(cfg.tolerance, precision.tolerance, prior, single, precision.name)
    result = check_output(out, ref, bound.value, digest_tolerance(precision))
    fields = {"tolerance_basis": bound.basis, "tolerance_floor": precision.tolerance,
              "a_priori_bound": prior, "one_process_relerr": single}  # fmt: skip
    lines = []
    if cfg.explain or not result.passed:
        why = _or_none(lambda: explain_run(workload, strategy, *pair(), inputs.x, u))
        if why is not None:
            why.notes += split_or_dtype(result.relerr, single, bound, precision.name)
            fields["explain"] = why.to_record()
            lines = why.lines()
    return InferenceCheck(result, fields, lines)


def _or_none(work):
    """work(), or None when the model does not fit one device in one process (a pipeline's
    reason to exist) or the comparison cannot run: the bound then falls back to one
    process's own, and nothing is explained. The run's own verdict never depends on it."""
    try:
        return work()
    except (torch.OutOfMemoryError, MemoryError):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _log.warning("check: the one-process comparison does not fit in memory; skipped")
    except Exception as exc:  # noqa: BLE001 (a comparison's failure is not the run's)
        _log.warning(f"check: the one-process comparison failed ({type(exc).__name__}: {exc})")
    return None


def models(
    workload: Workload, params: dict[str, np.ndarray], strategy: TorchStrategy
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model in the run's dtype on the root's device, the same weights in float64 on
    the CPU), both fresh builds in eval mode."""
    model64 = workload.build_model()
    state = {k: torch.from_numpy(np.asarray(v)) for k, v in params.items()}
    model64.load_state_dict(state, strict=False)
    model64 = model64.double().eval()
    run_model = copy.deepcopy(model64).to(strategy.device, strategy.precision.storage)
    return run_model.eval(), model64


def one_process(
    workload: Workload, strategy: TorchStrategy, model: torch.nn.Module, x: torch.Tensor
) -> np.ndarray:
    """The plain one-process forward in the run's dtype and device (the local strategy's)."""
    with torch.inference_mode(), strategy.autocast():
        xin = workload.prepare(x.to(strategy.device)).to(strategy.precision.storage)
        return model(xin).to("cpu", torch.float64).numpy()


def explain_run(
    workload: Workload,
    strategy: TorchStrategy,
    run_model: torch.nn.Module,
    model64: torch.nn.Module,
    x: torch.Tensor,
    u: float,
) -> ex.Explanation:
    """oracle/explain on the first EXPLAIN_ITEMS items, in the run's dtype/device/autocast."""
    x = x[: ex.EXPLAIN_ITEMS]
    xin = workload.prepare(x.to(strategy.device)).to(strategy.precision.storage)
    x64 = workload.prepare(x).to(torch.float64)
    return ex.explain(run_model, model64, xin, x64, u, strategy.autocast)


def split_or_dtype(relerr: float, single: float | None, bound: Bound, dtype: str) -> list[str]:
    """Whether the split or the dtype lost the precision (strategies other than local)."""
    if single is None:
        return []
    if relerr > FACTOR * single and relerr > bound.value:
        return [f"the split lost it: one process in {dtype} gives relerr {single:.1e}, the "
                f"strategy {relerr:.1e}"]  # fmt: skip
    return [f"the dtype lost it, not the split: one process in {dtype} gives relerr "
            f"{single:.1e}, the strategy {relerr:.1e}"]  # fmt: skip
