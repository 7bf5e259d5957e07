"""`scalelab predict`: the model against the checked-in measurements (tests/fixtures/predict,
copies of benchmarks/results), the communication model against hand formulas, and the CLI's
bad-input errors."""

import json
import shutil
from pathlib import Path

import pytest

from scalelab.config import RunConfig
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
from scalelab.predict.models.spatial import halo_bytes, trunk_of
from scalelab.predict.network import NETWORKS, load_network
from scalelab.predict.scenario import Scenario
from scalelab.predict.validate import UNCALIBRATED, validate
from scalelab.record import read_records
from scalelab.strategies.halo import plan_trunk

FIXTURES = Path(__file__).parent / "fixtures" / "predict"
CEILINGS = FIXTURES / "ceilings_h200x2.json"
PLAN_CEILINGS = FIXTURES.parent / "plan" / "ceilings_2core.json"


@pytest.fixture(scope="module")
def validation():
    return validate(FIXTURES, None, None)


# --- the done-when criterion on the committed measurements -------------------------------------
def test_validate_meets_the_issue_bound(validation):
    t = validation.table
    assert len(t) == 14
    assert validation.mape() <= 10.0
    assert validation.mape(predicted_only=True) <= 10.0
    assert t["error_pct"].abs().max() <= 15.0, t[["source", "error_pct"]]
    assert validation.outside().empty


def test_calibration_points_are_named(validation):
    roles = validation.table.set_index("source")["role"]
    assert (roles == "predicted").sum() == 8
    assert roles["ddp_scaling_h200x2.json[3] weak-128 x2"] == "calibration (DDP host cost)"
    assert roles["mpi_scaling_h200x2.jsonl:1"] == "calibration (compute)"
    assert roles["mpi_scaling_h200x2.jsonl:4"] == "predicted"  # alexnet, 8 ranks
    assert roles["mpi_scaling_h200x2.jsonl:8"] == "predicted"  # nccl: calibrated on mpi-gpu
    # a point that calibrated its own prediction matches exactly (the DDP rows are whole steps)
    ddp_cal = validation.table[validation.table["role"] != "predicted"]
    assert ddp_cal[ddp_cal["workload"] == "resnet18"]["error_pct"].abs().max() < 1e-9


def test_skipped_files_are_counted(validation):
    skipped = validation.skipped
    assert skipped["failed runs"] == 1
    assert skipped["bench records (one GPU, fast path: no scaling)"] == 1
    assert skipped["plain-DDP baseline rows (not a scalelab strategy)"] == 6
    assert skipped["in no known format: mpi_scaling_h200x2_summary.json"] == 1


def test_files_are_found_by_content_not_name(tmp_path, validation):
    for i, src in enumerate(sorted(FIXTURES.rglob("*.json*"))):
        shutil.copy(src, tmp_path / f"file{i}{src.suffix}")
    again = validate(tmp_path, str(CEILINGS), None)
    assert again.mape() == pytest.approx(validation.mape())


def test_a_four_gpu_summary_row_is_predicted(tmp_path):
    """A ddp_scaling_h200x4.json with 4-GPU rows is validated without code changes."""
    summary = json.loads((FIXTURES / "ddp_scaling_h200x2.json").read_text())
    four = {"config": "weak-512", "gpus": 4, "per_gpu": 512, "global": 2048, "ours": 150000.0}
    summary["rows"].append(four)
    (tmp_path / "ddp_scaling_h200x4.json").write_text(json.dumps(summary))
    shutil.copy(CEILINGS, tmp_path / "ceilings_h200x4.json")
    t = validate(tmp_path, None, None).table.set_index("source")
    row = t.loc["ddp_scaling_h200x4.json[6] weak-512 x4"]
    assert row["ranks"] == 4 and row["role"] == "predicted"
    assert row["measured_ms"] == pytest.approx(2048 / 150000.0 * 1e3)


def test_new_summary_format_and_comm_only_ceilings(tmp_path):
    """The multi-GPU study's layout: rows naming their workload (ours ran --fast), plain None
    past 2 GPUs, a partial file beside the complete one, and a --comm-only ceilings file:
    points needing a figure it lacks are passed over, naming the figure and the command."""
    summary = json.loads((FIXTURES / "ddp_scaling_h200x2.json").read_text())
    rows = [{**r, "workload": "resnet18"} for r in summary["rows"]]
    rows.append({**rows[0], "gpus": 4, "global": 2048, "ours": 150000.0, "plain": None})
    (tmp_path / "ddp_scaling.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "ddp_scaling.partial.json").write_text(json.dumps({"rows": rows, "partial": 1}))
    shutil.copy(FIXTURES / "mpi_scaling_h200x2.jsonl", tmp_path / "runs.jsonl")
    full = json.loads(CEILINGS.read_text())
    comm_only = {"schema": full["schema"], "comm": {"nccl": full["comm"]["nccl"]}}
    (tmp_path / "ceilings_nccl_x4.json").write_text(json.dumps(comm_only))
    v = validate(tmp_path, None, None)
    assert set(v.table["workload"]) == {"resnet18"} and len(v.table) == 7
    four = v.table.set_index("source").loc["ddp_scaling.json[6] weak-512 x4"]
    assert four["role"] == "predicted"  # calibrated on the same file's --fast 1-GPU row
    assert v.skipped["partial summary beside a complete one: ddp_scaling.partial.json"] == 1
    assert v.skipped["plain-DDP baseline rows (not a scalelab strategy)"] == 6
    lacking = {why: n for why, n in v.skipped.items() if "cannot be predicted" in why}
    assert sum(lacking.values()) == 8  # every run record needs MPI or PCIe figures
    assert any("comm.mpi.allreduce" in w and "--backend mpi --comm-only" in w for w in lacking)


def test_halo_volumes_match_the_records_byte_for_byte():
    """The halo plan the model uses moves exactly the bytes each rank's record counted."""
    lines = (FIXTURES / "mpi_scaling_h200x2.jsonl").read_text().splitlines()
    for rec in map(json.loads, lines):
        if rec["workload"] != "alexnet" or rec["ranks"] == 1:
            continue
        s = Scenario(
            RunConfig(workload="alexnet", strategy="mpi", split="spatial", batch=32), 1, 32
        )
        s = s.at(rec["ranks"])
        trunk = trunk_of(s)
        got = halo_bytes(s, trunk, plan_trunk(trunk.geometries(), s.ranks))
        per_rank = [sum(layer[r] for layer in got) for r in range(s.ranks)]
        assert per_rank == [b.get("halo", 0) for b in rec["rank_bytes"]]


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


# --- the CLI -----------------------------------------------------------------------------------
def _usage_error(result, needle):
    code, out, err = result
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def test_cli_validate_ends_with_mape(cli):
    code, out, err = cli("predict", "--validate", FIXTURES)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[-1].startswith("MAPE held out: ") and "leave-one-out" in lines[-1]
    assert lines[-1].index("held out") < lines[-1].index("in sample")
    assert float(lines[-1].split()[3].rstrip("%")) > 0  # the calibration points' too
    assert "every point within 15%" in out and "per strategy family" in out
    # a terminal's worth: the per-point table and the file lists are behind -v
    assert len(lines) <= 40 and max(map(len, lines)) <= 200
    code, verbose, err = cli("predict", "-v", "--validate", FIXTURES)
    assert code == 0 and len(verbose.splitlines()) > len(lines)


def test_held_out_error_predicts_each_calibration_point_without_its_configuration(validation):
    """Leave-one-out: a point that calibrated nothing keeps its error; a calibration point
    (its in-sample error ~0 by construction) is predicted from the other runs, so its held-out
    error is no longer ~0 where another batch calibrates it, or NaN where nothing else does."""
    t = validation.table
    predicted = t[t["role"] == "predicted"]
    assert (predicted["held_out_pct"] == predicted["error_pct"]).all()
    assert validation.mape(predicted_only=True) <= 10.0
    cal = t[t["role"].str.startswith("calibration (compute)")]
    assert len(cal) and (cal["error_pct"].abs() < 2.5).all()  # up to modelled copies
    held = cal["held_out_pct"].dropna()
    assert len(held) and (held.abs() > 1e-3).all()
    fams = validation.families().set_index("family")
    assert fams.loc["ddp", "held_out"] == t[t["strategy"] == "ddp"]["held_out_pct"].notna().sum()


def test_uncertainty_band_and_extrapolations(tmp_path):
    """A prediction's band is its family's held-out MAPE from bands.json; it names the ranks
    beyond the family's measured runs and a pipeline schedule none of them ran."""
    import pandas as pd

    from scalelab.predict.calibration import MultiPoint, Pool
    from scalelab.predict.uncertainty import band_note, extrapolations, write_bands

    fams = pd.DataFrame([{"family": "pipeline", "points": 5, "held_out": 4, "loo_mape_pct": 8.04,
                          "in_sample_mape_pct": 1.0, "worst_loo_pct": 12.0}])  # fmt: skip
    write_bands(fams, tmp_path / "bands.json")
    assert band_note("pipeline", str(tmp_path / "bands.json")).startswith("uncertainty: +-8% ")
    assert "never validated" in band_note("tensor", str(tmp_path / "bands.json"))
    ran = Scenario(_vgg(engine="torch", ranks=2, stages=2, schedule="gpipe"), 2, 2)
    pool = Pool(multis=[MultiPoint(ran, 0.05, "pp.jsonl:1")])
    want = Scenario(_vgg(engine="torch", ranks=2, stages=2, schedule="1f1b"), 2, 8)
    notes = extrapolations(pool, want, [2, 4])
    assert notes[0].startswith("extrapolates to 4 ranks") and "most" in notes[0]
    assert any("--schedule 1f1b" in n for n in notes)
    assert extrapolations(pool, ran, [2]) == []


def test_cli_validate_with_no_held_out_point_says_why(cli, tmp_path):
    """One one-rank run: it calibrates the model, so nothing is left to validate against (the
    MAPE would be over no point). One line, exit 2, no validate.csv."""
    for name in ("scaling_weak.jsonl", "ceilings_cpu.json"):
        shutil.copy(FIXTURES.parent / name, tmp_path / name)
    result = cli("predict", "--validate", tmp_path, "--out", tmp_path / "v")
    _usage_error(result, "nothing to validate")
    assert result[1] == "" and not (tmp_path / "v").exists()


def test_cli_predicts_up_to_1024_gpus(cli, tmp_path):
    ranks = ",".join(str(2**i) for i in range(11))
    code, out, err = cli(
        "predict", "resnet18", "--strategy", "ddp", "--ranks", ranks, "--gpus-per-node", 8,
        "--ceilings", CEILINGS, "--network", "ndr400", "--per-rank-batch", 512, "--amp", "bf16",
        "--channels-last", "--calibrate", FIXTURES, "-o", tmp_path,
    )  # fmt: skip
    assert code == 0, err
    assert "DDP host cost 2.38 ms/step" in out and "weak-512 x1" in out
    rows = json.loads((tmp_path / "predict.json").read_text())["rows"]
    assert [r["ranks"] for r in rows] == [2**i for i in range(11)]
    assert rows[-1]["nodes"] == 128 and 0 < rows[-1]["efficiency"] < 1
    assert rows[0]["ms"] == pytest.approx(10.832, rel=1e-3)  # the weak-512 1-GPU measurement
    assert (tmp_path / "predict.png").stat().st_size < 200_000


def test_cli_without_calibration_says_roofline(cli):
    code, out, _ = cli(
        "predict", "alexnet", "--strategy", "mpi", "--split", "spatial", "--batch", 32,
        "--ranks", "1,2,16", "--ceilings", CEILINGS,
    )  # fmt: skip
    assert code == 0
    assert "roofline lower bound" in out
    assert "not runnable" in out  # 16 ranks: a slab thinner than the c2 halo


def test_cli_bad_network(cli):
    _usage_error(
        cli("predict", "resnet18", "--strategy", "ddp", "--ceilings", CEILINGS, "--network", "x9"),
        "unknown network profile 'x9'",
    )


def test_cli_unmodelled_strategy(cli):
    _usage_error(
        cli("predict", "resnet18", "--strategy", "serial", "--ceilings", CEILINGS),
        "no model of strategy 'serial'",
    )


def test_cli_missing_ceilings_figure_names_it_and_how(cli, tmp_path):
    data = json.loads(CEILINGS.read_text())
    del data["comm"]["nccl"]
    partial = tmp_path / "ceilings.json"
    partial.write_text(json.dumps(data))
    result = cli(
        "predict", "resnet18", "--strategy", "ddp", "--ranks", "1,2", "--ceilings", partial
    )
    _usage_error(result, "comm.nccl.allreduce")
    assert "scalelab ceilings --ranks 2 --backend nccl" in result[2]


def test_cli_multi_node_needs_a_network(cli):
    _usage_error(
        cli(
            "predict",
            "resnet18",
            "--strategy",
            "ddp",
            "--ranks",
            "16",
            "--batch",
            "64",
            "--ceilings",
            CEILINGS,
        ),
        "give --network",
    )


def test_cli_no_ceilings_says_how_to_measure(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _usage_error(cli("predict", "resnet18", "--strategy", "ddp"), "scalelab ceilings")


def test_bottleneck_is_named_per_row(cli):
    code, out, _ = cli(
        "predict", "charcnn", "--strategy", "nccl", "--split", "spatial", "--batch", 1024,
        "--ranks", "1,16", "--ceilings", CEILINGS, "--network", "ndr400",
    )  # fmt: skip
    assert code == 0
    assert "compute-bound: compute" in out
    bottleneck = next(line for line in out.splitlines() if line.startswith("bottleneck:"))
    assert "network-bound past 1 ranks: all-reduce" in bottleneck


# --- the 4x H200 host's study ------------------------------------------------------------------
FOUR_GPUS = Path(__file__).parent / "fixtures" / "predict_h200x4"


def test_four_gpu_data_parallel_points_are_predicted_within_the_bound():
    """DDP (ResNet-18 --fast, 1/2/4 GPUs) and charcnn mpi-gpu/nccl (1/2/4 GPUs) on the 4x H200
    host: each within 15%, MAPE <= 10%, from the 1-GPU runs, one 2-GPU DDP run per workload
    and the 2x H200 host's ceilings plus this host's NCCL fit. (The same folder's alexnet
    CPU-rank and pipeline records are validated too but fall outside: docs/PREDICT.md.)"""
    t = validate(FOUR_GPUS, None, None).table
    gpu = t[t["strategy"].str.startswith(("ddp", "mpi-gpu", "nccl"))]
    assert len(gpu) == 21 and set(gpu["ranks"]) == {1, 2, 4}
    assert gpu["error_pct"].abs().max() <= 15.0, gpu[["source", "error_pct"]]
    assert gpu["error_pct"].abs().mean() <= 10.0
    four = gpu[(gpu["ranks"] == 4) & (gpu["role"] == "predicted")]
    assert len(four) == 7  # every 4-GPU point is a prediction, none calibrated on
    # + 9 alexnet CPU-rank points; of the pipeline records only the one-stage runs remain:
    # the multi-stage ones predate the root's host prefetch and are skipped (points.py).
    assert len(t) == 30


# --- CPU ranks sharing a host: the measured cpu_concurrency curve ------------------------------
def _alexnet_ctx(curve=None):
    from scalelab.predict.calibration import Pool
    from scalelab.predict.models import Context
    from scalelab.predict.points import discover

    data = json.loads(CEILINGS.read_text())
    if curve is not None:
        data["cpu_concurrency"] = curve
    pool = Pool()
    for p in discover(FIXTURES / "mpi_scaling_h200x2.jsonl").pools.values():
        pool.extend(p)
    return Context(Figures(data, "c.json"), None, pool)


@pytest.mark.parametrize("split", ["batch", "spatial"])
def test_cpu_ranks_compute_scales_by_the_measured_slowdown(split):
    """6 single-threaded ranks on one node, slowest-process curve 1 / 1.2 / 1.5 / 2.1 at
    1 / 2 / 4 / 8 processes: linear between 4 and 8, s(6) = 1.5 + (2.1 - 1.5) * 2 / 4 = 1.8, so
    compute is 1.8x the no-contention model's (the median-process curve, lower, is not the
    one a bulk-synchronous step waits for); the note names the curve."""
    from scalelab.predict.frame import predict_one

    curve = {"ranks": [1, 2, 4, 8], "slowdown_max": [1.0, 1.2, 1.5, 2.1]}
    curve["slowdown"] = [1.0, 1.1, 1.2, 1.3]
    cfg = RunConfig(workload="alexnet", strategy="mpi", split=split, batch=32, threads=1)
    s = Scenario(cfg, 1, 64).at(6)
    plain, contended = predict_one(_alexnet_ctx(), s), predict_one(_alexnet_ctx(curve), s)
    assert contended.phases["compute"] == pytest.approx(1.8 * plain.phases["compute"])
    assert contended.phases["scatter"] == pytest.approx(plain.phases["scatter"])
    assert any("compute x1.8" in n and "cpu_concurrency" in n for n in contended.notes)
    assert any("assumed not to slow each other" in n for n in plain.notes)
    # one rank is the calibration itself: no slowdown, no note
    one = predict_one(_alexnet_ctx(curve), s.at(1))
    assert one.phases["compute"] == pytest.approx(
        predict_one(_alexnet_ctx(), s.at(1)).phases["compute"]
    )
    assert not any("cpu_concurrency" in n for n in one.notes)


def test_a_measured_speed_up_from_more_busy_processes_is_read_as_none():
    """A noisy curve (a --quick one on a 32-core host read 0.79 at 8 processes): more busy
    processes never make the slowest one faster, so compute is not scaled below 1."""
    from scalelab.predict.frame import predict_one

    curve = {"ranks": [1, 2, 8], "slowdown": [1.0, 1.1, 0.8], "slowdown_max": [1.0, 1.25, 0.79]}
    cfg = RunConfig(workload="alexnet", strategy="mpi", split="batch", batch=32, threads=1)
    s = Scenario(cfg, 1, 64).at(8)
    plain, noisy = predict_one(_alexnet_ctx(), s), predict_one(_alexnet_ctx(curve), s)
    assert noisy.phases["compute"] == pytest.approx(plain.phases["compute"])
    assert any("below 1: read as 1" in n for n in noisy.notes)


def test_ranks_of_several_threads_take_the_curve_measured_with_that_many():
    """2 ranks of 2 threads: the single-threaded curve says s(4) / s(2) = 1.5 / 1.2 = 1.25;
    a plan's curve of 2-thread processes (by_threads) says 1.7 at 2 of them, and wins."""
    from scalelab.predict.frame import predict_one

    curve = {"ranks": [1, 2, 4, 8], "slowdown_max": [1.0, 1.2, 1.5, 2.1]}
    curve["slowdown"] = curve["slowdown_max"]
    cfg = RunConfig(workload="alexnet", strategy="mpi", split="batch", batch=32, threads=2)
    s = Scenario(cfg, 1, 64).at(2)
    plain = predict_one(_alexnet_ctx(), s).phases["compute"]
    single = predict_one(_alexnet_ctx(curve), s)
    assert single.phases["compute"] == pytest.approx(1.25 * plain)
    threaded = {**curve, "by_threads": {"2": {"ranks": [1, 2], "slowdown_max": [1.0, 1.7],
                                               "slowdown": [1.0, 1.6]}}}  # fmt: skip
    two = predict_one(_alexnet_ctx(threaded), s)
    assert two.phases["compute"] == pytest.approx(1.7 * plain)
    assert any("compute x1.7" in n and "with 2 threads per process" in n for n in two.notes)


def test_validate_pairs_each_file_with_its_own_hosts_ceilings(tmp_path):
    """A ceilings file of another host whose name is closer loses to the same host's; a
    results file whose host has only a --comm-only file borrows the rest, and says so."""
    shutil.copy(FIXTURES / "mpi_scaling_h200x2.jsonl", tmp_path / "mpi_scaling.jsonl")
    other = json.loads(CEILINGS.read_text())
    other["machine"].update(cpu_cores=64, gpu_count=4)
    other["cpu_gemm_flops"]["one_core"] *= 10  # would move every CPU point if it were used
    (tmp_path / "ceilings_mpi_scaling.json").write_text(json.dumps(other))
    shutil.copy(CEILINGS, tmp_path / "zz_ceilings.json")
    v = validate(tmp_path, None, None)
    assert v.ceilings["mpi_scaling.jsonl"] == "zz_ceilings.json" and not v.borrowed
    four = validate(FOUR_GPUS, None, None)
    assert four.ceilings["mpi_scaling_h200x4.jsonl"].startswith("ceilings_nccl_h200x4.json")
    took = four.borrowed["mpi_scaling_h200x4.jsonl"]
    assert "64 cpus, 4x NVIDIA H200" in took and "comm.mpi" in took
    assert "from ceilings_h200x2.json (vm, 32 cpus, 2x NVIDIA H200)" in took


# --- pipeline: the run's partition, per-stage times, the simulated schedule --------------------
def _vgg(**kw):
    cfg = dict(workload="vgg16", strategy="pipeline", device="cuda", train=True, dtype="bf16",
               channels_last=True, batch=256, microbatches=8)  # fmt: skip
    return RunConfig(**{**cfg, **kw})


def test_pipeline_partition_maps_layers_to_cost_rows():
    from scalelab.predict.models.pipeline import row_stages

    s = Scenario(_vgg(), 2, 2)
    owner = row_stages(s, [16, 24])  # cast + features.0..14 | features.15.. + classifier
    assert owner == [0] * 15 + [1] * 21  # conv1_1 .. conv3_3 on stage 0; relu3_3 .. fc8 on 1
    alex = Scenario(RunConfig(workload="alexnet", strategy="pipeline", batch=8), 2, 2)
    assert row_stages(alex, [5, 17])[-1] == 1  # the softmax row no layer claims goes last


def test_pipeline_points_carry_the_runs_partition():
    from scalelab.predict.points import discover

    path = COMMITTED / "pipeline_vgg_h200x2_prefetch.jsonl"
    runs = [r for r in read_records(path) if isinstance(r.get("pipeline"), dict)]
    got = [p.scenario.balance for p in discover(path).points]
    assert got == [tuple(r["pipeline"]["balance"]) for r in runs] and len(got) == 2


def test_pipeline_two_gpipe_stages_against_the_hand_formula():
    """Two stages, t0 >= t1 per micro-batch (forward t/3, backward 2t/3), GPipe, M = 8: stage 0
    forwards back to back, stage 1's last forward ends at 8 f0 + f1, its backwards run
    while stage 0 waits for the first, so the step is 8 t0 + t1 (+ 2 sends on the path).
    t(m) from two one-GPU steps: 20 ms at 64, 68 ms at 256 -> 4 ms + 0.25 ms/item, t(32) = 12
    ms, split over the stages by the roofline shares at 32."""
    from scalelab.predict.calibration import CalPoint, Pool
    from scalelab.predict.compute_model import roofline_layers
    from scalelab.predict.frame import bound, predict_one
    from scalelab.predict.models import Context

    local = Scenario(_vgg(strategy="local"), 1, 1)
    pool = Pool([CalPoint(local.family(), "local", None, b, t, 0.0, f"b{b}")
                 for b, t in ((64, 0.020), (256, 0.068))])  # fmt: skip
    ctx = Context(Figures(json.loads(CEILINGS.read_text()), "c.json"), None, pool)
    s = Scenario(_vgg(), 2, 2, balance=(16, 24))
    roof = [t for _, t in roofline_layers(s, ctx.figures, 32)]
    t0 = 0.012 * sum(roof[:15]) / sum(roof)
    t1 = 0.012 - t0
    assert t0 > t1
    pred = predict_one(ctx, s)
    assert pred.phases["compute"] == pytest.approx(8 * t0)
    assert pred.phases["bubble"] == pytest.approx(t1)
    send = ctx.fabric(s, "nccl").p2p(32 * 802816 * 2, False)  # conv3_3's output, bf16
    assert pred.phases["p2p"] == pytest.approx(2 * send)
    assert "slowest stage: rank 0 of 2, cast..conv3_3" in bound(pred)[1]


# --- predict's accuracy bar over the repository's own benchmark results ------------------------
# A frozen copy of the device records (and ceilings) under benchmarks/results that predict
# reads, so a later measurement there moves no test: tests/fixtures/predict_committed/README.md
COMMITTED = Path(__file__).parent / "fixtures" / "predict_committed"


@pytest.mark.slow
def test_committed_results_within_bound_on_the_criterions_scope():
    """`--validate` over the checked-in device records of 2x and 4x H200 hosts (their copy):
    on the done-criterion's scope, CPU ranks 1-8 and GPU runs of every strategy (ddp, mpi-gpu,
    nccl, pipeline, on 1-4 GPUs), every point within 15% of its measured time, and the MAPE
    over all points <= 10%. Points outside the scope (the batch split on 16-64 CPU ranks) are
    still predicted and counted in the MAPE. The deepstack pipeline runs have no one-rank
    deepstack measurement to calibrate on: their roofline bound is listed as such (it reads
    ~40% short), outside the MAPE and the bound."""
    v = validate(COMMITTED, None, None, held_out=False)
    # The held-out GPU studies (gpu_s17-20/, files s17_* to s20_*)
    # were each compared with the predictions of their day when measured (that comparison is in
    # git history); their records calibrate nothing here and lie outside this scope.
    # So is the model-parallel study on 4x H200 (heldout_*, its own README compares it), and
    # the transformer speed benchmark's bf16 runs at GPT-2 small's shape (speed_*), which no
    # calibration record here covers.
    prefixes = ("s17_", "s18_", "s19_", "s20_", "heldout_", "speed_")
    round_ = v.table["source"].str.startswith(prefixes)
    v.table = v.table[~round_]  # `scored` follows the table
    bounds = v.table[v.table["role"] == UNCALIBRATED]
    assert set(bounds["workload"]) == {"deepstack"} and (bounds["error_pct"] < -15).all()
    assert v.outside()["source"].isin(bounds["source"]).sum() == 0
    # torch pipelining's host-work calibration runs are not reproduced by construction (the
    # model re-predicts them and says how far off it is: a 2-GPU GPipe run of resnet18-cifar
    # -17%); the bound here is on what the model predicts, not on those
    t = v.scored[v.scored["role"] != "calibration (pipelining host cost)"]
    cpu = t["strategy"].str.startswith("mpi ")
    # fsdp (its own bar, 10%) on its own: met on the GPT it was measured on (2x H100 and
    # 2x H200), missed on the 1e9-parameter stack of 62 small units, whose step is FSDP's host
    # work, ~2.2x per unit on two ranks what one rank shows (-18% to -55%, docs/PERFORMANCE.md)
    fsdp = t[t["strategy"] == "fsdp"]
    gpt = fsdp[fsdp["workload"] == "model"]
    assert len(gpt) >= 4 and (gpt["error_pct"].abs() <= 10.0).all(), gpt
    scope = t[(~cpu | (t["ranks"] <= 8)) & (t["strategy"] != "fsdp")]
    assert set(scope["strategy"]) >= {"ddp", "mpi --split spatial", "nccl --split batch",
                                      "mpi-gpu --split batch", "pipeline"}  # fmt: skip
    worst = scope.loc[scope["error_pct"].abs().idxmax()]
    assert abs(worst["error_pct"]) <= 15.0, f"{worst['source']}: {worst['error_pct']:+.1f}%"
    assert t["error_pct"].abs().mean() <= 10.0
    assert len(t) >= 60 and (t["role"] == "predicted").sum() >= 36


def test_dp_replicas_of_a_pipeline_add_one_gradient_allreduce():
    """dp2 x pp2 on 4 GPUs: each replica is the 2-stage pipeline at half the batch, plus one
    all-reduce over the 2 replicas of a rank's share of the gradients (parameters / 2 stages,
    in the storage dtype); 3 ranks cannot hold 2 replicas."""
    from scalelab.predict.calibration import CalPoint, Pool
    from scalelab.predict.frame import predict_one
    from scalelab.predict.models import Context
    from scalelab.predict.models.base import param_layers, storage_bytes

    local = Scenario(_vgg(strategy="local"), 1, 1)
    pool = Pool([CalPoint(local.family(), "local", None, b, t, 0.0, f"b{b}")
                 for b, t in ((64, 0.020), (256, 0.068))])  # fmt: skip
    ctx = Context(Figures(json.loads(CEILINGS.read_text()), "c.json"), None, pool)
    one = predict_one(ctx, Scenario(_vgg(batch=128), 2, 2, balance=(16, 24)))
    two = Scenario(_vgg(dp=2, engine="torch", ranks=4), 4, 4, balance=(16, 24))
    pred = predict_one(ctx, two)
    grads = sum(p for _, p, _ in param_layers(two)) * storage_bytes(two) / 2
    assert pred.phases["dp_allreduce"] == pytest.approx(ctx.fabric(two, "nccl").allreduce(grads, 2))
    assert {k: v for k, v in pred.phases.items() if k != "dp_allreduce"} == pytest.approx(
        one.phases
    )
    assert pred.throughput == pytest.approx(256 / pred.seconds)
    bad = Scenario(_vgg(dp=2, engine="torch", ranks=3), 3, 3)
    assert "do not split into --dp 2" in predict_one(ctx, bad).feasible


def test_torchs_multi_stage_schedules_are_replayed_from_torchs_order():
    """VGG-16 over 2 ranks, 8 micro-batches, under torch's schedules on GPUs: the replay of
    torch's own lowered lists over the S x V stages. Interleaving V = 2 stages per rank keeps
    the work (compute within the cut's imbalance) and shrinks the bubble below 1F1B's, towards
    (K - 1) / V stage-times (measured 79.95 ms against 156.92 with the timing sync
    the engine had before, which held the ranks in lock-step; tests/test_torch_pipelining.py
    replays both); it pays a send at every one of the 2K - 1 cuts; the V-shaped zbv holds
    stages 0 and 3 on rank 0. GPipe and 1F1B (fused transfers) keep the prediction of
    scalelab's own schedule simulation, the same as the hand engine's."""
    from scalelab.errors import UsageError
    from scalelab.predict.calibration import CalPoint, Pool
    from scalelab.predict.frame import predict_one
    from scalelab.predict.models import Context

    local = Scenario(_vgg(strategy="local"), 1, 1)
    pool = Pool([CalPoint(local.family(), "local", None, b, t, 0.0, f"b{b}")
                 for b, t in ((64, 0.020), (256, 0.068))])  # fmt: skip
    ctx = Context(Figures(json.loads(CEILINGS.read_text()), "c.json"), None, pool)

    def pred(schedule: str, v: int = 1, engine: str = "torch"):
        cfg = _vgg(engine=engine, ranks=2, stages=2, schedule=schedule, virtual_stages=v)
        out = predict_one(ctx, Scenario(cfg, 2, 2))
        assert out.feasible is None and out.seconds == pytest.approx(sum(out.phases.values()))
        return out

    one, inter, zbv = pred("1f1b"), pred("interleaved-1f1b", 2), pred("zbv")
    assert inter.phases["compute"] == pytest.approx(one.phases["compute"], rel=0.1)
    assert inter.phases["bubble"] < 0.6 * one.phases["bubble"]  # (K - 1) / V, with imbalance
    assert inter.phases["p2p"] > one.phases["p2p"]
    for name in ("gpipe", "1f1b"):  # scalelab's own simulation of their fused transfers
        assert pred(name).phases == pytest.approx(pred(name, engine="scalelab").phases)
    assert "conv" in zbv.where["compute"] and "fc8" in zbv.where["compute"]  # 0 and 3: a V
    with pytest.raises(UsageError, match="one stage per rank"):
        predict_one(ctx, Scenario(_vgg(engine="torch", ranks=2, stages=2, virtual_stages=2), 2, 2))


def test_torch_pipelinings_forward_host_work_is_calibrated_on_a_one_rank_run():
    """The runtime's forward host work H per micro-batch, from a one-rank GPipe run of the
    family: one stage, M forwards issued back to back, each ending no sooner than the host
    issued it (M H), then the M backwards on the device: M (H + b), against M (f + b)
    without it; a run the model does not reproduce within 5% is said in a note; without
    such a run the note says the forwards are device-bound."""
    from scalelab.predict.calibration import CalPoint, Pool
    from scalelab.predict.frame import predict_one
    from scalelab.predict.models import Context
    from scalelab.predict.models.pipeline import NO_HOST, PipelineModel

    local = Scenario(_vgg(strategy="local"), 1, 1)
    singles = [CalPoint(local.family(), "local", None, b, t, 0.0, f"b{b}")
               for b, t in ((64, 0.020), (256, 0.068))]  # fmt: skip
    figures = Figures(json.loads(CEILINGS.read_text()), "c.json")
    bare = Context(figures, None, Pool(singles))
    one = _vgg(engine="torch", ranks=1, stages=1, schedule="gpipe", microbatches=8)
    lay = PipelineModel()._layout(bare, Scenario(one, 1, 1))
    f, m = lay.t_stage[0] / 3, 8
    host = 3 * f  # host-bound forwards

    def ctx_with(measured: float) -> Context:
        run = CalPoint(local.family(), "pipeline", None, one.batch, measured, 0.0, "pp.jsonl:1",
                       cfg=one, forward_host_s=host)  # fmt: skip
        return Context(figures, None, Pool([*singles, run]))

    expected = m * (host + 2 * f)
    pred = predict_one(ctx_with(expected), Scenario(one, 1, 1))
    assert pred.calibration["pp.jsonl:1"] == "pipelining host cost"
    assert pred.phases["host"] == pytest.approx(m * (host - f))
    assert any("pp.jsonl:1" in n and "forward host work" in n for n in pred.notes)
    assert not any("does not reproduce" in n for n in pred.notes)
    off = predict_one(ctx_with(1.5 * expected), Scenario(one, 1, 1))
    assert any("does not reproduce" in n and "pp.jsonl:1" in n for n in off.notes)
    # the one-rank pipelining run is not the bare step: the compute law ignores it
    assert predict_one(bare, Scenario(one, 1, 1)).phases["compute"] == pytest.approx(
        pred.phases["compute"]
    )
    two = _vgg(engine="torch", ranks=2, stages=2, schedule="1f1b", microbatches=8)
    assert NO_HOST in predict_one(bare, Scenario(two, 2, 2)).notes
    assert predict_one(ctx_with(expected), Scenario(two, 2, 2)).phases["host"] >= 0


def test_every_stage_of_a_cut_holds_a_layer():
    """The mlp's 5 layers in 4 stages (zbv: 2 per rank): the roofline cut puts the loss's
    rows, which no layer computes, in a stage of their own; the stage takes a layer from
    the one before it instead (no engine runs an empty stage)."""
    import re

    from scalelab.predict.calibration import Pool
    from scalelab.predict.frame import predict_one
    from scalelab.predict.models import Context

    cfg = RunConfig(workload="mlp", strategy="pipeline", engine="torch", schedule="zbv",
                    stages=2, ranks=2, train=True, batch=64)  # fmt: skip
    ctx = Context(Figures(json.loads(PLAN_CEILINGS.read_text()), "c.json"), None, Pool())
    pred = predict_one(ctx, Scenario(cfg, 2, 2))
    (note,) = [n for n in pred.notes if n.startswith("pipeline stages:")]
    counts = [int(c) for c in re.findall(r"\d+", note.split("layers")[0])]
    assert len(counts) == 4 and min(counts) >= 1 and sum(counts) == 5, note


# --- spatial: a gathered tail runs whole on the root --------------------------------------------
def _stack(ranks: int) -> Scenario:
    cfg = RunConfig(workload="deepstack", strategy="mpi", split="spatial", batch=4, image_size=8,
                    convs=2, fcs=1, num_classes=10)  # fmt: skip
    return Scenario(cfg, 1, 4).at(ranks)


def test_spatial_tail_after_the_gather_counts_whole_on_the_root():
    """deepstack at 8 x 8 over 2 ranks: rows 4 + 4, rank 0 expands input rows 0..5 (its halo)
    for the first 3x3 conv. Compute = prepare 5/8 + each trunk step / 2 + the tail (pool,
    proj, fc1, classifier) whole, since the root runs it alone after gathering the final
    maps; alexnet's dense head is still split N ways."""
    from scalelab.predict.models.spatial import critical_compute, tail_bytes

    s = _stack(2)
    trunk = trunk_of(s)
    trunk_times = {"conv1": 1.0, "conv1_relu": 0.2, "conv2": 2.0, "conv2_relu": 0.4}
    tail_times = {"pool": 0.3, "proj": 0.5, "fc1": 0.6, "classifier": 0.1}
    layers = [("prepare", 0.8), *trunk_times.items(), *tail_times.items()]
    plans = plan_trunk(trunk.geometries(), 2)
    want = 0.8 * 5 / 8 + sum(trunk_times.values()) / 2 + sum(tail_times.values())
    assert critical_compute(layers, trunk, plans, 2) == pytest.approx(want)
    one = plan_trunk(trunk.geometries(), 1)
    assert critical_compute(layers, trunk, one, 1) == pytest.approx(sum(t for _, t in layers))
    # gathered: (4 items, 64 channels, 8 rows, 8 columns) float32
    assert tail_bytes(s, trunk) == 4 * 64 * 8 * 8 * 4
    cfg = RunConfig(workload="alexnet", strategy="mpi", split="spatial", batch=4, image_size=67)
    dense = trunk_of(Scenario(cfg, 1, 4).at(2))
    assert not dense.rest and dense.head
    head = [(name, 1.0) for name in ("fc6", "fc7", "fc8")]
    plans = plan_trunk(dense.geometries(), 2)
    assert critical_compute(head, dense, plans, 2) == pytest.approx(1.5)  # 3 s of head / 2


def test_spatial_tail_prediction_gathers_the_maps_and_sums_nothing():
    from scalelab.predict.frame import predict_one
    from scalelab.predict.models.spatial import tail_bytes

    ctx = _alexnet_ctx()
    s = _stack(2)
    pred = predict_one(ctx, s)
    assert pred.phases["allreduce"] == 0.0  # no dense head, no LayerNorm
    fabric = ctx.fabric(s, "mpi")
    assert pred.phases["gather"] == pytest.approx(fabric.scatter(tail_bytes(s, trunk_of(s)), 2))


def test_profiled_runs_calibrate_nothing():
    """A --trace run's times carry torch.profiler's overhead (a traced 2-GPU resnet18
    step read as 70 ms of DDP host cost per step): such records are skipped, and said."""
    from scalelab.predict.points import discover

    traced = FIXTURES / "profiled_runs.jsonl"  # a --trace study's records, 2 GPUs
    found = discover(traced)
    assert not any(p.singles or p.multis for p in found.pools.values())
    assert any(k.startswith("profiled runs (--trace") for k in found.skipped)


def _step_curve(batch=8, lockstep=True):
    """A curve timed on AlexNet's own forward at `batch` items (a step's curve): alone 0.5 s,
    the slowest process's mean 1.5x at 4 processes, the slowest call per lockstep round 1.9x."""
    dtype = RunConfig(workload="alexnet").dtype
    curve = {"ranks": [1, 2, 4, 8], "slowdown": [1.0, 1.1, 1.2, 1.3],
             "slowdown_max": [1.0, 1.2, 1.5, 2.1], "seconds": [0.5, 0.55, 0.6, 0.65],
             "step": {"workload": "alexnet", "model": None, "train": False,
                      "dtype": dtype, "batch": batch, "threads": 1}}  # fmt: skip
    if lockstep:  # the median call alone (0.4 s) in place of the mean (seconds[0])
        curve["slowdown_lockstep"] = [1.0, 1.3, 1.9, 2.6]
        curve["seconds_lockstep"] = [0.4, 0.52, 0.76, 1.04]
    return curve


def test_a_curve_of_the_ranks_own_step_gives_their_compute():
    """4 single-threaded ranks of 32 images each compute 8: a curve timed on the forward at
    8 items says the step alone in place of the calibration law's value at 8 (its lockstep
    rounds' median call, 0.4 s) times the lockstep slowdown at 4 (1.9); without lockstep
    rounds, its mean call alone (0.5 s) times the slowest process's mean (1.5); a curve
    of another batch (16) or of several-thread ranks is read as the plain curve is."""
    from scalelab.predict.frame import predict_one

    def compute(curve, threads=1, ranks=4):
        cfg = RunConfig(workload="alexnet", strategy="mpi", split="batch", batch=32,
                        threads=threads)  # fmt: skip
        p = predict_one(_alexnet_ctx(curve), Scenario(cfg, 1, 64).at(ranks))
        return sum(p.phases.get(k, 0.0) for k in ("launch", "compute")), p.notes

    plain_curve = {k: v for k, v in _step_curve().items() if k != "step"}
    plain, plain_notes = compute(plain_curve)
    lock, notes = compute(_step_curve())
    assert lock == pytest.approx(1.9 * 0.4)
    assert any("lockstep round" in n and "x1.9" in n for n in notes)
    assert any("alone 400 ms" in n for n in notes)
    assert not any("alone 4" in n for n in plain_notes)
    no_lock, notes = compute(_step_curve(lockstep=False))
    assert no_lock == pytest.approx(1.5 * 0.5)
    assert any("compute x1.5" in n for n in notes) and not any("lockstep" in n for n in notes)
    assert plain != pytest.approx(0.75)  # the calibration law differs from the step alone
    # not this rank's step: the plain curve's prediction exactly
    assert compute(_step_curve(batch=16))[0] == pytest.approx(plain)
    assert compute(_step_curve(), ranks=2)[0] == pytest.approx(compute(plain_curve, ranks=2)[0])
    assert compute(_step_curve(batch=4), threads=2, ranks=8)[0] == pytest.approx(
        compute(plain_curve, threads=2, ranks=8)[0]
    )
