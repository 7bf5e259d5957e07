"""The CLI's contract under generated input (hypothesis): option values and malformed files
for run, sweep, roofline, scaling, report, predict and slurm. Whatever comes in, the exit code
is 0, 1 or 2 (never 3, an internal error); on 2 stderr is exactly one line and no file was
written. Commands run in-process through `main` in a fresh folder per example."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scalelab.cli.main import main

FIXTURES = Path(__file__).parent / "fixtures"
RECORD = json.loads((FIXTURES / "scaling_strong.jsonl").read_text().splitlines()[0])
CEILINGS = json.loads((FIXTURES / "ceilings_cpu.json").read_text())
SETTINGS = settings(
    max_examples=int(os.environ.get("SCALELAB_PROPERTY_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)


def contract(argv: list[str], files: dict[str, bytes]) -> tuple[int, str]:
    """Run `scalelab argv` in a fresh folder holding files; assert the contract."""
    with tempfile.TemporaryDirectory() as tmp, _cwd(tmp):
        for name, data in files.items():
            Path(name).write_bytes(data)
        before = _tree(Path(tmp))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse
                code = exc.code
        after = _tree(Path(tmp))
    text = err.getvalue()
    assert code in (0, 1, 2), (argv, code, text)
    if code == 2:
        assert len(text.strip().splitlines()) == 1, (argv, text)
        assert after == before, (argv, sorted(after - before), text)
    return code, text


@contextlib.contextmanager
def _cwd(path: str):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# --- values -------------------------------------------------------------------------------
NUMBERS = st.sampled_from(
    ["0", "-1", "1", "2", "3", "nan", "inf", "-inf", "1e300", "1e-300", "0.5", "abc", "",
     "99999999999999999999999", "18446744073709551616", "4096", "1,2", "1,,2", "0x10"]
)  # fmt: skip
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def garbage_bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=64),
        st.just(b"\xff\xfe\x00bad"),
        st.text(max_size=64).map(str.encode),
        JSONISH.map(lambda v: json.dumps(v).encode()),
    )


@st.composite
def mutated(draw, template: dict) -> dict:
    """template with a few fields deleted or replaced by values of the wrong kind."""
    rec = json.loads(json.dumps(template))
    for _ in range(draw(st.integers(1, 3))):
        target = rec
        keys = list(target)
        key = draw(st.sampled_from(keys))
        if isinstance(target[key], dict) and target[key] and draw(st.booleans()):
            target, key = target[key], draw(st.sampled_from(list(target[key])))
        if draw(st.booleans()):
            del target[key]
        else:
            target[key] = draw(JSONISH)
    return rec


def records_file() -> st.SearchStrategy[bytes]:
    lines = st.lists(mutated(RECORD).map(json.dumps) | st.just(json.dumps(RECORD)), max_size=3)
    return st.one_of(garbage_bytes(), lines.map(lambda ls: "\n".join(ls).encode()))


def ceilings_file() -> st.SearchStrategy[bytes]:
    return st.one_of(garbage_bytes(), mutated(CEILINGS).map(lambda d: json.dumps(d).encode()))


TOML_VALUES = st.sampled_from(
    ['"mlp"', '["mlp"]', "[1, 2]", "[]", "0", "-1", "nan", "inf", "1e300", "true", '"x"',
     '["../../x"]', "{a = 1}", "[[1]]", '"../../x"']
)  # fmt: skip
TOML_KEYS = st.sampled_from(
    ["workload", "strategy", "ranks", "batch", "hidden", "lr", "train", "steps", "iters",
     "batch_per_rank", "bogus", "name", "timeout_s", "device", "image_size", "dtype"]
)  # fmt: skip


@st.composite
def study_file(draw) -> bytes:
    if draw(st.integers(0, 4)) == 0:
        return draw(garbage_bytes())
    lines = []
    for table in draw(st.lists(st.sampled_from(["study", "grid", "fixed", "other"]), max_size=3)):
        lines.append(f"[{table}]")
        for _ in range(draw(st.integers(0, 3))):
            lines.append(f"{draw(TOML_KEYS)} = {draw(TOML_VALUES)}")
    if draw(st.booleans()):
        lines = ["[grid]", 'workload = ["mlp"]', "hidden = [4]"] + lines
    return "\n".join(lines).encode()


# --- the commands -------------------------------------------------------------------------
RUN_FLAGS = ["--batch", "--iters", "--warmup", "--seed", "--lr", "--momentum", "--l2",
             "--hidden", "--steps", "--threads", "--image-size", "--ranks", "--epochs",
             "--train-size"]  # fmt: skip
SMALL_RUN = ["--hidden", "4", "--batch", "2", "--iters", "1", "--warmup", "0",
             "--train-size", "8", "--heldout-size", "4", "--quiet"]  # fmt: skip


@SETTINGS
@given(
    options=st.lists(st.tuples(st.sampled_from(RUN_FLAGS), NUMBERS), max_size=3),
    train=st.booleans(),
    workload=st.sampled_from(["mlp", "mlp", "nope"]),
    weights=st.none() | garbage_bytes(),
    out=st.sampled_from([None, "a.jsonl", "blocker/x.jsonl", ".", "sub/dir/r.jsonl"]),
)
def test_run(options, train, workload, weights, out):
    argv = ["run", workload, *SMALL_RUN, *(["--train", "--steps", "2"] if train else [])]
    for flag, value in options:
        argv += [f"{flag}={value}"]
    files = {"blocker": b"a regular file"}
    if weights is not None:
        files["w.safetensors"] = weights
        argv += ["--weights", "w.safetensors"]
    if out is not None:
        argv += ["--out", out]
    if "--ranks" in " ".join(argv):  # ranks > 1 would start a launcher: not in-process
        argv += ["--strategy", "local"]
    contract(argv, files)


@SETTINGS
@given(
    study=study_file(),
    dry=st.booleans(),
    sets=st.lists(
        st.sampled_from(["hidden=4", "lr=nan", "ranks=[1,2]", "nope", "bogus=1", "batch=0", "=1"]),
        max_size=2,
    ),
)
def test_sweep(study, dry, sets):
    argv = ["sweep", "study.toml", *(["--dry-run"] if dry else ["--timeout", "60"])]
    for item in sets:
        argv += ["--set", item]
    contract(argv, {"study.toml": study})


@SETTINGS
@given(
    command=st.sampled_from(["roofline", "scaling", "report"]),
    records=records_file(),
    ceilings=st.none() | ceilings_file(),
)
def test_analyses(command, records, ceilings):
    argv = [command, "runs.jsonl", "--no-plots", "-o", "outdir"]
    files = {"runs.jsonl": records}
    if ceilings is not None and command != "scaling":
        files["c.json"] = ceilings
        argv += ["--ceilings", "c.json"]
    contract(argv, files)


@SETTINGS
@given(
    ranks=NUMBERS,
    ceilings=st.none() | ceilings_file(),
    calibrate=st.none() | records_file(),
    validate=st.booleans(),
)
def test_predict(ranks, ceilings, calibrate, validate):
    files: dict[str, bytes] = {}
    argv = ["predict", "--no-plots"]
    if validate:
        argv += ["--validate", "runs.jsonl"]
        files["runs.jsonl"] = calibrate or b""
    else:
        argv += ["mlp", "--ranks", ranks, "--strategy", "mpi-dp", "--train"]
        if calibrate is not None:
            files["runs.jsonl"] = calibrate
            argv += ["--calibrate", "runs.jsonl"]
    if ceilings is not None:
        files["c.json"] = ceilings
        argv += ["--ceilings", "c.json"]
    contract(argv, files)


@SETTINGS
@given(study=study_file(), nodes=NUMBERS, gpus=NUMBERS)
def test_slurm(study, nodes, gpus):
    argv = ["slurm", "study.toml", "--nodes", nodes, "--gpus-per-node", gpus, "-o", "jobs"]
    contract(argv, {"study.toml": study})


@SETTINGS
@given(contents=st.dictionaries(st.sampled_from(["workload", "model", "optimizer", "position",
                                                 "schedule", "history", "rng", "world_size"]),
                                JSONISH, max_size=6))  # fmt: skip
def test_resume_from_a_checkpoint_with_the_right_tag_and_wrong_contents(contents):
    import torch

    from scalelab.train.checkpoint import FORMAT

    buf = io.BytesIO()
    torch.save({"format": FORMAT, **contents}, buf)
    argv = ["run", "mlp", *SMALL_RUN, "--train", "--steps", "2", "--resume", "c.pt"]
    code, text = contract(argv, {"c.pt": buf.getvalue()})
    assert code == 2 and "--resume c.pt" in text
