"""`scalelab sweep`: TOML validation (one line, exit 2), grid -> points -> command lines that
reproduce the config exactly, failure records, resumability, and a grid with real MPI ranks."""

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalelab.cli.main import build_parser
from scalelab.cli.options import config_from_args
from scalelab.orchestration.sweep import _run_process, load_study, points
from scalelab.record import read_records


def _study(tmp_path, text, name="study.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = """
[study]
name = "t"
[grid]
workload = ["alexnet"]
strategy = ["mpi"]
ranks = [1, 2]
batch_per_rank = [4]
split = ["batch", "spatial"]
[fixed]
image_size = 67
iters = 2
"""


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[grid]\nworkload=['mlp']\n[gird]\nx=1", "unknown table 'gird'"),
        ("[grid]\nworkload=['mlp']\nbatchsize=[1]", "unknown key in [grid] 'batchsize'"),
        ("[grid]\nworkload=['mlp']\n[fixed]\nitres=3", "unknown key in [fixed] 'itres'"),
        ("[study]\nname='x'\nowner='me'\n[grid]\nworkload=['mlp']", "unknown key in [study]"),
        ("[study]\nname='x'\n[fixed]\nworkload='mlp'", "empty grid"),
        ("[grid]\nworkload=['mlp']\nbatch=[]", "empty grid: [grid] batch = []"),
        ("[grid]\nworkload=['mlp']\nbatch=8", "batch must be a list"),
        ("[grid]\nworkload=['mlp']\nbatch=['8']", "batch = '8' should be int"),
        ("[grid]\nworkload=['mlp']\ntrain=[1]", "train = 1 should be bool"),
        ("[grid]\nbatch=[1]\n[fixed]\nbatch=2\nworkload='mlp'", "batch is in both"),
        ("[grid]\nbatch=[1]", "no workload"),
        ("[grid]\nworkload=['mlp']\nbatch=[1]\nbatch_per_rank=[2]", "not both"),
        ("[grid]\nworkload=['mlp']\ndtype=['fp8']", "point 1 (workload=mlp dtype=fp8)"),
        ("[grid]\nworkload=['mlp']\nstrategy=['mpii']", "unknown strategy 'mpii'"),
        ("[grid\nworkload=['mlp']", "invalid TOML"),
        ("[study]\ntimeout_s=-1\n[grid]\nworkload=['mlp']", "timeout_s must be a positive"),
    ],
)
def test_bad_study_one_line_exit_2(cli, tmp_path, text, needle):
    code, out, err = cli("sweep", _study(tmp_path, text), "--out", tmp_path / "r.jsonl")
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "r.jsonl").exists()


def test_missing_study_file(cli, tmp_path):
    code, _, err = cli("sweep", tmp_path / "none.toml")
    assert code == 2 and "no such study file" in err


def test_points_reproduce_their_config_through_the_cli(tmp_path):
    """Each point's command line, parsed by the real `run` parser, gives back its RunConfig."""
    study = load_study(_study(tmp_path, GOOD))
    pts = points(study)
    assert [p.describe() for p in pts][:2] == [
        "workload=alexnet strategy=mpi ranks=1 batch_per_rank=4 split=batch",
        "workload=alexnet strategy=mpi ranks=1 batch_per_rank=4 split=spatial",
    ]  # TOML order, last key fastest
    assert [p.config.batch for p in pts] == [4, 4, 8, 8]  # batch = batch_per_rank * ranks
    assert study.results.name == "t.jsonl"
    parser = build_parser()
    for p in pts:
        args = parser.parse_args(p.argv())
        assert config_from_args(args, workload=args.workload) == p.config
    # lr is a training option (an inference point refuses it): a training study for it
    (one,) = points(load_study(_study(tmp_path, "[grid]\nworkload=['mlp']\n[fixed]\n"
                                                "train=true\nlr=1")))  # fmt: skip
    assert one.config.lr == 1.0 and "--lr" in one.argv()
    assert json.dumps(one.config.lr) == "1.0"  # float like the CLI's, so records match


def test_records_match_across_new_config_fields(tmp_path):
    """A record written before a config field existed still marks its point done."""
    from scalelab.orchestration.sweep import config_key

    (point,) = points(load_study(_study(tmp_path, "[grid]\nworkload=['mlp']\nhidden=[16]")))
    old = point.config.to_dict()
    del old["per_layer"]  # a field this record predates (default False)
    old["retired_option"] = 3  # a field RunConfig no longer has
    assert config_key(old) == point.match_key()
    assert config_key({**old, "hidden": 17}) != point.match_key()


def test_dry_run_lists_points(cli, tmp_path):
    code, out, _ = cli("sweep", _study(tmp_path, GOOD), "--dry-run", "--out", tmp_path / "r.jsonl")
    lines = out.strip().splitlines()
    assert code == 0 and len(lines) == 5 and "4 points" in lines[0]
    assert lines[1].startswith("[1/4] todo  ")
    assert "scalelab run alexnet --strategy mpi --batch 4" in lines[1]
    # Printed commands run as printed: `scalelab ... --ranks 2` starts its launcher itself.
    assert "--split spatial" in lines[4] and "--ranks 2" in lines[4]
    exe = shlex.split(lines[1].split("todo  ", 1)[1])[0]
    assert Path(exe).name == "scalelab"
    done = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("scalelab ")
    assert "--batch" not in lines[4]  # 8 is the default: only non-default flags are passed
    assert not (tmp_path / "r.jsonl").exists()


def test_timeout_kills_the_point():
    start = time.perf_counter()
    code, err = _run_process([sys.executable, "-c", "import time; time.sleep(60)"], 0.5)
    assert code is None and "timed out after 0.5 s" in err
    assert time.perf_counter() - start < 10


def test_failed_point_is_recorded_and_skipped_then_retried(cli, tmp_path):
    """mlp rejects --image-size 40 in the run itself: the sweep records it and goes on."""
    results = tmp_path / "r.jsonl"
    text = "[grid]\nworkload=['mlp']\nimage_size=[40, 28]\n[fixed]\nhidden=8\nbatch=2\niters=1\n"
    study = _study(tmp_path, text)
    code, out, _ = cli("sweep", study, "--out", results)
    assert code == 1
    assert "[1/2] workload=mlp image_size=40: FAILED" in out and "drop --image-size 40" in out
    assert "[2/2] workload=mlp image_size=28: ok" in out
    recs = read_records(results)
    assert [r["status"] for r in recs] == ["failed", "ok"]
    assert recs[0]["source"] == "sweep" and recs[0]["exit_code"] == 2
    assert recs[0]["config"]["image_size"] == 40
    # Resume: the finished point is done, the failed one is to be tried again.
    code, out, _ = cli("sweep", study, "--out", results, "--dry-run")
    assert "[1/2] todo" in out and "[2/2] done" in out
    code, out, _ = cli("sweep", study, "--out", results, "--dry-run", "--force")
    assert "[1/2] todo" in out and "[2/2] todo" in out


@pytest.mark.mpi
def test_four_point_grid_with_real_ranks(cli, tmp_path):
    """mlp under `mpi` on 1 and 2 real ranks x 2 batches: 4 records, each with one phase
    table per rank; a second sweep runs nothing; the scaling analysis reads the results."""
    results = tmp_path / "r.jsonl"
    text = (
        "[study]\nname='grid4'\n[grid]\nworkload=['mlp']\nstrategy=['mpi']\nranks=[1, 2]\n"
        "batch=[4, 8]\n[fixed]\nhidden=32\niters=2\nwarmup=0\n"
    )
    study = _study(tmp_path, text)
    code, out, err = cli("sweep", study, "--out", results)
    assert code == 0, out + err
    recs = read_records(results)
    assert [(r["ranks"], r["config"]["batch"]) for r in recs] == [(1, 4), (1, 8), (2, 4), (2, 8)]
    assert all(r["status"] == "ok" and len(r["rank_phases"]) == r["ranks"] for r in recs)
    start = time.perf_counter()
    code, out, _ = cli("sweep", study, "--out", results)
    assert code == 0 and out.count("already, skipped") == 4 and "0 ran, 4 already done" in out
    assert time.perf_counter() - start < 5 and len(read_records(results)) == 4

    from scalelab.analysis.scaling import scaling_table

    table = scaling_table(recs)
    assert set(table["mode"]) == {"strong"} and len(table) == 4
    for _, row in table.iterrows():
        t1 = table[(table["series"] == row["series"]) & (table["ranks"] == 1)]["seconds"].item()
        assert row["efficiency"] == pytest.approx(t1 / (row["ranks"] * row["seconds"]))
    assert json.loads(json.dumps(recs[0]["config"]))["strategy"] == "mpi"


def test_example_studies_are_valid():
    """Every study under examples/ parses and gives points (no stale config keys)."""
    from pathlib import Path

    examples = sorted((Path(__file__).parents[1] / "examples").glob("*.toml"))
    assert examples
    for path in examples:
        assert points(load_study(path)), path


# The studies the seeds (/work/shared/seeds) describe: (seed, workload, what varies, the value
# a point must hold). Each needs an example under examples/ that runs it.
SEED_STUDIES = [
    ("alexnet_mpi_cuda", "alexnet", "ranks", None),  # V2: MPI ranks, halo split
    ("mnist_mlp learning rate", "mlp", "lr", None),
    ("mnist_mlp hidden size", "mlp", "hidden", None),
    ("mnist_mlp roofline", "mlp", "batch", None),
    ("mnist_mlp W1 rows / W2 columns", "mlp", "strategy", "tensor"),
    ("resnet18 ddp strong scaling", "resnet18-cifar", "ranks", None),
    ("charcnn inference", "charcnn", "batch", None),
    ("vgg ReLU/max-pool swap", "vgg16", "swap_relu_pool", True),
    ("vgg model parallel (deep stack)", "deepstack", "schedule", None),
]


@pytest.mark.parametrize("seed,workload,key,value", SEED_STUDIES, ids=[s[0] for s in SEED_STUDIES])
def test_every_seed_study_has_an_example(seed, workload, key, value):
    """Some example's points run `workload` with `key` varying across them (or holding
    `value` in one, where given)."""
    examples = sorted((Path(__file__).parents[1] / "examples").glob("*.toml"))
    for path in examples:
        cfgs = [p.config for p in points(load_study(path)) if p.config.workload == workload]
        seen = [getattr(c, key) for c in cfgs]
        if (value is not None and value in seen) or (value is None and len(set(seen)) > 1):
            return
    pytest.fail(f"no example study under examples/ for the seed's {seed}")
