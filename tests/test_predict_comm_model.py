"""predict's communication model against hand formulas: ring, tree and hierarchical
all-reduce, a measured fit read back as a ring, network profiles and measured network files
as the inter-node link, gradient buckets and their overlap with the backward, and balanced
pipeline stages."""

import json

import pytest

from predict_helpers import CEILINGS
from scalelab.predict.comm_model import (
    Fabric,
    Link,
    flat_allreduce,
    hierarchical_allreduce,
    ring_allreduce,
    ring_link_from_fit,
    tree_allreduce,
)
from scalelab.predict.figures import Figures
from scalelab.predict.models.gradients import Bucket, buckets, exposed_allreduce
from scalelab.predict.models.pipeline import balanced_loads
from scalelab.predict.network import NETWORKS, load_network


# --- communication model against hand formulas -------------------------------------------------
def test_ring_and_tree_allreduce_closed_form():
    link = Link(alpha_s=1e-5, beta_Bps=1e10)
    # ring: 2(N-1) alpha + 2(N-1)/N n/beta = 14e-5 + 1.75e-2
    assert ring_allreduce(1e8, 8, link) == pytest.approx(2 * 7 * 1e-5 + 2 * 7 / 8 * 1e8 / 1e10)
    # tree: 2 log2(N) alpha + 2 n / beta
    assert tree_allreduce(1e8, 8, link) == pytest.approx(2 * 3 * 1e-5 + 2 * 1e8 / 1e10)
    assert flat_allreduce(1e8, 8, link) == pytest.approx(0.01764)  # the ring is faster here
    assert flat_allreduce(8, 1024, link) == pytest.approx(2 * 10 * 1e-5 + 16 / 1e10)  # tree
    assert ring_allreduce(1e8, 1, link) == 0.0


def test_ring_link_reproduces_the_measured_fit():
    """Read back as a ring, a fit measured on p ranks gives alpha + n/beta again at p."""
    for p in (2, 4, 8):
        link = ring_link_from_fit(3e-5, 3.5e11, p)
        assert ring_allreduce(1e7, p, link) == pytest.approx(3e-5 + 1e7 / 3.5e11)


def test_hierarchical_allreduce_closed_form():
    intra, inter = Link(1e-6, 1e11), Link(5e-6, 2.5e10)
    inside = 2 * 7 * 1e-6 + 2 * 7 / 8 * 1e8 / 1e11  # reduce-scatter + all-gather over 8 GPUs
    across = 2 * 3 * 5e-6 + 2 * 3 / 4 * (1e8 / 8) / 2.5e10  # ring over 4 nodes of n/8
    assert hierarchical_allreduce(1e8, 8, 4, intra, inter) == pytest.approx(inside + across)
    fabric = Fabric(intra, Link(1e-6, 1e11), inter, per_node=8)
    assert fabric.allreduce(1e8, 32) == pytest.approx(inside + across)
    assert fabric.allreduce(1e8, 8) == pytest.approx(ring_allreduce(1e8, 8, intra))


def test_network_profile_becomes_the_inter_node_link():
    fig = Figures(json.loads(CEILINGS.read_text()), str(CEILINGS))
    ndr = NETWORKS.get("ndr400")
    fabric = fig.fabric("nccl", per_node=8, network=ndr, nics=8)
    alpha, beta = fig.data["comm"]["nccl"]["allreduce"]["alpha_s"], 50e9
    assert fabric.intra_ring == Link(alpha / 2, fig.data["comm"]["nccl"]["allreduce"]["beta_Bps"])
    # datasheet latency + the library's measured per-step cost; one 400 Gb/s port per GPU
    assert fabric.inter == Link(1e-6 + alpha / 2, beta)
    assert fig.fabric("nccl", 8, ndr, nics=2).inter.beta_Bps == pytest.approx(beta / 4)


def test_measured_network_file(tmp_path):
    path = tmp_path / "ib.json"
    path.write_text(json.dumps({"alpha_s": 2e-6, "beta_Bps": 2e10}))
    net = load_network(str(path))
    assert net.measured and net.latency_s == 2e-6 and net.bw_Bps == 2e10
    fig = Figures(json.loads(CEILINGS.read_text()), str(CEILINGS))
    assert fig.fabric("nccl", 8, net, nics=8).inter == Link(2e-6, 2e10)  # nothing added


def test_buckets_and_overlap():
    # backward order: l2 (3/4 of the FLOPs) first; the first bucket closes at 1000 bytes
    plan = buckets([("l1", 100, 10), ("l2", 300, 30)], 4, first=1000, cap=2000)
    assert plan == [Bucket(1200, 0.75), Bucket(400, 1.0)]
    two = [Bucket(4e6, 0.5), Bucket(4e6, 1.0)]
    assert exposed_allreduce(two, 1.0, lambda n: 0.3) == pytest.approx((0.6, 0.3))
    assert exposed_allreduce(two, 1.0, lambda n: 0.8) == pytest.approx((1.6, 1.1))


def test_balanced_pipeline_stages():
    assert balanced_loads([1, 1, 1, 1, 4], 2) == ([4, 4], [3])
    loads, cuts = balanced_loads([5, 1, 1, 1, 1, 1], 3)
    assert max(loads) == 5 and len(cuts) == 2
