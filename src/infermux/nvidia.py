"""NVIDIA's facts in one place: which NVML device a CUDA index is, and what NVML says of it.

CUDA numbers the GPUs a process sees (after `CUDA_VISIBLE_DEVICES`, in `CUDA_DEVICE_ORDER`);
NVML numbers every GPU of the machine in PCI bus order. Units speak CUDA indices; telemetry and
the stored environment read NVML. `cuda_to_nvml` ties them: by UUID where PyTorch reports each
device's UUID, else by `CUDA_VISIBLE_DEVICES` (indices or `GPU-` UUID prefixes) over NVML's
devices in PCI bus order, else index for index. Discovery (`units/cuda.py`) and the NVML
telemetry source (`telemetry/nvml.py`) both go through it. nvidia-ml-py is imported lazily.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["NvmlDevice", "cuda_nvml_map", "cuda_to_nvml", "nvml_devices", "nvml_info", "torch_uuids"]


@dataclass(frozen=True)
class NvmlDevice:
    """One GPU as NVML lists it."""

    index: int
    uuid: str  # "GPU-…"
    pci_bus_id: str  # "00000000:1B:00.0"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_devices(pynvml: Any) -> list[NvmlDevice]:
    """Every GPU NVML sees (NVML initialised by the caller)."""
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        out.append(NvmlDevice(i, _text(pynvml.nvmlDeviceGetUUID(handle)),
                              _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)))
    return out


def torch_uuids() -> list[str | None]:
    """Each visible CUDA device's UUID as PyTorch reports it (`GPU-…`), None where it does not."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    out: list[str | None] = []
    for i in range(torch.cuda.device_count()):
        uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
        out.append(None if uuid is None else f"GPU-{uuid}")
    return out


def cuda_to_nvml(devices: Sequence[NvmlDevice], *, visible: str | None = None,
                 uuids: Sequence[str | None] = (), cuda_count: int | None = None
                 ) -> dict[int, int]:
    """CUDA index → NVML index for the GPUs this process sees.

    `visible` is `CUDA_VISIBLE_DEVICES` (None: unset); `uuids` each CUDA device's UUID where
    known; `cuda_count` how many CUDA devices the process sees (default: as many as `uuids`,
    the visible list or NVML's devices say). A CUDA device that cannot be tied to an NVML one
    is left out rather than guessed.
    """
    by_uuid = {d.uuid: d.index for d in devices}
    mapping = {i: by_uuid[u] for i, u in enumerate(uuids) if u is not None and u in by_uuid}
    if mapping and len(mapping) == len(uuids):
        return mapping
    in_pci_order = sorted(devices, key=lambda d: d.pci_bus_id.lower())
    if visible is not None and visible.strip() != "":
        mapping = {}
        for cuda_index, entry in enumerate(p.strip() for p in visible.split(",")):
            if entry.isdigit():
                n = int(entry)
                if n >= len(in_pci_order):
                    break  # CUDA stops at the first invalid entry
                mapping[cuda_index] = in_pci_order[n].index
            elif entry.startswith("GPU-"):
                found = [d for d in devices if d.uuid.startswith(entry)]
                if len(found) != 1:
                    break
                mapping[cuda_index] = found[0].index
            else:  # MIG-… instances and anything else: not a whole GPU NVML can name here
                break
    else:
        mapping = {i: d.index for i, d in enumerate(in_pci_order)}
    if cuda_count is not None:
        mapping = {i: n for i, n in mapping.items() if i < cuda_count}
    return mapping


def cuda_nvml_map(pynvml: Any) -> dict[int, int]:
    """The CUDA index → NVML index map of this process (NVML initialised by the caller)."""
    torch = sys.modules.get("torch")
    count = torch.cuda.device_count() if torch is not None and torch.cuda.is_available() else None
    return cuda_to_nvml(nvml_devices(pynvml), visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                        uuids=torch_uuids(), cuda_count=count)


def nvml_info(cuda_index: int) -> dict[str, Any]:
    """Driver, UUID, PCI bus id and clocks of CUDA device `cuda_index`; {} without NVML."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"nvml_error": str(exc)}
    try:
        index = cuda_nvml_map(pynvml).get(cuda_index)
        if index is None:
            return {"nvml_error": f"CUDA device {cuda_index} has no NVML device here"}
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        info: dict[str, Any] = {
            "nvml_index": index,
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "uuid": pynvml.nvmlDeviceGetUUID(handle),
            "pci_bus_id": pynvml.nvmlDeviceGetPciInfo(handle).busId,
            "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
            "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "power_limit_w": pynvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000.0,
        }
        return {k: (_text(v) if isinstance(v, bytes) else v) for k, v in info.items()}
    except pynvml.NVMLError as exc:
        return {"nvml_error": str(exc)}
    finally:
        pynvml.nvmlShutdown()
