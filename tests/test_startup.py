"""What every scalelab process pays before it does anything: the CLI (its parser, every
subcommand and strategy registered) imports torch, but none of torch's optional engines. Each
costs 0.15-1.2 s of CPU at import (DTensor and fsdp 0.7, pipelining 1.2 with torch.export and
dynamo, the flop counter's triton 0.15), paid by every launcher, every rank and `scalelab
--help`; the strategies that use them import them when they build."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

HEAVY = (
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "sympy",
    "triton",
)


def test_the_cli_imports_none_of_torchs_optional_engines():
    loaded = f"json.dumps([m for m in {HEAVY!r} if m in sys.modules])"
    probe = (
        "import json, sys\n"
        "from scalelab.cli.main import build_parser\n"
        "build_parser()\n"
        "import scalelab.strategies, scalelab.workloads, scalelab.predict\n"
        f"print({loaded})\n"
        "import scalelab.strategies.fsdp_comm\n"  # a strategy building: now they are there
        f"print({loaded})\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""},
    ).stdout.splitlines()  # fmt: skip
    assert json.loads(out[0]) == [], "imported at start-up"
    assert "torch.distributed.fsdp" in json.loads(out[1])  # the probe sees an import


def test_a_plain_run_imports_no_compiler_and_leaves_determinism_as_it_was(tmp_path):
    """A one-process run, start to close, imports neither dynamo nor inductor (restoring
    torch's determinism flags at close called torch.use_deterministic_algorithms, which
    imports torch._inductor and with it dynamo and sympy: 2.6 s of CPU a rank on 2 cores,
    for a setting the run never changed); flags a caller had set before the run are still
    set after it. The first run fills a fresh shape cache (its meta-device probe imports
    dynamo: workloads/shape_cache.py)."""
    probe = (
        "import json, os, sys, torch\n"
        "from scalelab.config import RunConfig\n"
        "from scalelab.run.runner import execute\n"
        "flags = lambda: (torch.are_deterministic_algorithms_enabled(),\n"
        "                 torch.is_deterministic_algorithms_warn_only_enabled())\n"
        "if os.environ['ON'] == '1':\n"
        "    torch.use_deterministic_algorithms(True, warn_only=True)\n"
        "before = flags()\n"
        "execute(RunConfig(workload='mlp', hidden=8, batch=2, iters=1, warmup=0, quiet=True,\n"
        "                  threads=1), None)\n"
        "print(json.dumps([[m for m in ('torch._inductor', 'torch._dynamo', 'sympy')\n"
        "                   if m in sys.modules], before == flags(), flags()]))\n"
    )
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "", "SCALELAB_SHAPE_CACHE": str(tmp_path)}
    got = []
    for on in ("0", "0", "1"):  # the first fills the shape cache
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True,
            env={**env, "ON": on},
        ).stdout.splitlines()  # fmt: skip
        got.append(json.loads(out[-1]))
    assert any(tmp_path.iterdir()) and all(restored for _, restored, _ in got)
    assert got[1][0] == [], got[1]  # warm cache, nothing changed: no compiler loaded
    assert got[2][2] == [True, True]  # the caller's flags, kept through the run
