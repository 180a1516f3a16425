"""The interpreter's cyclic garbage collector: each generation's pauses, counted per trial.

A process that imported torch holds about 350,000 objects the collector tracks, and a full
(generation-2) collection walks them all while it holds the interpreter lock: 180 ms on the
2-core machine. Such a pause in the runtime process would stop every front link, the
dispatcher and the worker threads, and land in the tail of a served or server-scenario
latency. `GcPauses` counts each generation's collections and their longest and total pause;
a trial's record (`gc`) and a server's summary carry them, so a tail can be checked against
them. Measured on an H100 host (docs/benchmarks.md): no full collection in any trial of a
find-peak, 5–7 young collections per 4 s trial, 1.4–6.6 ms in all; freezing the built heap
(`gc.freeze`) changed nothing measurable there. On the 2-core machine full collections do run
in trials: one of 191 ms stopped the load generator (issue lag p99 106 ms) and failed its
find-peak trial. So a started runtime freezes the heap it was built with (`freeze_heap`):
the full collections walk only what was allocated since, and the frozen objects go back to
the collector when the last runtime of the process stops. Every start freezes what was built
since, and every trial's beginning collects and freezes what the trials before it left
(`freeze_since`), so a trial's full collections walk that trial's own objects alone.

A pause is wall time, and a collecting thread taken off its core (by the host, by the
scheduler) pauses as long as it is away: on H200 hosts "full collections" of 320-370 ms came
in find-peak trials, one of them beside a batch the device timed at 340 ms. So the longest
full collection's CPU time is kept beside it (`full_max_cpu_ms`): far below the pause, the
host held the thread; near it, the collector walked that long (on the next host, 548 ms of a
548 ms pause: a walk, inside a trial, with the trials before it frozen).
"""

from __future__ import annotations

import gc
import threading
import time
from contextlib import suppress
from typing import Any

__all__ = ["GcPauses", "freeze_heap", "freeze_since", "thaw_heap"]

_freeze_lock = threading.Lock()
_freezers = 0


def freeze_heap() -> bool:
    """Move every tracked object out of the collector's reach (`gc.freeze`).

    Counted per process: every runtime's start freezes what is there (a second runtime's
    build too), and `thaw_heap` by the last to stop gives the objects back, so runtimes
    started one after another (a tune's) do not keep each other's garbage. No collection
    first: it would cost a full walk (180 ms on two cores) at every start, and garbage frozen
    with the heap is collected once it is thawed. A process that froze its heap itself is
    left as it is. Returns whether this call counts (its `thaw_heap` is then owed).
    """
    global _freezers
    with _freeze_lock:
        if _freezers == 0 and gc.get_freeze_count() > 0:
            return False
        gc.freeze()  # moves the generations' lists whole: no walk
        _freezers += 1
        return True


def freeze_since() -> None:
    """Collect, then freeze, what was allocated since the last freeze (a runtime froze the heap).

    Called at each trial's beginning, between trials: the records of the trials before it
    (batches, phases) and whatever a caller built between trials stay out of the walk of the
    trial's full collections. The collection first walks only those objects (the rest is
    frozen), so the garbage among them is not kept until the heap is thawed. Nothing happens
    where no runtime froze the heap.
    """
    with _freeze_lock:
        if _freezers > 0:
            gc.collect()
            gc.freeze()


def thaw_heap() -> None:
    """One runtime's `freeze_heap` undone; the last one gives the objects back (`gc.unfreeze`)."""
    global _freezers
    with _freeze_lock:
        if _freezers == 0:
            return
        _freezers -= 1
        if _freezers == 0:
            gc.unfreeze()


class GcPauses:
    """Collections per generation and the time each held the interpreter, since `reset()`.

    Installed as a `gc.callbacks` entry; the collector runs one collection at a time, in
    whichever thread triggered it, so the counters need no lock of their own.
    """

    def __init__(self) -> None:
        self._began = self._began_cpu = 0
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (a trial's beginning)."""
        self.count = [0, 0, 0]
        self.total_ns = [0, 0, 0]
        self.max_ns = [0, 0, 0]
        #: The CPU time of each generation's longest pause: far below the pause, the
        #: collecting thread was off its core (the host or the scheduler took it), not walking.
        self.max_cpu_ns = [0, 0, 0]

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter_ns()
            self._began_cpu = time.thread_time_ns()
            return
        g = min(2, int(info.get("generation", 2)))
        took = time.perf_counter_ns() - self._began
        self.count[g] += 1
        self.total_ns[g] += took
        if took >= self.max_ns[g]:
            self.max_ns[g] = took
            self.max_cpu_ns[g] = time.thread_time_ns() - self._began_cpu

    def install(self) -> GcPauses:
        """Start listening to the collector; returns self."""
        gc.callbacks.append(self._on_gc)
        return self

    def remove(self) -> None:
        """Stop listening."""
        with suppress(ValueError):
            gc.callbacks.remove(self._on_gc)

    def summary(self) -> dict[str, Any]:
        """Full collections with their longest and total pause; all collections and their total."""
        return {"full_collections": self.count[2],
                "full_max_ms": round(self.max_ns[2] / 1e6, 3),
                "full_max_cpu_ms": round(self.max_cpu_ns[2] / 1e6, 3),
                "full_total_ms": round(self.total_ns[2] / 1e6, 3),
                "collections": sum(self.count),
                "total_ms": round(sum(self.total_ns) / 1e6, 3)}
