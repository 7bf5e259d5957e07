"""Config sections: every field belongs to one, each section refuses its own bad values, and a
run refuses (one line, exit 2, nothing written) any option its strategy would ignore."""

import dataclasses
import subprocess
import sys

import pytest

from scalelab.analysis.frame import config_of
from scalelab.config import RunConfig, upgrade_record_config
from scalelab.config_sections import SCHEDULES, SECTIONS, check, flag
from scalelab.errors import UsageError
from scalelab.strategies import STRATEGIES


def _refused(cli, tmp_path, args, needle):
    results = tmp_path / "runs.jsonl"
    code, out, err = cli("run", *args, "--out", results)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], (code, err)
    assert "Traceback" not in err and not results.exists()
    assert not list(tmp_path.iterdir())  # nothing written, not even a folder


# One option from a section each strategy (and engine, placement) does not read.
@pytest.mark.parametrize(
    "args, needle",
    [
        (["alexnet", "--strategy", "ddp", "--train", "--stages", "4"],
         "--stages is a pipeline option; the ddp strategy does not read it"),
        (["alexnet", "--strategy", "local", "--split", "spatial"], "the local strategy"),
        (["mlp", "--strategy", "serial", "--fast"], "--fast is a fast option; the serial"),
        (["alexnet", "--strategy", "mpi", "--nonblocking"], "the mpi strategy"),
        (["alexnet", "--strategy", "mpi", "--oversubscribe-gpus"], "--oversubscribe-gpus"),
        (["alexnet", "--strategy", "nccl", "--amp", "bf16"], "--amp is an amp option; the nccl"),
        (["alexnet", "--strategy", "mpi-gpu", "--stages", "3"], "the mpi-gpu strategy"),
        (["mlp", "--strategy", "mpi-dp", "--train", "--compile"], "the mpi-dp strategy"),
        (["mlp", "--strategy", "mpi-dp", "--train", "--global-batch", "8"], "pass --batch"),
        (["mlp", "--strategy", "pipeline", "--dp", "2"],
         "--placement pipeline does not read it (--dp needs --engine torch)"),
        (["mlp", "--strategy", "pipeline", "--tp", "2"], "--tp is a tensor option"),
        (["mlp", "--strategy", "pipeline", "--engine", "torch", "--compile"],
         "the pipeline strategy with --engine torch"),
        (["mlp", "--strategy", "pipeline", "--placement", "manual", "--compile"],
         "--placement manual does not read it"),
        (["mlp", "--strategy", "tensor", "--train", "--bucket-mb", "50"], "the tensor strategy"),
        (["mlp", "--strategy", "tensor", "--engine", "torch", "--virtual-stages", "2"],
         "the tensor strategy with --engine torch"),
        # options of the other mode
        (["mlp", "--lr", "0.5"], "--lr is a train option; an inference run does not read it"),
        (["mlp", "--sync-bn"], "--sync-bn is a train option; an inference run does not read it"),
        (["mlp", "--strategy", "serial", "--train", "--bucket-mb", "50"], "the serial strategy"),
        (["mlp", "--ckpt-every", "2"], "(add --train)"),
    ],
)  # fmt: skip
def test_an_option_the_strategy_does_not_read_is_refused(cli, tmp_path, args, needle):
    _refused(cli, tmp_path, args, needle)


def test_refused_before_any_launcher_starts(tmp_path):
    """`--stages 4 --strategy ddp --ranks 2` as a user types it: one line from this process,
    no torchrun started (it would take seconds and print its own banner)."""
    out = tmp_path / "r.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "scalelab", "run", "alexnet", "--strategy", "ddp", "--train",
         "--ranks", "2", "--stages", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and not out.exists()
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "scalelab run: error: --stages is a pipeline option; the ddp strategy does not read it"
    ), line


def test_the_options_a_strategy_reads_still_run(cli, tmp_path):
    """Defaults of unread sections never trip their rules: a local run at --batch 2 is not
    held to the pipeline's 4 micro-batches."""
    code, out, err = cli("run", "mlp", "--batch", "2", "--hidden", "4", "--iters", "1",
                         "--warmup", "0", "--quiet", "--no-record")  # fmt: skip
    assert code == 0, err
    for name in STRATEGIES.names():  # every strategy declares only known sections
        cls = STRATEGIES.get(name)
        for engine in ("scalelab", "torch"):
            cfg = RunConfig(workload="mlp", strategy=name, engine=engine)
            assert set(cls.reads_for(cfg)) <= set(SECTIONS), name


def test_every_field_has_a_known_section_and_help_groups_by_section(cli):
    for f in dataclasses.fields(RunConfig):
        assert f.metadata["section"] in SECTIONS, f.name
    code, out, _ = cli("run", "--help")
    assert code == 0
    pipeline = out.index("pipeline options:")
    assert out.index("--stages", pipeline) < out.index("options:", pipeline + 20)
    assert "--global-batch" not in out  # the removed flag is refused, not advertised


def _ranged():
    for section in SECTIONS.values():
        for name, (lo, _) in section.ints.items():
            yield pytest.param(section.name, name, lo - 1, id=f"{section.name}.{name}")
        for name in section.floats:
            yield pytest.param(section.name, name, float("nan"), id=f"{section.name}.{name}")


@pytest.mark.parametrize("section, name, bad", list(_ranged()))
def test_each_sections_ranges(section, name, bad):
    with pytest.raises(UsageError, match=f"--{flag(name)} must be"):
        RunConfig(workload="mlp", **{name: bad})


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"dtype": "fp8"}, "unknown dtype"),  # run
        ({"data_dir": "/no/such/dir"}, "no such directory"),  # workload
        ({"resume": "/no/such.pt"}, "--resume /no/such.pt: no such file"),  # checkpoint
        ({"amp": "fp17"}, "--amp must be bf16 or fp16"),  # ddp
        ({"split": "spatial", "overlap": True}, "--overlap pipelines"),  # split
        ({"schedule": "zigzag"}, "unknown --schedule"),  # pipeline
        ({"placement": "nowhere"}, "unknown --placement"),  # pipeline
        ({"engine": "jax"}, "unknown --engine"),  # engine
    ],
)
def test_each_sections_own_rules(fields, needle):
    with pytest.raises(UsageError, match=needle):
        RunConfig(workload="mlp", **fields)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"strategy": "ddp", "amp": "fp16"}, "--amp fp16 needs a GPU"),
        ({"strategy": "ddp", "amp": "bf16", "dtype": "fp16"}, "disagree"),
        ({"strategy": "ddp", "grad_compress": "bf16"}, "needs NCCL"),
        ({"strategy": "pipeline", "batch": 2}, "smaller than --microbatches 4"),
        ({"strategy": "pipeline", "schedule": "zbv"}, "unknown --schedule 'zbv'"),
        ({"strategy": "pipeline", "engine": "torch", "batch": 6}, "equal parts"),
    ],
)
def test_rules_that_hold_when_a_strategy_reads_the_section(fields, needle):
    cfg = RunConfig(workload="mlp", train=True, **fields)  # the config alone is fine
    with pytest.raises(UsageError, match=needle):
        check(cfg, STRATEGIES.get(cfg.strategy))


def test_schedule_names_match_the_engines():
    from scalelab.layout.schedule import SCHEDULES as HAND
    from scalelab.layout.torch_schedule import SCHEDULES as TORCH

    engines = {"scalelab": tuple(HAND), "torch": tuple(TORCH)}
    assert engines == SCHEDULES


def test_records_written_before_sections_still_load():
    """ddp's --batch then counted items per rank: the record's own trained global batch (or
    the config's --global-batch) is what today's --batch means; a strategy whose batch was
    already global states the same number, and an inference record states none."""
    old = {**RunConfig(workload="mlp", strategy="ddp", batch=16, ranks=2).to_dict(),
           "extra": {}, "global_batch": None}  # fmt: skip
    got = upgrade_record_config(old, trained_batch=32)
    assert got["batch"] == 32 and "extra" not in got and "global_batch" not in got
    assert RunConfig(**got).batch == 32
    assert upgrade_record_config({**old, "global_batch": 64}, trained_batch=64)["batch"] == 64
    mpi_dp = {**old, "strategy": "mpi-dp"}  # its --batch was already global
    assert upgrade_record_config(mpi_dp, trained_batch=16)["batch"] == 16
    infer = {**old, "strategy": "mpi", "train": False}
    assert upgrade_record_config(infer)["batch"] == 16
    new = RunConfig(workload="mlp", strategy="ddp", batch=16, ranks=2).to_dict()
    assert upgrade_record_config(new) == new
    record = {"config": old, "global_batch": 32, "strategy": "ddp"}  # as the analyses read it
    assert config_of(record)["batch"] == 32


def test_fsdp_records_from_before_unit_sizes_read_one_unit_per_block():
    """A record written before --fsdp-unit-mb existed ran one FSDP unit per block: it reads 0,
    not the default (200) a run today takes; a record that names its size keeps it."""
    now = RunConfig(workload="mlp", strategy="fsdp", ranks=2).to_dict()
    assert now["fsdp_unit_mb"] == 200.0
    before = {k: v for k, v in now.items() if k != "fsdp_unit_mb"}
    assert RunConfig(**upgrade_record_config(before)).fsdp_unit_mb == 0.0
    assert upgrade_record_config({**now, "fsdp_unit_mb": 40.0})["fsdp_unit_mb"] == 40.0
