"""The PyTorch engine: eager, channels_last, the unit's precision, CUDA graphs, torch.compile.

Why CUDA graphs by default on GPUs: Python's per-batch launch overhead dominates small batches
(ResNet50 fp16 batch 1 went from 283 to 1,098 images/s on an H200 with one captured graph), so a
GPU runner replays one graph per batch instead of launching every kernel from Python.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from infermux.engines.base import (
    BatchTiming,
    Engine,
    Runner,
    host_output,
    is_out_of_memory,
    parse_options,
    register_engine,
)
from infermux.errors import DeviceOutOfMemoryError, RunError, UsageError, first_line
from infermux.iospec import TensorSpec
from infermux.models import LoadedModel
from infermux.units import Unit

__all__ = ["TorchEngine", "TorchOptions", "TorchRunner"]

CompileMode = Literal[
    "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
]
#: Gathers of at least this many bytes per thread are split over threads (up to _GATHER_THREADS).
_GATHER_BYTES_PER_THREAD = 8 << 20
_GATHER_THREADS = 4
#: Served rows larger than this are copied row by row, not taken by slot: measured on the
#: 2-core machine, 32 rows of 602 KB took 3.4-9 ms row by row, 7.6-8.3 ms taken from one slab
#: and 13-17 ms taken per slab and placed; 128 rows of 4 KB 0.34 ms, 0.12 ms and 0.14 ms.
_SLAB_ROW_BYTES = 64 << 10
#: `INFERMUX_SERVED_ROWS=staged` copies served rows through the pinned staging buffer even
#: where they could go to the device straight from their slabs (`_direct_rows`): the path
#: to compare against, and a way around a host that refuses to lock shared memory.
_DIRECT_ROWS = os.environ.get("INFERMUX_SERVED_ROWS", "dma") != "staged"
_DTYPES = {"fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: Compile modes that capture CUDA graphs themselves (torch's CUDA graph trees), and the mode
#: each is compiled as instead: the same kernels, replayed in the runner's own CUDA graph. A
#: tree captured in one Python thread could not be replayed from another before torch 2.13
#: (pytorch/pytorch#123177: an AssertionError in every runtime worker under torch 2.11, while
#: in-process trials passed); a runner's own graph replays from any thread, and measured the
#: same (ResNet50 fp16 b64 on an H100: 19,430 images/s as `default` under our graph, 19,351
#: under torch's).
_SELF_GRAPHING = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
#: Compiled graphs dynamo keeps per code object: every batch bucket of every unit's module.
_RECOMPILE_LIMIT = 64
#: `wait: sleep`: the share of the shortest recent device time a runner sleeps through
#: after its launch before it spins, and the shortest sleep worth the wake-up (a sleep
#: overshoots by tens of microseconds; a batch that ends earlier than SLEEP_SHARE of the
#: shortest recent device time is collected that much late).
SLEEP_SHARE = 0.8
_SLEEP_MIN_NS = 200_000
#: How fast the shortest recent device time forgets an old minimum: it rises by this share of
#: the gap to a longer batch's time, so one fast batch does not hold the sleep short for good.
_FLOOR_RISE = 0.05


def sleep_before_wait(launch_ns: int, now_ns: int, device_floor_ns: int) -> float:
    """Seconds a `wait: sleep` runner sleeps before it spins on its launched batch.

    Until `SLEEP_SHARE` of the shortest recent device time has passed since the launch; 0 before
    any batch was timed, or when less than `_SLEEP_MIN_NS` is left of that.
    """
    left = launch_ns + int(SLEEP_SHARE * device_floor_ns) - now_ns
    return left / 1e9 if device_floor_ns > 0 and left >= _SLEEP_MIN_NS else 0.0


def device_floor(floor_ns: int, device_ns: int) -> int:
    """The shortest recent device time after a batch of `device_ns`: the minimum, slowly rising."""
    if device_ns <= 0:
        return floor_ns
    if floor_ns <= 0 or device_ns <= floor_ns:
        return device_ns
    return floor_ns + int(_FLOOR_RISE * (device_ns - floor_ns))


class _ServedRows:
    """A served batch's input rows, one array per item, as `TorchRunner.gather_input` reads them."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[np.ndarray]) -> None:
        self.rows = rows


class TorchOptions(BaseModel):
    """Options of the PyTorch engine; `None` means "the engine decides for the unit"."""

    model_config = ConfigDict(extra="forbid")

    channels_last: bool | None = None
    cuda_graph: bool | None = None
    compile: CompileMode | None = None
    compile_cache_dir: str | None = None
    threads: int | None = None
    warmup_iters: int = 3
    #: `fp8`: every `nn.Linear` (dimensions a multiple of 16) computes in FP8 e4m3 with
    #: per-tensor scales calibrated once on seeded sample inputs, the rest in the unit's
    #: fp16/bf16 (infermux.engines.fp8). None: the unit's mode throughout.
    precision: Literal["fp8"] | None = None
    #: FP8 products accumulated in the tensor cores' fast mode (fewer bits kept between
    #: partial sums; +2% on BERT-base) rather than in full fp32.
    fp8_fast_accum: bool = True
    #: For networks with an attention mask input (`mask_input`: transformers encoders): a
    #: second graph without the mask runs the batches whose masks are all ones (no padding),
    #: as eager transformers does by itself after a device sync. Traced or captured (torch.compile,
    #: CUDA graphs), the mask is otherwise applied to every batch, and attention with a mask
    #: ran at half its speed without one (BERT-base, H100, docs/benchmarks.md). Costs a
    #: second build of each (batch, length) runner, and a second CUDA graph's memory pool
    #: (the two graphs do not share one). None: on for CUDA units.
    dense_attention: bool | None = None
    #: How a CUDA runner's thread waits for its launched batch (trtexec's `--useSpinWait`
    #: choice): `spin` (CUDA's default event wait: the thread runs a core until the device
    #: signals), `sleep` (sleeps until `SLEEP_SHARE` of the batch's device time, as its last
    #: batches took it, has passed since its launch, then spins for the rest), `block` (a
    #: blocking-sync event: the thread sleeps until the device wakes it). The cores a spin
    #: holds are the ones a served host's fronts and clients also need.
    wait: Literal["spin", "sleep", "block"] = "spin"

    def resolve(self, unit: Unit, ndim: int) -> TorchOptions:
        """Fill the defaults for `unit`: the measured best choices, overridable by the user."""
        on_gpu = unit.kind == "cuda"
        channels_last = self.channels_last
        if channels_last is None:
            # channels_last feeds Tensor Cores without layout transposes; on CUDA cores (fp32)
            # and the CPU it does not help convolution nets as reliably, so it stays off there.
            channels_last = on_gpu and unit.mode != "fp32" and ndim == 4
        cuda_graph = self.cuda_graph
        if cuda_graph is None:
            cuda_graph = on_gpu
        if cuda_graph and not on_gpu:
            raise UsageError(f"option cuda_graph=true needs a CUDA unit, not {unit.id!r}")
        if on_gpu and not cuda_graph and self.compile in _SELF_GRAPHING:
            raise UsageError(
                f"option cuda_graph=false conflicts with compile={self.compile!r}, which means "
                f"CUDA graphs: use compile={_SELF_GRAPHING[self.compile]} with cuda_graph=false, "
                "or drop cuda_graph"
            )
        threads = self.threads or (len(unit.cores) if unit.kind == "cpu" else None)
        if self.precision == "fp8":
            from infermux.engines.fp8 import unit_reason

            why = unit_reason(unit)
            if why:
                raise UsageError(f"option precision=fp8 on {unit.id!r}: {why}; drop the option")
        if self.wait != "spin" and not on_gpu:
            raise UsageError(f"option wait={self.wait} is how a CUDA unit's runner waits for its "
                             f"batch; {unit.id!r} runs on the CPU: drop the option")
        dense_attention = self.dense_attention
        if dense_attention is None:
            dense_attention = on_gpu
        update: dict[str, Any] = {"channels_last": channels_last, "cuda_graph": cuda_graph,
                                  "threads": threads, "dense_attention": dense_attention}
        if self.compile and self.compile_cache_dir is None:
            # torch.compile's artefacts (FX graphs, kernels, autotuning) are kept with the other
            # caches, so a second run or tune of the same model rebuilds from them in seconds.
            from infermux.export import cache_dir

            update["compile_cache_dir"] = str(cache_dir() / "torch-compile")
        return self.model_copy(update=update)



class _Precision:
    """Sets the TF32 switches for a unit; they are process-global, so each call sets them."""

    def __init__(self, mode: str) -> None:
        self.allow_tf32 = mode == "tf32"

    def apply(self) -> None:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        torch.backends.cudnn.allow_tf32 = self.allow_tf32


class TorchRunner(Runner):
    """One model, one unit, one batch size: buffers, a stream, and optionally a CUDA graph."""

    engine = "torch"

    def __init__(
        self,
        module: Any,
        unit: Unit,
        batch: int,
        input_shape: tuple[int, ...],
        options: TorchOptions,
        data: str,
        input_specs: tuple[TensorSpec, ...] = (),
        length: int | None = None,
        mask_input: int | None = None,
    ) -> None:
        """A runner at (`batch`, `length`) of `module`.

        `mask_input`: the position of an attention mask the module also takes as None (no
        padding); a second forward without it (`TorchOptions.dense_attention`) then runs the
        batches whose masks are all ones.
        """
        import torch

        started = time.perf_counter()
        # Several inputs (ids, masks, features): one buffer each, float ones in the compute
        # dtype, integer ones as they are; a CUDA graph is captured per (batch, length).
        self.input_specs = input_specs
        self.length = length
        specs = input_specs or (TensorSpec("input", "float32", tuple(input_shape)),)
        self.unit = unit
        self.batch = batch
        self.input_shape = input_shape
        self.options = options.model_dump()
        self._opts = options
        self._module = module
        self._precision = _Precision(unit.mode)
        self._dtype = getattr(torch, _DTYPES.get(unit.mode, "float32"))
        self._on_gpu = unit.kind == "cuda"
        self._device = torch.device(unit.device if self._on_gpu else "cpu")
        self._graph: Any = None
        self._mask_at = mask_input if input_specs else None
        self._graph_dense: Any = None
        self._y_masked: list[Any] = []  # each graph's own output tensors
        self._y_dense: list[Any] = []
        #: The gathered batch's masks are all ones: the next launch runs the dense forward.
        self._dense_next = False
        self._in_flight = False
        #: Set by close(): the graph and output buffers are gone, so it must not run again.
        self.closed = False
        self.asynchronous = self._on_gpu
        if self._on_gpu:
            self._stream = torch.cuda.Stream(self._device)
            # The last is the one `collect` waits on: blocking-sync with `wait: block`.
            self._events = [torch.cuda.Event(enable_timing=True,
                                             blocking=i == 3 and options.wait == "block")
                            for i in range(4)]
        #: The least device time (first copy's start to last copy's end) of recent batches,
        #: ns, for `wait: sleep`; 0 until a batch was collected.
        self._device_floor_ns = 0
        self._xs_dev: list[Any] = []
        self._xs_host: list[Any] = []
        rng = np.random.default_rng(0)
        for spec in specs:
            shape = (batch, *spec.resolve({}))
            memory_format = (
                torch.channels_last if options.channels_last and len(shape) == 4
                else torch.contiguous_format
            )
            # The host buffer holds the batch in the compute dtype: the copy moves what the
            # unit reads.
            dtype = self._dtype if spec.is_float else getattr(torch, spec.dtype)
            x_dev = torch.empty(shape, dtype=dtype, device=self._device,
                                memory_format=memory_format)
            x_host = x_dev
            if self._on_gpu and data == "host":
                x_host = torch.empty(shape, dtype=dtype, pin_memory=True)
            if input_specs:
                x_host.copy_(torch.from_numpy(spec.generate(batch, {}, rng)))
            else:
                x_host.copy_(torch.randn(shape))
            if x_host is not x_dev:
                x_dev.copy_(x_host)
            self._xs_dev.append(x_dev)
            self._xs_host.append(x_host)
        self._x_dev = self._xs_dev[0]
        self._x_host = self._xs_host[0]
        self._y_dev: list[Any] = []
        #: The collected batch's outputs on the host (what `outputs()` reads).
        self._y_host: list[Any] = []
        #: On a GPU, two sets of pinned host outputs used by turns, and the launched batch's:
        #: a collected batch's outputs stay its own while the next batch runs
        #: (`outputs_survive_launch`), so a worker launches that batch before reading them.
        self._y_hosts: list[list[Any]] = []
        self._y_launched: list[Any] = []
        self._gather_pool: Any = None  # threads for large gathers, made on first need
        #: Served rows to copy to the device straight from their slabs at the next launch:
        #: (device rows, slab rows as tensors, a device staging buffer to convert, or None).
        self._direct: tuple[list[Any], list[Any], Any] | None = None
        self._dev_rows: dict[Any, list[Any]] = {}  # device buffer → its rows (made once)
        self._stages: dict[Any, Any] = {}  # row dtype → a device buffer of this runner's batch
        self._warm_up(options.warmup_iters)
        self.build_s = time.perf_counter() - started

    # -- building ---------------------------------------------------------------------------

    def _forward(self, dense: bool = False) -> list[Any]:
        import torch
        from torch.utils._pytree import tree_flatten

        xs: list[Any] = list(self._xs_dev)
        if dense and self._mask_at is not None:
            xs[self._mask_at] = None
        with torch.inference_mode():
            out = self._module(*xs)
        leaves, _ = tree_flatten(out)
        return [t for t in leaves if isinstance(t, torch.Tensor)]

    def _warm_up(self, iters: int) -> None:
        import torch

        self._precision.apply()
        variants = [False, True] if self._mask_at is not None else [False]
        if not self._on_gpu:
            torch.set_num_threads(self._opts.threads or 1)
            for dense in variants:
                for _ in range(max(1, iters)):
                    outs = self._forward(dense)
            self._y_dev = outs
            self._y_host = outs
            return
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            for dense in variants:
                for _ in range(max(1, iters)):
                    outs = self._forward(dense)
                self._stream.synchronize()
                if self._opts.cuda_graph:
                    graph = torch.cuda.CUDAGraph()
                    # A graph reads the tensors it was captured with: the module, the input
                    # and the outputs stay referenced by this runner as long as the graph does.
                    with torch.cuda.graph(graph, stream=self._stream):
                        outs = self._forward(dense)
                    if dense:
                        self._graph_dense = graph
                    else:
                        self._graph = graph
                    graph.replay()
                self._stream.synchronize()
                if dense:
                    self._y_dense = outs
                else:
                    self._y_masked = outs
        self._y_dev = self._y_masked
        self._y_hosts = [[torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in outs]
                         for _ in range(2)]
        self._y_host = self._y_launched = self._y_hosts[1]
        self.outputs_survive_launch = True

    # -- running ----------------------------------------------------------------------------

    def run(self) -> BatchTiming:
        """One batch, synchronized; phases from CUDA events on GPU units."""
        if self.closed:
            self._refuse_closed()
        if not self._on_gpu:
            return self._run_cpu()
        self.launch()
        return self.collect()

    def _refuse_closed(self) -> None:
        raise RunError(f"torch runner for {self.unit.id} at batch {self.batch} was closed "
                       "(its engine was released) and cannot run: build it again")

    def launch(self) -> None:
        """Enqueue copy in, compute and copy out on the runner's stream.

        On a GPU it returns before the batch is done (`collect()` waits).
        """
        if self.closed:
            self._refuse_closed()
        if not self._on_gpu:
            self._launched = self._run_cpu()
            return
        import torch

        ev = self._events
        stream = self._stream
        self._launch_ns = time.perf_counter_ns()
        # set_stream is cheaper than the `torch.cuda.stream()` context manager (measured ~14 us
        # per enter/exit on an H200 host), which matters for batch-1 eager runners.
        previous = torch.cuda.current_stream(self._device)
        torch.cuda.set_stream(stream)
        try:
            ev[0].record(stream)
            direct, self._direct = self._direct, None
            if direct is not None:  # served rows, by DMA from their slabs
                dsts, srcs, stage = direct
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
                if stage is not None:
                    self._x_dev.narrow(0, 0, len(dsts)).copy_(stage.narrow(0, 0, len(dsts)))
            elif self._x_host is not self._x_dev:
                for x_dev, x_host in zip(self._xs_dev, self._xs_host, strict=True):
                    x_dev.copy_(x_host, non_blocking=True)
            ev[1].record(stream)
            dense = self._dense_next
            graph = self._graph_dense if dense else self._graph
            if graph is not None:
                graph.replay()
                self._y_dev = self._y_dense if dense else self._y_masked
            else:
                self._precision.apply()
                self._y_dev = self._forward(dense)
            ev[2].record(stream)
            # The other host set than the last batch's (whose outputs may still be read).
            self._y_launched = self._y_hosts[self._y_hosts[0] is self._y_launched]
            for dst, src in zip(self._y_launched, self._y_dev, strict=True):
                dst.copy_(src, non_blocking=True)
            ev[3].record(stream)
        finally:
            torch.cuda.set_stream(previous)
        self._in_flight = True

    def done(self) -> bool:
        """Whether the launched batch's last copy has finished on the device (no waiting)."""
        if not self._on_gpu or not self._in_flight:
            return True
        return bool(self._events[3].query())

    def collect(self) -> BatchTiming:
        """Wait for the launched batch; its host latency and device phases."""
        if not self._on_gpu:
            return self._launched
        ev = self._events
        if self._opts.wait == "sleep" and not ev[3].query():
            pause = sleep_before_wait(self._launch_ns, time.perf_counter_ns(),
                                      self._device_floor_ns)
            if pause > 0:
                time.sleep(pause)
        ev[3].synchronize()
        self._in_flight = False
        self._y_host = self._y_launched
        latency = time.perf_counter_ns() - self._launch_ns
        timing = BatchTiming(
            latency_ns=latency,
            h2d_ns=int(ev[0].elapsed_time(ev[1]) * 1e6),
            compute_ns=int(ev[1].elapsed_time(ev[2]) * 1e6),
            d2h_ns=int(ev[2].elapsed_time(ev[3]) * 1e6),
        )
        if self._opts.wait == "sleep":
            self._device_floor_ns = device_floor(self._device_floor_ns,
                                                 timing.h2d_ns + timing.compute_ns + timing.d2h_ns)
        return timing

    def _run_cpu(self) -> BatchTiming:
        import torch

        threads = self._opts.threads or 1
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        start = time.perf_counter_ns()
        self._y_host = self._forward(self._dense_next)
        latency = time.perf_counter_ns() - start
        return BatchTiming(latency_ns=latency, compute_ns=latency)

    def prepare_pool(self, samples: np.ndarray) -> Any:
        """The pool in the compute dtype, on the device when inputs are pre-staged."""
        import torch

        pool = torch.from_numpy(np.ascontiguousarray(samples)).to(self._dtype)
        if self._x_host.device != pool.device:
            pool = pool.to(self._x_host.device)
        return pool

    def prepare_rows(self, rows: list[np.ndarray]) -> Any:
        """A served batch's own rows (any float dtype) as `gather_input` reads them.

        Rows for a host input buffer are kept as they are: `gather_input` copies each one
        straight into the buffer, converting to the compute dtype on the way, instead of
        stacking them, converting the stack and gathering it (three copies of every byte).
        """
        if self._x_host.is_cuda:
            return self.prepare_pool(np.stack(rows))
        return _ServedRows(rows)

    def pool_layout(self) -> tuple[str, ...]:
        """Dtype and device of the buffer `gather_input` writes."""
        return (str(self._dtype), str(self._x_host.device))

    def gather_input(self, pool: Any, indices: Sequence[int]) -> None:
        """Gather rows of `pool` into the input buffer with one indexed copy.

        Host buffers wait for the previous batch's copy to the device first (the copy reads
        them asynchronously); device buffers are written on the runner's stream, in order.
        """
        import torch

        self._direct = None  # whatever this gathers is what the next launch copies
        if isinstance(pool, _ServedRows):
            self._copy_rows(pool.rows)
            return
        if not isinstance(pool, torch.Tensor):
            super().gather_input(pool, indices)
            return
        n = len(indices)
        dst = self._x_host.narrow(0, 0, n)
        if dst.is_cuda:
            with torch.cuda.stream(self._stream):
                idx = torch.as_tensor(list(indices), dtype=torch.long).to(self._device)
                dst.copy_(pool.index_select(0, idx))
            return
        if self._in_flight and self._x_host is not self._x_dev:
            self._events[1].synchronize()
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        if not (dst.is_contiguous() and pool.dtype == dst.dtype):
            dst.copy_(pool.index_select(0, idx))
            return
        parts = min(_GATHER_THREADS, n, int(dst.nbytes // _GATHER_BYTES_PER_THREAD))
        if parts <= 1:
            torch.index_select(pool, 0, idx, out=dst)
            return
        # A large batch is gathered by several threads (index_select releases the GIL): one
        # thread gathering ResNet50 fp16 batch 256 (77 MB of random rows) took longer than the
        # batch's compute on an H200 host, so a single instance could not hide it.
        if self._gather_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._gather_pool = ThreadPoolExecutor(_GATHER_THREADS, "infermux-gather")
        bounds = [n * k // parts for k in range(parts + 1)]
        jobs = [self._gather_pool.submit(torch.index_select, pool, 0, idx[a:b],
                                         out=dst.narrow(0, a, b - a))
                for a, b in itertools.pairwise(bounds)]
        for job in jobs:
            job.result()

    def _copy_rows(self, rows: list[np.ndarray]) -> None:
        """Copy served rows into the host input buffer, converting; large batches on threads.

        One call copies a thread's share of rows (`_foreach_copy_`), so the interpreter lock
        is released once per share, not once per row: a copy per row gave the lock back and
        waited to take it again after each row, behind the event loop's thread, which may keep
        it for the switch interval (5 ms). Traced on H200 hosts serving through 8 fronts, a
        gather of about 60 ResNet50 rows took 17.5 ms that way and 9.5 ms this way, one of
        about 55 digits rows (2 KB each) 7.7 and 4.8 ms (docs/benchmarks.md).
        """
        import torch

        slab_rows = getattr(rows[0], "slab_region", None) is not None
        if (slab_rows and _DIRECT_ROWS and self._x_host is not self._x_dev
                and self._direct_rows(rows)):
            return
        if self._in_flight and self._x_host is not self._x_dev:
            self._events[1].synchronize()
        dst = self._x_host.narrow(0, 0, len(rows))
        if slab_rows and self._gather_slab_rows(rows, dst):
            return

        def copy(a: int, b: int) -> None:
            sources = [torch.from_numpy(rows[i]) for i in range(a, b)]
            torch._foreach_copy_(list(dst.narrow(0, a, b - a).unbind(0)), sources)

        n = len(rows)
        parts = min(_GATHER_THREADS, n, int(dst.nbytes // _GATHER_BYTES_PER_THREAD))
        if parts <= 1:
            copy(0, n)
            return
        if self._gather_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._gather_pool = ThreadPoolExecutor(_GATHER_THREADS, "infermux-gather")
        bounds = [n * k // parts for k in range(parts + 1)]
        jobs = [self._gather_pool.submit(copy, a, b) for a, b in itertools.pairwise(bounds)]
        for job in jobs:
            job.result()

    def _direct_rows(self, rows: list[Any]) -> bool:
        """Prepare served rows to go to the device straight from their slabs (by DMA at launch).

        Each row's slab is page-locked in place where the row lies (`engines.host_pins.HostPins`), so the
        launch copies it to the device by DMA: no CPU copy of the row into the pinned staging
        buffer (which cost a ResNet50 batch of 64 FP16 rows 7.6–10.6 ms of gather on H100 and
        H200 hosts, docs/benchmarks.md), and nothing waits for the previous batch's copy. Rows of
        the compute dtype land in the input buffer itself (a contiguous one); others in a device
        buffer of theirs, converted on the device. False (the staging path then) for rows of
        several dtypes or of a slab that cannot be locked.
        """
        import torch

        from infermux.engines.host_pins import host_pins

        dtype = rows[0].dtype
        groups: dict[int, tuple[Any, list[int]]] = {}
        for row in rows:
            if row.dtype != dtype:
                return False
            group = groups.get(id(row.slab_region))
            if group is None:
                group = groups[id(row.slab_region)] = (row.slab_region, [])
            group[1].append(row.slab_slot)
        pins = host_pins()
        if not all(pins.ensure(region, slots) for region, slots in groups.values()):
            return False
        sources = []
        for row in rows:  # a tensor per slot, made once and kept on the slot's row
            tensor = row.__dict__.get("tensor")
            if tensor is None:
                tensor = row.__dict__["tensor"] = torch.from_numpy(row)
            sources.append(tensor)
        target = self._x_dev
        stage = None
        if not (target.is_contiguous() and target.dtype == sources[0].dtype):
            stage = self._stages.get(dtype)
            if stage is None:
                stage = self._stages[dtype] = torch.empty(target.shape, dtype=sources[0].dtype,
                                                          device=target.device)
            target = stage
        dev_rows = self._dev_rows.get(id(target))
        if dev_rows is None:
            dev_rows = self._dev_rows[id(target)] = list(target.unbind(0))
        self._direct = (dev_rows[:len(rows)], sources, stage)
        return True

    def _gather_slab_rows(self, rows: list[Any], dst: Any) -> bool:
        """Gather rows that lie in front processes' slabs by slot: one indexed copy per slab.

        Each row is a `serve.shm.SlabRow`: its slab's input region (one array of rows, one
        per slot) and its slot there. The rows of one slab are read with one `numpy.take`
        (which releases the interpreter lock for the whole copy; a large one is split over
        the gather threads) straight into the input buffer (pinned on a GPU host, whence the
        runner copies to the device); no tensor is made per row. Not `torch.index_select`:
        from 32K elements it runs on torch's intra-op threads, and on a loaded two-core
        machine a 128-row digits gather (0.5 MB) then took 5-14 ms instead of 30 us.

        Rows of several slabs are taken per slab and placed by position, a second copy. For
        rows over `_SLAB_ROW_BYTES` (ResNet-sized ones) the row-by-row copy was as fast or
        faster in either case, and False is returned (the caller copies them so).
        """
        import torch

        if rows[0].nbytes > _SLAB_ROW_BYTES:
            return False
        slots = [r.slab_slot for r in rows]
        keys = [r.slab_key for r in rows]
        region = rows[0].slab_region
        n = len(rows)
        target = (dst.numpy() if dst.device.type == "cpu" and dst.is_contiguous()
                  and dst.dtype in (torch.float32, torch.float16) else None)
        if keys.count(keys[0]) == n:  # one front's slab
            idx = np.array(slots, dtype=np.intp)
            if target is not None and target.dtype == region.dtype:
                self._take(region, idx, target)
                return True
            picked = np.empty((n, *region.shape[1:]), region.dtype)
            self._take(region, idx, picked)
        else:  # several fronts' slabs (FP32 or FP16 rows): each slab's rows by slot
            groups: dict[Any, tuple[Any, list[int], list[int]]] = {}
            for pos, (key, slot) in enumerate(zip(keys, slots, strict=True)):
                group = groups.get(key)
                if group is None:
                    group = groups[key] = (rows[pos].slab_region, [], [])
                group[1].append(pos)
                group[2].append(slot)
            picked = target if target is not None else np.empty((n, *region.shape[1:]),
                                                                 np.float32)
            for group_region, positions, group_slots in groups.values():
                picked[positions] = group_region[group_slots]
            if picked is target:
                return True
        dst.copy_(torch.from_numpy(picked))
        return True

    def _take(self, region: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
        """`out[k] = region[idx[k]]`; a large gather split over the gather threads."""
        n = len(idx)
        parts = min(_GATHER_THREADS, n, int(out.nbytes // _GATHER_BYTES_PER_THREAD))
        if parts <= 1:
            np.take(region, idx, axis=0, out=out, mode="clip")  # "raise" buffers `out`
            return
        if self._gather_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._gather_pool = ThreadPoolExecutor(_GATHER_THREADS, "infermux-gather")
        bounds = [n * k // parts for k in range(parts + 1)]
        jobs = [self._gather_pool.submit(np.take, region, idx[a:b], 0, out[a:b], "clip")
                for a, b in itertools.pairwise(bounds)]
        for job in jobs:
            job.result()

    def compute(self, x: Any) -> list[Any]:
        """Run one batch from tensor `x` and return the outputs where they were computed.

        For pipelines, which move data between stages themselves (`Runner.compute` states the
        contract): `x` is on this unit's device (any dtype; it is converted into the input
        buffer, which a CUDA graph reads), nothing is copied back to the host, and the returned
        tensors are overwritten by the next call. Synchronized on return.
        """
        import torch

        expected = (self.batch, *self.input_shape)
        if tuple(x.shape) != expected:
            raise UsageError(f"tensor of shape {tuple(x.shape)} given, runner takes {expected}")
        if not self._on_gpu:
            threads = self._opts.threads or 1
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            if x.dtype == self._dtype:
                with torch.inference_mode():
                    out = self._module(x)
                from torch.utils._pytree import tree_flatten

                return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self._x_dev.copy_(x)
            return self._forward()
        previous = torch.cuda.current_stream(self._device)
        if x.is_cuda:  # produced on another stream: order the copy after it
            self._stream.wait_stream(torch.cuda.current_stream(x.device))
        torch.cuda.set_stream(self._stream)
        try:
            self._x_dev.copy_(x, non_blocking=True)
            if self._graph is not None:
                self._graph.replay()
                self._y_dev = self._y_masked
            else:
                self._precision.apply()
                self._y_dev = self._forward()
        finally:
            torch.cuda.set_stream(previous)
        self._stream.synchronize()
        return self._y_dev

    def set_input(self, batch: np.ndarray) -> None:
        """Copy `batch` into the input buffer (host pinned, or device when pre-staged)."""
        import torch

        expected = (self.batch, *self.input_shape)
        if tuple(batch.shape) != expected:
            raise UsageError(f"batch of shape {tuple(batch.shape)} given, runner takes {expected}")
        self._direct = None
        self._dense_next = False
        self._x_host.copy_(torch.from_numpy(np.ascontiguousarray(batch)))

    def set_inputs(self, arrays: Sequence[np.ndarray]) -> None:
        """Copy one batch of every input (in the model's order) into the input buffers."""
        import torch

        if not self.input_specs:
            super().set_inputs(arrays)
            return
        self.check_inputs(arrays)
        self._direct = None
        if self._on_gpu and self._in_flight and self._x_host is not self._x_dev:
            self._events[1].synchronize()  # the previous batch's copy still reads them
        for x_host, array in zip(self._xs_host, arrays, strict=True):
            x_host.copy_(torch.from_numpy(np.ascontiguousarray(array)))
        # Checked on the host, where the rows are: no device sync.
        self._dense_next = self._mask_at is not None and bool(np.all(arrays[self._mask_at]))

    def outputs(self) -> list[np.ndarray]:
        """The last collected batch's outputs as numpy arrays (`host_output`)."""
        return [host_output(t) for t in self._y_host]

    def close(self) -> None:
        """Drop the graph and buffers so the device memory can be reused."""
        self.closed = True
        if self._gather_pool is not None:
            self._gather_pool.shutdown(wait=False)
            self._gather_pool = None
        self._graph = self._graph_dense = None
        self._y_dev = []
        self._y_masked = []
        self._y_dense = []
        self._y_host = []
        self._y_hosts = []
        self._y_launched = []
        self._direct = None
        self._dev_rows = {}
        self._stages = {}


@register_engine
class TorchEngine(Engine):
    """PyTorch on `cpu` and `cuda:N/{fp32,tf32,fp16,bf16}` units."""

    name = "torch"
    unit_kinds = ("cpu", "cuda")

    options_model = TorchOptions

    def __init__(self) -> None:
        super().__init__()
        # Prepared modules per (model, unit, options) for this engine's life, beside the
        # runners per batch: a sweep over batch sizes converts and compiles the module once.
        self._modules: dict[tuple[str, str, str], Any] = {}

    def unsupported_reason(self, unit: Unit) -> str:
        """CPU int8 is a Q/DQ ONNX model: the ONNX engines run it, eager PyTorch does not."""
        if unit.kind == "cpu" and unit.mode == "int8":
            return (f"the torch engine has no int8 path for {unit.id!r}: int8 on CPUs runs a "
                    "Q/DQ model on onnxruntime or openvino, or litert's own int8 "
                    "(--engine onnxruntime)")
        return super().unsupported_reason(unit)

    takes_io = True

    def accepts(self, model: LoadedModel) -> bool:
        """Only torch modules: an ONNX file is for the ONNX engines."""
        return model.module is not None

    def _prepare(self, model: LoadedModel, unit: Unit, opts: TorchOptions,
                 length: int | None = None) -> Any:
        import copy

        import torch

        key = (model.key, unit.id, opts.model_dump_json())
        if key in self._modules:
            return self._modules[key]
        if model.module is None:
            raise UsageError(
                f"model {model.name!r} is an ONNX file: the torch engine runs torch models; "
                "use --engine onnxruntime or openvino"
            )
        module = copy.deepcopy(model.module).eval()
        dtype = getattr(torch, _DTYPES.get(unit.mode, "float32"))
        device = torch.device(unit.device if unit.kind == "cuda" else "cpu")
        module = module.to(device=device, dtype=dtype)
        if opts.channels_last:
            module = module.to(memory_format=torch.channels_last)
        if opts.precision == "fp8":
            module = _to_fp8(module, model, unit, length, opts.fp8_fast_accum)
        if opts.compile:
            if opts.compile_cache_dir:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = opts.compile_cache_dir
                os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
            # One graph per batch size (a runtime worker builds one per bucket), each
            # specialised as it was measured, not one dynamic-shape graph for them all; the
            # recompile limit (8 per code object) would otherwise send the ninth bucket, a
            # worker's largest, back to eager.
            dynamo = torch._dynamo.config
            for limit in ("recompile_limit", "cache_size_limit"):
                if hasattr(dynamo, limit):
                    setattr(dynamo, limit, max(getattr(dynamo, limit), _RECOMPILE_LIMIT))
            # Self-graphing modes compile the same kernels without torch's graph trees; the
            # runner captures its own graph around them (see _SELF_GRAPHING).
            mode = _SELF_GRAPHING.get(opts.compile, opts.compile)
            module = torch.compile(module, mode=mode, dynamic=False)
        self._modules[key] = module
        return module

    def resolve_options(self, options: dict[str, Any] | None, unit: Unit, model: LoadedModel,
                        data: str) -> TorchOptions:
        """Parsed, with defaults resolved for the unit and the input's rank."""
        return parse_options(TorchOptions, "torch", options).resolve(unit, len(model.input_shape) + 1)

    def _build(self, model: LoadedModel, unit: Unit, batch: int, opts: TorchOptions, data: str,
               instance: int) -> TorchRunner:
        """A runner for `model` on `unit` at `batch` (the module prepared once per options)."""
        return self._build_io(model, unit, batch, opts, data, instance, None)

    def _build_io(self, model: LoadedModel, unit: Unit, batch: int, opts: TorchOptions,
                  data: str, instance: int, length: int | None) -> TorchRunner:
        """A runner at (`batch`, `length`); a model of one float input ignores `length`."""
        io = model.spec_io
        dims = {} if io.simple else io.dims_for(length)
        specs = () if io.simple else io.resolved(dims)
        mask = getattr(model.module, "mask_input", None)
        names = [t.name for t in specs]
        mask_at = names.index(mask) if opts.dense_attention and mask in names else None
        try:
            module = self._prepare(model, unit, opts, length)
            runner = TorchRunner(module, unit, batch, model.input_shape, opts, data,
                                 input_specs=specs, length=next(iter(dims.values()), None),
                                 mask_input=mask_at)
        except Exception as exc:
            # torch's CPU allocator raises a plain RuntimeError that names itself (still in
            # torch 2.14: no type of its own), so its text is the one signal there is.
            if is_out_of_memory(exc) or "DefaultCPUAllocator" in str(exc):
                # Forget the caches so their memory can go, but close nothing: one engine
                # builds the runners of several runtime workers, and closing a runner that
                # another worker holds would break that worker (its next batch found no graph
                # and no output buffers). What nobody holds is freed with the references.
                self._runners.clear()
                self._modules.clear()
                _free_device_memory()
                where = "device memory" if unit.kind == "cuda" else "memory"
                raise DeviceOutOfMemoryError(
                    f"{model.name} on {unit.id} at batch {batch} ran out of {where}"
                ) from exc
            if isinstance(exc, (UsageError, RunError)):
                raise
            raise RunError(
                f"torch engine failed to build {model.name} on {unit.id} at batch {batch}: "
                f"{first_line(exc)}"
            ) from exc
        return runner

    def release(self) -> None:
        """Forget every cached module and runner and return cached device memory."""
        super().release()
        self._modules.clear()
        _free_device_memory()


#: Items of the seeded batch FP8 scales are calibrated on.
_FP8_CALIBRATION_ITEMS = 32


def _to_fp8(module: Any, model: LoadedModel, unit: Unit, length: int | None,
            fast_accum: bool = True) -> Any:
    """`module` (on its unit, in its dtype) with its Linears in FP8, calibrated on seeded inputs.

    The calibration batch is seeded noise (or the model's sample token ids) at the first
    sequence length built, like the agreement check's inputs: what it sets is a speed
    measurement's scales; a deployment's own data would set them from real activations.
    """
    import torch

    from infermux.engines import fp8

    props = torch.cuda.get_device_properties(torch.device(unit.device))
    why = fp8.unsupported_reason(unit.mode, (props.major, props.minor), module)
    if why:
        raise UsageError(f"option precision=fp8 for {model.name} on {unit.id}: {why}")
    io = model.spec_io
    dtype = getattr(torch, _DTYPES[unit.mode])
    if io.simple:
        arrays = [np.random.default_rng(1).standard_normal(
            (_FP8_CALIBRATION_ITEMS, *model.input_shape)).astype(np.float32)]
    else:
        arrays = io.generate(_FP8_CALIBRATION_ITEMS, io.dims_for(length), seed=1)
    inputs = [torch.from_numpy(a).to(unit.device) for a in arrays]
    inputs = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
    amax = fp8.calibrate(module, inputs)
    fp8.to_fp8(module, amax, fast_accum=fast_accum)
    return module


def _free_device_memory() -> None:
    """Collect what was just dropped, then hand the allocator's cached blocks back."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
