"""Which machine a results file or a ceilings file was measured on, so validation pairs each
measurement with the ceilings of its own host.

Hostnames alone do not tell hosts apart here (every lent VM is called "vm"), so a host is the
tuple (hostname, CPU count, GPU name, GPU count); two descriptions are the same host when every
field both of them know agrees. Run records carry it in `env` (hostname, cpu_count, gpu_name,
gpu_count), ceilings files in `machine` (hostname, cpu_cores, gpu, gpu_count), DDP summaries
only the GPU (`device`, and `gpus_machine`: "4x NVIDIA H200 (...)").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Host:
    hostname: str | None = None
    cpus: int | None = None
    gpu: str | None = None
    gpus: int | None = None

    @classmethod
    def of_record(cls, rec: dict[str, Any]) -> Host:
        env = rec.get("env") or {}
        return cls(env.get("hostname"), env.get("cpu_count"), env.get("gpu_name"),
                   env.get("gpu_count"))  # fmt: skip

    @classmethod
    def of_ceilings(cls, data: dict[str, Any]) -> Host:
        m = data.get("machine") or {}
        return cls(m.get("hostname"), m.get("cpu_cores"), m.get("gpu"), m.get("gpu_count"))

    @classmethod
    def of_summary(cls, obj: dict[str, Any]) -> Host:
        count = re.match(r"\s*(\d+)\s*x\s", str(obj.get("gpus_machine") or ""))
        return cls(None, None, obj.get("device") or obj.get("gpu"),
                   int(count.group(1)) if count else None)  # fmt: skip

    @property
    def known(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    def same(self, other: Host) -> bool:
        """Every field both know agrees, and they share at least one."""
        pairs = [(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)]
        both = [(a, b) for a, b in pairs if a is not None and b is not None]
        return bool(both) and all(a == b for a, b in both)

    def describe(self) -> str:
        parts = [self.hostname or "?"]
        if self.cpus is not None:
            parts.append(f"{self.cpus} cpus")
        if self.gpu is not None:
            parts.append(f"{self.gpus or '?'}x {self.gpu}")
        return ", ".join(parts)
