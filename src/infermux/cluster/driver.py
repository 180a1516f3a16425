"""The driver: one runtime per Ray node, queries routed by measured capacity, faults absorbed.

`run_cluster(plan, handle)` places a `NodeRuntime` actor on every node the plan names (pinned
with Ray's node affinity, holding the node's CPUs and GPUs its local plan uses), builds each
node's runtime, then drives the plan's LoadGen scenario through `ClusterSUT`:

- **Routing.** A query (or, for a query of many samples, each piece of one batch of the chosen
  node) goes to the node that would finish it first: what the node holds over its measured
  rate for the model (a moving average of completions while busy, seeded by the node's own
  latency estimates after its build). Pieces for one node go in one `submit` call (a per-node
  outbox, sent by whoever routed unless a send is under way). Offline, the generator keeps a
  node's holding plus a batch on the way per node (`capacity_items`), twice over, so a node's
  queue never runs dry while completions and refills travel. Inside a node, the runtime's
  dispatcher pulls as on one machine.
- **Polling.** One driver thread keeps a poll outstanding on every node (`ray.wait`); a poll
  returns as soon as the node has completions (offline, once more than a batch beyond what its
  workers run is no longer queued there: one answer for about two batches). Completion times
  are the driver's own clock at receipt, so latency includes the way back, as a client would
  see it.
- **Serving** (`cluster/serve.py`). Queries that carry input rows take them along in their
  pieces; outputs come back in the poll answers with the sample indices they answer.
- **Faults.** A node whose poll fails (its actor or node died) or stays silent past
  `route.node_timeout_s` is taken out: every sample it held goes to another live node, at most
  `route.max_retries` times, else it is reported failed. Nothing is left unfinished or hanging;
  the node's row shows when it was lost and the per-node timeline shows the gap. A served
  request whose own input a node's engine rejected (the node's runtime tells the input's fault
  from the worker's) fails alone (`on_rejected`) and is tried on no other node.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infermux.cluster.connect import ClusterHandle
from infermux.cluster.node import NodeRuntime
from infermux.cluster.plan import ClusterPlan, NodeEntry
from infermux.errors import InfermuxError, RunError, UsageError, first_line
from infermux.load.base import CompletionFn, Query
from infermux.load.scenarios import LoadGenerator, ScenarioResult, find_peak
from infermux.runtime.dispatcher import Batch, Item, WorkerState
from infermux.runtime.metrics import BatchRecord, summarise
from infermux.runtime.placement import LatencyEstimate
from infermux.runtime.plan import Plan, parse_plan
from infermux.store import Store

__all__ = ["ClusterReport", "ClusterSUT", "NodeLink", "resolve_nodes", "run_cluster"]

ProgressFn = Callable[[str, float], None]


@dataclass
class NodeLink:
    """The driver's view of one node: its actor, plan, measured rate and what it holds."""

    name: str
    entry: str
    node_id: str
    address: str
    actor: Any
    plan: Plan | None
    models: set[str]
    #: items/s per model: seeded from the node's estimates, then a moving average of completions.
    rate: dict[str, float] = field(default_factory=dict)
    #: Items per model its live workers hold at once, and their largest batch (a piece).
    hold: dict[str, int] = field(default_factory=dict)
    batch: dict[str, int] = field(default_factory=dict)
    alive: bool = True
    #: query id -> [model, samples still out, sample indices]
    out: dict[int, list[Any]] = field(default_factory=dict)
    held: int = 0
    lost_at_ns: int = 0
    lost_reason: str | None = None
    completed: int = 0
    failed: int = 0
    #: Served samples failed here for their own input (the engine rejected it): not retried.
    rejected: int = 0
    rerouted: int = 0
    #: node clock minus driver clock, from the poll with the shortest round trip.
    offset_ns: int = 0
    best_rtt_ns: int = 1 << 62
    build: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    # the moving average's current window, per model: (items, busy ns)
    window: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    start_rate: dict[str, float] = field(default_factory=dict)
    #: What its runtime's start answered (input shapes per model, its workers).
    started: dict[str, Any] = field(default_factory=dict)
    #: When it joined a running plan (driver clock), 0 for the nodes it started with.
    joined_at_ns: int = 0


def ray_errors(ray: Any) -> tuple[type[BaseException], ...]:
    """What a call on a node can raise when the node or its actor is gone or silent."""
    return (ray.exceptions.RayError, ConnectionError, TimeoutError)


class ClusterSUT:
    """The whole cluster as one LoadGen system under test (or, serving, a server's runtime).

    Queries are cut into pieces of a node's batch for its model, each to the node that would
    finish it first. The pieces for one node wait in an outbox and go in one `submit` call:
    whoever routes sends the outbox unless a send is already under way, in which case that
    sender takes them on its next turn (so parts routed meanwhile coalesce, at no added delay).
    Served queries (`Query.inputs`) carry their rows: each piece takes its own rows along, the
    outputs come back with the sample indices they answer and go to `on_outputs` as a `Batch`
    of those samples; a node lost or failing sends the piece's rows again to another node.
    """

    def __init__(self, links: list[NodeLink], ray: Any, plan: ClusterPlan, *,
                 serving: bool = False) -> None:
        self.links = links
        self.ray = ray
        self.route = plan.route
        #: Per node, the unfinished items below which it answers a poll at once (offline with
        #: `route.coalesce_answers`; 0: at every completion). It keeps a batch queued beyond
        #: what its workers hold while the answer travels and the refill comes back.
        self.low_water: dict[str, int] = {
            ln.name: sum(ln.hold.get(m, 0) + 2 * ln.batch.get(m, 0) for m in ln.models)
            if (not serving and plan.load.scenario == "offline" and plan.route.coalesce_answers)
            else 0 for ln in links}
        self._coalesce = (not serving and plan.load.scenario == "offline"
                          and plan.route.coalesce_answers)
        self.lock = threading.Lock()
        self.serving = serving
        #: Keep the per-completion log and delay samples (a run's); a server does not, as it
        #: runs for days.
        self.keep_log = not serving
        self._on_complete: CompletionFn | None = None
        self._attempts: dict[int, int] = defaultdict(int)
        self._rr = 0
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        #: Polls out at the nodes: ref -> (node, sent ns)
        self._pending: dict[Any, tuple[NodeLink, int]] = {}
        self._ended = False
        #: Parts routed and not yet sent, per node index; `_send_lock` is held while sending.
        self._outbox: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
        self._send_lock = threading.Lock()
        #: Served queries: their input rows (row s is sample s) and samples not yet answered.
        self._rows: dict[int, Any] = {}
        self._left: dict[int, int] = {}
        #: Served outputs: (Batch of the samples answered, output arrays, a row per item).
        self.on_outputs: Callable[[Batch, list[np.ndarray]], None] | None = None
        #: Served queries whose own input a node's engine rejected, and its message (a
        #: server answers each 400): failed alone, never tried on another node.
        self.on_rejected: Callable[[list[int], str], None] | None = None
        #: Called with every node's poll answer once it is taken (a server's statistics).
        self.on_answer: Callable[[NodeLink, dict[str, Any]], None] | None = None
        #: Called with a node just taken out of service.
        self.on_node_lost: Callable[[NodeLink], None] | None = None
        #: (driver ns, node, samples) of every completion received: the per-node timeline.
        self.log: list[tuple[int, str, int]] = []
        self.events: list[dict[str, Any]] = []
        self.route_ns = 0
        self.routed_pieces = 0
        #: Submit calls made to nodes (one per node per send, whatever its pieces).
        self.node_calls = 0
        #: Submits in flight (ref, node, sent ns) and, once they answer, how long each took to
        #: be queued at its node (on the driver's clock): the way out, as `return_ns` is back.
        self._sent: list[tuple[Any, NodeLink, int]] = []
        self.to_node_ns: list[int] = []
        #: The driver's time handling poll answers, how many, and their round trips.
        self.answer_ns = 0
        self.answers = 0
        self.rtt_ns: list[int] = []
        #: From a node's first completion in an answer to the driver's receipt of the answer.
        self.return_ns: list[int] = []
        #: Samples sent again to another node after theirs was lost or failed them.
        self.retried = 0

    # -- the load generator's side ------------------------------------------------------------

    def start(self, on_complete: CompletionFn) -> None:
        """Begin polling every node; completions go to `on_complete`."""
        self._on_complete = on_complete
        self._stop.clear()
        self._poller = threading.Thread(target=self._poll_loop, name="infermux-cluster-poll",
                                        daemon=True)
        self._poller.start()

    def capacity_items(self, model: str) -> int:
        """Items the live nodes hold at once for `model`, plus a batch each on the way.

        The offline generator keeps twice this outstanding, so every node's queue holds at
        least a batch beyond what its workers run even while completions travel back to the
        driver and the refill travels out: its workers never wait on the driver.
        """
        with self.lock:
            return sum(ln.hold.get(model, 0) + ln.batch.get(model, 0)
                       for ln in self.links if ln.alive)

    def issue(self, queries: Sequence[Query]) -> None:
        """Route every query's samples to nodes and send each node its parts in one call."""
        started = time.perf_counter_ns()
        failed: list[tuple[int, int]] = []
        with self.lock:
            self._route(queries, failed)
        self._flush()
        self.route_ns += time.perf_counter_ns() - started
        if failed:
            self._report(failed, ok=False)

    def end(self) -> None:
        """No more queries: nodes flush partial batches."""
        self._ended = True
        self._flush()
        for ln in self._live():
            with contextlib.suppress(Exception):
                ln.actor.end.remote()

    def add_link(self, ln: NodeLink) -> None:
        """A node that joined (started and measured): routed to from now on."""
        low = (sum(ln.hold.get(m, 0) + 2 * ln.batch.get(m, 0) for m in ln.models)
               if self._coalesce else 0)
        with self.lock:
            self.low_water[ln.name] = low
            self.links = [*self.links, ln]
        if self._ended:
            with contextlib.suppress(Exception):
                ln.actor.end.remote()

    # -- routing ----------------------------------------------------------------------------

    def _live(self) -> list[NodeLink]:
        return [ln for ln in self.links if ln.alive]

    def _route(self, queries: Sequence[Query], failed: list[tuple[int, int]],
               avoid: NodeLink | None = None) -> None:
        """Assign samples to nodes, into the outbox (call under the lock).

        Pieces are whole batches of the chosen node (a node given half batches runs half
        batches whenever the other half went elsewhere). `avoid`: the node that just failed
        these queries, chosen only when no other node serves the model (its idle worker would
        otherwise look fastest, and a retry could fail on the same broken device again).
        """
        for q in queries:
            idx = [i for i, ln in enumerate(self.links) if ln.alive and q.model in ln.models]
            if avoid is not None and any(self.links[i] is not avoid for i in idx):
                idx = [i for i in idx if self.links[i] is not avoid]
            if not idx:
                failed.append((q.id, len(q.samples)))
                continue
            rows = self._rows.get(q.id)
            if rows is None and q.inputs is not None:
                rows = self._rows[q.id] = q.inputs
                self._left[q.id] = len(q.samples)
            samples = list(q.samples)
            while samples:
                i = self._pick(idx, q.model, len(samples))
                ln = self.links[i]
                k = max(1, ln.batch.get(q.model, 1))
                take, samples = samples[:k], samples[k:]
                entry = ln.out.get(q.id)
                if entry is None:
                    ln.out[q.id] = [q.model, len(take), list(take)]
                else:
                    entry[1] += len(take)
                    entry[2].extend(take)
                ln.held += len(take)
                if rows is None:
                    self._outbox[i].append((q.id, q.model, take))
                else:
                    whole = len(take) == len(rows) and take == list(range(len(rows)))
                    self._outbox[i].append((q.id, q.model, take, rows if whole else rows[take]))
                self.routed_pieces += 1

    def _pick(self, idx: list[int], model: str, n: int) -> int:
        if self.route.policy == "round_robin":
            self._rr += 1
            return idx[self._rr % len(idx)]
        best, when = idx[0], float("inf")
        for i in idx:
            ln = self.links[i]
            rate = ln.rate.get(model) or 1.0
            finish = (ln.held + min(n, max(1, ln.batch.get(model, 1)))) / rate
            if finish < when:
                best, when = i, finish
        return best

    def _flush(self) -> None:
        """Send every node its routed parts, one call per node (see the class docstring)."""
        while True:
            if not self._send_lock.acquire(blocking=False):
                return  # the sender now at work takes what was just routed on its next turn
            try:
                with self.lock:
                    box, self._outbox = self._outbox, defaultdict(list)
                for i, items in box.items():
                    ln = self.links[i]
                    if not ln.alive:
                        continue  # taking it out moved what it held to other nodes
                    self.node_calls += 1
                    try:
                        ref = ln.actor.submit.remote(items)
                        if self.keep_log:
                            with self.lock:
                                self._sent.append((ref, ln, time.perf_counter_ns()))
                    except ray_errors(self.ray) as exc:  # the poll sees the node's death
                        self.events.append({"event": "submit_failed", "node": ln.name,
                                            "error": str(exc)})
            finally:
                self._send_lock.release()
            with self.lock:
                if not self._outbox:
                    return

    def _report(self, done: list[tuple[int, int]], *, ok: bool) -> None:
        if not done:
            return
        if self._left:
            with self.lock:
                for qid, n in done:
                    left = self._left.get(qid)
                    if left is None:
                        continue
                    if left - n <= 0:
                        del self._left[qid]
                        self._rows.pop(qid, None)
                        self._attempts.pop(qid, None)
                    else:
                        self._left[qid] = left - n
        if self._on_complete is not None:
            self._on_complete(done, ok, time.perf_counter_ns())

    # -- completions and faults ----------------------------------------------------------------

    def _poll_loop(self) -> None:
        ray = self.ray
        wait_s = self.route.poll_wait_s
        pending = self._pending
        while not self._stop.is_set():
            for ln in self._live():
                if not any(p[0] is ln for p in pending.values()):
                    try:
                        pending[ln.actor.poll.remote(wait_s, self.low_water.get(ln.name, 0))
                                ] = (ln, time.perf_counter_ns())
                    except ray_errors(ray) as exc:
                        self._lose(ln, f"poll could not be sent: {exc}")
            if not pending:
                time.sleep(0.01)
                continue
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.1)
            now = time.perf_counter_ns()
            if self.keep_log:
                self._sent_delays()
            for ref in ready:
                ln, sent = pending.pop(ref)
                try:
                    answer = ray.get(ref)
                except ray_errors(ray) as exc:  # RayActorError and kin: the node is gone
                    self._lose(ln, first_line(exc, limit=200))
                    continue
                self._take(ln, answer, sent, time.perf_counter_ns())
            timeout_ns = int(self.route.node_timeout_s * 1e9)
            for ref, (ln, sent) in list(pending.items()):
                if not ln.alive:
                    del pending[ref]
                elif now - sent > timeout_ns:
                    del pending[ref]
                    self._lose(ln, f"no answer for {self.route.node_timeout_s:g} s")

    def _sent_delays(self) -> None:
        """Collect the queueing times of answered submits (their errors are the poll's business)."""
        with self.lock:
            sent, self._sent = self._sent, []
        if not sent:
            return
        ready, _ = self.ray.wait([r for r, _, _ in sent], num_returns=len(sent), timeout=0)
        done = set(ready)
        keep = []
        for ref, ln, at in sent:
            if ref not in done:
                if ln.alive:
                    keep.append((ref, ln, at))
                continue
            with contextlib.suppress(*ray_errors(self.ray)):
                self.to_node_ns.append(self.ray.get(ref) - ln.offset_ns - at)
        with self.lock:
            self._sent = keep + self._sent

    def _take(self, ln: NodeLink, answer: dict[str, Any], sent_ns: int, got_ns: int) -> None:
        rtt = got_ns - sent_ns
        if answer["done"] or answer.get("outputs"):
            self.answers += 1
            if self.keep_log:
                self.rtt_ns.append(rtt)
        self._take_answer(ln, answer, sent_ns, got_ns)
        self.answer_ns += time.perf_counter_ns() - got_ns

    def _take_answer(self, ln: NodeLink, answer: dict[str, Any], sent_ns: int,
                     got_ns: int) -> None:
        rtt = got_ns - sent_ns
        # The way there and back, without the time the node waited for a completion: the
        # node's clock read `clock_ns` about half of it before the answer arrived.
        transit = max(0, rtt - int(answer.get("waited_ns", 0)))
        if transit < ln.best_rtt_ns:
            ln.best_rtt_ns = transit
            ln.offset_ns = answer["clock_ns"] - (got_ns - transit // 2)
        if answer.get("first_done_ns") and self.keep_log:
            # The way back, without the time the node held the answer back on purpose.
            self.return_ns.append(got_ns - (answer["first_done_ns"] - ln.offset_ns)
                                  - int(answer.get("held_back_ns", 0)))
        ok_done: list[tuple[int, int]] = []
        delivered: list[tuple[Batch, list[np.ndarray]]] = []
        retry: list[Query] = []
        gave_up: list[tuple[int, int]] = []
        refused: dict[str, list[tuple[int, int]]] = {}
        with self.lock:
            if not ln.alive:
                return  # reports of a node already given up are not credited twice
            busy = ln.held > 0
            for qid, message in answer.get("rejected", ()):
                n = self._refuse(ln, qid)
                if n:
                    refused.setdefault(message, []).append((qid, n))
            for qid, samples, outs in answer.get("outputs", ()):
                got = self._answered(ln, qid, samples, outs, got_ns)
                if got is not None:
                    delivered.append(got)
                    ok_done.append((qid, len(got[0].items)))
            for qid, n, ok in answer["done"]:
                entry = ln.out.get(qid)
                if entry is None:
                    continue
                model = entry[0]
                if qid in self._rows:
                    if ok:
                        continue  # a served sample is answered by its outputs, above
                    # Which samples failed is not told: all it still holds of the query go
                    # again (outputs of them arriving later from this node are dropped).
                    n, taken = entry[1], entry[2]
                    del ln.out[qid]
                else:
                    n = min(n, entry[1])
                    entry[1] -= n
                    taken, entry[2] = entry[2][:n], entry[2][n:]
                    if entry[1] <= 0:
                        del ln.out[qid]
                ln.held -= n
                if ok:
                    ln.completed += n
                    ln.window[model][0] += n
                    ok_done.append((qid, n))
                else:
                    ln.failed += n
                    self._retry_or_fail(qid, model, taken, retry, gave_up)
            if busy:
                self._update_rate(ln, rtt)
            self._route(retry, gave_up, avoid=ln)
        if self.on_answer is not None:  # first: a failure reported below names the node's error
            self.on_answer(ln, answer)
        for message, done in refused.items():
            if self.on_rejected is not None:
                self.on_rejected([qid for qid, _ in done], message)
            self._report(done, ok=False)
        if self.on_outputs is not None:
            for batch, outs in delivered:
                self.on_outputs(batch, outs)
        if ok_done:
            if self.keep_log:
                self.log.append((got_ns, ln.name, sum(n for _, n in ok_done)))
            self._report(ok_done, ok=True)
        self._flush()
        self._report(gave_up, ok=False)

    def _answered(self, ln: NodeLink, qid: int, samples: list[int], outs: list[np.ndarray],
                  got_ns: int) -> tuple[Batch, list[np.ndarray]] | None:
        """Served outputs of `samples` from node `ln` (under the lock): those it still holds.

        A sample the node no longer holds (given up after a failure and sent elsewhere) is
        dropped, so every sample is answered once.
        """
        entry = ln.out.get(qid)
        if entry is None:
            return None
        held = entry[2]
        if held[:len(samples)] == samples:
            keep = list(range(len(samples)))
            entry[2] = held[len(samples):]
        else:
            have = set(held)
            keep = [j for j, s in enumerate(samples) if s in have]
            if not keep:
                return None
            gone = {samples[j] for j in keep}
            entry[2] = [s for s in held if s not in gone]
        n = len(keep)
        entry[1] -= n
        if entry[1] <= 0:
            del ln.out[qid]
        ln.held -= n
        ln.completed += n
        model = entry[0]
        ln.window[model][0] += n
        if n != len(samples):
            samples = [samples[j] for j in keep]
            outs = [y[keep] for y in outs]
        items = [Item(qid, model, s, got_ns) for s in samples]
        return Batch(model, items, n, got_ns, [got_ns] * n), outs

    def _refuse(self, ln: NodeLink, qid: int) -> int:
        """Fail served query `qid` alone, its input rejected by `ln` (under the lock); its samples.

        The runtime on `ln` told the input's fault from the worker's (its worker ran its own
        samples after the batch raised, and serves on): another node would raise too, so no
        piece of the query is tried again, and what other nodes hold of it is dropped (their
        outputs are then not delivered). 0 when `ln` no longer held the query (given up and
        sent elsewhere already).
        """
        if qid not in self._rows or qid not in ln.out:
            return 0
        for other in self.links:
            entry = other.out.pop(qid, None)
            if entry is not None:
                other.held -= entry[1]
                if other is ln:
                    ln.rejected += entry[1]
        return self._left.get(qid, 0)

    def _update_rate(self, ln: NodeLink, window_ns: int) -> None:
        alpha = self.route.rate_alpha
        for model in ln.models:
            w = ln.window[model]
            w[1] += window_ns
            if w[1] >= 250_000_000 and w[0] > 0:
                rate = w[0] / (w[1] / 1e9)
                old = ln.rate.get(model)
                ln.rate[model] = rate if not old else (1 - alpha) * old + alpha * rate
                w[0] = w[1] = 0

    def _retry_or_fail(self, qid: int, model: str, samples: list[int], retry: list[Query],
                       gave_up: list[tuple[int, int]]) -> None:
        self._attempts[qid] += 1
        if self._attempts[qid] <= self.route.max_retries:
            retry.append(Query(qid, model, tuple(samples)))
            self.retried += len(samples)
        else:
            gave_up.append((qid, len(samples)))

    def _lose(self, ln: NodeLink, reason: str) -> None:
        """Take a node out: what it held goes to other nodes, or is reported failed."""
        retry: list[Query] = []
        gave_up: list[tuple[int, int]] = []
        with self.lock:
            if not ln.alive:
                return
            ln.alive = False
            ln.lost_at_ns = time.perf_counter_ns()
            ln.lost_reason = reason
            held = ln.held
            for qid, (model, n, samples) in ln.out.items():
                self._retry_or_fail(qid, model, samples[:n], retry, gave_up)
            ln.out.clear()
            ln.held = 0
            ln.rerouted = sum(len(q.samples) for q in retry)
            self._route(retry, gave_up)
            targets = set(self._outbox)
        self.events.append({"t_ns": ln.lost_at_ns, "event": "node_lost", "node": ln.name,
                            "reason": reason, "held_samples": held,
                            "rerouted_samples": ln.rerouted,
                            "failed_samples": sum(n for _, n in gave_up)})
        if self.on_node_lost is not None:
            self.on_node_lost(ln)
        self._flush()
        if self._ended:
            for i in targets:
                with contextlib.suppress(Exception):
                    self.links[i].actor.end.remote()
        self._report(gave_up, ok=False)

    def stop(self) -> None:
        """Stop polling, once the polls still out at the nodes have returned.

        A poll left waiting at a node would take the completions of the node's next trial
        (`_Trials`) and lose them.
        """
        self._stop.set()
        if self._poller is not None:
            self._poller.join(10)
        refs = list(self._pending)
        if refs:
            with contextlib.suppress(Exception):
                self.ray.wait(refs, num_returns=len(refs), timeout=self.route.poll_wait_s + 5)
        self._pending.clear()


@dataclass
class ClusterReport:
    """What `run_cluster` returns: the stored run id, status, the trial's record, per node."""

    run_id: int | None
    plan: ClusterPlan
    status: str
    record: dict[str, Any] | None = None
    nodes: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    start_s: float = 0.0
    #: Every node's batch records of the trial, on the driver's clock (`node/worker` names).
    batches: list[BatchRecord] = field(default_factory=list, repr=False)
    #: Measured delays in ns (the simulation's input): `to_node` (a submit until queued at its
    #: node), `return` (a completion until the driver has it), `issue_lag` (due until issued).
    delays_ns: dict[str, list[int]] = field(default_factory=dict, repr=False)
    #: Every trial's record in order (one, or with `load.find_peak` the offline trial and the
    #: server trials of the search), and the search's result.
    trials: list[dict[str, Any]] = field(default_factory=list, repr=False)
    peak: dict[str, Any] | None = None

    @property
    def final(self) -> dict[str, Any] | None:
        """The trial's record (the same shape as a runtime trial's, plus `nodes`)."""
        return self.record

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        out = {"run_id": self.run_id, "status": self.status, "error": self.error,
               "plan": self.plan.to_dict(), "start_s": self.start_s, "nodes": self.nodes,
               "result": self.record}
        if self.peak is not None:
            out["peak"] = self.peak
            out["trials"] = self.trials
        return out


def resolve_nodes(plan: ClusterPlan, nodes: list[dict[str, Any]]
                  ) -> list[tuple[NodeEntry, str, dict[str, Any]]]:
    """(entry, node name, ray node row) for every node a plan entry claims; errors name the entry.

    Entries claim nodes in order; a node serves one entry. `count: all` takes every match left
    (none yet is allowed where another entry has a node: matching nodes that join later are
    taken then, `NodeWatcher`).
    """
    taken: set[str] = set()
    out = []
    for i, entry in enumerate(plan.nodes):
        free = [n for n in nodes if n["NodeID"] not in taken and entry.node.matches(n)]
        want = len(free) if entry.count == "all" else int(entry.count)
        if entry.count == "all" and not free and any(
                e.count != "all" or any(e.node.matches(n) for n in nodes) for e in plan.nodes):
            continue
        if not free or len(free) < want:
            seen = ", ".join(f"{n['NodeID'][:8]} ({n.get('NodeManagerAddress')})" for n in nodes)
            raise UsageError(
                f"cluster plan field nodes[{i}] ({entry.name}): {want if want else 'a'} node(s) "
                f"matching {entry.node.describe()} wanted, {len(free)} free; the cluster has "
                f"{len(nodes)} alive: {seen}")
        for k, node in enumerate(free[:want]):
            taken.add(node["NodeID"])
            name = entry.name if want == 1 and entry.count == 1 else f"{entry.name}-{k}"
            out.append((entry, name, node))
    return out


def _resources(plan: Plan, node: dict[str, Any]) -> dict[str, Any]:
    """The CPUs and GPUs a node's plan uses, within what the node offers (Ray pins them).

    Ray chooses which of the node's GPUs an actor gets and shows it only those
    (`CUDA_VISIBLE_DEVICES`), so a node plan's `cuda:N` is the N-th GPU it was given.
    """
    res = node.get("Resources") or {}
    cores: set[int] = set()
    whole_cpu = False
    gpus: set[str] = set()
    for m in plan.models:
        units = [r.unit for r in m.replicas] + [u for s in m.stages or [] for u in s.units]
        for u in units:
            if u == "cpu":
                whole_cpu = True
            elif u.startswith("cpu:"):
                from infermux.units import parse_core_set

                cores.update(parse_core_set(u[4:]))
            elif u.startswith("cuda:"):
                gpus.add(u.split("/")[0])
    have_cpu = float(res.get("CPU", 0))
    cpus = have_cpu if whole_cpu else min(have_cpu, float(len(cores)))
    return {"num_cpus": cpus, "num_gpus": min(float(res.get("GPU", 0)), float(len(gpus)))}


def _check_units(name: str, node: dict[str, Any], plan: Plan, facts: dict[str, Any]) -> None:
    """One clear line when the plan names a unit the node lacks (before anything is built)."""
    from infermux.units import parse_core_set

    have = set(facts.get("units", []))
    cores = set(facts.get("cores", []))
    where = f"node {name} ({node.get('NodeManagerAddress')}, id {node['NodeID'][:8]})"
    for mi, m in enumerate(plan.models):
        for ri, r in enumerate(m.replicas):
            field_ = f"models[{mi}].replicas[{ri}].unit"
            if r.unit.startswith("cpu:"):
                missing = sorted(set(parse_core_set(r.unit[4:])) - cores)
                if missing:
                    raise UsageError(
                        f"{where}: plan field {field_} {r.unit!r} names cores {missing} it lacks; "
                        f"its cores are {sorted(cores)}: give that node a plan for its own units")
            # Other kinds (openvino:, dla:) need the node's runtimes probed: its runtime's own
            # layout names them, with the node, when it starts.
            elif r.unit.startswith("cuda:") and r.unit not in have:
                raise UsageError(
                    f"{where}: plan field {field_} {r.unit!r} is not a unit of that node; it has "
                    f"{', '.join(sorted(have)) or 'none'}: give that node a plan for its own units")


def _start_nodes(plan: ClusterPlan, handle: ClusterHandle, base: Path | None,
                 progress: ProgressFn | None, *, serving: bool = False,
                 max_restarts: int = 0, take_when_idle: bool = True) -> list[NodeLink]:
    """Place, tune where asked, and build every node's runtime; their links (or the error)."""
    return _start_claims(plan, handle, resolve_nodes(plan, handle.nodes()), base, progress,
                         serving=serving, max_restarts=max_restarts,
                         take_when_idle=take_when_idle)


def _start_claims(plan: ClusterPlan, handle: ClusterHandle,
                  claims: list[tuple[NodeEntry, str, dict[str, Any]]], base: Path | None,
                  progress: ProgressFn | None, *, serving: bool = False,
                  max_restarts: int = 0, take_when_idle: bool = True) -> list[NodeLink]:
    ray = handle.ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(max_concurrency=8)(NodeRuntime)
    links: list[NodeLink] = []
    try:
        actors = []
        for entry, name, node in claims:
            local = plan.local_plan(entry, base)
            res = _resources(local, node) if local is not None else {"num_cpus": 0}
            actor = remote.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
                name=None, **res).remote(name)
            actors.append((entry, name, node, local, actor))
            links.append(NodeLink(name, entry.name, node["NodeID"],
                                  str(node.get("NodeManagerAddress")), actor, local, set()))
        facts = ray.get([a[4].facts.remote() for a in actors], timeout=300)
        for (entry, name, node, local, actor), fact, ln in zip(actors, facts, links, strict=True):
            ln.facts = fact
            if local is None:
                if progress:
                    progress(f"{name}: tuning", 0.0)
                spec = entry.tune_spec()
                got = ray.get(actor.tune.remote([m.model_dump(mode="json") for m in plan.models],
                                                spec.model_dump(mode="json") if spec else {},
                                                plan.load.model_dump(mode="json")))
                if "error" in got:
                    cls = UsageError if got.get("usage") else RunError
                    raise cls(f"node {name}: {got['error']}")
                local = parse_plan(got["plan"], source=f"node {name}'s tuned plan")
            ln.plan = local
            ln.models = {m.name for m in local.models}
            _check_units(name, node, local, fact)
        if progress:
            progress("building the nodes' runtimes", 0.0)
        built = ray.get([ln.actor.start.remote(ln.plan.to_dict() if ln.plan else {},
                                               serving, max_restarts, take_when_idle)
                         for ln in links], timeout=900)
        for ln, got in zip(links, built, strict=True):
            if "error" in got:
                cls = UsageError if got.get("usage") else RunError
                raise cls(f"node {ln.name} ({ln.address}, id {ln.node_id[:8]}): {got['error']}")
            ln.build = got["build"]
            ln.rate = dict(got["capacity"])
            ln.start_rate = dict(got["capacity"])
            ln.hold = dict(got["hold"])
            ln.batch = dict(got["batch"])
            ln.started = got
        return links
    except BaseException:
        _stop_nodes(ray, links)
        raise


class NodeWatcher:
    """Nodes that join while a plan runs or serves: started, measured, then routed to.

    Every `route.join_check_s` the cluster's alive nodes are listed; a node the driver does not
    run yet and that matches an entry with `count: all` gets that entry's runtime like the
    nodes at the start (placed, tuned where the entry says `tune: auto`, built: its build
    measures its latency, which seeds its rate) and only then joins the routing, so no query
    waits on a node still building. A node whose start fails is left out (an event says why)
    and not tried again.
    """

    def __init__(self, plan: ClusterPlan, handle: ClusterHandle, sut: ClusterSUT,
                 base: Path | None, *, serving: bool = False, max_restarts: int = 0,
                 take_when_idle: bool = True, begin_trial: bool = True,
                 on_join: Callable[[NodeLink], None] | None = None) -> None:
        self.plan, self.handle, self.sut, self.base = plan, handle, sut, base
        self.serving, self.max_restarts, self.take_when_idle = (serving, max_restarts,
                                                                take_when_idle)
        self.begin_trial = begin_trial
        self.on_join = on_join
        self._tried: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin watching (nothing to watch when no entry takes `count: all` or joining is off)."""
        if self.plan.route.join_check_s <= 0 or not any(
                e.count == "all" for e in self.plan.nodes):
            return
        self._tried = {ln.node_id for ln in self.sut.links}
        self._thread = threading.Thread(target=self._loop, name="infermux-cluster-join",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; a node being started finishes (or fails) first."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def _loop(self) -> None:
        while not self._stop.wait(self.plan.route.join_check_s):
            try:
                nodes = self.handle.nodes()
            except Exception:  # noqa: BLE001  (the cluster's state is read again next time)
                continue
            for node in nodes:
                if self._stop.is_set():
                    return
                # A node that matches no entry yet is looked at again next time (its row may
                # list its resources and labels later than the node itself).
                if node["NodeID"] not in self._tried and self._entry(node) is not None:
                    self._tried.add(node["NodeID"])
                    self.join(node)

    def _entry(self, node: dict[str, Any]) -> NodeEntry | None:
        return next((e for e in self.plan.nodes if e.count == "all" and e.node.matches(node)),
                    None)

    def join(self, node: dict[str, Any]) -> NodeLink | None:
        """Start `node` under the first `count: all` entry it matches and route to it."""
        entry = self._entry(node)
        if entry is None:
            return None
        taken = {ln.name for ln in self.sut.links}
        k = sum(ln.entry == entry.name for ln in self.sut.links)
        while f"{entry.name}-{k}" in taken:
            k += 1
        name = f"{entry.name}-{k}"
        t0 = time.perf_counter_ns()
        try:
            ln = _start_claims(self.plan, self.handle, [(entry, name, node)], self.base, None,
                               serving=self.serving, max_restarts=self.max_restarts,
                               take_when_idle=self.take_when_idle)[0]
            if self.begin_trial:
                self.handle.ray.get(ln.actor.begin_trial.remote(), timeout=60)
        except Exception as exc:  # noqa: BLE001  (the running nodes go on; the event says why)
            self.sut.events.append({"t_ns": time.perf_counter_ns(), "event": "node_join_failed",
                                    "node": name, "node_id": node["NodeID"],
                                    "error": first_line(exc, limit=300)})
            return None
        if self._stop.is_set():  # the run ended while it started: nobody would stop it
            _stop_nodes(self.handle.ray, [ln])
            self.sut.events.append({"t_ns": time.perf_counter_ns(), "event": "node_join_late",
                                    "node": name, "node_id": node["NodeID"],
                                    "start_s": (time.perf_counter_ns() - t0) / 1e9})
            return None
        ln.joined_at_ns = time.perf_counter_ns()
        self.sut.add_link(ln)
        self.sut.events.append({"t_ns": ln.joined_at_ns, "event": "node_joined", "node": name,
                                "node_id": node["NodeID"], "entry": entry.name,
                                "start_s": (ln.joined_at_ns - t0) / 1e9,
                                "rate_at_start": dict(ln.start_rate)})
        if self.on_join is not None:
            self.on_join(ln)
        return ln


def _stop_nodes(ray: Any, links: list[NodeLink]) -> None:
    refs = []
    for ln in links:
        with contextlib.suppress(Exception):
            refs.append(ln.actor.shutdown.remote())
    with contextlib.suppress(Exception):
        ray.wait(refs, num_returns=len(refs), timeout=30)
    for ln in links:
        with contextlib.suppress(Exception):
            ray.kill(ln.actor)


def _records(ln: NodeLink, got: dict[str, Any]) -> tuple[list[BatchRecord], list[WorkerState]]:
    """A node's batch records on the driver's clock, its workers named `node/worker`."""
    off = ln.offset_ns
    recs = []
    for b in got["batches"]:
        recs.append(BatchRecord(
            f"{ln.name}/{b['worker']}", b["unit"], b["model"], b["size"], b["bucket"],
            b["taken_ns"] - off, b["start_ns"] - off, b["end_ns"] - off,
            [t - off for t in b["enqueued_ns"]], [t - off for t in b["ready_ns"]],
            b.get("device_compute_ns", 0)))
    states = []
    for i, w in enumerate(got["workers"]):
        st = WorkerState(i, f"{ln.name}/{w['name']}", w["unit"], w["model"], w["buckets"],
                         {w["model"]}, LatencyEstimate(0.2))
        st.alive, st.error, st.failure = w["alive"], w["error"], w["failure"]
        states.append(st)
    return recs, states


def _node_timeline(sut: ClusterSUT, start_ns: int, duration_s: float, bins: int = 20
                   ) -> dict[str, Any]:
    """Samples each node completed per time bin, as the driver received them."""
    if duration_s <= 0:
        return {"bin_s": 0.0, "rows": []}
    bin_s = duration_s / bins
    table: dict[tuple[int, str], int] = defaultdict(int)
    for t, node, n in sut.log:
        table[(min(bins - 1, max(0, int((t - start_ns) / 1e9 / bin_s))), node)] += n
    rows = [{"t_s": round(i * bin_s, 4), "node": node, "items": table.get((i, node), 0)}
            for i in range(bins) for node in sorted({ln.name for ln in sut.links})]
    return {"bin_s": bin_s, "rows": rows}


def run_cluster(
    plan: ClusterPlan,
    handle: ClusterHandle,
    *,
    store: Store | None = None,
    progress: ProgressFn | None = None,
    command: str = "",
    base: Path | None = None,
    during: Callable[[ClusterSUT], None] | None = None,
) -> ClusterReport:
    """Run `plan` on the connected cluster under its load; the trial is stored, tagged by node.

    `during(sut)` is called on a thread of its own once the load begins (a test or a benchmark
    stops a node from there). Ctrl-C ends the run with what was measured.
    """
    from infermux.store import recording

    report = ClusterReport(None, plan, "complete")
    load = plan.load
    if load.find_peak and load.p99_bound_ms is None:
        raise UsageError("--find-peak needs a latency bound: set the cluster plan's "
                         "load.p99_bound_ms or pass --p99")
    if load.scenario == "server" and load.rate_qps is None and not load.find_peak:
        raise UsageError("cluster plan field load.rate_qps is required by the server scenario: "
                         "set it or pass --qps, or use --find-peak")
    config = {"cluster_plan": plan.to_dict(), "model": plan.name,
              "models": sorted({m.name for m in plan.models}), "cluster": handle.address}
    with recording(store, "cluster", config, command) as rec:
        report.run_id = rec.run_id
        try:
            _run(report, plan, handle, store, progress, base, during)
        except Exception as exc:
            report.status = "failed"
            report.error = (str(exc) if isinstance(exc, InfermuxError)
                            else f"{type(exc).__name__}: {exc}")
            raise
        finally:
            record = report.record or {}
            report.nodes = record.get("nodes", [])
            rec.status = report.status
            rec.summary = {k: record.get(k) for k in (
                "scenario", "valid", "validity_notes", "duration_s", "items_per_s",
                "completed", "failed", "unfinished", "latency")}
            rec.summary["nodes"] = [{k: n.get(k) for k in ("node", "status", "completed_samples",
                                                           "lost_at_s")} for n in report.nodes]
            if report.peak is not None:
                rec.summary["peak"] = {k: v for k, v in report.peak.items() if k != "trials"}
            if report.error:
                rec.summary["error"] = report.error
    return report


def _run(report: ClusterReport, plan: ClusterPlan, handle: ClusterHandle, store: Store | None,
         progress: ProgressFn | None, base: Path | None,
         during: Callable[[ClusterSUT], None] | None) -> None:
    started = time.perf_counter()
    links: list[NodeLink] = []
    trial: _Trials | None = None
    try:
        links = _start_nodes(plan, handle, base, progress)
        report.start_s = time.perf_counter() - started
        load = plan.load
        trial = _Trials(report, plan, handle, store, progress, base, links, during)
        if load.scenario == "server" and load.find_peak:
            offline = trial.run(load.model_copy(update={"scenario": "offline",
                                                        "find_peak": False}))
            if offline is None or offline.interrupted:
                return
            upper = float(trial.last.get("items_per_s") or 0.0)

            def server(rate: float) -> ScenarioResult:
                got = trial.run(load.model_copy(update={"scenario": "server", "rate_qps": rate,
                                                        "find_peak": False}))
                assert got is not None
                return got

            bound = float(load.p99_bound_ms or 0.0)
            peak = find_peak(server, upper_qps=upper, bound_ms=bound)
            report.peak = peak.record()
            valid = [t for t in report.trials if t.get("scenario") == "server" and t.get("valid")]
            if peak.peak_qps is not None and valid:
                best = max(valid, key=lambda t: t.get("rate_qps") or 0.0)
                report.record = best
                report.batches, report.delays_ns = trial.kept[best["trial"]]
        else:
            trial.run(load)
    except KeyboardInterrupt:
        report.status = "interrupted"
    finally:
        _stop_nodes(handle.ray, trial.links if trial is not None else links)


class _Trials:
    """One LoadGen trial after another on the same started nodes, each stored as it ends.

    Every trial empties the nodes' queues and counters (`begin_trial`) and drives a fresh
    `ClusterSUT` over the nodes alive (with those that joined during an earlier trial); the
    report's `record` is the last trial's (the search's best valid one once it ends).
    """

    def __init__(self, report: ClusterReport, plan: ClusterPlan, handle: ClusterHandle,
                 store: Store | None, progress: ProgressFn | None, base: Path | None,
                 links: list[NodeLink], during: Callable[[ClusterSUT], None] | None) -> None:
        self.report, self.plan, self.handle, self.store = report, plan, handle, store
        self.progress, self.base, self.links, self.during = progress, base, links, during
        self.last: dict[str, Any] = {}
        #: trial index → its batch records and delays (the search's best is reported)
        self.kept: dict[int, tuple[list[BatchRecord], dict[str, list[int]]]] = {}

    def run(self, load: Any) -> ScenarioResult | None:
        ray = self.handle.ray
        index = len(self.report.trials)
        live = [ln for ln in self.links if ln.alive]
        ray.get([ln.actor.begin_trial.remote() for ln in live])
        for ln in self.links:
            ln.out.clear()
            ln.held = ln.completed = ln.failed = ln.rerouted = 0
            ln.window.clear()
        plan = self.plan.model_copy(update={"load": load})
        sut = ClusterSUT(list(self.links), ray, plan)
        models = sorted({m for ln in live for m in ln.models})
        shares = dict.fromkeys(models, 1.0)
        for ln in live:
            for m in ln.plan.models if ln.plan else []:
                shares[m.name] = m.share
        gen = LoadGenerator(load.model_dump(mode="json"), shares,
                            mix=[p.model_dump() for p in load.mix] if load.mix else None,
                            progress=self.progress)
        watcher = NodeWatcher(plan, self.handle, sut, self.base)
        watcher.start()
        if self.during is not None and index == 0:
            threading.Thread(target=self.during, args=(sut,), name="infermux-cluster-during",
                             daemon=True).start()
        try:
            result = gen.run(sut, dict.fromkeys(models, load.sample_pool))
        finally:
            watcher.stop()
            sut.stop()
            self.links = sut.links  # with the nodes that joined: every one is stopped at the end
        record, batches = _summarise(sut, result, ray)
        record["trial"] = index
        delays = {"to_node": list(sut.to_node_ns), "return": list(sut.return_ns),
                  "issue_lag": result.issue_lag_ns()}
        self.report.record, self.report.batches, self.report.delays_ns = record, batches, delays
        self.report.trials.append(record)
        self.kept[index] = (batches, delays)
        self.last = record
        if result.interrupted:
            self.report.status = "interrupted"
        if self.store is not None and self.report.run_id is not None:
            _store(self.store, self.report.run_id, record, result, batches, index)
        return result


def _summarise(sut: ClusterSUT, result: ScenarioResult, ray: Any
               ) -> tuple[dict[str, Any], list[BatchRecord]]:
    records: list[BatchRecord] = []
    states: list[WorkerState] = []
    extra: dict[str, dict[str, Any]] = {}
    for ln in sut.links:
        if not ln.alive:
            continue
        try:
            got = ray.get(ln.actor.trial_records.remote(), timeout=60)
        except ray_errors(ray) as exc:
            sut._lose(ln, f"{type(exc).__name__} while collecting its records")
            continue
        recs, sts = _records(ln, got)
        records.extend(recs)
        states.extend(sts)
        extra[ln.name] = {"retried_in_node": got["retried_items"],
                          "failed_in_node": got["failed_items"]}
    record = summarise(result, records, states, {})
    dur = result.duration_s
    total = sum(ln.completed for ln in sut.links) or 1
    nodes = []
    for ln in sut.links:
        nodes.append({
            "node": ln.name, "entry": ln.entry, "node_id": ln.node_id, "address": ln.address,
            "status": "ok" if ln.alive else "lost", "lost_reason": ln.lost_reason,
            "lost_at_s": (ln.lost_at_ns - result.start_ns) / 1e9 if ln.lost_at_ns else None,
            "joined_at_s": ((ln.joined_at_ns - result.start_ns) / 1e9 if ln.joined_at_ns
                            else None),
            "completed_samples": ln.completed, "share": ln.completed / total,
            "items_per_s": ln.completed / dur if dur else None,
            "rate_estimate": ln.rate, "rate_at_start": ln.start_rate,
            "rerouted_samples": ln.rerouted, "failed_samples": ln.failed,
            "clock_offset_ns": ln.offset_ns, "build_s": ln.build.get("build_s"),
            "plan": ln.plan.name if ln.plan else None, "models": sorted(ln.models), **ln.facts,
            **extra.get(ln.name, {})})
    record["nodes"] = nodes
    record["node_timeline"] = _node_timeline(sut, result.start_ns, dur)
    record["cluster_events"] = [{**e, "t_s": (e["t_ns"] - result.start_ns) / 1e9}
                                for e in sut.events if "t_ns" in e]
    record["routing"] = {"pieces": sut.routed_pieces, "route_s": sut.route_ns / 1e9,
                         "per_piece_us": sut.route_ns / 1e3 / max(1, sut.routed_pieces),
                         "node_calls": sut.node_calls,
                         "per_call_us": sut.route_ns / 1e3 / max(1, sut.node_calls),
                         "answers": sut.answers,
                         "per_answer_us": sut.answer_ns / 1e3 / max(1, sut.answers),
                         "poll_rtt_p50_ms": (float(np.median(sut.rtt_ns)) / 1e6
                                             if sut.rtt_ns else None),
                         "return_p50_ms": (float(np.median(sut.return_ns)) / 1e6
                                           if sut.return_ns else None),
                         "to_node_p50_ms": (float(np.median(sut.to_node_ns)) / 1e6
                                            if sut.to_node_ns else None)}
    return record, records


def _store(store: Store, run_id: int, record: dict[str, Any], result: ScenarioResult,
           batches: list[BatchRecord], trial: int = 0) -> None:
    store.add_runtime_trial(run_id, trial, record, result, batches)
    store.add_cluster_nodes(run_id, trial, record["nodes"])
