"""Where a stage's tensors live and how they move between units.

One code path serves the profiler (which times it) and the pipeline (which runs it), so a profile
measures what runs.

A CPU unit's tensors live in host memory, pinned when a GPU is present (so GPU copies from and to
them are real DMA transfers); a CUDA unit's live on its device. A copy is issued by the thread
that needs the data (the consumer pulls), on that thread's stream for GPU work, and is finished
on return. CPU threads run on their unit's cores (`pin_thread`).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from infermux.units import Unit

__all__ = ["HOST", "HostPins", "alloc", "copy_into", "device_of", "dtype_of", "host_pins",
           "pin_thread", "stream_for"]

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


class HostPins:
    """Host memory page-locked for CUDA in place (`cudaHostRegister`), chunk by chunk as used.

    Served rows lie in the front processes' slabs (shared memory this process maps). A GPU
    runner that copies them to its device straight from there, by DMA, needs the pages locked;
    the alternative, a CPU copy of every row into a pinned staging buffer first, was the
    largest cost of serving ResNet-sized rows (docs/benchmarks.md). A slab is sized from the
    admission limit (gigabytes for large rows) and mostly untouched (its lowest slots are used
    first), so it is locked in chunks of `chunk_bytes` as rows in them are copied, never all
    at once. A region is kept referenced once any chunk of it is locked, so its mapping (and
    the pages locked) cannot go away under a copy; the locks go with the process.

    `register(address, size) -> bool` does the locking (`cuda_register` on a GPU host); a chunk
    it refuses is not tried again and rows in it take the staging path.
    """

    def __init__(self, register: Callable[[int, int], bool], chunk_bytes: int = 32 << 20) -> None:
        page = mmap.PAGESIZE
        self.chunk_bytes = max(page, chunk_bytes // page * page)
        self._register = register
        self._lock = threading.Lock()
        #: A mapping's first page → (a region viewing it, locked chunks, refused chunks). The
        #: region held keeps the mapping, so the address is not reused by another.
        self._regions: dict[int, tuple[Any, set[int], set[int]]] = {}

    def locked_bytes(self) -> int:
        """Bytes locked so far (whole chunks)."""
        return sum(len(locked) for _, locked, _ in self._regions.values()) * self.chunk_bytes

    def ensure(self, region: Any, slots: list[int]) -> bool:
        """Whether rows `slots` of `region` (a numpy array of rows) are locked, locking them now.

        `region` must be a view of a mapping from its start (a slab's input region, in any
        dtype): a chunk is a page-aligned range from there, the last one ending on the page
        that holds the region's end.
        """
        base = region.__array_interface__["data"][0]
        stride, row_bytes = region.strides[0], region[0].nbytes
        end = base + region.shape[0] * stride  # every slot's room, whatever the rows' dtype
        page = mmap.PAGESIZE
        start = base - base % page
        limit = -(-end // page) * page
        size = self.chunk_bytes
        wanted: set[int] = set()
        for slot in slots:
            first = base + slot * stride - start
            wanted.update(range(first // size, (first + row_bytes - 1) // size + 1))
        with self._lock:
            entry = self._regions.get(start)
            if entry is None:
                entry = self._regions[start] = (region, set(), set())
            _, locked, refused = entry
            todo = wanted - locked
            if todo & refused:
                return False
            for k in sorted(todo):
                at = start + k * size
                if self._register(at, min(at + size, limit) - at):
                    locked.add(k)
                else:
                    refused.add(k)
                    return False
        return True


def cuda_register(address: int, size: int) -> bool:
    """Page-lock `size` bytes at `address` for every CUDA device (`cudaHostRegisterPortable`).

    A refusal leaves its error as the thread's last CUDA error, which the next kernel launch
    would report as its own: it is taken here, by a launch whose error is expected.
    """
    import torch

    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(address, size, 1)) == 0:
        return True
    with suppress(RuntimeError):
        torch.zeros(1, device="cuda")
    return False


_HOST_PINS: HostPins | None = None
_HOST_PINS_LOCK = threading.Lock()


def host_pins() -> HostPins:
    """The process-wide `HostPins` on CUDA (one per process: a range is registered once)."""
    global _HOST_PINS
    with _HOST_PINS_LOCK:
        if _HOST_PINS is None:
            _HOST_PINS = HostPins(cuda_register)
        return _HOST_PINS
