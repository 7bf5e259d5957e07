"""How a generated point script ends, run by bash against stand-in srun and Python (no
cluster): srun failing itself leaves a failed record with its reason, the early time warning
lets the point run on, and a job stopped as its step ends records the stop once.
tests/test_slurm_cluster_ends.py stops real jobs on a two-node Slurm."""

import contextlib
import os
import shlex
import shutil
import subprocess

import pytest

import slurm_helpers
from slurm_helpers import _generate

pytestmark = pytest.mark.slurm

# the stand-in binaries (autouse: first on PATH for every test here) and the study, named
# in this module so that pytest gives them to its tests
fake_bin, study = slurm_helpers.fake_bin, slurm_helpers.study


def _point_job(tmp_path, study, srun_body, *extra, helper_first=""):
    """point_002.sbatch (mpi) with a stand-in srun running srun_body and a stand-in Python whose
    point-helper calls (`done ...`, `failed REASON ...`) land in ARGS_DIR/helper-* files
    (helper_first: shell run by the helper before it records; extra: `slurm` options)."""
    out, _ = _generate(cli_main, tmp_path, study, *extra)
    own = tmp_path / "ownbin"
    own.mkdir()
    (own / "srun").write_text(f"#!/bin/bash\n{srun_body}\n")
    (own / "python3").write_text(
        '#!/bin/bash\n[ "$2" = scalelab.cli.slurm_point ] || exit 0\n'
        f"{helper_first}\n"
        'printf "%s\\n" "${@:3}" > "$(mktemp -p "$ARGS_DIR" helper-XXXX)"\n'
        '[ "$3" = prepare ] && { touch "$4"; exit 1; } || exit 0\n'
    )
    for f in own.iterdir():
        f.chmod(0o755)
    args_dir = tmp_path / "args"
    args_dir.mkdir()
    env = {**os.environ, "ARGS_DIR": str(args_dir), "PATH": f"{own}:{os.environ['PATH']}"}
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node-[a-b]")
    return out / "point_002.sbatch", env, args_dir


def _helper_calls(args_dir):
    return sorted(
        (p.read_text().splitlines() for p in args_dir.glob("helper-*")),
        key=lambda c: c[0] != "prepare",
    )


def cli_main(*args):
    from scalelab.cli.main import main

    code = main([str(a) for a in args])
    return code, "", ""


def test_a_step_srun_fails_itself_leaves_a_failed_record(tmp_path, study):
    """srun's own failure (a plugin it lacks, a Python without scalelab) used to end the job
    with no record: the step's last srun or scalelab line becomes the failed record's reason."""
    said = "srun: error: Couldn't find the specified plugin name for mpi/bogus"
    script, env, args_dir = _point_job(tmp_path, study, f'echo "{said}" >&2; exit 1')
    tmp = tmp_path / "tmp"  # a SIGKILLed watcher's empty step folder goes with the job
    (tmp / "scalelab-step-4242.0").mkdir(parents=True)
    (tmp / "scalelab-step-4242.1" / "task0.7").mkdir(parents=True)
    proc = subprocess.run(
        ["bash", str(script)], env={**env, "TMPDIR": str(tmp)}, capture_output=True, text=True
    )
    assert proc.returncode == 1 and said in proc.stderr
    assert [p.name for p in tmp.iterdir()] == ["scalelab-step-4242.1"]  # and its prepared file
    done, failed = _helper_calls(args_dir)
    assert done[0] == "prepare" and failed[:2] == [
        "failed",
        f"the job step exited with code 1: {said}",
    ]
    assert failed[2:] == done[2:]  # the same point


def test_the_early_time_warning_lets_the_point_run_on(tmp_path, study):
    """USR1 (--signal=B:USR1@120, ahead of a >= 10 min limit) no longer ends the job FAILED 143:
    the point runs on and ends as it ends (here ok: no failed record). SIGTERM after it asks
    the point helper to record the stop, told that the warning came (its cause:
    test_slurm_ends.test_a_stopped_jobs_cause_is_read_from_scontrol)."""
    import signal
    import time

    for srun, signals, code, reason in [
        ("sleep 2", [signal.SIGUSR1], 0, None),
        ("sleep 30", [signal.SIGUSR1, signal.SIGTERM], 143, ["stopped", "1"]),
    ]:
        for d in ("ownbin", "args"):
            shutil.rmtree(tmp_path / d, ignore_errors=True)
        script, env, args_dir = _point_job(tmp_path, study, srun)
        proc = subprocess.Popen(["bash", str(script)], env=env, start_new_session=True)
        try:
            while not list(args_dir.glob("helper-*")):  # the traps are set: `prepare` was asked
                time.sleep(0.05)
            for sig in signals:
                time.sleep(0.5)
                proc.send_signal(sig)
            assert proc.wait(timeout=60) == code
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
        calls = _helper_calls(args_dir)
        assert [c[0] for c in calls] == ["prepare"] + (["stopped"] if reason else [])
        assert reason is None or calls[1][:2] == reason, calls  # the warning came first
        assert reason is None or calls[1][2:] == calls[0][1:]  # the same point, its prepared file


# Slurm stopping a job signals every process of it: `kill -TERM 0` in the stand-ins (the
# script runs in a session of its own), by the first helper call of the kind named only.
ONCE = 'once() {{ [ ! -e "$ARGS_DIR/once" ] && touch "$ARGS_DIR/once"; }}; '
ONCE += '[ "$3" = {} ] && once && kill -TERM 0'


@pytest.mark.parametrize(
    ("srun", "helper_first", "extra", "calls"),
    [
        # requeued while srun launched the step: srun failed at once ("Job credential
        # revoked"), the SIGTERM came as `point_helper failed` ran, and killed it
        ("exit 1", ONCE.format("failed"), (), ["prepare", "stopped"]),
        # stopped while a setup line ran, before the point's traps: recorded once it is known
        ("exit 0", "", ("--setup", "kill -TERM $$"), ["stopped"]),
    ],
)  # fmt: skip
def test_a_job_stopped_as_its_step_ends_records_the_stop(
    tmp_path, study, srun, helper_first, extra, calls
):
    """A requeued attempt left no record (test_slurm_cluster_ends in CI): the point's shell
    reset its traps once the step ended, so the SIGTERM that came then killed it before any
    helper recorded the attempt; one before the traps were set did too. Now the stop is
    recorded, once, wherever the SIGTERM lands."""
    import signal

    script, env, args_dir = _point_job(tmp_path, study, srun, *extra, helper_first=helper_first)
    proc = subprocess.Popen(["bash", str(script)], env=env, start_new_session=True)
    try:
        assert proc.wait(timeout=60) == 143
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    got = _helper_calls(args_dir)
    assert [c[0] for c in got] == calls, got
    assert got[-1][1] == "" and got[-1][3:] == _argv_of(script)  # not warned; the point


def _argv_of(script):
    """The point's `args=(...)` as bash reads them."""
    line = next(ln for ln in script.read_text().splitlines() if ln.startswith("args=("))
    return shlex.split(line[len("args=(") : -1])
