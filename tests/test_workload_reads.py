"""Each workload declares the shape sections it reads (Workload.reads, config_sections.SHAPES):
a non-default shape option it would not read is refused before any work, one line, exit 2,
nothing written; the options it does read pass."""

import dataclasses
from pathlib import Path

import pytest

from scalelab import config_sections
from scalelab.config import RunConfig
from scalelab.config_sections import SHAPES, check
from scalelab.strategies import STRATEGIES
from scalelab.workloads import WORKLOADS

# Per workload: an option it does not read, and who does.
REFUSED = {
    "alexnet": (["--hidden", "64"], "--hidden is an mlp option; the alexnet workload"),
    "vgg16": (["--convs", "3"], "--convs is a deepstack option; the vgg16 workload"),
    "resnet18": (["--swap-relu-pool"], "--swap-relu-pool is an alexnet/vgg16 option"),
    "resnet18-cifar": (["--vocab", "5"], "--vocab is a --model option; the resnet18-cifar"),
    "deepstack": (["--hidden", "8"], "--hidden is an mlp option; the deepstack workload"),
    "charcnn": (["--image-size", "32"], "the charcnn workload does not read it"),
    "mlp": (["--fcs", "3"], "--fcs is a deepstack option; the mlp workload does not read it"),
    "model": (["--model", "examples/models/rescnn.py:rescnn", "--input-shape", "3,8,8",
               "--num-classes", "5"], "the model workload does not read it"),
}  # fmt: skip
# A non-default value for every shape option.
GIVEN = {"image_size": 32, "num_classes": 5, "hidden": 8, "convs": 3, "fcs": 3,
         "swap_relu_pool": True, "model": "m:f", "model_arg": ("a=1",), "input_shape": "3,8,8",
         "input_dtype": "int64", "vocab": 7, "tokenizer": "tok"}  # fmt: skip


@pytest.mark.parametrize("name", WORKLOADS.names())
def test_an_option_the_workload_does_not_read_is_refused(cli, tmp_path, name):
    args, needle = REFUSED[name]  # a new workload needs its line here
    workload = [] if name == "model" else [name]
    code, out, err = cli("run", *workload, *args, "--out", tmp_path / "r.jsonl")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], (code, err)
    assert "Traceback" not in err and not list(tmp_path.iterdir())


def _shape_fields(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig) if f.metadata["section"] == section]


@pytest.mark.parametrize("command", ["layers", "fit", "predict"])
def test_the_commands_that_model_a_workload_refuse_it_too(cli, tmp_path, command):
    """layers, fit and predict read the workload's shapes without running a strategy."""
    ceilings = str(Path(__file__).parent / "fixtures" / "plan" / "ceilings_2core.json")
    extra = ["--strategy", "mpi", "--ranks", "1", "--ceilings", ceilings]
    code, out, err = cli(command, "alexnet", "--hidden", "64", *extra[: 6 * (command == "predict")])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert "--hidden is an mlp option; the alexnet workload does not read it" in lines[0]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", WORKLOADS.names())
def test_the_options_a_workload_reads_pass(name):
    cls = WORKLOADS.get(name)
    assert set(cls.reads) <= set(SHAPES), name
    given = {k: GIVEN[k] for section in cls.reads for k in _shape_fields(section)}
    cfg = RunConfig(workload=name, **given)
    check(cfg, STRATEGIES.get("local"), cls)  # nothing refused
    for section in set(SHAPES) - set(cls.reads):  # and every other one is
        for field in _shape_fields(section):
            with pytest.raises(config_sections.UsageError, match="workload does not read it"):
                check(RunConfig(workload=name, **{field: GIVEN[field]}), STRATEGIES.get("local"),
                      cls)  # fmt: skip


def test_every_shape_field_is_in_a_shape_section_read_by_some_workload():
    read = {s for name in WORKLOADS.names() for s in WORKLOADS.get(name).reads}
    assert read == set(SHAPES)
    assert set(GIVEN) == {k for s in SHAPES for k in _shape_fields(s)}


def test_a_sweep_over_several_workloads_plans_each_with_its_own_options(cli, tmp_path):
    """alexnet and vgg16 both read --image-size and --swap-relu-pool: the study plans; a
    fixed --hidden, read by neither, is refused naming the point, before anything runs."""
    study = tmp_path / "s.toml"
    grid = "[grid]\nworkload = ['alexnet', 'vgg16']\nswap_relu_pool = [false, true]\n"
    study.write_text(grid + "[fixed]\nimage_size = 64\nbatch = 1\n")
    code, out, err = cli("sweep", study, "--dry-run", "--out", tmp_path / "r.jsonl")
    assert code == 0 and out.count("todo") == 4, err
    study.write_text(grid + "[fixed]\nimage_size = 64\nhidden = 64\n")
    code, out, err = cli("sweep", study, "--dry-run", "--out", tmp_path / "r.jsonl")
    assert code == 2 and "point 1 (workload=alexnet" in err and "--hidden is an mlp option" in err
    assert not (tmp_path / "r.jsonl").exists()
