"""The protocol-neutral core of `infermux serve`: models, admission, requests into the runtime.

The HTTP and gRPC fronts parse their wire formats into `numpy` inputs and call
`InferenceCore.infer`; everything they share lives here: the model descriptions that metadata
and config answer from, request validation (every error a `ProtocolError` naming the field),
bounded admission, the routing of the runtime's outputs back to each request, and the
statistics Triton's clients read.

Each request's items enter the runtime (`infermux.runtime.Runtime`: one machine's, or a
cluster's) as one query whose samples carry their own input rows (`Query.inputs`), exactly like
a load generator's queries: dynamic batching, replicas, pipelines, SLO-aware and dynamic
placement all apply. Outputs come back per batch through the core's subscription, a row per
item, and are written into the request's own arrays in order; failures come back as
completions that are not ok. Every admitted request is answered.

Two entries: `infer()`, one request awaited on the event loop (the in-process fronts), and
`submit_many()`, every request of a front process's frame admitted under one lock and
submitted in one call, their answers delivered per runtime batch to a `BatchSink` (no task,
no future, no loop turn per request: serve/fronts.py, docs/architecture-serve.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infermux.load.base import Query
from infermux.runtime.api import Runtime
from infermux.runtime.dispatcher import Batch, WorkerState
from infermux.runtime.plan import ModelEntry, Plan
from infermux.serve.trace import RequestTrace

__all__ = [
    "DATATYPES",
    "BatchAnswer",
    "BatchRequest",
    "BatchSink",
    "InferenceCore",
    "ModelInfo",
    "ProtocolError",
    "ServedModelSummary",
    "TensorSpec",
    "find_model",
    "output_datatype",
    "tensor_from_bytes",
    "tensor_from_list",
]

#: KServe v2 datatypes this server reads, with their numpy dtype (little-endian on the wire).
#: Integer and bool ones are taken by the inputs that are (token ids, masks); BYTES by none.
DATATYPES: dict[str, np.dtype] = {
    "FP32": np.dtype("<f4"), "FP16": np.dtype("<f2"), "FP64": np.dtype("<f8"),
    "INT64": np.dtype("<i8"), "INT32": np.dtype("<i4"), "BOOL": np.dtype("bool"),
}
_FLOAT_DATATYPES = ("FP32", "FP16", "FP64")
#: A spec dtype → its v2 datatype.
_V2 = {"float32": "FP32", "float16": "FP16", "bfloat16": "FP32", "float64": "FP64",
       "int64": "INT64", "int32": "INT32", "bool": "BOOL", "uint8": "INT32", "int8": "INT32"}
def output_datatype(dtype: Any) -> str:
    """The v2 datatype an output of `dtype` (a spec's name or a numpy dtype) is served as.

    Floats as FP32 (what every float output has been, whatever precision computed it),
    integers and bools as themselves (class ids, token ids: exact, never rounded to a float's
    24 bits; an integer type without a v2 name of its own as INT64).
    """
    name = str(dtype) if isinstance(dtype, str) else np.dtype(dtype).name
    v2 = _V2.get(name) or ("INT64" if name.startswith(("int", "uint")) else "FP32")
    return "FP32" if v2 in _FLOAT_DATATYPES else v2


#: Every datatype name of the protocol, so a wrong one is told apart from a misspelt one.
_KNOWN_DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                    "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16")
#: The protocol extensions this server implements (perf_analyzer reads the list).
EXTENSIONS = ["binary_tensor_data", "statistics", "model_configuration"]
SERVER_NAME = "infermux"


class ProtocolError(Exception):
    """A request the server answers with an error: HTTP status, message, optional Retry-After.

    400: the request is wrong (the message names the field); 401: no or a wrong API key;
    404: no such route; 503: the server cannot take it now (full queue, shutting down, no live
    worker), with `retry_after_s` where waiting helps.
    """

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model: name, v2 datatype, shape of one item (no batch axis).

    A dynamic dim (a sequence length) is -1, as the protocol writes it.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]

    def metadata(self) -> dict[str, Any]:
        """The v2 metadata entry: the batch axis is -1."""
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *self.shape]}

    def config(self) -> dict[str, Any]:
        """The Triton model-config entry."""
        return {"name": self.name, "data_type": f"TYPE_{self.datatype}", "dims": list(self.shape)}


@dataclass
class _Totals:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def dump(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class ModelStats:
    """What Triton's statistics extension reports for one model (request and batch totals)."""

    success: _Totals = field(default_factory=_Totals)
    fail: _Totals = field(default_factory=_Totals)
    queue: _Totals = field(default_factory=_Totals)
    compute_input: _Totals = field(default_factory=_Totals)
    compute_infer: _Totals = field(default_factory=_Totals)
    compute_output: _Totals = field(default_factory=_Totals)
    inference_count: int = 0
    execution_count: int = 0
    rejected: int = 0
    last_inference_ms: int = 0
    #: batch size → (count, compute_input ns, compute_infer ns, compute_output ns)
    batches: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ServedModelSummary:
    """One model's totals over a server's life (an entry of the summary's `models`)."""

    requests_ok: int
    requests_failed: int
    #: Refused with a 503 at the admission limit (never queued).
    requests_rejected: int
    items: int
    batches: int
    #: Mean time of an answered request, from its admission to its answer.
    mean_request_ms: float | None
    mean_batch: float | None

    def to_dict(self) -> dict[str, Any]:
        """The stored and printed form."""
        return {"requests_ok": self.requests_ok, "requests_failed": self.requests_failed,
                "requests_rejected": self.requests_rejected, "items": self.items,
                "batches": self.batches, "mean_request_ms": self.mean_request_ms,
                "mean_batch": self.mean_batch}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServedModelSummary:
        """A stored entry as the type."""
        return cls(int(data["requests_ok"]), int(data["requests_failed"]),
                   int(data.get("requests_rejected") or 0), int(data["items"]),
                   int(data["batches"]), data.get("mean_request_ms"), data.get("mean_batch"))


@dataclass
class ModelInfo:
    """What the server says about one model: its tensors, batch limit and where it runs."""

    name: str
    entry: ModelEntry
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int
    max_queue_delay_us: int
    #: Items this model may hold admitted and unanswered before new requests get a 503.
    max_queue_items: int
    instance_groups: list[dict[str, Any]]
    version: str = "1"
    stats: ModelStats = field(default_factory=ModelStats)
    in_flight_items: int = 0
    in_flight_requests: int = 0
    #: A model of several inputs: its `IOSpec` and the longest sequence length compiled.
    io: Any = None
    max_length: int | None = None
    #: The sequence lengths compiled (ascending); a model whose inputs cannot be padded
    #: (`IOSpec.pads_exactly`) takes only these.
    lengths: tuple[int, ...] = ()
    #: The outputs' names the model states (an ONNX file's, a factory's `outputs`), if any: a
    #: model of one input serves them; without them, `output` or `output_0`, `output_1`, ...
    output_names: tuple[str, ...] = ()
    #: A model of several inputs: each output's shape for one item at the longest length, as
    #: served (what a front process's slab makes room for; a spec's -1 may be any size).
    output_room: tuple[tuple[int, ...], ...] = ()

    def items(self, tensors: Mapping[str, np.ndarray]) -> tuple[list[list[np.ndarray]], int | None]:
        """A request's tensors of a model of several inputs as items, and its length.

        Each item is one array of every input (in the model's order); every input's dynamic
        dims must agree and fit the longest length compiled. A bad one is a 400 naming the
        input, what the model takes and what was given.
        """
        from infermux.errors import UsageError
        from infermux.iospec import IOSpec

        io: IOSpec = self.io
        arrays = [tensors[t.name] for t in io.inputs]
        sizes = {t.name: len(a) for t, a in zip(io.inputs, arrays, strict=True)}
        if len(set(sizes.values())) > 1:
            raise ProtocolError(400, f"inputs have different batch sizes {sizes}: give every "
                                     "input the same first dimension")
        try:
            dims = io.check_item([a[0] for a in arrays])
        except UsageError as exc:
            raise ProtocolError(400, str(exc)) from None
        length = max(dims.values()) if dims else None
        if length is not None and self.max_length is not None and length > self.max_length:
            name = next(t.name for t in io.inputs if t.dynamic)
            raise ProtocolError(400, f"input {name!r}: sequence length {length} given, the "
                                     f"model takes at most {self.max_length}")
        refusal = self.unpadded_refusal(length)
        if refusal is not None:
            raise refusal
        return [[a[k] for a in arrays] for k in range(len(arrays[0]))], length

    @functools.cached_property
    def exact_lengths(self) -> frozenset[int] | None:
        """The only lengths a model whose inputs cannot be padded takes.

        None: any up to the longest (`IOSpec.pads_exactly`).
        """
        if self.io is None or self.io.pads_exactly:
            return None
        return frozenset(self.lengths)

    def unpadded_refusal(self, length: int | None) -> ProtocolError | None:
        """A 400 for a request of a length the model can neither run nor pad to; else None."""
        exact = self.exact_lengths
        if exact is None or length is None or length in exact:
            return None
        return ProtocolError(400, self.io.unpadded_error(length, self.lengths, self.name))

    def length_of(self, arrays: Sequence[np.ndarray] | np.ndarray) -> int | None:
        """The sequence length of a request's checked arrays (one per input), or None."""
        sizes = [a.shape[1 + d] for t, a in zip(self.inputs, arrays, strict=True)
                 for d, dim in enumerate(t.shape) if dim == -1]
        return max(sizes) if sizes else None

    @property
    def fixed_outputs(self) -> bool:
        """A model of several inputs whose every output has one shape, the one served.

        No -1 dim in any output, and each output's shape is what the start-up probe found
        (`output_room`): a declared shape the network does not give is answered at the shapes
        the runtime gives, as outputs with a sequence dim are.
        """
        return (self.io is not None and bool(self.outputs)
                and len(self.outputs) == len(self.output_room)
                and all(tuple(t.shape) == tuple(room)
                        for t, room in zip(self.outputs, self.output_room, strict=True)))

    def cut(self, rows: list[np.ndarray], length: int) -> list[np.ndarray]:
        """One item's outputs cut to its own `length` along their sequence dims."""
        out = []
        for spec, row in zip(self.outputs, rows, strict=False):
            index = tuple(slice(0, length) if d == -1 else slice(None) for d in spec.shape)
            out.append(row[index] if len(index) == row.ndim else row)
        return out

    def metadata(self) -> dict[str, Any]:
        """The v2 model metadata."""
        return {"name": self.name, "versions": [self.version], "platform": "infermux",
                "inputs": [t.metadata() for t in self.inputs],
                "outputs": [t.metadata() for t in self.outputs]}

    def config(self) -> dict[str, Any]:
        """The Triton model configuration (what perf_analyzer and Model Analyzer read)."""
        buckets = sorted({b for r in self.entry.replicas for b in r.buckets()})
        return {
            "name": self.name,
            "platform": "infermux",
            "backend": "infermux",
            "version_policy": {"latest": {"num_versions": 1}},
            "max_batch_size": self.max_batch_size,
            "input": [t.config() for t in self.inputs],
            "output": [t.config() for t in self.outputs],
            "dynamic_batching": {
                "preferred_batch_size": buckets[-1:] if buckets else [self.max_batch_size],
                "max_queue_delay_microseconds": self.max_queue_delay_us,
            },
            "instance_group": self.instance_groups,
            "parameters": {"model": {"string_value": self.entry.model}},
        }

    def statistics(self) -> dict[str, Any]:
        """The Triton statistics-extension record of this model."""
        s = self.stats
        return {
            "name": self.name, "version": self.version,
            "last_inference": s.last_inference_ms,
            "inference_count": s.inference_count, "execution_count": s.execution_count,
            "inference_stats": {
                "success": s.success.dump(), "fail": s.fail.dump(), "queue": s.queue.dump(),
                "compute_input": s.compute_input.dump(), "compute_infer": s.compute_infer.dump(),
                "compute_output": s.compute_output.dump(),
                "cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0},
            },
            "batch_stats": [
                {"batch_size": b, "compute_input": {"count": v[0], "ns": v[1]},
                 "compute_infer": {"count": v[0], "ns": v[2]},
                 "compute_output": {"count": v[0], "ns": v[3]}}
                for b, v in sorted(s.batches.items())],
        }

    def check_input(self, name: Any, datatype: Any, shape: Any) -> tuple[TensorSpec, tuple[int, ...]]:
        """Validate one input's name, datatype and shape; its spec and the full shape."""
        names = ", ".join(t.name for t in self.inputs)
        spec = next((t for t in self.inputs if t.name == name), None)
        if spec is None:
            raise ProtocolError(400, f"input name {name!r} is not an input of model "
                                     f"{self.name!r}; inputs: {names}")
        # A float input takes any float datatype (the runner converts); an integer or bool
        # one (ids, masks) only its own kind.
        taken = (_FLOAT_DATATYPES if spec.datatype in _FLOAT_DATATYPES else
                 ("INT64", "INT32") if spec.datatype in ("INT64", "INT32") else (spec.datatype,))
        if not isinstance(datatype, str) or datatype not in taken:
            if datatype in DATATYPES or datatype in _KNOWN_DATATYPES:
                why = f"{datatype} is not accepted"
            else:
                why = f"{datatype!r} is not a v2 datatype"
            raise ProtocolError(400, f"input {name!r} datatype: {why}; the model takes "
                                     f"{spec.datatype} (also taken: {', '.join(taken)})")
        if (not isinstance(shape, (list, tuple)) or not shape
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
            raise ProtocolError(400, f"input {name!r} shape {shape!r} is not a list of integers; "
                                     f"expected [N, {', '.join(map(str, spec.shape))}]")
        full = tuple(int(d) for d in shape)
        if len(full) != len(spec.shape) + 1 or not all(
                g == e or (e == -1 and g >= 1) for g, e in zip(full[1:], spec.shape, strict=False)):
            raise ProtocolError(400, f"input {name!r} shape {list(full)} does not match the "
                                     f"model: expected [N, {', '.join(map(str, spec.shape))}] "
                                     f"with 1 ≤ N ≤ {self.max_batch_size}")
        if not 1 <= full[0] <= self.max_batch_size:
            raise ProtocolError(400, f"input {name!r} batch {full[0]} is outside 1 to the "
                                     f"model's max_batch_size {self.max_batch_size}")
        return spec, full


def tensor_from_bytes(name: str, datatype: str, shape: tuple[int, ...], raw: bytes | memoryview,
                      ) -> np.ndarray:
    """A tensor from raw little-endian bytes; the byte count must match the shape exactly."""
    dtype = DATATYPES[datatype]
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise ProtocolError(400, f"input {name!r}: {len(raw)} bytes of data given, shape "
                                 f"{list(shape)} of {datatype} needs {expected}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def tensor_from_list(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> np.ndarray:
    """A tensor from JSON data (flat or nested numbers); the count must match the shape."""
    if not isinstance(data, list):
        raise ProtocolError(400, f"input {name!r} data must be a list of numbers, not "
                                 f"{type(data).__name__}")
    try:
        arr = np.asarray(data, dtype=DATATYPES[datatype])
    except (ValueError, TypeError):
        raise ProtocolError(400, f"input {name!r} data is not a regular array of numbers") from None
    if arr.size != math.prod(shape):
        raise ProtocolError(400, f"input {name!r}: {arr.size} values given, shape {list(shape)} "
                                 f"needs {math.prod(shape)}")
    return arr.reshape(shape)


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[np.ndarray]] | None
    model: ModelInfo
    items: int
    admitted_ns: int
    left: int
    outputs: list[np.ndarray] | None = None
    #: Requests admitted by `submit_many`: where the answer goes, and the caller's token.
    sink: BatchSink | None = None
    token: Any = None
    #: The request's stage stamps when it is traced (serve/trace.py), else None.
    trace: dict[str, int] | None = None
    #: The request's sequence length: its outputs are cut to it (a batch ran padded).
    length: int | None = None
    #: The client requests it carries (a Triton batch behind Triton's front: several), each
    #: counted in the statistics and metrics with the request's time.
    clients: int = 1


#: A request for `InferenceCore.submit_many`: (model, input rows, output arrays to fill or
#: None, the caller's token, the client requests it carries: 1 but for a Triton batch). The
#: rows may be a list of FP32 or FP16 rows (a front's `serve.shm.SlabRow`s). A model of
#: several inputs takes a list of arrays, one per input in the model's order, already checked
#: (`ModelInfo.items`).
BatchRequest = tuple["ModelInfo", "np.ndarray | list[np.ndarray]", "list[np.ndarray] | None",
                     Any, int]
#: One answer of a `BatchSink`: (token, the outputs or the error).
BatchAnswer = tuple[Any, "list[np.ndarray] | ProtocolError"]


class BatchSink:
    """Where the answers of `InferenceCore.submit_many` go, on the caller's event loop.

    The runtime's callbacks (worker threads) add answers under the core's lock; the first one
    added since the last delivery schedules one wake-up of the loop, which hands every answer
    gathered by then to `deliver` in one call, and records their Prometheus figures in one
    update per model. So a runtime batch costs the loop one wake-up, whatever its size.
    """

    def __init__(self, core: InferenceCore, loop: asyncio.AbstractEventLoop,
                 deliver: Callable[[list[BatchAnswer]], None]) -> None:
        self.core = core
        self.loop = loop
        self._deliver = deliver
        self._answers: list[BatchAnswer] = []
        #: (model, ok, request ns, client requests) of each answer, for the metrics.
        self._timings: list[tuple[ModelInfo, bool, int, int]] = []
        #: Stage records of the traced answers gathered since the last delivery.
        self._traced: list[dict[str, int]] = []
        self._scheduled = False

    def _add(self, token: Any, result: list[np.ndarray] | ProtocolError, info: ModelInfo,
             ok: bool, took_ns: int, trace: dict[str, int] | None = None,
             clients: int = 1) -> None:
        """One answer (called with the core's lock held, on any thread).

        It stands for `clients` client requests (a Triton batch's), each counted with its time.
        """
        self._answers.append((token, result))
        self._timings.append((info, ok, took_ns, clients))
        if trace is not None:
            self._traced.append(trace)
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self.core._lock:
            answers, self._answers = self._answers, []
            timings, self._timings = self._timings, []
            traced, self._traced = self._traced, []
            self._scheduled = False
        if traced:
            now = time.perf_counter_ns()
            for record in traced:
                record["delivered"] = now
        trace = self.core.trace
        if traced and trace is not None:
            now = time.perf_counter_ns()  # `deliver` writes them out at once (before the
            for record in traced:         # front can read them: stamped first)
                record["written"] = now
                trace.add(record)
        if answers:  # the answers first: the metrics are no client's wait
            self._deliver(answers)
        metrics = self.core.metrics
        if metrics is not None and timings:
            by_model: dict[tuple[str, bool], list[int]] = {}
            touched: dict[str, ModelInfo] = {}
            for info, ok, took, clients in timings:
                by_model.setdefault((info.name, ok), []).extend((took,) * clients)
                touched[info.name] = info
            for (name, ok), durations in by_model.items():
                metrics.requests(name, ok, durations)
            for info in touched.values():
                metrics.pending(info.name, info.in_flight_requests, info.in_flight_items)


def find_model(models: Mapping[str, ModelInfo], name: str, version: str | None = None,
               ) -> ModelInfo:
    """The model called `name` (and `version`, if given), or a 400 naming what exists."""
    info = models.get(name)
    if info is None:
        raise ProtocolError(400, f"model {name!r} is not served here; models: "
                                 f"{', '.join(models)}")
    if version not in (None, "", info.version):
        raise ProtocolError(400, f"model {name!r} has no version {version!r}; versions: "
                                 f"{info.version}")
    return info


class InferenceCore:
    """Requests into the runtime's dispatcher and answers back; thread-safe where it must be.

    `infer()` and `submit_many()` run on the fronts' event loop; `_on_outputs`, `_on_complete`
    and `_on_batch` (the core's subscription to the runtime) run on worker threads and hand
    results back with `call_soon_threadsafe` (per request for `infer()`, per runtime batch
    for a `BatchSink`).
    """

    def __init__(self, runtime: Runtime, plan: Plan, *, max_queue_items: int | None = None,
                 metrics: Any = None, supervisor: Any = None) -> None:
        self.runtime = runtime
        #: Restarts failed workers (`runtime.supervisor.Supervisor`), or None.
        self.supervisor = supervisor
        self.plan = plan
        self.metrics = metrics
        self.models: dict[str, ModelInfo] = {}
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self._drained: asyncio.Event | None = None
        #: Set by the server once every front it opened accepts connections: not ready before.
        self.fronts_up = False
        self.started_ns = time.perf_counter_ns()
        #: The per-request stage trace (`serve --trace-requests`), or None: off.
        self.trace: RequestTrace | None = None
        self._subscription = runtime.subscribe(outputs=self._on_outputs,
                                               completions=self._on_complete,
                                               batches=self._on_batch,
                                               rejections=self._on_rejected)
        for entry in plan.models:
            self.models[entry.name] = self._describe(entry, max_queue_items)

    # -- models -------------------------------------------------------------------------------

    def _describe(self, entry: ModelEntry, max_queue_items: int | None) -> ModelInfo:
        states = [s for s in self.runtime.workers() if s.model == entry.name]
        max_batch = max([s.batch for s in states] or [1])
        capacity = sum(s.batch * s.depth for s in states if s.alive)
        groups: dict[str, int] = {}
        for s in states:
            groups[s.unit] = groups.get(s.unit, 0) + 1
        instance_groups = []
        for unit, count in sorted(groups.items()):
            gpus = sorted({int(g) for g in re.findall(r"cuda:(\d+)", unit)})
            group: dict[str, Any] = {"name": f"{entry.name} on {unit}", "count": count,
                                     "kind": "KIND_GPU" if gpus else "KIND_CPU"}
            if gpus:
                group["gpus"] = gpus
            instance_groups.append(group)
        io = None
        lengths: list[int | None] = [None]
        describe = getattr(self.runtime, "io_spec", None)  # a local runtime's; not a cluster's
        names: tuple[str, ...] = ()
        if describe is not None:
            io, lengths = describe(entry.name)
            names = tuple(t.name for t in io.outputs)  # an ONNX file's, a module's `outputs`
            io = None if io.simple else io
        if io is not None:
            inputs = [TensorSpec(t.name, _V2[t.dtype],
                                 tuple(-1 if isinstance(d, str) else d for d in t.shape))
                      for t in io.inputs]
            outputs = [TensorSpec(t.name, output_datatype(t.dtype),
                                  tuple(-1 if isinstance(d, str) else d for d in t.shape))
                       for t in io.outputs]
        else:
            inputs = [TensorSpec("input", _input_datatype(entry),
                                 self.runtime.input_shape(entry.name))]
            outputs = []  # filled by `probe_outputs`
        return ModelInfo(
            name=entry.name, entry=entry, inputs=inputs, outputs=outputs,
            io=io, max_length=lengths[-1], output_names=names,
            lengths=tuple(sorted(n for n in lengths if n is not None)),
            max_batch_size=max_batch,
            max_queue_delay_us=int(self.plan.dispatcher.max_queue_delay_ms * 1000),
            # Enough to keep every worker busy with a batch queued behind it, and no more:
            # memory stays bounded whatever the clients send.
            max_queue_items=max_queue_items or max(64, 4 * capacity),
            instance_groups=instance_groups,
        )

    async def probe_outputs(self) -> None:
        """Learn each model's outputs (names, shapes) by serving one zero item through it."""
        for info in self.models.values():
            if info.io is not None:  # several inputs: the outputs are the model's spec's
                # One generated item at the longest length tells the outputs' sizes (the
                # spec's -1 is a sequence dim or any size), and their names if not given.
                dims = info.io.dims_for(info.max_length) if info.io.dynamic_dims else {}
                item = info.io.generate(1, dims)
                outs = await self._submit(info, {t.name: a for t, a in
                                                 zip(info.io.inputs, item, strict=True)},
                                          count=False)
                info.output_room = tuple(tuple(o.shape[1:]) for o in outs)
                if not info.outputs:
                    names = (["output"] if len(outs) == 1
                             else [f"output_{i}" for i in range(len(outs))])
                    info.outputs = [TensorSpec(n, output_datatype(o.dtype), tuple(o.shape[1:]))
                                    for n, o in zip(names, outs, strict=True)]
                continue
            spec = info.inputs[0]
            outs = await self._submit(info, np.zeros((1, *spec.shape), dtype=np.float32),
                                      count=False)
            names = (list(info.output_names) if len(info.output_names) == len(outs) else
                     ["output"] if len(outs) == 1 else [f"output_{i}" for i in range(len(outs))])
            info.outputs = [TensorSpec(n, output_datatype(o.dtype), tuple(o.shape[1:]))
                            for n, o in zip(names, outs, strict=True)]

    def model(self, name: str, version: str | None = None) -> ModelInfo:
        """The model called `name` (and `version`, if given), or a 400 naming what exists."""
        return find_model(self.models, name, version)

    def live(self) -> bool:
        """The process is up (the fronts answer)."""
        return True

    def model_ready(self, name: str) -> bool:
        """At least one live worker serves the model, and the server is not shutting down."""
        if self._closing:
            return False
        return self.runtime.ready(name)

    def not_ready_reason(self, name: str) -> str:
        """Why model `name` is not ready, in words ("" when it is)."""
        if self._closing:
            return "the server is shutting down"
        if self.model_ready(name):
            return ""
        return f"model {name!r} has no live worker ({self._last_error(name)})"

    def ready(self) -> bool:
        """Every front accepts connections and every model is ready."""
        return self.fronts_up and all(self.model_ready(m) for m in self.models)

    def server_metadata(self) -> dict[str, Any]:
        """The v2 server metadata, with the extensions perf_analyzer looks for."""
        from infermux import __version__

        regions = getattr(self, "shared_memory", None)  # serve/shm.py, set by the server
        extensions = EXTENSIONS + (regions.extensions() if regions is not None else [])
        return {"name": SERVER_NAME, "version": __version__, "extensions": extensions}

    # -- requests -----------------------------------------------------------------------------

    async def infer(self, info: ModelInfo, inputs: np.ndarray | Mapping[str, np.ndarray],
                    ) -> list[np.ndarray]:
        """Serve one request of `(n, *input_shape)` items; outputs, a row per item, in order.

        A model of several inputs takes every input by name (`ModelInfo.items` checks them);
        outputs with a sequence dim come back at the request's own length.

        Raises ProtocolError 503 (with Retry-After) when the model's admission limit is
        reached, the server is shutting down, or no worker is left to serve the model.
        """
        return await self._submit(info, inputs, count=True)

    async def _submit(self, info: ModelInfo, inputs: Any, *, count: bool,
                      ) -> list[np.ndarray]:
        length = None
        if info.io is not None:  # several inputs: per item, one array of each
            inputs, length = info.items(inputs)
        elif inputs.dtype not in (np.float32, np.float16):
            inputs = inputs.astype(np.float32)  # FP16 rows go as they are: the runner converts
        n = len(inputs)
        loop = asyncio.get_running_loop()
        now = time.perf_counter_ns()
        with self._lock:
            refusal = self._refusal(info, n, self.model_ready(info.name))
            if refusal is not None:
                # A full model's refusal is counted even for the probe: it never is one.
                self._refused(info, count or isinstance(refusal, _FullError))
                raise refusal
            qid = next(self._ids)
            pending = _Pending(loop, loop.create_future(), info, n, now, n, length=length)
            if self.trace is not None and count and self.trace.wants(qid):
                pending.trace = {"front": 0, "id": qid, "admitted": now}
            self._pending[qid] = pending
            info.in_flight_items += n
            info.in_flight_requests += 1
            if self.metrics is not None:
                self.metrics.pending(info.name, info.in_flight_requests, info.in_flight_items)
        future = pending.future
        assert future is not None
        future.add_done_callback(lambda f: f.exception())  # never "never retrieved"
        self.runtime.submit([Query(qid, info.name, tuple(range(n)), inputs)])
        outputs = await future
        if pending.trace is not None and self.trace is not None:
            pending.trace["written"] = time.perf_counter_ns()  # the handler resumed
            self.trace.add(pending.trace)
        if count:
            self._request_done(info, ok=True, started_ns=now)
        return outputs

    def _refusal(self, info: ModelInfo, n: int, ready: bool) -> ProtocolError | None:
        """Why a request of `n` items of `info` is refused now (503), or None: admit it.

        Called with `_lock` held. `ready`: the model has a live worker (`model_ready`).
        """
        if self._closing:
            return _closing()
        if info.in_flight_items + n > info.max_queue_items:
            return _FullError(503, f"model {info.name!r} has {info.in_flight_items} items in "
                              f"flight, its admission limit is {info.max_queue_items}: retry "
                              "later", retry_after_s=1.0)
        if not ready:
            restarting = any(s.restarting for s in self.runtime.workers()
                             if s.model == info.name)
            return ProtocolError(503, f"model {info.name!r} is not ready: no live worker "
                                      f"serves it ({self._last_error(info.name)})",
                                 retry_after_s=1.0 if restarting else None)
        return None

    def refuse_early(self, name: str) -> ProtocolError | None:
        """A refusal decided before a request of model `name` is decoded, or None: go on.

        Past saturation a front spends most of its time refusing; a gRPC refusal that first
        decoded and checked the request's tensors cost the front about a fifth more CPU than
        one that does not (bench/serve_refusals.py, docs/architecture-serve.md). When the model
        already holds its whole admission limit (no request of one item or more fits) or the
        server is shutting down, the 503 is known from the model's name alone: it is
        counted here and returned. Otherwise (or for a name not served, which the full path
        reports) None: the request is decoded and admitted or refused as usual, under the lock.
        The unlocked read may refuse a request an answer was about to make room for, as if it
        had arrived a moment earlier.
        """
        info = self.models.get(name)
        if info is None:
            return None
        if self._closing:
            refusal = _closing()
        elif info.in_flight_items < info.max_queue_items:
            return None
        else:
            refusal = _FullError(503, f"model {info.name!r} holds its admission limit of "
                                      f"{info.max_queue_items} items in flight: retry later",
                                 retry_after_s=1.0)
        with self._lock:
            self._refused(info, True)
        return refusal

    def batch_sink(self, deliver: Callable[[list[BatchAnswer]], None]) -> BatchSink:
        """A sink for `submit_many` whose answers `deliver` gets on this event loop."""
        return BatchSink(self, asyncio.get_running_loop(), deliver)

    def submit_many(self, requests: Sequence[BatchRequest], sink: BatchSink,
                    traces: dict[Any, dict[str, int]] | None = None,
                    ) -> list[tuple[Any, ProtocolError]]:
        """Admit several requests at once and submit them to the runtime together.

        For a caller that has many requests in hand (a front process's frame of descriptors):
        one lock acquisition admits or refuses them all, in order, against each model's
        admission limit; the admitted ones go to the runtime in one `submit`; refusals are
        counted and returned at once as (token, 503 error). Each admitted request's answer
        reaches `sink` (see `BatchSink`): its outputs, written into the arrays given with it
        (or new ones), or its error. The statistics are those of `infer()`: a request is a
        success, a failure or a refusal, with the time from admission to its answer.
        `traces`: the stage records of the traced requests, by token (serve/trace.py).
        """
        return self.submit_frames([(requests, sink, traces)])[0]

    def submit_frames(self, frames: Sequence[tuple[Sequence[BatchRequest], BatchSink,
                                                   dict[Any, dict[str, int]] | None]],
                      ) -> list[list[tuple[Any, ProtocolError]]]:
        """`submit_many` for several callers' frames at once, each with its own sink.

        One lock and one `submit` to the runtime (so one wake-up of its workers) for all of
        them, in order. Returns each frame's refusals.
        """
        now = time.perf_counter_ns()
        refusals: list[list[tuple[Any, ProtocolError]]] = []
        queries: list[Query] = []
        rejected: dict[str, int] = {}
        touched: dict[str, ModelInfo] = {}
        with self._lock:
            ready: dict[str, bool] = {}
            for requests, sink, traces in frames:
                refused: list[tuple[Any, ProtocolError]] = []
                refusals.append(refused)
                for info, inputs, out, token, clients in requests:
                    n = len(inputs[0]) if info.io is not None else len(inputs)
                    if info.exact_lengths is not None:  # checked here for Triton's instances
                        bad = info.unpadded_refusal(info.length_of(inputs))
                        if bad is not None:
                            refused.append((token, bad))
                            continue
                    is_ready = ready.get(info.name)
                    if is_ready is None:
                        is_ready = ready[info.name] = self.model_ready(info.name)
                    refusal = self._refusal(info, n, is_ready)
                    if refusal is not None:
                        info.stats.rejected += clients
                        rejected[info.name] = rejected.get(info.name, 0) + clients
                        refused.append((token, refusal))
                        continue
                    qid = next(self._ids)
                    length = None
                    rows: Any = inputs
                    if info.io is not None:  # several inputs: per item, one array of each
                        length = info.length_of(inputs)
                        rows = [[a[k] for a in inputs] for k in range(n)]
                    elif not isinstance(inputs, list) and inputs.dtype not in (np.float32,
                                                                               np.float16):
                        rows = inputs.astype(np.float32)
                    pending = self._pending[qid] = _Pending(sink.loop, None, info, n, now, n,
                                                            out, sink, token, length=length,
                                                            clients=clients)
                    if traces and token in traces:
                        pending.trace = traces[token]
                        pending.trace["admitted"] = now
                    info.in_flight_items += n
                    info.in_flight_requests += clients
                    touched[info.name] = info
                    queries.append(Query(qid, info.name, tuple(range(n)), rows))
        if self.metrics is not None:
            for name, count in rejected.items():
                self.metrics.rejected(name, count)
            for info in touched.values():
                self.metrics.pending(info.name, info.in_flight_requests, info.in_flight_items)
        if queries:
            try:
                self.runtime.submit(queries)
            except Exception as exc:  # noqa: BLE001 - each request is answered, as infer() would
                with self._lock:
                    for q in queries:
                        self._finish(q.id, None, f"the runtime did not take the request: {exc}",
                                     status=500)
        return refusals

    def count_refused(self, info: ModelInfo, count: int) -> None:
        """Requests of `info` a front process refused itself with 503 (its slab was full)."""
        with self._lock:
            info.stats.rejected += count
        if self.metrics is not None:
            self.metrics.rejected(info.name, count)

    def _refused(self, info: ModelInfo, count: bool) -> None:
        """One request refused with 503 before admission (full, not ready, shutting down).

        Every refusal is counted, so answered + failed + refused is every request received.
        """
        if not count:
            return
        info.stats.rejected += 1
        if self.metrics is not None:
            self.metrics.rejected(info.name)

    def _request_done(self, info: ModelInfo, *, ok: bool, started_ns: int) -> None:
        took = time.perf_counter_ns() - started_ns
        with self._lock:
            (info.stats.success if ok else info.stats.fail).add(took)
            info.stats.last_inference_ms = int(time.time() * 1000)
        if self.metrics is not None:
            self.metrics.request(info.name, ok, took)

    def _last_error(self, model: str) -> str:
        failed = [s for s in self.runtime.workers() if s.model == model and s.error]
        if not failed:
            return "none was built"
        if self.supervisor is not None:
            return "; ".join(self.supervisor.describe(s) for s in failed)
        return f"last error: {failed[-1].error}"

    def _finish(self, qid: int, outputs: list[np.ndarray] | None, error: str | None,
                status: int = 503, retry_after_s: float | None = None) -> None:
        """Hand a request's answer to its event loop (called with `_lock` held)."""
        pending = self._pending.pop(qid, None)
        if pending is None:
            return
        info = pending.model
        info.in_flight_items -= pending.items
        info.in_flight_requests -= pending.clients
        if pending.sink is not None:
            # Accounted here, under the lock already held; the sink's one wake-up of the loop
            # delivers it and updates the metrics for all the answers gathered by then.
            ok = error is None and outputs is not None
            took = time.perf_counter_ns() - pending.admitted_ns
            (info.stats.success if ok else info.stats.fail).add(took * pending.clients,
                                                                 pending.clients)
            info.stats.last_inference_ms = int(time.time() * 1000)
            result: list[np.ndarray] | ProtocolError = (
                outputs if ok and outputs is not None
                else ProtocolError(status, error or "inference failed", retry_after_s))
            if pending.trace is not None:
                pending.trace["answer_queued"] = pending.admitted_ns + took
            pending.sink._add(pending.token, result, info, ok, took, pending.trace,
                              pending.clients)
        else:
            self._answer(pending, outputs, error, status, retry_after_s)
        if self._closing and not self._pending and self._drained is not None:
            pending.loop.call_soon_threadsafe(self._drained.set)

    def _answer(self, pending: _Pending, outputs: list[np.ndarray] | None, error: str | None,
                status: int, retry_after_s: float | None = None) -> None:
        """Hand an `infer()` request's answer to its awaiting coroutine (`_lock` held)."""
        info = pending.model
        assert pending.future is not None  # an `infer()` request
        if pending.trace is not None:
            pending.trace["answer_queued"] = time.perf_counter_ns()
        if self.metrics is not None:
            self.metrics.pending(info.name, info.in_flight_requests, info.in_flight_items)
        if error is None and outputs is not None:
            pending.loop.call_soon_threadsafe(_set_result, pending.future, outputs)
        else:
            exc = ProtocolError(status, error or "inference failed", retry_after_s)
            pending.loop.call_soon_threadsafe(_set_exception, pending.future, exc)
            pending.loop.call_soon_threadsafe(functools.partial(
                self._request_done, pending.model, ok=False, started_ns=pending.admitted_ns))

    # -- the runtime's callbacks (worker threads) ----------------------------------------------

    def _on_outputs(self, batch: Batch, outputs: list[np.ndarray]) -> None:
        cut: bool | None = None  # whether this batch's model has outputs to cut to a length
        with self._lock:
            for i, item in enumerate(batch.items):
                pending = self._pending.get(item.query)
                if pending is None:
                    continue
                rows = [y[i] for y in outputs]
                if pending.length is not None:
                    if cut is None:
                        cut = not pending.model.fixed_outputs
                    if cut:
                        rows = pending.model.cut(rows, pending.length)
                if pending.outputs is None:
                    pending.outputs = [np.empty((pending.items, *r.shape), dtype=r.dtype)
                                       for r in rows]
                for dst, row in zip(pending.outputs, rows, strict=True):
                    dst[item.sample] = row
                pending.left -= 1
                if pending.trace is not None:
                    _stamp(pending.trace, item.enqueued_ns, batch)
                if pending.left == 0:
                    self._finish(item.query, pending.outputs, None)

    def _on_rejected(self, queries: Sequence[int], message: str) -> None:
        """The engine rejected these requests' own inputs (the worker serves on): 400 each."""
        with self._lock:
            for qid in queries:
                pending = self._pending.get(qid)
                if pending is not None:
                    self._finish(qid, None, f"model {pending.model.name!r} rejected the "
                                            f"request's input: {message}", status=400)

    def _on_complete(self, done: Sequence[tuple[int, int]], ok: bool, when_ns: int) -> None:
        if ok:
            return  # the outputs came through `_on_outputs`
        with self._lock:
            for qid, _ in done:
                pending = self._pending.get(qid)
                if pending is None:
                    continue
                self._finish(qid, None, f"inference of model {pending.model.name!r} failed: "
                                        f"{self._last_error(pending.model.name)}")

    def _on_batch(self, w: WorkerState, batch: Batch, start_ns: int, end_ns: int,
                  timing: Any) -> None:
        info = self.models.get(batch.model)
        if info is None:
            return
        n = len(batch.items)
        queue_ns = sum(batch.taken_ns - it.enqueued_ns for it in batch.items)
        compute_ns = end_ns - start_ns
        infer_ns = getattr(timing, "compute_ns", 0) or compute_ns
        input_ns = getattr(timing, "h2d_ns", 0) or 0
        output_ns = getattr(timing, "d2h_ns", 0) or 0
        with self._lock:
            s = info.stats
            s.inference_count += n
            s.execution_count += 1
            s.queue.add(queue_ns, n)
            s.compute_input.add(input_ns * n, n)
            s.compute_infer.add(infer_ns * n, n)
            s.compute_output.add(output_ns * n, n)
            row = s.batches.setdefault(n, [0, 0, 0, 0])
            row[0] += 1
            row[1] += input_ns
            row[2] += infer_ns
            row[3] += output_ns
        if self.metrics is not None:
            self.metrics.batch(w, batch.model, n, queue_ns, compute_ns, infer_ns, input_ns,
                               output_ns)

    # -- shutdown -------------------------------------------------------------------------------

    def begin_close(self) -> None:
        """Take no new requests (503); those admitted are still answered."""
        with self._lock:
            self._closing = True

    async def drain(self, timeout_s: float) -> int:
        """Wait until every admitted request is answered (at most `timeout_s`); those left."""
        with self._lock:
            if not self._pending:
                return 0
            self._drained = asyncio.Event()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._drained.wait(), timeout_s)
        with self._lock:
            return len(self._pending)

    def expire_waiting(self, limit_s: float) -> int:
        """Answer 503 the requests admitted over `limit_s` ago whose model has no live worker.

        A worker that died is restarted while its model's admitted requests stay queued for it;
        a restart can take longer than a client waits (a slow rebuild, a backoff, a loaded
        host: more than 30 s on two busy cores). Past the limit each such request is answered
        503 with the reason and a Retry-After, rather than left waiting; its items may still
        run once the worker is back, and their outputs are dropped. Requests of a model that
        has a live worker are never expired here, whatever their age. The number answered.
        """
        cutoff = time.perf_counter_ns() - int(limit_s * 1e9)
        with self._lock:
            stale = [(qid, p.model.name) for qid, p in self._pending.items()
                     if p.admitted_ns < cutoff and not self.runtime.ready(p.model.name)]
            for qid, name in stale:
                self._finish(qid, None, f"model {name!r} has no live worker "
                                        f"({self._last_error(name)}) and the request waited "
                                        f"{limit_s:g}s for it: retry later",
                             status=503, retry_after_s=1.0)
        return len(stale)

    def fail_pending(self, reason: str) -> int:
        """Answer every request still pending with an error (the runtime stopped); how many."""
        with self._lock:
            pending = list(self._pending)
            for qid in pending:
                self._finish(qid, None, reason)
        return len(pending)

    def summary(self) -> dict[str, ServedModelSummary]:
        """Per-model totals for the stored run and `--json`."""
        out: dict[str, ServedModelSummary] = {}
        for name, info in self.models.items():
            s = info.stats
            out[name] = ServedModelSummary(
                requests_ok=s.success.count, requests_failed=s.fail.count,
                requests_rejected=s.rejected, items=s.inference_count,
                batches=s.execution_count,
                mean_request_ms=s.success.ns / s.success.count / 1e6 if s.success.count else None,
                mean_batch=s.inference_count / s.execution_count if s.execution_count else None,
            )
        return out


def _input_datatype(entry: ModelEntry) -> str:
    """FP16 when every replica computes in fp16 (clients then send half the bytes), else FP32.

    Either is accepted whatever is declared; the declared one is what perf_analyzer and
    Triton's clients send.
    """
    modes = {r.unit.rpartition("/")[2] if "/" in r.unit else "" for r in entry.replicas}
    return "FP16" if modes == {"fp16"} else "FP32"


def _stamp(trace: dict[str, Any], enqueued_ns: int, batch: Batch) -> None:
    """A traced request's runtime stages: its first item's queueing, its last item's batch."""
    trace.setdefault("enqueued", enqueued_ns)
    trace["taken"] = batch.taken_ns
    trace.update(batch.stamps)
    # Its batch's bucket, items, device time, gather path and the device's idle time before
    # it: not stages, kept for the batches' summary (serve/trace.py).
    trace.update(bucket=batch.bucket, items=len(batch.items), device_ns=batch.device_ns,
                 gather_path=batch.gather_path, idle_before_ns=batch.idle_before_ns)
    trace["outputs_written"] = time.perf_counter_ns()


class _FullError(ProtocolError):
    """A refusal because the model's admission limit is reached."""


def _closing() -> ProtocolError:
    """The refusal of every request once shutdown began."""
    return ProtocolError(503, "the server is shutting down and takes no new requests",
                         retry_after_s=1.0)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
