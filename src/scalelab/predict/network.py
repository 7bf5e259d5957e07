"""Inter-node networks: named profiles with datasheet figures, or the user's measured file.

A profile describes one network port (one NIC): its line rate in bytes/s per direction and the
one-way latency of a message through the adapter and one switch hop. These are what vendors
promise, not what NCCL or MPI reach; `scalelab predict --network FILE` takes a measured
alpha/beta instead (a JSON file, see `load_network`). How a port turns into a per-rank link
(NICs per node, the library's own per-message cost) is comm_model.Fabric's business.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from scalelab.errors import UsageError
from scalelab.registry import Registry

GBIT = 1e9 / 8  # bytes/s in one Gb/s


@dataclass(frozen=True)
class NetworkProfile:
    name: str
    bw_Bps: float  # per port, one direction
    latency_s: float  # one-way small-message latency (adapter + switch hop)
    source: str  # where the figures come from
    measured: bool = False  # True: alpha/beta measured end to end (library cost included)

    def describe(self) -> str:
        kind = "measured" if self.measured else "datasheet"
        return (
            f"{self.name}: {self.bw_Bps / 1e9:.1f} GB/s per port per direction, "
            f"{self.latency_s * 1e6:.2f} us latency ({kind}; {self.source})"
        )


NETWORKS: Registry[NetworkProfile] = Registry("network profile")

_CX7 = (
    "NVIDIA ConnectX-7 VPI adapter user manual: single-port NDR 400Gb/s, "
    "https://docs.nvidia.com/networking/display/ConnectX7VPI/Introduction"
)
_CX6 = (
    "NVIDIA ConnectX-6 adapter user manual, Introduction: VPI cards with up to two ports of "
    "200Gb/s, sub-600ns latency, https://docs.nvidia.com/networking/display/ConnectX6EN/Introduction"
)
_CX6EN = "Mellanox ConnectX-6 EN card product brief: up to two ports of 200GbE, sub 0.8usec latency"
_CX5EN = "Mellanox ConnectX-5 EN card product brief: two ports of 100GbE, sub-600ns latency"
# Latency = the adapter's figure plus one switch hop, rounded up: ConnectX adapters state
# sub-0.6 us (InfiniBand, RoCE on ConnectX-5) or sub-0.8 us (ConnectX-6 EN); an InfiniBand
# switch hop adds a few hundred ns, an Ethernet switch hop up to ~1 us.
for _profile in (
    NetworkProfile("ndr400", 400 * GBIT, 1.0e-6, _CX7 + "; latency as ConnectX-6 + one hop"),
    NetworkProfile("hdr200", 200 * GBIT, 1.0e-6, _CX6 + "; + one switch hop"),
    NetworkProfile("roce200", 200 * GBIT, 1.8e-6, _CX6EN + "; + one Ethernet switch hop"),
    NetworkProfile("roce100", 100 * GBIT, 1.6e-6, _CX5EN + "; + one Ethernet switch hop"),
):
    NETWORKS.register(_profile.name, _profile.describe())(_profile)


def load_network(spec: str | None) -> NetworkProfile | None:
    """A profile name (`ndr400`), a JSON file of the user's measurement, or None (one node).

    The file holds {"alpha_s": seconds, "beta_Bps": bytes/s} of one inter-node message
    (e.g. the p2p fit of `scalelab ceilings --ranks 2` run across two nodes; a ceilings file
    itself is accepted and its first comm backend's p2p fit is used), optionally "name" and
    "source"."""
    if spec is None:
        return None
    if spec in NETWORKS:
        return NETWORKS.get(spec)
    path = Path(spec)
    if not path.is_file():
        known = ", ".join(NETWORKS.names())
        raise UsageError(f"unknown network profile {spec!r} (known: {known}; or a JSON file)")
    return _from_file(path)


def _from_file(path: Path) -> NetworkProfile:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"--network {path}: not JSON") from None
    fit = _fit_of(data) if isinstance(data, dict) else None
    if fit is None:
        raise UsageError(
            f"--network {path}: needs alpha_s and beta_Bps (seconds, bytes/s) of one "
            "inter-node message, e.g. from `scalelab ceilings --ranks 2` across two nodes"
        )
    alpha, beta = fit
    if not (alpha >= 0 and beta > 0):
        raise UsageError(f"--network {path}: alpha_s must be >= 0 and beta_Bps > 0")
    source = str(data.get("source", f"measured, {path}"))
    return NetworkProfile(str(data.get("name", path.stem)), beta, alpha, source, measured=True)


def _fit_of(data: dict) -> tuple[float, float] | None:
    if "alpha_s" in data and "beta_Bps" in data:
        return float(data["alpha_s"]), float(data["beta_Bps"])
    for backend in (data.get("comm") or {}).values():  # a ceilings file measured across nodes
        p2p = backend.get("p2p") if isinstance(backend, dict) else None
        if isinstance(p2p, dict) and "alpha_s" in p2p and "beta_Bps" in p2p:
            return float(p2p["alpha_s"]), float(p2p["beta_Bps"])
    return None
