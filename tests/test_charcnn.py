"""charcnn: the model against its float64 NumPy oracle, its cost table against torch's FLOP
counter and the seed's shapes, and the AG News reader on the real file and on broken ones."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scalelab.config import RunConfig
from scalelab.data import agnews
from scalelab.errors import UsageError
from scalelab.oracle.check import relative_error
from scalelab.oracle.ops import one_hot
from scalelab.workloads import WORKLOADS
from scalelab.workloads.base import state_dict_float64

AG_NEWS = Path(__file__).resolve().parents[2] / "shared" / "data" / "ag_news"
needs_data = pytest.mark.skipif(not (AG_NEWS / "test.csv").is_file(), reason="no AG News copy")


def make(**kw) -> object:
    return WORKLOADS.get("charcnn")(RunConfig(workload="charcnn", **kw))


@pytest.fixture(scope="module")
def workload():
    return make()


@pytest.fixture(scope="module")
def model(workload):
    """The seeded model with LayerNorm gamma/beta moved off 1/0, so a transposed or ignored
    affine in the oracle shows up."""
    m = workload.build_model()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for ln in (m.ln1, m.ln6):
            ln.weight.copy_(1 + 0.5 * torch.randn(ln.weight.shape, generator=g))
            ln.bias.copy_(0.5 * torch.randn(ln.bias.shape, generator=g))
    return m


def two_texts(workload) -> torch.Tensor:
    """One real-looking quantized text and one synthetic row, (2, 1014) uint8."""
    text = agnews.quantize(["Stocks fell on Wall St. (Reuters) -- oil hit $50 a barrel!"])
    return torch.cat([torch.from_numpy(text), workload.synthetic_inputs(1, seed=3).x])


# --- model vs oracle ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_forward_matches_numpy_reference(workload, model, dtype, tol):
    x = two_texts(workload)
    ref = workload.reference_forward(state_dict_float64(model), x.numpy())
    with torch.no_grad():
        out = copy.deepcopy(model).to(dtype)(workload.prepare(x).to(dtype)).double().numpy()
    assert out.shape == ref.shape == (2, 4)
    assert relative_error(out, ref) < tol
    assert np.abs(ref[0] - ref[1]).max() > 1e-3  # distinct inputs give distinct logits


def test_reference_sees_the_layernorm_affine(workload, model):
    params = state_dict_float64(model)
    x = two_texts(workload).numpy()
    flat = dict(params, **{"ln6.weight": np.ones_like(params["ln6.weight"])})
    assert (
        relative_error(workload.reference_forward(flat, x), workload.reference_forward(params, x))
        > 1e-3
    )


# --- shapes and costs ----------------------------------------------------------------------
def test_parameter_shapes_follow_the_seed(model):
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["conv1.weight"] == (256, 70, 7)
    assert shapes["conv2.weight"] == (256, 256, 7)
    assert all(shapes[f"conv{i}.weight"] == (256, 256, 3) for i in (3, 4, 5, 6))
    assert shapes["ln1.weight"] == shapes["ln1.bias"] == (256, 1008)
    assert shapes["ln6.weight"] == shapes["ln6.bias"] == (256, 102)
    assert shapes["fc1.weight"] == (1024, 8704)
    assert shapes["fc2.weight"] == (1024, 1024)
    assert shapes["fc3.weight"] == (4, 1024)


def test_cost_table_shapes_and_params_match_the_modules(workload, model):
    rows = [r for r in workload.cost_table() if r.module is not None]
    seen = {}
    hooks = [
        model.get_submodule(r.module).register_forward_hook(
            lambda mod, i, o, name=r.module: seen.__setitem__(name, tuple(o.shape[1:]))
        )
        for r in rows
    ]
    with torch.no_grad():
        model(workload.prepare(workload.synthetic_inputs(1, seed=0).x))
    for h in hooks:
        h.remove()
    for r in rows:
        assert seen[r.module] == r.out_shape, r.name
        assert r.params == sum(p.numel() for p in model.get_submodule(r.module).parameters())
    total = sum(r.params for r in workload.cost_table())
    assert total == sum(p.numel() for p in model.parameters()) == 11_908_100


def test_conv_and_linear_flops_match_flop_counter(workload, model):
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(workload.prepare(workload.synthetic_inputs(1, seed=0).x))
    counts = counter.get_flop_counts()
    rows = [r for r in workload.cost_table() if r.kind in ("conv", "linear")]
    assert len(rows) == 9
    for r in rows:
        measured = sum(counts[f"CharCNN.{r.module}"].values())
        assert abs(r.flops - measured) <= 0.01 * measured, r.name
    assert sum(r.flops for r in rows) == sum(counts["Global"].values())


def test_flops_per_text(workload):
    # conv 2*256*(70*7*1008 + 256*7*330 + 256*3*(108+106+104+102)) + fc 2*(8704+1024+4)*1024
    # + layernorm 7*256*(1008+102) + relu, pool: 0.743 GFLOP (~0.74 GFLOP a text)
    assert workload.flops_per_item() == 743_432_192
    names = [r.name for r in workload.cost_table()]
    assert names[:4] == ["conv1", "ln1", "relu1", "pool1"] and names[-1] == "fc3"


# --- inputs ----------------------------------------------------------------------------------
def test_prepare_is_one_hot_with_zero_padding_columns(workload):
    x = workload.synthetic_inputs(3, seed=5).x
    x[0, :4] = torch.tensor([70, 255, 0, 69], dtype=torch.uint8)
    h = workload.prepare(x)
    assert h.shape == (3, 70, 1014) and h.dtype == torch.float32 and h.device == x.device
    sums = h.sum(dim=1)
    assert set(sums.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(sums == 0, x >= 70)
    assert sums[0, :4].tolist() == [0.0, 0.0, 1.0, 1.0]
    np.testing.assert_array_equal(h.numpy(), one_hot(x.numpy().astype(np.int64), 70))


def test_synthetic_inputs_are_deterministic_and_in_range(workload):
    a, b = workload.synthetic_inputs(16, seed=1), workload.synthetic_inputs(16, seed=1)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, workload.synthetic_inputs(16, seed=2).x)
    assert a.x.dtype == torch.uint8 and a.x.shape == (16, 1014)
    assert int(a.x.max()) == 70 and int(a.x.min()) == 0  # some padding, full alphabet range
    assert a.y.dtype == torch.int64 and set(a.y.tolist()) <= {0, 1, 2, 3}


def test_quantize_lowercases_reverses_and_pads():
    q = agnews.quantize(["Ab c-\\\n\u00e9"])
    assert q.dtype == np.uint8 and q.shape == (1, 1014)
    # backwards: e-acute (not in the alphabet), newline, backslash, '-', c, space, b, a
    assert q[0, :8].tolist() == [70, 69, 46, 59, 2, 70, 1, 0]
    assert (q[0, 8:] == 70).all()
    assert agnews.ALPHABET[59] == "-" and agnews.ALPHABET.index("-") == 36  # 36 is never set


def test_quantize_keeps_the_last_characters_of_a_long_text():
    q = agnews.quantize(["q" + "a" * 1012 + "bc", "xyz"], length=1014)
    assert q[0, :2].tolist() == [2, 1] and (q[0, 2:] == 0).all()  # the leading 'q' is cut
    assert q[1, :3].tolist() == [25, 24, 23] and (q[1, 3:] == 70).all()
    assert agnews.quantize(["abcdef"], length=3).tolist() == [[5, 4, 3]]


@needs_data
def test_reader_on_the_real_test_split():
    texts, labels = agnews.read_agnews(AG_NEWS / "test.csv")
    assert len(texts) == 7600 and labels.dtype == np.int64
    assert np.bincount(labels).tolist() == [1900] * 4
    assert labels[0] == 2  # "3" = Business
    assert texts[0].startswith("Fears for T N pension after talks Unions representing")
    # a quoted field with commas; the backslash (a line break in AG News) is kept
    assert "(SPACE.com) SPACE.com - TORONTO, Canada -- A second\\team" in texts[1]


@needs_data
def test_real_inputs_through_the_workload():
    w = make(data_dir=str(AG_NEWS))
    data = w.real_inputs(5)
    assert data.x.shape == (5, 1014) and data.x.dtype == torch.uint8
    assert data.y.tolist()[:2] == [2, 3]
    texts, _ = agnews.read_agnews(AG_NEWS / "test.csv")
    np.testing.assert_array_equal(data.x.numpy()[1], agnews.quantize([texts[1]])[0])
    with pytest.raises(UsageError, match="asked for 7601 texts"):
        w.real_inputs(7601)


# --- bad input ---------------------------------------------------------------------------------
def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "test.csv"
    path.write_text(text, encoding="utf-8")
    return path


def test_reader_parses_quotes_and_accepts_a_headerless_file(tmp_path):
    path = write(tmp_path, '1,"Hi, there","He said ""yes"", then left"\n4,b,c\n\n')
    texts, labels = agnews.read_agnews(path)
    assert texts == ['Hi, there He said "yes", then left', "b c"]
    assert labels.tolist() == [0, 3]


@pytest.mark.parametrize(
    "text, message",
    [
        ("label,title,description\n3,a,b\n5,c,d\n", "line 3: label '5' is not one of"),
        ("class,title,text\n3,a,b\n", "line 1: neither the header"),
        ("label,title,description\n3,a\n", "line 2: expected 3 fields"),
        ("label,title,description\n3,a,b,c\n", "line 2: expected 3 fields"),
        ("label,title,description\n", "no data rows"),
    ],
)
def test_bad_csv_is_a_usage_error(tmp_path, text, message):
    with pytest.raises(UsageError, match=message):
        agnews.read_agnews(write(tmp_path, text))


def test_missing_files_and_options_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        agnews.read_agnews(tmp_path / "absent.csv")
    with pytest.raises(UsageError, match="no AG News test.csv or train.csv"):
        make(data_dir=str(tmp_path))
    with pytest.raises(UsageError, match="drop --image-size"):
        make(image_size=32)
    with pytest.raises(UsageError, match="4 classes"):
        write(tmp_path, "1,a,b\n")
        make(data_dir=str(tmp_path), num_classes=10)
    assert make(num_classes=10).build_model().fc3.out_features == 10
