"""The CLI's contract under generated input (hypothesis): option values and malformed files
for run, sweep, roofline, scaling, report, predict and slurm. Whatever comes in, the exit code
is 0, 1 or 2 (never 3, an internal error); on 2 stderr is exactly one line and no file was
written. Commands run in-process through `main` in a fresh folder per example."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import tempfile
from pathlib import Path

import pytest
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
# Examples that train or read data sets cost about a second each on 2 cores: fewer of them.
SLOW_SETTINGS = settings(SETTINGS, max_examples=max(3, SETTINGS.max_examples // 4))


def contract(argv: list[str], files: dict[str, bytes]) -> tuple[int, str]:
    """Run `scalelab argv` in a fresh folder holding files; assert the contract."""
    with tempfile.TemporaryDirectory() as tmp, _cwd(tmp):
        for name, data in files.items():  # None: a folder
            Path(name).mkdir() if data is None else Path(name).write_bytes(data)
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


@st.composite
def not_utf8(draw, valid: bytes) -> bytes:
    """A valid file with bytes that are not UTF-8 put somewhere inside (a Latin-1 name, a
    truncated multi-byte character)."""
    at = draw(st.integers(0, len(valid)))
    return valid[:at] + draw(st.sampled_from([b"\xff", b"\xe9", b"\xc3", b"\x80\x80"])) + valid[at:]


def records_file() -> st.SearchStrategy[bytes]:
    lines = st.lists(mutated(RECORD).map(json.dumps) | st.just(json.dumps(RECORD)), max_size=3)
    return st.one_of(
        garbage_bytes(),
        lines.map(lambda ls: "\n".join(ls).encode()),
        not_utf8(json.dumps(RECORD).encode()),
    )


def ceilings_file() -> st.SearchStrategy[bytes]:
    return st.one_of(
        garbage_bytes(),
        mutated(CEILINGS).map(lambda d: json.dumps(d).encode()),
        not_utf8(json.dumps(CEILINGS).encode()),
    )


@st.composite
def safetensors_file(draw) -> bytes:
    """The safetensors layout (8-byte little-endian header length, JSON header, data) with a
    header of the wrong type, entries of the wrong kinds, or lengths and offsets that lie."""
    entry = st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["F32", "F64", "I64", "BOOL", "F8", "x", 1, None]),
            "shape": st.sampled_from([[4, 784], [784, 4], [-1], [], "x", [1e9], [2**40, 2**40]]),
            "data_offsets": st.sampled_from([[0, 16], [16, 0], [0, 10**12], "a", None, [0]]),
        }
    )
    names = st.sampled_from(["0.weight", "0.bias", "2.weight", "__metadata__", ""])
    header = st.one_of(
        st.dictionaries(names, entry | JSONISH, max_size=3),
        JSONISH,
        st.just({"__metadata__": {"format": 1}}),
    )
    text = json.dumps(draw(header)).encode()
    if draw(st.booleans()):
        text = draw(not_utf8(text))
    size = draw(st.sampled_from([len(text), len(text) + 8, 0, 2**63, len(text) - 1]))
    return size.to_bytes(8, "little", signed=False) + text + draw(st.binary(max_size=32))


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
    text = "\n".join(lines).encode()
    return draw(not_utf8(text)) if draw(st.integers(0, 5)) == 0 else text


# Output locations that cannot be written: under a regular file, a file where a folder goes.
OUT_DIRS = st.sampled_from(["outdir", "blocker/outdir", "blocker"])


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
    weights=st.none() | garbage_bytes() | safetensors_file(),
    out=st.sampled_from([None, "a.jsonl", "blocker/x.jsonl", ".", "sub/dir/r.jsonl"]),
    saved=st.sampled_from([[], ["--save-weights", "blocker/w.pt"], ["--save-weights", "."],
                           ["--ckpt-every", "1", "--ckpt-dir", "blocker/c"]]),
)  # fmt: skip
def test_run(options, train, workload, weights, out, saved):
    argv = ["run", workload, *SMALL_RUN, *(["--train", "--steps", "2"] if train else [])]
    for flag, value in options:
        argv += [f"{flag}={value}"]
    files = {"blocker": b"a regular file"}
    if weights is not None:
        files["w.safetensors"] = weights
        argv += ["--weights", "w.safetensors"]
    if out is not None:
        argv += ["--out", out]
    argv += saved if train or "--save-weights" in saved else []
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
    if not dry:  # the default results folder, or one under a regular file
        argv += [] if len(sets) % 2 else ["--out", "blocker/r.jsonl"]
    contract(argv, {"study.toml": study, "blocker": b"a regular file"})


@SETTINGS
@given(
    command=st.sampled_from(["roofline", "scaling", "report"]),
    records=records_file(),
    ceilings=st.none() | ceilings_file(),
    out=OUT_DIRS,
)
def test_analyses(command, records, ceilings, out):
    argv = [command, "runs.jsonl", "--no-plots", "-o", out]
    files = {"runs.jsonl": records, "blocker": b"a regular file"}
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
    out=st.none() | OUT_DIRS,
)
def test_predict(ranks, ceilings, calibrate, validate, out):
    files: dict[str, bytes] = {"blocker": b"a regular file"}
    argv = ["predict", "--no-plots", *(["-o", out] if out else [])]
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
@given(study=study_file(), nodes=NUMBERS, gpus=NUMBERS, out=OUT_DIRS)
def test_slurm(study, nodes, gpus, out):
    argv = ["slurm", "study.toml", "--nodes", nodes, "--gpus-per-node", gpus, "-o", out]
    contract(argv, {"study.toml": study, "blocker": b"a regular file"})


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


@functools.lru_cache(maxsize=1)
def _real_checkpoint() -> bytes:
    """A checkpoint a real 2-step training wrote (made once)."""
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with tempfile.TemporaryDirectory() as tmp, _cwd(tmp), quiet[0], quiet[1]:
        argv = ["run", "mlp", *SMALL_RUN, "--train", "--steps", "2", "--no-record"]
        assert main([*argv, "--ckpt-every", "1", "--ckpt-dir", "c"]) == 0
        return max(Path("c").rglob("*.pt"), key=lambda p: p.stat().st_mtime).read_bytes()


@SLOW_SETTINGS
@given(data=st.data())
def test_resume_from_a_real_checkpoint_with_wrong_contents(data):
    """The right tag and structure, one part wrong: a tensor of another shape or dtype, a key
    missing or of the wrong kind, anywhere in the state."""
    import torch

    state = torch.load(io.BytesIO(_real_checkpoint()), weights_only=True)
    key = data.draw(st.sampled_from(sorted(k for k in state if k != "format")))
    part = state[key]
    if isinstance(part, dict) and part and data.draw(st.booleans()):
        inner = data.draw(st.sampled_from(sorted(part, key=str)))
        part[inner] = data.draw(
            st.sampled_from([torch.zeros(3, 5), torch.zeros(0), torch.ones(2, dtype=torch.int64),
                             "x", None, 7, [1.5]])
        )  # fmt: skip
    elif data.draw(st.booleans()):
        del state[key]
    else:
        state[key] = data.draw(JSONISH)
    buf = io.BytesIO()
    torch.save(state, buf)
    argv = ["run", "mlp", *SMALL_RUN, "--train", "--steps", "4", "--resume", "c.pt"]
    contract(argv, {"c.pt": buf.getvalue()})


@pytest.mark.parametrize(
    "key, value, words",
    [("epoch", 7, "in epoch 8, past the end of this run's 1 epoch(s)"),
     ("items", 10**6, "1000000 items into an epoch of 4 steps"),
     ("steps", 10**6, "at step 1000000, the end of this run's 4 steps")],
)  # fmt: skip
def test_resume_from_a_position_past_the_runs_end_is_refused(key, value, words):
    """A checkpoint whose position this run never reaches (an epoch past --epochs, more items
    than an epoch holds, more steps than --steps): one line, exit 2, where the first ran no
    step and crashed on the empty history (a case the property test above found)."""
    import torch

    state = torch.load(io.BytesIO(_real_checkpoint()), weights_only=True)
    state["position"][key] = value
    buf = io.BytesIO()
    torch.save(state, buf)
    argv = ["run", "mlp", *SMALL_RUN, "--train", "--steps", "4", "--resume", "c.pt"]
    code, text = contract(argv, {"c.pt": buf.getvalue()})
    assert code == 2 and words in text, text


AGNEWS = b'"Class Index","Title","Description"\n1,"a","b"\n'


@SLOW_SETTINGS
@given(
    images=st.binary(max_size=40) | st.sampled_from([b"\x00\x00\x08\x03" + bytes(12)]),
    labels=st.binary(max_size=16),
    csv=st.text(max_size=80).map(str.encode) | not_utf8(AGNEWS),
)
def test_malformed_data_sets(images, labels, csv):
    """MNIST IDX files and an AG News CSV that are truncated, mislabelled or not UTF-8."""
    mnist = {}
    for split in ("train", "t10k"):
        mnist |= {f"d/{split}-images-idx3-ubyte": images, f"d/{split}-labels-idx1-ubyte": labels}
    files = {"d": None, **mnist, "a": None, "a/train.csv": csv, "a/test.csv": csv}
    contract(["run", "mlp", *SMALL_RUN, "--train", "--steps", "1", "--data-dir", "d"], files)
    contract(["run", "charcnn", "--batch", "1", "--iters", "1", "--warmup", "0", "--quiet",
              "--data-dir", "a"], files)  # fmt: skip


@pytest.mark.parametrize(
    "machine, comm, field",
    [
        ({"cpu_cores": [None]}, {}, "machine.cpu_cores"),  # found by test_predict's fuzzing
        ({"cpu_cores": "two"}, {}, "machine.cpu_cores"),
        ({"cpu_cores": 2, "gpu_count": -1}, {}, "machine.gpu_count"),
        ({"cpu_cores": 2}, {"ranks": 2.5}, "comm.mpi.ranks"),
    ],
)
def test_a_ceilings_file_with_a_count_that_is_not_a_whole_number_is_one_line(
    cli, tmp_path, machine, comm, field
):
    """cpu_cores, gpu_count, cpu_gemm_flops.cores and a backend's ranks size what predict and
    plan set up: a value that is not a whole number is named in one line, exit 2."""
    fit = {"alpha_s": 5e-6, "beta_Bps": 2e9}
    data = {"schema": "scalelab.ceilings/1", "machine": machine, "device": "cpu",
            "gemm_flops": {"fp32": 1e11}, "mem_bw": 1e10,
            "comm": {"mpi": {"ranks": 2, "allreduce": fit, **comm}}}  # fmt: skip
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    code, _, err = cli("predict", "--no-plots", "mlp", "--strategy", "mpi", "--ranks", "2",
                       "--ceilings", path, "-o", tmp_path / "out")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "malformed ceilings file" in err and field in err, err
    assert not (tmp_path / "out").exists()
