"""(slow) `scalelab plan`'s whole loop on this host for mlp training on the real MNIST test
set: calibrate what is missing, rank, measure the top 3 and the plain configuration, and
check the regret and the choice's prediction (plan_helpers._assert_regret)."""

from __future__ import annotations

import numpy as np
import pytest

from plan_helpers import _assert_regret, _plan


@pytest.mark.slow
def test_mlp_training_plan_on_mnist_is_proved_on_this_host(cli, tmp_path, mnist_dir):
    summary = _plan(cli, tmp_path, "mlp", "--train", "--batch", "100", "--steps", "10",
                    "--data-dir", str(mnist_dir), "--strategies", "mpi-dp,ddp", verify=3,
                    repeats=2)  # fmt: skip
    assert np.isfinite([r["measured"] for r in summary[0]["verify"]["rows"]]).all()
    _assert_regret(*summary, top=3, repeats=2)
