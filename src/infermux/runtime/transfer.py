"""Where a stage's tensors live and how they move between units.

One code path serves the profiler (which times it) and the pipeline (which runs it), so a profile
measures what runs.

A CPU unit's tensors live in host memory, pinned when a GPU is present (so GPU copies from and to
them are real DMA transfers); a CUDA unit's live on its device. A copy is issued by the thread
that needs the data (the consumer pulls), on that thread's stream for GPU work, and is finished
on return. CPU threads run on their unit's cores (`pin_thread`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from infermux.units import Unit

__all__ = ["HOST", "alloc", "copy_into", "device_of", "dtype_of", "pin_thread", "stream_for"]

#: The host as an endpoint: where a pipeline's inputs come from and its outputs go.
HOST = "host"


def dtype_of(unit: Unit | None) -> Any:
    """The torch dtype a unit computes in (`float32` for the host and CPU units)."""
    import torch

    return getattr(torch, unit.torch_dtype_name if unit is not None else "float32")


def device_of(unit: Unit | None) -> Any:
    """The torch device a unit's tensors live on (the host for `None` and CPU units)."""
    import torch

    if unit is not None and unit.kind == "cuda":
        return torch.device(unit.device)
    return torch.device("cpu")


def _cuda_present() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def alloc(unit: Unit | None, shape: tuple[int, ...], dtype: Any | None = None) -> Any:
    """An uninitialised buffer in `unit`'s memory (pinned host memory when a GPU is present)."""
    import torch

    device = device_of(unit)
    dtype = dtype if dtype is not None else dtype_of(unit)
    pin = device.type == "cpu" and _cuda_present()
    return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)


def stream_for(unit: Unit | None) -> Any | None:
    """A new CUDA stream on a GPU unit's device; None for host endpoints."""
    import torch

    if unit is not None and unit.kind == "cuda":
        return torch.cuda.Stream(torch.device(unit.device))
    return None


def copy_into(dst: Any, src: Any, stream: Any | None) -> None:
    """`dst.copy_(src)` (converting dtype), on `stream` when given, finished on return.

    GPU↔host copies use pinned host buffers, so they are asynchronous DMA on `stream`; GPU↔GPU
    copies between devices are peer copies where the devices allow it (else staged by the driver).
    """
    import torch

    if stream is None:
        dst.copy_(src)
        return
    previous = torch.cuda.current_stream(stream.device)
    torch.cuda.set_stream(stream)
    try:
        dst.copy_(src, non_blocking=True)
    finally:
        torch.cuda.set_stream(previous)
    stream.synchronize()


@contextmanager
def pin_thread(unit: Unit | None) -> Iterator[None]:
    """Run the calling thread on a CPU unit's cores (Linux affinity is per thread); restore after."""
    if unit is None or unit.kind != "cpu" or not unit.cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, unit.cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
