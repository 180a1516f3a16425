"""CUDA GPUs, seen through PyTorch (and NVML where nvidia-ml-py is installed, `infermux.nvidia`)."""

from __future__ import annotations

from typing import Any

from infermux.nvidia import nvml_info
from infermux.units.base import CUDA_MODES, Unit

__all__ = ["cuda_units"]


def cuda_units(notes: list[str]) -> list[Unit]:
    """One unit per (GPU, numeric mode); modes the hardware lacks are listed as unavailable."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        notes.append("cuda: PyTorch is not installed")
        return []
    if not torch.cuda.is_available():
        reason = "this PyTorch build has no CUDA" if torch.version.cuda is None else (
            "PyTorch has CUDA but sees no GPU (no driver, or CUDA_VISIBLE_DEVICES hides them)"
        )
        notes.append(f"cuda: no GPU units: {reason}")
        return []
    units: list[Unit] = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        capability = (props.major, props.minor)
        nvml = nvml_info(index)
        domain = f"gpu:{nvml.get('uuid') or index}"
        details: dict[str, Any] = {
            "memory_bytes": int(props.total_memory),
            "sm_count": int(props.multi_processor_count),
            "compute_capability": f"{props.major}.{props.minor}",
            "cuda_runtime": torch.version.cuda,
            **nvml,
        }
        for mode, needed in CUDA_MODES.items():
            ok = capability >= needed
            units.append(
                Unit(
                    id=f"cuda:{index}/{mode}",
                    kind="cuda",
                    device=f"cuda:{index}",
                    mode=mode,
                    name=props.name,
                    contention_domain=domain,
                    available=ok,
                    reason="" if ok else (
                        f"{mode} needs compute capability {needed[0]}.{needed[1]}, "
                        f"this GPU has {props.major}.{props.minor}"
                    ),
                    details=details,
                )
            )
    return units
