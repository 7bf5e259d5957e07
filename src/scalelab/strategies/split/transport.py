"""Where bytes live while they cross between ranks, and the copies that get them there.

The compute device and the comm's buffers may differ: MPI without CUDA support reads host
memory only, so a GPU rank stages every message through pinned host buffers (d2h before a
send, h2d after a receive). NCCL and CUDA-aware MPI take device buffers directly, and on CPU
ranks nothing moves at all. The splits call these four methods and never ask which case holds.
"""

from __future__ import annotations

import torch

from scalelab.comm.base import Comm
from scalelab.instrument.timer import PhaseTimer


class Transport:
    """Moves tensors between the compute device and the wire (the comm's buffer device)."""

    def __init__(self, comm: Comm, device: torch.device, timer: PhaseTimer) -> None:
        self.device = device
        self.timer = timer
        on_gpu = device.type == "cuda"
        self.wire = device if on_gpu and comm.device == "cuda" else torch.device("cpu")
        self.staged = on_gpu and self.wire.type == "cpu"  # host staging of device data
        self.pinned = self.staged

    @property
    def mode(self) -> str:
        if self.device.type == "cpu":
            return "host"
        return "host-staged (pinned)" if self.staged else "device-direct"

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A receive buffer on the wire (pinned host memory when staging)."""
        return torch.empty(shape, dtype=dtype, device=self.wire, pin_memory=self.pinned)

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """Compute-device tensor -> a contiguous buffer the comm can send (d2h when staging)."""
        if not self.staged:
            return t.contiguous()
        with self.timer.phase("d2h"):
            buf = self.empty(tuple(t.shape), t.dtype)
            buf.copy_(t)
        self.timer.add_bytes("d2h", buf.nbytes)
        return buf

    def from_wire(self, t: torch.Tensor) -> torch.Tensor:
        """Received buffer -> compute device (h2d when staging)."""
        if t.device == self.device or (t.device.type == self.device.type == "cpu"):
            return t
        with self.timer.phase("h2d"):
            out = t.to(self.device, non_blocking=t.is_pinned())
        self.timer.add_bytes("h2d", t.nbytes)
        return out

    def host_to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """The root's host input -> the wire (h2d when the comm moves device buffers)."""
        if self.wire.type == "cpu":
            return t
        with self.timer.phase("h2d"):
            out = t.to(self.wire, non_blocking=t.is_pinned())
        self.timer.add_bytes("h2d", t.nbytes)
        return out

    def to_host64(self, t: torch.Tensor) -> torch.Tensor:
        """The gathered output -> float64 on the host (the oracle's form)."""
        phase = "d2h" if t.is_cuda else "gather"
        with self.timer.phase(phase):
            out = t.to("cpu", torch.float64)
        if t.is_cuda:
            self.timer.add_bytes("d2h", t.nbytes)
        return out

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """Pin a host tensor once, outside the timed loop, when it will be copied to a GPU."""
        return t.pin_memory() if self.device.type == "cuda" and not t.is_pinned() else t
