"""`tensor --engine torch`: DTensor Colwise/Rowwise pairs on 2 real gloo ranks against one
process (fp64): inference relerr < 1e-12 for mlp, alexnet's and VGG-16's heads; training
(weights after 2 SGD steps, the mlp's L2 penalty over shards included) within 1e-10."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scalelab.config import RunConfig
from scalelab.strategies.tensor_dtensor import linear_pairs
from scalelab.workloads import WORKLOADS
from torchpp_helpers import check_training, torchrun


@pytest.mark.mpi
def test_tensor_parallel_on_two_ranks_equals_one_process():
    results = torchrun(2, "tp")
    assert len(results) == 6
    for r in results:
        if r["train"]:
            check_training(r)
        else:
            assert r["relerr"] < 1e-12, r


@pytest.mark.parametrize(
    "name, pairs",
    [
        ("mlp", [("fc1", "fc2")]),
        ("vgg16", [("classifier.0", "classifier.3")]),
        ("alexnet", [("fc6", "fc7")]),
        ("charcnn", [("fc1", "fc2")]),
        ("deepstack", [("proj", "fc1"), ("fc2", "classifier")]),
    ],
)
def test_marked_pairs(name, pairs):
    cfg = RunConfig(workload=name, fcs=2)
    workload = WORKLOADS.get(name)(cfg)
    with torch.device("meta"):
        assert linear_pairs(workload, workload.build_model()) == pairs


def test_sequential_pairs_skip_non_elementwise_links():
    """A conv between two linears breaks the pair: sharding across it would be wrong."""

    class W:
        name = "user"

    seq = nn.Sequential(nn.Linear(2, 2), nn.Conv1d(1, 1, 1), nn.Linear(2, 2), nn.ReLU(),
                        nn.Linear(2, 2))  # fmt: skip
    assert linear_pairs(W(), seq) == [("2", "4")]


def test_tp_needs_the_torch_engine(cli):
    code, _, err = cli("run", "mlp", "--strategy", "tensor", "--tp", "2", "--no-record")
    assert code == 2 and "--tp needs --engine torch" in err
