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
