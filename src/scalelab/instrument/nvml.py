"""`--nvml`: a sampler thread reading this rank's GPU through NVML (nvidia-ml-py) at a fixed
period: memory used, power, SM utilisation and the board's energy counter.

Samples are attributed to phases afterwards through the phase intervals the PhaseTimer logs
while the sampler runs (`HUB.intervals`): a phase's peak memory is the largest sample inside
any of its intervals (or the nearest sample when the phase is shorter than the period), its
energy the energy counter interpolated at the interval ends, summed over the intervals.
Resolution is the sampling period and the driver's own update rate (~20-100 ms for power on
recent GPUs): per-phase numbers of millisecond phases are estimates, whole-run ones are not.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch

from scalelab.errors import UsageError
from scalelab.instrument.timer import HUB

DEFAULT_PERIOD_S = 0.01


def import_nvml() -> ModuleType:
    """pynvml, initialised; UsageError (one line) when the package or the driver is missing."""
    try:
        import pynvml
    except ImportError:
        raise UsageError(
            "--nvml needs nvidia-ml-py (pip install -e '.[gpu]'), which is not installed"
        ) from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise UsageError(
            f"--nvml: NVML did not start (no NVIDIA driver or GPU here?): {exc}"
        ) from None
    return pynvml


def nvml_handle(nvml: ModuleType, device: torch.device) -> Any:
    """The NVML handle of a torch CUDA device: by UUID, since CUDA_VISIBLE_DEVICES renumbers
    devices for CUDA but not for NVML."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except Exception:
            pass  # MIG or older drivers: fall back to the index
    return nvml.nvmlDeviceGetHandleByIndex(index)


@dataclass
class Samples:
    """Columns of the samples taken: time (perf_counter s), memory used (bytes), power (W),
    SM utilisation (%), energy counter (J since driver load; NaN where unsupported)."""

    t: list[float] = field(default_factory=list)
    mem: list[float] = field(default_factory=list)
    power: list[float] = field(default_factory=list)
    util: list[float] = field(default_factory=list)
    energy: list[float] = field(default_factory=list)


def read_sample(nvml: ModuleType, handle: Any) -> tuple[float, float, float, float]:
    mem = float(nvml.nvmlDeviceGetMemoryInfo(handle).used)
    power = nvml.nvmlDeviceGetPowerUsage(handle) / 1e3  # mW -> W
    util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    try:
        energy = nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3  # mJ -> J (Volta+)
    except Exception:
        energy = float("nan")
    return mem, power, util, energy


class NvmlSampler:
    """Context manager: a daemon thread samples every period_s; phase intervals are logged
    meanwhile so `notes()` can give per-phase peak memory and energy."""

    def __init__(
        self,
        device: torch.device,
        period_s: float = DEFAULT_PERIOD_S,
        nvml: ModuleType | None = None,
        handle: Any = None,
    ) -> None:
        """nvml/handle: an already opened NVML module and device handle (tests pass fakes)."""
        self.nvml = import_nvml() if nvml is None else nvml
        if device.type != "cuda":
            raise UsageError(
                f"--nvml samples the GPU a run computes on; this run computes on {device.type} "
                "(use --device cuda or a GPU strategy)"
            )
        self.handle = nvml_handle(self.nvml, device) if handle is None else handle
        self.period_s = period_s
        self.samples = Samples()
        self.intervals: list[tuple[str, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scalelab-nvml", daemon=True)

    def _take(self) -> None:
        mem, power, util, energy = read_sample(self.nvml, self.handle)
        s = self.samples
        s.t.append(time.perf_counter())
        s.mem.append(mem)
        s.power.append(power)
        s.util.append(util)
        s.energy.append(energy)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._take()

    def __enter__(self) -> NvmlSampler:
        self._take()  # one sample before the first phase
        HUB.intervals = self.intervals
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._take()  # and one after the last
        HUB.intervals = None

    def notes(self) -> dict[str, Any]:
        return summarize(self.samples, self.intervals, self.period_s)

    def over(self, spans: list[tuple[float, float]]) -> dict[str, float]:
        """attribute() over any spans of this run (e.g. one layer's forward calls)."""
        return attribute(self.samples, energy_curve(self.samples), spans)


def energy_curve(s: Samples) -> np.ndarray:
    """Cumulative energy (J) at each sample: the board's counter where it has one, else the
    trapezoidal integral of the power samples."""
    t, p, e = np.asarray(s.t), np.asarray(s.power), np.asarray(s.energy)
    if len(e) and np.all(np.isfinite(e)):
        return e - e[0]
    steps = np.diff(t) * (p[1:] + p[:-1]) / 2
    return np.concatenate([[0.0], np.cumsum(steps)])


def attribute(s: Samples, energy: np.ndarray, spans: list[tuple[float, float]]) -> dict[str, float]:
    """Peak memory (largest sample inside a span, else the sample nearest its middle), energy
    (the cumulative curve interpolated at the span ends, summed) and mean power over spans."""
    t, mem = np.asarray(s.t), np.asarray(s.mem)
    peak, joules, seconds = 0.0, 0.0, 0.0
    for start, end in spans:
        inside = (t >= start) & (t <= end)
        near = mem[inside].max() if inside.any() else mem[np.abs(t - (start + end) / 2).argmin()]
        peak = max(peak, float(near))
        joules += float(np.interp(end, t, energy) - np.interp(start, t, energy))
        seconds += end - start
    return {
        "peak_mem_bytes": peak,
        "energy_j": joules,
        "power_w": joules / seconds if seconds > 0 else float("nan"),
        "count": len(spans),
    }


def summarize(
    s: Samples, intervals: list[tuple[str, float, float]], period_s: float
) -> dict[str, Any]:
    """Whole-run and per-phase figures from the samples (see the module docstring)."""
    t, mem = np.asarray(s.t), np.asarray(s.mem)
    energy = energy_curve(s)
    spans: dict[str, list[tuple[float, float]]] = {}
    for path, start, end in intervals:
        spans.setdefault(path, []).append((start, end))
    return {
        "period_s": period_s,
        "samples": len(t),
        "seconds": float(t[-1] - t[0]) if len(t) else 0.0,
        "peak_mem_bytes": float(mem.max()) if len(mem) else None,
        "mean_power_w": float(np.mean(s.power)) if s.power else None,
        "max_power_w": float(np.max(s.power)) if s.power else None,
        "mean_sm_util": float(np.mean(s.util)) if s.util else None,
        "energy_j": float(energy[-1]) if len(energy) else None,
        "phases": {path: attribute(s, energy, sp) for path, sp in spans.items()},
    }
