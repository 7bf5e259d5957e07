"""(slow) `scalelab plan`'s whole loop on this host for a user's model (tokcnn, a 1-D conv
net over token ids, examples/models/): calibrate, rank, measure the top 2 and the plain
configuration, the regret and the choice's prediction, the refusals named, and the model's
flags reaching every verification run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from plan_helpers import TOKCNN, _assert_regret, _plan


@pytest.mark.slow
def test_a_user_models_plan_is_proved_on_this_host(cli, tmp_path):
    # tokcnn (a 1-D conv net over int64 token ids, examples/models/) on 2 texts of 512 tokens:
    # batch 2 leaves one micro-batch count, and spatial and DTensor refuse the model: 5
    # runnable candidates, of which the top 2 and the plain one are measured (a run here is
    # mostly process start-up, so CI time is the number of runs)
    summary, out = _plan(cli, tmp_path, "--model", TOKCNN, "--model-arg", "dim=64",
                         "--model-arg", "vocab=500", "--input-shape", "512", "--input-dtype",
                         "int64", "--vocab", "500", "--batch", "2", "--iters", "10",
                         "--warmup", "2", verify=2, repeats=2)  # fmt: skip
    rows = {r["candidate"]: r for r in summary["rows"]}
    spatial = next(r["status"] for c, r in rows.items() if "--split spatial" in c)
    dtensor = next(r["status"] for c, r in rows.items() if "--engine torch" in c)
    assert spatial.startswith("does not apply: --split spatial needs a convolution trunk")
    assert dtensor.startswith("does not apply: tensor: nothing to shard: fc is the last Linear")
    _assert_regret(summary, out, top=2, repeats=2)
    v = summary["verify"]
    chosen = next(r for r in v["rows"] if r["candidate"] == v["chosen"])
    assert np.isfinite([chosen["predicted"], chosen["measured"], chosen["error_pct"]]).all()
    for rec in map(json.loads, (out / "verify.jsonl").read_text().splitlines()):
        cfg = rec["config"]  # measured as the same model: the flags reached the runs
        assert (cfg["model"], cfg["model_arg"], cfg["input_shape"], cfg["vocab"]) == (
            TOKCNN, ["dim=64", "vocab=500"], "512", 500)  # fmt: skip
