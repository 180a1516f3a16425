"""Restarting failed workers of a running runtime, a bounded number of times each.

A worker fails when a batch raises (its engine failed) or when its process dies (killed by a
signal, crashed). The dispatcher takes it out of service and tells the supervisor
(a `failures` subscription of `LocalRuntime`); a child process that dies between batches is noticed here by
polling (`ProcessHost.exited`). The supervisor then restarts the worker on its own thread, after
a short backoff that doubles with each restart, at most `max_restarts` times per worker within
any `window_s`; past that the worker stays out of service (`WorkerState.error` says why) until
its oldest restart leaves the window, and, if nothing else serves its model, the model is not
ready meanwhile. A budget per window, not per lifetime: a worker that failed three times in a
week is not left down for good.

A batch that raised while the worker stayed healthy (it ran a batch of its own samples right
after) is the input's fault, not the worker's: the worker never reports it here
(`Dispatcher.rejected`).

While a worker whose *process died* is being restarted, the items it held and its model's queue
wait for it (`Dispatcher.will_restart`): nothing in them was wrong. An item is still tried at
most `max_retries + 1` times, so an input that kills the process every time is given up on. A
batch that *raised* is not held: its items are retried on other workers or answered with the
error, as without a supervisor, and the worker is restarted for the requests that follow.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from infermux.runtime.api import LocalRuntime, Subscription
from infermux.runtime.dispatcher import WorkerState
from infermux.runtime.process_host import WorkerDiedError

__all__ = ["Supervisor"]


class Supervisor:
    """Watches a `LocalRuntime` (`start_runtime`'s) and restarts its failed workers."""

    def __init__(self, runtime: LocalRuntime, *, max_restarts: int = 3, backoff_s: float = 0.5,
                 poll_s: float = 0.25, restart_timeout_s: float = 300.0,
                 window_s: float = 600.0, clock_s: Callable[[], float] = time.monotonic,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.runtime = runtime
        self.max_restarts = max_restarts
        #: The window `max_restarts` counts over, and the clock it is read on.
        self.window_s = window_s
        self.clock_s = clock_s
        self.backoff_s = backoff_s
        self.poll_s = poll_s
        self.restart_timeout_s = restart_timeout_s
        self.on_event = on_event
        #: Every restart tried: {"worker", "attempt", "ok", "error", "took_s"}.
        self.history: list[dict[str, Any]] = []
        self._failed: queue.Queue[int] = queue.Queue()
        #: When each worker's restarts within the window began (oldest first).
        self._attempts: dict[int, deque[float]] = {}
        #: Workers out of restarts for now, with when the window lets the next one begin.
        self._deferred: dict[int, float] = {}
        #: Workers whose restart has begun (their attempt is already counted).
        self._begun: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="infermux-supervisor",
                                        daemon=True)
        self._subscription: Subscription | None = None

    def start(self) -> Supervisor:
        """Begin watching: failed workers are told to it through a subscription."""
        rt = self.runtime
        self._subscription = rt.subscribe(failures=self._on_failed)
        rt.set_restart_policy(self._will_restart)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop restarting; workers still waiting for a restart give their items up."""
        self._stop.set()
        self._failed.put(-1)
        self._thread.join(timeout_s)
        rt = self.runtime
        rt.set_restart_policy(None)
        if self._subscription is not None:
            self._subscription.cancel()
        for w in list(rt.workers()):
            if w.restarting:
                rt.give_up(w, f"{w.error or 'failed'}; the server stopped before its restart")

    def used(self, w: WorkerState) -> int:
        """Restarts of `w` begun within the last `window_s`."""
        times = self._attempts.get(w.id)
        if not times:
            return 0
        since = self.clock_s() - self.window_s
        while times and times[0] <= since:
            times.popleft()
        return len(times)

    def restartable(self, w: WorkerState) -> bool:
        """Whether `w` may be restarted now (a restartable worker with restarts left in the window)."""
        return (self.runtime.restartable(w.id) and self.used(w) < self.max_restarts
                and not self._stop.is_set())

    def describe(self, w: WorkerState) -> str:
        """A failed worker's state in words, for a not-ready answer."""
        if w.restarting or (not w.alive and self.restartable(w)):
            attempt = self.used(w) + (0 if w.id in self._begun else 1)
            return (f"worker {w.name} is restarting (restart {attempt} of {self.max_restarts} "
                    f"within {self.window_s:g}s) after: {w.error}")
        if not w.alive and self.max_restarts and self.runtime.restartable(w.id):
            when = self._deferred.get(w.id)
            later = "" if when is None else \
                f"; the next restart in {max(0.0, when - self.clock_s()):.0f}s"
            return (f"worker {w.name} failed and was restarted {self.used(w)} times within "
                    f"{self.window_s:g}s, the most allowed{later}: {w.error}")
        return f"last error: {w.error}"

    # -- the dispatcher's hooks (any thread) -----------------------------------------------

    def _will_restart(self, w: WorkerState, exc: BaseException) -> bool:
        return isinstance(exc, WorkerDiedError) and self.restartable(w)

    def _on_failed(self, w: WorkerState) -> None:
        self._failed.put(w.id)

    # -- the supervisor's thread -------------------------------------------------------------

    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                wid = self._failed.get(timeout=self.poll_s)
            except queue.Empty:
                self._watch_processes()
                self._retry_deferred()
                continue
            if wid < 0 or self._stop.is_set():
                return
            self._restart(self.runtime.worker(wid))

    def _watch_processes(self) -> None:
        """Fail a worker whose child process died while it held no batch."""
        for w, death in self.runtime.dead_processes():
            self.runtime.fail_idle(w, WorkerDiedError(f"worker {w.name}: {death}"))

    def _defer(self, w: WorkerState) -> None:
        """Restart `w` again once its oldest restart leaves the window."""
        times = self._attempts.get(w.id)
        if times and self.runtime.restartable(w.id) and not self._stop.is_set():
            self._deferred[w.id] = times[0] + self.window_s

    def _retry_deferred(self) -> None:
        """Restart a worker that was out of restarts once the window allows one again."""
        now = self.clock_s()
        for wid, when in list(self._deferred.items()):
            if now >= when:
                del self._deferred[wid]
                self._failed.put(wid)

    def _restart(self, w: WorkerState) -> None:
        if not self.restartable(w):
            if w.restarting or not w.alive:
                self.runtime.give_up(w, w.error or "failed")
                self._defer(w)
            return
        self._attempts.setdefault(w.id, deque()).append(self.clock_s())
        attempt = self.used(w)
        self._begun.add(w.id)
        try:
            self._attempt(w, attempt)
        finally:
            self._begun.discard(w.id)

    def _attempt(self, w: WorkerState, attempt: int) -> None:
        rt = self.runtime
        rt.mark_restarting(w)
        self._event({"event": "worker_restarting", "worker": w.name, "attempt": attempt,
                     "error": w.error})
        if self._stop.wait(self.backoff_s * 2 ** (attempt - 1)):
            return
        started = time.perf_counter()
        try:
            self.runtime.restart_worker(w.id, self.restart_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed restart is one attempt used
            error = f"restart {attempt} failed: {exc}"
            self.history.append({"worker": w.name, "attempt": attempt, "ok": False,
                                 "error": error, "took_s": time.perf_counter() - started})
            rt.set_error(w, error)
            self._event({"event": "worker_restart_failed", "worker": w.name, "error": error})
            if self.restartable(w):
                self._failed.put(w.id)  # try again, later
            else:
                rt.give_up(w, error)
                self._defer(w)
            return
        self.history.append({"worker": w.name, "attempt": attempt, "ok": True, "error": None,
                             "took_s": time.perf_counter() - started})
        self._event({"event": "worker_restarted", "worker": w.name, "attempt": attempt})

    def _event(self, event: dict[str, Any]) -> None:
        if self.on_event is not None:
            with contextlib.suppress(Exception):
                self.on_event(event)

    def summary(self) -> dict[str, Any]:
        """Restarts per worker, for the stored run."""
        out: dict[str, Any] = {}
        for h in self.history:
            row = out.setdefault(h["worker"], {"restarts": 0, "failed_restarts": 0, "errors": []})
            row["restarts" if h["ok"] else "failed_restarts"] += 1
            if h["error"]:
                row["errors"].append(h["error"])
        return out
