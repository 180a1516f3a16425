"""One node's side: an infermux runtime inside a Ray actor, fed and polled by the driver.

`NodeRuntime` is a plain class; the driver wraps it with `ray.remote` (a threaded actor, so a
poll that waits for completions never blocks a submit) and pins it to its node. Only query
ids, sample indices and counts cross between driver and node; each node builds its own seeded
sample library, as a CPU worker's child process does.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from infermux.errors import InfermuxError

__all__ = ["NodeRuntime"]


class NodeRuntime:
    """The runtime of one node's local plan, driven from outside (a LoadGen SUT at a distance)."""

    def __init__(self, name: str) -> None:
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        self.name = name
        self.rt: Any = None
        self._cond = threading.Condition()
        self._done: dict[tuple[int, bool], int] = defaultdict(int)
        self._completed_samples = 0
        self._failed_samples = 0
        self._submitted_samples = 0
        #: The earliest completion not yet polled (how long answers wait to reach the driver).
        self._first_done_ns = 0

    # -- set-up --------------------------------------------------------------------------

    def facts(self) -> dict[str, Any]:
        """Where this actor runs: host, pid, cores it may use, units discovered."""
        from infermux.units import discover

        found = discover(with_runtimes=False)
        return {"host": socket.gethostname(), "pid": os.getpid(),
                "cores": sorted(os.sched_getaffinity(0)),
                "units": [u.id for u in found.units]}

    def tune(self, models: list[dict[str, Any]], spec: dict[str, Any],
             load: dict[str, Any]) -> dict[str, Any]:
        """Tune the cluster's models on this node's units; the plan (a dict), or an error."""
        from infermux.models import ModelSpec
        from infermux.tune import TuneRequest, model_name, run_tune

        try:
            request = TuneRequest(
                models=[ModelSpec(m["model"], m.get("weights"),
                                  tuple(m["input_shape"]) if m.get("input_shape") else None)
                        for m in models],
                units=spec.get("units", "auto"), engines=spec.get("engines", "auto"),
                budget_s=float(spec.get("budget_s", 120.0)), batches=spec.get("batches"))
            report = run_tune(request)
        except InfermuxError as exc:
            return {"error": str(exc), "usage": exc.exit_code == 2}
        if report.plan is None:
            return {"error": f"node {self.name}: tuning found no runnable plan", "usage": False}
        plan = dict(report.plan)
        names = {model_name(m["model"]): m["name"] for m in models}
        plan["models"] = [{**e, "name": names.get(e["name"], e["name"])} for e in plan["models"]]
        plan["load"] = load
        return {"plan": plan}

    def start(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Build and start the plan's workers; their capacity per model, or the error.

        Errors come back as data (`error`, `usage`) rather than raised, so the driver can name
        the node in one line without Ray's traceback around it.
        """
        from infermux.runtime.plan import parse_plan
        from infermux.runtime.session import start_runtime

        try:
            rt = start_runtime(parse_plan(plan, source=f"node {self.name}'s plan"))
        except InfermuxError as exc:
            return {"error": str(exc), "usage": exc.exit_code == 2}
        self.rt = rt
        rt.dispatcher.set_completion(self._on_complete)
        return {"build": rt.build_info, "capacity": self.capacity(), "facts": self.facts(),
                "buckets": {s.name: s.buckets for s in rt.states}}

    def capacity(self) -> dict[str, float]:
        """Items/s per model its live workers can do, from their latency estimates."""
        out: dict[str, float] = defaultdict(float)
        for s in self.rt.states if self.rt is not None else []:
            if not s.alive:
                continue
            est = s.estimate.expected_ns(s.batch, s.model)
            if est > 0:
                out[s.model] += s.batch / (est / 1e9)
        return dict(out)

    def hold_items(self) -> dict[str, int]:
        """Items per model the live workers can hold at once (the driver sizes backlogs by it)."""
        out: dict[str, int] = defaultdict(int)
        for s in self.rt.states if self.rt is not None else []:
            if s.alive:
                out[s.model] += s.batch * s.depth
        return dict(out)

    # -- a trial ---------------------------------------------------------------------------

    def begin_trial(self) -> int:
        """Empty the queues and counters for a new trial; the items dropped."""
        dropped = self.rt.dispatcher.begin_trial()
        self.rt.recorder.reset()
        with self._cond:
            self._done.clear()
            self._completed_samples = self._failed_samples = self._submitted_samples = 0
        return int(dropped)

    def submit(self, queries: Sequence[tuple[int, str, Sequence[int]]]) -> int:
        """Queue `(query id, model, sample indices)` parts; the clock when they were queued."""
        from infermux.load.base import Query

        self.rt.dispatcher.submit([Query(q, m, tuple(s)) for q, m, s in queries])
        with self._cond:
            self._submitted_samples += sum(len(s) for _, _, s in queries)
        return time.perf_counter_ns()

    def end(self) -> None:
        """No more queries this trial: partial batches go at once."""
        self.rt.dispatcher.end()

    def _on_complete(self, done: Sequence[tuple[int, int]], ok: bool, when_ns: int) -> None:
        with self._cond:
            if not self._done:
                self._first_done_ns = when_ns
            for qid, n in done:
                self._done[(qid, ok)] += n
                if ok:
                    self._completed_samples += n
                else:
                    self._failed_samples += n
            self._cond.notify_all()

    def poll(self, wait_s: float) -> dict[str, Any]:
        """Completions since the last poll, waiting up to `wait_s` for the first.

        `done`: (query id, samples, ok) triples; `queued`: items waiting per model; `clock_ns`:
        this node's clock when it answered (the driver estimates the offset from it).
        """
        with self._cond:
            if not self._done:
                self._cond.wait(wait_s)
            done = [(q, n, ok) for (q, ok), n in self._done.items()]
            first = self._first_done_ns if done else 0
            self._done.clear()
            totals = {"completed": self._completed_samples, "failed": self._failed_samples,
                      "submitted": self._submitted_samples}
        d = self.rt.dispatcher
        with d.cond:
            queued = {m: d.queued(m) for m in d.models}
            alive = sum(1 for s in self.rt.states if s.alive)
        return {"done": done, "queued": queued, "alive_workers": alive, "totals": totals,
                "first_done_ns": first, "clock_ns": time.perf_counter_ns()}

    def trial_records(self) -> dict[str, Any]:
        """The trial's batch records and worker states, for the driver's summary and store."""
        from infermux.runtime.metrics import records_array

        rt = self.rt
        workers = [{"name": s.name, "unit": s.unit, "model": s.model, "buckets": s.buckets,
                    "alive": s.alive, "error": s.error, "failure": s.failure,
                    "estimate_ms": {str(b): v / 1e6 for b, v in s.estimate.snapshot(s.model).items()}}
                   for s in rt.states]
        with rt.dispatcher.cond:
            counts = {"retried_items": rt.dispatcher.retried,
                      "failed_items": rt.dispatcher.failed_items}
        return {"batches": records_array(list(rt.recorder.records)), "workers": workers,
                "events": [dict(e) for e in rt.dispatcher.events], **counts,
                "clock_ns": time.perf_counter_ns()}

    def shutdown(self) -> None:
        """Stop the workers (what is queued stays unfinished)."""
        if self.rt is not None:
            self.rt.shutdown(now=True)
            self.rt = None

