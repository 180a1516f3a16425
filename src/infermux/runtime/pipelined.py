"""Pipelined models in the runtime: a model entry with `stages:` served by the stage executor.

The dispatcher sees one worker per pipeline (all its stages, copies and `pipeline_replicas`): it
takes batches of queries like any worker, cuts each into link chunks and feeds them to the
`Pipeline` executor (`runtime.stages`), whose stages run on their own units and engines joined
by bounded buffers. A batch completes when its last chunk leaves the last stage. Feeding blocks
while the pipeline's input slots are full, so a pipeline holds a bounded number of batches in
flight, and the dispatcher's queue (where latency is counted from the query's scheduled time)
absorbs the rest.

Stages run with `buckets`: a stage takes the chunks its inbound link holds, up to its batch, and
runs the smallest runner that fits, so light server load is not held back to fill a batch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from infermux.engines.base import BatchTiming
from infermux.errors import RunError, UsageError
from infermux.models import LoadedModel
from infermux.runtime.dispatcher import Batch, Dispatcher, WorkerState
from infermux.runtime.plan import ModelEntry
from infermux.units import Discovery, Unit, select_units

__all__ = ["PipelineWorker", "build_pipeline", "pipeline_buckets"]


def pipeline_buckets(entry: ModelEntry) -> list[int]:
    """Dispatcher batch sizes of a pipelined entry: 1, 2, 4, ... up to the first stage's batch."""
    assert entry.stages
    top = entry.stages[0].batch
    sizes, size = {top}, 1
    while size < top:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def build_pipeline(entry: ModelEntry, model: LoadedModel, found: Discovery, where: str) -> Any:
    """The `Pipeline` executor of a model entry with `stages:`; errors name the plan field."""
    from infermux.models.graph import capture_graph
    from infermux.runtime.stages import Pipeline

    units: dict[str, Unit] = {}
    assert entry.stages
    for si, stage in enumerate(entry.stages):
        try:
            for unit in select_units(stage.units, found):
                units[unit.id] = unit
        except UsageError as exc:
            raise UsageError(f"plan field {where}.stages[{si}].units: {exc}") from None
        for unit_id in stage.units:
            if unit_id in units and units[unit_id].kind not in ("cpu", "cuda"):
                raise UsageError(
                    f"plan field {where}.stages[{si}].units: {unit_id!r} cannot hold a stage; "
                    "stages run on cpu, cpu:N and cuda:N/... units")
    if model.module is None:
        raise UsageError(f"plan field {where}.model: {model.name} is an ONNX file; a pipeline "
                         "cuts a torch model (give the architecture or factory instead)")
    graph = capture_graph(model.module, model.input_shape)
    known = {"input", "output", *(c.node for c in graph.cuts)}
    for si, stage in enumerate(entry.stages):
        for edge in (stage.start, stage.end):
            if edge not in known:
                raise UsageError(
                    f"plan field {where}.stages[{si}]: {edge!r} is not a cut point of "
                    f"{model.name}; list them with `infermux partition -m {entry.model} --show`")
    return Pipeline(entry, model, graph, units, buckets=True)


@dataclass
class _InFlight:
    batch: Batch
    start_ns: int
    chunks_left: int
    #: Outputs per chunk (batches with their own inputs only), joined when the last comes out.
    outputs: dict[int, list[np.ndarray]] | None = None


class PipelineWorker:
    """The thread that feeds one pipeline from the dispatcher and reports its completions."""

    def __init__(self, state: WorkerState, pipeline: Any, samples: np.ndarray,
                 dispatcher: Dispatcher) -> None:
        import torch

        self.state = state
        self.pipeline = pipeline
        #: The sample pool as the pipeline's input slots hold it (dtype), gathered from directly.
        self.pool = torch.from_numpy(np.ascontiguousarray(samples)).to(pipeline.feed_dtype)
        self.dispatcher = dispatcher
        self.chunk: int = pipeline.chunk
        self._lock = threading.Lock()
        self._in_flight: dict[int, _InFlight] = {}  # first chunk id → batch
        self._owner: dict[int, int] = {}  # chunk id → first chunk id of its batch
        self._next_chunk = 0
        self._failed = False
        self._window: tuple[float, list[list[tuple[int, ...]]]] | None = None
        self.thread = threading.Thread(target=self._main, name=f"infermux-{state.name}",
                                       daemon=True)

    def start(self) -> None:
        """Start the stages and the feeding thread."""
        self.pipeline.serve(self._on_chunk, self._on_error)
        self.thread.start()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the feeder, then for the pipeline to drain."""
        self.thread.join(timeout_s)

    def _main(self) -> None:
        d, w = self.dispatcher, self.state
        try:
            while (batch := d.next_batch(w)) is not None:
                indices = batch.samples
                own = batch.inputs()  # a served batch brings its own rows
                chunks = [indices[i:i + self.chunk] for i in range(0, len(indices), self.chunk)]
                with self._lock:
                    first = self._next_chunk
                    self._next_chunk += len(chunks)
                    self._in_flight[first] = _InFlight(batch, time.perf_counter_ns(), len(chunks),
                                                       None if own is None else {})
                    for k in range(len(chunks)):
                        self._owner[first + k] = first
                for k, rows in enumerate(chunks):
                    if own is None:
                        self.pipeline.feed_indices(first + k, self.pool, rows)
                    else:
                        at = k * self.chunk
                        self.pipeline.feed(first + k, own[at:at + len(rows)])
        except RunError as exc:
            self._on_error(exc)
        finally:
            if not self._failed:
                self.pipeline.end_serving()

    def _on_chunk(self, chunk_id: int, out_ns: int, outputs: list[Any]) -> None:
        with self._lock:
            first = self._owner.pop(chunk_id, None)
            if first is None:
                return
            entry = self._in_flight[first]
            if entry.outputs is not None:  # valid only during this call: copied
                entry.outputs[chunk_id - first] = [
                    np.array(t.detach().float().cpu().numpy()) for t in outputs]
            entry.chunks_left -= 1
            if entry.chunks_left:
                return
            del self._in_flight[first]
        joined = None
        if entry.outputs is not None:
            parts = [entry.outputs[k] for k in sorted(entry.outputs)]
            joined = [np.concatenate([p[i] for p in parts]) for i in range(len(parts[0]))]
        latency = out_ns - entry.start_ns
        self.dispatcher.finished(self.state, entry.batch, entry.start_ns, out_ns,
                                 BatchTiming(latency, compute_ns=latency), joined)

    def _on_error(self, exc: BaseException) -> None:
        with self._lock:
            if self._failed:
                return
            self._failed = True
            held = [f.batch for f in self._in_flight.values()]
            self._in_flight.clear()
            self._owner.clear()
        self.dispatcher.failed(self.state, held, exc)

    # -- per-stage metrics over a trial ---------------------------------------------------------

    def begin_window(self) -> None:
        """Start counting per-stage figures (at a trial's start)."""
        self._window = (time.perf_counter(), self.pipeline.stage_counters())

    def stage_stats(self) -> list[dict[str, Any]]:
        """Per-stage busy share, batch sizes, compute/transfer time and queue depth of the window."""
        started, before = self._window or (time.perf_counter(), None)
        return self.pipeline.stage_stats(before, time.perf_counter() - started)

    def close(self) -> None:
        """Stop and release the pipeline's runners."""
        self.pipeline.close()
