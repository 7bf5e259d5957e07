"""A figure scalelab prints agrees with the figures beside it, or carries a flag
saying which assumption broke. One test (or a few) per kind of disagreement seen, on
constructed records or cheap real runs (tiny fp64 models, one thread)."""

from __future__ import annotations

import pytest
import torch

from scalelab.instrument import threads as T
from scalelab.orchestration.strategy_roles import strategy_roles
from scalelab.record import read_records


# --- 1. threads chosen from the CPUs free for the run -----------------------------------------
@pytest.mark.parametrize(
    "allowed, ranks, others, default, want, busy",
    [
        (2, 1, 1.95, 2, 1, True),  # a 2-core host under load: one thread
        (2, 1, 0.0, 2, 2, False),  # an idle host: torch's default
        (4, 2, 0.0, 4, 2, False),  # two ranks share four idle CPUs
        (4, 2, 3.5, 4, 1, True),  # ... a busy host: one per rank
        (16, 1, 0.0, 4, 4, False),  # never above torch's default
        (2, 4, 0.0, 2, 1, False),  # more ranks than CPUs: one each (oversubscription warns)
        (8, 2, None, 8, 4, False),  # no /proc/stat: the allowance shared
    ],
)
def test_threads_are_the_free_cpus_share(allowed, ranks, others, default, want, busy):
    got = T.choose(allowed, "affinity", ranks, others, default)
    assert got.threads == want and got.source == "chosen"
    assert got.why.startswith("host busy") == busy, got.why
    assert f"torch's default {default}" in got.why


def test_threads_given_or_on_a_gpu_are_not_chosen(monkeypatch):
    assert T.pick(3, "cpu", 1, 2).threads == 3
    monkeypatch.setattr(T, "others_busy", lambda cpus: pytest.fail("no need to look"))
    monkeypatch.setattr(T.host_checks, "cpu_allowance", lambda **kw: (2.0, "affinity"))
    assert T.pick(None, "cpu", 2, 2).threads == 1  # two ranks on two CPUs: one each, no look
    assert T.pick(None, "cuda", 1, 8) == T.ThreadChoice(
        threads=8, source="torch default", why=T.pick(None, "cuda", 1, 8).why
    )


def test_a_run_on_a_busy_host_takes_one_thread_and_says_why(cli, tmp_path, monkeypatch):
    """No --threads, others keep every CPU busy: the run takes one thread (torch's default is
    put back after it), the record and the summary say what was chosen and why."""
    from scalelab.instrument import host_checks

    if torch.get_num_threads() < 2:
        pytest.skip("torch's default is one thread here: nothing to choose")
    monkeypatch.setattr(host_checks, "cpu_allowance", lambda **kw: (4.0, "affinity"))
    monkeypatch.setattr(T, "others_busy", lambda cpus, seconds=0.1: 4.0)
    before = torch.get_num_threads()
    out = tmp_path / "runs.jsonl"
    code, stdout, err = cli("run", "mlp", "--hidden", 16, "--batch", 8, "--iters", 2,
                            "--dtype", "fp64", "--out", out)  # fmt: skip
    assert code == 0, err
    assert torch.get_num_threads() == before
    (rec,) = read_records(out)
    assert rec["threads"]["threads"] == 1 == rec["host"]["torch_threads"]
    assert rec["threads"]["source"] == "chosen" and "host busy" in rec["threads"]["why"]
    assert "threads: 1 per rank (chosen: host busy" in stdout
    code, stdout, err = cli("run", "mlp", "--hidden", 16, "--batch", 8, "--iters", 2,
                            "--dtype", "fp64", "--threads", 1, "--out", out)  # fmt: skip
    assert code == 0, err
    assert read_records(out)[-1]["threads"]["source"] == "--threads"


# --- 7. predict --calibrate names its runs, prefers unwarned ones, checks measured rows -------
FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "predict"


def _alexnet_records(tmp_path, two_rank_scale: float):
    """The fixture's alexnet mpi --split spatial records at 1 and 2 ranks, led by a warned
    1-rank copy ten times slower (a local run at CV 87%); the 2-rank run's wall
    scaled by two_rank_scale."""
    import json

    recs = [json.loads(x) for x in (FIXTURES / "mpi_scaling_h200x2.jsonl").open()][:2]
    slow = json.loads(json.dumps(recs[0]))
    slow["warnings"] = ["unstable timing: CV 87% over 5 iterations"]
    slow["wall_s"] *= 10
    slow["phases"] = {k: v * 10 for k, v in slow["phases"].items()}
    recs[1]["wall_s"] *= two_rank_scale
    path = tmp_path / f"runs{two_rank_scale}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [slow, *recs]))
    return path


@pytest.mark.parametrize("scale, flagged", [(1.0, False), (0.2, True)])
def test_predict_calibrate_names_prefers_and_checks(cli, tmp_path, scale, flagged):
    runs = _alexnet_records(tmp_path, scale)
    code, out, err = cli(
        "predict", "alexnet", "--strategy", "mpi", "--split", "spatial", "--batch", 32,
        "--threads", 1, "--ranks", "1,2", "--ceilings", FIXTURES / "ceilings_h200x2.json",
        "--calibrate", runs, "--no-plots",
    )  # fmt: skip
    assert code == 0, err
    used = next(line for line in out.splitlines() if line.startswith("- calibrated on:"))
    assert f"{runs.name}:2 (compute)" in used and f"{runs.name}:1" not in used  # unwarned
    row = next(line.split() for line in out.splitlines() if line.split()[:2] == ["2", "1"])
    assert "measured_ms" in out  # the measured 2-rank run is shown beside the prediction
    assert ("disagrees" in " ".join(row)) == flagged
    assert ("beyond 10%" in out) == flagged


# --- 8. FLOPs on the path the run takes: attention's fast path counted ------------------------
ATTENTION_NETS = """
from torch import nn


class Enc(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.emb = nn.Linear(16, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        h = self.emb(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head((h + a).mean(1))


def enc():
    return Enc()


def stack():
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return nn.Sequential(encoder, nn.Flatten(), nn.Linear(160, 3))
"""


def _attention_workload(tmp_path, factory):
    from scalelab.config import RunConfig
    from scalelab.workloads import WORKLOADS

    path = tmp_path / "attention_nets.py"
    path.write_text(ATTENTION_NETS)
    cfg = RunConfig(workload="model", model=f"{path}:{factory}", input_shape="10,16")
    return WORKLOADS.get("model")(cfg), path


def test_multihead_attention_flops_match_the_formula(cli, tmp_path):
    """S 10 tokens, E 32: embed 2*16*32*S, in-projection 2*E*3E*S, QK^T and AV 2*S*S*E each,
    out-projection 2*E*E*S, head 2*E*4. In eval the fused fast path ran and counted none of
    the attention (10,496 of 105,216)."""
    s, e = 10, 32
    want = 2 * 16 * e * s + 2 * e * 3 * e * s + 2 * (2 * s * s * e) + 2 * e * e * s + 2 * e * 4
    workload, path = _attention_workload(tmp_path, "enc")
    assert workload.flops_per_item() == pytest.approx(want, rel=0.01)
    code, out, err = cli("layers", "--model", f"{path}:enc", "--input-shape", "10,16",
                         "--batch", 100)  # fmt: skip
    assert code == 0, err
    total = next(line.split() for line in out.splitlines() if line.startswith("total"))
    assert float(total[-1]) == pytest.approx(want * 100 / 1e6, abs=0.05)
    assert torch.backends.mha.get_fastpath_enabled()  # put back


def test_encoder_layer_flops_match_torchs_counter_on_the_unfused_path(tmp_path):
    """nn.TransformerEncoderLayer in eval runs `_transformer_encoder_layer_fwd` (0 FLOPs to
    FlopCounterMode); in training mode torch runs (and counts) every op: the same count."""
    from torch.utils.flop_counter import FlopCounterMode

    workload, _ = _attention_workload(tmp_path, "stack")
    model = workload.build_model().train()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.randn(1, 10, 16))
    assert counter.get_total_flops() > 0
    assert workload.flops_per_item() == pytest.approx(counter.get_total_flops(), rel=0.01)


# --- 9. no `nan ms`, no 0.000 MB for a 12 kB scatter -------------------------------------------
def test_fit_estimates_print_no_nan(cli):
    """On a CPU without --mem-limit the tries are estimated, not run: no step time to print."""
    code, out, err = cli("fit", "mlp", "--hidden", 16, "--find", "batch", "--most", 4)
    assert code == 0, err
    assert "nan" not in (out + err).lower()
    assert "fits (estimated, not run)" in err and "no step times" in err


def test_phases_table_shows_small_transfers():
    import pandas as pd

    from scalelab.cli.commands.phases import format_run

    table = pd.DataFrame([{"rank": 0, "op": "scatter", "calls": 3, "time_s": 0.01,
                           "wait_s": 0.002, "transfer_s": 0.008, "unmatched_s": 0.0,
                           "bytes": 12_288, "waited_for": 1}])  # fmt: skip
    summary = {"straggler": None, "blame_s": {}, "overlap_fraction": [None]}
    text = format_run({"id": "x", "workload": "mlp", "strategy": "mpi", "ranks": 2}, table, summary)
    row = next(line.split() for line in text.splitlines() if "scatter" in line)
    assert row[-1] == "0.01229"  # MB, the last column (3 decimals read 0.012, 0.4 kB 0.000)


# --- 5. one unit per column; no CV for one repetition -----------------------------------------
def _train_record(rid, epochs, steps, wall, spread):
    return {"id": rid, "status": "ok", "workload": "mlp", "strategy": "local", "mode": "train",
            "ranks": 1, "items": steps * 100, "steps": steps, "wall_s": wall,
            "throughput": steps * 100 / wall, "config": {"batch": 100, "train": True,
            "epochs": epochs}, "wall_spread_s": spread}  # fmt: skip


def test_training_table_gives_per_step_spread_and_no_cv_for_one_epoch(tmp_path):
    import re

    from scalelab.analysis.report import Page, runs_section

    four = _train_record("four", 4, 40, 4.0, {"n": 4, "iqr": 0.4, "cv": 0.1, "min": 0.9,
                                              "max": 1.1, "median": 1.0})  # fmt: skip
    one = _train_record("one", 1, 10, 1.0, {"n": 1, "iqr": 0.0, "cv": 0.0, "min": 1.0,
                                            "max": 1.0, "median": 1.0})  # fmt: skip
    _, _, body = runs_section([four, one], Page(tmp_path, plots=False))
    head = re.findall(r"<th[^>]*>([^<]*)</th>", body)
    rows = [re.findall(r"<td[^>]*>([^<]*)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", body)]
    rows = [dict(zip(head, r)) for r in rows if r]
    assert "IQR ms" not in head and "IQR ms/iter" in head
    assert rows[0]["ms/iter"] == "100.000" and rows[0]["IQR ms/iter"] == "40.000"  # 0.4 s/10
    assert rows[0]["CV"] == "10.0%"
    assert rows[1]["CV"] == "" and rows[1]["IQR ms/iter"] == ""  # one epoch: no spread


def test_one_repetition_has_no_spread_in_the_summary():
    from scalelab.instrument.stats import spread_text

    text = spread_text({"n": 1, "iqr": 0.0, "cv": 0.0, "min": 0.5, "max": 0.5})
    assert "CV" not in text and "one repetition" in text


# --- 3. system roofline points above the model flagged ----------------------------------------
def test_system_points_above_their_model_are_flagged():
    """The fixture's runs sit on their pooled model (none flagged); pool one run faster than
    the others (its compute phases halved) and the pooled model falls below it: flagged."""
    import dataclasses
    import json
    from pathlib import Path

    from scalelab.analysis import system_roofline as S

    recs = read_records(Path(__file__).parent / "fixtures" / "system_roofline.jsonl")
    peaks = S.estimate_peaks(recs)
    assert (S.system_points(recs, peaks)["flag"] == "").all()
    low = dataclasses.replace(peaks, p_flops=peaks.p_flops / 2)  # a peak measured too low
    pts = S.system_points(recs, low)
    above = pts[["measured", "measured_phases"]].max(axis=1) > pts["model"] * 1.01
    assert above.any() and (pts.loc[above, "flag"] == S.ABOVE_MODEL).all()
    assert (pts.loc[~above, "flag"] == "").all()
    assert json.loads(pts.to_json(orient="records"))[0].keys() >= {"flag", "model"}


# --- 2. per-layer times add up to their wall; same-shape layers far apart flagged -------------
def _layer_record(wall_s, layers):
    return {"id": "r", "status": "ok", "workload": "alexnet", "strategy": "local",
            "mode": "infer", "ranks": 1, "items": 8, "wall_s": wall_s, "precision": "fp32",
            "config": {"workload": "alexnet", "batch": 8, "device": "cpu", "dtype": "fp32"},
            "per_layer": [{"layer": n, "kind": "Conv2d", "seconds": s, "calls": 3}
                          for n, s in layers]}  # fmt: skip


@pytest.mark.parametrize("wall_s, flagged", [(0.3, False), (0.06, True)])
def test_layer_table_adds_up_to_the_wall(wall_s, flagged):
    from scalelab.analysis import layers as L

    rec = _layer_record(wall_s, [("c1", 0.02), ("c3", 0.0678), ("c5", 0.00108)])
    t = L.layer_table([rec])
    assert t["ms"].sum() == pytest.approx(wall_s * 1e3)  # the rest row closes the sum
    rest = t[t["layer"] == L.REST].iloc[0]
    assert rest["flag"].startswith(L.EXCEEDS) == flagged and (rest["ms"] < 0) == flagged


def test_same_shape_layers_far_apart_are_flagged():
    """AlexNet's c3 and c5 do the same FLOPs on the same bytes: 67.8 ms against 1.08 ms (a
    busy-host run) flags both; c1 and c4 stay unflagged."""
    import json
    from pathlib import Path

    from scalelab.analysis import roofline

    ceilings = json.loads((Path(__file__).parent / "fixtures" / "ceilings_cpu.json").read_text())
    rec = _layer_record(0.3, [("c1", 0.02), ("c3", 0.0678), ("c4", 0.03), ("c5", 0.00108)])
    df = roofline.layer_roofline([rec], ceilings).set_index("layer")
    assert df.loc["c3", "flops"] == df.loc["c5", "flops"]
    assert "slower than c5 (same shape)" in df.loc["c3", "flag"]
    assert "faster than c3 (same shape)" in df.loc["c5", "flag"]
    assert "same shape" not in df.loc["c1", "flag"] + df.loc["c4", "flag"]
    rec["per_layer"][3]["seconds"] = 0.05  # within 3x of c3: nothing to flag
    df = roofline.layer_roofline([rec], ceilings)
    assert not df["flag"].str.contains("same shape").any()


# --- 6. ceilings: a torch GEMM below NumPy's one core, an unstable figure, both said ----------
def test_torch_fp64_gemm_below_numpy_on_one_core_is_a_violation():
    from scalelab.instrument import ceiling_checks as CC

    data = {"device": "cpu", "gemm_flops": {"fp64": 20.8e9, "fp32": 60e9},
            "cpu_gemm_flops": {"one_core": 46.3e9, "all_cores": 80e9, "cores": 2}}  # fmt: skip
    assert [s for s, why in CC.violations(data) if "NumPy fp64 on one core" in why] == ["gemm"]
    data["gemm_flops"]["fp64"] = 50e9
    assert CC.violations(data) == []


def test_ceilings_keep_their_spread_and_name_an_unstable_one():
    import torch

    from scalelab.instrument import ceiling_checks as CC
    from scalelab.instrument import ceilings as C

    plan = C.Plan((48,), (1 << 20,), 0, (48,), 1 << 20, 0.002, 3, 0.05)
    got = C.gemm_flops(torch.device("cpu"), plan, ["fp64"])
    rows = got["detail"]["fp64"]
    assert rows and all(r["spread"] >= 0 and r["repeats"] == 3 for r in rows)
    steady = {"device": "cpu", "gemm_flops": {"fp64": 5e10, "detail": {"fp64": [
        {"n": 512, "flops": 5e10, "spread": 0.05, "repeats": 5}]}}}  # fmt: skip
    assert CC.unstable_notes(steady) == []
    shaky = {**steady, "gemm_flops": {"fp64": 5e10, "detail": {"fp64": [
        {"n": 512, "flops": 5e10, "spread": 1.05, "repeats": 5}]}},
        "mem_bw_detail": [{"bytes": 1, "Bps": 6.4e9, "spread": 6.3, "repeats": 3}]}  # fmt: skip
    notes = CC.unstable_notes(shaky)
    assert len(notes) == 2 and "fp64 GEMM" in notes[0] and "105% slower" in notes[0]
    assert "memory copy" in notes[1]
    CC.self_check(shaky, {})
    assert set(notes) <= set(shaky["warnings"])  # written into the file, never silent


# --- 4. start-up skew kept out of the steps; a rank's wall above the run's flagged ------------
def test_training_starts_its_clock_after_every_rank_arrived(cli, tmp_path, monkeypatch):
    """The ranks meet at a barrier before the first timed step: a rank that arrives late
    (here: the barrier takes 2 s) is not charged to anyone's first step."""
    import time

    from scalelab.comm.base import SelfComm
    from scalelab.train.loop import Trainer

    events = []

    def late_barrier(self):
        events.append("barrier")
        time.sleep(2.0)

    step = Trainer.train_step
    monkeypatch.setattr(SelfComm, "barrier", late_barrier)
    monkeypatch.setattr(Trainer, "train_step", lambda s, b: events.append("step") or step(s, b))
    out = tmp_path / "runs.jsonl"
    code, _, err = cli("run", "mlp", "--train", "--hidden", 16, "--batch", 50, "--steps", 2,
                       "--train-size", 100, "--heldout-size", 50, "--threads", 1,
                       "--dtype", "fp64", "--quiet", "--out", out)  # fmt: skip
    assert code == 0, err
    assert events[:3] == ["barrier", "step", "step"]
    (rec,) = read_records(out)
    assert rec["wall_s"] < 2.0 and rec["time_to_train_s"] < 2.0


def test_a_ranks_wall_above_the_runs_is_flagged():
    from scalelab.instrument.host_checks import rank_wall_warning

    (warn,) = rank_wall_warning(0.241, [0.241, 0.624])  # a one-epoch 2-rank mpi-dp run
    assert warn.startswith("rank skew: rank 1's wall 624 ms is 2.59x the run's 241 ms")
    assert rank_wall_warning(0.241, [0.241, 0.26]) == []
    assert rank_wall_warning(0.001, [0.001, 0.0025]) == []  # within the 2 ms slack
    assert rank_wall_warning(0.241, None) == []


# --- the report: every contradiction above absent or flagged ----------------------------------
def test_report_from_constructed_records_flags_every_contradiction(tmp_path):
    """A busy host's contradictions, as records: AlexNet's per-layer run (c3 62x c5, layers
    above the wall), a one-epoch 2-rank training run with a rank's wall above the run's,
    the system roofline's runs, ceilings with an unstable figure. The page names each."""
    import json
    from pathlib import Path

    from scalelab.analysis.report import write_report
    from scalelab.instrument.host_checks import rank_wall_warning

    fixtures = Path(__file__).parent / "fixtures"
    layers = _layer_record(0.06, [("c1", 0.02), ("c3", 0.0678), ("c4", 0.03), ("c5", 0.00108)])
    train = _train_record("skew", 1, 10, 0.241, {"n": 1, "iqr": 0.0, "cv": 0.0, "min": 0.241,
                                                  "max": 0.241, "median": 0.241})  # fmt: skip
    train.update(strategy="mpi-dp", ranks=2, rank_wall_s=[0.241, 0.624],
                 warnings=rank_wall_warning(0.241, [0.241, 0.624]))  # fmt: skip
    system = read_records(fixtures / "system_roofline.jsonl")
    ceilings = json.loads((fixtures / "ceilings_cpu.json").read_text())
    ceilings["warnings"] = [
        "unstable ceiling: fp32 GEMM 1.94e+11 FLOP/s is the best of 3 "
        "blocks whose median was 105% slower (host busy? re-measure)"
    ]
    page = write_report(
        [layers, train, *system], tmp_path, ceilings, plots=False, roles=strategy_roles()
    )
    text = page.read_text()
    for said in ("slower than c5 (same shape)", "faster than c3 (same shape)",
                 "layers exceed the wall", "rank skew: rank 1", "unstable ceiling",
                 "IQR ms/iter"):  # fmt: skip
        assert said in text, said
    assert '<th class="text">flag</th>' in text or ">flag<" in text  # the system table's
    assert "CV 0.0%" not in text
