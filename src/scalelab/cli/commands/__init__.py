"""One module per subcommand; importing one registers it in COMMANDS. A process imports only
the module of the command it runs (`load`): every rank of a launched job runs `scalelab run`,
and imported the other seventeen (plan, predict, bench, demo and what they import) too."""

from __future__ import annotations

import importlib

# command name -> its module here, in `scalelab --help`'s order
MODULES = {
    "bench": "bench",
    "ceilings": "ceilings",
    "demo": "demo",
    "env": "env",
    "fit": "fit",
    "layers": "layers",
    "list": "listing",
    "phases": "phases",
    "plan": "plan",
    "predict": "predict",
    "report": "report",
    "roofline": "roofline",
    "run": "run",
    "scaling": "scaling",
    "slurm": "slurm",
    "sweep": "sweep",
    "timeline": "timeline",
    "versions": "versions",
}


def load(command: str | None = None) -> None:
    """Register `command` (every command when None, or when it names none of them: the parser
    then lists them all, and says which is closest)."""
    wanted = [MODULES[command]] if command in MODULES else list(MODULES.values())
    for module in wanted:
        importlib.import_module(f"{__name__}.{module}")
