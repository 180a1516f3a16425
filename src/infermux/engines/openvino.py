"""The OpenVINO engine: `openvino:CPU|GPU|NPU` units, and the plain `cpu` units on the CPU device.

Knobs the tuner can set: the performance hint (latency, throughput, cumulative_throughput),
streams, infer requests in flight, threads, and the inference precision (f32, bf16, f16, u8).

How a runner keeps a throughput-hinted model busy: N requests in flight (N = the compiled
model's optimal number, or `requests`), as OpenVINO's benchmark_app does. `run()` splits its batch
into up to N sub-batches (the model is compiled at the sub-batch size), starts one request per
sub-batch and returns when all are done: synchronous, so it serves a runtime worker that gives
each call a new batch (in a child process or a thread) as well as a benchmark loop, and its
timing is the batch's own. A batch of 1 cannot be split: repeated runs of one input keep N whole
batches in flight instead. With the latency hint N is 1 and `run()` is a plain synchronous call.
docs/architecture-engines.md gives the reasons and the measurements.

int8 (`cpu/int8` and `cpu:0-1/int8` units, or `precision=u8` on an `openvino:*` unit): the same
Q/DQ model ONNX Runtime runs, made once from calibration data by `infermux.quantize`; OpenVINO's
CPU plugin folds the QuantizeLinear/DequantizeLinear pairs into u8 kernels. A file that already
holds Q/DQ nodes is used as is.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from infermux.engines.base import (
    BatchTiming,
    Engine,
    Runner,
    host_array,
    host_output,
    parse_options,
    register_engine,
)
from infermux.errors import RunError, UsageError, first_line
from infermux.export import cache_dir
from infermux.iospec import TensorSpec
from infermux.models import LoadedModel
from infermux.units import Unit

__all__ = ["OvEngine", "OvOptions", "OvRunner", "compile_config", "split_parts"]

Hint = Literal["latency", "throughput", "cumulative_throughput"]
Precision = Literal["f32", "bf16", "f16", "u8"]
#: OpenVINO element type names → the precision names results use everywhere else.
_PRECISION_NAMES = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "u8": "int8", "i8": "int8"}


class OvOptions(BaseModel):
    """Options of the OpenVINO engine; `None` means "the runtime or the unit decides"."""

    model_config = ConfigDict(extra="forbid")

    hint: Hint = "throughput"
    streams: int | None = Field(None, ge=1)
    requests: int | None = Field(None, ge=1)
    precision: Precision | None = None
    threads: int | None = Field(None, ge=1)
    pin_threads: bool | None = None
    #: Compiled-model cache (OpenVINO's CACHE_DIR); "" turns it off.
    cache_dir: str | None = None
    opset: int | None = None
    warmup_iters: int = Field(3, ge=0)
    #: Split each batch over the requests (compiled at the sub-batch size); false runs whole
    #: batches, one request per new input.
    split_batch: bool = True
    #: int8 only: calibration data for the Q/DQ model (an image folder, an (N, *input) .npy
    #: file, or "random", the default: right for timing, meaningless for accuracy).
    calibration_data: str | None = None
    calibration_items: int = Field(256, ge=1)
    quantize_method: Literal["minmax", "entropy", "percentile"] = "minmax"
    quantize_tool: Literal["onnxruntime", "modelopt"] = "onnxruntime"

    def resolve(self, unit: Unit) -> tuple[str, OvOptions]:
        """(OpenVINO device, options with the unit's defaults), rejecting what cannot be."""
        update: dict[str, Any] = {}
        if unit.kind == "cpu":
            # A `cpu` unit's precision is in its name (fp32, or int8 for cpu/int8): results
            # from it must be results in that precision.
            wanted = "u8" if unit.mode == "int8" else "f32"
            if self.precision not in (None, wanted):
                raise UsageError(
                    f"option precision={self.precision} on unit {unit.id!r}, which is "
                    f"{unit.mode}: use cpu/int8 for u8, the unit openvino:CPU for bf16/f16, or "
                    "drop the option"
                )
            update["precision"] = wanted
            update["threads"] = self.threads or len(unit.cores) or None
            device = "CPU"
        elif unit.kind == "openvino":
            device = unit.device.partition(":")[2]
        else:
            raise UsageError(f"the openvino engine cannot run on unit {unit.id!r}")
        if self.cache_dir is None:
            update["cache_dir"] = str(cache_dir() / "openvino")
        return device, self.model_copy(update=update)


def compile_config(device: str, opts: OvOptions) -> dict[str, str]:
    """The properties `compile_model` gets, as OpenVINO's string keys (stable across releases)."""
    config = {"PERFORMANCE_HINT": opts.hint.upper()}
    if opts.streams is not None:
        config["NUM_STREAMS"] = str(opts.streams)
    if opts.requests is not None:
        config["PERFORMANCE_HINT_NUM_REQUESTS"] = str(opts.requests)
    if opts.precision in ("f32", "bf16", "f16"):
        config["INFERENCE_PRECISION_HINT"] = opts.precision
    elif opts.precision == "u8" and device.startswith("CPU"):
        # int8 where the model is quantized, fp32 elsewhere (as ONNX Runtime runs the same
        # file), rather than the bf16 the CPU plugin picks for float layers where it can.
        config["INFERENCE_PRECISION_HINT"] = "f32"
    if device.startswith("CPU"):
        if opts.threads is not None:
            config["INFERENCE_NUM_THREADS"] = str(opts.threads)
        if opts.pin_threads is not None:
            config["ENABLE_CPU_PINNING"] = "YES" if opts.pin_threads else "NO"
    if opts.cache_dir:
        config["CACHE_DIR"] = opts.cache_dir
    return config


class _Tracker:
    """Requests in flight, and the most at once.

    A pool's are counted from submission to their completion callback; a split batch's are seen
    at each submission (`seen`).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0

    def started(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def finished(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def seen(self, in_flight: int) -> None:
        """`in_flight` requests were running at once (counted by the caller)."""
        with self.lock:
            self.peak = max(self.peak, in_flight)


def split_parts(batch: int, requests: int) -> int:
    """How many sub-batches of equal size (the last one padded) a batch is split into.

    As many as there are requests to keep in flight, but no more than the sub-batch size needs:
    batch 4 over 3 requests is 2 sub-batches of 2 (not 2 + 1 + 1, which would need a second
    compiled model), batch 5 over 2 is 3 + 2 padded to 3 + 3, batch 1 is not split.
    """
    parts = max(1, min(requests, batch))
    sub = -(-batch // parts)
    return -(-batch // sub)


class OvRunner(Runner):
    """A compiled model and its infer requests: each batch split over N requests in flight.

    N is the compiled model's optimal number of requests (or the `requests` option). A batch of
    `batch` items is split into `parts` sub-batches (`split_parts`), each computed by its own
    request on its own stream, all started before any is waited for; the model is compiled at
    the sub-batch size. Every request reads its rows of the one input buffer and writes its rows
    of the output buffers (shared memory, no per-batch copy). `run()` is synchronous and
    accounts for exactly one batch, whoever calls it with whatever input.

    A batch that cannot be split (batch 1, or `split_batch=false`) runs whole: a new input runs
    once, on one request, and repeated `run()` calls on the same input keep N whole batches in
    flight (`_run_pool`, what benchmark_app does).
    """

    engine = "openvino"

    def __init__(self, compiled: Any, unit: Unit, batch: int, input_shape: tuple[int, ...],
                 opts: OvOptions, started: float, *, requests: int, parts: int,
                 input_specs: tuple[TensorSpec, ...] = (), length: int | None = None) -> None:
        import openvino as ov

        self.unit = unit
        self.batch = batch
        self.input_shape = input_shape
        self.input_specs = input_specs
        self.length = length
        self._compiled = compiled
        self._n = requests
        self._parts = parts
        self._sub = -(-batch // parts)
        rows = self._sub * parts
        rng = np.random.default_rng(0)
        # One buffer per input; a model of several gets runnable values (ids within the
        # vocabulary, masks of ones), padding rows included.
        self._xs: list[np.ndarray] = []
        for i, port in enumerate(compiled.inputs if input_specs else compiled.inputs[:1]):
            dtype = port.get_element_type().to_dtype()
            if input_specs:
                x = input_specs[i].generate(rows, {}, rng).astype(dtype)
            else:
                x = rng.standard_normal((rows, *input_shape)).astype(dtype)
                x[batch:] = 0  # padding rows of the last sub-batch
            self._xs.append(x)
        self._x = self._xs[0]
        self._tracker = _Tracker()
        self._requests: list[Any] = []
        self._y: list[np.ndarray] = []
        self._queue: Any = None
        #: A new input was set and has not run: it runs once, not once per request.
        self._fresh = False
        self._in_flight = 0
        self._last_request = 0
        if parts > 1:
            self._build_split(ov, rows)
        else:
            self._build_pool(ov)
        self.options = {
            **opts.model_dump(),
            "requests": self._n,
            "sub_batches": parts,
            "sub_batch": self._sub,
            "streams": _int_property(compiled, "NUM_STREAMS"),
            # A Q/DQ model computes in int8 where it is quantized, whatever the float hint.
            "precision": "int8" if opts.precision == "u8" else _precision_of(compiled),
            "device": unit.device,
        }
        for _ in range(max(1, opts.warmup_iters)):
            self.run()
        self.build_s = time.perf_counter() - started

    def _build_split(self, ov: Any, rows: int) -> None:
        sub = self._sub
        for out in self._compiled.outputs:
            shape = tuple(out.get_shape())  # static: (sub, ...)
            self._y.append(np.empty((rows, *shape[1:]), dtype=out.get_element_type().to_dtype()))
        for i in range(self._parts):
            request = self._compiled.create_infer_request()
            rows_i = slice(i * sub, (i + 1) * sub)  # C-contiguous rows: views, not copies
            for k, x in enumerate(self._xs):
                request.set_input_tensor(k, ov.Tensor(x[rows_i], shared_memory=True))
            for j, y in enumerate(self._y):
                request.set_output_tensor(j, ov.Tensor(y[rows_i], shared_memory=True))
            self._requests.append(request)

    def _build_pool(self, ov: Any) -> None:
        # Every request reads the same host buffer (requests only read inputs): no per-batch copy.
        x_tensors = [ov.Tensor(x, shared_memory=True) for x in self._xs]
        self._queue = ov.AsyncInferQueue(self._compiled, self._n)
        for i in range(self._n):
            for k, x_tensor in enumerate(x_tensors):
                self._queue[i].set_input_tensor(k, x_tensor)
        # The callback closes over these, not over the runner, so a runner nobody holds is
        # collected; the finalizer then (or at exit) waits for its requests before they go.
        self._done: collections.deque[tuple[int, int, int]] = collections.deque()
        self._cond = threading.Condition()
        self._queue.set_callback(_on_done(self._done, self._cond, self._tracker))
        self._finalizer = weakref.finalize(self, _settle, self._queue, self._tracker, self._cond)

    @property
    def peak_in_flight(self) -> int:
        """Most requests this runner has had in flight at once (see `reset_peak_in_flight`)."""
        return self._tracker.peak

    def reset_peak_in_flight(self) -> None:
        """Start counting `peak_in_flight` afresh."""
        with self._tracker.lock:
            self._tracker.peak = self._tracker.in_flight

    def run(self) -> BatchTiming:
        """One batch: its sub-batches all in flight at once, or one whole batch (see the class).

        The latency runs from the first submission to the last completion.
        """
        if self._parts == 1:
            return self._run_pool()
        tracker = self._tracker
        start = time.perf_counter_ns()
        for i, request in enumerate(self._requests):
            # In flight at this submission: it and every earlier one OpenVINO has not finished.
            # Asked of the requests, not counted by completion callbacks: a Python callback on
            # OpenVINO's thread may still wait for the interpreter lock when the compiled model
            # is released, and the release joins that thread holding the lock (a deadlock).
            tracker.seen(1 + sum(not r.wait_for(0) for r in self._requests[:i]))
            request.start_async()
        for request in self._requests:
            request.wait()
        latency = time.perf_counter_ns() - start
        return BatchTiming(latency_ns=latency, compute_ns=latency)

    def _run_pool(self) -> BatchTiming:
        """Keep N batches in flight; return the timing of the next one that finishes.

        After `set_input`/`gather_input` (a new batch) the batch runs exactly once and its own
        timing is returned. The submission comes first and waits inside OpenVINO for a free
        request, as benchmark_app's loop does, so a finished request is refilled without a
        Python hop; its callback has recorded the finish by then, and that record is returned.
        """
        if self._fresh:
            # Every request reads the one buffer, so filling the pool would compute this batch
            # N times. Run it once.
            self._fresh = False
            self._submit()
            return self._next_done()
        while self._in_flight < self._n:  # after a drain: fill the pool
            self._submit()
            self._in_flight += 1
        self._submit()  # blocks until one of the N finishes, then reuses it
        return self._next_done()

    def _next_done(self) -> BatchTiming:
        with self._cond:
            while not self._done:
                self._cond.wait()
            submitted, finished, slot = self._done.popleft()
        self._last_request = slot
        latency = finished - submitted
        return BatchTiming(latency_ns=latency, compute_ns=latency)

    def _submit(self) -> None:
        slot = self._queue.get_idle_request_id()  # blocks for a free one; start_async takes it
        self._tracker.started()
        self._queue.start_async(userdata=(time.perf_counter_ns(), slot))

    def _drain(self) -> None:
        if self._queue is None:
            return  # split batches are finished when run() returns
        _settle(self._queue, self._tracker, self._cond, release=False)
        with self._cond:
            self._done.clear()
        self._in_flight = 0

    def set_input(self, batch: np.ndarray) -> None:
        """Copy `batch` into the shared input buffer, once no request is reading it."""
        expected = (self.batch, *self.input_shape)
        if tuple(batch.shape) != expected:
            raise UsageError(f"batch of shape {tuple(batch.shape)} given, runner takes {expected}")
        self._drain()
        self._x[: self.batch] = batch
        self._fresh = True

    def set_inputs(self, arrays: Sequence[np.ndarray]) -> None:
        """Copy one batch of every input (in the model's order), once no request reads them."""
        if not self.input_specs:
            super().set_inputs(arrays)
            return
        self.check_inputs(arrays)
        self._drain()
        for x, array in zip(self._xs, arrays, strict=True):
            x[: self.batch] = array
        self._fresh = True

    def gather_input(self, pool: Any, indices: Sequence[int]) -> None:
        """Gather rows of `pool` straight into the input buffer (one copy; the rest is padding)."""
        rows = np.asarray(pool)
        n = len(indices)
        if rows.dtype != self._x.dtype or n > self.batch or rows.shape[1:] != self._x.shape[1:]:
            super().gather_input(pool, indices)
            return
        self._drain()
        # mode="clip" writes into `out` directly; the default ("raise") buffers the whole batch.
        np.take(rows, np.asarray(indices, dtype=np.intp), axis=0, out=self._x[:n], mode="clip")
        if n < self.batch:
            self._x[n: self.batch] = 0
        self._fresh = True

    def compute(self, x: Any) -> list[Any]:
        """`Runner.compute`: one copy into the input buffer; outputs returned without a copy.

        The outputs are torch views of the runner's output buffers (host memory), valid until
        the next batch.
        """
        import torch

        self.set_input(host_array(x))
        self.run()
        return [torch.from_numpy(y) for y in self._output_views()]

    def _output_views(self) -> list[np.ndarray]:
        if self._parts > 1:
            return [y[: self.batch] for y in self._y]
        self._drain()
        request = self._queue[self._last_request]
        return [np.asarray(request.get_output_tensor(i).data)
                for i in range(len(self._compiled.outputs))]

    def outputs(self) -> list[np.ndarray]:
        """Outputs for the current input, as float32 copies, once no request is running.

        Whole batches: every request in flight reads the one input buffer, so once they are
        done any of them holds the outputs of that input; the last one `run()` returned is read.
        """
        return [host_output(y) for y in self._output_views()]

    def close(self) -> None:
        """Wait for the requests in flight and their callbacks, then let the compiled model go."""
        if self._queue is not None:
            _settle(self._queue, self._tracker, self._cond)
        self._drain()


def _on_done(done: collections.deque[tuple[int, int, int]], cond: threading.Condition,
             tracker: _Tracker) -> Callable[[Any, tuple[int, int]], None]:
    """The pool's completion callback: notes when and which request finished."""

    def callback(_request: Any, userdata: tuple[int, int]) -> None:
        now = time.perf_counter_ns()  # runs on an OpenVINO thread
        submitted, slot = userdata
        with cond:  # the count last: `_settle` waits for it
            done.append((submitted, now, slot))
            tracker.finished()
            cond.notify()

    return callback


def _settle(queue: Any, tracker: _Tracker, cond: threading.Condition,
            release: bool = True) -> None:
    """Wait until a pool's requests are done and their callbacks have counted them out.

    `wait_all` returns when the requests have finished, not when their Python callbacks have:
    one may still be waiting for the interpreter lock. Before a `release` of the compiled model,
    which joins OpenVINO's threads while holding that lock (so such a callback hangs the
    process), a short sleep after the count reaches zero gives a callback that was switched out
    after counting itself out (the last thing it does under `cond`) the lock to return.
    """
    queue.wait_all()
    with cond:
        while tracker.in_flight > 0:
            cond.wait(0.01)
    if release:
        time.sleep(0.02)


def _int_property(compiled: Any, name: str) -> int | None:
    try:
        return int(compiled.get_property(name))
    except Exception:  # noqa: BLE001 - a device without the property: report none
        return None


def _precision_of(compiled: Any) -> str:
    """The precision the device really computes in (the CPU picks bf16 where AMX has it)."""
    try:
        name = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    except Exception:  # noqa: BLE001 - devices that do not report it
        return "unknown"
    return _PRECISION_NAMES.get(name, name)


@register_engine
class OvEngine(Engine):
    """OpenVINO on `openvino:*` units and on `cpu` units (CPU device, fp32)."""

    name = "openvino"
    unit_kinds = ("cpu", "openvino")

    requires = ("openvino",)
    install_hint = "pip install 'infermux[openvino]'"
    options_model = OvOptions
    takes_io = True

    def __init__(self) -> None:
        super().__init__()
        self._core: Any = None

    def resolve_options(self, options: dict[str, Any] | None, unit: Unit, model: LoadedModel,
                        data: str) -> tuple[str, OvOptions]:
        """The OpenVINO device for the unit and the options resolved for it."""
        device, opts = parse_options(OvOptions, "openvino", options).resolve(unit)
        if data == "device" and not device.startswith("CPU"):
            raise UsageError(f"--data device is not supported by the openvino engine on {unit.id!r}:"
                             " use --data host")
        return device, opts

    @staticmethod
    def options_key(opts: Any) -> str:
        """The options part of the cache key (the device follows from the unit)."""
        return str(opts[1].model_dump_json())

    def _build(self, model: LoadedModel, unit: Unit, batch: int, resolved: Any, data: str,
               instance: int) -> OvRunner:
        """Read the ONNX file, fix its batch, compile it for the unit's device with the hints."""
        return self._build_io(model, unit, batch, resolved, data, instance, None)

    def _build_io(self, model: LoadedModel, unit: Unit, batch: int, resolved: Any, data: str,
                  instance: int, length: int | None) -> OvRunner:
        """Compile at (`batch`, `length`): every input reshaped to its static shape."""
        import openvino as ov

        device, opts = resolved
        io = model.spec_io
        dims = {} if io.simple else io.dims_for(length)
        specs = () if io.simple else io.resolved(dims)
        if specs and opts.precision == "u8":
            raise UsageError(f"{model.name!r} takes several or integer inputs: int8 (u8) is "
                             "made for one float input only; use an fp32 unit, or --engine "
                             "onnxruntime, whose cpu/int8 quantizes such a model dynamically")
        started = time.perf_counter()
        onnx_file = self.onnx_for(model, opts.opset)
        if self._core is None:
            self._core = ov.Core()
        precision_info: dict[str, Any] = {}
        if opts.precision == "u8":
            from infermux.quantize import model_at_precision

            onnx_file, precision_info = model_at_precision(
                onnx_file, "int8", model.input_shape, calibration_data=opts.calibration_data,
                calibration_items=opts.calibration_items, method=opts.quantize_method,
                tool=opts.quantize_tool)
        try:
            ov_model = self._core.read_model(str(onnx_file.path))
        except Exception as exc:  # openvino raises RuntimeError/its own types for bad graphs
            raise RunError(f"OpenVINO cannot read {onnx_file.path.name}: {first_line(exc)}; "
                           "re-export the model or pass another ONNX file") from exc
        if opts.precision == "u8" and not _is_quantised(ov_model):
            raise UsageError(
                "option precision=u8 needs a quantised model (QuantizeLinear/FakeQuantize nodes, "
                "e.g. from NNCF or onnxruntime.quantization); this one is float: use f32/bf16/f16"
            )
        names = [port.get_any_name() for port in ov_model.inputs]
        shapes = [t.shape for t in specs] if specs else [model.input_shape]
        if specs and names != [t.name for t in specs]:
            raise RunError(f"{onnx_file.path.name}'s inputs {names} are not the model's "
                           f"{[t.name for t in specs]}")

        def reshape(rows: int) -> None:
            ov_model.reshape({n: ov.PartialShape([rows, *shape])
                              for n, shape in zip(names, shapes, strict=False)})

        try:
            reshape(batch)
        except Exception as exc:  # translated here, with the shapes
            raise UsageError(
                f"{onnx_file.path.name} cannot take batch {batch} with item shape "
                f"{model.input_shape}: {first_line(exc)}"
            ) from exc
        config = compile_config(device, opts)
        compiled = self._compile(ov_model, device, config, model.name, batch)
        # The optimal number of requests depends on the compiled model (its streams): known
        # only once compiled at the batch. A batch split over the requests is compiled again at
        # the sub-batch size (a compile of mobilenet_v3_small takes ~0.2 s on 2 cores).
        n = opts.requests or int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
        n = 1 if opts.hint == "latency" and opts.requests is None else max(1, n)
        parts = split_parts(batch, n) if opts.split_batch else 1
        if parts > 1:
            sub = -(-batch // parts)
            reshape(sub)
            compiled = self._compile(ov_model, device, config, model.name, sub)
        runner = OvRunner(compiled, unit, batch, model.input_shape, opts, started, requests=n,
                          parts=parts, input_specs=specs,
                          length=next(iter(dims.values()), None))
        runner.options["onnx_file"] = str(onnx_file.path)
        runner.options["onnx_sha256"] = onnx_file.digest
        runner.options.update(precision_info)
        return runner

    def _compile(self, ov_model: Any, device: str, config: dict[str, str], name: str,
                 batch: int) -> Any:
        try:
            return self._core.compile_model(ov_model, device, config)
        except Exception as exc:
            raise RunError(f"OpenVINO failed to compile {name} for {device} at batch "
                           f"{batch}: {first_line(exc)}") from exc


def _is_quantised(ov_model: Any) -> bool:
    kinds = {op.get_type_name() for op in ov_model.get_ops()}
    return bool(kinds & {"FakeQuantize", "QuantizeLinear", "DequantizeLinear"})


