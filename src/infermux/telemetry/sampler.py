"""The background sampler: one thread reads every source at a fixed rate into a bounded buffer.

- Sources are probed in a fixed, documented order (`probe_sources`): NVML GPUs, then a Jetson
  board's sysfs, then the host CPU (psutil, RAPL). One that cannot run adds a note saying why;
  when none can, the empty stand-in keeps the API the same.
- `start()` returns once the first tick is in the buffer (the ready handshake), so a window
  opened right after it is bracketed; `stop()` takes a last tick, closes the sources and joins
  the thread, exactly once (also at garbage collection or interpreter exit).
- The buffer is a ring: at 10 Hz the default holds two hours; older ticks are dropped and
  counted, never grown without bound.
- The thread runs at a lower priority (nice +10) and measures its own cost (CPU and wall time
  per tick) so every result can show what observing it cost: a CPU-only tick takes about
  0.3 ms of CPU on a 2-core virtual machine, 0.3% of one core at 10 Hz.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from infermux.errors import RunError, UsageError
from infermux.telemetry.base import EmptySource, Source, SourceUnavailable, Tick

__all__ = ["DEFAULT_INTERVAL_S", "Sampler", "SamplerCost", "probe_sources"]

DEFAULT_INTERVAL_S = 0.1
#: How long the default ring buffer covers, in seconds of ticks.
DEFAULT_BUFFER_S = 7200.0


def probe_sources(units: Iterable[Any] | None = None, notes: list[str] | None = None) -> list[Source]:
    """The sources for `units` (Unit records; None = everything this machine has), in order.

    Order: 1. NVML, for the CUDA units' GPUs (all GPUs when `units` is None); 2. the Jetson
    board, when this is one (its GPU and DLAs have no NVML); 3. the host CPU, always (every
    run uses it, if only to feed an accelerator). Reasons a source is missing go to `notes`.
    """
    from infermux.telemetry.cpu import CpuSource
    from infermux.telemetry.jetson import JetsonSource
    from infermux.telemetry.nvml import NvmlSource

    notes = notes if notes is not None else []
    unit_list = list(units) if units is not None else None
    sources: list[Source] = []
    jetson: Source | None = None
    try:
        jetson = JetsonSource()
    except SourceUnavailable as exc:
        notes.append(str(exc))
    cuda = None if unit_list is None else sorted(
        {u.index for u in unit_list if u.kind == "cuda"})
    if jetson is None and (cuda is None or cuda):
        try:
            sources.append(NvmlSource(cuda))
        except SourceUnavailable as exc:
            notes.append(str(exc))
    if jetson is not None:
        sources.append(jetson)
    cores: list[int] | None = None
    if unit_list is not None:
        cpu_units = [u for u in unit_list if u.kind in ("cpu", "openvino")]
        if cpu_units and all(u.cores for u in cpu_units):
            cores = sorted({c for u in cpu_units for c in u.cores})
    sources.append(CpuSource(cores))
    for source in sources:
        notes.extend(source.notes)
    return sources


@dataclass(frozen=True)
class SamplerCost:
    """What sampling cost: ticks taken, the thread's CPU and wall time, per tick and overall."""

    ticks: int
    cpu_s: float
    wall_s: float
    elapsed_s: float

    @property
    def cpu_per_tick_us(self) -> float:
        """Mean CPU time of one tick, µs."""
        return self.cpu_s / self.ticks * 1e6 if self.ticks else 0.0

    @property
    def wall_per_tick_us(self) -> float:
        """Mean wall time of one tick, µs."""
        return self.wall_s / self.ticks * 1e6 if self.ticks else 0.0

    @property
    def cpu_share_pct(self) -> float:
        """The sampler's CPU time as a share of one core over its life, %."""
        return 100.0 * self.cpu_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        """JSON-ready figures."""
        return {"ticks": self.ticks, "cpu_s": self.cpu_s, "wall_s": self.wall_s,
                "cpu_per_tick_us": self.cpu_per_tick_us,
                "wall_per_tick_us": self.wall_per_tick_us,
                "cpu_share_pct": self.cpu_share_pct}


class _Shared:
    """State shared by the sampler object and its thread.

    The thread never holds the sampler object, so an abandoned sampler is collected and its
    finalizer stops the thread.
    """

    def __init__(self, sources: list[Source], interval_s: float, capacity: int) -> None:
        self.sources = sources
        self.interval_s = interval_s
        self.buffer: deque[Tick] = deque(maxlen=capacity)
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.stop = False
        self.poke = 0
        self.seq = 0
        self.dropped = 0
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.notes: list[str] = []
        self.cpu_ns = 0
        self.wall_ns = 0
        self.started_ns = 0
        self.stopped_ns = 0
        self.failed: set[str] = set()

    def tick(self) -> None:
        wall0, cpu0 = time.perf_counter_ns(), time.thread_time_ns()
        readings = []
        for source in self.sources:
            try:
                readings.extend(source.read())
            except Exception as exc:  # noqa: BLE001 - one broken source must not stop the rest
                if source.name not in self.failed:
                    self.failed.add(source.name)
                    self.notes.append(f"{source.name}: read failed: {type(exc).__name__}: {exc}")
        cost_cpu = time.thread_time_ns() - cpu0
        cost_wall = time.perf_counter_ns() - wall0
        with self.lock:
            if len(self.buffer) == self.buffer.maxlen:
                self.dropped += 1
            self.buffer.append(Tick(self.seq, wall0, readings, cost_wall, cost_cpu))
            self.seq += 1
            self.cpu_ns += cost_cpu
            self.wall_ns += cost_wall
            self.wake.notify_all()

    def run(self) -> None:
        # Lower this thread's priority (Linux: per-thread nice) so that on a busy machine the
        # measured work, not the observer, gets the core; tick times are taken when the tick
        # runs, so a late tick costs resolution, not accuracy.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            self.started_ns = time.perf_counter_ns()
            self.tick()
            self.ready.set()
            next_ns = self.started_ns + int(self.interval_s * 1e9)
            seen_poke = 0
            while True:
                with self.lock:
                    while not self.stop and self.poke == seen_poke:
                        remaining = (next_ns - time.perf_counter_ns()) / 1e9
                        if remaining <= 0:
                            break
                        self.wake.wait(remaining)
                    if self.stop:
                        break
                    seen_poke = self.poke
                self.tick()
                now = time.perf_counter_ns()
                next_ns += int(self.interval_s * 1e9)
                if next_ns <= now:  # fell behind (a slow read, a paused VM): don't burst
                    next_ns = now + int(self.interval_s * 1e9)
            self.tick()  # the last tick brackets a window that ends at stop()
        except BaseException as exc:  # noqa: BLE001 - reported to the owner's thread
            self.error = exc
        finally:
            self.stopped_ns = time.perf_counter_ns()
            self.ready.set()
            _close_all(self.sources)


def _close_all(sources: list[Source]) -> None:
    for source in sources:
        with contextlib.suppress(Exception):  # closing is best effort
            source.close()


def _shutdown(shared: _Shared, thread: threading.Thread) -> None:
    with shared.lock:
        shared.stop = True
        shared.wake.notify_all()
    if thread.ident is None:  # never started: the thread would have closed the sources
        _close_all(shared.sources)
    elif thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout=10)


class Sampler:
    """Samples `sources` every `interval_s` in a named background thread.

    Use as a context manager::

        with Sampler.for_units(units) as sampler:
            t0 = time.perf_counter_ns(); work(); t1 = time.perf_counter_ns()
            summary = sampler.window(t0, t1).summary(items=n)
    """

    def __init__(
        self,
        sources: Sequence[Source] | None = None,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        capacity: int | None = None,
        notes: Sequence[str] = (),
    ) -> None:
        if not 0.001 <= interval_s <= 60:
            raise UsageError(
                f"telemetry interval {interval_s}s is out of range: use 0.001s to 60s, e.g. 0.1s")
        if capacity is not None and capacity < 2:
            raise UsageError(f"telemetry buffer of {capacity} ticks is too small: use 2 or more")
        self.notes = list(notes)
        if sources is None:
            sources = probe_sources(notes=self.notes)
        chosen = list(sources) or [EmptySource(self.notes or None)]
        self.interval_s = interval_s
        self.capacity = capacity or max(2, int(DEFAULT_BUFFER_S / interval_s))
        self._shared = _Shared(chosen, interval_s, self.capacity)
        self._thread = threading.Thread(target=self._shared.run, name="infermux-telemetry",
                                        daemon=True)
        self._finalizer = weakref.finalize(self, _shutdown, self._shared, self._thread)
        self._started = False

    @classmethod
    def for_units(cls, units: Iterable[Any], **kwargs: Any) -> Sampler:
        """A sampler for the sources that observe `units` (see `probe_sources`)."""
        notes: list[str] = []
        sources = probe_sources(units, notes)
        return cls(sources, notes=notes, **kwargs)

    @property
    def sources(self) -> list[Source]:
        """The sources read, in probe order."""
        return list(self._shared.sources)

    def describe(self) -> dict[str, Any]:
        """What is sampled, how often, and every note on what is missing."""
        return {
            "interval_s": self.interval_s,
            "capacity": self.capacity,
            "sources": [s.describe() for s in self._shared.sources],
            "notes": self.notes + self._shared.notes,
        }

    def start(self, timeout_s: float = 10.0) -> Sampler:
        """Start the thread and wait until the first tick is buffered (the ready handshake)."""
        if self._started:
            raise RunError("this telemetry sampler was already started; create a new one")
        self._started = True
        self._thread.start()
        if not self._shared.ready.wait(timeout_s):
            self.stop()
            raise RunError(f"telemetry sampler gave no first reading within {timeout_s:g}s")
        if self._shared.error is not None:
            raise RunError(f"telemetry sampler failed to start: {self._shared.error}") from (
                self._shared.error)
        return self

    def stop(self) -> None:
        """Take a last tick, close the sources and join the thread; later calls do nothing."""
        self._finalizer()

    @property
    def running(self) -> bool:
        """Whether the thread is sampling."""
        return self._thread.is_alive()

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def flush(self, timeout_s: float = 2.0) -> Tick | None:
        """Take a tick now (from the sampler thread) and return it; None if not running."""
        shared = self._shared
        if not self.running:
            return self.latest()
        with shared.lock:
            target = shared.seq + 1
            shared.poke += 1
            shared.wake.notify_all()
            deadline = time.monotonic() + timeout_s
            while shared.seq < target and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                shared.wake.wait(left)
            return shared.buffer[-1] if shared.buffer else None

    def latest(self) -> Tick | None:
        """The newest tick, or None before the first."""
        with self._shared.lock:
            return self._shared.buffer[-1] if self._shared.buffer else None

    def ticks(self, t0_ns: int | None = None, t1_ns: int | None = None) -> list[Tick]:
        """A copy of the buffered ticks, or those within [t0_ns, t1_ns] and one either side.

        The tick just before and just after let integration interpolate at both ends.
        """
        with self._shared.lock:
            ticks = list(self._shared.buffer)
        if t0_ns is None and t1_ns is None:
            return ticks
        lo = t0_ns if t0_ns is not None else ticks[0].t_ns if ticks else 0
        hi = t1_ns if t1_ns is not None else ticks[-1].t_ns if ticks else 0
        before = [t for t in ticks if t.t_ns < lo]
        inside = [t for t in ticks if lo <= t.t_ns <= hi]
        after = [t for t in ticks if t.t_ns > hi]
        return before[-1:] + inside + after[:1]

    def window(self, t0_ns: int, t1_ns: int, *, flush: bool = True) -> Any:
        """The telemetry of [t0_ns, t1_ns] (`time.perf_counter_ns` clock) as a `TelemetryWindow`.

        With `flush` (default), a tick is taken first if none is yet after `t1_ns`, so the
        window's end is bracketed.
        """
        from infermux.telemetry.energy import TelemetryWindow

        if t1_ns < t0_ns:
            raise UsageError(f"telemetry window ends ({t1_ns}) before it starts ({t0_ns})")
        latest = self.latest()
        if flush and (latest is None or latest.t_ns <= t1_ns):
            self.flush()
        return TelemetryWindow(t0_ns, t1_ns, self.ticks(t0_ns, t1_ns), self.cost(),
                               self.describe())

    @property
    def dropped(self) -> int:
        """Ticks dropped from the front of the full ring buffer."""
        return self._shared.dropped

    def cost(self) -> SamplerCost:
        """The sampler's own cost so far."""
        shared = self._shared
        end = shared.stopped_ns or time.perf_counter_ns()
        elapsed = (end - shared.started_ns) / 1e9 if shared.started_ns else 0.0
        with shared.lock:
            return SamplerCost(shared.seq, shared.cpu_ns / 1e9, shared.wall_ns / 1e9, elapsed)
