"""`mpi-dp`: data-parallel training over MPI ranks, as in the MNIST seed.

Rank 0 reads the data. At the start of each epoch it scatters every rank's share of all that
epoch's batches in one Scatterv (the shares follow the one-process shuffled order, which
changes every epoch: rank r gets the r-th even_counts piece of each global batch). Per step
every rank computes the gradient of its share, weighted by its share of the global batch, and
the gradients are summed with one Allreduce of a flat buffer, staged through pinned host memory
when the rank drives a GPU and MPI is not CUDA-aware. So N ranks train on the same global
batches with the same gradients as one process, up to the order of the sums.

--nonblocking reduces layer by layer instead: as soon as autograd has accumulated a layer's
gradients (post-accumulate-grad hooks; backward visits layer 2 before layer 1) an Iallreduce of
that layer starts, so layer 2's reduction is in flight while layer 1's gradient is computed.

Bytes per step: the Allreduce carries one buffer of P parameters (P * itemsize bytes; a
2-rank ring sends and receives that much per rank); the record's `bytes_per_step`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from scalelab.comm import Comm, even_counts
from scalelab.comm.mpi import MPIComm
from scalelab.config import RunConfig
from scalelab.errors import UsageError
from scalelab.instrument.timer import PhaseTimer
from scalelab.results import RunOutput
from scalelab.strategies.base import STRATEGIES
from scalelab.strategies.torch_base import TorchStrategy, resolve_device
from scalelab.train.loop import TrainPlan, eval_batch, evaluate, require_labels, run_training
from scalelab.train.sources import BatchSource, Step, batch_order, batch_slices
from scalelab.workloads.base import Inputs, Workload


def batch_covers_ranks(batch: int, ranks: int) -> None:
    if batch < ranks:
        raise UsageError(
            f"--batch {batch} is smaller than {ranks} ranks: some ranks would have no items "
            "(--batch is the global batch)"
        )


class OnMPIRanks(TorchStrategy):
    """A torch strategy whose ranks are MPI processes (mpi4py), each on the CPU or on its
    node's GPU number local_rank (mod the GPU count)."""

    launcher = "mpi"

    def make_comm(self) -> Comm:
        return MPIComm()

    def pick_device(self) -> torch.device:
        if self.cfg.device != "cuda":
            return resolve_device(self.cfg.device)
        resolve_device("cuda")
        device = torch.device("cuda", self.comm.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device


def host_stage(buf: torch.Tensor, comm: Comm) -> torch.Tensor | None:
    """A pinned host twin of a device buffer that MPI cannot read directly, else None."""
    if not buf.is_cuda or comm.cuda_aware:
        return None
    return torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)


def staged_allreduce(
    comm: Comm, buf: torch.Tensor, host: torch.Tensor | None, timer: PhaseTimer
) -> None:
    """Sum buf over ranks in place, through host memory when MPI cannot read the device."""
    if host is None:
        with timer.phase("mpi"):
            comm.allreduce(buf)
        return
    with timer.phase("d2h"):
        host.copy_(buf)
    with timer.phase("mpi"):
        comm.allreduce(host)
    with timer.phase("h2d"):
        buf.copy_(host, non_blocking=True)


def _grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def _unflatten(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """The summed gradients back into each parameter's .grad."""
    for p, part in zip(params, flat.split([p.numel() for p in params])):
        if p.grad is None:
            p.grad = part.view_as(p).clone()
        else:
            p.grad.copy_(part.view_as(p))


class FlatReduce:
    """Every gradient in one flat buffer, one blocking Allreduce(sum) per step (the seed's)."""

    def __init__(self, comm: Comm, model: nn.Module) -> None:
        self.comm = comm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.flat = torch.empty(
            sum(p.numel() for p in self.params),
            dtype=self.params[0].dtype,
            device=self.params[0].device,
        )  # (P,)
        self.host = host_stage(self.flat, comm)
        self.nbytes = self.flat.nbytes

    def reduce(self, timer: PhaseTimer) -> None:
        with timer.phase("allreduce"):
            torch.cat([g.reshape(-1) for g in _grads(self.params)], out=self.flat)
            staged_allreduce(self.comm, self.flat, self.host, timer)
            _unflatten(self.params, self.flat)
        timer.add_bytes("allreduce", self.nbytes)

    def notes(self) -> dict:
        return {"nonblocking": False}


class LayerwiseReduce:
    """--nonblocking: one Iallreduce per layer, started from autograd hooks as soon as the
    layer's gradients are accumulated; reduce() waits for them after backward."""

    def __init__(self, comm: MPIComm, model: nn.Module) -> None:
        self.comm = comm
        self.layers = [
            (name, [p for p in mod.parameters(recurse=False) if p.requires_grad])
            for name, mod in model.named_modules()
        ]
        self.layers = [(name, ps) for name, ps in self.layers if ps]
        self.flat = [self._buffer(ps) for _, ps in self.layers]
        self.host = [host_stage(f, comm) for f in self.flat]
        self.owner = {p: i for i, (_, ps) in enumerate(self.layers) for p in ps}
        for p in self.owner:
            p.register_post_accumulate_grad_hook(self._ready)
        self._reset()
        self.nbytes = sum(f.nbytes for f in self.flat)
        self.pending_at_start: dict[str, list[str]] = {}  # layer -> layers still computing

    @staticmethod
    def _buffer(params: list[nn.Parameter]) -> torch.Tensor:
        n = sum(p.numel() for p in params)
        return torch.empty(n, dtype=params[0].dtype, device=params[0].device)

    def _reset(self) -> None:
        self.left = [len(ps) for _, ps in self.layers]
        self.requests: list = [None] * len(self.layers)

    def _ready(self, p: nn.Parameter) -> None:
        i = self.owner[p]
        self.left[i] -= 1
        if self.left[i] == 0:
            self._start(i)

    def _start(self, i: int) -> None:
        name, params = self.layers[i]
        still = [n for j, (n, _) in enumerate(self.layers) if self.left[j] > 0]
        self.pending_at_start.setdefault(name, still)
        torch.cat([g.reshape(-1) for g in _grads(params)], out=self.flat[i])
        buf = self.flat[i] if self.host[i] is None else self.host[i].copy_(self.flat[i])
        if buf.is_cuda:  # CUDA-aware MPI reads the device buffer (__cuda_array_interface__)
            torch.cuda.current_stream().synchronize()  # MPI does not follow CUDA streams
        mpi, target = self.comm.MPI, buf if buf.is_cuda else buf.numpy()
        self.requests[i] = self.comm.world.Iallreduce(mpi.IN_PLACE, target, op=mpi.SUM)

    def reduce(self, timer: PhaseTimer) -> None:
        with timer.phase("allreduce"):
            # No backward ran (an empty share): start them now, in backward's order (last
            # layer first), as MPI matches the other ranks' Iallreduces by order of issue.
            for i in reversed(range(len(self.layers))):
                if self.requests[i] is None:
                    self._start(i)
            with timer.phase("wait"):
                for req in self.requests:
                    req.Wait()
            for i, (_, params) in enumerate(self.layers):
                if self.host[i] is not None:
                    self.flat[i].copy_(self.host[i], non_blocking=True)
                _unflatten(params, self.flat[i])
        timer.add_bytes("allreduce", self.nbytes)
        self._reset()

    def notes(self) -> dict:
        return {"nonblocking": True, "reduce_started_while_pending": self.pending_at_start}


class ScatteredBatches(BatchSource):
    """Rank 0 scatters each rank's share of an epoch's batches at the epoch's start; a step
    then takes the rank's next piece from its local share, no communication."""

    def __init__(self, strategy: TorchStrategy, train: Inputs | None) -> None:
        self.strategy, self.train = strategy, train
        self.comm, cfg = strategy.comm, strategy.cfg
        self.n = self.comm.bcast_object(len(train) if train is not None else None)
        self.global_batch, self.seed = cfg.batch, cfg.seed
        self.rounds = 0  # Scatterv rounds (one per epoch)

    def steps_per_epoch(self) -> int:
        return len(batch_slices(self.n, self.global_batch))

    def _count(self, part: slice, rank: int) -> int:
        return even_counts(part.stop - part.start, self.comm.size)[rank]

    def epoch(self, epoch: int, skip: int) -> Iterator[Step]:
        slices = batch_slices(self.n, self.global_batch)[skip:]
        if not slices:
            return
        mine, start = self._scatter(epoch, slices), 0
        for part in slices:
            items, count = part.stop - part.start, self._count(part, self.comm.rank)
            yield Step(mine.slice(start, start + count), items, count / items)
            start += count

    def _scatter(self, epoch: int, slices: list[slice]) -> Inputs:
        timer, comm = self.strategy.timer, self.comm
        counts = [sum(self._count(p, r) for p in slices) for r in range(comm.size)]
        self.rounds += 1
        with timer.phase("scatter"):
            order = self._send_order(epoch, slices) if comm.is_root else None
            train = self.train
            x = comm.scatterv(train.x[order] if order is not None else None, counts)
            y = comm.scatterv(train.y[order] if order is not None else None, counts)
        timer.add_bytes("scatter", x.nbytes + y.nbytes)
        with timer.phase("h2d"):
            return Inputs(self.strategy.to_device(x), self.strategy.to_device(y))

    def _send_order(self, epoch: int, slices: list[slice]) -> torch.Tensor:
        """Item indices grouped by destination rank: rank r's pieces of every batch, in order."""
        order = batch_order(self.n, epoch, self.seed)
        pieces: list[list[torch.Tensor]] = [[] for _ in range(self.comm.size)]
        for part in slices:
            idx, start = order[part], 0
            for r, c in enumerate(even_counts(len(idx), self.comm.size)):
                pieces[r].append(idx[start : start + c])
                start += c
        return torch.cat([piece for rank in pieces for piece in rank])


@STRATEGIES.register(
    "mpi-dp",
    "data-parallel training over MPI ranks: shares scattered per epoch, Allreduce of gradients",
)
class MPIDataParallel(OnMPIRanks):
    name = "mpi-dp"
    reads = ("mpi-dp", "checkpoint")
    data_parallel = True
    trains_only = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.reducer: FlatReduce | LayerwiseReduce | None = None

    @classmethod
    def preflight(cls, cfg: RunConfig) -> int:
        """Checks that need no ranks; returns the global batch."""
        batch_covers_ranks(cfg.batch, cfg.ranks)
        return cfg.batch

    def validate(self, workload: Workload) -> None:
        batch_covers_ranks(self.cfg.batch, self.comm.size)

    def all_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        return float(self.comm.allreduce(t)[0])

    def reduce_gradients(self, model: nn.Module, timer: PhaseTimer) -> None:
        assert self.reducer is not None
        self.reducer.reduce(timer)

    def infer(self, workload: Workload, model: nn.Module, inputs: Inputs | None) -> RunOutput:
        raise UsageError("mpi-dp trains (add --train); `scalelab list` names inference strategies")

    def train(
        self, workload: Workload, model: nn.Module, data: tuple[Inputs, Inputs] | None
    ) -> RunOutput:
        train, heldout = data if data is not None else (None, None)
        require_labels(train, heldout)
        module = self.place(model)
        self.reducer = (
            LayerwiseReduce(self.comm, module)
            if self.cfg.nonblocking
            else FlatReduce(self.comm, module)
        )
        source = ScatteredBatches(self, train)
        batch = eval_batch(workload, self.cfg.batch)
        plan = TrainPlan(
            source=source,
            evaluate=lambda m: (
                evaluate(self, workload, m, heldout, batch) if heldout is not None else float("nan")
            ),
            module=module,
            prepare=workload.prepare,
            loss=workload.loss,
            n_train=source.n,
            notes={"bytes_per_step": {"allreduce": self.reducer.nbytes}},
        )
        out = run_training(self, workload, module, plan)
        out.notes.update(self.reducer.notes(), scatter_rounds=source.rounds)
        return out
