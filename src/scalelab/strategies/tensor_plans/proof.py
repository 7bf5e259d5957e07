"""Every plan (a user's --tp-plan, the model's declared one, or the derived one) proved before
`scalelab run` launches a rank: the plan is put on the model exactly as each rank puts it
(derived.parallelize: the same swaps, row orders, attributes and ParallelStyles), with the N
tensor ranks as N threads of this process over torch's threaded process group (real DTensor
collectives between threads), and each rank's forward of two items in float64 is compared
with the unsharded module's. A forward that fails, or disagrees (relerr > 1e-9), is refused
in one line naming the module where it went wrong and the attributes the plan set on it.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import torch
import torch.distributed as dist
from torch import nn

from scalelab.comm.launch import inside_torchrun
from scalelab.errors import UsageError
from scalelab.strategies.tensor_plans import declared
from scalelab.strategies.tensor_plans import derived as tp
from scalelab.workloads.blocks import repeated_blocks

TOLERANCE = 1e-9  # float64: a plan that shards right agrees to ~1e-15
WAIT_S = 120.0


def inside_ranks() -> bool:
    return inside_torchrun()


def by_heads(cfg, workload, model: nn.Module) -> bool:
    """The model is sharded by a plan (tensor_plans/), not by the workload's Linear pairs."""
    if cfg.tp_plan is not None or declared.declared(model):
        return True
    if not hasattr(workload, "linear_pairs"):  # the built-in workloads mark their pairs
        return False
    if getattr(workload, "blocks", None) is not None:
        return True
    return not workload.linear_pairs(model) and repeated_blocks(model) is not None


def prove(cfg) -> None:
    """One line and exit 2 when the plan fails or disagrees on a tiny forward."""
    from scalelab.workloads import WORKLOADS

    n = tp.tp_degree(cfg)
    kind = WORKLOADS.get(cfg.workload)
    if cfg.tp_plan is None and not hasattr(kind, "linear_pairs"):
        return  # a built-in workload: its marked Linear pairs, no plan to prove
    workload = kind(cfg)
    with torch.device("meta"):
        if not by_heads(cfg, workload, workload.build_model()):
            return
    plan = tp.derive_plan(workload.build_model(), n, cfg.tp_plan)  # its own refusals first
    if n < 2:
        return
    model = workload.build_model().double().eval()
    x = workload.prepare(workload.synthetic_inputs(2, cfg.seed).x).double()
    with torch.no_grad():
        ref, ref_calls = _traced(model, x)
    outs = _on_threads(n, lambda: _rank_forward(model, x, cfg.tp_plan))
    for rank, got in enumerate(outs):
        if got is None:
            continue
        if isinstance(got, BaseException):
            raise UsageError(_failed(plan, rank, got))
        out, calls = got
        if _relerr(out, ref) > TOLERANCE:
            raise UsageError(_disagrees(plan, rank, calls, ref_calls, _relerr(out, ref)))


def _rank_forward(model: nn.Module, x: torch.Tensor, user: str | None):
    from torch.distributed.device_mesh import init_device_mesh

    mine = copy.deepcopy(model)
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    tp.parallelize(mine, mesh, tp.derive_plan(mine, n, user))
    with torch.no_grad():
        return _traced(mine, x)


def _traced(model: nn.Module, x: torch.Tensor):
    """(output, [(module name, its output)] in call order); on a failure the exception carries
    the innermost module it was raised in (`where`)."""
    calls, stack, hooks = [], [], []

    def done(name: str, out) -> None:
        calls.append((name, out))
        stack.pop()

    for name, m in model.named_modules():
        hooks.append(m.register_forward_pre_hook(lambda *_a, nm=name: stack.append(nm)))
        hooks.append(m.register_forward_hook(lambda _m, _i, o, nm=name: done(nm, o)))
    try:
        return model(x), calls
    except Exception as exc:
        exc.where = stack[-1] if stack else ""
        raise
    finally:
        for h in hooks:
            h.remove()


def _on_threads(n: int, fn) -> list:
    """fn() on n threads, each rank r of a threaded process group; what each returned or
    raised."""
    try:
        from torch.testing._internal.distributed import multi_threaded_pg as mt
    except ImportError:  # a torch without its testing package: the ranks run unproved
        return [None] * n
    results: list = [None] * n
    isolate = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
    if isolate is not None:
        isolate(True)
    mt._install_threaded_pg()
    # The threaded group's termination event is class state: a proof whose rank failed left
    # it set, and every collective of the next proof in this process would exit at once.
    mt.ProcessLocalGroup.reset()
    store = dist.HashStore()

    def rank(r: int) -> None:
        dist.init_process_group(backend="threaded", rank=r, world_size=n, store=store)
        try:
            results[r] = fn()
        except BaseException as exc:  # wake the ranks waiting in a collective
            results[r] = exc
            mt.ProcessLocalGroup.exception_handle(exc)
        finally:
            # torch 2.11's threaded world lacks `comms`: nothing to free there
            with contextlib.suppress(AttributeError):
                dist.destroy_process_group()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    try:
        for t in threads:
            t.start()
        for r, t in enumerate(threads):
            t.join(WAIT_S)
            if t.is_alive():
                results[r] = TimeoutError(f"no result in {WAIT_S:.0f} s (a collective waits)")
    finally:
        mt.ProcessLocalGroup.reset()
        mt._uninstall_threaded_pg()
        if isolate is not None:
            isolate(False)
    first = next((r for r in results if isinstance(r, Exception)), None)  # the cause, not
    return [first if isinstance(r, BaseException) and first is not None else r for r in results]


def _relerr(a, b) -> float:
    a, b = _tensor(a), _tensor(b)
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _tensor(v):
    if torch.is_tensor(v):
        return v.detach().double()
    if isinstance(v, (tuple, list)) and v and torch.is_tensor(v[0]):
        return v[0].detach().double()
    return getattr(v, "logits", None)


def _attrs(plan, where: str) -> str:
    owner = next((a for a in sorted(plan.heads, key=len, reverse=True)
                  if where == a or where.startswith(a + ".")), None)  # fmt: skip
    if owner is None:
        return ""
    return f" (the plan set {owner}'s {', '.join(plan.heads[owner])} to the rank's share)"


def _failed(plan, rank: int, exc: BaseException) -> str:
    where = getattr(exc, "where", "") or "the model"
    what = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return (f"tensor: the {plan.source} plan fails in rank {rank}'s forward at {where}"
            f"{_attrs(plan, where)}: {type(exc).__name__}: {what}; pass --tp-plan "
            "MODULE:OBJECT with a plan its forward takes")  # fmt: skip


def _disagrees(plan, rank: int, calls, ref_calls, err: float) -> str:
    ref = dict(ref_calls)
    where = next((nm for nm, out in calls if nm in ref and nm and
                  _relerr(out, ref[nm]) > TOLERANCE and _tensor(out) is not None
                  and _tensor(out).shape == _tensor(ref[nm]).shape), "the model")  # fmt: skip
    return (f"tensor: the {plan.source} plan disagrees with the unsharded module on rank "
            f"{rank} (relerr {err:.1e}), first at {where}{_attrs(plan, where)}; pass "
            "--tp-plan MODULE:OBJECT with a plan that shards it by whole heads")  # fmt: skip
