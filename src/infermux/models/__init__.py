"""Models: where a network comes from, its input spec, and loading its weights.

Sources, in the order a bare name is tried: an ONNX file (`*.onnx`), a Python factory
(`path/to/file.py:build`), a built-in network (`digits-cnn`, trained on first use),
`torchvision:NAME`, `timm:NAME`, `hf:NAME` or `hf:FOLDER` (`infermux.hf`: transformers, nothing
downloaded), then a bare architecture name looked up in torchvision and then
timm. Without `weights` the network is randomly initialised and `LoadedModel.weights_note` says
so; every result carries that note.

What runs code: weights files are read without running pickled code (`weights_only=True`, or
safetensors). A factory is different: loading `file.py:build` imports `file.py`, which executes
it, and calls `build()`; a plan that names one does so in this process and again in every worker
process. Name only factory files you trust.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from infermux.errors import RunError, UsageError
from infermux.iospec import IOSpec

__all__ = ["LoadedModel", "ModelSpec", "list_models", "load_model"]

_STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "module", "net")
#: Networks infermux ships, needing no download: name → module with `build()` (the network) and
#: `trained_weights()` (its weights file, trained and cached on first use).
_BUILTIN = {"digits-cnn": "infermux.characterize.digits"}


@dataclass(frozen=True)
class ModelSpec:
    """What the user asked for: a model reference, optional weights, optional input shape."""

    ref: str
    weights: str | None = None
    input_shape: tuple[int, ...] | None = None
    dtype: str = "float32"


@dataclass
class LoadedModel:
    """A network ready for an engine: a torch module (or an ONNX file) and its input spec."""

    spec: ModelSpec
    name: str
    source: str  # torchvision | timm | factory | onnx | module
    input_shape: tuple[int, ...]
    dtype: str
    weights_note: str
    module: Any = None  # torch.nn.Module in eval mode on the CPU, None for ONNX
    onnx_path: Path | None = None
    info: dict[str, Any] = field(default_factory=dict)
    #: What the network is beyond its display name, for a file source: the factory's or ONNX
    #: file's resolved path and content hash (two `m.py:build` in two folders differ here).
    identity: str = ""
    #: Named inputs and outputs (`infermux.iospec`); None means one float input of
    #: `input_shape`, filled in on construction. `input_shape` is the first input's item shape
    #: (0 for a dynamic dim without a default size).
    io: IOSpec | None = None

    def __post_init__(self) -> None:
        if self.io is None:
            self.io = IOSpec.single(self.input_shape, self.dtype)

    @property
    def spec_io(self) -> IOSpec:
        """The model's inputs and outputs (never None once constructed)."""
        if self.io is None:
            self.io = IOSpec.single(self.input_shape, self.dtype)
        return self.io

    @classmethod
    def from_module(
        cls,
        module: Any,
        *,
        name: str,
        input_shape: tuple[int, ...],
        dtype: str = "float32",
        weights_note: str = "an in-memory module",
    ) -> LoadedModel:
        """Wrap a torch module already in memory (a pipeline segment, a notebook's network)."""
        module.eval()
        return cls(ModelSpec(ref=name, input_shape=input_shape, dtype=dtype), name, "module",
                   tuple(input_shape), dtype, weights_note, module=module,
                   info={"parameters": int(sum(p.numel() for p in module.parameters()))})

    @property
    def randomly_initialised(self) -> bool:
        """True when no weights were loaded: outputs are meaningless, timings are not."""
        return self.spec.weights is None and self.source != "onnx"

    @property
    def key(self) -> str:
        """A stable key for caches: source file identity, weights file identity, shape, dtype."""
        weights = ""
        if self.spec.weights:
            stat = Path(self.spec.weights).stat()
            weights = f"{Path(self.spec.weights).resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        if self.source == "module":  # two in-memory modules may share a name, never an identity
            weights = f"id:{id(self.module)}"
        text = (f"{self.source}|{self.name}|{self.identity}|{weights}|{self.input_shape}|"
                f"{self.dtype}")
        if not self.spec_io.simple:  # several inputs, integer inputs or dynamic dims
            text += f"|{self.spec_io.key()}"
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        """The model's part of a result record."""
        return {
            "name": self.name,
            "source": self.source,
            "ref": self.spec.ref,
            "weights": self.spec.weights,
            "weights_note": self.weights_note,
            "input_shape": list(self.input_shape),
            "dtype": self.dtype,
            "inputs": [t.to_dict() for t in self.spec_io.inputs],
            "outputs": [t.to_dict() for t in self.spec_io.outputs],
            **self.info,
        }


def _torchvision_names() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def _timm() -> Any | None:
    try:
        return importlib.import_module("timm")
    except ImportError:
        return None


def list_models(pattern: str = "*") -> dict[str, list[str]]:
    """Architecture names per source that match a glob (`resnet*`)."""
    import fnmatch

    found = {"torchvision": [n for n in _torchvision_names() if fnmatch.fnmatch(n, pattern)]}
    if builtin := [n for n in _BUILTIN if fnmatch.fnmatch(n, pattern)]:
        found["infermux"] = builtin
    timm = _timm()
    if timm is not None:
        found["timm"] = list(timm.list_models(pattern))
    from infermux import hf

    if hf_names := [f"hf:{n}" for n in hf.names() if fnmatch.fnmatch(n, pattern)
                    or fnmatch.fnmatch(f"hf:{n}", pattern)]:
        found["hf"] = hf_names
    return found


def _build_torchvision(name: str) -> Any:
    import torchvision

    return torchvision.models.get_model(name, weights=None)


def _build_timm(name: str) -> Any:
    timm = _timm()
    if timm is None:
        raise UsageError(f"model 'timm:{name}' needs timm: pip install 'infermux[timm]'")
    if name not in timm.list_models():
        close = difflib.get_close_matches(name, timm.list_models(), n=5)
        raise UsageError(f"timm has no model {name!r}; close names: {', '.join(close) or 'none'}")
    return timm.create_model(name, pretrained=False)


def _file_identity(path: Path, extra: str = "") -> str:
    """`resolved path:sha256 of the bytes[:extra]`: what a file source is, for cache keys."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"{path.resolve()}:{h.hexdigest()[:20]}" + (f":{extra}" if extra else "")


def _build_factory(ref: str) -> Any:
    """Import the factory's file (this executes it) and call the function it names."""
    path_text, _, func = ref.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"factory file {path_text!r} does not exist: write path/to/file.py:function")
    # One module name per file: two `m.py` in two folders are two modules, never one.
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(f"_infermux_factory_{path.stem}_{where}",
                                                         path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"cannot import {path_text!r} as Python: write path/to/file.py:function")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise RunError(f"importing factory file {path_text!r} failed: {exc}") from exc
    factory = getattr(module, func, None)
    if not callable(factory):
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise UsageError(f"{path_text!r} has no function {func!r}; it has: {', '.join(names)}")
    try:
        return factory()
    except Exception as exc:
        raise RunError(f"factory {ref!r} raised: {exc}") from exc


def _load_weights(module: Any, weights: str) -> str:
    """Load a state dict or a checkpoint holding one, with `weights_only` so no code runs."""
    import torch

    path = Path(weights)
    if not path.is_file():
        raise UsageError(f"weights file {weights!r} does not exist: pass --weights path/to/file.pt")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise UsageError(
                f"weights file {weights!r} is a safetensors file and the safetensors package is "
                "not installed: pip install safetensors, or convert the file to a torch.save state "
                "dict (.pt)"
            ) from None
    try:
        if path.suffix == ".safetensors":
            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UsageError(
            f"weights file {weights!r} is not a readable state dict or checkpoint ({exc}); "
            "save it with torch.save(model.state_dict(), path)"
        ) from exc
    if isinstance(state, dict):
        for key in _STATE_DICT_KEYS:
            inner = state.get(key)
            if isinstance(inner, dict) and inner and all(isinstance(k, str) for k in inner):
                state = inner
                break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UsageError(
            f"weights file {weights!r} holds no state dict of tensors; "
            "save it with torch.save(model.state_dict(), path)"
        )
    if all(k.startswith("module.") for k in state):  # saved from DataParallel/DDP
        state = {k[len("module."):]: v for k, v in state.items()}
    try:
        result = module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0:3]
        raise UsageError(
            f"weights file {weights!r} does not match the architecture: {' '.join(first)[:300]}; "
            "check the model name or pass weights saved from it"
        ) from exc
    del result
    return f"weights loaded from {path.name}"


def _default_shape(module: Any, source: str) -> tuple[int, ...] | None:
    shape = getattr(module, "input_shape", None)
    if shape:
        return tuple(int(s) for s in shape)
    cfg = getattr(module, "pretrained_cfg", None) or getattr(module, "default_cfg", None)
    if isinstance(cfg, dict) and cfg.get("input_size"):
        return tuple(int(s) for s in cfg["input_size"])
    if source == "torchvision":
        name = type(module).__name__.lower()
        return (3, 299, 299) if "inception" in name else (3, 224, 224)
    return None


def _onnx_shape(path: Path) -> tuple[tuple[int, ...] | None, str]:
    try:
        onnx = importlib.import_module("onnx")
    except ImportError:
        return None, "float32"
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:
        raise UsageError(f"ONNX file {str(path)!r} cannot be read: {exc}") from exc
    initialisers = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initialisers]
    if not inputs:
        return None, "float32"
    dims = inputs[0].type.tensor_type.shape.dim[1:]
    shape = tuple(d.dim_value for d in dims)
    elem = onnx.helper.tensor_dtype_to_np_dtype(inputs[0].type.tensor_type.elem_type).name
    return (shape if all(s > 0 for s in shape) else None), elem


def resolve_source(ref: str) -> tuple[str, str]:
    """(`source`, `name`) for a model reference; raises a UsageError naming close matches."""
    if ref.endswith(".onnx"):
        return "onnx", ref
    if ".py:" in ref:
        return "factory", ref
    if ref in _BUILTIN:
        return "builtin", ref
    for prefix in ("torchvision:", "timm:", "hf:"):
        if ref.startswith(prefix):
            return prefix[:-1], ref[len(prefix):]
    if ref in _torchvision_names():
        return "torchvision", ref
    timm = _timm()
    if timm is not None and ref in timm.list_models():
        return "timm", ref
    names = _torchvision_names() + (list(timm.list_models()) if timm is not None else [])
    close = difflib.get_close_matches(ref, names, n=5)
    hint = f"close names: {', '.join(close)}" if close else "run `infermux models` to list them"
    raise UsageError(
        f"unknown model {ref!r}: not a torchvision or timm architecture, an ONNX file or "
        f"file.py:function; {hint}"
    )


def load_model(spec: ModelSpec | str) -> LoadedModel:
    """Build the network on the CPU in eval mode, load its weights, and settle its input spec."""
    if isinstance(spec, str):
        spec = ModelSpec(ref=spec)
    source, name = resolve_source(spec.ref)
    if source == "onnx":
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"ONNX file {name!r} does not exist")
        from infermux.iospec import from_onnx

        io = from_onnx(path)
        if io is not None and not io.simple and spec.input_shape is None:
            return LoadedModel(spec, path.stem, "onnx", _first_shape(io), io.inputs[0].dtype,
                               "weights from the ONNX file", onnx_path=path,
                               identity=_file_identity(path), io=io)
        shape, dtype = _onnx_shape(path)
        shape = spec.input_shape or shape
        if shape is None:
            raise UsageError(
                f"cannot tell the input shape of {name!r}: pass --input-shape, e.g. 3x224x224"
            )
        if io is not None and len(io.inputs) > 1:
            raise UsageError(f"--input-shape sets one input; {name!r} has {len(io.inputs)} "
                             f"({', '.join(t.name for t in io.inputs)}): drop --input-shape")
        single = (IOSpec.single(shape, dtype, io.inputs[0].name, io.outputs) if io is not None
                  else None)
        return LoadedModel(spec, path.stem, "onnx", shape, dtype, "weights from the ONNX file",
                           onnx_path=path, identity=_file_identity(path), io=single)
    builders = {"torchvision": _build_torchvision, "timm": _build_timm, "factory": _build_factory,
                "hf": _build_hf}
    if source == "torchvision" and name not in _torchvision_names():
        close = difflib.get_close_matches(name, _torchvision_names(), n=5)
        raise UsageError(f"torchvision has no model {name!r}; close names: {', '.join(close)}")
    if source == "builtin":
        builtin = importlib.import_module(_BUILTIN[name])
        module = builtin.build()
        if not spec.weights:
            spec = replace(spec, weights=builtin.trained_weights())
    else:
        module = builders[source](name)
    import torch

    if not isinstance(module, torch.nn.Module):
        raise UsageError(f"{spec.ref!r} returned {type(module).__name__}, not a torch.nn.Module")
    note = "randomly initialised (no --weights): outputs are meaningless, timings are not"
    hf_weights = getattr(module, "weights_from", None) if source == "hf" else None
    if hf_weights:
        note = f"weights loaded from {hf_weights}"
        spec = replace(spec, weights=spec.weights or hf_weights)
    elif spec.weights:
        note = _load_weights(module.model if source == "hf" else module, spec.weights)
    module.eval()
    from infermux.iospec import from_module, module_outputs

    io = from_module(module)
    if io is not None and spec.input_shape is not None and not io.simple:
        raise UsageError(f"--input-shape sets one float input; {spec.ref!r} declares "
                         f"{', '.join(t.text() for t in io.inputs)}: drop --input-shape")
    if io is not None and spec.input_shape is None:
        io_shape = _first_shape(io)
        spec_dtype = io.inputs[0].dtype if io.simple else spec.dtype
        display = (Path(name.rpartition(":")[0]).stem + ":" + name.rpartition(":")[2]
                   if source == "factory" else name)
        ident = _file_identity(Path(name.rpartition(":")[0]), name.rpartition(":")[2]) if (
            source == "factory") else ""
        if source == "hf" and (Path(name) / "config.json").is_file():  # a local folder
            display, ident = Path(name).resolve().name, _file_identity(Path(name) / "config.json")
        return LoadedModel(spec, display, source, io_shape, spec_dtype, note, module=module,
                           info={"parameters": int(sum(p.numel() for p in module.parameters()))},
                           identity=ident, io=io)
    shape = spec.input_shape or _default_shape(module, source)
    if shape is None:
        raise UsageError(
            f"cannot tell the input shape of {spec.ref!r}: pass --input-shape, e.g. 3x224x224, "
            "or give the module an `input_shape` attribute"
        )
    display = Path(name.rpartition(":")[0]).stem + ":" + name.rpartition(":")[2] if (
        source == "factory") else name
    if source in ("torchvision", "timm") and not spec.weights:
        _settle_norms(module, tuple(shape))
    params = sum(p.numel() for p in module.parameters())
    identity = ""
    if source == "factory":
        path_text, _, func = name.rpartition(":")
        identity = _file_identity(Path(path_text), func)
    named = module_outputs(module)  # its outputs' names, kept beside a given input shape
    return LoadedModel(spec, display, source, shape, spec.dtype, note, module=module,
                       info={"parameters": int(params)}, identity=identity,
                       io=IOSpec.single(tuple(shape), spec.dtype, outputs=named) if named else None)


#: Seeded items whose batch statistics become a randomly initialised network's norm statistics.
_SETTLE_ITEMS = 4
#: A fresh network whose outputs stay below this in magnitude has shrunk its activations past
#: what fp16 holds (mobilenet_v3_small ~1e-9, efficientnet_b0 ~1e-13); ResNets, RegNets, VGG
#: and ConvNeXt give 0.2–80 and are left as they are.
_SETTLE_BELOW = 1e-2


def _settle_norms(module: Any, shape: tuple[int, ...]) -> None:
    """Give a randomly initialised network's batch norms the statistics of its own activations.

    A fresh torchvision network's batch norms hold mean 0 and variance 1 whatever their input
    is, so in some networks the activations shrink block by block (mobilenet_v3_small's logits
    are ~1e-9). That is below what fp16 can hold: an fp16 engine returns zeros and no agreement
    check can pass, though the engine is right. Where the outputs of a seeded batch are that
    small, one more pass in training mode (cumulative statistics) sets every norm to its input's
    real statistics, as training would, so activations stay near unit scale in every precision.
    Networks whose outputs are not that small are left alone (a ResNet50 so settled grows its
    residual stream and its fp16 error past the fp16 tolerance). Timings are unchanged: the
    same layers, the same shapes.
    """
    import torch

    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms or not shape or 0 in shape:
        return
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((_SETTLE_ITEMS, *shape), generator=generator)
    try:
        with torch.no_grad():
            leaves = [y for y in torch.utils._pytree.tree_flatten(module(x))[0]
                      if isinstance(y, torch.Tensor) and y.is_floating_point()]
    except (RuntimeError, ValueError):
        return  # the shape does not fit the network: the run says so where it builds
    if not leaves or max(float(y.abs().max()) for y in leaves) >= _SETTLE_BELOW:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: after one batch, exactly its statistics
    try:
        module.train()
        with torch.no_grad():
            module(x)
    except (RuntimeError, ValueError):  # as above; the norms keep their initial statistics
        for m in norms:
            m.reset_running_stats()
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
        module.eval()


def _build_hf(name: str) -> Any:
    from infermux import hf

    return hf.build(name)


def _first_shape(io: IOSpec) -> tuple[int, ...]:
    """The first input's item shape at the default dims (0 where a dim has no default)."""
    first = io.inputs[0]
    return tuple(d if isinstance(d, int) else int(io.default_dims.get(d, 0)) for d in first.shape)
