"""The strategy interface: how a run places data, moves it and gathers it.

A strategy receives a built model and (on the root rank) the inputs in transport form; it
returns the gathered output and its timings. The workload never learns which strategy ran it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from torch import nn

from scalelab.comm import Comm, SelfComm
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.instrument.timer import Timings
from scalelab.precision import Precision, get_precision
from scalelab.registry import Registry
from scalelab.results import RunOutput
from scalelab.workloads.base import Inputs, Workload


class Strategy(ABC):
    """Base of every strategy; subclasses register with @STRATEGIES.register(name, line)."""

    name: ClassVar[str]
    needs_data_everywhere: ClassVar[bool] = False  # every rank reads the training data itself
    launcher: ClassVar[str | None] = None  # "mpi" or "torchrun": who starts its ranks
    # Config sections it reads beyond those every run reads (config_sections.ALWAYS and
    # the mode's); a non-default option of any other section is refused before any work.
    reads: ClassVar[tuple[str, ...]] = ()
    # What plan/, predict/, cli/ ask of a strategy instead of comparing its name:
    takes_split: ClassVar[bool] = False  # reads --split (broadcast|batch|spatial)
    data_parallel: ClassVar[bool] = False  # every rank holds the whole model, a batch share
    splits_model: ClassVar[bool] = False  # every rank holds part of the model (stages, shards)
    pipelined: ClassVar[bool] = False  # layers in stages x micro-batches (--stages, --schedule)
    shards_parameters: ClassVar[bool] = False  # params/grads/optimizer state 1/ranks per rank
    by_heads: ClassVar[bool] = False  # tensor parallel: weights split by heads/columns
    ddp_buckets: ClassVar[bool] = False  # DDP's bucketed all-reduce (--bucket-mb, --batch total)
    reference: ClassVar[bool] = False  # the float64 one-process reference itself
    plain_local: ClassVar[bool] = False  # the plain torch one-process run (cpu or cuda)
    gpu_first: ClassVar[bool] = False  # predict's --device defaults to cuda for it
    trains_only: ClassVar[bool] = False  # predict models its training step only

    @classmethod
    def build(cls, cfg: RunConfig) -> Strategy:
        """The strategy object for cfg; a strategy with several implementations picks one
        here (pipeline: its placement registry)."""
        return cls(cfg)

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.precision: Precision = get_precision(cfg.dtype)
        self.comm: Comm = self.make_comm()

    @classmethod
    def launcher_for(cls, cfg: RunConfig) -> str | None:
        """Who starts cfg's ranks (a strategy with two engines says per engine); None: it
        runs in one process."""
        return cls.launcher

    @classmethod
    def reads_for(cls, cfg: RunConfig) -> tuple[str, ...]:
        """The sections a run of cfg reads (a strategy with two engines says per engine)."""
        return cls.reads

    @classmethod
    def replicates_model(cls, cfg: RunConfig) -> bool:
        """Whether each rank of cfg runs the whole model on its share of the batch."""
        return cls.data_parallel

    @classmethod
    def traced_by_torch(cls, cfg: RunConfig) -> bool:
        """Whether torch's engine (DTensor) runs cfg's tensor split, not the hand-written one."""
        return cls.by_heads and cfg.engine == "torch"

    @classmethod
    def pipelined_by_torch(cls, cfg: RunConfig) -> bool:
        """Whether torch.distributed.pipelining runs cfg's stages."""
        return cls.pipelined and cfg.engine == "torch"

    @classmethod
    def model_needs(cls, cfg: RunConfig) -> dict[str, bool]:
        """What it asks of the model, as Workload.check_strategy's keywords (workloads/ sits
        below strategies/, so the fact travels as data)."""
        return {"stages": cls.pipelined, "tensor_pairs": cls.traced_by_torch(cfg)}

    @classmethod
    def derived_flags(cls, given: dict[str, Any]) -> dict[str, Any]:
        """The flags a command line gave (field name -> value), with any this strategy derives
        from them where they were not given, before the config is built: none here."""
        return given

    @classmethod
    def describe(cls, cfg: RunConfig) -> str:
        """Who does not read an option, for the refusal's line."""
        return f"the {cls.name} strategy"

    @classmethod
    def read_with(cls, cfg: RunConfig, section: str) -> str | None:
        """The flag under which this strategy does read section (None: under none)."""
        return None

    @staticmethod
    def readers(cfg: RunConfig, section: str) -> list[str]:
        """The registered strategies that read section with cfg, or with another engine."""
        out = []
        for name in STRATEGIES.names():
            cls = STRATEGIES.get(name)
            flag = None if section in cls.reads_for(cfg) else cls.read_with(cfg, section)
            if flag is not None or section in cls.reads_for(cfg):
                out.append(f"{name} {flag}" if flag else name)
        return out

    def make_comm(self) -> Comm:
        return SelfComm()

    @property
    def is_root(self) -> bool:
        return self.comm.is_root

    def validate(self, workload: Workload) -> None:
        """Check the topology and options against the workload before anything runs."""

    @abstractmethod
    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        """Timed inference of inputs (present on the root rank) through model."""

    def train(
        self, workload: Workload, model: nn.Module, data: tuple[Inputs, Inputs] | None
    ) -> RunOutput:
        raise UsageError(f"strategy {self.name} does not train; drop --train")

    def gather_phases(self, timings: Timings) -> list[dict[str, float]] | None:
        return self.comm.gather_object(timings.iteration_phases())

    def close(self) -> None:
        self.comm.close()


STRATEGIES: Registry[type[Strategy]] = Registry("strategy")
