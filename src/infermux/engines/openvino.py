"""The OpenVINO engine: `openvino:CPU|GPU|NPU` units, and the plain `cpu` units on the CPU device.

Knobs the tuner can set: the performance hint (latency, throughput, cumulative_throughput),
streams, infer requests in flight, threads, and the inference precision (f32, bf16, f16, u8).

How a runner keeps a throughput-hinted model busy: it owns an `AsyncInferQueue` of N requests
(N = the compiled model's optimal number, or `requests`) that all read the one input buffer.
`run()` tops the pool up to N batches in flight, waits for the next one to finish and returns
that batch's own timing, so each call still accounts for exactly one batch while N streams work
at once — what OpenVINO's benchmark_app does. With the latency hint N is 1 and `run()` is a
plain synchronous call. docs/architecture-engines.md gives the reasons.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from infermux.engines.base import BatchTiming, Engine, Runner, parse_options, register_engine
from infermux.errors import RunError, UsageError
from infermux.export import cache_dir
from infermux.models import LoadedModel
from infermux.units import Unit

__all__ = ["OvEngine", "OvOptions", "OvRunner", "compile_config"]

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

    def resolve(self, unit: Unit) -> tuple[str, OvOptions]:
        """(OpenVINO device, options with the unit's defaults), rejecting what cannot be."""
        update: dict[str, Any] = {}
        if unit.kind == "cpu":
            # A `cpu` unit is fp32 by name: results from it must be fp32 results.
            if self.precision not in (None, "f32"):
                raise UsageError(
                    f"option precision={self.precision} on unit {unit.id!r}, which is fp32: use "
                    "the unit openvino:CPU for bf16/f16/u8"
                )
            update["precision"] = "f32"
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
    if device.startswith("CPU"):
        if opts.threads is not None:
            config["INFERENCE_NUM_THREADS"] = str(opts.threads)
        if opts.pin_threads is not None:
            config["ENABLE_CPU_PINNING"] = "YES" if opts.pin_threads else "NO"
    if opts.cache_dir:
        config["CACHE_DIR"] = opts.cache_dir
    return config


class OvRunner(Runner):
    """A compiled model at one batch size and a pool of infer requests sharing one input."""

    engine = "openvino"

    def __init__(self, compiled: Any, unit: Unit, batch: int, input_shape: tuple[int, ...],
                 opts: OvOptions, started: float) -> None:
        import openvino as ov

        self.unit = unit
        self.batch = batch
        self.input_shape = input_shape
        self._compiled = compiled
        n = opts.requests or int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
        self._n = 1 if opts.hint == "latency" and opts.requests is None else max(1, n)
        dtype = compiled.inputs[0].get_element_type().to_dtype()
        self._x = np.random.default_rng(0).standard_normal((batch, *input_shape)).astype(dtype)
        # Every request reads the same host buffer (requests only read inputs): no per-batch copy.
        x_tensor = ov.Tensor(self._x, shared_memory=True)
        self._queue = ov.AsyncInferQueue(compiled, self._n)
        for i in range(self._n):
            self._queue[i].set_input_tensor(x_tensor)
        # The callback closes over these two, not over the runner, so a runner nobody holds is
        # collected; the finalizer then (or at exit) waits for its requests before they go.
        self._done: collections.deque[tuple[int, int, int]] = collections.deque()
        self._cond = threading.Condition()
        self._queue.set_callback(_on_done(self._done, self._cond))
        self._finalizer = weakref.finalize(self, self._queue.wait_all)
        self._in_flight = 0
        #: A new input was set and has not run: it runs once, not once per request.
        self._fresh = False
        self._next_id = 0
        self._last_request = 0
        self.options = {
            **opts.model_dump(),
            "requests": self._n,
            "streams": _int_property(compiled, "NUM_STREAMS"),
            "precision": _precision_of(compiled),
            "device": unit.device,
        }
        for _ in range(max(1, opts.warmup_iters)):
            self.run()
        self.build_s = time.perf_counter() - started

    def run(self) -> BatchTiming:
        """Keep N batches in flight; return the timing of the next one that finishes.

        After `set_input`/`gather_input` (a new batch, as the runtime gives each call) the
        batch runs exactly once and its own timing is returned.

        The submission comes first and waits inside OpenVINO for a free request, as
        benchmark_app's loop does, so a finished request is refilled without a Python hop; its
        callback has recorded the finish by then, and that record is what this call returns.
        """
        if self._fresh:
            # A new input (the runtime sets one per batch): every request reads the one
            # buffer, so filling the pool would compute this batch N times. Run it once.
            self._fresh = False
            self._submit()
            with self._cond:
                while not self._done:
                    self._cond.wait()
                submitted, finished, slot = self._done.popleft()
            self._last_request = slot
            return BatchTiming(latency_ns=finished - submitted, compute_ns=finished - submitted)
        while self._in_flight < self._n:  # after a drain: fill the pool
            self._submit()
            self._in_flight += 1
        self._submit()  # blocks until one of the N finishes, then reuses it
        with self._cond:
            while not self._done:
                self._cond.wait()
            submitted, finished, slot = self._done.popleft()
        self._last_request = slot
        latency = finished - submitted
        return BatchTiming(latency_ns=latency, compute_ns=latency)

    def _submit(self) -> None:
        slot = self._queue.get_idle_request_id()  # blocks for a free one; start_async takes it
        self._queue.start_async(userdata=(time.perf_counter_ns(), slot))

    def _drain(self) -> None:
        self._queue.wait_all()
        with self._cond:
            self._done.clear()
        self._in_flight = 0

    def set_input(self, batch: np.ndarray) -> None:
        """Copy `batch` into the shared input buffer, once no request is reading it."""
        expected = (self.batch, *self.input_shape)
        if tuple(batch.shape) != expected:
            raise UsageError(f"batch of shape {tuple(batch.shape)} given, runner takes {expected}")
        self._drain()
        self._x[...] = batch
        self._fresh = True

    def outputs(self) -> list[np.ndarray]:
        """Outputs for the current input, as float32 copies, once the pool has gone idle.

        Every request in flight reads the one input buffer, so once they are done any of them
        holds the outputs of that input; the last one `run()` returned is read.
        """
        self._drain()
        request = self._queue[self._last_request]
        return [np.array(request.get_output_tensor(i).data, dtype=np.float32, copy=True)
                for i in range(len(self._compiled.outputs))]

    def close(self) -> None:
        """Wait for the requests in flight, then let the compiled model go."""
        self._drain()


def _on_done(done: collections.deque[tuple[int, int, int]],
             cond: threading.Condition) -> Callable[[Any, tuple[int, int]], None]:
    """The pool's completion callback: notes when and which request finished."""

    def callback(_request: Any, userdata: tuple[int, int]) -> None:
        now = time.perf_counter_ns()  # runs on an OpenVINO thread
        submitted, slot = userdata
        with cond:
            done.append((submitted, now, slot))
            cond.notify()

    return callback


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

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """Importable here, or how to install it."""
        try:
            import openvino  # noqa: F401
        except ImportError:
            return False, "install it with: pip install 'infermux[openvino]'"
        return True, ""

    def __init__(self) -> None:
        super().__init__()
        self._core: Any = None
        self._runners: dict[tuple[Any, ...], OvRunner] = {}


    def build(
        self,
        model: LoadedModel,
        unit: Unit,
        batch: int,
        options: dict[str, Any] | None = None,
        data: str = "host",
        instance: int = 0,
    ) -> OvRunner:
        """Read the ONNX file, fix its batch, compile it for the unit's device with the hints."""
        import openvino as ov

        if not self.supports(unit):
            raise UsageError(f"the openvino engine cannot run on unit {unit.id!r} "
                             f"(it runs {', '.join(self.unit_kinds)})")
        self.check_build_args(batch, data)
        device, opts = parse_options(OvOptions, "openvino", options).resolve(unit)
        if data == "device" and not device.startswith("CPU"):
            raise UsageError(f"--data device is not supported by the openvino engine on {unit.id!r}:"
                             " use --data host")
        key = (model.key, unit.id, opts.model_dump_json(), batch, data, instance)
        if key in self._runners:
            return self._runners[key]
        started = time.perf_counter()
        onnx_file = self.onnx_for(model, opts.opset)
        if self._core is None:
            self._core = ov.Core()
        try:
            ov_model = self._core.read_model(str(onnx_file.path))
        except Exception as exc:  # openvino raises RuntimeError/its own types for bad graphs
            raise RunError(f"OpenVINO cannot read {onnx_file.path.name}: {_first_line(exc)}; "
                           "re-export the model or pass another ONNX file") from exc
        if opts.precision == "u8" and not _is_quantised(ov_model):
            raise UsageError(
                "option precision=u8 needs a quantised model (QuantizeLinear/FakeQuantize nodes, "
                "e.g. from NNCF or onnxruntime.quantization); this one is float: use f32/bf16/f16"
            )
        name = ov_model.inputs[0].get_any_name()
        try:
            ov_model.reshape({name: ov.PartialShape([batch, *model.input_shape])})
        except Exception as exc:  # translated here, with the shapes
            raise UsageError(
                f"{onnx_file.path.name} cannot take batch {batch} with item shape "
                f"{model.input_shape}: {_first_line(exc)}"
            ) from exc
        config = compile_config(device, opts)
        try:
            compiled = self._core.compile_model(ov_model, device, config)
        except Exception as exc:
            raise RunError(f"OpenVINO failed to compile {model.name} for {device} at batch "
                           f"{batch}: {_first_line(exc)}") from exc
        runner = OvRunner(compiled, unit, batch, model.input_shape, opts, started)
        runner.options["onnx_file"] = str(onnx_file.path)
        runner.options["onnx_sha256"] = onnx_file.digest
        self._runners[key] = runner
        return runner

    def release(self) -> None:
        """Drain and forget every cached runner."""
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()


def _is_quantised(ov_model: Any) -> bool:
    kinds = {op.get_type_name() for op in ov_model.get_ops()}
    return bool(kinds & {"FakeQuantize", "QuantizeLinear", "DequantizeLinear"})


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
