"""Where the error entered: the model run in the run's dtype/device and in float64 on the same
inputs, with every module of its tree watched (containers too: precision can be lost in a
module's own forward between its children; each forward is wrapped, not hooked, see capture).

For each call of each module (first tensor output; N items):
  in_err   relerr of its floating inputs against the float64 run's (what it was handed)
  out_err  relerr of its output against the float64 run's
  own_err  relerr of its output against the float64 module called on the run's own inputs
           (widened): the error this module made, with its inputs' error taken out
  expected what the dtype's rounding explains for it: BASE * u * sqrt(k) for each reduction
           of length k computed inside it (Linear: in_features, convolutions: C/groups * kh *
           kw, norms: the normalised size, attention: the embedding), plus, for a container,
           4x the own errors of the children it called (their error passing through it)
A module is flagged when own_err > expected; the cause is the smallest flagged module (no
flagged module inside it) with the largest own_err / expected, with the kernel choice in
force when it ran (autocast, TF32 for matmul/cuDNN, the SDPA backends enabled).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from scalelab.oracle.check import relative_error

BASE = 8.0  # rounding budget per reduction, in units of u * sqrt(length)
APRIORI = 2.0  # the whole model's a-priori bound, in units of u * sqrt(sum of k)
GROWTH = 4.0  # a child's own error may grow this much passing through its container
EXPLAIN_ITEMS = 4  # items explained: per-module errors are norms, a few items suffice


@dataclass
class ModuleError:
    module: str  # path in the model ("" is the model itself)
    kind: str  # class name
    call: int  # which call of the module (0: the first)
    in_err: float
    out_err: float
    own_err: float
    expected: float
    kernel: str  # the kernel choice in force there ("" when none is known)

    @property
    def ratio(self) -> float:
        return self.own_err / self.expected if self.expected > 0 else math.inf


@dataclass
class Explanation:
    rows: list[ModuleError]
    cause: ModuleError | None
    unit_roundoff: float
    notes: list[str] = field(default_factory=list)  # e.g. one process vs the split

    def table(self):
        """The rows as a pandas DataFrame (ratio = own_err / expected; flagged: above 1)."""
        import pandas as pd

        df = pd.DataFrame([asdict(r) for r in self.rows])
        if not df.empty:
            df["ratio"] = [r.ratio for r in self.rows]
            df["flagged"] = df["ratio"] > 1
        return df

    def to_record(self) -> dict[str, Any]:
        return {
            "cause": None if self.cause is None else asdict(self.cause),
            "unit_roundoff": self.unit_roundoff,
            "modules": [asdict(r) for r in self.rows],
            "notes": self.notes,
        }

    def lines(self, top: int = 6) -> list[str]:
        """A few lines for the terminal: the cause, then the worst modules."""
        out = [f"  explain: {cause_line(self.cause)}"]
        out += [f"  explain: {n}" for n in self.notes]
        worst = sorted(self.rows, key=lambda r: -r.ratio)[:top]
        out.append("    module                          own err  expected   in err  out err")
        for r in worst:
            name = (r.module or "(model)") + (f"#{r.call}" if r.call else "")
            out.append(
                f"    {name[:30]:<30} {r.own_err:9.1e} {r.expected:9.1e} {r.in_err:8.1e} "
                f"{r.out_err:8.1e}{'  ' + r.kernel if r.kernel else ''}"
            )
        return out


def cause_line(cause: ModuleError | None) -> str:
    if cause is None:
        return "no module's own error exceeds what the dtype's rounding explains"
    where = cause.module or "the model's own forward"
    kernel = f" [{cause.kernel}]" if cause.kernel else ""
    return (
        f"the error enters at {where} ({cause.kind}){kernel}: its own error "
        f"{cause.own_err:.1e} is {cause.ratio:.0f}x what rounding explains "
        f"({cause.expected:.1e}); its inputs carried {cause.in_err:.1e}"
    )


# --- capture ---------------------------------------------------------------------------------
@dataclass
class _Call:
    args: tuple
    kwargs: dict
    output: torch.Tensor
    kernel: str


def _first_tensor(out: Any) -> torch.Tensor | None:
    if torch.is_tensor(out):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if torch.is_tensor(o)), None)
    return None


def _copy(value: Any) -> Any:
    """A detached copy of the tensors in value (an in-place child would change them later)."""
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def capture(
    model: nn.Module, x: torch.Tensor, context: Callable[[], AbstractContextManager] = nullcontext
) -> dict[str, list[_Call]]:
    """module path -> its calls (inputs, first tensor output, kernel in force), in call order.
    Each module's forward is wrapped on the instance, not hooked: torch's fused paths (the
    TransformerEncoderLayer fast path in eval) turn off when a module carries hooks, and the
    explanation must see the kernels the run used. Inputs are copied before the call,
    outputs right after it (a later ReLU(inplace=True) would change them)."""
    calls: dict[str, list[_Call]] = {}
    saved = []
    for name, module in model.named_modules():
        saved.append((module, module.__dict__.get("forward")))
        module.forward = _recorder(name, module, module.forward, calls)
    try:
        with torch.no_grad(), context():
            model(x)
    finally:
        for module, own in saved:
            del module.forward
            if own is not None:
                module.forward = own
    return calls


def _recorder(name: str, module: nn.Module, forward: Callable, calls: dict) -> Callable:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        before = (_copy(args), _copy(kwargs))
        out = forward(*args, **kwargs)
        first = _first_tensor(out)
        if first is not None:
            kernel = kernel_choice(module, first, _first_tensor(args))
            calls.setdefault(name, []).append(_Call(*before, _copy(first), kernel))
        return out

    return recorded


def kernel_choice(module: nn.Module, out: torch.Tensor, x: torch.Tensor | None) -> str:
    """The kernel choice in force for this module's call, where one is known: autocast, TF32,
    the SDPA backends, or an output narrower than its input (computed in that dtype)."""
    device, parts = out.device, []
    narrow = x is not None and x.is_floating_point() and out.is_floating_point()
    if narrow and torch.finfo(out.dtype).eps > torch.finfo(x.dtype).eps:
        parts.append(f"computes in {str(out.dtype).removeprefix('torch.')}")
    if torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
        parts.append(f"autocast {str(dtype).removeprefix('torch.')}")
    if device.type == "cuda":
        matmul = isinstance(module, nn.Linear | nn.MultiheadAttention | nn.Bilinear)
        if matmul and torch.backends.cuda.matmul.allow_tf32:
            parts.append("TF32 matmul")
        if isinstance(module, nn.modules.conv._ConvNd) and torch.backends.cudnn.allow_tf32:
            parts.append("TF32 cuDNN")
        if isinstance(module, nn.MultiheadAttention | nn.TransformerEncoderLayer):
            parts.append("SDPA " + sdpa_backends())
    try:  # "high"/"medium": TF32 or bf16 passes (torch refuses when settings were mixed)
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:
        precision = "highest"
    matmul = nn.Linear | nn.Bilinear | nn.MultiheadAttention | nn.modules.conv._ConvNd
    if out.dtype == torch.float32 and precision != "highest" and isinstance(module, matmul):
        parts.append(f"float32 matmul precision {precision}")
    return ", ".join(parts)


def sdpa_backends() -> str:
    """The scaled-dot-product-attention backends enabled (torch picks the first that fits)."""
    cuda = torch.backends.cuda
    on = [
        name
        for name, enabled in (
            ("cudnn", getattr(cuda, "cudnn_sdp_enabled", lambda: False)()),
            ("flash", cuda.flash_sdp_enabled()),
            ("mem-efficient", cuda.mem_efficient_sdp_enabled()),
            ("math", cuda.math_sdp_enabled()),
        )
        if enabled
    ]
    return "/".join(on) if on else "none"


# --- compare ---------------------------------------------------------------------------------
def _widen(value: Any) -> Any:
    """Floating tensors to float64 on the CPU (ints kept), through tuples, lists and dicts."""
    if torch.is_tensor(value):
        value = value.detach().cpu()
        return value.double() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_widen(v) for v in value)
    if isinstance(value, dict):
        return {k: _widen(v) for k, v in value.items()}
    return value


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _widen(a), _widen(b)
    if a.shape != b.shape or not a.is_floating_point():
        return 0.0 if a.shape == b.shape and torch.equal(a, b) else math.nan
    return relative_error(a.numpy(), b.numpy())


def _input_err(run: _Call, ref: _Call) -> float:
    pairs = [
        (a, b)
        for a, b in zip(run.args, ref.args)
        if torch.is_tensor(a) and torch.is_tensor(b) and a.is_floating_point()
    ]
    errs = [_err(a, b) for a, b in pairs]
    return max(errs) if errs else 0.0


def reduction_length(module: nn.Module) -> int:
    """Terms summed per output of a module's own computation (1: none known)."""
    if isinstance(module, nn.Linear | nn.Bilinear):
        return module.in_features
    if isinstance(module, nn.modules.conv._ConvNd):
        return module.in_channels // module.groups * math.prod(module.kernel_size)
    if isinstance(module, nn.LayerNorm):
        return math.prod(module.normalized_shape)
    if isinstance(module, nn.GroupNorm):
        return module.num_channels // module.num_groups
    if isinstance(module, nn.MultiheadAttention):
        return module.embed_dim
    return 1


def _budgets(model: nn.Module, captured: set[str], u: float) -> dict[str, float]:
    """module path -> BASE * u * sqrt(k) over the reductions computed inside its calls
    themselves: its own, and those of leaves whose hooks never fired (their work done in its
    forward: a fused fast path, a functional call on a child's weights)."""
    budget = {n: BASE * u * math.sqrt(reduction_length(m)) for n, m in model.named_modules()}
    for name, m in model.named_modules():
        if name in captured or list(m.children()):
            continue
        owner = name
        while owner and owner not in captured:
            owner = owner.rpartition(".")[0]
        if owner in budget:
            budget[owner] += BASE * u * math.sqrt(reduction_length(m))
    return budget


def _children(name: str, names: set[str]) -> list[str]:
    """The captured modules directly inside name (nearest captured descendants)."""
    prefix = f"{name}." if name else ""
    inside = [n for n in names if n != name and n.startswith(prefix)]
    return [n for n in inside if not any(n.startswith(f"{o}.") for o in inside if o != n)]


def explain(
    model: nn.Module,
    model64: nn.Module,
    x: torch.Tensor,
    x64: torch.Tensor,
    u: float,
    context: Callable[[], AbstractContextManager] = nullcontext,
) -> Explanation:
    """model (the run's dtype/device) and model64 (the same weights in float64 on the CPU),
    both in eval mode, on the same inputs (x in the run's form, x64 widened): every module's
    errors and the module where the error entered. u: the run's unit roundoff."""
    run = capture(model, x, context)
    ref = capture(model64, x64)
    modules = dict(model64.named_modules())
    names = {n for n in run if n in ref and len(run[n]) == len(ref[n])}
    budget = _budgets(model, names, u)
    own: dict[tuple[str, int], float] = {}
    rows = []
    for name in sorted(names, key=lambda n: (-_depth(n), n)):  # innermost first
        kids = _children(name, names)
        for i, (r, f) in enumerate(zip(run[name], ref[name])):
            own[name, i] = _own_error(modules[name], r, f)
            passed = sum(own.get((k, j), 0.0) for k in kids for j in range(len(run[k])))
            rows.append(
                ModuleError(
                    module=name,
                    kind=type(modules[name]).__name__,
                    call=i,
                    in_err=_input_err(r, f),
                    out_err=_err(r.output, f.output),
                    own_err=own[name, i],
                    expected=budget[name] + GROWTH * passed,
                    kernel=_fused(modules[name], name, names, r.kernel),
                )
            )
    rows.sort(key=lambda r: (_depth(r.module), r.module, r.call))
    return Explanation(rows, _cause(rows), u)


def _fused(module: nn.Module, name: str, names: set[str], kernel: str) -> str:
    """kernel, plus torch's fused encoder path when a TransformerEncoderLayer ran without
    calling its children (eval mode: torch._transformer_encoder_layer_fwd, native attention)."""
    layer = nn.TransformerEncoderLayer | nn.TransformerDecoderLayer
    attn = f"{name}.self_attn" if name else "self_attn"
    if not isinstance(module, layer) or attn in names:
        return kernel
    return ", ".join(p for p in (kernel, "fused fast path (children not called)") if p)


def _depth(name: str) -> int:
    return name.count(".") + 1 if name else 0


def _own_error(module64: nn.Module, run: _Call, ref: _Call) -> float:
    """relerr of the run's output against the float64 module called on the run's inputs."""
    with torch.no_grad():
        try:
            local = module64(*_widen(run.args), **_widen(run.kwargs))
        except Exception:  # a module that cannot be called on its own: its error as a whole
            return _err(run.output, ref.output)
    first = _first_tensor(local)
    return math.nan if first is None else _err(run.output, first)


def _cause(rows: list[ModuleError]) -> ModuleError | None:
    """The smallest flagged module (none flagged inside it), the worst such by ratio."""
    flagged = [r for r in rows if r.ratio > 1 and math.isfinite(r.own_err)]
    inner = [
        r
        for r in flagged
        if not any(o.module.startswith(f"{r.module}.") or (o.module and not r.module)
                   for o in flagged if o is not r)
    ]  # fmt: skip
    return max(inner, key=lambda r: r.ratio) if inner else None


def a_priori(model: nn.Module, u: float) -> float:
    """A relerr bound from the dtype's rounding alone: APRIORI * u * sqrt(sum of k) over every
    leaf module's reduction of length k (1 for element-wise ones): independent roundings add
    in quadrature, so depth and width both enter. AlexNet in fp32 gives 2e-5, about the fixed
    fp32 tolerance (calibrated on it); small models stay under that floor."""
    leaves = [m for m in model.modules() if not list(m.children())]
    return APRIORI * u * math.sqrt(sum(reduction_length(m) for m in leaves))


def explanation_lines(stored: dict[str, Any] | None) -> list[str]:
    """The summary's lines for a record's `explain` (to_record's dict); none without one."""
    if not stored:
        return []
    cause = stored.get("cause")
    rows = [ModuleError(**m) for m in stored.get("modules", [])]
    found = None if cause is None else ModuleError(**cause)
    return Explanation(rows, found, stored["unit_roundoff"], stored.get("notes", [])).lines()
