"""Pipelined execution: stages as worker threads joined by bounded links of preallocated buffers.

Data moves in *chunks* of `plan.chunk` items (the gcd of the stage batches), so each stage runs at
its own batch size: a worker gathers `batch / chunk` chunks into its input buffer, runs its
segment once, and writes its outputs back out chunk by chunk.

Each producer (the feeder, and every copy of every stage) owns a pool of `buffers × batch/chunk`
chunk slots, preallocated in its own memory (pinned host memory for CPU units when a GPU is
present, device memory for GPU units, host memory for the last stage). It blocks when every slot
is taken, so a slow consumer bounds how much any producer runs ahead: memory per link is fixed.
The consumer *pulls* a chunk from the producer's slot into its own input buffer (host copy, pinned
DMA or GPU peer copy, on the worker's own CUDA stream) and frees the slot at once, so no worker
ever holds a slot while it waits for more: no deadlock, whatever the batch sizes.

A stage on several units, or with several instances, is duplicated: its workers take chunks from
the same inbound link (whoever is free takes the next, i.e. work stealing). `pipeline_replicas`
builds whole copies of the chain that share the feeder and the sink. Outputs carry chunk ids, so
`run()` returns them in input order.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infermux.engines import create_engine
from infermux.errors import RunError, UsageError
from infermux.models import LoadedModel
from infermux.models.graph import ModelGraph
from infermux.models.segments import build_segment
from infermux.runtime.plan import ModelEntry, Stage
from infermux.runtime.transfer import alloc, copy_into, dtype_of, pin_thread, stream_for
from infermux.stats import latency_summary_ms
from infermux.units import Unit

__all__ = ["Pipeline", "PipelineMeasurement"]

_POLL_S = 0.05
#: Feeding gathers of at least this many bytes per thread are split over threads (up to 4).
_GATHER_BYTES_PER_THREAD = 8 << 20
_GATHER_THREADS = 4
_END = object()


class _StoppedError(Exception):
    """Raised inside workers when the pipeline is stopped."""


class _Pool:
    """A producer's preallocated chunk slots; `acquire` blocks while all are in flight."""

    def __init__(self, slots: list[list[Any]], stop: threading.Event) -> None:
        self.slots = slots
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(len(slots)):
            self._free.put(i)
        self._stop = stop
        #: Most slots ever in flight at once (for the memory-bound check).
        self.peak_in_flight = 0

    def acquire(self) -> int:
        while True:
            try:
                index = self._free.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    raise _StoppedError from None
                continue
            self.peak_in_flight = max(self.peak_in_flight, len(self.slots) - self._free.qsize())
            return index

    def release(self, index: int) -> None:
        self._free.put(index)


class _Link:
    """Full slots waiting for a consumer: (pool, slot, chunk id, feed time ns), or an end mark."""

    def __init__(self, stop: threading.Event) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._stop = stop

    def publish(self, item: Any) -> None:
        self._queue.put(item)

    def take(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    raise _StoppedError from None

    def take_nowait(self) -> Any | None:
        """The next item if one is waiting, else None."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def depth(self) -> int:
        """Items waiting now (approximate, for metrics)."""
        return self._queue.qsize()


@dataclass
class _StageCopy:
    stage: int
    replica: int
    unit: Unit
    runners: dict[int, Any]  # bucket (items) → runner; the largest is the stage's batch
    batch: int
    pool: _Pool
    gather: Any
    stream: Any
    busy_ns: int = 0
    batches: int = 0
    items: int = 0
    compute_ns: int = 0
    transfer_ns: int = 0
    depth_sum: int = 0
    depth_samples: int = 0

    @property
    def runner(self) -> Any:
        """The runner at the stage's full batch."""
        return self.runners[self.batch]

    def counters(self) -> tuple[int, int, int, int, int, int, int]:
        return (self.busy_ns, self.batches, self.items, self.compute_ns, self.transfer_ns,
                self.depth_sum, self.depth_samples)


@dataclass
class PipelineMeasurement:
    """A measured window: items through the sink, per-chunk latencies, per-stage busy shares."""

    items: int
    window_s: float
    latencies_ns: list[int] = field(default_factory=list)
    stage_busy: list[float] = field(default_factory=list)

    @property
    def items_per_s(self) -> float:
        """Items per second through the whole pipeline."""
        return self.items / self.window_s if self.window_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (latency percentiles of chunks, feed to sink)."""
        return {"items": self.items, "window_s": self.window_s, "items_per_s": self.items_per_s,
                "stage_busy": self.stage_busy, **latency_summary_ms(self.latencies_ns)}


class Pipeline:
    """A built pipeline of a model entry's `stages:`; `run()`, `measure()` or `serve()`.

    `serve()` runs it under the dispatcher (`runtime.pipelined`); `close()` releases it.
    """

    def __init__(
        self,
        plan: ModelEntry,
        model: LoadedModel,
        graph: ModelGraph,
        units: dict[str, Unit],
        *,
        buckets: bool = False,
    ) -> None:
        if not plan.stages:
            raise UsageError(f"model {plan.name!r} of the plan has no stages: section")
        #: The entry's stages, in order (input to output).
        self.stages: list[Stage] = list(plan.stages)
        missing = [u for s in self.stages for u in s.units if u not in units]
        if missing:
            raise UsageError(f"plan names units {missing} that were not selected: add them to --units")
        if len(graph.outputs) != len(graph.nodes[-1].all_input_nodes):
            raise UsageError(f"{model.name} has outputs that are not batch-major tensors: "
                             "it cannot run as a pipeline")
        self.plan = plan
        self.chunk = plan.chunk
        #: Runners for partial batches too (powers of two of the chunk): a stage runs what its
        #: inbound link holds instead of waiting for a full batch (serving under light load).
        self.buckets = buckets
        self._stop = threading.Event()
        self._engines: dict[str, Any] = {}
        for index, stage in enumerate(self.stages):
            engine = self._engines.get(stage.engine) or create_engine(stage.engine)
            self._engines[stage.engine] = engine
            for unit_id in stage.units:
                if unit_id in units and not engine.supports(units[unit_id]):
                    raise UsageError(
                        f"stages[{index}].engine: {stage.engine!r} cannot run on {unit_id!r}; "
                        f"it runs {', '.join(engine.unit_kinds)} units")
        infos = {c.node: c.tensor for c in graph.cuts}
        self._segments = []
        for index, stage in enumerate(self.stages):
            module = build_segment(graph, stage.start, stage.end)
            seg_in = graph.input if stage.start == "input" else infos[stage.start]
            outs = graph.outputs if stage.end == "output" else [infos[stage.end]]
            self._segments.append((seg_in, outs, LoadedModel.from_module(
                module, name=f"{model.name}[{index}:{stage.start}→{stage.end}]",
                input_shape=seg_in.shape, dtype=model.dtype, weights_note=model.weights_note)))
        self._input = graph.input
        self._outputs = graph.outputs
        # The feeder's pool: host memory, enough slots for every first-stage copy to be busy.
        first = self.stages[0]
        feed_slots = first.buffers * (first.batch // self.chunk) * max(
            1, len(first.units) * first.instances * plan.pipeline_replicas)
        # Inputs wait on the host in the first stage's compute dtype (fp16 for a `cuda:N/fp16`
        # stage): the host→device copy moves what the stage reads, as a replica's runner does.
        first_unit = units.get(first.units[0])
        self.feed_dtype = dtype_of(first_unit if first_unit is not None and
                                   first_unit.kind == "cuda" else None)
        self._feed_pool = _Pool([[alloc(None, (self.chunk, *self._input.shape), self.feed_dtype)]
                                 for _ in range(feed_slots)], self._stop)
        self._gather_pool: Any = None
        self._source = _Link(self._stop)
        self._sink = _Link(self._stop)
        self.copies: list[list[_StageCopy]] = [[] for _ in self.stages]
        self._links: list[list[_Link]] = []  # per replica: link into stage s (s ≥ 1)
        try:
            self._build(units)
        except BaseException:
            self.close()
            raise
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._ended: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self._started = False

    # -- building -------------------------------------------------------------------------------

    def _build(self, units: dict[str, Unit]) -> None:
        plan = self.plan
        for replica in range(plan.pipeline_replicas):
            self._links.append([self._source] + [_Link(self._stop) for _ in self.stages[1:]])
            for s, stage in enumerate(self.stages):
                seg_in, outs, seg_model = self._segments[s]
                last = s == len(self.stages) - 1
                if stage.batch % self.chunk:  # pragma: no cover - chunk is the gcd
                    raise UsageError(f"stage batch {stage.batch} is not a multiple of {self.chunk}")
                engine = self._engines[stage.engine]
                sizes = self._bucket_sizes(stage.batch)
                for unit_id in stage.units:
                    unit = units[unit_id]
                    for instance in range(stage.instances):
                        runners = {b: engine.build(
                            seg_model, unit, b, stage.options, data="device",
                            instance=replica * stage.instances + instance) for b in sizes}
                        home = None if last else unit  # the last stage writes into the host
                        slots = [[alloc(home, (self.chunk, *o.shape)) for o in outs]
                                 for _ in range(stage.buffers * stage.batch // self.chunk)]
                        self.copies[s].append(_StageCopy(
                            s, replica, unit, runners, stage.batch, _Pool(slots, self._stop),
                            alloc(unit, (stage.batch, *seg_in.shape)), stream_for(unit)))

    def _bucket_sizes(self, batch: int) -> list[int]:
        """Runner batch sizes of a stage: its batch, and with `buckets` 1, 2, 4, ... below it."""
        if not self.buckets:
            return [batch]
        sizes = {batch}
        size = 1
        while size < batch:
            sizes.add(size)
            size *= 2
        return sorted(sizes)

    def _workers_of(self, stage: int, replica: int) -> list[_StageCopy]:
        return [c for c in self.copies[stage] if c.replica == replica]

    # -- running --------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._started:
            raise RunError("a pipeline runs once: build a new one for another run")
        self._started = True
        for stage in self.copies:
            for copy in stage:
                thread = threading.Thread(target=self._work, args=(copy,), daemon=True,
                                          name=f"infermux-stage{copy.stage}-{copy.unit.id}")
                thread.start()
                self._threads.append(thread)

    def _work(self, copy: _StageCopy) -> None:
        try:
            with pin_thread(copy.unit):
                self._loop(copy)
        except _StoppedError:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._errors.append(exc)
            self._stop.set()

    def _loop(self, copy: _StageCopy) -> None:
        inbound = self._links[copy.replica][copy.stage]
        last = copy.stage == len(self.stages) - 1
        outbound = self._sink if last else self._links[copy.replica][copy.stage + 1]
        g = self.chunk
        ending = False
        while not ending:
            ids: list[tuple[int, int, int, int]] = []  # chunk id, feed time, offset, rows
            filled = transfer = 0
            while filled + g <= copy.batch:
                if ids and self.buckets:
                    # Take what is waiting; run a smaller bucket rather than wait for more.
                    item = inbound.take_nowait()
                    if item is None:
                        break
                else:
                    item = inbound.take()
                    copy.depth_sum += inbound.depth()
                    copy.depth_samples += 1
                if item is _END:
                    ending = True
                    break
                t0 = time.perf_counter_ns()
                pool, slot, chunk_id, fed_ns, rows = item
                copy_into(copy.gather[filled:filled + rows], pool.slots[slot][0][:rows], copy.stream)
                pool.release(slot)
                ids.append((chunk_id, fed_ns, filled, rows))
                filled += rows
                transfer += time.perf_counter_ns() - t0
            if ids:
                bucket = next(b for b in sorted(copy.runners) if b >= filled)
                t0 = time.perf_counter_ns()
                outs = copy.runners[bucket].compute(copy.gather[:bucket])
                compute = time.perf_counter_ns() - t0
                for chunk_id, fed_ns, at, rows in ids:
                    slot = copy.pool.acquire()
                    t0 = time.perf_counter_ns()
                    for dst, src in zip(copy.pool.slots[slot], outs, strict=True):
                        copy_into(dst[:rows], src[at:at + rows], copy.stream)
                    transfer += time.perf_counter_ns() - t0
                    outbound.publish((copy.pool, slot, chunk_id, fed_ns, rows))
                copy.busy_ns += compute + transfer
                copy.compute_ns += compute
                copy.transfer_ns += transfer
                copy.batches += 1
                copy.items += filled
        self._finish(copy, outbound)

    def _finish(self, copy: _StageCopy, outbound: _Link) -> None:
        """The last copy of a stage to end passes the end mark to every copy of the next."""
        key = (copy.replica, copy.stage)
        with self._lock:
            self._ended[key] = self._ended.get(key, 0) + 1
            all_done = self._ended[key] == len(self._workers_of(copy.stage, copy.replica))
        if not all_done:
            return
        if copy.stage == len(self.stages) - 1:
            outbound.publish(_END)
        else:
            for _ in self._workers_of(copy.stage + 1, copy.replica):
                outbound.publish(_END)

    def _first_copies(self) -> int:
        return len(self.copies[0])

    def _check(self) -> None:
        if self._errors:
            self._stop.set()
            exc = self._errors[0]
            raise RunError(f"a pipeline stage failed: {type(exc).__name__}: {exc}") from exc

    def run(self, inputs: np.ndarray) -> list[np.ndarray]:
        """Push `inputs` (`(N, *input_shape)`, N a multiple of the chunk) through; outputs in order."""
        import torch

        inputs = np.ascontiguousarray(inputs, dtype=np.float32)
        if inputs.shape[1:] != self._input.shape or len(inputs) % self.chunk:
            raise UsageError(
                f"inputs of shape {inputs.shape} given: the pipeline takes (N, "
                f"{', '.join(map(str, self._input.shape))}) with N a multiple of {self.chunk}")
        chunks = len(inputs) // self.chunk
        results: dict[int, list[np.ndarray]] = {}
        self._start()
        feeder = threading.Thread(target=self._feed, args=(torch.from_numpy(inputs), chunks),
                                  daemon=True, name="infermux-feeder")
        feeder.start()
        ended = 0
        try:
            while ended < self.plan.pipeline_replicas:
                self._check()
                try:
                    item = self._sink.take()
                except _StoppedError:
                    self._check()
                    raise
                if item is _END:
                    ended += 1
                    continue
                pool, slot, chunk_id, _, _ = item
                results[chunk_id] = [t.numpy().copy() for t in pool.slots[slot]]
                pool.release(slot)
        finally:
            self._stop.set()
            feeder.join()
            self.join()
        self._check()
        if len(results) != chunks:
            raise RunError(f"the pipeline returned {len(results)} of {chunks} chunks")
        return [np.concatenate([results[c][k] for c in range(chunks)])
                for k in range(len(self._outputs))]

    def _feed(self, data: Any, chunks: int) -> None:
        g = self.chunk
        try:
            for c in range(chunks):
                slot = self._feed_pool.acquire()
                self._feed_pool.slots[slot][0].copy_(data[c * g:(c + 1) * g])
                self._source.publish((self._feed_pool, slot, c, time.perf_counter_ns(), g))
            for _ in range(self._first_copies()):
                self._source.publish(_END)
        except _StoppedError:
            pass

    def _feed_forever(self) -> None:
        # Slots keep the random data they were filled with: feeding costs no copy, so the feeder
        # (a thread on the same cores) takes as little from the stages as it can.
        for tensors in self._feed_pool.slots:
            tensors[0].normal_()
        chunk_id = 0
        try:
            while not self._stop.is_set():
                slot = self._feed_pool.acquire()
                self._source.publish((self._feed_pool, slot, chunk_id, time.perf_counter_ns(),
                                      self.chunk))
                chunk_id += 1
        except _StoppedError:
            pass

    def measure(self, duration_s: float = 2.0, warmup_s: float = 0.5) -> PipelineMeasurement:
        """Run on endless input; count items through the sink over `duration_s` after warm-up."""
        self._start()
        feeder = threading.Thread(target=self._feed_forever, daemon=True, name="infermux-feeder")
        feeder.start()
        items = 0
        latencies: list[int] = []
        busy_start: list[list[int]] = []
        try:
            begin = time.perf_counter()
            start = end = 0.0
            measuring = False
            while True:
                self._check()
                pool, slot, _, fed_ns, _ = self._sink.take()
                now_ns = time.perf_counter_ns()
                pool.release(slot)
                now = now_ns / 1e9
                if not measuring and now - begin >= warmup_s:
                    measuring, start = True, now
                    busy_start = [[c.busy_ns for c in stage] for stage in self.copies]
                    continue
                if measuring:
                    items += self.chunk
                    latencies.append(now_ns - fed_ns)
                    end = now
                    if end - start >= duration_s:
                        break
        except _StoppedError:
            self._check()
            raise
        finally:
            self._stop.set()
            feeder.join()
            self.join()
        self._check()
        window = end - start
        # A batch's busy time is counted when it ends, so a window's edges can push a share
        # a little past 1; it is clipped, and long windows make the edges negligible.
        busy = [
            min(1.0, sum(c.busy_ns - b for c, b in zip(stage, before, strict=True)) / 1e9
                / (window * len(stage))) if window > 0 else 0.0
            for stage, before in zip(self.copies, busy_start, strict=True)
        ]
        return PipelineMeasurement(items, window, latencies, busy)

    # -- serving: the runtime feeds batches and hears of each chunk that comes out -----------------

    def serve(self, on_chunk: Callable[[int, int, list[Any]], None],
              on_error: Callable[[BaseException], None]) -> None:
        """Start the stages for `feed()`, then call `on_chunk` for each chunk that comes out.

        `on_chunk(chunk_id, out_ns, outputs)` gets host tensors of the chunk's rows, valid only
        during the call. `on_error` is called once, from the sink thread, if a stage fails.
        """
        self._start()
        self._sink_thread = threading.Thread(target=self._drain, args=(on_chunk, on_error),
                                             daemon=True, name="infermux-pipeline-sink")
        self._sink_thread.start()

    def _drain(self, on_chunk: Callable[[int, int, list[Any]], None],
               on_error: Callable[[BaseException], None]) -> None:
        ended = 0
        try:
            while ended < self.plan.pipeline_replicas:
                item = self._sink.take()
                if item is _END:
                    ended += 1
                    continue
                pool, slot, chunk_id, _, rows = item
                try:
                    on_chunk(chunk_id, time.perf_counter_ns(), [t[:rows] for t in pool.slots[slot]])
                finally:
                    pool.release(slot)
        except _StoppedError:
            if self._errors:
                exc = self._errors[0]
                on_error(RunError(f"a pipeline stage failed: {type(exc).__name__}: {exc}"))

    def _feed_slot(self) -> int:
        """A free input slot (blocks while all are in flight); a stopped pipeline raises."""
        self._check()
        try:
            return self._feed_pool.acquire()
        except _StoppedError:
            self._check()
            raise RunError("the pipeline was stopped") from None

    def feed(self, chunk_id: int, rows: Any) -> None:
        """Queue one chunk (at most `chunk` rows, a torch tensor or array); blocks while full."""
        import torch

        slot = self._feed_slot()
        tensor = self._feed_pool.slots[slot][0]
        data = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.asarray(rows))
        if len(data) > self.chunk:
            self._feed_pool.release(slot)
            raise UsageError(f"a chunk holds at most {self.chunk} rows, not {len(data)}")
        tensor[:len(data)].copy_(data)
        self._source.publish((self._feed_pool, slot, chunk_id, time.perf_counter_ns(), len(data)))

    def feed_indices(self, chunk_id: int, pool: Any, indices: Any) -> None:
        """Queue one chunk of rows `indices` of `pool` (a host tensor in `feed_dtype`).

        The rows go straight into an input slot: one indexed copy, split over threads when large.
        """
        import torch

        if len(indices) > self.chunk:
            raise UsageError(f"a chunk holds at most {self.chunk} rows, not {len(indices)}")
        slot = self._feed_slot()
        n = len(indices)
        dst = self._feed_pool.slots[slot][0].narrow(0, 0, n)
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        parts = min(_GATHER_THREADS, n, int(dst.nbytes // _GATHER_BYTES_PER_THREAD))
        if parts <= 1:
            torch.index_select(pool, 0, idx, out=dst)
        else:
            # index_select releases the GIL: a large chunk (ResNet50 b64 is 19 MB in fp16) is
            # gathered by several threads, as the torch runner gathers a replica's batch.
            if self._gather_pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._gather_pool = ThreadPoolExecutor(_GATHER_THREADS, "infermux-feed")
            bounds = [n * k // parts for k in range(parts + 1)]
            for job in [self._gather_pool.submit(torch.index_select, pool, 0, idx[a:b],
                                                 out=dst.narrow(0, a, b - a))
                        for a, b in itertools.pairwise(bounds)]:
                job.result()
        self._source.publish((self._feed_pool, slot, chunk_id, time.perf_counter_ns(), n))

    def end_serving(self, timeout_s: float = 60.0) -> None:
        """No more chunks: let the stages drain, then stop them."""
        if not self._started:
            return
        for _ in range(self._first_copies()):
            self._source.publish(_END)
        sink = getattr(self, "_sink_thread", None)
        if sink is not None:
            sink.join(timeout_s)
        self._stop.set()
        self.join()

    def stage_counters(self) -> list[list[tuple[int, ...]]]:
        """Raw per-copy counters, per stage (for `stage_stats` over a window)."""
        return [[c.counters() for c in stage] for stage in self.copies]

    def stage_stats(self, since: list[list[tuple[int, ...]]] | None, window_s: float
                    ) -> list[dict[str, Any]]:
        """Per stage over a window: busy share, batch sizes, compute and transfer time, queue depth.

        The queue depth is the mean length of the stage's inbound link when a copy took from it.
        """
        stats = []
        for si, (stage, spec) in enumerate(zip(self.copies, self.stages, strict=True)):
            now = [c.counters() for c in stage]
            before = since[si] if since is not None else [(0,) * 7] * len(stage)
            d = [sum(n[k] - b[k] for n, b in zip(now, before, strict=True)) for k in range(7)]
            busy_ns, batches, items, compute_ns, transfer_ns, depth_sum, depth_n = d
            stats.append({
                "stage": si, "segment": f"{spec.start}→{spec.end}", "units": list(spec.units),
                "engine": spec.engine, "copies": len(stage),
                "busy": min(1.0, busy_ns / 1e9 / (window_s * len(stage))) if window_s > 0 else 0.0,
                "batches": batches, "items": items,
                "mean_batch": items / batches if batches else 0.0,
                "compute_ms_per_batch": compute_ns / 1e6 / batches if batches else 0.0,
                "transfer_ms_per_batch": transfer_ns / 1e6 / batches if batches else 0.0,
                "queue_depth": depth_sum / depth_n if depth_n else 0.0,
            })
        return stats

    def peak_in_flight(self) -> dict[str, int]:
        """Most slots each pool had in flight (never more than its `buffers × batch/chunk`)."""
        peaks = {"feeder": self._feed_pool.peak_in_flight}
        for stage in self.copies:
            for c in stage:
                peaks[f"{c.stage}:{c.replica}:{c.unit.id}"] = c.pool.peak_in_flight
        return peaks

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the workers to stop."""
        for thread in self._threads:
            thread.join(timeout=timeout_s)

    def close(self) -> None:
        """Stop the workers and release the runners."""
        self._stop.set()
        for thread in getattr(self, "_threads", []):
            thread.join(timeout=30.0)
        for stage in self.copies:
            for c in stage:
                for runner in c.runners.values():
                    runner.close()
        for engine in self._engines.values():
            engine.release()
        if getattr(self, "_gather_pool", None) is not None:
            self._gather_pool.shutdown(wait=False)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
