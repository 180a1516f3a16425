"""One node's side: an infermux runtime inside a Ray actor, fed and polled by the driver.

`NodeRuntime` is a plain class; the driver wraps it with `ray.remote` (a threaded actor, so a
poll that waits for completions never blocks a submit) and pins it to its node. Under a load
generator only query ids, sample indices and counts cross between driver and node; each node
builds its own seeded sample library, as a CPU worker's child process does. A node started for
serving (`start(..., serving=True)`) takes parts that carry their requests' input rows (Ray
passes large arrays through its object store) and sends each batch's output rows back with
the sample indices they answer, in the next poll's answer.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from infermux.errors import InfermuxError

if TYPE_CHECKING:
    from infermux.runtime.api import LocalRuntime
    from infermux.runtime.dispatcher import Batch, WorkerState

__all__ = ["NodeRuntime"]


class NodeRuntime:
    """The runtime of one node's local plan, driven from outside (a LoadGen SUT at a distance)."""

    def __init__(self, name: str) -> None:
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        self.name = name
        self.rt: LocalRuntime | None = None
        self._cond = threading.Condition()
        self._done: dict[tuple[int, bool], int] = defaultdict(int)
        self._completed_items = 0
        self._failed_items = 0
        self._submitted_items = 0
        #: The earliest completion not yet polled (how long answers wait to reach the driver).
        self._first_done_ns = 0
        #: Serving: output rows not yet polled, as (query id, sample indices, arrays), and the
        #: executed batches as (worker index, items, queue ns, compute ns) for the statistics.
        self.serving = False
        self._outputs: list[tuple[int, list[int], list[np.ndarray]]] = []
        self._batches: list[tuple[int, int, int, int]] = []
        #: Serving: (query id, message) of requests whose own input the engine rejected (the
        #: worker serves on); the driver fails them alone instead of trying another node.
        self._rejected: list[tuple[int, str]] = []
        self._worker_index: dict[int, int] = {}
        self._supervisor: Any = None

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

    def start(self, plan: dict[str, Any], serving: bool = False, max_restarts: int = 0,
              take_when_idle: bool = True) -> dict[str, Any]:
        """Build and start the plan's workers; their capacity per model, or the error.

        Errors come back as data (`error`, `usage`) rather than raised, so the driver can name
        the node in one line without Ray's traceback around it. `serving`: queries carry their
        own input rows and their outputs go back in the poll answers; a failed worker is then
        restarted up to `max_restarts` times, and an idle worker takes a partial batch at once
        unless `take_when_idle` is off, as `infermux serve` does on one machine.
        """
        from infermux.runtime.plan import parse_plan
        from infermux.runtime.session import start_runtime

        try:
            # The batch records of a server that runs for days are not kept: the statistics
            # go to the driver in the poll answers instead.
            rt = start_runtime(parse_plan(plan, source=f"node {self.name}'s plan"),
                               record_batches=not serving)
        except InfermuxError as exc:
            return {"error": str(exc), "usage": exc.exit_code == 2}
        self.rt = rt
        if serving:
            self.serving = True
            self._worker_index = {s.id: i for i, s in enumerate(rt.workers())}
            rt.subscribe(completions=self._on_complete, outputs=self._on_outputs,
                         batches=self._on_batch, rejections=self._on_rejected)
            rt.set_take_when_idle(take_when_idle)
            if max_restarts:
                from infermux.runtime.supervisor import Supervisor

                self._supervisor = Supervisor(rt, max_restarts=max_restarts).start()
        else:
            rt.subscribe(completions=self._on_complete)
        return {"build": rt.build_info, "capacity": self.capacity(), "facts": self.facts(),
                "buckets": {s.name: s.buckets for s in rt.workers()},
                "hold": self.hold_items(), "batch": self.batches(),
                "input_shapes": {m.name: list(rt.input_shape(m.name)) for m in rt.plan.models},
                "workers": self.workers()}

    def capacity(self) -> dict[str, float]:
        """Items/s per model its live workers can do, from their latency estimates."""
        out: dict[str, float] = defaultdict(float)
        for s in self.rt.workers() if self.rt is not None else []:
            if not s.alive:
                continue
            est = s.estimate.expected_ns(s.batch, s.model)
            if est > 0:
                out[s.model] += s.batch / (est / 1e9)
        return dict(out)

    def hold_items(self) -> dict[str, int]:
        """Items per model the live workers can hold at once (the driver sizes backlogs by it)."""
        out: dict[str, int] = defaultdict(int)
        for s in self.rt.workers() if self.rt is not None else []:
            if s.alive:
                out[s.model] += s.batch * s.depth
        return dict(out)

    def batches(self) -> dict[str, int]:
        """The largest batch per model of its live workers (the driver routes whole batches)."""
        out: dict[str, int] = {}
        for s in self.rt.workers() if self.rt is not None else []:
            if s.alive:
                out[s.model] = max(out.get(s.model, 0), s.batch)
        return out

    def workers(self) -> list[dict[str, Any]]:
        """Each worker's name, unit, model, batch sizes, depth, liveness and error."""
        return [{"name": s.name, "unit": s.unit, "model": s.model, "buckets": s.buckets,
                 "serves": sorted(s.serves), "depth": s.depth, "alive": s.alive,
                 "restarting": s.restarting, "error": s.error, "restarts": s.restarts}
                for s in (self.rt.workers() if self.rt is not None else [])]

    def _rt(self) -> LocalRuntime:
        if self.rt is None:
            raise InfermuxError(f"node {self.name}: its runtime is not started")
        return self.rt

    # -- a trial ---------------------------------------------------------------------------

    def begin_trial(self) -> int:
        """Empty the queues and counters for a new trial; the items dropped."""
        dropped = self._rt().begin_trial()
        with self._cond:
            self._done.clear()
            self._completed_items = self._failed_items = self._submitted_items = 0
            self._rejected.clear()
        return int(dropped)

    def submit(self, queries: Sequence[tuple[Any, ...]]) -> int:
        """Queue parts; the clock when they were queued.

        A part is `(query id, model, sample indices)`, or with a fourth element, the input rows
        of those samples in order (a served request's): their outputs come back in `poll`.
        """
        from infermux.load.base import Query

        self._rt().submit([Query(p[0], p[1], tuple(p[2]), p[3] if len(p) > 3 else None)
                                   for p in queries])
        with self._cond:
            self._submitted_items += sum(len(p[2]) for p in queries)
        return time.perf_counter_ns()

    def end(self) -> None:
        """No more queries this trial: partial batches go at once."""
        self._rt().end()

    def _on_outputs(self, batch: Batch, outputs: list[np.ndarray]) -> None:
        """A served batch's output rows, split by query (copies: the runner reuses its buffers)."""
        per: dict[int, tuple[list[int], list[int]]] = {}
        for i, it in enumerate(batch.items):
            pos, samples = per.setdefault(it.query, ([], []))
            pos.append(i)
            samples.append(it.sample)
        got = [(qid, samples, [np.ascontiguousarray(y[pos]) for y in outputs])
               for qid, (pos, samples) in per.items()]
        with self._cond:
            if not self._outputs and not self._done:
                self._first_done_ns = time.perf_counter_ns()
            self._outputs.extend(got)
            self._completed_items += len(batch.items)
            self._cond.notify_all()

    def _on_batch(self, w: WorkerState, batch: Batch, start_ns: int, end_ns: int, timing: Any) -> None:
        queue_ns = sum(batch.taken_ns - it.enqueued_ns for it in batch.items)
        with self._cond:
            self._batches.append((self._worker_index.get(w.id, -1), len(batch.items), queue_ns,
                                  end_ns - start_ns))

    def _on_rejected(self, queries: Sequence[int], message: str) -> None:
        """The engine rejected these served queries' own inputs (the runtime's input fault).

        Their failed completions follow; the driver reads this first, so it fails them alone.
        """
        with self._cond:
            self._rejected.extend((qid, message) for qid in queries)
            self._cond.notify_all()

    def _on_complete(self, done: Sequence[tuple[int, int]], ok: bool, when_ns: int) -> None:
        if ok and self.serving:
            return  # served samples are answered by their outputs (`_on_outputs`)
        with self._cond:
            if not self._done and not self._outputs:
                self._first_done_ns = when_ns
            for qid, n in done:
                self._done[(qid, ok)] += n
                if ok:
                    self._completed_items += n
                else:
                    self._failed_items += n
            self._cond.notify_all()

    def poll(self, wait_s: float, low_water: int = 0) -> dict[str, Any]:
        """Completions since the last poll, waiting up to `wait_s` for the first.

        With `low_water`, completions are held back (within `wait_s`) until fewer than that
        many submitted items are unfinished here, or a failure is to be told.

        `done`: (query id, samples, ok) triples; `outputs` (serving): (query id, sample
        indices, output arrays) of every batch finished since; `rejected` (serving): (query
        id, message) of queries whose own input the engine rejected; `queued`: items waiting per
        model; `clock_ns`: this node's clock when it answered, `waited_ns` how long it waited
        for completions (the driver estimates the clocks' offset from them) and `held_back_ns`
        how much of that was holding back completions it had (`low_water`).
        """
        called = time.perf_counter_ns()
        with self._cond:
            if not self._done and not self._outputs and not self._rejected:
                self._cond.wait(wait_s)
            # Offline, the answer may wait for more completions while the node still holds
            # `low_water` items unfinished: its workers have work, and one answer (then one
            # refill) serves several batches instead of each.
            deadline = called + int(wait_s * 1e9)
            held_from = time.perf_counter_ns()
            while (low_water and self._done and not self._outputs
                   and all(ok for _, ok in self._done)
                   and self._submitted_items - self._completed_items
                   - self._failed_items >= low_water):
                left = deadline - time.perf_counter_ns()
                if left <= 0:
                    break
                self._cond.wait(left / 1e9)
            waited = time.perf_counter_ns() - called
            held_back = time.perf_counter_ns() - held_from if low_water else 0
            done = [(q, n, ok) for (q, ok), n in self._done.items()]
            outputs, self._outputs = self._outputs, []
            batches, self._batches = self._batches, []
            rejected, self._rejected = self._rejected, []
            first = self._first_done_ns if done or outputs else 0
            self._done.clear()
            totals = {"completed": self._completed_items, "failed": self._failed_items,
                      "submitted": self._submitted_items}
        rt = self._rt()
        queued = rt.stats().queued_items
        states = list(rt.workers())
        alive = [s.alive for s in states]
        restarting = [s.restarting for s in states]
        answer = {"done": done, "queued": queued, "alive_workers": sum(alive), "totals": totals,
                  "first_done_ns": first, "waited_ns": waited, "held_back_ns": held_back,
                  "clock_ns": time.perf_counter_ns()}
        if self.serving:
            answer.update(outputs=outputs, batches=batches, rejected=rejected, alive=alive,
                          restarting=restarting, errors=[s.error for s in states])
        return answer

    def trial_records(self) -> dict[str, Any]:
        """The trial's batch records and worker states, for the driver's summary and store."""
        from infermux.runtime.metrics import records_array

        rt = self._rt()
        workers = [{"name": s.name, "unit": s.unit, "model": s.model, "buckets": s.buckets,
                    "alive": s.alive, "error": s.error, "failure": s.failure,
                    "estimate_ms": {str(b): v / 1e6 for b, v in s.estimate.snapshot(s.model).items()}}
                   for s in rt.workers()]
        counts = rt.trial_counts()
        return {"batches": records_array(counts.records), "workers": workers,
                "events": counts.events, "retried_items": counts.retried_items,
                "failed_items": counts.failed_items,
                "clock_ns": time.perf_counter_ns()}

    def shutdown(self) -> None:
        """Stop the workers (what is queued stays unfinished)."""
        if self._supervisor is not None:
            with contextlib.suppress(Exception):
                self._supervisor.stop()
            self._supervisor = None
        if self.rt is not None:
            self.rt.stop(drain=False)
            self.rt = None

