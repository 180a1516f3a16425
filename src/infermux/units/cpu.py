"""The host CPU: model, cores this process may use, and ISA flags that matter for inference."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["ISA_FLAGS", "MAX_DEFAULT_FRONTS", "default_fronts", "read_cpu_info", "split_cores"]

#: Flags worth reporting: vector widths and matrix extensions that inference kernels use.
ISA_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
    # aarch64 (/proc/cpuinfo "Features")
    "asimd", "asimddp", "asimdhp", "sve", "sve2", "bf16", "i8mm",
)


def read_cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """Model name, logical/usable cores, sockets and ISA flags, from /proc/cpuinfo and affinity.

    `cpuinfo` is a parameter so captures from other machines (an Orin, a Xeon) can be parsed.
    """
    text = cpuinfo.read_text(errors="replace") if cpuinfo.exists() else ""
    model = ""
    flags: set[str] = set()
    sockets: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        value = value.strip()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value
        elif key in ("flags", "features"):
            flags.update(value.split())
        elif key == "physical id":
            sockets.add(value)
    if not model:
        model = platform.processor() or platform.machine()
    try:
        usable = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = list(range(os.cpu_count() or 1))
    return {
        "model": model,
        "arch": platform.machine(),
        "logical_cores": os.cpu_count() or len(usable),
        "usable_cores": usable,
        "sockets": max(1, len(sockets)),
        "isa": [f for f in ISA_FLAGS if f in flags],
    }


def split_cores(cores: tuple[int, ...], parts: int) -> list[tuple[int, ...]]:
    """`cores` in `parts` contiguous sets, as even as they divide (the first ones one larger)."""
    size, extra = divmod(len(cores), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        out.append(cores[at:at + n])
        at += n
    return out


#: Most front processes `infermux serve` starts by default (more did not help one runtime
#: process).
MAX_DEFAULT_FRONTS = 8


def default_fronts(cores: int) -> int:
    """Front processes `infermux serve` starts on a host of `cores` usable cores: half (at most 8).

    The other half are the runtime process's (dispatcher, GPU worker threads, the gather
    threads). Below four cores a separate front would take a core the runtime needs: 1, the
    fronts run in the server process as before.
    """
    return 1 if cores < 4 else min(MAX_DEFAULT_FRONTS, cores // 2)
