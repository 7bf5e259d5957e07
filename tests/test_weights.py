"""Weights round-trip through both formats; mismatches name the first wrong key; the
hand-written safetensors reader (used without the library) reads what the library reads."""

import pytest
import torch

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.weights import load_weights, read_safetensors, save_weights, write_safetensors
from scalelab.workloads import WORKLOADS


def _mlp(hidden=16, seed=0):
    return WORKLOADS.get("mlp")(RunConfig(workload="mlp", hidden=hidden, seed=seed)).build_model()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_round_trip(tmp_path, suffix):
    a, b = _mlp(seed=1), _mlp(seed=2)
    assert not torch.equal(a.fc1.weight, b.fc1.weight)
    save_weights(a, str(tmp_path / f"w{suffix}"))
    load_weights(b, str(tmp_path / f"w{suffix}"))
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_safetensors_dtypes(tmp_path):
    tensors = {
        "a": torch.randn(3, 4, dtype=torch.bfloat16),
        "b": torch.arange(5, dtype=torch.uint8),
        "c": torch.randn(2, dtype=torch.float64),
    }
    write_safetensors(tmp_path / "t.safetensors", tensors)
    back = read_safetensors(tmp_path / "t.safetensors")
    assert all(
        torch.equal(tensors[k], back[k]) and back[k].dtype == tensors[k].dtype for k in tensors
    )


def test_shape_mismatch_names_key(tmp_path):
    save_weights(_mlp(hidden=16), str(tmp_path / "w.pt"))
    with pytest.raises(UsageError, match=r"'fc1.weight' has shape \(16, 784\).*\(32, 784\)"):
        load_weights(_mlp(hidden=32), str(tmp_path / "w.pt"))


def test_foreign_state_dict_and_garbage(tmp_path):
    torch.save({"conv.weight": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(UsageError, match="missing key 'fc1.weight'"):
        load_weights(_mlp(), str(tmp_path / "other.pt"))
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(UsageError, match="not a torch state_dict"):
        load_weights(_mlp(), str(tmp_path / "junk.pt"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(UsageError, match="safetensors"):
        load_weights(_mlp(), str(tmp_path / "junk.safetensors"))


def test_safetensors_library_and_hand_reader_agree(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    import importlib.util

    from scalelab import weights

    tensors = {"w": torch.randn(3, 2, dtype=torch.float64), "b": torch.arange(4)}
    weights.write_safetensors(tmp_path / "t.safetensors", tensors)
    by_library = weights.read_safetensors(tmp_path / "t.safetensors")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "safetensors" else real(n, *a)
    )
    by_hand = weights.read_safetensors(tmp_path / "t.safetensors")
    assert all(torch.equal(by_library[k], by_hand[k]) for k in tensors)
    monkeypatch.undo()
    (tmp_path / "bad.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{notjson}")
    with pytest.raises(Exception, match="not a readable safetensors"):
        weights.read_safetensors(tmp_path / "bad.safetensors")
