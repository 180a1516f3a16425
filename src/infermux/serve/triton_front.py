"""`infermux serve --front triton`: Triton's own C++ server as the fronts, infermux's runtime behind.

Python fronts cost 300-600 µs of CPU per request (docs/architecture-serve.md), most of it
grpc's and uvicorn's own per-call work. Triton's server parses HTTP and gRPC in C++, batches
in its dynamic batcher and hands each batch to a model instance of the plan's model. Each
instance links to the runtime process over a Unix socket, is given a slab of shared memory
like a front process (`serve/fronts.py`), writes each Triton batch's rows into it and sends
one descriptor; the runtime submits the rows where they lie and writes the outputs into the
same slots. The plan's dispatcher still decides the batches the workers run: Triton's batcher
only groups what has queued while an instance was busy, and, for the native backend, what comes
within a short queue delay (`QUEUE_DELAY_MS`), so that the runtime takes fewer descriptors.

Two backends make the instances (`--triton-backend`):
- `native` (serve/triton_backend.c, built here with the machine's C compiler and cached by
  its source's digest): the instance copies a batch's rows into free slots, sends its
  descriptor and returns at once; a thread of its own sends each request's response when the
  runtime answers. Many batches are in flight per instance, and no interpreter runs per
  request or per batch. Models of one FP32 or FP16 input, or of several (a sequence dim at
  each Triton batch's length); FP32, FP16, INT64, INT32 or BOOL outputs.
- `python`: a Python-backend stub per instance (`TritonPythonModel`), one Triton batch in
  flight each (every request queues behind a whole device round), for the models the native
  backend does not take. The stubs are built for numpy 1: under numpy 2 tensors cross by
  DLPack (their numpy conversions read numpy 1's array layout), at twice the cost;
  `--triton-python-path` can give them a numpy 1.
`auto` (the default) takes native wherever every model fits it and it builds, else python.

`TritonHub` is the runtime process's side: it writes the model repository (one model per
plan model: its tensors, `max_batch_size` its largest batch, `--fronts` instances, a queue
of its admission limit), starts `tritonserver` on the HTTP and gRPC ports, accepts the
instances' links and restarts the server if it dies. Triton answers the v2 protocol itself:
health, metadata, config, statistics (Triton's own, per client request), shared memory
(system; CUDA with the python backend), and 503-like UNAVAILABLE past the queue. infermux's
`/metrics` keeps its port and counts the runtime's view: each Triton batch is one request
there.

The server comes from a Triton install (`--triton-home`, `$INFERMUX_TRITON_HOME`,
/opt/tritonserver) or the `nvidia-pytriton` wheel's bundled build (installed with
`--no-deps`: infermux never imports pytriton, whose pins would downgrade numpy); the native
backend needs only its `bin/tritonserver` and the libraries beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib.util
import json
import math
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from infermux.errors import UsageError
from infermux.export import cache_dir
from infermux.serve.core import DATATYPES
from infermux.serve.fronts import FrontHub, _Generation, _layout
from infermux.serve.proxy import DTYPE_CODES, REQUEST, FrameReader, Kind, Link, frame
from infermux.serve.shm import Segment

__all__ = ["BACKENDS", "TRITON_MALLOC", "TRITON_MALLOC_ENV", "TritonHub", "TritonInstall",
           "TritonPythonModel", "build_native_backend", "find_triton", "model_config",
           "native_init", "restricted", "why_not_native"]

#: Where a Triton install is looked for when `--triton-home` is not given.
TRITON_HOME_ENV = "INFERMUX_TRITON_HOME"
_DEFAULT_HOMES = ("/opt/tritonserver",)
#: How the `nvidia-pytriton` wheel (its server and backends only) is installed without its pins.
_HOW = "pip install --no-deps nvidia-pytriton==0.7.0 (Linux x86-64, glibc 2.35 or newer)"
#: How long `tritonserver` may take to load every model before `serve` gives up.
_START_TIMEOUT_S = 180.0
#: glibc's allocator settings `tritonserver` runs with when `$INFERMUX_TRITON_MALLOC` is `heap`
#: (and the environment sets none of its own): every request's tensor (hundreds of KB in the
#: request) comes from the heap and goes back to it, instead of a fresh mapping per request whose
#: pages fault in and are returned (glibc maps blocks over its adaptive threshold, and trims the
#: heap's top past 128 KB); the heap keeps up to 256 MiB free before it trims. On the 2-core
#: machine it cut Triton's CPU per 602 KB request to 0.83x, but its p99 was higher in each of
#: four alternated pairs (bench/serve_triton_malloc.py, docs/benchmarks.md): not the default.
TRITON_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
TRITON_MALLOC_ENV = "INFERMUX_TRITON_MALLOC"
#: Whether this process runs numpy 1 (the ABI Triton's Python-backend stubs are built for).
_NUMPY1 = int(np.__version__.split(".")[0]) < 2
#: The Triton backends a plan model can be served through: `native`, infermux's own C backend
#: (serve/triton_backend.c, built here with the machine's C compiler), or `python`, the Python
#: backend's stubs; `auto` takes native wherever every model fits it and it builds.
BACKENDS = ("auto", "native", "python")
#: How long Triton's batcher holds a request for others to join its batch, by backend, unless
#: `--triton-queue-delay` says (ms). A native instance's execute copies rows and returns at once,
#: so with no delay Triton handed it 1.9 requests a batch at 19k BERT requests/s, and each
#: batch is a descriptor the runtime process handles under its interpreter lock; 0.3 ms made
#: them 14.7 a batch and served 1.13-1.31x the requests/s on an H200 host, alternated
#: (docs/benchmarks.md, "Triton's queue delay"). A Python stub holds its batch until the runtime
#: answers, so requests gather meanwhile without one.
QUEUE_DELAY_MS = {"native": 0.3, "python": 0.0}
_BACKEND_SOURCE = Path(__file__).with_name("triton_backend.c")
_NATIVE_TYPES = ("FP32", "FP16")  # of a single input
#: Of every output: floats are FP32 in the slab (FP16 made by the backend), the others as are.
_NATIVE_OUTPUT_TYPES = ("FP32", "FP16", "INT64", "INT32", "BOOL")
_TYPES = {"FP32": "TYPE_FP32", "FP16": "TYPE_FP16", "FP64": "TYPE_FP64", "INT64": "TYPE_INT64",
          "INT32": "TYPE_INT32", "BOOL": "TYPE_BOOL"}


@dataclass(frozen=True)
class TritonInstall:
    """A Triton server build: its binary, its Python backend and the stub for this Python.

    The last two are None, with `python_problem` saying why, where the build has none: the
    native backend needs neither.
    """

    home: Path
    binary: Path
    python_backend: Path | None
    stub: Path | None
    python_problem: str | None = None


def _stub_for(home: Path, backend: Path) -> Path | None:
    """The `triton_python_backend_stub` built for this interpreter's Python, if any."""
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    for path in (home / "python_backend_stubs" / ver / "triton_python_backend_stub",
                 backend / "triton_python_backend_stub"):
        if path.is_file():
            return path
    return None


def find_triton(home: str | None = None) -> TritonInstall:
    """The Triton build at `home`, else `$INFERMUX_TRITON_HOME`, /opt/tritonserver, pytriton's.

    One clear line when none is found. A build without a Python backend or a stub for this
    Python is returned with `python_problem` set: the native backend serves without them.
    """
    candidates: list[tuple[str, Path]] = []
    if home:
        candidates.append(("--triton-home", Path(home)))
    elif os.environ.get(TRITON_HOME_ENV):
        candidates.append((f"${TRITON_HOME_ENV}", Path(os.environ[TRITON_HOME_ENV])))
    else:
        candidates += [("default", Path(h)) for h in _DEFAULT_HOMES]
        spec = importlib.util.find_spec("pytriton")  # located, not imported
        if spec is not None and spec.submodule_search_locations:
            candidates.append(("nvidia-pytriton",
                               Path(next(iter(spec.submodule_search_locations))) / "tritonserver"))
    tried = []
    for source, path in candidates:
        binary = path / "bin" / "tritonserver"
        backend = path / "backends" / "python"
        if not binary.is_file():
            tried.append(f"{path} ({source}: no bin/tritonserver)")
            if source == "--triton-home" or source.startswith("$"):
                break
            continue
        if not (backend / "libtriton_python.so").is_file():
            return TritonInstall(path, binary, None, None, python_problem=(
                f"--front triton: {path} has no Python backend (backends/python/"
                f"libtriton_python.so): use --triton-backend native, a Triton build with it, "
                f"or {_HOW}"))
        stub = _stub_for(path, backend)
        if stub is None:
            return TritonInstall(path, binary, backend, None, python_problem=(
                f"--front triton: {path} has no triton_python_backend_stub for Python "
                f"{sys.version_info.major}.{sys.version_info.minor}: use --triton-backend "
                "native, or run infermux under a Python the build has a stub for"))
        return TritonInstall(path, binary, backend, stub)
    raise UsageError("--front triton: no Triton server found (tried "
                     f"{', '.join(tried) or 'nothing'}): {_HOW}, or pass --triton-home DIR "
                     "(a directory with bin/tritonserver)")


def model_config(info: Any, instances: int, link_path: str,
                 answer_timeout_s: float = 120.0, backend: str = "python",
                 queue_delay_ms: float = 0.0) -> str:
    """A plan model's `config.pbtxt`: its tensors, its largest batch, `instances` instances.

    Triton's batcher takes what has queued while every instance was busy, and waits up to
    `queue_delay_ms` for more (`QUEUE_DELAY_MS`: a native instance's batch is one descriptor
    for the runtime process; the plan's own queue delay is the runtime dispatcher's), up to the
    model's largest batch; past its admission limit a request is refused at once (UNAVAILABLE).
    """
    def tensor(spec: Any, datatype: str | None = None) -> str:
        dims = ", ".join(str(d) for d in spec.shape) or "1"
        extra = "" if spec.shape else " reshape: { shape: [ ] }"
        return (f'{{ name: "{spec.name}" data_type: {_TYPES[datatype or spec.datatype]} '
                f"dims: [ {dims} ]{extra} }}")

    for spec in [*info.inputs, *info.outputs]:
        if spec.datatype not in _TYPES:
            raise UsageError(f"--front triton: tensor {spec.name!r} of model {info.name!r} is "
                             f"{spec.datatype}, which the Triton front does not pass: serve it "
                             "with --front own")
    inputs = ",\n  ".join(tensor(s) for s in info.inputs)
    # An output whose spec names no shape (a factory's `outputs = ["scores"]`) takes the rank
    # its probe gave, every dim free: Triton checks the instances' tensors against it.
    room = list(getattr(info, "output_room", ()) or ())
    outputs = ",\n  ".join(
        tensor(replace(s, shape=(-1,) * len(room[i])) if i < len(room)
               and len(room[i]) != len(s.shape) else s) for i, s in enumerate(info.outputs))
    return f"""name: "{info.name}"
backend: "{'infermux' if backend == 'native' else 'python'}"
max_batch_size: {info.max_batch_size}
input [
  {inputs}
]
output [
  {outputs}
]
dynamic_batching {{
  max_queue_delay_microseconds: {round(queue_delay_ms * 1000)}
  default_queue_policy {{ max_queue_size: {info.max_queue_items} }}
}}
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
parameters: {{ key: "infermux_link" value: {{ string_value: "{link_path}" }} }}
parameters: {{ key: "infermux_answer_timeout_s" value: {{ string_value: "{answer_timeout_s:g}" }} }}
"""


#: What `--api-key` guards behind Triton's front: all but the health probes (as the own
#: fronts: liveness and readiness stay open).
_GUARDED = "metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging"


def trace_args(settings: Any) -> list[str]:
    """Triton's trace options for `--trace-requests N`: every Nth request's timestamps.

    Triton stamps each traced request's stages (received, queued, the backend's execute,
    response sent) with its steady clock, CLOCK_MONOTONIC on Linux as the runtime's stamps,
    and writes them to `<trace file>.triton` when it stops (`serve.trace.summarize` reads it).
    """
    if not settings.trace_requests:
        return []
    from infermux.serve.trace import TRITON_SUFFIX

    return ["--trace-config", "level=TIMESTAMPS",
            "--trace-config", f"rate={settings.trace_requests}",
            "--trace-config", "count=-1",
            "--trace-config", f"triton,file={os.path.abspath(settings.trace_path)}.{TRITON_SUFFIX}"]


def restricted(api_key: str | None) -> list[str]:
    """Triton's options that ask for the key on every API but health (`--api-key`).

    Triton compares one header's value exactly: behind its front the key goes in HTTP's
    `x-api-key` header and gRPC's `triton-grpc-protocol-x-api-key` metadata (Triton's prefix;
    the own fronts take both, and `Authorization: Bearer KEY`). A request without it is
    refused (HTTP 403, gRPC UNAVAILABLE) naming the header. The key is on `tritonserver`'s
    command line, where this machine's users can read it (Triton takes it no other way).
    """
    if api_key is None:
        return []
    return [f"--http-restricted-api={_GUARDED}:x-api-key={api_key}",
            f"--grpc-restricted-protocol={_GUARDED}:x-api-key={api_key}"]


def _triton_error(pb: Any, status: int, message: str) -> Any:
    """The runtime's refusal as a Python-backend error with Triton's code for its status.

    A 400 is INVALID_ARG (as the native backend answers it), a 503 UNAVAILABLE, where the
    stub's `TritonError` takes a code.
    """
    codes = {400: "INVALID_ARG", 503: "UNAVAILABLE"}
    code = getattr(pb.TritonError, codes.get(status, "INTERNAL"), None)
    if code is None:  # a stub too old for codes: Triton answers it as INTERNAL
        return pb.TritonError(f"{message} (status {status})")
    return pb.TritonError(message, code)


def why_not_native(info: Any, layout: Any) -> str | None:
    """Why a plan model cannot be served through the native backend; None where it can.

    The backend copies each input's bytes as they come (any datatype Triton is given here;
    one FP32 or FP16 input, or several by the slab's `several` layout, a sequence dim at the
    request's length) and answers outputs from the slab's rows (floats FP32, answered as FP32
    or FP16; INT64, INT32 and BOOL as they are), at fixed shapes or at those the runtime sends
    back (SHAPED).
    """
    for spec in info.outputs:
        if spec.datatype not in _NATIVE_OUTPUT_TYPES:
            return (f"output {spec.name!r} of model {info.name!r} is {spec.datatype} (the native "
                    f"backend answers {', '.join(_NATIVE_OUTPUT_TYPES)})")
    if not layout.several:
        if len(info.inputs) != 1 or info.inputs[0].datatype not in _NATIVE_TYPES:
            return (f"model {info.name!r}'s input is {info.inputs[0].datatype} (one FP32 or FP16 "
                    "input, or several)")
        if len(layout.output_shapes) != len(info.outputs):
            return f"model {info.name!r}'s outputs have no fixed shapes"
    elif len(layout.several) != len(info.inputs):
        return f"model {info.name!r}'s inputs do not match its slab's layout"
    return None


def native_init(index: int, info: Any, layout: Any, slab: str, slots: int) -> bytes:
    """INIT for a native instance: its model's slab and layout as lines the C side reads.

    `index`: the model's among the served; `slab`: the slab's shared-memory name; `slots`: its
    slots. An output line is its name, datatype, rank and item shape (floats FP32 in the slab,
    integers and bools their own size; for a
    model of several inputs, the room at the longest length). A model of several inputs adds
    `several 1`, its longest length, whether its outputs are fixed, and an input line each:
    name, bytes per element, rank and item shape (-1 for the sequence dim).
    """
    spec = info.inputs[0]
    lines = [f"index {index}", f"slab {slab}", f"slots {slots}",
             f"code {1 if spec.datatype == 'FP16' else 0}",
             f"input_item_bytes {layout.input_item_bytes}"]
    if layout.several:
        lines += ["several 1", f"max_length {layout.max_length}",
                  f"fixed_outputs {int(bool(layout.fixed_outputs))}"]
        for tensor, (shape, dtype) in zip(info.inputs, layout.several, strict=True):
            lines.append(f"input {tensor.name} {np.dtype(dtype).itemsize} {len(shape)} "
                         + " ".join(str(d) for d in shape))
    else:
        itemsize = 2 if spec.datatype == "FP16" else 4
        lines.append(f"row_bytes {math.prod(layout.input_shape) * itemsize}")
    for out, shape in zip(info.outputs, layout.output_shapes, strict=True):
        lines.append(f"output {out.name} {out.datatype} {len(shape)} "
                     + " ".join(str(d) for d in shape))
    return ("\n".join(lines) + "\n").encode()


def build_native_backend(folder: Path | None = None) -> Path:
    """The native Triton backend (serve/triton_backend.c), built for this machine.

    Built once per source (its digest names the library) into `folder` (default: the cache's
    `triton/`) with `$CC`, `cc` or `gcc`; one line naming the compiler's first error, or how to
    get one, where it cannot be built.
    """
    source = _BACKEND_SOURCE.read_bytes()
    folder = folder or cache_dir() / "triton"
    lib = folder / f"libtriton_infermux-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if lib.is_file():
        return lib
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise UsageError("--front triton: no C compiler (cc) to build infermux's Triton backend: "
                         "install one (e.g. apt-get install gcc), or pass --triton-backend python")
    folder.mkdir(parents=True, exist_ok=True)
    partial = lib.with_name(f"{lib.name}.{os.getpid()}.part")
    proc = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial),
                           str(_BACKEND_SOURCE), "-lpthread"], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        first = next((ln for ln in proc.stderr.splitlines() if "error" in ln),
                     proc.stderr[:200]).strip() or f"exit code {proc.returncode}"
        raise UsageError(f"--front triton: infermux's Triton backend did not build with "
                         f"{compiler} ({first}): pass --triton-backend python")
    os.replace(partial, lib)
    return lib


_MODEL_PY = '''"""A plan model served through Triton: each batch goes to the infermux runtime."""
import sys

# The runtime process's import path (after --triton-python-path's folders): Triton's stub
# embeds Python and may not see PYTHONPATH.
sys.path[:0] = [p for p in {path!r} if p not in sys.path]
from infermux.serve.triton_front import TritonPythonModel  # noqa: E402,F401
'''


class TritonHub(FrontHub):
    """The runtime process's side of `--front triton`; see the module docstring.

    A `FrontHub` whose fronts are Triton's model instances: they connect (HELLO, naming their
    model) instead of being started, each gets its slabs and its requests are submitted and
    answered exactly as a front process's.
    """

    def __init__(self, core: Any, settings: Any, count: int, http_sock: socket.socket,
                 install: TritonInstall) -> None:
        self.backend, self.native_lib, self.backend_note = self._choose_backend(
            core, settings, count, install)
        #: Triton's queue delay for the plan's models (`QUEUE_DELAY_MS`, `--triton-queue-delay`).
        given = getattr(settings, "triton_queue_delay_ms", None)
        self.queue_delay_ms = QUEUE_DELAY_MS[self.backend] if given is None else float(given)
        super().__init__(core, settings, count, http_sock)
        self.install = install
        #: Folders first on the model instances' import path (`--triton-python-path`).
        self.python_path = [os.path.abspath(p) for p in
                            (settings.triton_python_path or "").split(os.pathsep) if p]
        self.process: asyncio.subprocess.Process | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="infermux-triton-"))
        self.link_path = str(self._dir / "link")
        self._listener: asyncio.AbstractServer | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._log = self._dir / "tritonserver.log"
        # Triton binds the ports itself: the reservations go just before it starts.
        self._ports_held = [http_sock, self._grpc_reservation]

    @staticmethod
    def _choose_backend(core: Any, settings: Any, count: int, install: TritonInstall
                        ) -> tuple[str, Path | None, str | None]:
        """`native` or `python`, the native library, and why `auto` fell back (or None)."""
        wanted = getattr(settings, "triton_backend", "auto") or "auto"
        why = None if wanted == "python" else next(
            (w for w in (why_not_native(m, _layout(m, count)) for m in core.models.values())
             if w), None)
        if why is not None and wanted == "native":
            raise UsageError(f"--triton-backend native: {why}: use --triton-backend python")
        if wanted != "python" and why is None:
            try:
                return "native", build_native_backend(), None
            except UsageError as exc:
                if wanted == "native" or install.python_problem:
                    raise
                why = str(exc)
        if install.python_problem:
            raise UsageError(f"{install.python_problem}" + (f" ({why})" if why else ""))
        return "python", None, why

    def _slab_slots(self) -> list[int]:
        """Slots per model per instance.

        A native instance holds many batches in flight: a front's slots (the admission limit).
        A Python stub holds one Triton batch: its largest batch is all a slab holds.
        """
        if self.backend == "native":
            return super()._slab_slots()
        return [m.max_batch_size for m in self.models]

    # -- starting ---------------------------------------------------------------------------------

    def _repository(self) -> Path:
        repo = self._dir / "models"
        for info in self.models:
            version = repo / info.name / "1"
            version.mkdir(parents=True, exist_ok=True)
            (repo / info.name / "config.pbtxt").write_text(
                model_config(info, self.count, self.link_path,
                             answer_timeout_s=self.settings.drain_timeout_s + 90,
                             backend=self.backend, queue_delay_ms=self.queue_delay_ms))
            if self.backend == "native":
                continue
            (version / "model.py").write_text(
                _MODEL_PY.format(path=[*self.python_path,
                                       *(p for p in sys.path if p and os.path.isdir(p))]))
        if self.backend == "native":  # Triton finds backends/<name>/libtriton_<name>.so
            native = self._dir / "backends" / "infermux"
            native.mkdir(parents=True, exist_ok=True)
            assert self.native_lib is not None
            (native / "libtriton_infermux.so").symlink_to(self.native_lib)
            return repo
        # The backend directory Triton is given: the install's Python backend, with the stub
        # built for this interpreter's Python beside it (where the backend looks for it).
        backend = self._dir / "backends" / "python"
        backend.mkdir(parents=True, exist_ok=True)
        assert self.install.python_backend is not None and self.install.stub is not None
        for item in self.install.python_backend.iterdir():
            if item.name != "triton_python_backend_stub":
                (backend / item.name).symlink_to(item)
        (backend / "triton_python_backend_stub").symlink_to(self.install.stub)
        return repo

    async def start(self) -> None:
        """Write the repository, listen for the instances, start Triton, wait until all load."""
        repo = self._repository()
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_unix_server(self._attach_protocol, self.link_path)
        for sock in self._ports_held:
            sock.close()
        await self._launch(repo)
        wanted = self.count * len(self.models)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while sum(g.ready.is_set() for g in self.fronts) < wanted:
            if self.process is not None and self.process.returncode is not None:
                raise UsageError(f"--front triton: tritonserver exited ({self.process.returncode})"
                                 f" while loading the models: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise UsageError(f"--front triton: {wanted} model instances did not start within "
                                 f"{_START_TIMEOUT_S:.0f} s: {self._log_tail()}")
            await asyncio.sleep(0.05)
        self._watcher = asyncio.create_task(self._watch_server(repo))
        self.http_task = asyncio.create_task(self._stopped.wait())

    async def _launch(self, repo: Path) -> None:
        """Start `tritonserver` on the repository, the ports and the settings."""
        s = self.settings
        env = dict(os.environ)
        # The stub embeds Python: it finds this environment (a venv's site-packages) from the
        # first `python3` on PATH, and infermux from PYTHONPATH.
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
        if env.get(TRITON_MALLOC_ENV) == "heap" and not any(k.startswith("MALLOC_") for k in env):
            env.update(TRITON_MALLOC)
        args = [str(self.install.binary), f"--model-repository={repo}",
                f"--backend-directory={self._dir / 'backends'}",
                f"--http-address={s.host}", f"--http-port={self.http_port}",
                f"--grpc-address={s.host}", f"--grpc-port={self.grpc_port}",
                "--allow-metrics=false", "--strict-readiness=true",
                f"--exit-timeout-secs={max(1, int(s.drain_timeout_s))}", "--log-verbose=0",
                *restricted(s.api_key), *trace_args(s)]
        log = open(self._log, "ab")  # noqa: SIM115 - the server's output, for its errors
        try:
            self.process = await asyncio.create_subprocess_exec(
                *args, env=env, stdout=log, stderr=log, start_new_session=True)
        finally:
            log.close()

    def _log_tail(self, lines: int = 6) -> str:
        with contextlib.suppress(OSError):
            text = self._log.read_text(errors="replace").splitlines()
            errors = [ln for ln in text if ln[:1] == "E" or "error" in ln.lower()]
            return " | ".join((errors or text)[-lines:]) or "(no output)"
        return "(no output)"

    async def _watch_server(self, repo: Path) -> None:
        """Restart `tritonserver` when it ends, unless the server is stopping."""
        while True:
            assert self.process is not None
            await self.process.wait()
            if self._closing:
                return
            self.restarts += 1
            await asyncio.sleep(min(5.0, 0.5 * self.restarts))
            if self._closing:
                return
            await self._launch(repo)

    def _attach_protocol(self) -> Link:
        """A Link for a connecting instance: its first frame (HELLO) says which model it is."""
        holder: dict[str, Any] = {}

        def on_frame(kind: int, payload: bytes) -> None:
            gen = holder.get("gen")
            if gen is None:
                if kind != Kind.HELLO:
                    link.transport.close()  # type: ignore[union-attr]
                    return
                holder["gen"] = self._attach(link, json.loads(payload))
            else:
                self._on_frame(gen, kind, payload)

        def on_lost() -> None:
            gen = holder.get("gen")
            if gen is not None:
                gen.link = None
                if gen in self.fronts:
                    self.fronts.remove(gen)
                    self._retire(gen)

        link = Link(on_frame, on_lost)
        return link

    def _attach(self, link: Link, hello: dict[str, Any]) -> _Generation:
        slot = len(self.fronts) + len(self.retired)
        segments = [Segment.new(f"infermux-triton{slot}-{m.name}", n * lay.slot_bytes)
                    for m, n, lay in zip(self.models, self.slots, self.layouts, strict=True)]
        gen = _Generation(slot, segments)
        gen.pid = int(hello.get("pid", 0))
        gen.link = link
        gen.sink = self.core.batch_sink(functools.partial(self._answered, gen))
        if hello.get("init") == "text":  # a native instance: its model's slab alone
            try:
                index = [m.name for m in self.models].index(hello.get("model"))
            except ValueError:
                link.send(Kind.INIT, f"error no model {hello.get('model')!r}\n".encode(), now=True)
            else:
                link.send(Kind.INIT, native_init(index, self.models[index], self.layouts[index],
                                                 segments[index].name, self.slots[index]),
                          now=True)
        else:
            init = {"models": self.models,
                    "slabs": [(s.name, n) for s, n in zip(segments, self.slots, strict=True)],
                    "layouts": self.layouts, "slot": slot}
            link.send(Kind.INIT, pickle.dumps(init), now=True)
        self.fronts.append(gen)
        return gen

    async def _push_state(self) -> None:
        """Triton answers readiness and statistics itself: nothing to push."""

    # -- stopping ---------------------------------------------------------------------------------

    def _drain(self) -> None:
        """SIGTERM to Triton: it finishes what it admitted, then exits."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    async def stop(self, grace_s: float | None) -> None:
        """Let Triton answer what it admitted (at most `grace_s`), then end it; free the slabs."""
        self.should_exit = True
        if self.process is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.process.wait(), (grace_s or 0) + 5)
            if self.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                await self.process.wait()
        if self._watcher is not None:
            self._watcher.cancel()
        if self._listener is not None:
            self._listener.close()
        self._stopped.set()
        if grace_s == 0:
            self.close()

    def close(self) -> None:
        """Unlink and unmap every slab; remove the repository."""
        super().close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def summary(self) -> dict[str, Any]:
        """For the ready line and the stored run."""
        return {"fronts": self.count, "front": "triton", "triton_backend": self.backend,
                "triton_queue_delay_ms": self.queue_delay_ms,
                **({"triton_backend_note": self.backend_note} if self.backend_note else {}),
                "front_restarts": self.restarts,
                "front_pids": [self.process.pid] if self.process is not None else [],
                "front_slab_items": {m.name: n for m, n in zip(self.models, self.slots,
                                                                strict=True)}}


# -- the model instance's side (in Triton's Python backend stub) ----------------------------------

class TritonPythonModel:
    """A plan model as a Triton Python-backend model: each batch forwarded to the runtime."""

    def initialize(self, args: dict[str, Any]) -> None:  # noqa: D102 - Triton's interface
        import triton_python_backend_utils as pb

        self._pb = pb
        config = json.loads(args["model_config"])
        self._name = config["name"]
        self._path = config["parameters"]["infermux_link"]["string_value"]
        self._answer_timeout_s = float(
            config["parameters"].get("infermux_answer_timeout_s", {}).get("string_value", 120))
        self._sock: socket.socket | None = None
        self._segment: Segment | None = None
        self._ids = 0
        self._connect()

    def _connect(self) -> None:
        """Link to the runtime process: HELLO, its INIT (this model's slab), READY."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(self._path)
        self._sock.settimeout(self._answer_timeout_s)
        self._sock.sendall(frame(Kind.HELLO, json.dumps({"model": self._name,
                                                         "pid": os.getpid()}).encode()))
        self._reader = FrameReader()
        self._frames: list[tuple[int, bytes]] = []
        kind, payload = self._next()
        if kind != Kind.INIT:
            raise RuntimeError(f"expected INIT from the infermux runtime, got frame {kind}")
        init = pickle.loads(payload)  # the runtime process's own frame
        names = [m.name for m in init["models"]]
        self._index = names.index(self._name)
        self.info = init["models"][self._index]
        self._layout = init["layouts"][self._index]
        slab_name, self._slots = init["slabs"][self._index]
        self._segment = Segment(slab_name, 0, create=False)
        self._code = 1 if self.info.inputs[0].datatype == "FP16" else 0
        self._out_types = [DATATYPES.get(o.datatype, np.dtype("<f4")) for o in self.info.outputs]
        self._sock.sendall(frame(Kind.READY, json.dumps({"pid": os.getpid()}).encode()))

    def _drop_link(self) -> None:
        """Give up this link (its slab may still be written by a late answer): a new one next."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        if self._segment is not None:
            self._segment.close()
        self._sock = self._segment = None

    def _next(self) -> tuple[int, bytes]:
        assert self._sock is not None
        while not self._frames:
            data = self._sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the infermux runtime process closed the link")
            self._frames = self._reader.feed(data)
        return self._frames.pop(0)

    def execute(self, requests: list[Any]) -> list[Any]:  # noqa: D102 - Triton's interface
        pb = self._pb
        try:
            if self._sock is None:
                self._connect()
            return self._execute(requests)
        except (OSError, ConnectionError) as exc:  # timed out, or the runtime went away
            self._drop_link()
            error = pb.TritonError(f"the infermux runtime did not answer: {exc}")
            return [pb.InferenceResponse(error=error) for _ in requests]

    def _execute(self, requests: list[Any]) -> list[Any]:
        pb = self._pb
        info, layout = self.info, self._layout
        # Under numpy 2, DLPack both ways, not the backend's numpy conversions: its stubs are
        # built against numpy 1, whose array descriptor numpy 2 laid out anew (an input read
        # through it was wrong, an output had no bytes); DLPack's structures are the same for
        # both, but cost more per tensor (`--triton-python-path` gives the stubs a numpy 1).
        if _NUMPY1:
            arrays = [[pb.get_input_tensor_by_name(r, t.name).as_numpy() for t in info.inputs]
                      for r in requests]
        else:
            arrays = [[np.from_dlpack(pb.get_input_tensor_by_name(r, t.name))
                       for t in info.inputs] for r in requests]
        tensor = pb.Tensor if _NUMPY1 else pb.Tensor.from_dlpack
        sizes = [len(a[0]) for a in arrays]
        n = sum(sizes)
        if n > self._slots:  # Triton keeps a batch within max_batch_size: not expected
            return [pb.InferenceResponse(error=pb.TritonError(
                f"a batch of {n} items exceeds the model's largest batch {self._slots}"))
                for _ in requests]
        length = info.length_of(arrays[0]) if layout.several else None
        assert self._sock is not None and self._segment is not None
        buf = self._segment.map
        if layout.several:
            views = layout.several_inputs(buf, 0, n, length)
        else:
            views = [layout.inputs(buf, 0, n, DTYPE_CODES[self._code])]
        at = 0
        for request_arrays, k in zip(arrays, sizes, strict=True):
            for view, a in zip(views, request_arrays, strict=True):
                view[at:at + k] = a
            at += k
        self._ids += 1
        rid = self._ids
        self._sock.sendall(frame(Kind.INFER, REQUEST.pack(rid, self._index, self._code, 0, n,
                                                          length or 0, len(requests))))
        shapes = None
        while True:
            kind, payload = self._next()
            if kind == Kind.DONE and rid in {int.from_bytes(payload[i:i + 8], "little")
                                             for i in range(0, len(payload), 8)}:
                break
            if kind == Kind.SHAPED:
                answered = {r: s for r, s in json.loads(payload)}
                if rid in answered:
                    shapes = [tuple(s) for s in answered[rid]]
                    break
            if kind == Kind.ERROR:
                for r, status, message, _ in json.loads(payload):
                    if r == rid:
                        error = _triton_error(pb, status, message)
                        return [pb.InferenceResponse(error=error) for _ in requests]
        outputs = layout.outputs(buf, 0, n, shapes)
        responses = []
        at = 0
        for request, k in zip(requests, sizes, strict=True):
            # Only the outputs the client asked for (none named: all of them), so a client of
            # BERT's pooled output is not sent, nor made, its hidden states.
            wanted = set(request.requested_output_names() or ())
            tensors = [tensor(spec.name, np.array(y[at:at + k], dtype=dtype))
                       for spec, y, dtype in zip(info.outputs, outputs, self._out_types,
                                                 strict=True)
                       if not wanted or spec.name in wanted]
            responses.append(pb.InferenceResponse(output_tensors=tensors))
            at += k
        return responses

    def finalize(self) -> None:  # noqa: D102 - Triton's interface
        self._drop_link()
