"""ONNX export: any model infermux can load becomes one ONNX file, cached by content hash.

The ONNX engines (ONNX Runtime, OpenVINO, TensorRT) all start from an ONNX file. A model given as
an ONNX file is used as is; a torch model is exported once per content (architecture source,
weights, input shape, opset, torch version) and kept under the cache folder, so a batch sweep, a
second engine or a second run reuses it.

Why the TorchScript exporter (`dynamo=False`): for the convolution networks this project measures
it is the exporter that needs nothing beyond torch (the dynamo exporter needs onnxscript), it has
handled torchvision and timm CNNs for years, and it names the unsupported operator when it fails.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infermux.cache import bound_after_write, touch
from infermux.errors import RunError, UsageError, first_line
from infermux.models import LoadedModel

__all__ = [
    "DEFAULT_OPSET",
    "OPSET_BY_RUNTIME",
    "ExportedModel",
    "cache_dir",
    "check_onnx_file",
    "content_hash",
    "export_onnx",
    "file_digest",
]

#: The opset exported for each target runtime. 17 is parsed by every release infermux supports
#: (TensorRT 8.6, the release on JetPack 5, stops at 17) and newer opsets add nothing the CNNs
#: measured here use; a runtime can move on alone by changing its entry. The cache key holds the
#: opset, not the runtime, so runtimes that share an opset share one export.
OPSET_BY_RUNTIME: dict[str, int] = {"onnxruntime": 17, "openvino": 17, "tensorrt": 17}
DEFAULT_OPSET = 17
#: Input and output names of exported graphs; the batch axis (0) of each is dynamic.
INPUT_NAME = "input"
_EXPORTER_MAX_OPSET = 20


@dataclass(frozen=True)
class ExportedModel:
    """An ONNX file ready for a runtime, and how it came to be."""

    path: Path
    digest: str  # sha256 of the file's bytes, short: part of every engine cache key
    opset: int | None  # None for a user's file (used as is)
    exported: bool  # False when the user gave the file or the cache had it
    export_s: float = 0.0


def cache_dir() -> Path:
    """The cache root: `$INFERMUX_CACHE_DIR`, else `~/.cache/infermux`."""
    root = os.environ.get("INFERMUX_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "infermux"


def file_digest(path: Path) -> str:
    """Short sha256 of a file's bytes (ONNX files are read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:20]


def content_hash(model: LoadedModel, opset: int) -> str:
    """What decides the exported graph: code of every module class, tensors, shape, opset.

    A traced module (a pipeline segment) adds its generated code.
    """
    import torch
    from torch import fx

    module = model.module
    h = hashlib.sha256()
    h.update(f"{torch.__version__}|{opset}|{model.input_shape}|{model.dtype}".encode())
    if not model.spec_io.simple:  # several inputs: their names, dtypes and dims decide the graph
        h.update(model.spec_io.key().encode())
    # A factory file's path and content: its classes' source is not importable by name, and two
    # factories with one file name must never share an export.
    h.update(model.identity.encode())
    if hasattr(module, "export_form"):  # transformers: attention written out (see _torch_export)
        h.update(b"|attention:plain")
    for cls in sorted({type(m) for m in module.modules()}, key=lambda c: c.__qualname__):
        h.update(f"{cls.__module__}.{cls.__qualname__}".encode())
        try:
            h.update(inspect.getsource(cls).encode())
        except (OSError, TypeError):  # classes built at run time have no source file
            h.update(repr(cls).encode())
    h.update(repr(module).encode())  # hyper-parameters that live in constructors
    for sub in module.modules():
        # A traced module's forward is its generated code, not its class's source: two
        # segments of one network share classes and may share weights, never code.
        if isinstance(sub, fx.GraphModule):
            h.update(sub.code.encode())
    for name, tensor in module.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def _failing_operator(exc: BaseException) -> str | None:
    """The operator the exporter names in its error (`aten::linalg_eigvals`), if it names one."""
    match = re.search(r"'((?:aten|prim|onnx|[a-z_]+)::[A-Za-z0-9_.]+)'", str(exc))
    return match.group(1) if match else None


def export_onnx(model: LoadedModel, runtime: str = "onnxruntime", opset: int | None = None,
                root: Path | None = None) -> ExportedModel:
    """The model as an ONNX file for `runtime`: the user's file, a cached export, or a new one.

    Exports go to a temporary file beside the cache entry and are renamed into place, so two
    processes exporting the same model at once both end with a complete file. A cached export
    is marked used (`cache.touch`); a new one may prune the cache to `INFERMUX_CACHE_MAX_SIZE`.
    """
    if model.onnx_path is not None:
        path = Path(model.onnx_path)
        check_onnx_file(path)
        return ExportedModel(path, file_digest(path), None, exported=False)
    if model.module is None:
        raise UsageError(f"model {model.name!r} has neither a torch module nor an ONNX file")
    opset = opset or OPSET_BY_RUNTIME.get(runtime, DEFAULT_OPSET)
    if not 7 <= opset <= _EXPORTER_MAX_OPSET:
        raise UsageError(f"opset {opset} unsupported: the exporter writes opsets 7 to "
                         f"{_EXPORTER_MAX_OPSET}; pass e.g. --option opset=17")
    base = root or cache_dir()
    folder = base / "onnx"
    key = content_hash(model, opset)
    path = folder / f"{_safe(model.name)}-{key}-op{opset}.onnx"
    if path.is_file() and path.stat().st_size > 0:
        touch(path)
        return ExportedModel(path, file_digest(path), opset, exported=False)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the ONNX cache folder {str(folder)!r} ({exc}); "
                         "set INFERMUX_CACHE_DIR to a writable folder") from exc
    started = time.perf_counter()
    with atomic_file(path) as tmp:
        _torch_export(model, tmp, opset)
    exported = ExportedModel(path, file_digest(path), opset, exported=True,
                             export_s=time.perf_counter() - started)
    bound_after_write(base, path)
    return exported


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` that becomes `path` when the block ends without error.

    Caches written this way are never seen half-written by another process.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through `atomic_file`."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def _torch_export(model: LoadedModel, path: Path, opset: int) -> None:
    import torch

    module = model.module
    io = model.spec_io
    if io.simple:
        examples: tuple[Any, ...] = (
            torch.zeros((1, *model.input_shape), dtype=getattr(torch, model.dtype)),)
        input_names = [INPUT_NAME]
    else:
        # Runnable example inputs (ids within the vocabulary, masks of ones); every dynamic dim
        # stays dynamic in the file under its own name.
        dims = io.dims_for(None) if all(d in io.default_dims for d in io.dynamic_dims) else {
            d: 8 for d in io.dynamic_dims}
        examples = tuple(torch.from_numpy(a) for a in io.generate(1, dims))
        input_names = [t.name for t in io.inputs]
    with torch.inference_mode():
        outputs = module(*examples)
    flat = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    output_names = [f"output{i}" if i else "output" for i in range(len(flat))]
    declared = [t.name for t in io.outputs]
    if len(declared) == len(flat) and not io.simple:
        output_names = declared
    dynamic: dict[str, Any] = {n: {0: "batch"} for n in (*input_names, *output_names)}
    if not io.simple:
        for spec in (*io.inputs, *io.outputs):
            if spec.name in dynamic:
                dynamic[spec.name].update({i + 1: d for i, d in enumerate(spec.shape)
                                           if isinstance(d, str)})
    # torch ≥ 2.5 has both exporters and (from 2.9) defaults to dynamo; older ones only this one.
    which: dict[str, Any] = (
        {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {})
    # A transformer exports its attention as matmul-softmax-matmul, the pattern ONNX Runtime's
    # transformer fusions recognise (`HFModule.export_form`).
    form = module.export_form() if hasattr(module, "export_form") else nullcontext()
    try:
        with warnings.catch_warnings(), form:
            warnings.simplefilter("ignore")  # the exporter's deprecation notice, not ours to fix
            torch.onnx.export(
                module, examples, str(path), opset_version=opset, input_names=input_names,
                output_names=output_names, dynamic_axes=dynamic, do_constant_folding=True,
                **which,
            )
    except Exception as exc:
        operator = _failing_operator(exc)
        first = first_line(exc, typed=False)
        where = f"operator {operator} is not exportable" if operator else first
        raise RunError(
            f"exporting {model.name} to ONNX (opset {opset}) failed: {where}"
            + (f" ({first})" if operator and operator not in first else "")
            + "; try another --option opset=N, or export the model yourself and pass the .onnx file"
        ) from exc


def check_onnx_file(path: Path) -> None:
    """Raise one clear UsageError if `path` is not a readable, well-formed ONNX model."""
    try:
        import onnx
    except ImportError:  # the runtime will read it and report
        return
    try:
        proto = onnx.load(str(path), load_external_data=False)
        onnx.checker.check_model(proto)
    except Exception as exc:  # onnx raises DecodeError, ValidationError, OSError…
        first = first_line(exc, typed=False)
        raise UsageError(
            f"ONNX file {str(path)!r} is not a valid ONNX model ({type(exc).__name__}: "
            f"{first[:200]}); re-export it or pass another file"
        ) from exc


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60]
