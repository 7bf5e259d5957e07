"""Halo geometry and exchange, in one process: known borders, edge ranks, exact slabs.

The exchange runs over a thread-per-rank comm (real non-blocking sends and receives between
threads), so the same function the MPI and NCCL ranks call is checked without a launcher.
"""

import queue
import threading

import pytest
import torch

from scalelab.comm.base import Comm, Request
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.instrument.timer import PhaseTimer
from scalelab.layout.trunk import trunk_for
from scalelab.strategies.halo import (
    Geometry,
    edge_pad,
    exchange,
    max_ranks,
    plan_layer,
    plan_trunk,
)
from scalelab.strategies.split.transport import Transport
from scalelab.workloads import WORKLOADS


def _workload(name, **kw):
    return WORKLOADS.get(name)(RunConfig(workload=name, **kw))


# --- geometry -------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 3, 5, 8])
def test_alexnet_halos_match_the_seed_formula(ranks):
    """Interior ranks receive (k-1)//2 rows from above: C1 5 rows, C2 2 rows (the seed's
    table), and each layer's output rows are owned exactly once, contiguously, in rank order."""
    trunk = trunk_for(_workload("alexnet"), None)
    geoms = trunk.geometries()
    plans = dict(zip([g.name for g in geoms], plan_trunk(geoms, ranks)))
    assert [r.halo_up for r in plans["c1"]] == [0] + [5] * (ranks - 1)
    assert [r.halo_up for r in plans["c2"]] == [0] + [2] * (ranks - 1)
    assert [r.halo_down for r in plans["c2"]] == [2] * (ranks - 1) + [0]
    for geom, plan in zip(geoms, plans.values()):
        assert plan[0].out[0] == 0 and plan[-1].out[1] == geom.out_size
        assert all(a.out[1] == b.out[0] for a, b in zip(plan, plan[1:]))
        for rows in plan:
            assert rows.halo_up <= (geom.kernel - 1) // 2 and rows.halo_down <= geom.kernel // 2


def test_edge_ranks_pad_and_interior_ranks_do_not():
    geom = Geometry("c", kernel=5, stride=1, pad=2, in_size=10)
    plan = plan_layer(geom, [0, 4, 7, 10])
    assert [(r.pad_top, r.pad_bottom) for r in plan] == [(2, 0), (0, 0), (0, 2)]
    assert [r.need for r in plan] == [(0, 6), (2, 9), (5, 10)]
    assert [(r.halo_up, r.halo_down) for r in plan] == [(0, 2), (2, 2), (2, 0)]


def test_first_layer_is_split_evenly():
    geoms = trunk_for(_workload("alexnet"), None).geometries()
    c1 = plan_trunk(geoms, 8)[0]
    assert [r.out[1] - r.out[0] for r in c1] == [7, 7, 7, 7, 7, 7, 7, 6]  # 55 rows


def test_slab_thinner_than_halo_is_a_clear_error():
    geoms = trunk_for(_workload("alexnet", image_size=67), None).geometries()
    assert max_ranks(geoms) == 4
    with pytest.raises(UsageError, match="slab thinner than the halo"):
        plan_trunk(geoms, 5)


def test_edge_pad():
    x = torch.ones(1, 1, 2, 3)
    y = edge_pad(x, 2, 1, 2, float("-inf"))
    assert y.shape == (1, 1, 5, 3)
    assert torch.isinf(y[0, 0, 0]).all() and torch.isinf(y[0, 0, 3:]).all()
    assert edge_pad(x, 2, 0, 0, 0.0) is x


# --- slabs through the real layers equal the full map's rows ---------------------------------
@pytest.mark.parametrize(
    "workload, ranks, kw", [("alexnet", 3, {"image_size": 67}), ("charcnn", 5, {})]
)
@torch.inference_mode()
def test_every_slab_computes_its_rows_of_the_full_map(workload, ranks, kw):
    """Each rank's needed rows (taken from the full serial map), edge-padded, through the
    model's own layer = that rank's rows of the full output, at every windowed layer.

    In float64: the slab and the whole map may take different kernels (the choice follows the
    shape and the thread count), whose fp32 sums differ by ~1e-6 on charcnn's 1792-term dot
    products; in float64 that rounding is ~1e-15, while a wrong row is off by O(1)."""
    wl = _workload(workload, **kw)
    model = wl.build_model().double()
    trunk = trunk_for(wl, model)
    plans = plan_trunk(trunk.geometries(), ranks)
    x = wl.prepare(wl.synthetic_inputs(1, 1).x).double()
    for step, plan in zip(trunk.steps, plans):
        if step.kind == "window":  # the whole map, padded on both edges like the model
            full = step.apply(edge_pad(x, 2, step.pad, step.pad, step.pad_value))
            for rows in plan:
                if rows.empty:
                    continue
                slab = x[:, :, rows.need[0] : rows.need[1]]
                slab = edge_pad(slab, 2, rows.pad_top, rows.pad_bottom, step.pad_value)
                scale = float(full.abs().max())  # (1, C, H, W) or (1, C, L): tolerance follows it
                torch.testing.assert_close(
                    step.apply(slab), full[:, :, rows.out[0] : rows.out[1]],
                    rtol=1e-12, atol=1e-12 * scale,
                )  # fmt: skip
        else:
            full = step.apply(x) if step.apply is not None else step.norm(x)
        x = full


# --- exchange over real (threaded) non-blocking messages -------------------------------------
class ThreadComm(Comm):
    """Ranks as threads; isend copies into a per-(src, dst, tag) queue, irecv takes from it."""

    def __init__(self, rank, size, boxes):
        self._rank, self._size, self.boxes = rank, size, boxes

    rank = property(lambda self: self._rank)
    size = property(lambda self: self._size)

    def isend(self, x, dest, tag=0):
        self.boxes[(self._rank, dest, tag)].put(x.clone())
        return _Done()

    def irecv(self, buf, source, tag=0):
        box = self.boxes[(source, self._rank, tag)]
        return _Recv(lambda: buf.copy_(box.get(timeout=10)))

    def barrier(self): ...
    def gather_object(self, obj, root=0): ...
    def bcast_object(self, obj, root=0): ...
    def scatterv(self, x, counts, root=0): ...
    def gatherv(self, x, root=0): ...
    def allreduce(self, x, op="sum"): ...
    def bcast(self, x, root=0): ...


class _Done(Request):
    def wait(self):
        pass


class _Recv(Request):
    def __init__(self, fn):
        self.fn = fn

    def wait(self):
        self.fn()


def _exchange_all(global_map, axis, plan):
    """Every rank's exchange result, each rank holding only its own rows of global_map."""
    size = len(plan)
    boxes = {(s, d, t): queue.Queue() for s in range(size) for d in range(size) for t in range(4)}
    results, errors = [None] * size, []

    def rank_main(r):
        try:
            comm = ThreadComm(r, size, boxes)
            timer = PhaseTimer()
            own = global_map.narrow(axis, plan[r].own[0], plan[r].own[1] - plan[r].own[0])
            wire = Transport(comm, torch.device("cpu"), timer)
            results[r] = (exchange(comm, wire, timer, own, axis, plan, tag=0), timer)
        except Exception as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return results


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_exchange_delivers_known_borders(ranks):
    """Row i of the map holds the value i everywhere: after the exchange every rank holds
    exactly the rows [need) of its layer, halos from the right neighbours, edges untouched."""
    geom = Geometry("c3", kernel=3, stride=1, pad=1, in_size=11)
    plan = plan_layer(geom, [0, *[11 * r // ranks for r in range(1, ranks)], 11])
    rows = torch.arange(11.0)[None, None, :, None].expand(2, 3, 11, 4).contiguous()
    for r, (got, timer) in enumerate(_exchange_all(rows, 2, plan)):
        lo, hi = plan[r].need
        assert torch.equal(got, rows[:, :, lo:hi])
        halo_rows = plan[r].halo_up + plan[r].halo_down
        assert timer.bytes_moved().get("halo", 0) == halo_rows * 2 * 3 * 4 * 4
    assert plan[0].halo_up == 0 and plan[-1].halo_down == 0  # nothing beyond the edges


def test_exchange_on_transport_form_bytes():
    """The first layer's halo travels as 1-byte indices along the text axis (dim 1)."""
    geom = Geometry("conv1", kernel=7, stride=1, pad=0, in_size=30)
    plan = plan_layer(geom, [0, 12, 30])
    text = torch.arange(30, dtype=torch.uint8)[None, :].repeat(3, 1)
    for r, (got, timer) in enumerate(_exchange_all(text, 1, plan)):
        assert got.dtype == torch.uint8 and torch.equal(got, text[:, slice(*plan[r].need)])
        assert timer.bytes_moved()["halo"] == 3 * 3  # 3 texts x 3 halo characters
