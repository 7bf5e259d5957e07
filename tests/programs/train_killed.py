"""`scalelab ARGS` that SIGKILLs itself on one rank before its K-th optimizer step:
`python train_killed.py K RANK run mlp --train ...` (under mpiexec, torchrun, or alone).

A real kill -9 mid-epoch: no exception handler, no atexit, no flush, as when a node dies.
"""

import os
import signal
import sys

from scalelab.cli.main import main
from scalelab.train import loop

kill_at, kill_rank = int(sys.argv[1]), int(sys.argv[2])
rank = int(
    next(
        (os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK") if v in os.environ),
        "0",
    )
)
calls = 0
real_step = loop.Trainer.train_step  # every strategy's pluggable step runs through it


def dying_step(self, step):
    global calls
    calls += 1
    if rank == kill_rank and calls == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_step(self, step)


loop.Trainer.train_step = dying_step
sys.exit(main(sys.argv[3:]))
