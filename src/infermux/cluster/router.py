"""The cluster's router: queries cut into node batches, sent to the node that finishes first.

`ClusterSUT` is the whole cluster as one LoadGen system under test (and, serving, the router
behind `ClusterRuntime`); `NodeLink` is its view of one node.

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
from typing import Any

import numpy as np

from infermux.cluster.plan import ClusterPlan
from infermux.errors import first_line
from infermux.load.base import CompletionFn, Query
from infermux.runtime.dispatcher import Batch, Item
from infermux.runtime.plan import Plan

__all__ = ["ClusterSUT", "NodeLink", "ray_errors"]


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
                            "reason": reason, "held_items": held,
                            "rerouted_items": ln.rerouted,
                            "failed_items": sum(n for _, n in gave_up)})
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
        (`ClusterRuntime.begin_trial`) and lose them.
        """
        self._stop.set()
        if self._poller is not None:
            self._poller.join(10)
        refs = list(self._pending)
        if refs:
            with contextlib.suppress(Exception):
                self.ray.wait(refs, num_returns=len(refs), timeout=self.route.poll_wait_s + 5)
        self._pending.clear()
