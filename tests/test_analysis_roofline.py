"""Roofline analyses on checked-in records with hand-computed answers (fixtures/README.md)."""

import json
from pathlib import Path

import pytest

from scalelab.analysis import roofline
from scalelab.analysis import system_roofline as sysroof
from scalelab.errors import UsageError
from scalelab.record import read_records

FIXTURES = Path(__file__).parent / "fixtures"


def test_classify_and_attainable():
    # ridge at 1e11 / 1e10 = 10 FLOP/byte
    assert roofline.classify(9.99, 1e11, 1e10) == "memory"
    assert roofline.classify(10.0, 1e11, 1e10) == "compute"
    assert roofline.attainable(2.0, 1e11, 1e10) == 2e10
    assert roofline.attainable(50.0, 1e11, 1e10) == 1e11


def test_layer_roofline_known_answers():
    """mlp H=100, batch 64, fp32: fc1 does 2*784*100*64 FLOPs moving
    4*(64*(784+100) + 78500) bytes -> AI 18.57, compute-bound, 10.04% of 1e11 in 1 ms."""
    recs = read_records(FIXTURES / "layers.jsonl")
    ceilings = roofline.read_ceilings(FIXTURES / "ceilings_cpu.json")
    df = roofline.layer_roofline(recs, ceilings).set_index("layer")
    assert list(df.index) == ["fc1", "sigmoid", "fc2", "softmax", "custom"]  # flatten: no cost
    fc1 = df.loc["fc1"]
    assert fc1["flops"] == 10_035_200 and fc1["bytes"] == 540_304
    assert fc1["ai"] == pytest.approx(18.5732, rel=1e-4)
    assert fc1["bound"] == "compute" and fc1["fraction"] == pytest.approx(0.100352)
    sig = df.loc["sigmoid"]
    assert (sig["flops"], sig["bytes"], sig["bound"]) == (25_600, 51_200, "memory")
    assert sig["attainable"] == pytest.approx(5e9) and sig["fraction"] == pytest.approx(0.512)
    assert df.loc["fc2", "bound"] == "memory" and df.loc["fc2", "ai"] == pytest.approx(3.9752, 1e-4)
    assert df.loc["custom", "ai"] == 100 and df.loc["custom", "fraction"] == pytest.approx(1.0)


def test_device_peaks_fall_back_to_cpu_section():
    c = roofline.read_ceilings(FIXTURES / "ceilings_cpu.json")
    assert roofline.device_peaks(c, "cpu", "fp32") == (1e11, 1e10)
    assert roofline.device_peaks(c, "cpu", "bf16") == (1e11, 1e10)  # unmeasured: fp32 GEMM
    gpu = {**c, "device": "cuda"}
    assert roofline.device_peaks(gpu, "cpu", "fp32") == (5e10, 1e10)  # CPU section
    with pytest.raises(UsageError, match="no fp32 GEMM rate"):
        roofline.device_peaks(c, "cuda", "fp32")


def test_alpha_beta_fit_exact():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    times = [5e-6 + n / 2e9 for n in sizes]
    alpha, beta = roofline.fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(5e-6, rel=1e-6) and beta == pytest.approx(2e9, rel=1e-9)
    with pytest.raises(UsageError, match="two different"):
        roofline.fit_alpha_beta([8, 8], [1.0, 2.0])


def test_system_peaks_recovered_from_phases():
    """The fixture's phases were built from P_flops 2e10, P_mpi 1e9, P_pci 4e9; half the runs
    book bytes, half rely on the analytic gradient size: the estimates must agree exactly."""
    recs = read_records(FIXTURES / "system_roofline.jsonl")
    peaks = sysroof.estimate_peaks(recs)
    assert peaks.runs == 6
    assert peaks.p_flops == pytest.approx(2e10)
    assert peaks.p_mpi == pytest.approx(1e9) and peaks.p_pci == pytest.approx(4e9)
    assert peaks.pci_share == pytest.approx(2 / 3)
    assert peaks.beta_Bps == pytest.approx(1e9) and abs(peaks.alpha_s) < 1e-12
    one = sysroof.estimate_peaks(recs, reference="h64b16")
    assert one.runs == 1 and one.p_flops == pytest.approx(2e10)


def test_system_points_model_and_bound():
    """Built from the model, so measured_phases equals the model curve; B=16 is
    network-bound (2388*H*16/2e10 < 3180*H/1e9), B=64 and 256 compute-bound."""
    recs = read_records(FIXTURES / "system_roofline.jsonl")
    pts = sysroof.system_points(recs, sysroof.estimate_peaks(recs)).set_index("id")
    assert pts["measured_phases"].to_numpy() == pytest.approx(pts["model"].to_numpy())
    assert (pts["measured"] < pts["model"]).all()  # wall includes the input copy and overhead
    assert pts["bound"].to_dict() == {
        "h64b16": "network",
        "h64b64": "compute",
        "h64b256": "compute",
        "h256b16": "network",
        "h256b64": "compute",
        "h256b256": "compute",
    }
    h = pts.loc["h64b16"]
    grad = (795 * 64 + 10) * 4
    assert h["bytes_mpi"] == grad and h["bytes_pci"] == 2 * grad
    assert h["ai"] == pytest.approx(3 * (1592 * 64 + 50) * 16 / 2 / (3 * grad))
    # AI -> infinity approaches P_flops; the seed's formula at s = 1/2 agrees too.
    p = sysroof.SystemPeaks(2e10, 4e9, 1e9, 0.5, 1)
    assert p.model(1e9) == pytest.approx(2e10, rel=1e-6)
    assert p.model(4.0) == pytest.approx(4.0 / (4.0 / 2e10 + 0.5 * (1 / 4e9 + 1 / 1e9)))


def test_system_roofline_needs_distributed_training():
    with pytest.raises(UsageError, match="distributed training"):
        sysroof.estimate_peaks(read_records(FIXTURES / "layers.jsonl"))


def test_ceilings_bad_input(tmp_path):
    with pytest.raises(UsageError, match="no such ceilings file"):
        roofline.read_ceilings(tmp_path / "nope.json")
    other = tmp_path / "c.json"
    other.write_text(json.dumps({"schema": "someone.else/2"}))
    with pytest.raises(UsageError, match="expected 'scalelab.ceilings/1'"):
        roofline.read_ceilings(other)
    recs = read_records(FIXTURES / "layers.jsonl")
    same = roofline.read_ceilings(FIXTURES / "ceilings_cpu.json")
    assert roofline.ceilings_mismatch(same, recs) is None
    warn = roofline.ceilings_mismatch(
        roofline.read_ceilings(FIXTURES / "ceilings_other.json"), recs
    )
    assert warn == "ceilings measured on nodeB, runs on nodeA"


def test_layer_and_nvml_tables():
    from scalelab.analysis.layers import layer_table, nvml_phase_table

    recs = read_records(FIXTURES / "layers.jsonl")
    t = layer_table(recs).set_index("layer")
    assert t.loc["fc1", "peak_MB"] == 0.6 and t.loc["fc1", "ms"] == 1.0
    assert t.loc["sigmoid", "power_W"] == 41.5
    assert t.loc["softmax", "peak_MB"] != t.loc["softmax", "peak_MB"]  # None -> NaN, no error
    nv = nvml_phase_table(recs)
    assert nv.loc[0, "J per call"] == 2.0 and nv.loc[0, "run max W"] == 55.0


def test_layer_rows_accept_the_short_format():
    """Records with `layers` rows keyed `name`/`peak_bytes` read the same."""
    from scalelab.analysis.frame import layer_rows

    rec = {"layers": [{"name": "fc1", "kind": "Linear", "seconds": 1.0, "peak_bytes": 5}, "junk"]}
    (row,) = layer_rows(rec)
    assert row["name"] == "fc1" and row["peak_bytes"] == 5 and row["power_w"] is None
    assert layer_rows({"per_layer": None}) == []
