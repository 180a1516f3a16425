"""Shared memory for `infermux serve`: the fronts' tensor slabs and Triton's shared-memory extensions.

Two uses of the same mechanism:

- **Slabs** (`Segment`, `SlotAllocator`, `SlabLayout`): with `--fronts N` a front process writes
  a request's input rows into a segment the runtime process maps, and reads the outputs back
  from it; only a 20-byte descriptor crosses the socket (serve/fronts.py).
- **Triton's system shared memory extension** (`SharedMemoryRegions`): a client registers a
  POSIX shared-memory object (`/v2/systemsharedmemory/region/{name}/register`, or gRPC
  `SystemSharedMemoryRegister`); an input whose parameters name the region
  (`shared_memory_region`, `shared_memory_byte_size`, `shared_memory_offset`) is read from it
  and an output so named is written into it instead of the response. CUDA regions
  (`cudasharedmemory`, a `cudaIpcMemHandle_t` from the client) are opened with the CUDA runtime
  on GPU hosts; their inputs are copied to the host and their outputs back to the device.

Segments are opened through `/dev/shm` with `mmap`, not `multiprocessing.shared_memory`: before
Python 3.13 attaching to a segment registers it with the attaching process's resource tracker,
which unlinks it when that process exits, so a front (or a client region) would lose its memory
to whichever process exited first.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import ctypes
import functools
import math
import mmap
import os
import secrets
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infermux.serve.core import DATATYPES, ProtocolError, tensor_from_bytes

__all__ = [
    "SHM_DIR",
    "OutputTarget",
    "Segment",
    "SharedMemoryRegions",
    "SlabLayout",
    "SlabRow",
    "SlotAllocator",
    "cuda_ipc_available",
    "grpc_params",
    "output_target",
]

#: Where Linux keeps POSIX shared-memory objects (`shm_open("/x")` is `/dev/shm/x`).
SHM_DIR = "/dev/shm"


class Segment:
    """A POSIX shared-memory object mapped into this process (created or attached)."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        self.name = name.lstrip("/")
        path = os.path.join(SHM_DIR, self.name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise ValueError(f"shared memory {name!r} is empty")
            self.map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.owner = create

    @classmethod
    def new(cls, prefix: str, size: int) -> Segment:
        """A fresh segment of `size` bytes under a unique name (pages are touched lazily)."""
        return cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}", size, create=True)

    def unlink(self) -> None:
        """Remove the name; the mapping stays valid until closed (the owner's job)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))

    def close(self) -> None:
        """Unmap, unless arrays still view it (then the mapping goes with the last of them)."""
        with contextlib.suppress(BufferError):
            self.map.close()


class SlotAllocator:
    """First-fit allocation of contiguous slot ranges in a slab (one event loop, no lock).

    Reusing the lowest free slots first keeps the touched part of a large slab small: a
    segment's pages are allocated by the kernel only when first written.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._starts: list[int] = [0]
        self._lengths: list[int] = [slots]

    def take(self, n: int) -> int | None:
        """The first slot of `n` free contiguous slots, or None when no run is long enough."""
        for i, length in enumerate(self._lengths):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += n
                    self._lengths[i] -= n
                return start
        return None

    def give(self, start: int, n: int) -> None:
        """Free `n` slots from `start`, merged with free neighbours."""
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            i -= 1
            self._lengths[i] += n
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, n)
        if i + 1 < len(self._starts) and self._starts[i] + self._lengths[i] == self._starts[i + 1]:
            self._lengths[i] += self._lengths[i + 1]
            del self._starts[i + 1], self._lengths[i + 1]

    @property
    def free(self) -> int:
        """Free slots in all."""
        return sum(self._lengths)


class SlabRow(np.ndarray):
    """One slot's input row of a front's slab, as the runtime process sees it.

    An ordinary row wherever a row is read (stacked, pickled, copied: it is an ndarray); a
    runner that knows slabs reads `slab_region` (the slab's input region, `(slots, *shape)`)
    and `slab_slot` (this row's index in it), and gathers a batch's rows of one slab with one
    indexed copy instead of one copy per row. `slab_key` tells slabs apart (the same key, the
    same region). Made once per slot (`SlabLayout.rows`), so serving a row creates no array.
    """

    slab_region: np.ndarray
    slab_slot: int
    slab_key: Any


@dataclass(frozen=True)
class SlabLayout:
    """Where a request's tensors lie in a model's slab.

    A slab of `slots` slots is two regions: the inputs (slot `s`'s input, room for FP32, the
    widest accepted, at `s * input_item_bytes`), then the outputs (slot `s`'s at
    `slots * input_item_bytes + s * output bytes`). A request of `n` items takes `n`
    contiguous slots: its input rows are rows `start` to `start + n` of the input region,
    and its outputs are each `n` rows in its part of the output region, one contiguous array
    each. The input region is one array of rows indexed by slot, so the runtime gathers a
    batch's rows from a slab with one indexed copy (`rows`, `SlabRow`).

    A model of several inputs (`several`: each input's item shape and dtype, -1 for a
    sequence dim; `output_shapes`: each output's item shape at the longest length) has room
    per slot for every input and output at `max_length`; a request of sequence length
    `length` packs each input's `n` rows at that length one after another in its part of the
    input region, and its outputs, at the shapes the runtime gave them, in its part of the
    output region.
    """

    input_shape: tuple[int, ...]
    output_shapes: tuple[tuple[int, ...], ...]
    several: tuple[tuple[tuple[int, ...], str], ...] = ()
    max_length: int = 1
    #: Slots of the slab (set once its size is known: `replace(layout, slots=n)`).
    slots: int = 0
    #: A model of several inputs whose outputs have no sequence dim: every request's outputs
    #: are `output_shapes`, so the runtime writes them into the request's slots as it does a
    #: single-input model's (no shapes sent back, no second copy).
    fixed_outputs: bool = False
    #: Each output's dtype in the slab (numpy's `str`, e.g. "<i8"); empty: every one FP32.
    #: Float outputs are FP32 here whatever they are served as (the native backend makes FP16
    #: of them); integer and bool ones keep their own, so their values cross exactly.
    output_dtypes: tuple[str, ...] = ()

    def _at(self, shape: tuple[int, ...], length: int | None) -> tuple[int, ...]:
        """`shape` with its sequence dims (-1) at `length` (the longest when None)."""
        size = self.max_length if length is None else length
        return tuple(size if d == -1 else d for d in shape)

    @functools.cached_property
    def input_item_bytes(self) -> int:
        """Bytes of one item's input (every input at the longest length), as stored."""
        if self.several:
            return sum(math.prod(self._at(shape, None)) * np.dtype(dtype).itemsize
                       for shape, dtype in self.several)
        return math.prod(self.input_shape) * 4

    @functools.cached_property
    def _several_at(self) -> dict[int | None, list[tuple[tuple[int, ...], np.dtype, int]]]:
        """Per request length: each input's item shape, dtype and bytes (filled as met)."""
        return {}

    @functools.cached_property
    def _out_dtypes(self) -> tuple[np.dtype, ...]:
        """Each output's dtype in the slab."""
        if len(self.output_dtypes) == len(self.output_shapes):
            return tuple(np.dtype(d) for d in self.output_dtypes)
        return tuple(np.dtype("<f4") for _ in self.output_shapes)

    @functools.cached_property
    def output_item_bytes(self) -> tuple[int, ...]:
        """Bytes of one item's row of each output (at the longest length)."""
        return tuple(math.prod(s) * d.itemsize
                     for s, d in zip(self.output_shapes, self._out_dtypes, strict=True))

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: an item's input and outputs."""
        return self.input_item_bytes + sum(self.output_item_bytes)

    def inputs(self, buf: Any, start: int, n: int, dtype: np.dtype) -> np.ndarray:
        """The `n` input rows of the request at slot `start`, as `dtype`."""
        return self.input_rows(buf, dtype)[start:start + n]

    def input_rows(self, buf: Any, dtype: np.dtype) -> np.ndarray:
        """The whole input region as `(slots, *input_shape)` rows of `dtype`, one per slot."""
        dtype = np.dtype(dtype)
        inner = [dtype.itemsize]
        for d in reversed(self.input_shape[1:]):
            inner.insert(0, inner[0] * d)
        return np.ndarray((self.slots, *self.input_shape), dtype=dtype, buffer=buf,
                          strides=(self.input_item_bytes, *inner[:len(self.input_shape)]))

    def rows(self, buf: Any, dtype: np.dtype, key: Any) -> list[SlabRow]:
        """One `SlabRow` per slot of the input region (made once per slab and dtype).

        A request's rows are a slice of this list: no array is made per request or row, and
        each row tells the runtime its slot (`SlabRow`).
        """
        region = self.input_rows(buf, dtype)
        rows = []
        for slot in range(self.slots):
            row = region[slot].view(SlabRow)
            row.slab_region, row.slab_slot, row.slab_key = region, slot, key
            rows.append(row)
        return rows

    def several_inputs(self, buf: Any, start: int, n: int, length: int | None,
                       ) -> list[np.ndarray]:
        """A model of several inputs: the request's arrays, one per input, at `length`."""
        specs = self._several_at.get(length)
        if specs is None:  # once per length: a request makes only its views
            specs = self._several_at[length] = [
                (shape, np.dtype(dtype), math.prod(shape) * np.dtype(dtype).itemsize)
                for shape, dtype in ((self._at(shape, length), dtype)
                                     for shape, dtype in self.several)]
        at = start * self.input_item_bytes
        views = []
        for shape, dtype, item_bytes in specs:
            views.append(np.ndarray((n, *shape), dtype=dtype, buffer=buf, offset=at))
            at += n * item_bytes
        return views

    def output_rows(self, buf: Any) -> np.ndarray | None:
        """A model of one output: the whole output region as `(slots, *shape)` rows.

        A request's outputs are then a slice of it (made once per slab, as `rows`). None for
        a model of several outputs.
        """
        if len(self.output_shapes) != 1:
            return None
        return np.ndarray((self.slots, *self.output_shapes[0]), dtype=self._out_dtypes[0],
                          buffer=buf, offset=self.slots * self.input_item_bytes)

    def outputs(self, buf: Any, start: int, n: int,
                shapes: Sequence[tuple[int, ...]] | None = None) -> list[np.ndarray]:
        """The request's output arrays (each in its slab dtype): `n` rows of `shapes`.

        `shapes`: each output's item shape as served (a model of several inputs: at the
        request's length); None: `output_shapes`. Raises ValueError when they do not fit the
        request's slots.
        """
        if shapes is None:
            shapes = self.output_shapes
        elif sum(math.prod(s) * d.itemsize for s, d in zip(shapes, self._out_dtypes, strict=True)
                 ) > sum(self.output_item_bytes):
            raise ValueError(f"outputs of shapes {[list(s) for s in shapes]} per item exceed "
                             f"the slab's room for {[list(s) for s in self.output_shapes]}")
        at = self.slots * self.input_item_bytes + start * sum(self.output_item_bytes)
        views = []
        for shape, dtype in zip(shapes, self._out_dtypes, strict=True):
            view = np.ndarray((n, *shape), dtype=dtype, buffer=buf, offset=at)
            views.append(view)
            at += view.nbytes
        return views


# -- Triton's shared-memory extensions --------------------------------------------------------

@dataclass
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    kind: str  # "system" or "cuda"
    segment: Segment | None = None
    device_ptr: int = 0
    device_id: int = 0
    raw_handle: bytes = b""

    def view(self, offset: int, byte_size: int, what: str) -> memoryview:
        if offset < 0 or byte_size < 0 or offset + byte_size > self.byte_size:
            raise ProtocolError(400, f"{what}: bytes {offset} to {offset + byte_size} are outside "
                                     f"shared memory region {self.name!r} of {self.byte_size} "
                                     "bytes")
        assert self.segment is not None  # a system region always has its segment
        start = self.offset + offset
        return memoryview(self.segment.map)[start:start + byte_size]

    def describe(self) -> dict[str, Any]:
        """What another process needs to open the same region."""
        return {"kind": self.kind, "name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size, "device_id": self.device_id,
                "raw_handle": base64.b64encode(self.raw_handle).decode()}

    def status(self) -> dict[str, Any]:
        if self.kind == "system":
            return {"name": self.name, "key": self.key, "offset": self.offset,
                    "byte_size": self.byte_size}
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


@dataclass(frozen=True)
class OutputTarget:
    """Where an output goes when the request names a shared-memory region for it."""

    region: str
    offset: int
    byte_size: int


def _int_param(params: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = params.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(400, f"{where}.{key} {value!r} is not a byte count")
    return value


def output_target(params: dict[str, Any], where: str) -> OutputTarget | None:
    """The region an output's parameters name, or None when they name none."""
    region = params.get("shared_memory_region")
    if region is None:
        return None
    if not isinstance(region, str):
        raise ProtocolError(400, f"{where}.shared_memory_region must be a region's name")
    return OutputTarget(region, _int_param(params, "shared_memory_offset", where, 0),
                        _int_param(params, "shared_memory_byte_size", where))


class SharedMemoryRegions:
    """The regions clients registered with this front (system and, on GPU hosts, CUDA)."""

    def __init__(self) -> None:
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()
        self._extensions: list[str] | None = None
        #: In a front process: tells the runtime process of a change, which tells every front
        #: (a client may register through one connection and infer through another, and
        #: connections are spread over the fronts). Raises ProtocolError if refused.
        self.publish: Callable[[dict[str, Any]], Awaitable[None]] | None = None

    def extensions(self) -> list[str]:
        """The protocol extensions these regions implement here (CUDA only on GPU hosts)."""
        if self._extensions is None:
            self._extensions = ["system_shared_memory"] + (
                ["cuda_shared_memory"] if cuda_ipc_available() else [])
        return self._extensions

    # -- registration ---------------------------------------------------------------------------

    async def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map `key`'s POSIX shared memory; bytes `offset` to `offset + byte_size` are the region."""
        region = self._open_system(name, key, offset, byte_size)
        await self._add(region)

    async def register_cuda(self, name: str, raw_handle: bytes, device_id: int,
                            byte_size: int) -> None:
        """Open a client's CUDA IPC handle (64 bytes) on `device_id`."""
        region = self._open_cuda(name, raw_handle, device_id, byte_size)
        await self._add(region)

    async def _add(self, region: _Region) -> None:
        if self.publish is not None:
            try:
                await self.publish({"op": "register", **region.describe()})
            except ProtocolError:
                self._close(region)
                raise
        with self._lock:
            if region.name in self._regions:  # the runtime's table came first: the same one
                self._close(self._regions[region.name])
            self._regions[region.name] = region

    async def unregister(self, name: str | None, kind: str) -> None:
        """Forget region `name` (every region of `kind` when None), in every front."""
        if self.publish is not None:
            await self.publish({"op": "unregister", "kind": kind, "name": name})
        self._drop(name, kind)

    def apply_table(self, table: dict[str, dict[str, Any]]) -> None:
        """Make the regions those of `table` (the runtime process's, of every front)."""
        with self._lock:
            gone = [n for n, r in self._regions.items()
                    if n not in table or table[n] != r.describe()]
        for name in gone:
            self._drop_one(name)
        for name, d in table.items():
            with self._lock:
                if name in self._regions:
                    continue
            try:
                if d["kind"] == "system":
                    region = self._open_system(name, d["key"], d["offset"], d["byte_size"])
                else:
                    region = self._open_cuda(name, base64.b64decode(d["raw_handle"]),
                                             d["device_id"], d["byte_size"])
            except ProtocolError:
                continue  # gone meanwhile: a request naming it gets the usual 400
            with self._lock:
                self._regions[name] = region

    def _open_system(self, name: str, key: str, offset: int, byte_size: int) -> _Region:
        self._check_new(name)
        if not isinstance(key, str) or not key.strip("/") or "/" in key.strip("/"):
            raise ProtocolError(400, f"shared memory key {key!r} is not a POSIX shared memory "
                                     "name such as /input0")
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ProtocolError(400, f"region {name!r} {what} {value!r} is not a byte count")
        try:
            segment = Segment(key, 0, create=False)
        except (OSError, ValueError) as exc:
            raise ProtocolError(400, f"shared memory {key!r} cannot be opened ({exc}): create "
                                     "it first (tritonclient.utils.shared_memory."
                                     "create_shared_memory_region)") from None
        if offset + byte_size > segment.size:
            segment.close()
            raise ProtocolError(400, f"region {name!r}: offset {offset} + byte_size {byte_size} "
                                     f"is beyond {key!r}'s {segment.size} bytes")
        return _Region(name, key, offset, byte_size, "system", segment)

    def _open_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int,
                   ) -> _Region:
        self._check_new(name)
        if len(raw_handle) != 64:
            raise ProtocolError(400, f"region {name!r}: raw_handle has {len(raw_handle)} bytes, "
                                     "a cudaIpcMemHandle_t has 64")
        ptr = _cuda().open_handle(raw_handle, device_id)
        return _Region(name, "", 0, byte_size, "cuda", device_ptr=ptr, device_id=device_id,
                       raw_handle=raw_handle)

    def _check_new(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ProtocolError(400, "a shared memory region needs a name")
        with self._lock:
            if name in self._regions:
                raise ProtocolError(400, f"shared memory region {name!r} is already registered: "
                                         "unregister it first")

    def _drop(self, name: str | None, kind: str) -> None:
        with self._lock:
            names = [n for n, r in self._regions.items() if r.kind == kind and name in (None, n)]
        for n in names:
            self._drop_one(n)

    def _drop_one(self, name: str) -> None:
        with self._lock:
            region = self._regions.pop(name, None)
        if region is not None:
            self._close(region)

    @staticmethod
    def _close(region: _Region) -> None:
        if region.segment is not None:
            region.segment.close()
        if region.device_ptr:
            _cuda().close_handle(region.device_ptr, region.device_id)

    def status(self, name: str | None, kind: str) -> list[dict[str, Any]]:
        """The registered regions of `kind` (or the one called `name`: 400 if there is none)."""
        with self._lock:
            regions = [r for r in self._regions.values() if r.kind == kind]
        if name is not None:
            regions = [r for r in regions if r.name == name]
            if not regions:
                raise ProtocolError(400, f"no {kind} shared memory region {name!r} is registered")
        return [r.status() for r in regions]

    def _get(self, name: str, what: str) -> _Region:
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise ProtocolError(400, f"{what}: shared memory region {name!r} is not registered")
        return region

    # -- tensors ----------------------------------------------------------------------------------

    def input(self, name: str, datatype: str, shape: tuple[int, ...], params: dict[str, Any],
              ) -> np.ndarray | None:
        """Input `name` read from the region its parameters name; None when they name none.

        A system region's rows are a view of the client's memory (the client leaves it alone
        until it has the answer); a CUDA region's are copied to the host.
        """
        region_name = params.get("shared_memory_region")
        if region_name is None:
            return None
        where = f"input {name!r} parameters"
        if not isinstance(region_name, str):
            raise ProtocolError(400, f"{where}.shared_memory_region must be a region's name")
        size = _int_param(params, "shared_memory_byte_size", where)
        offset = _int_param(params, "shared_memory_offset", where, 0)
        region = self._get(region_name, f"input {name!r}")
        if region.kind == "cuda":
            if offset + size > region.byte_size:
                raise ProtocolError(400, f"input {name!r}: bytes {offset} to {offset + size} are "
                                         f"outside region {region.name!r}")
            host = np.empty(size, dtype=np.uint8)
            _cuda().copy(host.ctypes.data, region.device_ptr + offset, size, to_device=False)
            return tensor_from_bytes(name, datatype, shape, host.data)
        return tensor_from_bytes(name, datatype, shape, region.view(offset, size, f"input {name!r}"))

    def write_output(self, name: str, y: np.ndarray, target: OutputTarget,
                     dtype: Any = "<f4") -> None:
        """Write output `name` into its target region, as `dtype` (its served datatype's)."""
        data = np.ascontiguousarray(y, dtype=dtype)
        if data.nbytes > target.byte_size:
            raise ProtocolError(400, f"output {name!r} has {data.nbytes} bytes, its "
                                     f"shared_memory_byte_size is {target.byte_size}")
        region = self._get(target.region, f"output {name!r}")
        if region.kind == "cuda":
            if target.offset + data.nbytes > region.byte_size:
                raise ProtocolError(400, f"output {name!r} does not fit region {region.name!r}")
            _cuda().copy(region.device_ptr + target.offset, data.ctypes.data, data.nbytes,
                         to_device=True)
            return
        dst = region.view(target.offset, data.nbytes, f"output {name!r}")
        np.frombuffer(dst, dtype=np.uint8)[:] = data.view(np.uint8).ravel()

    # -- the protocol's requests ---------------------------------------------------------------

    async def http_route(self, method: str, rest: list[str],
                         body: bytes | bytearray | memoryview) -> tuple[int, Any]:
        """Answer `/v2/{system,cuda}sharedmemory/...`: (status, JSON payload or None)."""
        import json

        kind = "system" if rest[0] == "systemsharedmemory" else "cuda"
        tail = rest[1:]
        name = None
        if tail[:1] == ["region"] and len(tail) == 3:
            name, tail = tail[1], tail[2:]
        if tail == ["status"]:
            _method(method, "GET", rest)
            return 200, self.status(name, kind)
        if tail == ["unregister"]:
            _method(method, "POST", rest)
            await self.unregister(name, kind)
            return 200, None
        if tail == ["register"] and name is not None:
            _method(method, "POST", rest)
            try:
                request = json.loads(bytes(body) or b"{}")
            except ValueError as exc:
                raise ProtocolError(400, f"the register request is not valid JSON: {exc}") from None
            if not isinstance(request, dict):
                raise ProtocolError(400, "the register request must be a JSON object")
            if kind == "system":
                key = request.get("key")
                if not isinstance(key, str):
                    raise ProtocolError(400, f"region {name!r} needs a key (a POSIX shared "
                                             "memory name such as /input0)")
                await self.register_system(name, key, _int_param(request, "offset", "request", 0),
                                     _int_param(request, "byte_size", "request"))
            else:
                handle = request.get("raw_handle")
                b64 = handle.get("b64") if isinstance(handle, dict) else None
                if not isinstance(b64, str):
                    raise ProtocolError(400, "raw_handle must be {\"b64\": BASE64 of the "
                                             "cudaIpcMemHandle_t}")
                await self.register_cuda(name, base64.b64decode(b64), _int_param(
                    request, "device_id", "request", 0), _int_param(request, "byte_size",
                                                                    "request"))
            return 200, None
        raise ProtocolError(404, f"no route /v2/{'/'.join(rest)}")

    def close(self) -> None:
        """Forget every region (here only)."""
        self._drop(None, "system")
        self._drop(None, "cuda")


def _method(given: str, wanted: str, rest: list[str]) -> None:
    if given != wanted:
        raise ProtocolError(405, f"{given} /v2/{'/'.join(rest)}: this route takes {wanted}")


def grpc_params(parameters: Any) -> dict[str, Any]:
    """A gRPC `map<string, InferParameter>` as a plain dict."""
    out: dict[str, Any] = {}
    for key, value in parameters.items():
        choice = value.WhichOneof("parameter_choice")
        if choice is not None:
            out[key] = getattr(value, choice)
    return out


def datatype_bytes(datatype: str) -> int:
    """Bytes per value of a v2 datatype this server reads."""
    return DATATYPES[datatype].itemsize


# -- CUDA, through the CUDA runtime library (GPU hosts only) ------------------------------------

class _CudaIpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Cuda:
    """The few CUDA runtime calls CUDA shared memory needs, loaded on first use."""

    def __init__(self) -> None:
        self.lib = _load_cudart()
        self._lock = threading.Lock()

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise ProtocolError(400, f"{what} failed: CUDA error {code}")

    def open_handle(self, raw: bytes, device_id: int) -> int:
        with self._lock:
            self._check(self.lib.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")
            ptr = ctypes.c_void_p()
            handle = _CudaIpcHandle(raw)
            # cudaIpcMemLazyEnablePeerAccess = 1
            self._check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), handle, 1),
                        "cudaIpcOpenMemHandle")
        return int(ptr.value or 0)

    def close_handle(self, ptr: int, device_id: int) -> None:
        with self._lock:
            self.lib.cudaSetDevice(device_id)
            self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))

    def copy(self, dst: int, src: int, size: int, *, to_device: bool) -> None:
        kind = 1 if to_device else 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost
        self._check(self.lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src),
                                        ctypes.c_size_t(size), kind), "cudaMemcpy")


def _load_cudart() -> Any:
    names = ["libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0"]
    with contextlib.suppress(ImportError):
        import nvidia.cuda_runtime as wheel  # the CUDA runtime wheel torch installs

        package_dir = os.path.dirname(wheel.__file__) if wheel.__file__ \
            else next(iter(wheel.__path__))  # a namespace package has no __file__
        lib_dir = os.path.join(package_dir, "lib")
        if os.path.isdir(lib_dir):
            names = [os.path.join(lib_dir, f) for f in sorted(os.listdir(lib_dir))
                     if f.startswith("libcudart.so")] + names
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _CudaIpcHandle,
                                             ctypes.c_uint]
        return lib
    raise ProtocolError(400, "CUDA shared memory needs the CUDA runtime (libcudart), which is "
                             "not on this host: use system shared memory")


@functools.lru_cache(maxsize=1)
def _cuda() -> _Cuda:
    return _Cuda()


def cuda_ipc_available() -> bool:
    """Whether this host can open CUDA IPC handles (a CUDA runtime and a device)."""
    try:
        lib = _cuda().lib
    except ProtocolError:
        return False
    count = ctypes.c_int(0)
    return lib.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0
