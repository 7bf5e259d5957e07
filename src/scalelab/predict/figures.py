"""The measured figures a prediction needs, read from a `scalelab ceilings` file.

Every figure the model uses comes from here (or from the network profile); a missing one is
a UsageError that names it and the command that measures it, never a silent default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scalelab.errors import UsageError
from scalelab.instrument.ceilings import DEFAULT_PATH, read_ceilings
from scalelab.predict.comm_model import Fabric, Link, ring_link_from_fit
from scalelab.predict.network import NetworkProfile

HOW = {
    "comm": "scalelab ceilings --ranks 2 --backend {backend} --comm-only -o {path}",
    "local": "scalelab ceilings --device {device} -o {path}",
}


def load(path: str | None) -> tuple[dict[str, Any], str]:
    """(ceilings, path): --ceilings, else scalelab-results/ceilings.json, else an error."""
    if path is None:
        if not DEFAULT_PATH.is_file():
            raise UsageError(
                f"no --ceilings given and no {DEFAULT_PATH}: measure this machine first "
                f"(scalelab ceilings; add --ranks 2 --backend nccl|mpi for communication)"
            )
        path = str(DEFAULT_PATH)
    return read_ceilings(path), path


@dataclass
class Figures:
    """Typed access to one ceilings file; `path` goes into error messages."""

    data: dict[str, Any]
    path: str = "ceilings.json"  # the file (the commands printed write to it: a bare path)
    origin: str = ""  # where figures beside the file's come from, said after its name

    def _missing(self, figure: str, how: str) -> UsageError:
        return UsageError(
            f"{self.path}{self.origin} lacks {figure}, which this prediction needs; "
            f"measure it: {how}"
        )

    def comm_fit(self, backend: str, op: str) -> tuple[float, float, int]:
        """(alpha_s, beta_Bps, ranks measured on) of comm[backend][op]."""
        section = (self.data.get("comm") or {}).get(backend) or {}
        fit = section.get(op) or {}
        if "alpha_s" not in fit or "beta_Bps" not in fit:
            how = HOW["comm"].format(backend=backend, path=self.path)
            raise self._missing(f"comm.{backend}.{op} (alpha/beta)", how)
        return float(fit["alpha_s"]), float(fit["beta_Bps"]), int(section.get("ranks", 2))

    def copy_Bps(self, direction: str, memory: str) -> float:
        """Host<->device bandwidth: direction h2d/d2h, memory pinned/pageable."""
        value = (self.data.get(direction) or {}).get(memory)
        if not value:
            how = HOW["local"].format(device="cuda", path=self.path)
            raise self._missing(f"{direction}.{memory} (host<->device copy bandwidth)", how)
        return float(value)

    def gemm_flops(self, device: str, dtype: str, threads: int | None) -> float:
        if device == "cpu":
            return self._cpu("cpu_gemm_flops", threads)
        value = (self.data.get("gemm_flops") or {}).get(dtype)
        if not value or self.data.get("device") != "cuda":
            how = HOW["local"].format(device="cuda", path=self.path)
            raise self._missing(f"gemm_flops.{dtype} measured on cuda", how)
        return float(value)

    def mem_Bps(self, device: str, threads: int | None) -> float:
        if device == "cpu":
            return self._cpu("cpu_mem_bw", threads)
        if not self.data.get("mem_bw") or self.data.get("device") != "cuda":
            raise self._missing(
                "mem_bw measured on cuda", HOW["local"].format(device="cuda", path=self.path)
            )
        return float(self.data["mem_bw"])

    def host_copy_Bps(self) -> float:
        """One core's copy bandwidth (read + write counted): a host memcpy of n bytes takes
        2 n / this."""
        return self._cpu("cpu_mem_bw", 1)

    def cpu_slowdown(
        self, processes: float, slowest: bool = False, threads: int = 1
    ) -> float | None:
        """How much slower each of `processes` processes of `threads` threads computing at
        once on the host runs than one alone: the measured `cpu_concurrency` curve (for more
        than one thread, its `by_threads` curve of that count, which a plan measures), linear
        between its points and held at its ends (None when the ceilings lack the curve).
        slowest: the slowest process's slowdown (`slowdown_max`) instead of the median's."""
        curve = self.data.get("cpu_concurrency") or {}
        if threads != 1:
            curve = (curve.get("by_threads") or {}).get(str(threads)) or {}
        return _at(curve, "slowdown_max" if slowest else "slowdown", processes)

    def cpu_step(self) -> tuple[dict[str, Any], float] | None:
        """The step a workload's `cpu_concurrency` curve timed (its `step`: workload, model,
        train, dtype, batch, threads) and that step's seconds alone: the median call of its
        lockstep rounds (`seconds_lockstep[0]`) where timed so, else `seconds[0]`; None for
        a curve of the convolution or one recorded without it."""
        curve = self.data.get("cpu_concurrency") or {}
        step = curve.get("step")
        seconds = curve.get("seconds_lockstep") or curve.get("seconds")
        return (step, float(seconds[0])) if step and seconds else None

    def cpu_lockstep(self, processes: float) -> float | None:
        """The slowest call per lockstep round at `processes` single-threaded processes over
        one alone (`slowdown_lockstep`, a step's curve), as cpu_slowdown reads its curves."""
        return _at(self.data.get("cpu_concurrency") or {}, "slowdown_lockstep", processes)

    def _cpu(self, key: str, threads: int | None) -> float:
        section = self.data.get(key) or {}
        one, every = section.get("one_core"), section.get("all_cores")
        if not one:
            raise self._missing(
                f"{key}.one_core", HOW["local"].format(device="cpu", path=self.path)
            )
        if threads == 1 or not every:
            return float(one)
        cores = section.get("cores") or (self.data.get("machine") or {}).get("cpu_cores") or 1
        share = min(threads or cores, cores) / cores
        return float(max(one, every * share))

    def fabric(
        self, backend: str, per_node: int, network: NetworkProfile | None, nics: int
    ) -> Fabric:
        """Intra-node links from the measured fits; the inter-node link of one rank from the
        network profile: its bandwidth shared by the per_node ranks behind `nics` ports; its
        latency plus the library's measured per-message cost (a datasheet counts the wire,
        not the software) unless the profile itself was measured end to end."""
        a_ar, b_ar, p = self.comm_fit(backend, "allreduce")
        a_p, b_p, _ = self.comm_fit(backend, "p2p")
        ring = ring_link_from_fit(a_ar, b_ar, p)
        inter = None
        if network is not None:
            software = 0.0 if network.measured else ring.alpha_s
            inter = Link(network.latency_s + software, network.bw_Bps * nics / per_node)
        return Fabric(ring, Link(a_p, b_p), inter, per_node)


def figures_at(path: str | Path | None) -> Figures:
    data, where = load(None if path is None else str(path))
    return Figures(data, where)


def _at(curve: dict[str, Any], key: str, processes: float) -> float | None:
    """A cpu_concurrency curve's `key` at `processes`: linear between its points, held at its
    ends; None where the curve lacks it."""
    ks, values = curve.get("ranks"), curve.get(key)
    return float(np.interp(processes, ks, values)) if ks and values else None
