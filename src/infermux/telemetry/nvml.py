"""NVIDIA GPUs through NVML (nvidia-ml-py, imported lazily).

Per GPU and tick: board power, the total-energy counter where the GPU has one (Volta and newer;
otherwise the sampler integrates power and the result says so), SM and memory utilisation,
memory used, SM and memory clocks, temperature (and the slowdown threshold, read once), the
clock-limiting ("clocks event", formerly "throttle") reasons, and other processes on the GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from infermux.nvidia import cuda_nvml_map
from infermux.telemetry.base import Reading, Source, SourceUnavailable

__all__ = ["THROTTLE_REASONS", "NvmlSource", "decode_throttle"]

#: NVML clocks-event reason bits (nvml.h `nvmlClocksEventReason*`) by our name.
THROTTLE_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clocks": 0x100,
}


def decode_throttle(mask: int) -> tuple[str, ...]:
    """Names of the reasons set in an NVML clocks-event bitmask, in bit order."""
    return tuple(name for name, bit in THROTTLE_REASONS.items() if mask & bit)


def _holds_cuda_memory(cuda_index: int) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    return bool(torch.cuda.memory_reserved(cuda_index) > 0)


def instant_power_mw(pynvml: Any, gpu: _Gpu) -> int | None:
    """The GPU's instantaneous power in mW from NVML's field values; None if not supported."""
    try:
        value = pynvml.nvmlDeviceGetFieldValues(gpu.handle, [gpu.instant_field])[0]
    except pynvml.NVMLError:
        return None
    if value.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    return int(value.value.uiVal)


class _Gpu:
    """One GPU's handle and the facts read once at start."""

    def __init__(self, pynvml: Any, device: str, nvml_index: int) -> None:
        self.device = device
        self.nvml_index = nvml_index
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
        name = pynvml.nvmlDeviceGetName(self.handle)
        self.name = name.decode() if isinstance(name, bytes) else name
        self.has_energy = True
        try:
            self.energy_origin_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except pynvml.NVMLError:
            self.has_energy = False
            self.energy_origin_mj = 0
        try:
            self.slowdown_c: float | None = float(pynvml.nvmlDeviceGetTemperatureThreshold(
                self.handle, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        except pynvml.NVMLError:
            self.slowdown_c = None
        try:
            self.power_limit_w: float | None = (
                pynvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1000.0)
        except pynvml.NVMLError:
            self.power_limit_w = None
        # Renamed "clocks event reasons" in NVML 12.x; the old name remains in older bindings.
        self.reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        self.processes_ok = True
        # Newer drivers average nvmlDeviceGetPowerUsage over ~1 s on Ampere and later; the
        # instantaneous field, where it exists, is what a 10 Hz trace and a peak need.
        self.instant_field = getattr(pynvml, "NVML_FI_DEV_POWER_INSTANT", None)
        if self.instant_field is not None and instant_power_mw(pynvml, self) is None:
            self.instant_field = None


class NvmlSource(Source):
    """NVIDIA GPUs through NVML; `cuda_indices` limits it to some GPUs (default: all visible)."""

    name = "nvml"

    def __init__(self, cuda_indices: Sequence[int] | None = None) -> None:
        super().__init__()
        try:
            import pynvml
        except ImportError:
            raise SourceUnavailable(
                "nvml: nvidia-ml-py is not installed (pip install 'infermux[nvidia]')") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise SourceUnavailable(
                f"nvml: cannot initialise NVML ({exc}): no NVIDIA driver here") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
            mapping = cuda_nvml_map(pynvml)
            wanted = sorted(mapping) if cuda_indices is None else list(cuda_indices)
            missing = [i for i in wanted if i not in mapping]
            if missing:
                raise SourceUnavailable(f"nvml: CUDA devices {missing} not found among {count} GPUs")
            self._gpus = [_Gpu(pynvml, f"cuda:{i}", mapping[i]) for i in wanted]
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise SourceUnavailable(f"nvml: reading the GPUs failed ({exc})") from exc
        if not self._gpus:
            pynvml.nvmlShutdown()
            raise SourceUnavailable("nvml: NVML sees no GPU")
        for gpu in self._gpus:
            if not gpu.has_energy:
                self.notes.append(
                    f"{gpu.device} ({gpu.name}) has no total-energy counter: energy is power "
                    "integrated over time")
        self._closed = False

    @property
    def devices(self) -> list[str]:
        """`cuda:N` per GPU read."""
        return [g.device for g in self._gpus]

    def describe(self) -> dict[str, Any]:
        """GPU names, NVML indices, energy method, slowdown temperature and power limit."""
        data = super().describe()
        data["gpus"] = [
            {"device": g.device, "nvml_index": g.nvml_index, "name": g.name,
             "energy": "counter" if g.has_energy else "power-integrated",
             "power": "instant" if g.instant_field is not None else "nvmlDeviceGetPowerUsage",
             "temp_slowdown_c": g.slowdown_c, "power_limit_w": g.power_limit_w}
            for g in self._gpus
        ]
        return data

    def read(self) -> list[Reading]:
        """One reading per GPU; a field NVML refuses stays None."""
        return [self._read_gpu(g) for g in self._gpus]

    def _try(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)`, or None when NVML refuses (not supported, no permission, GPU lost)."""
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def _read_gpu(self, gpu: _Gpu) -> Reading:
        nv, h, get = self._nvml, gpu.handle, self._try
        reading = Reading(source=self.name, device=gpu.device, temp_slowdown_c=gpu.slowdown_c)
        mw = instant_power_mw(nv, gpu) if gpu.instant_field is not None else None
        if mw is None:
            mw = get(nv.nvmlDeviceGetPowerUsage, h)
        if mw is not None:
            reading.power_w = mw / 1000.0
        if gpu.has_energy and (mj := get(nv.nvmlDeviceGetTotalEnergyConsumption, h)) is not None:
            reading.energy_j = (mj - gpu.energy_origin_mj) / 1000.0
        if (util := get(nv.nvmlDeviceGetUtilizationRates, h)) is not None:
            reading.util_pct, reading.mem_util_pct = float(util.gpu), float(util.memory)
        if (memory := get(nv.nvmlDeviceGetMemoryInfo, h)) is not None:
            reading.mem_used_bytes = int(memory.used)
        if (sm := get(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)) is not None:
            reading.clock_mhz = float(sm)
        if (mem := get(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)) is not None:
            reading.mem_clock_mhz = float(mem)
        if (temp := get(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)) is not None:
            reading.temp_c = float(temp)
        if (mask := get(gpu.reasons, h)) is not None:
            reading.throttle = decode_throttle(int(mask))
        if gpu.processes_ok:
            reading.other_processes = self._others(gpu)
        return reading

    def _others(self, gpu: _Gpu) -> tuple[int, ...] | None:
        """Pids of other processes with a context on the GPU; None when NVML cannot say.

        In a container NVML reports host pids, so this process's own pid may not appear:
        then, if this process holds CUDA memory on that GPU, one entry is taken to be it.
        """
        nv = self._nvml
        try:
            procs = list(nv.nvmlDeviceGetComputeRunningProcesses(gpu.handle))
        except nv.NVMLError:
            gpu.processes_ok = False  # not supported (MIG, permissions): stop asking
            return None
        procs += self._try(nv.nvmlDeviceGetGraphicsRunningProcesses, gpu.handle) or []
        pids = sorted({int(p.pid) for p in procs if int(p.pid) > 0})
        me = os.getpid()
        if me in pids:
            return tuple(p for p in pids if p != me)
        if pids and _holds_cuda_memory(int(gpu.device.partition(":")[2])):
            return tuple(pids[1:])
        return tuple(pids)

    def close(self) -> None:
        """Shut NVML down (reference-counted by NVML itself)."""
        if not self._closed:
            self._closed = True
            self._try(self._nvml.nvmlShutdown)
