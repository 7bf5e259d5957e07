"""What every strategy model shares: the registry, the context a prediction draws on, and the
transport a strategy's messages take (host buffers, host-staged GPU data, device buffers)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.precision import get_precision
from scalelab.predict.calibration import Pool
from scalelab.predict.comm_model import Fabric
from scalelab.predict.compute_model import ComputeModel, build_workload
from scalelab.predict.figures import Figures
from scalelab.predict.model_registry import MODELS, modelled_as
from scalelab.predict.network import NetworkProfile
from scalelab.predict.scenario import Prediction, Scenario


@dataclass
class Context:
    """The measured figures, the network between nodes, and the measurements to calibrate on."""

    figures: Figures
    network: NetworkProfile | None
    pool: Pool
    _memo: dict[tuple, Any] = field(default_factory=dict, init=False, repr=False)

    def once(self, key: tuple, make: Callable[[], Any]) -> Any:
        """make() computed once per key for this context: a family's calibrated host cost is
        the same for every candidate plan predicts."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def of_run(self, source: str) -> Context:
        """This context with its pool preferring the results file `source` (`file:line`)
        names. A measured multi-rank run's host cost is its step less its own compute, and a
        one-GPU step bound by its host's CPU is its file's, not another host's: GPT-2 small's
        one-GPU fsdp step read 33 ms beside one 4-GPU study and 45 ms beside a 2-GPU one."""
        pool = replace(self.pool, prefer=source.rsplit(":", 1)[0])
        return Context(self.figures, self.network, pool)

    def fabric(self, scenario: Scenario, backend: str) -> Fabric:
        return self.figures.fabric(backend, scenario.per_node, self.network, scenario.nics_per_node)

    def compute(self, scenario: Scenario, spatial: bool = False) -> ComputeModel:
        return ComputeModel.build(scenario, self.figures, self.pool, spatial)


@dataclass(frozen=True)
class Wire:
    """backend: the ceilings' comm section; staged: GPU data through pinned host buffers
    (d2h before a send, h2d after a receive); gpu: the ranks compute on GPUs."""

    backend: str
    staged: bool
    gpu: bool

    def stage(self, figures: Figures, nbytes: float) -> float:
        """d2h + h2d of one message when staged, else nothing (pinned host buffers)."""
        if not self.staged:
            return 0.0
        return nbytes / figures.copy_Bps("d2h", "pinned") + nbytes / figures.copy_Bps(
            "h2d", "pinned"
        )


class StrategyModel(ABC):
    """Predicts one strategy's iteration; subclasses register in MODELS by strategy name."""

    name: str

    def wire(self, scenario: Scenario) -> Wire:
        gpu = scenario.cfg.device == "cuda"
        return Wire("nccl" if gpu else "gloo", False, gpu)

    def infeasible(self, scenario: Scenario) -> str | None:
        """Why the scenario cannot run (None: it can); shown in the table, not raised."""
        return None

    def calibrated_on(self, cfg: RunConfig) -> RunConfig:
        """The run whose one-rank measurement calibrates cfg's compute (its family and the
        batch calibrate.needed_batch reads): cfg itself, unless one rank computes a smaller
        model (tensor: a shard of the hidden units)."""
        return cfg

    @abstractmethod
    def predict(self, ctx: Context, scenario: Scenario) -> Prediction: ...


class OverMPI(StrategyModel):
    """A strategy whose messages go through mpi4py: host-staged when the ranks drive GPUs
    (Open MPI here is not CUDA-aware)."""

    def wire(self, scenario: Scenario) -> Wire:
        gpu = scenario.cfg.device == "cuda"
        return Wire("mpi", staged=gpu, gpu=gpu)


def model_for(strategy: str) -> StrategyModel:
    name = modelled_as(strategy)
    if name is None:
        known = ", ".join(sorted(MODELS.names()))
        raise UsageError(
            f"scalelab predict has no model of strategy {strategy!r} (modelled: {known})"
        )
    return MODELS.get(name)()


# --- what the cost table and the workload say about sizes -----------------------------------
def item_bytes(scenario: Scenario) -> int:
    """Bytes of one input item in its transport form (uint8 pixels or character indices)."""
    x = build_workload(scenario.cfg).synthetic_inputs(1, 0).x
    return int(x[0].numel() * x.element_size())


def output_width(scenario: Scenario) -> int:
    """Values per item of the model's output (logits)."""
    costs = build_workload(scenario.cfg).cost_table()
    linears = [c for c in costs if c.kind == "linear"]
    return linears[-1].out_elems if linears else costs[-1].out_elems


def storage_bytes(scenario: Scenario) -> int:
    """Bytes per value of weights, gradients and activations outside autocast."""
    return get_precision(scenario.precision).storage.itemsize


def param_layers(scenario: Scenario) -> list[tuple[str, int, int]]:
    """(layer, parameters, forward FLOPs per item) of the layers that hold parameters."""
    return [
        (c.name, c.params, c.flops) for c in build_workload(scenario.cfg).cost_table() if c.params
    ]
