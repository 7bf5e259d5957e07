"""The pipeline on GPUs (marked gpu): 2 GPUs agree with one, VGG-16 in bf16 channels-last
(compiled and a manual split), and GPipe training on 2 and 4 GPUs that does not hang and
equals 1F1B."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline_helpers import _cli

# --- GPUs --------------------------------------------------------------------------------------

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


@pytest.mark.gpu
@two_gpus
def test_pipeline_on_two_gpus_agrees_with_one(tmp_path):
    common = ["deepstack", "--device", "cuda", "--dtype", "fp64", "--batch", "6"]
    common += ["--image-size", "16", "--convs", "4", "--fcs", "2", "--num-classes", "10"]
    pipe = ["--strategy", "pipeline", "--ranks", "2", "--stages", "2", "--microbatches", "3"]
    rec = _cli(tmp_path, *common, *pipe, "--check")
    assert rec["check_passed"] and rec["relerr"] < 1e-12
    assert [s["device"] for s in rec["pipeline"]["stage"]] == ["cuda:0", "cuda:1"]
    train = ["--train", "--steps", "2", "--train-size", "12", "--heldout-size", "6"]
    a, b = tmp_path / "pipe.pt", tmp_path / "local.pt"
    _cli(tmp_path, *common, *pipe, *train, "--schedule", "1f1b", "--save-weights", str(a))
    _cli(tmp_path, *common, *train, "--save-weights", str(b))
    wa, wb = torch.load(a), torch.load(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@two_gpus
def test_vgg16_bf16_channels_last_pipeline_and_manual_split_on_two_gpus(tmp_path):
    common = ["vgg16", "--device", "cuda", "--image-size", "64", "--num-classes", "10"]
    rec = _cli(
        tmp_path,
        *common,
        "--strategy",
        "pipeline",
        "--ranks",
        "2",
        "--stages",
        "2",
        "--dtype",
        "bf16",
        "--channels-last",
        "--batch",
        "16",
        "--microbatches",
        "4",
        "--check",
    )
    assert rec["check_passed"]
    compiled = _cli(tmp_path, *common, "--strategy", "pipeline", "--ranks", "2", "--stages", "2",
                    "--dtype", "bf16", "--channels-last", "--batch", "16", "--microbatches", "4",
                    "--compile", "--check")  # fmt: skip
    assert compiled["check_passed"]
    assert all(s["compiled_graphs"] >= 1 for s in compiled["pipeline"]["stage"])
    manual = _cli(
        tmp_path,
        *common,
        "--strategy",
        "pipeline",
        "--placement",
        "manual",
        "--stages",
        "2",
        "--dtype",
        "fp32",
        "--check",
        "--batch",
        "8",
    )
    assert manual["check_passed"] and manual["pipeline"]["devices"] == ["cuda:0", "cuda:1"]


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 4])
def test_gpipe_training_on_gpus_does_not_hang_and_equals_1f1b(stages, tmp_path):
    """GPipe's first backward send meets a receive posted long before (in a group with the
    last forward send): without the links opened at setup, NCCL hung here on 2 H200s."""
    if torch.cuda.device_count() < stages:
        pytest.skip(f"needs {stages} CUDA GPUs")
    common = ["vgg16", "--device", "cuda", "--image-size", "64", "--num-classes", "10"]
    common += ["--strategy", "pipeline", "--ranks", str(stages), "--stages", str(stages)]
    common += ["--dtype", "fp32", "--channels-last", "--train", "--batch", "32"]
    common += ["--microbatches", "8", "--steps", "3", "--train-size", "96", "--heldout-size", "32"]
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        runs[schedule] = _cli(tmp_path, *common, "--schedule", schedule, "--json")
    assert runs["gpipe"]["steps"] == runs["1f1b"]["steps"] == 3
    np.testing.assert_allclose(runs["gpipe"]["loss"], runs["1f1b"]["loss"], rtol=1e-3)
    for stage in runs["1f1b"]["pipeline"]["stage"]:  # the median step's timeline, in order
        spans = stage["timeline_ms"]
        names = [name for name, _, _ in spans]
        assert names.count("forward") == names.count("backward") == 8, names
        assert [a for _, a, _ in spans] == sorted(a for _, a, _ in spans)
        assert all(b >= a for _, a, b in spans)
