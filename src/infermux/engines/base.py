"""The engine contract: `Engine.build(model, unit, batch, options)` → `Runner`.

A Runner owns its buffers: the batch is written into `host_input` (pinned host memory on a GPU
unit, or device memory when inputs are pre-staged) and `run()` executes one batch synchronously,
returning where the time went. `infer()` is the convenience path for correctness checks.

A model with several inputs (`LoadedModel.io`: token ids, masks, features) is built at one
sequence length (`length`, the size of its dynamic dims) by engines with `takes_io`; its runner
holds one buffer per input, filled at build with runnable values (`IOSpec.generate`), and
`set_inputs` copies a batch of every input. Engines without `takes_io` run one float input.

`compute(x)` is the path for pipelines, whose stages may run on any engine: torch tensor in,
torch tensors out, in the memory of the runner's unit (`compute_device`). Every engine has it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError

from infermux.errors import DeviceOutOfMemoryError, UsageError
from infermux.iospec import TensorSpec
from infermux.models import LoadedModel
from infermux.units import Unit

__all__ = [
    "DATA_PLACEMENTS",
    "BatchTiming",
    "Engine",
    "Runner",
    "compute_device",
    "create_engine",
    "engine_status",
    "host_array",
    "host_output",
    "is_out_of_memory",
    "list_engines",
    "parse_options",
    "register_engine",
]

#: `host`: inputs start in (pinned) host memory and the copy is timed; `device`: pre-staged.
DATA_PLACEMENTS = ("host", "device")


@dataclass(frozen=True)
class BatchTiming:
    """One batch, in nanoseconds: host wall time from start to outputs on the host, and phases.

    Phases are measured on the device (CUDA events) for GPU units; CPU units have only compute.
    """

    latency_ns: int
    h2d_ns: int = 0
    compute_ns: int = 0
    d2h_ns: int = 0

    @property
    def device_ns(self) -> int:
        """The batch's time on the device: copy in, compute, copy out (0 where not measured)."""
        return self.h2d_ns + self.compute_ns + self.d2h_ns


class Runner(ABC):
    """A model compiled for one unit and one batch size, with preallocated buffers."""

    engine: str
    unit: Unit
    batch: int
    input_shape: tuple[int, ...]
    #: Seconds spent building (compilation, warm-up, graph capture), reported with results.
    build_s: float = 0.0
    #: The resolved options actually used (defaults filled in), stored with results.
    options: dict[str, Any]
    #: The sequence length (the size of the model's dynamic dims) it was built for, if any.
    length: int | None = None
    #: Every input with its item shape at `length` (set by runners of several inputs; empty
    #: means the one float input of `input_shape`).
    input_specs: tuple[TensorSpec, ...] = ()

    @abstractmethod
    def run(self) -> BatchTiming:
        """Execute one batch from the input buffer to the output buffer; return when done."""

    @abstractmethod
    def set_input(self, batch: np.ndarray) -> None:
        """Copy a batch (shape `(batch, *input_shape)`) into the input buffer."""

    @abstractmethod
    def outputs(self) -> list[np.ndarray]:
        """The last batch's outputs as host arrays (copies).

        Floats as float32, integer and bool outputs (class ids, token ids) as their own dtype
        (`host_output`).
        """

    def set_inputs(self, arrays: Sequence[np.ndarray]) -> None:
        """Copy one batch of every input, in the model's input order, into the input buffers.

        Runners of one input take a one-element sequence; runners of several override this.
        """
        if len(arrays) != 1:
            raise UsageError(f"{len(arrays)} inputs given, the {self.engine} runner takes one")
        self.set_input(arrays[0])

    def infer_inputs(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run one batch of given inputs (every input, in order) and return its outputs."""
        self.set_inputs(arrays)
        self.run()
        return self.outputs()

    def check_inputs(self, arrays: Sequence[np.ndarray]) -> None:
        """Raise one UsageError line naming the first input whose count, shape or dtype is off."""
        specs = self.input_specs
        if len(arrays) != len(specs):
            raise UsageError(f"{len(arrays)} inputs given, the model takes {len(specs)}: "
                             f"{', '.join(t.name for t in specs)}")
        for spec, array in zip(specs, arrays, strict=True):
            expected = (self.batch, *spec.resolve({}))
            if tuple(array.shape) != expected:
                raise UsageError(f"input {spec.name!r}: shape {tuple(array.shape)} given, the "
                                 f"runner takes {expected}")
            floats = np.issubdtype(array.dtype, np.floating)
            if floats != spec.is_float or (not floats and array.dtype.kind != spec.numpy_dtype.kind
                                           and spec.dtype != "bool"):
                raise UsageError(f"input {spec.name!r}: dtype {array.dtype} given, the model "
                                 f"takes {spec.dtype}")

    #: True when `launch()` returns before the batch is done (GPU runners): the caller may
    #: prepare the next batch with `gather_input` while this one runs.
    asynchronous: bool = False
    #: True when a collected batch's `outputs()` stay its own through the next `launch()` (the
    #: runner writes each launch's outputs to another host buffer): the caller may launch the
    #: next batch first and read them after. False: read them before the next launch.
    outputs_survive_launch: bool = False

    def prepare_pool(self, samples: np.ndarray) -> Any:
        """The sample pool (float32, `(count, *input_shape)`) as `gather_input` reads it best.

        The default keeps the numpy array; a runner may convert it to its dtype and device.
        """
        return samples

    def pool_layout(self) -> tuple[str, ...]:
        """Runners with equal layouts can share one prepared pool."""
        return ("numpy",)

    def gather_input(self, pool: Any, indices: Sequence[int]) -> None:
        """Copy rows `indices` of `pool` into the first rows of the input buffer.

        The rows after them are padding. Safe to call while a launched batch is still running.
        """
        rows = np.asarray(pool)[list(indices)]
        if len(rows) < self.batch:
            pad = np.zeros((self.batch - len(rows), *rows.shape[1:]), dtype=rows.dtype)
            rows = np.concatenate([rows, pad])
        self.set_input(rows)

    def launch(self) -> None:
        """Start one batch from the input buffer; the default runs it to completion."""
        self._launched = self.run()

    def collect(self) -> BatchTiming:
        """Wait for the launched batch and return its timing."""
        return self._launched

    def done(self) -> bool:
        """Whether the launched batch is over, so `collect()` returns without waiting.

        The default's `launch` runs the batch to completion. An asynchronous runner answers
        from its device (an event query), without blocking: a worker waiting to take its next
        batch asks it, so a batch that ends early is answered at once, not at its estimate.
        """
        return True

    def compute(self, x: Any) -> list[Any]:
        """Run one batch from torch tensor `x`; return its outputs as torch tensors.

        The contract every engine keeps (pipeline stages call it, whatever the engine):
        - `x` has shape `(self.batch, *self.input_shape)`, any floating dtype (it is converted
          to the runner's input dtype), and lives in `compute_device(self.unit)`'s memory: the
          host for CPU, OpenVINO and DLA units, the GPU for `cuda` units.
        - The result is one tensor per model output, batch-major, in the same memory (host
          tensors for host units, device tensors on the unit's GPU for `cuda` units), in the
          dtype the engine computed it in (float32 on fp32 units).
        - Synchronous: the outputs are complete on return. They may be the runner's own
          buffers, overwritten by the next `compute`/`run`: copy what must outlive that.
        - `x` is only read, and may be released or overwritten once the call returns.

        This default goes through `set_input` (given a numpy view of `x`: no copy of a host
        tensor), `run()` and `outputs()` (copies), then moves the outputs to the unit's device;
        engines override it to skip copies (each engine's docstring says which remain).
        """
        import torch

        self.set_input(host_array(x))
        self.run()
        device = compute_device(self.unit)
        outs = [torch.from_numpy(y) for y in self.outputs()]
        return outs if device.type == "cpu" else [t.to(device) for t in outs]

    def infer(self, batch: np.ndarray) -> list[np.ndarray]:
        """Run one batch of given data and return its outputs (for correctness checks)."""
        self.set_input(batch)
        self.run()
        return self.outputs()

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the runner holds (graphs, sessions); the default holds nothing."""


def compute_device(unit: Unit) -> Any:
    """The torch device whose memory `Runner.compute` takes `x` from and returns outputs in.

    The unit's GPU for `cuda` units; the host for every other unit (CPU core sets, OpenVINO
    devices, DLAs: their runners stage device copies themselves).
    """
    import torch

    return torch.device(unit.device if unit.kind == "cuda" else "cpu")


def host_output(y: Any) -> np.ndarray:
    """One output as a runner returns it: a host copy.

    A float output becomes float32 (whatever precision it was computed in); an integer or
    bool one stays as it is (exact: an int64 id past float32's 24 bits is not rounded).
    """
    import torch

    if isinstance(y, torch.Tensor):
        y = y.detach()
        if y.is_floating_point():
            return y.float().cpu().numpy().copy()
        return y.cpu().numpy().copy()
    y = np.asarray(y)
    return np.array(y, dtype=np.float32 if y.dtype.kind in "fc" else y.dtype, copy=True)


def host_array(x: Any) -> np.ndarray:
    """A torch tensor as a numpy array on the host: a view (no copy) of a host tensor.

    Device tensors are copied to the host; dtypes numpy lacks (bfloat16) become float32.
    """
    import torch

    if not isinstance(x, torch.Tensor):
        return np.asarray(x)
    x = x.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.numpy()


class Engine(ABC):
    """Turns a loaded model into runners for the units it supports; caches within its life.

    An engine declares what it needs (`requires`, `install_hint`, `unit_kinds`,
    `options_model`) and implements `_build`; the base runs the checks every engine shares
    (the unit, the batch, the data placement, the options), keeps one runner per key for the
    engine's life, and `release()` closes them all. The registry (`register_engine`) makes an
    engine creatable by name, as timm's registry does for models.
    """

    name: ClassVar[str]
    #: The unit kinds this engine can drive.
    unit_kinds: ClassVar[tuple[str, ...]]
    #: Modules that must import for the engine to be usable here.
    requires: ClassVar[tuple[str, ...]] = ()
    #: How to get `requires` when they are missing (the tail of "install it with: ...").
    install_hint: ClassVar[str] = ""
    #: The engine's options (a pydantic model), validated by `parse_options`.
    options_model: ClassVar[type[BaseModel] | None] = None
    #: Whether the engine runs models of several, integer or variable-length inputs (builds
    #: take `length`); engines without it run one float input of fixed shape.
    takes_io: ClassVar[bool] = False

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """Whether the engine's library is importable here, and if not, how to get it."""
        import importlib

        for module in cls.requires:
            try:
                importlib.import_module(module)
            except ImportError:
                return False, f"install it with: {cls.install_hint or 'pip install ' + module}"
        return True, ""

    def unsupported_reason(self, unit: Unit) -> str:
        """Why this engine cannot run on `unit` here ("" when it can)."""
        if unit.kind not in self.unit_kinds:
            return (f"the {self.name} engine cannot run on unit {unit.id!r} "
                    f"(it runs {', '.join(self.unit_kinds)})")
        return ""

    def supports(self, unit: Unit) -> bool:
        """Whether this engine can run on `unit`."""
        return not self.unsupported_reason(unit)

    def __init__(self) -> None:
        self._onnx_exports: dict[tuple[str, int | None], Any] = {}
        self._runners: dict[tuple[Any, ...], Runner] = {}

    @staticmethod
    def check_build_args(batch: int, data: str) -> None:
        """The arguments every engine's `build` validates the same way."""
        if data not in DATA_PLACEMENTS:
            raise UsageError(f"data placement {data!r} unknown: use one of {DATA_PLACEMENTS}")
        if batch <= 0:
            raise UsageError(f"batch size {batch} must be at least 1")

    def onnx_for(self, model: LoadedModel, opset: int | None) -> Any:
        """The model's ONNX file for this engine's runtime, exported once per engine life.

        The export itself is cached on disk by content hash (`infermux.export`); this keeps the
        hashing out of every later `build` of the same model.
        """
        from infermux.export import export_onnx

        key = (model.key, opset)
        if key not in self._onnx_exports:
            self._onnx_exports[key] = export_onnx(model, self.name, opset)
        return self._onnx_exports[key]

    def accepts(self, model: LoadedModel) -> bool:
        """Whether this engine can run `model`.

        Engines that need a torch module say no to ONNX files, engines of one float input
        (without `takes_io`) to models of several or integer inputs.
        """
        return self.takes_io or model.spec_io.simple

    def build(
        self,
        model: LoadedModel,
        unit: Unit,
        batch: int,
        options: dict[str, Any] | None = None,
        data: str = "host",
        instance: int = 0,
        length: int | None = None,
    ) -> Runner:
        """Compile `model` for `unit` at a fixed `batch` and return a ready runner.

        Runners with different `instance` numbers are distinct (own buffers, streams, graphs)
        but may share the prepared model's weights. A runner built before with the same model,
        unit, options, batch, data placement and instance is returned again while it is open.
        `length` sizes the dynamic dims of a model that has them (None: their default sizes).
        """
        why = self.unsupported_reason(unit)
        if why:
            raise UsageError(why)
        self.check_build_args(batch, data)
        simple = model.spec_io.simple
        if not simple and not self.takes_io:
            raise UsageError(
                f"the {self.name} engine runs one float input; {model.name!r} takes "
                f"{', '.join(t.text() for t in model.spec_io.inputs)}: use --engine torch, "
                "onnxruntime or openvino")
        if simple and length is not None:
            raise UsageError(f"sequence length {length} given, but {model.name!r} has no "
                             "dynamic dimension: drop the sequence length")
        if not simple:
            model.spec_io.dims_for(length)  # a dim without a size: one line, before building
        opts = self.resolve_options(options, unit, model, data)
        key = (model.key, unit.id, self.options_key(opts), batch, data, instance, length)
        runner = self._runners.get(key)
        if runner is not None and not getattr(runner, "closed", False):
            return runner
        try:
            if simple:
                runner = self._build(model, unit, batch, opts, data, instance)
            else:
                runner = self._build_io(model, unit, batch, opts, data, instance, length)
        except DeviceOutOfMemoryError:
            raise
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            # One type for every engine's out-of-memory, whatever its library raised: the
            # runtime, the tuner and the bench record it as `oom` by this type. Nothing is
            # closed here: runners this engine built for other workers are still in use.
            where = "device memory" if unit.kind in ("cuda", "dla") else "memory"
            raise DeviceOutOfMemoryError(
                f"{model.name} on {unit.id} at batch {batch} ran out of {where}") from exc
        self._runners[key] = runner
        return runner

    def resolve_options(self, options: dict[str, Any] | None, unit: Unit, model: LoadedModel,
                        data: str) -> Any:
        """The validated options for one build (engines resolve defaults against the unit)."""
        if self.options_model is None:
            return dict(options or {})
        return parse_options(self.options_model, self.name, options)

    @staticmethod
    def options_key(opts: Any) -> str:
        """The resolved options as part of the runner cache key."""
        if isinstance(opts, BaseModel):
            return opts.model_dump_json()
        return repr(sorted(opts.items())) if isinstance(opts, dict) else repr(opts)

    @abstractmethod
    def _build(self, model: LoadedModel, unit: Unit, batch: int, opts: Any, data: str,
               instance: int) -> Runner:
        """Build a new runner; `opts` is what `resolve_options` returned."""

    def _build_io(self, model: LoadedModel, unit: Unit, batch: int, opts: Any, data: str,
                  instance: int, length: int | None) -> Runner:
        """Build a runner of a model with several inputs (engines with `takes_io`)."""
        raise UsageError(f"the {self.name} engine runs one float input")

    def release(self) -> None:
        """Close every runner this engine built and forget them (and what engines cache)."""
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()


OptionsT = TypeVar("OptionsT", bound=BaseModel)


def parse_options(model: type[OptionsT], engine: str, options: dict[str, Any] | None) -> OptionsT:
    """Validate an engine's options; a bad one is one line naming it and listing the others."""
    try:
        return model(**(options or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "options"
        allowed = ", ".join(sorted(model.model_fields))
        raise UsageError(
            f"{engine} engine option {field}={err.get('input')!r}: {err['msg']} "
            f"(options: {allowed})"
        ) from None


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is an out-of-memory error, by type.

    Ours (`DeviceOutOfMemoryError`), torch's (`torch.OutOfMemoryError`) and Python's
    (`MemoryError`, which numpy raises for a host buffer it cannot allocate).
    """
    import sys

    from infermux.errors import DeviceOutOfMemoryError

    torch = sys.modules.get("torch")
    types: tuple[type[BaseException], ...] = (DeviceOutOfMemoryError, MemoryError)
    if torch is not None:
        types += (getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError,)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, types):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False


_ENGINES: dict[str, type[Engine]] = {}


def register_engine(cls: type[Engine]) -> type[Engine]:
    """Class decorator: make an engine creatable by its `name`."""
    _ENGINES[cls.name] = cls
    return cls


def list_engines() -> list[str]:
    """Names of every registered engine, usable here or not."""
    return sorted(_ENGINES)


def engine_status() -> dict[str, tuple[bool, str]]:
    """Each engine's availability on this machine and, if absent, how to install it."""
    return {name: cls.available() for name, cls in sorted(_ENGINES.items())}


def create_engine(name: str) -> Engine:
    """The engine called `name`; a clear error for unknown or uninstalled engines."""
    if name not in _ENGINES:
        raise UsageError(f"unknown engine {name!r}; engines: {', '.join(list_engines())}")
    ok, why = _ENGINES[name].available()
    if not ok:
        raise UsageError(f"engine {name!r} is not usable here: {why}")
    return _ENGINES[name]()
