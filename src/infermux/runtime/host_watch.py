"""Whole-host stalls, seen from a process that does none of the plan's work.

On some hosts the whole machine stops now and then: on H200 hosts run as virtual machines, the
load generator ran 229-346 ms late and single batches took 350-408 ms on the device in four of
eleven find-peak rounds, while the same plan held its rate before and after. A 3 s server trial
at 20k queries/s has 60k queries; a stall that long puts several thousand of them over a 15 ms
bound and decides the trial's p99. Such a trial measured the host, not the plan.

The runtime's own threads cannot tell that stall from their own slowness: they share the
interpreter lock with everything the plan does. `HostWatch` starts a small child interpreter
that imports nothing of infermux, sleeps `TICK_S` at a time and reports each wake-up that came
more than `REPORT_MS` late, as a pair of `CLOCK_MONOTONIC` times (the clock the load
generator's `time.perf_counter_ns` reads, shared by every process of the host). Its sleeps
hold no lock of the runtime's and it runs no work of the plan's, so a long gap in it means the
host stopped scheduling it: the hypervisor paused the machine, or something outside the plan
took every core. `HostWatch.during(start_ns, end_ns, at_least_ms)` gives the gaps that overlap
a trial.

The peak search (`load.scenarios.find_peak`, `disturbed=`) runs a failed trial again when a
gap at least as long as the bound overlapped it, a bounded number of times, and reports every
such trial and its gap; an offline trial with such a gap is run again too, since a stall
lowers the offline figure the peak is divided by (`runtime.peak.run_load`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import IO, Any

__all__ = ["REPORT_MS", "TICK_S", "HostWatch"]

#: The child's sleep between looks at the clock.
TICK_S = 0.002
#: Gaps past a tick longer than this are reported by the child (the search filters further).
REPORT_MS = 5.0

#: The child: sleep, look at the clock, report late wake-ups; leave when the parent is gone.
_CHILD = """
import os, sys, time
tick, least, parent = float(sys.argv[1]), int(float(sys.argv[2]) * 1e6), int(sys.argv[3])
tick_ns = int(tick * 1e9)
print("ready", flush=True)
prev = time.perf_counter_ns()
checked = prev
while True:
    time.sleep(tick)
    now = time.perf_counter_ns()
    if now - prev - tick_ns >= least:
        print(prev, now, flush=True)
    prev = now
    if now - checked > 1_000_000_000:
        checked = now
        if os.getppid() != parent:
            break
"""


class HostWatch:
    """A child process that reports when the whole host stopped; a context manager.

    `gaps` holds `(start_ns, end_ns)` of each late wake-up the child reported. Where the child
    cannot start (no interpreter to run, a host that forbids new processes), `available` is False
    and `during` finds nothing: the search then runs as it did without the watch.
    """

    def __init__(self, tick_s: float = TICK_S, report_ms: float = REPORT_MS) -> None:
        self.tick_s = tick_s
        self.report_ms = report_ms
        self.gaps: list[tuple[int, int]] = []
        self.available = False
        self.error: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> HostWatch:
        """Start the child and wait until it watches (a second at most)."""
        if self._proc is not None:
            return self
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _CHILD, str(self.tick_s), str(self.report_ms),
                 str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, bufsize=1)
        except OSError as exc:
            self.error = f"the host watch could not start: {exc}"
            return self
        assert self._proc.stdout is not None
        first = self._proc.stdout.readline().strip()
        if first != "ready":
            self.error = f"the host watch did not start (it said {first!r})"
            self.stop()
            return self
        self.available = True
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,),
                                        name="infermux-host-watch", daemon=True)
        self._reader.start()
        return self

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            parts = line.split()
            if len(parts) != 2:
                continue
            try:
                gap = (int(parts[0]), int(parts[1]))
            except ValueError:
                continue
            with self._lock:
                self.gaps.append(gap)

    def stop(self) -> None:
        """Stop the child (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait(5.0)
        if proc.stdout is not None:
            proc.stdout.close()
        if self._reader is not None:
            self._reader.join(1.0)

    def __enter__(self) -> HostWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def during(self, start_ns: int, end_ns: int, at_least_ms: float = 0.0
               ) -> dict[str, Any] | None:
        """The gaps of at least `at_least_ms` overlapping `[start_ns, end_ns]`, or None.

        Gaps the child reports only when it wakes: a stall still going on at `end_ns` is
        seen once it ends, so a caller asks after the trial has ended. The length is the
        wake-up's lateness (the gap less one tick).
        """
        tick_ns = int(self.tick_s * 1e9)
        with self._lock:
            hits = [(a, b) for a, b in self.gaps
                    if b > start_ns and a < end_ns and (b - a - tick_ns) >= at_least_ms * 1e6]
        if not hits:
            return None
        lengths = [(b - a - tick_ns) / 1e6 for a, b in hits]
        return {"stalls": len(hits), "longest_ms": round(max(lengths), 3),
                "total_ms": round(sum(lengths), 3),
                "at_s": round((hits[lengths.index(max(lengths))][0] - start_ns) / 1e9, 3)}

    def wait_caught_up(self, timeout_s: float = 0.1) -> None:
        """Give the child a moment to report a gap that ended just now (one tick and a bit)."""
        time.sleep(min(timeout_s, max(2 * self.tick_s, 0.005)))
