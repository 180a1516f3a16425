"""Host memory page-locked for CUDA in place, so served rows go to a GPU by DMA from their slabs."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

__all__ = ["HostPins", "cuda_register", "host_pins"]


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
        self._locked_bytes = 0

    def locked_bytes(self) -> int:
        """Bytes locked so far."""
        return self._locked_bytes

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
        with self._lock:
            entry = self._regions.get(start)
            if entry is None:
                entry = self._regions[start] = (region, set(), set())
            _, locked, refused = entry
            # Served batches reuse the lowest slots: every chunk from the lowest row's to the
            # highest's is usually locked already, which two bounds tell without a set per row.
            low = (base + min(slots) * stride - start) // size
            high = (base + max(slots) * stride - start + row_bytes - 1) // size
            if all(k in locked for k in range(low, high + 1)):
                return True
        wanted: set[int] = set()
        for slot in slots:
            first = base + slot * stride - start
            wanted.update(range(first // size, (first + row_bytes - 1) // size + 1))
        with self._lock:
            _, locked, refused = entry
            todo = wanted - locked
            if todo & refused:
                return False
            for k in sorted(todo):
                at = start + k * size
                if self._register(at, min(at + size, limit) - at):
                    locked.add(k)
                    self._locked_bytes += min(at + size, limit) - at
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
