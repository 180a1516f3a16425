"""The four MLPerf LoadGen scenarios, their validity rules and the server peak search.

- offline: every sample is available at once; measured is throughput. Rather than queueing the
  whole run's samples up front, the generator keeps a backlog of twice what the SUT can hold in
  flight, topped up on every completion: the SUT never waits for work, memory stays bounded, and
  the drain at the end is at most two batches per worker.
- server: single-sample queries with Poisson arrivals at `rate_qps` from a seeded generator;
  valid only if the 99th percentile latency is at most `p99_bound_ms`.
- single-stream: the next query is issued when the last completes; the metric is p90 latency.
- multi-stream: the same with `samples_per_query` samples per query; the metric is p99 latency.
Every scenario is valid only if it ran at least `min_duration_s` and `min_queries` (samples for
offline, queries otherwise); `max_duration_s` stops it early and makes it invalid.
Latency is measured by the generator, to a query's last sample's completion from the moment the
query was due: in the server scenario its scheduled arrival (`start + arrival_time[i]`, as LoadGen
measures), otherwise its issue. A generator that falls behind its schedule (it shares the GIL with
the workers, most of all near the peak) so cannot hide its lateness from the latency; server
records keep the latency from the issue and the issue lag beside it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infermux.load.base import Query, SystemUnderTest
from infermux.progress import ProgressFn
from infermux.stats import latency_summary_ms

__all__ = ["LAG_SHARE", "PEAK_RESOLUTION", "STALL_RETRIES", "LoadGenerator", "PeakResult",
           "ScenarioResult", "bisection_steps", "find_peak", "lag_note", "poisson_schedule"]

_METRIC = {"offline": None, "server": 99, "single-stream": 90, "multi-stream": 99}


def poisson_schedule(rate_qps: float, count: int, seed: int) -> np.ndarray:
    """Arrival times in seconds of `count` queries of a Poisson process at `rate_qps`."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate_qps, count))


@dataclass
class ScenarioResult:
    """Raw per-query records of one scenario run plus the settings that produced them."""

    scenario: str
    settings: dict[str, Any]
    models: list[str]
    query_model: list[str] = field(default_factory=list)
    query_samples: list[int] = field(default_factory=list)
    issued_ns: list[int] = field(default_factory=list)
    #: When each query was due: its scheduled arrival (server), else its issue. Latency runs
    #: from here. Empty means "the issue times" (results built by hand).
    scheduled_ns: list[int] = field(default_factory=list)
    completed_ns: list[int] = field(default_factory=list)  # 0: not completed
    ok: list[bool] = field(default_factory=list)
    start_ns: int = 0
    end_ns: int = 0
    interrupted: bool = False
    stopped_early: bool = False

    @property
    def duration_s(self) -> float:
        """From the first issue to the last completion (or the stop)."""
        return max(0.0, (self.end_ns - self.start_ns) / 1e9)

    @property
    def due_ns(self) -> list[int]:
        """When each query was due (its scheduled arrival, or its issue): latency's origin."""
        return self.scheduled_ns if self.scheduled_ns else self.issued_ns

    def latencies_ns(self, model: str | None = None, *, origin: str = "scheduled") -> list[int]:
        """Latencies of completed, successful queries (optionally of one model).

        From the scheduled arrival (`origin="scheduled"`, the rule), or from the issue
        (`origin="issue"`, what the generator's lag hides; for comparison only).
        """
        starts = self.due_ns if origin == "scheduled" else self.issued_ns
        return [c - i for m, i, c, ok in zip(self.query_model, starts, self.completed_ns,
                                             self.ok, strict=True)
                if ok and c and (model is None or m == model)]

    def issue_lag_ns(self) -> list[int]:
        """How late the generator issued each query after its scheduled arrival."""
        return [max(0, i - d) for i, d in zip(self.issued_ns, self.due_ns, strict=True)]

    def counts(self, model: str | None = None) -> dict[str, int]:
        """Issued, completed, failed and unfinished queries and completed samples."""
        issued = completed = failed = samples = 0
        for m, c, ok, n in zip(self.query_model, self.completed_ns, self.ok, self.query_samples,
                               strict=True):
            if model is not None and m != model:
                continue
            issued += 1
            if c and ok:
                completed += 1
                samples += n
            elif c:
                failed += 1
        return {"issued": issued, "completed": completed, "failed": failed,
                "unfinished": issued - completed - failed, "completed_items": samples}

    def validity(self) -> tuple[bool, list[str]]:
        """LoadGen's rules: duration, query count, no failures, and the server's p99 bound."""
        notes = []
        s = self.settings
        counts = self.counts()
        if self.interrupted:
            notes.append("interrupted by the user")
        if self.stopped_early:
            notes.append(f"stopped at max_duration_s {s.get('max_duration_s')}")
        if self.duration_s < s["min_duration_s"]:
            notes.append(f"ran {self.duration_s:.2f}s < min_duration_s {s['min_duration_s']:g}")
        done = counts["completed_items"] if self.scenario == "offline" else counts["completed"]
        unit = "samples" if self.scenario == "offline" else "queries"
        if done < s["min_queries"]:
            notes.append(f"{done} {unit} < min_queries {s['min_queries']}")
        if counts["failed"] or counts["unfinished"]:
            notes.append(f"{counts['failed']} failed and {counts['unfinished']} unfinished queries")
        bound = s.get("p99_bound_ms")
        if self.scenario == "server" and bound is not None:
            p99 = self.summary_latency().get("p99_ms")
            if p99 is None or p99 > bound:
                notes.append(f"p99 {p99 if p99 is None else round(p99, 3)} ms > bound {bound:g} ms")
        return not notes, notes

    def summary_latency(self, model: str | None = None) -> dict[str, float]:
        """Latency percentiles (ms) of completed queries."""
        return latency_summary_ms(self.latencies_ns(model))

    def record(self) -> dict[str, Any]:
        """The scenario's headline figures, as stored and printed."""
        valid, notes = self.validity()
        counts = self.counts()
        dur = self.duration_s
        rec: dict[str, Any] = {
            "scenario": self.scenario, "valid": valid, "validity_notes": notes,
            "duration_s": dur, **counts,
            "throughput_qps": counts["completed"] / dur if dur else None,
            "items_per_s": counts["completed_items"] / dur if dur else None,
            "latency": self.summary_latency(),
            "interrupted": self.interrupted,
        }
        if self.scenario == "server":
            rec["rate_qps"] = self.settings.get("rate_qps")
            issued = [i for i in self.issued_ns if i]
            span = (max(issued) - min(issued)) / 1e9 if len(issued) > 1 else 0.0
            rec["achieved_issue_rate_qps"] = (len(issued) - 1) / span if span else None
            # The old rule beside the new one: latency from the issue hides the generator's lag.
            rec["latency_from_issue"] = latency_summary_ms(self.latencies_ns(origin="issue"))
            rec["issue_lag"] = latency_summary_ms(self.issue_lag_ns())
            # A generator that fell behind its schedule measured the host as much as the plan:
            # flagged here, so a single trial says so as a peak search's trials do.
            note = lag_note(rec["issue_lag"].get("p99_ms"), self.settings.get("p99_bound_ms"))
            rec["load_generator_lag"] = note is not None
            if note is not None:
                rec["load_generator_note"] = note
        metric = _METRIC[self.scenario]
        if metric is not None:
            rec["metric"] = f"p{metric}_ms"
            rec["metric_value_ms"] = rec["latency"].get(f"p{metric}_ms")
        else:
            rec["metric"] = "items_per_s"
            rec["metric_value"] = rec["items_per_s"]
        rec["per_model"] = {
            m: {**self.counts(m), "latency": self.summary_latency(m)} for m in self.models
        }
        return rec


class LoadGenerator:
    """Drives a SUT through one scenario from the calling thread and records every query.

    `clock_ns` and `sleep` are injectable; the defaults are `time.perf_counter_ns` and
    `time.sleep`. Query ids are `id_base`, `id_base + 1`, ...; completions of other ids are
    ignored.
    """

    def __init__(
        self,
        settings: dict[str, Any],
        shares: dict[str, float],
        *,
        mix: list[dict[str, Any]] | None = None,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        sleep: Callable[[float], None] = time.sleep,
        progress: ProgressFn | None = None,
        id_base: int = 0,
    ) -> None:
        self.settings = dict(settings)
        #: Query ids run from here: a runtime gives each trial its own range, so a late
        #: completion of an earlier trial can never be taken for a query of this one.
        self._id_base = id_base
        self.scenario = settings["scenario"]
        self.models = list(shares)
        self._phases = [(0.0, shares)] if not mix else [(p["at_s"], p["shares"]) for p in mix]
        self._clock = clock_ns
        self._sleep = sleep
        self._progress = progress
        self._cond = threading.Condition()
        self._result = ScenarioResult(self.scenario, self.settings, self.models)
        self._remaining: dict[int, int] = {}
        self._failed: set[int] = set()
        self._outstanding: dict[str, int] = dict.fromkeys(self.models, 0)
        self._done_samples = 0
        self._done_queries = 0
        self._last_done_ns = 0

    # -- the SUT's side ---------------------------------------------------------------------

    def on_complete(self, done: Sequence[tuple[int, int]], ok: bool, when_ns: int) -> None:
        """Record finished samples, as (query id, samples) pairs (thread-safe; the SUT calls it)."""
        r = self._result
        finished = False
        with self._cond:
            for query_id, samples in done:
                left = self._remaining.get(query_id)
                if left is None:  # finished already, or not a query of this run
                    continue
                if not ok:
                    self._failed.add(query_id)
                left -= samples
                if left > 0:
                    self._remaining[query_id] = left
                    continue
                del self._remaining[query_id]
                at = query_id - self._id_base
                r.completed_ns[at] = when_ns
                r.ok[at] = query_id not in self._failed
                n = r.query_samples[at]
                self._outstanding[r.query_model[at]] -= n
                self._done_samples += n
                self._done_queries += 1
                self._last_done_ns = max(self._last_done_ns, when_ns)
                finished = True
            if finished:
                self._cond.notify_all()

    # -- issuing ----------------------------------------------------------------------------

    def shares_at(self, t_s: float) -> dict[str, float]:
        """The model shares in force `t_s` seconds into the run, normalised."""
        shares = self._phases[0][1]
        for at_s, phase in self._phases:
            if t_s >= at_s:
                shares = phase
        full = {m: float(shares.get(m, 0.0)) for m in self.models}
        total = sum(full.values()) or 1.0
        return {m: v / total for m, v in full.items()}

    def _new_query(self, model: str, samples: tuple[int, ...], now_ns: int,
                   due_ns: int | None = None) -> Query:
        r = self._result
        qid = self._id_base + len(r.issued_ns)
        r.query_model.append(model)
        r.query_samples.append(len(samples))
        r.issued_ns.append(now_ns)
        r.scheduled_ns.append(now_ns if due_ns is None else due_ns)
        r.completed_ns.append(0)
        r.ok.append(False)
        self._remaining[qid] = len(samples)
        self._outstanding[model] += len(samples)
        return Query(qid, model, samples)

    def run(self, sut: SystemUnderTest, pools: dict[str, int]) -> ScenarioResult:
        """Run the scenario against `sut`; `pools` is each model's QSL size (sample indices).

        Ctrl-C ends issuing; the result keeps what completed and is marked interrupted.
        """
        self._pools = pools
        self._rng = np.random.default_rng(self.settings.get("seed", 0))
        self._index_buf: dict[str, list[int]] = {}
        sut.start(self.on_complete)
        self._result.start_ns = self._clock()
        try:
            {"offline": self._offline, "server": self._server,
             "single-stream": self._stream, "multi-stream": self._stream}[self.scenario](sut)
            sut.end()
            self._drain()
        except KeyboardInterrupt:
            self._result.interrupted = True
            sut.end()
        with self._cond:
            ends = [c for c in self._result.completed_ns if c]
            self._result.end_ns = max(ends) if ends and not self._result.interrupted else (
                self._clock())
        return self._result

    def _samples(self, model: str, n: int) -> tuple[int, ...]:
        # Indices are drawn in blocks: one generator call per sample costs ~30 µs of the GIL.
        buf = self._index_buf.get(model)
        if buf is None or len(buf) < n:
            fresh = self._rng.integers(0, self._pools[model], max(4096, n)).tolist()
            buf = self._index_buf[model] = (buf or []) + fresh
        out = tuple(buf[-n:])
        del buf[-n:]
        return out

    def _elapsed_s(self) -> float:
        return (self._clock() - self._result.start_ns) / 1e9

    def _report(self, fraction: float) -> None:
        if self._progress is not None:
            self._progress(self.scenario, max(0.0, min(1.0, fraction)))

    def _rule_met(self, done: int) -> tuple[bool, bool]:
        """(validity rule met, hard stop reached) for `done` samples/queries so far.

        The rule is judged on the span up to the last completion, which is the duration the
        result reports, not on the clock now: a query that completes just before the minimum
        duration and is checked just after it must not end a run that then reads too short.
        """
        elapsed = self._elapsed_s()
        s = self.settings
        covered = (self._last_done_ns - self._result.start_ns) / 1e9 if self._last_done_ns else 0.0
        met = covered >= s["min_duration_s"] and done >= s["min_queries"]
        cap = s.get("max_duration_s")
        stop = cap is not None and elapsed >= cap
        frac = min(elapsed / s["min_duration_s"] if s["min_duration_s"] else 1.0,
                   done / s["min_queries"])
        self._report(frac)
        return met, stop

    def _offline(self, sut: SystemUnderTest) -> None:
        backlog = {m: max(16, 2 * sut.capacity_items(m)) for m in self.models}
        # LoadGen's offline query carries many samples; queries of up to a quarter of the
        # backlog keep the generator's per-query Python work (which holds the GIL the workers
        # need) small next to the samples it issues, while the backlog still refills smoothly.
        chunk = {m: max(1, backlog[m] // 4) for m in self.models}
        while True:
            with self._cond:
                met, stop = self._rule_met(self._done_samples)
                if met or stop:
                    self._result.stopped_early = stop and not met
                    return
                shares = self.shares_at(self._elapsed_s())
                batch = []
                now = self._clock()
                for m in self.models:
                    want = math.ceil(backlog[m] * shares[m] * len(self.models))
                    want = min(want, backlog[m]) if shares[m] > 0 else 0
                    need = max(0, want - self._outstanding[m])
                    while need > 0:
                        k = min(need, chunk[m])
                        batch.append(self._new_query(m, self._samples(m, k), now))
                        need -= k
            if batch:
                sut.issue(batch)
            with self._cond:
                self._cond.wait(0.05)

    def _server(self, sut: SystemUnderTest) -> None:
        s = self.settings
        rate = float(s["rate_qps"])
        count = max(int(s["min_queries"]), math.ceil(rate * s["min_duration_s"]))
        times = poisson_schedule(rate, count, int(s.get("seed", 0)))
        # The run lasts at least min_duration_s even if the last arrival falls before it.
        if times[-1] < s["min_duration_s"]:
            extra = poisson_schedule(rate, count, int(s.get("seed", 0)) + 1) + times[-1]
            times = np.concatenate([times, extra[extra <= s["min_duration_s"] * 1.01]])
        cap = s.get("max_duration_s")
        if cap is not None and times[-1] > cap:
            times = times[times <= cap]
            self._result.stopped_early = True
        choices = self._model_choices(times)
        start = self._result.start_ns
        i = 0
        n = len(times)
        while i < n:
            due_ns = start + int(times[i] * 1e9)
            now = self._clock()
            if now < due_ns:
                # Sleep, never spin: a spinning generator would hold the GIL the workers need.
                self._sleep((due_ns - now) / 1e9)
                continue
            batch = []
            with self._cond:
                # Every query already due goes now; its latency runs from when it was due.
                while i < n and (due := start + int(times[i] * 1e9)) <= now:
                    m = choices[i]
                    batch.append(self._new_query(m, self._samples(m, 1), now, due))
                    i += 1
            sut.issue(batch)
            self._report(i / n)

    def _model_choices(self, times: np.ndarray) -> list[str]:
        if len(self.models) == 1:
            return [self.models[0]] * len(times)
        picks = self._rng.random(len(times))
        out = []
        for t, p in zip(times, picks, strict=True):
            shares = self.shares_at(float(t))
            acc = 0.0
            chosen = self.models[-1]
            for m in self.models:
                acc += shares[m]
                if p < acc:
                    chosen = m
                    break
            out.append(chosen)
        return out

    def _stream(self, sut: SystemUnderTest) -> None:
        per_query = int(self.settings["samples_per_query"]) if self.scenario == "multi-stream" else 1
        while True:
            with self._cond:
                met, stop = self._rule_met(self._done_queries)
                if met or stop:
                    self._result.stopped_early = stop and not met
                    return
                m = self._model_choices(np.array([self._elapsed_s()]))[0]
                query = self._new_query(m, self._samples(m, per_query), self._clock())
            sut.issue([query])
            with self._cond:
                while query.id in self._remaining:
                    self._cond.wait(0.5)

    def _drain(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._remaining and time.monotonic() < deadline:
                self._cond.wait(0.1)


@dataclass
class PeakResult:
    """The server peak search: every trial's rate, p99 and validity, and the best valid rate.

    Without a peak, `reason` says why (no throughput to search below, or no rate held the
    bound) and what to do about it. `repeats` are the rates run again to confirm the edge, with
    every p99 each gave; `notes` what else the reader should know (a load generator that fell
    behind, an edge that moved between runs).
    """

    bound_ms: float
    trials: list[dict[str, Any]]
    peak_qps: float | None
    offline_items_per_s: float | None
    reason: str | None = None
    repeats: list[dict[str, Any]] = field(default_factory=list)
    #: Whether the repeats agreed: the last valid rate valid again, the first invalid invalid.
    edge_confirmed: bool | None = None
    notes: list[str] = field(default_factory=list)
    #: The offline throughput measured again after the search, where it was.
    offline_after_items_per_s: float | None = None

    @property
    def offline_drift(self) -> float | None:
        """How far the offline throughput moved during the search: after / before - 1."""
        before, after = self.offline_items_per_s, self.offline_after_items_per_s
        return after / before - 1.0 if before and after else None

    def record(self) -> dict[str, Any]:
        """JSON-ready, with the peak as a fraction of offline throughput.

        The fraction is of the higher offline figure, before or after the search: a host that
        sped up during it cannot flatter the plan.
        """
        top = max(self.offline_items_per_s or 0.0, self.offline_after_items_per_s or 0.0)
        frac = self.peak_qps / top if self.peak_qps and top else None
        spreads = [r["p99_spread_ms"] for r in self.repeats if r.get("p99_spread_ms") is not None]
        lagged = [t["rate_qps"] for t in self.trials
                  if t.get("load_generator_lag") and not t.get("disturbed")]
        stalled = [t for t in self.trials if t.get("host_stall")]
        return {"p99_bound_ms": self.bound_ms, "peak_qps": self.peak_qps,
                "offline_items_per_s": self.offline_items_per_s,
                "offline_after_items_per_s": self.offline_after_items_per_s,
                "offline_drift": self.offline_drift,
                "peak_fraction_of_offline": frac, "reason": self.reason,
                "edge_confirmed": self.edge_confirmed, "repeats": self.repeats,
                "p99_spread_ms": max(spreads) if spreads else None,
                "load_generator_lag_rates_qps": lagged,
                "host_stalls": {"trials": len(stalled),
                                "run_again": sum(1 for t in stalled if t.get("disturbed")),
                                "longest_ms": max((t["host_stall"]["longest_ms"]
                                                   for t in stalled), default=None)},
                "notes": self.notes,
                "trials": self.trials}


#: How many times find-peak runs a failed trial again when the host stopped during it, by
#: default (`load.stall_retries`).
STALL_RETRIES = 2

#: How finely find-peak places the edge by default, as a share of the offline throughput
#: (`load.peak_resolution`): it bisects until the span left is this narrow, so the peak it
#: reports is at most this far below the highest rate that held.
PEAK_RESOLUTION = 0.01

#: A trial whose load generator issued its queries this late (p99, as a share of the bound)
#: measured the host's lag as much as the plan: it is flagged.
LAG_SHARE = 0.1


def lag_note(issue_lag_p99_ms: float | None, bound_ms: float | None) -> str | None:
    """What to tell the reader of a server trial whose generator fell behind, else None.

    Behind means an issue lag p99 over `LAG_SHARE` of the bound. The latency still runs from
    each query's scheduled arrival, so the lag is counted, not hidden; the note says that part
    of the p99 is the host's (the generator shares the interpreter with the dispatcher and the
    workers' threads), not the plan's.
    """
    if issue_lag_p99_ms is None or bound_ms is None or issue_lag_p99_ms <= LAG_SHARE * bound_ms:
        return None
    return (f"the load generator fell behind its schedule: issue lag p99 {issue_lag_p99_ms:.1f} "
            f"ms > {LAG_SHARE:g} of the {bound_ms:g} ms bound, so the p99 holds this host's lag "
            "as well as the plan's: rerun on a quieter host or with fewer workers' threads")


def _trial_entry(rate: float, result: ScenarioResult, bound_ms: float) -> dict[str, Any]:
    valid, notes = result.validity()
    lat = result.latencies_ns()
    lag = latency_summary_ms(result.issue_lag_ns()).get("p99_ms")
    entry: dict[str, Any] = {
        "rate_qps": rate, "p99_ms": result.summary_latency().get("p99_ms"), "valid": valid,
        "notes": notes,
        # LoadGen's early stopping judges the p99 by how many queries broke the bound against
        # how many the query count allows; with ~1,000 queries one stall decides the trial.
        "queries": len(lat), "over_bound": sum(1 for v in lat if v > bound_ms * 1e6),
        "issue_lag_p99_ms": lag,
        "load_generator_lag": lag_note(lag, bound_ms) is not None,
    }
    if result.interrupted:
        entry["interrupted"] = True
    return entry


def find_peak(
    run_server: Callable[..., ScenarioResult],
    *,
    upper_qps: float,
    bound_ms: float,
    iterations: int | None = None,
    lower_qps: float = 0.0,
    resolution: float = PEAK_RESOLUTION,
    confirm: bool = False,
    confirm_duration_s: float | None = None,
    disturbed: Callable[[ScenarioResult], dict[str, Any] | None] | None = None,
    stall_retries: int = STALL_RETRIES,
) -> PeakResult:
    """The highest server rate whose runs are all valid: bisection, then the edge confirmed.

    Between `lower_qps` (assumed valid) and `upper_qps` (the offline throughput, which no server
    rate can beat); the first trial is at half the upper bound, and the span is halved until it
    is at most `resolution` of the upper bound (or `iterations` times). With `confirm`, the last
    valid rate and the first invalid one are run again: on a noisy host one run of each does not
    place the edge. The peak is the highest rate valid in every run; if the repeat of the last
    valid rate fails, the rate halfway down to the next lower valid one is run (`between`), then
    that lower rate again, and the peak falls to the first that holds. The p99s each repeated
    rate gave are reported (their spread). With `confirm_duration_s`, each repeat is called as
    `run_server(rate, confirm_duration_s)`: a longer run, nearer LoadGen's, whose p99 one short
    host stall cannot decide alone (in a 3 s trial at 20k queries/s, a 30 ms stall is 1% of the
    queries). Those runs decide: a first invalid rate whose longer run holds (above a last valid
    rate whose longer run held) lifts the peak, and the search goes on above it
    (`_search_above`). A trial whose load generator issued late (issue lag p99 over `LAG_SHARE`
    of the bound) is flagged and noted: its p99 holds the host's lag, not the plan's alone.
    `disturbed` takes a trial's result and describes the stop of the host that overlapped it, or
    gives None (`runtime.peak` passes what `runtime.host_watch` and `runtime.peak.device_stop`
    saw): a trial that failed during such a stop measured the host, not the plan, so it is kept
    marked `disturbed`, left out of the search and run again, at most `stall_retries` times a
    rate and twice that in a search (a host that stops every few seconds would otherwise triple
    the search). With no throughput to search below, or no valid rate, the result has no peak
    and says why in `reason`.
    """
    trials: list[dict[str, Any]] = []
    if not upper_qps or upper_qps <= 0 or not math.isfinite(upper_qps):
        return PeakResult(bound_ms, trials, None, upper_qps or 0.0, reason=(
            f"the offline throughput is {upper_qps or 0:g} samples/s, so there is no server rate "
            "to search: make the offline scenario complete samples first (see its validity notes)"))

    if iterations is None:
        iterations = bisection_steps(upper_qps - lower_qps, resolution * upper_qps)
    stall_retries = max(0, stall_retries)
    retries_left = 2 * stall_retries

    def run(rate: float, repeat: bool = False) -> dict[str, Any]:
        nonlocal retries_left
        long = repeat and confirm_duration_s is not None
        for attempt in range(stall_retries + 1):
            result = run_server(rate, confirm_duration_s) if long else run_server(rate)
            entry = _trial_entry(rate, result, bound_ms)
            if repeat:
                entry["repeat"] = True
            if long:
                entry["min_duration_s"] = confirm_duration_s
            stall = disturbed(result) if disturbed is not None else None
            if stall is not None:
                entry["host_stall"] = stall
            trials.append(entry)
            if (stall is None or entry["valid"] or entry.get("interrupted")
                    or attempt == stall_retries or retries_left <= 0):
                return entry
            # The host stopped during a trial that failed: it says nothing of the plan.
            entry["disturbed"] = True
            retries_left -= 1
        raise AssertionError("unreachable: the last attempt returns")

    lo, hi = lower_qps, upper_qps
    best: float | None = None
    interrupted = False
    for _ in range(iterations):
        rate = (lo + hi) / 2 if best is not None or lo > 0 else hi * 0.5
        entry = run(rate)
        if entry.get("interrupted"):
            interrupted = True
            break
        if entry["valid"]:
            best = rate if best is None else max(best, rate)
            lo = rate
        else:
            hi = rate
    result = PeakResult(bound_ms, trials, best, upper_qps)
    if confirm and not interrupted and best is not None:
        long = confirm_duration_s is not None
        above = _confirm(result, run, long)
        if above is not None:
            _search_above(result, run, above)
        _summarise_repeats(result, long)
    peak = result.peak_qps
    if peak is None and best is not None:
        tried = ", ".join(f"{r['rate_qps']:.3g}" for r in result.repeats if r["valid"][0])
        result.reason = (f"no rate held p99 <= {bound_ms:g} ms in every run: {tried} qps passed "
                         "once and failed when repeated, so this host's p99 moves more between "
                         "runs than the bound allows; rerun on a quieter host, or with longer "
                         "trials (--duration)")
    elif peak is None and trials and not trials[-1].get("interrupted"):
        low = min(trials, key=lambda t: t["rate_qps"])
        p99 = low["p99_ms"]
        result.reason = (f"no rate held p99 <= {bound_ms:g} ms: the lowest tried, "
                         f"{low['rate_qps']:.3g} qps, gave p99 "
                         f"{'none' if p99 is None else f'{p99:.1f}'} ms")
    stall = _stall_note(trials, bound_ms)
    if stall is not None:
        result.notes.append(stall)
    lagged = [t for t in trials if t.get("load_generator_lag") and not t.get("disturbed")]
    if lagged:
        worst = max(t["issue_lag_p99_ms"] for t in lagged)
        rates = ", ".join(f"{t['rate_qps']:.0f}" for t in lagged)
        result.notes.append(
            f"the load generator fell behind its schedule at {rates} qps (issue lag p99 up to "
            f"{worst:.1f} ms > {LAG_SHARE:g} of the {bound_ms:g} ms bound): those p99s hold this "
            "host's lag as well as the plan's; it shares the interpreter with the workers, so "
            "rerun on a quieter host or with fewer workers' threads before trusting that edge")
    return result


def bisection_steps(span: float, resolution: float) -> int:
    """How many halvings bring `span` to at most `resolution` (at least one)."""
    if span <= 0 or resolution <= 0:
        return 1
    return max(1, math.ceil(math.log2(span / resolution) - 1e-9))


def _stall_note(trials: list[dict[str, Any]], bound_ms: float) -> str | None:
    """What the reader should know of trials during which the host stopped, or None."""
    hit = [t for t in trials if t.get("host_stall")]
    if not hit:
        return None
    longest = max(t["host_stall"]["longest_ms"] for t in hit)
    again = [t for t in hit if t.get("disturbed")]
    counted = [t for t in hit if not t.get("disturbed") and not t["valid"]]
    seen = sorted({t["host_stall"].get("seen_by", "host watch") for t in hit})
    how = {"host watch": "a process that does none of the plan's work stopped with it",
           "device": "a batch stood still on the device longer than the bound and a batch of "
                     "every worker beside it"}
    said = (f"the host stopped for up to {longest:.0f} ms during {len(hit)} of the "
            f"{len(trials)} trials (" + "; ".join(how.get(k, k) for k in seen) + ")")
    if again:
        rates = ", ".join(f"{t['rate_qps']:.0f}" for t in again)
        said += (f"; {len(again)} of them failed the {bound_ms:g} ms bound and "
                 f"{'was' if len(again) == 1 else 'were'} run again (at {rates} qps), left out "
                 "of the search")
    if counted:
        rates = ", ".join(f"{t['rate_qps']:.0f}" for t in counted)
        said += (f"; failed trials at {rates} qps met a stall too and count, the retries "
                 "being spent: this host's stalls may have placed the edge")
    return said


#: How many steps (valid rates `_SPLIT_SHARE` apart) below the last valid rate a failed
#: confirmation walks before giving up. Six reach a seven-step bisection's lowest valid rate:
#: on a 2-core host whose longer runs failed down to 87% of offline, three steps ended with no
#: peak at all, which tells the user nothing.
_CONFIRM_DOWN = 6
#: A failed confirmation first tries the rate halfway down to the next lower valid one, where
#: that gap is at least this share of the failed rate: bisection's valid rates lie far apart
#: (a half, three quarters, seven eighths of offline), and the edge is between them.
_SPLIT_SHARE = 0.02


def _confirm(result: PeakResult, run: Callable[..., dict[str, Any]],
             long: bool) -> tuple[float, float] | None:
    """Repeat the last valid and the first invalid rate; move the peak down if it fails.

    `long`: the repeats are longer runs than the search's (`confirm_duration_s`); they decide.
    Then, if the last valid rate's long run held and so did the first invalid rate's, that
    rate's short run met a stall of the host: it becomes the peak, and the span above it to
    search is returned (from it to the next invalid rate, or the offline figure).
    """
    trials = [t for t in result.trials if not t.get("disturbed")]
    best = result.peak_qps
    assert best is not None
    invalid = [t["rate_qps"] for t in trials if not t["valid"] and t["rate_qps"] > best]
    first_bad = min(invalid) if invalid else None
    short_p99 = {t["rate_qps"]: t["p99_ms"] for t in trials}
    valid_rates = sorted({t["rate_qps"] for t in trials if t["valid"]}, reverse=True)

    def again(rate: float, between: bool = False) -> dict[str, Any]:
        entry = run(rate, repeat=True)
        if between:
            entry["between"] = True
        return entry

    # The last valid rate again; if it fails, the rate halfway to the next lower valid one
    # (run once, in the confirming length), then that valid rate again, and so on down (a few
    # steps at most), until one holds in every run. A bisection that held all the way up
    # leaves its last valid rates a percent apart: a rate within `_SPLIT_SHARE` of the last
    # step is run without counting as a step, so the walk reaches as far down as it would
    # through a coarser bisection's rates.
    down: list[float] = []
    step: float | None = None
    steps = 0
    for r in (r for r in valid_rates if r <= best):
        if step is None or r <= step * (1 - _SPLIT_SHARE):
            step, steps = r, steps + 1
            if steps > _CONFIRM_DOWN + 1:
                break
        down.append(r)
    peak: float | None = None
    failed = None
    for rate in down:
        if failed is not None and failed - rate >= _SPLIT_SHARE * failed:
            mid = (rate + failed) / 2
            # One long run decides; short runs hold twice, as the rates above had to.
            if again(mid, between=True)["valid"] and (
                    long or again(mid, between=True)["valid"]):
                peak = mid
                break
        if again(rate)["valid"]:
            peak = rate
            break
        failed = rate
    bad_again = again(first_bad) if first_bad is not None else None
    result.peak_qps = peak
    result.edge_confirmed = (peak == best
                             and (bad_again is None or not bad_again["valid"]))
    if long and peak == best and bad_again is not None and bad_again["valid"]:
        assert first_bad is not None
        result.peak_qps = first_bad
        result.notes.append(
            f"{first_bad:.0f} qps failed its short run (p99 {_p99(short_p99[first_bad])}) and "
            f"held its longer one (p99 {_p99(bad_again['p99_ms'])}): the short run met a stall "
            "of the host, so the search went on above it")
        higher = [r for r in invalid if r > first_bad]
        return first_bad, min(higher) if higher else float(result.offline_items_per_s or 0.0)
    return None


def _p99(ms: float | None) -> str:
    return "none" if ms is None else f"{ms:.1f} ms"


#: How many short trials the search runs above a first invalid rate whose long run held.
_RESUME_ITERATIONS = 3
#: How many of those that held their short run are run long, from the highest down.
_RESUME_CHECKS = 2


def _search_above(result: PeakResult, run: Callable[..., dict[str, Any]],
                  span: tuple[float, float]) -> None:
    """Bisect `span` in short trials; the highest valid rate whose long run holds is the peak.

    The valid rates are run long from the highest down, `_RESUME_CHECKS` at most: the span's
    top often holds its short run only (2-core host: 1,443 queries/s held 26 ms short, 62 ms
    long, while 1,237 below it was never run long and the peak stayed at half of offline).
    """
    lo, hi = span
    held: list[float] = []
    for _ in range(_RESUME_ITERATIONS):
        rate = (lo + hi) / 2
        entry = run(rate)
        if entry.get("interrupted"):
            return
        if entry["valid"]:
            held.append(rate)
            lo = rate
        else:
            hi = rate
    for rate in sorted(held, reverse=True)[:_RESUME_CHECKS]:
        entry = run(rate, repeat=True)
        if entry.get("interrupted"):
            return
        if entry["valid"]:
            result.peak_qps = rate
            return


def _summarise_repeats(result: PeakResult, long: bool) -> None:
    """The rates run more than once, with every p99 they gave, and a note if the edge moved."""
    runs: dict[float, list[dict[str, Any]]] = {}
    for t in result.trials:
        if t.get("disturbed"):  # run again at once; it measured the host
            continue
        runs.setdefault(t["rate_qps"], []).append(t)
    for rate, entries in sorted(runs.items()):
        if len(entries) < 2:
            continue
        p99s = [e["p99_ms"] for e in entries]
        known = [p for p in p99s if p is not None]
        result.repeats.append({
            "rate_qps": rate, "p99_ms": p99s, "valid": [e["valid"] for e in entries],
            "p99_spread_ms": (max(known) - min(known)) if len(known) > 1 else None})
    if not result.edge_confirmed:
        said = "; ".join(f"{r['rate_qps']:.0f} qps: p99 "
                         + ", ".join("none" if p is None else f"{p:.1f}" for p in r["p99_ms"])
                         + " ms" for r in result.repeats)
        rule = ("its longer runs decide: the peak is the highest rate whose longer run held"
                if long else "the peak is the highest rate valid in every run")
        result.notes.append(f"the edge moved between runs ({said}): {rule}")
