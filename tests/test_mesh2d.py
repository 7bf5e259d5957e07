"""2-D layouts on one device mesh, 4 real gloo ranks: dp2 x pp2 (pipeline --engine torch) and
dp2 x tp2 (tensor --engine torch) against one process (fp64 weights after 2 SGD steps)."""

from __future__ import annotations

import pytest

from scalelab.errors import UsageError
from scalelab.strategies.mesh import Layout
from torchpp_helpers import check_training, torchrun


@pytest.mark.mpi
def test_dp2_x_pp2_trains_like_one_process():
    results = torchrun(4, "pp2d")
    assert len(results) == 2
    for r in results:
        assert r["mesh"] == {"dp": 2, "pp": 2}
        check_training(r)


@pytest.mark.mpi
def test_dp2_x_tp2_trains_like_one_process():
    results = torchrun(4, "tp2d")
    assert len(results) == 2
    for r in results:
        check_training(r)


def test_layout_checks_the_world():
    Layout(2, 3, "pp").check(6, "x")
    with pytest.raises(UsageError, match="--ranks 6"):
        Layout(2, 3, "pp").check(4, "x")
