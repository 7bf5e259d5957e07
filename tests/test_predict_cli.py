"""`scalelab predict` on the command line: --validate's summary, a prediction up to 1024
GPUs, the roofline bound without calibration, the bottleneck named per row, and the bad-input
errors (one line, exit 2)."""

import json
import shutil

import pytest

from predict_helpers import CEILINGS, FIXTURES


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
