"""`scalelab predict --validate` against the checked-in measurements (tests/fixtures/predict,
copies of benchmarks/results; the 4x H200 host's study; and, slow, the frozen copy of every
device record): the accuracy bar, which points calibrate and which are predicted, the files
skipped and why, the held-out (leave-one-out) error, and each file paired with its own host's
ceilings."""

import json
import shutil

import pytest

from predict_helpers import CEILINGS, COMMITTED, FIXTURES, FOUR_GPUS
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.predict.models.spatial import halo_bytes, trunk_of
from scalelab.predict.points import discover
from scalelab.predict.scenario import Scenario
from scalelab.predict.validate import UNCALIBRATED, _count_once, validate
from scalelab.strategies.halo import plan_trunk


@pytest.fixture(scope="module")
def validation():
    return validate(FIXTURES, None, None)


# --- the accuracy bar on the checked-in measurements ------------------------------------------
def test_validate_is_within_10_percent_on_the_fixtures(validation):
    t = validation.table
    assert len(t) == 14
    assert validation.mape() <= 10.0
    assert validation.mape(predicted_only=True) <= 10.0
    assert t["error_pct"].abs().max() <= 15.0, t[["source", "error_pct"]]
    assert validation.outside().empty


def test_calibration_points_are_named(validation):
    roles = validation.table.set_index("source")["role"]
    assert (roles == "predicted").sum() == 7
    # a GPU rank's cost per call beside the other rank: the 2-GPU mpi-gpu run's compute phase
    assert roles["mpi_scaling_h200x2.jsonl:6"] == "calibration (GPU ranks' compute)"
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


# --- the 4x H200 host's study ------------------------------------------------------------------
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
    # every 4-GPU point is a prediction but the mpi-gpu run whose compute phase shows the
    # 4-GPU ranks' cost per forward call for the nccl run (models/split.py: beside)
    assert len(four) == 6
    roles = t.set_index("source")["role"]
    assert roles["mpi_scaling_h200x4.jsonl:14"] == "calibration (GPU ranks' compute)"
    # + 9 alexnet CPU-rank points; of the pipeline records only the one-stage runs remain:
    # the multi-stage ones predate the root's host prefetch and are skipped (points.py).
    assert len(t) == 30


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


def test_a_file_of_gpu_runs_takes_the_ceilings_measured_on_the_gpu(tmp_path):
    """A host's folder holds ceilings_cpu.json (measured on its CPU) and ceilings_gpu.json
    (on its GPU, its CPU figures too), and a results file of CPU and GPU runs: the GPU
    file serves it whatever the names (a CPU file named closer to it included), so no GPU
    point is left out for a cuda figure the CPU file cannot hold."""
    shutil.copytree(COMMITTED / "holdout_strategies_h200x2_2026-11-26", tmp_path / "h")
    for part in ("cal", "measure"):
        folder = tmp_path / "h" / part
        cpu, gpu = (json.loads((folder / f"ceilings_{d}.json").read_text()) for d in ("cpu", "gpu"))
        assert (cpu["device"], gpu["device"]) == ("cpu", "cuda")
        (folder / "ceilings_cpu.json").rename(folder / "holdout_mixed_ceilings.json")
    v = validate(tmp_path / "h", None, None, held_out=False)
    assert v.ceilings["holdout_mixed_measured.jsonl"].startswith("ceilings_gpu.json")
    assert v.ceilings["holdout_mixed_calibration.jsonl"].startswith("ceilings_gpu.json")
    assert not [k for k in v.skipped if "measured on cuda" in k], v.skipped


def test_profiled_runs_calibrate_nothing():
    """A --trace run's times carry torch.profiler's overhead (a traced 2-GPU resnet18
    step read as 70 ms of DDP host cost per step): such records are skipped, and said."""
    from scalelab.predict.points import discover

    traced = FIXTURES / "profiled_runs.jsonl"  # a --trace study's records, 2 GPUs
    found = discover(traced)
    assert not any(p.singles or p.multis for p in found.pools.values())
    assert any(k.startswith("profiled runs (--trace") for k in found.skipped)


# --- predict's accuracy bar over the repository's own benchmark results ------------------------
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
    # The held-out GPU studies (files holdout_* and clock_mpi_holdout_*: plan calibrations and
    # verifications, and DDP, FSDP, pipeline and MPI runs of resnet18-cifar, VGG-16 and a GPT
    # on 2x H200; heldout_*: the model-parallel study on 4x H200) were each compared with the
    # predictions made before they were measured (their folders' predict-vs-measured.md, the
    # model-parallel README); their records calibrate nothing here and lie outside this scope.
    # So are the transformer speed benchmark's bf16 runs at GPT-2 small's shape (speed_*),
    # which no calibration record here covers.
    held = ("holdout_", "clock_mpi_holdout_", "heldout_", "speed_")
    # a source names its file, or its path where two files share a name
    studies = v.table["source"].str.split("/").str[-1].str.startswith(held)
    v.table = v.table[~studies]  # `scored` follows the table
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


# --- one measurement, one point; FSDP's host cost from its own unit size ------------------------
def test_a_record_filed_twice_is_one_point_and_fsdp_calibrates_on_its_unit_size(tmp_path):
    """The fsdp unit-size study's records (2x H200: per block, 40 MB and 1000 MB units, on 1
    and 2 ranks) filed in two folders under one name: each measurement is scored once, the
    sources name the folder where the names collide, and every 2-rank point takes FSDP's host
    cost from runs of its own unit size (none other would calibrate it): the one-rank run's,
    and the 2-rank run's own under its process group (each is its own anchor, as a DDP run
    is for DDP's host cost, so the study alone leaves nothing predicted)."""
    study = COMMITTED / "fsdp_units_h200x2" / "speed_records.jsonl"
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        shutil.copy(study, tmp_path / folder / study.name)
    shutil.copy(COMMITTED / "ceilings_h200x2.json", tmp_path)
    records = [json.loads(line) for line in study.read_text().splitlines() if line.strip()]
    with pytest.raises(UsageError, match="3 calibration \\(FSDP host cost\\)"):
        validate(tmp_path, None, None, held_out=False)
    found = discover(tmp_path)
    _count_once(found)
    copies = found.skipped["copies of a measurement counted once (the same record elsewhere)"]
    assert copies == len(found.points) > 0  # b's copy of every point a holds
    assert all(p.source.startswith("a/speed_records.jsonl:") for p in found.points)
    two = [p for p in found.points if p.scenario.cfg.strategy == "fsdp" and p.scenario.ranks == 2]
    assert len(two) == 3  # per block, 40 MB, 1000 MB
    unit_of = {f"a/{study.name}:{n}": r["config"].get("fsdp_unit_mb")
               for n, r in enumerate(records, 1)}  # fmt: skip

    found = discover(tmp_path)
    pool = found.pools[tmp_path / "a" / study.name]
    for point in found.points:
        if point.scenario.cfg.strategy == "fsdp" and point.scenario.ranks == 2:
            single = pool.fsdp_single(point.scenario)
            assert single is not None
            assert unit_of[single.source] == point.scenario.cfg.fsdp_unit_mb
            anchor = pool.fsdp_anchor(point.scenario).source
            assert anchor == f"a/{study.name}:{point.source.rsplit(':', 1)[1]}"


def test_a_records_relative_model_file_is_found_from_any_folder(tmp_path, monkeypatch):
    """A record names `--model models/m.py:net` relative to the checkout it ran in; validate
    run from elsewhere finds the file in the first folder above the records that holds it
    (from another folder it once dropped 57 of the committed points as `no such file`)."""
    from scalelab.predict.points import _model_found

    (tmp_path / "repo" / "models").mkdir(parents=True)
    (tmp_path / "repo" / "models" / "m.py").write_text("net = None\n")
    records = tmp_path / "repo" / "results" / "study" / "runs.jsonl"
    records.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = RunConfig(workload="model", model="models/m.py:net")
    assert _model_found(cfg, records).model == f"{tmp_path / 'repo' / 'models' / 'm.py'}:net"
    for kept in ("missing/m.py:net", "torch.nn:Linear", "hf:llama", None):
        assert _model_found(RunConfig(workload="model", model=kept), records).model == kept
    monkeypatch.chdir(tmp_path / "repo")  # found from here: left as the record wrote it
    assert _model_found(cfg, records).model == "models/m.py:net"
