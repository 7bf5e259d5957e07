"""Which strategy names play a part an analysis asks about, handed in by its caller.

Analyses read records and import no strategy (tests/test_layering.py), yet a few tables
need to know what a record's strategy *is*: the versions table's speedup is against the
float64 reference run, its superlinear warning against the plain one-process torch run, the
system roofline's all-reduce ceiling is MPI's for ranks that all-reduce over MPI. The
strategy classes know (`reference`, `plain_local`, `launcher` with `data_parallel`); the
caller, which may import them, says it as names (orchestration/strategy_roles.py), so no
analysis compares a strategy's name with a literal.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StrategyRoles:
    reference: frozenset[str] = frozenset()  # the float64 reference (the speedup base)
    plain_local: frozenset[str] = frozenset()  # one plain torch process (the superlinear base)
    mpi_allreduce: frozenset[str] = frozenset()  # data-parallel ranks all-reducing over MPI
