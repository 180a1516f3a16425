"""Input and output specs: a network's named tensors, their dtypes and shapes with named dims.

A model takes one or more named inputs (float features, int64 token ids, masks) and returns one
or more named outputs. Each `TensorSpec` gives one item's shape — the batch dimension is left
out, as everywhere in infermux — whose entries are sizes or names of dynamic dimensions
(`("seq",)` for a sequence of token ids). An `IOSpec` holds a model's inputs and outputs and
the sizes its dynamic dims take when nobody asks for others (`default_dims`, e.g. `seq: 128`).

Where specs come from: every input and output of an ONNX file (`from_onnx`), a factory's module
(`from_module`: an `inputs` attribute, or `sample_inputs`), the transformer architectures
(`infermux.hf`), or a plain shape (`IOSpec.single`). `generate` makes inputs a benchmark can
run: normal floats, integer ids within the vocabulary (`high`), masks of ones.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infermux.errors import UsageError

__all__ = ["DTYPES", "VALUES", "IOSpec", "TensorSpec", "from_module", "from_onnx",
           "normalise_dtype"]

#: Tensor dtypes a spec can name (the first six are what networks take; the rest ONNX files use).
DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool", "float64", "uint8", "int8")
_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
            "bf16": "bfloat16", "long": "int64", "int": "int32", "double": "float64"}
#: How generated inputs are filled: normal floats, integer ids in [0, high), ones (masks).
VALUES = ("normal", "ids", "ones")
_FLOATS = ("float32", "float16", "bfloat16", "float64")
_DIM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
#: ONNX TensorProto element types → spec dtypes.
_ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 9: "bool",
                10: "float16", 11: "float64", 16: "bfloat16"}
#: Integer inputs whose vocabulary cannot be read get ids in [0, this).
_DEFAULT_HIGH = 2


def normalise_dtype(dtype: Any) -> str:
    """A dtype name (`float32`, `int64`, ...) from a name, an alias, a numpy or torch dtype."""
    text = str(dtype).removeprefix("torch.").lower()
    text = _ALIASES.get(text, text)
    if text not in DTYPES:
        raise UsageError(f"dtype {dtype!r} is not one infermux runs: use one of {', '.join(DTYPES)}")
    return text


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor: dtype and one item's shape (sizes, or names of dynamic dims)."""

    name: str
    dtype: str = "float32"
    shape: tuple[int | str, ...] = ()
    #: How `generate` fills it; "" picks by dtype (normal floats, ids for integers, ones for bool).
    values: str = ""
    #: Integer ids are drawn from [0, high) (a vocabulary's size); None: `_DEFAULT_HIGH`.
    high: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise UsageError("a tensor spec needs a name")
        object.__setattr__(self, "dtype", normalise_dtype(self.dtype))
        dims: list[int | str] = []
        for dim in self.shape:
            if isinstance(dim, str) and _DIM_NAME.match(dim):
                dims.append(dim)
            elif isinstance(dim, (int, np.integer)) and not isinstance(dim, bool) and dim > 0:
                dims.append(int(dim))
            else:
                raise UsageError(f"input {self.name!r}: dimension {dim!r} is neither a size ≥ 1 "
                                 "nor the name of a dynamic dimension (e.g. 'seq')")
        object.__setattr__(self, "shape", tuple(dims))
        # An integer input named as a mask (attention_mask, padding_mask) holds ones, as a
        # bool one does: generated as such, and it lets padding stay out (`pads_exactly`).
        values = self.values or ("normal" if self.is_float else
                                 "ones" if self.dtype == "bool" or "mask" in self.name.lower()
                                 else "ids")
        if values not in VALUES:
            raise UsageError(f"input {self.name!r}: values {self.values!r} unknown: use one of "
                             f"{', '.join(VALUES)}")
        if values == "normal" and not self.is_float:
            raise UsageError(f"input {self.name!r} is {self.dtype}: normal values need a float "
                             "dtype; use values 'ids' or 'ones'")
        object.__setattr__(self, "values", values)
        if self.high is not None and self.high < 1:
            raise UsageError(f"input {self.name!r}: high={self.high} must be at least 1")

    @property
    def is_float(self) -> bool:
        """Whether the tensor holds floating-point values (converted to a unit's precision)."""
        return self.dtype in _FLOATS

    @property
    def dynamic(self) -> tuple[str, ...]:
        """Names of the dynamic dims, in order."""
        return tuple(d for d in self.shape if isinstance(d, str))

    def resolve(self, dims: Mapping[str, int]) -> tuple[int, ...]:
        """One item's concrete shape, each dynamic dim taking its size from `dims`."""
        out = []
        for dim in self.shape:
            if isinstance(dim, str):
                if dim not in dims:
                    raise UsageError(f"input {self.name!r} has the dynamic dimension {dim!r}: "
                                     "give its size, e.g. --seq 128")
                out.append(int(dims[dim]))
            else:
                out.append(dim)
        return tuple(out)

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """The host array dtype (bfloat16, which numpy lacks, is held as float32)."""
        return np.dtype("float32" if self.dtype == "bfloat16" else self.dtype)

    def generate(self, batch: int, dims: Mapping[str, int],
                 rng: np.random.Generator) -> np.ndarray:
        """A batch of inputs a network can run: normal floats, ids in [0, high), or ones."""
        shape = (batch, *self.resolve(dims))
        if self.values == "ones":
            return np.ones(shape, dtype=self.numpy_dtype)
        if self.values == "ids":
            return rng.integers(0, self.high or _DEFAULT_HIGH, size=shape).astype(self.numpy_dtype)
        return rng.standard_normal(shape).astype(self.numpy_dtype)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        data: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                                "values": self.values}
        if self.high is not None:
            data["high"] = self.high
        return data

    def text(self, *, values: bool = True) -> str:
        """`name: int64[batch, seq]`, for tables; `values`: with what an input is filled with."""
        dims = ", ".join(str(d) for d in ("batch", *self.shape))
        extra = "" if not values else f" < {self.high}" if self.values == "ids" and self.high else (
            " (ones)" if self.values == "ones" else "")
        return f"{self.name}: {self.dtype}[{dims}]{extra}"

    @classmethod
    def coerce(cls, value: Any, default_name: str = "input") -> TensorSpec:
        """A spec from a TensorSpec, a dict of its fields, or a `(name, dtype, shape)` tuple."""
        if isinstance(value, TensorSpec):
            return value
        if isinstance(value, Mapping):
            known = {"name", "dtype", "shape", "values", "high"}
            extra = sorted(set(value) - known)
            if extra:
                raise UsageError(f"tensor spec {dict(value)!r}: unknown keys {extra}; use "
                                 f"{', '.join(sorted(known))}")
            data = dict(value)
            data.setdefault("name", default_name)
            data["shape"] = tuple(data.get("shape", ()))
            return cls(**data)
        if isinstance(value, (tuple, list)) and 2 <= len(value) <= 3 and isinstance(value[0], str):
            return cls(value[0], value[1], tuple(value[2]) if len(value) > 2 else ())
        if isinstance(value, str):
            return cls(value)
        raise UsageError(f"tensor spec {value!r}: write a dict with name, dtype and shape, or "
                         "(name, dtype, shape)")


@dataclass(frozen=True)
class IOSpec:
    """A model's inputs (in the order its forward takes them) and outputs (empty: not known)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...] = ()
    #: Sizes of dynamic dims when none are asked for (`{"seq": 128}`).
    default_dims: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if not self.inputs:
            raise UsageError("a model needs at least one input")
        names = [t.name for t in self.inputs]
        if len(set(names)) != len(names):
            raise UsageError(f"input names {names} repeat: each input needs its own name")

    @classmethod
    def single(cls, shape: Sequence[int], dtype: str = "float32", name: str = "input",
               outputs: Sequence[TensorSpec] = ()) -> IOSpec:
        """The spec of a network with one float input of fixed shape (an image CNN)."""
        return cls((TensorSpec(name, dtype, tuple(shape)),), tuple(outputs))

    @property
    def simple(self) -> bool:
        """One float input of fixed shape: the case every path of infermux runs."""
        return (len(self.inputs) == 1 and self.inputs[0].is_float
                and not self.inputs[0].dynamic)

    @property
    def pads_exactly(self) -> bool:
        """Whether an item padded to a longer compiled length keeps its own outputs.

        True without a dynamic dim, or with an input that masks the sequence (values "ones": an
        attention mask, 0 past an item's own length). A model without one (a bag of
        embeddings, a convolution over the sequence) reads the padding as data, so its items
        run only at lengths it compiles (`unpadded_error`).
        """
        return not self.dynamic_dims or any(t.values == "ones" and t.dynamic for t in self.inputs)

    def unpadded_error(self, length: int | None, compiled: Sequence[int | None],
                       name: str = "") -> str | None:
        """Why a model that cannot be padded cannot run `length`; None when it can.

        One line naming the input, the length and `compiled`, the lengths it can run.
        """
        lengths = sorted(n for n in compiled if n is not None)
        if self.pads_exactly or length is None or not lengths or length in lengths:
            return None
        seq = next(t.name for t in self.inputs if t.dynamic)
        model = f"model {name!r}" if name else "the model"
        return (f"input {seq!r}: sequence length {length} given; {model} has no mask input, so "
                "padding would change its outputs, and it runs only at the lengths it compiles "
                f"({', '.join(map(str, lengths))}): send one of those, or add {length} to its "
                "seq_buckets")

    @property
    def dynamic_dims(self) -> tuple[str, ...]:
        """Every dynamic dim of the inputs, once each, in order of appearance."""
        seen: dict[str, None] = {}
        for spec in self.inputs:
            for dim in spec.dynamic:
                seen.setdefault(dim)
        return tuple(seen)

    def dims_for(self, length: int | None = None) -> dict[str, int]:
        """Sizes of the dynamic dims: `length` for every one (a sequence-length bucket).

        Without `length`, the defaults; a dim with neither is a usage error naming it.
        """
        dims: dict[str, int] = {}
        for name in self.dynamic_dims:
            size = length if length is not None else self.default_dims.get(name)
            if size is None:
                raise UsageError(f"dynamic dimension {name!r} has no size: pass a sequence "
                                 "length (--seq 128, or seq_buckets in a plan)")
            if size < 1:
                raise UsageError(f"sequence length {size} must be at least 1")
            dims[name] = int(size)
        return dims

    def shapes(self, dims: Mapping[str, int]) -> list[tuple[int, ...]]:
        """Each input's item shape at `dims`."""
        return [spec.resolve(dims) for spec in self.inputs]

    def resolved(self, dims: Mapping[str, int]) -> tuple[TensorSpec, ...]:
        """The inputs with their dynamic dims set to `dims` (what a runner built at them takes)."""
        return tuple(TensorSpec(t.name, t.dtype, t.resolve(dims), t.values, t.high)
                     for t in self.inputs)

    def generate(self, batch: int, dims: Mapping[str, int], seed: int = 0) -> list[np.ndarray]:
        """One batch of runnable inputs, seeded (see `TensorSpec.generate`)."""
        rng = np.random.default_rng(seed)
        return [spec.generate(batch, dims, rng) for spec in self.inputs]

    def check_item(self, values: Mapping[str, Any] | Sequence[Any],
                   lengths: Sequence[int] | None = None) -> dict[str, int]:
        """Check one item's inputs (no batch axis) against the spec; return their dims' sizes.

        `values` maps input names to arrays, or lists them in input order. A missing, unknown,
        mistyped or misshapen input is one UsageError line naming the input, what the model
        takes and what was given; a dynamic dim must have one size across the inputs, and one
        of `lengths` (a plan's sequence buckets) when they are given.
        """
        if isinstance(values, Mapping):
            unknown = sorted(set(values) - {t.name for t in self.inputs})
            if unknown:
                raise UsageError(f"input {unknown[0]!r} is not one the model takes: it takes "
                                 f"{', '.join(t.text() for t in self.inputs)}")
            missing = [t.name for t in self.inputs if t.name not in values]
            if missing:
                spec = next(t for t in self.inputs if t.name == missing[0])
                raise UsageError(f"input {missing[0]!r} is missing: the model takes "
                                 f"{spec.text()}")
            arrays = [np.asarray(values[t.name]) for t in self.inputs]
        else:
            arrays = [np.asarray(v) for v in values]
            if len(arrays) != len(self.inputs):
                raise UsageError(f"{len(arrays)} inputs given, the model takes "
                                 f"{len(self.inputs)}: {', '.join(t.name for t in self.inputs)}")
        dims: dict[str, int] = {}
        for spec, array in zip(self.inputs, arrays, strict=True):
            given = f"{array.dtype}{list(array.shape)}"
            floats = np.issubdtype(array.dtype, np.floating)
            same_kind = (floats if spec.is_float else
                         array.dtype == np.bool_ if spec.dtype == "bool" else
                         np.issubdtype(array.dtype, np.integer))
            if not same_kind:
                raise UsageError(f"input {spec.name!r}: {given} given, the model takes "
                                 f"{spec.text()}")
            if array.ndim != len(spec.shape):
                raise UsageError(f"input {spec.name!r}: {given} given, the model takes "
                                 f"{spec.text()} ({len(spec.shape)} dims per item)")
            for dim, size in zip(spec.shape, array.shape, strict=True):
                if isinstance(dim, int) and dim != size:
                    raise UsageError(f"input {spec.name!r}: {given} given, the model takes "
                                     f"{spec.text()}")
                if isinstance(dim, str):
                    if dims.setdefault(dim, int(size)) != size:
                        raise UsageError(f"input {spec.name!r}: {dim} is {size}, another input "
                                         f"has {dim} {dims[dim]}: they must agree")
                    if lengths is not None and size not in lengths:
                        raise UsageError(f"input {spec.name!r}: {dim} {size} is not one of the "
                                         f"sequence lengths {list(lengths)}: pad it to one")
        return dims

    def with_outputs(self, outputs: Sequence[TensorSpec]) -> IOSpec:
        """A copy of this spec with its outputs named."""
        return IOSpec(self.inputs, tuple(outputs), dict(self.default_dims))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"inputs": [t.to_dict() for t in self.inputs],
                "outputs": [t.to_dict() for t in self.outputs],
                "default_dims": dict(self.default_dims)}

    def key(self) -> str:
        """What decides compiled artefacts (names, dtypes, shapes), for cache keys."""
        return repr([(t.name, t.dtype, t.shape) for t in self.inputs])


# -- reading specs -------------------------------------------------------------------------------


def from_onnx(path: Path) -> IOSpec | None:
    """Every input (initialisers excluded) and output of an ONNX file; None without `onnx`.

    A dim with a name (`dim_param`) stays dynamic under that name; an unnamed unknown dim is
    called `<input>_dim<i>`. The first dim is the batch. An integer input that indexes an
    embedding table (a `Gather` on an initialiser) gets the table's row count as its `high`.
    """
    try:
        import onnx
    except ImportError:
        return None
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # onnx raises DecodeError, OSError…
        raise UsageError(f"ONNX file {str(path)!r} cannot be read: {exc}") from exc
    initialisers = {i.name: tuple(i.dims) for i in graph.initializer}
    vocab: dict[str, int] = {}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) == 2:
            table = initialisers.get(node.input[0])
            if table:
                vocab[node.input[1]] = max(vocab.get(node.input[1], 0), int(table[0]))

    def spec(value: Any, *, is_input: bool) -> TensorSpec:
        tensor = value.type.tensor_type
        dtype = _ONNX_DTYPES.get(tensor.elem_type)
        if dtype is None:
            raise UsageError(f"ONNX file {str(path)!r}: {'input' if is_input else 'output'} "
                             f"{value.name!r} has element type {tensor.elem_type}, which infermux "
                             f"does not run (it runs {', '.join(DTYPES)})")
        dims: list[int | str] = []
        for i, dim in enumerate(list(tensor.shape.dim)[1:], start=1):
            if dim.dim_value > 0:
                dims.append(int(dim.dim_value))
            else:
                dims.append(dim.dim_param if _DIM_NAME.match(dim.dim_param or "")
                            else f"{value.name}_dim{i}")
        high = vocab.get(value.name) if is_input and dtype.startswith("int") else None
        return TensorSpec(value.name, dtype, tuple(dims), high=high)

    inputs = [spec(v, is_input=True) for v in graph.input if v.name not in initialisers]
    if not inputs:
        return None
    return IOSpec(tuple(inputs), tuple(spec(v, is_input=False) for v in graph.output))


def module_outputs(module: Any) -> tuple[TensorSpec, ...]:
    """A factory module's `outputs` (names or specs), whether or not it declares its inputs."""
    return tuple(TensorSpec.coerce(o, f"output{i}" if i else "output")
                 for i, o in enumerate(getattr(module, "outputs", None) or ()))


def from_module(module: Any) -> IOSpec | None:
    """A factory module's spec, if it declares one; None when it does not.

    - `inputs`: a list of tensor specs (dicts with name, dtype, shape[, values, high], or
      `(name, dtype, shape)` tuples, or `TensorSpec`s), one item's shape each; optional
      `outputs` (names or specs) and `default_dims` (`{"seq": 128}`);
    - or `sample_inputs`: a tuple, list or dict of batch tensors (or a function returning one):
      names from the forward's parameters (or the dict's keys), dtypes and item shapes from the
      tensors, an integer input's `high` from its largest value.
    """
    declared = getattr(module, "inputs", None)
    outputs = module_outputs(module)
    defaults = dict(getattr(module, "default_dims", None) or {})
    if declared is not None and not callable(declared):
        if isinstance(declared, Mapping):
            declared = [{"name": k, **v} if isinstance(v, Mapping) else (k, *v)
                        for k, v in declared.items()]
        inputs = tuple(TensorSpec.coerce(v, f"input{i}") for i, v in enumerate(declared))
        return IOSpec(inputs, outputs, defaults)
    samples = getattr(module, "sample_inputs", None)
    if samples is None:
        return None
    if callable(samples):
        samples = samples()
    if isinstance(samples, Mapping):
        named = list(samples.items())
    else:
        if not isinstance(samples, (tuple, list)):
            samples = (samples,)
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names = params + [f"input{i}" for i in range(len(params), len(samples))]
        named = list(zip(names, samples, strict=False))
    inputs_list = []
    for name, tensor in named:
        dtype = normalise_dtype(tensor.dtype)
        values, high = "", None
        if dtype.startswith("int"):
            top = int(tensor.max()) if tensor.numel() else 0
            if tensor.numel() and int(tensor.min()) == 1 and top == 1:
                values = "ones"
            else:
                high = top + 1
        inputs_list.append(TensorSpec(name, dtype, tuple(tensor.shape[1:]), values, high))
    return IOSpec(tuple(inputs_list), outputs, defaults)
