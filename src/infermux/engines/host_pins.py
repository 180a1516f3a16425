"""Host memory page-locked for CUDA in place, so served rows go to a GPU by DMA from their slabs."""

from __future__ import annotations

import math
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
    first), so it is locked in chunks of about `chunk_bytes` (whole rows: a copy must lie in
    one registration) as rows in them are copied, never all at once. A region is kept
    referenced once any chunk of it is locked, so its mapping (and the pages locked) cannot go
    away under a copy; the locks go with the process.

    `register(address, size) -> bool` does the locking (`cuda_register` on a GPU host); a chunk
    it refuses is not tried again and rows in it take the staging path.
    """

    def __init__(self, register: Callable[[int, int], bool], chunk_bytes: int = 32 << 20) -> None:
        page = mmap.PAGESIZE
        self.chunk_bytes = max(page, chunk_bytes // page * page)
        self._register = register
        self._lock = threading.Lock()
        #: A mapping's first byte → (a region viewing it, locked chunks, refused chunks). The
        #: region held keeps the mapping, so the address is not reused by another.
        self._regions: dict[int, tuple[Any, set[int], set[int]]] = {}
        self._locked_bytes = 0

    def locked_bytes(self) -> int:
        """Bytes locked so far."""
        return self._locked_bytes

    def ensure(self, region: Any, slots: list[int]) -> bool:
        """Whether rows `slots` of `region` (a numpy array of rows) are locked, locking them now.

        `region` must be a view of a mapping from its start (a slab's input region, in any
        dtype). A chunk is a run of whole rows starting on a page: a copy from host memory must
        lie within one registration (CUDA refuses a copy that spans two with "invalid
        argument"), so no row is split between chunks. Its rows are `rows_per_chunk` of them;
        the last chunk ends on the page that holds the region's end.
        """
        base = region.__array_interface__["data"][0]
        stride = region.strides[0]
        page = mmap.PAGESIZE
        if base % page:
            return False
        per = self.rows_per_chunk(stride)
        limit = -(-(base + region.shape[0] * stride) // page) * page
        with self._lock:
            entry = self._regions.get(base)
            if entry is None:
                entry = self._regions[base] = (region, set(), set())
            _, locked, refused = entry
            # Served batches reuse the lowest slots: every chunk from the lowest row's to the
            # highest's is usually locked already, which two bounds tell without a set per row.
            low, high = min(slots) // per, max(slots) // per
            if all(k in locked for k in range(low, high + 1)):
                return True
        wanted = {slot // per for slot in slots}
        with self._lock:
            _, locked, refused = entry
            todo = wanted - locked
            if todo & refused:
                return False
            for k in sorted(todo):
                at = base + k * per * stride
                size = min(at + per * stride, limit) - at
                if self._register(at, size):
                    locked.add(k)
                    self._locked_bytes += size
                else:
                    refused.add(k)
                    return False
        return True

    def rows_per_chunk(self, stride: int) -> int:
        """Rows of `stride` bytes per chunk: about `chunk_bytes` of them.

        Their bytes are a whole number of pages, so each chunk starts on a page (as the row
        after its last one does).
        """
        page = mmap.PAGESIZE
        step = page // math.gcd(stride, page)  # rows whose bytes are a whole number of pages
        return max(step, self.chunk_bytes // stride // step * step)


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
