"""Trials and the peak search: one loop for every runtime, this machine's or a cluster's.

`run_trial(rt, settings, shares)` runs one LoadGen trial on a built `TrialRuntime`
(`runtime.api`): it starts the trial (empty queues, zeroed counters), drives the load
generator through the runtime's `submit` and completion subscription, ends the trial and
summarises it (`runtime.metrics.summarise`) with what the runtime adds of its own (pipeline
stages, a cluster's nodes). `run_load(rt, settings, keep=...)` is what `infermux run` does with
a plan's `load:` section: one trial, or with `find_peak` the offline trial and then the server
rates of `load.scenarios.find_peak`, each trial handed to `keep` as it ends (stored there).
`run_plan` (this machine) and `run_cluster` (a Ray cluster) both go through it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from infermux.errors import UsageError
from infermux.load.base import CompletionFn, Query
from infermux.load.scenarios import (
    PEAK_RESOLUTION,
    STALL_RETRIES,
    LoadGenerator,
    PeakResult,
    ScenarioResult,
    find_peak,
)
from infermux.progress import ProgressFn
from infermux.runtime.host_probe import HostProbe, plan_cuda_device, probe_host, search_note
from infermux.runtime.host_watch import HostWatch
from infermux.runtime.metrics import BatchRecord, summarise
from infermux.runtime.trial import TrialSummary

if TYPE_CHECKING:
    from infermux.runtime.api import Subscription, TrialRuntime

__all__ = ["CONFIRM_SCALE", "SPEED_DRIFT", "KeepFn", "TrialRun", "best_at_peak",
           "confirm_duration_s", "device_stall", "device_stop", "gc_note", "host_stall",
           "lengthened", "offline_stall_note", "offline_upper", "own_pause", "run_load",
           "run_trial", "search_answer", "speed_note", "stall_note"]

#: Trial t numbers its queries from t << _TRIAL_ID_BITS: ranges of trials never overlap.
_TRIAL_ID_BITS = 40

#: The runs that confirm a find-peak's edge last this many times a search trial, unless the
#: load sets `confirm_duration_s`. LoadGen judges a server run on at least 270,336 queries;
#: a 3 s search trial at 20k queries/s has 60k, so one 30 ms stall of the host is 1% of them
#: and decides its p99. Four times as long comes near LoadGen's count at such rates.
CONFIRM_SCALE = 4.0


def confirm_duration_s(settings: dict[str, Any]) -> float | None:
    """How long a find-peak's confirming runs last, or None where that is no longer."""
    given = settings.get("confirm_duration_s")
    base = float(settings.get("min_duration_s") or 0.0)
    length = float(given) if given else CONFIRM_SCALE * base
    return length if length > base else None


def lengthened(settings: dict[str, Any], min_duration_s: float | None) -> dict[str, Any]:
    """`settings` for a run of at least `min_duration_s` (its hard stop moved as far)."""
    if min_duration_s is None:
        return settings
    out = {**settings, "min_duration_s": min_duration_s}
    cap, base = settings.get("max_duration_s"), float(settings.get("min_duration_s") or 0.0)
    if cap is not None:
        out["max_duration_s"] = float(cap) + (min_duration_s - base)
    return out


@dataclass
class TrialRun:
    """One trial that ran: its number in the run, the generator's result, its record, batches."""

    index: int
    result: ScenarioResult
    #: The trial's record (`runtime.metrics.summarise` and the runtime's own additions).
    record: TrialSummary
    #: Every batch the trial ran (what the store keeps per batch).
    batches: list[BatchRecord]


#: Called with every trial as soon as it ends (the caller stores it).
KeepFn = Callable[[TrialRun], None]


class _TrialSUT:
    """A `TrialRuntime` as a LoadGen system under test: queries in, completions out."""

    def __init__(self, rt: TrialRuntime) -> None:
        self.rt = rt
        self.subscription: Subscription | None = None

    def start(self, on_complete: CompletionFn) -> None:
        """Report completions to the load generator."""
        self.subscription = self.rt.subscribe(completions=on_complete)

    def issue(self, queries: Sequence[Query]) -> None:
        """Queue the queries' samples."""
        self.rt.submit(queries)

    def capacity_items(self, model: str) -> int:
        """Items the runtime's live workers of `model` hold at once."""
        return self.rt.capacity_items(model)

    def end(self) -> None:
        """Flush partial batches: no more queries will come."""
        self.rt.end()


def run_trial(rt: TrialRuntime, settings: dict[str, Any], shares: dict[str, float],
              mix: list[dict[str, Any]] | None = None, *, progress: ProgressFn | None = None,
              index: int = 0) -> TrialRun:
    """One trial of `settings` (a `load:` section) on the built runtime.

    A trial starts from empty queues and zeroed counters (what an earlier trial left is
    dropped, its late batches go unreported) and numbers its queries in a range of its own,
    so nothing of an earlier trial can be credited to this one.
    """
    dropped = rt.begin_trial(settings)
    gen = LoadGenerator(settings, shares, mix=mix, progress=progress,
                        id_base=rt.trial << _TRIAL_ID_BITS)
    sut = _TrialSUT(rt)
    try:
        result = gen.run(sut, rt.sample_counts())
    finally:
        if sut.subscription is not None:
            sut.subscription.cancel()
        counts = rt.end_trial()
    record = summarise(result, counts.records, counts.workers, {}, events=counts.events)
    record = rt.trial_details(result, replace(record, settings=settings))
    record = replace(record, retried_items=counts.retried_items,
                     failed_items=counts.failed_items, dropped_from_earlier_trial=dropped,
                     trial=index)
    return TrialRun(index, result, record, counts.records)


#: A batch counts as stalled on the device where its device time is over this many times its
#: bucket's median in the trial, and over `STALL_SHARE` of the bound.
STALL_FACTOR = 4.0
STALL_SHARE = 0.5
#: Fewer batches of a bucket than this in a trial give no median to judge by.
STALL_MIN_BATCHES = 5


def device_stall(batches: Sequence[BatchRecord], bound_ms: float) -> dict[str, Any] | None:
    """The trial's batches that stopped on the device, if any: count and the longest.

    A batch's device time (its copies and compute, timed by the device's own events) far above
    its bucket's median is the device stopping while it ran: on one H100 host a probe that kept
    the device fed saw a 132 ms gap between two events, and one that launched a tiny kernel
    every millisecond a 174 ms wait, with no gap in a CPU probe beside them
    (`bench/device_stalls.py`). One such stall in a trial puts more than one query in a hundred
    over a 15 ms bound at any rate; the trial then measures the device's host, not the plan.
    Batches of CUDA units only.
    """
    by_bucket: dict[tuple[str, int], list[int]] = {}
    for b in batches:
        if b.device_ns > 0 and b.unit.startswith("cuda"):  # a CPU's slow batch is contention
            by_bucket.setdefault((b.model, b.bucket), []).append(b.device_ns)
    count = 0
    worst: tuple[int, float, tuple[str, int]] | None = None
    for key, times in by_bucket.items():
        if len(times) < STALL_MIN_BATCHES:
            continue
        median = statistics.median(times)
        for ns in times:
            if ns > STALL_FACTOR * median and ns > STALL_SHARE * bound_ms * 1e6:
                count += 1
                if worst is None or ns > worst[0]:
                    worst = (ns, median, key)
    if worst is None:
        return None
    ns, median, (model, bucket) = worst
    return {"batches": count, "longest_ms": ns / 1e6, "median_ms": median / 1e6,
            "model": model, "bucket": bucket}


def device_stop(batches: Sequence[BatchRecord], bound_ms: float) -> dict[str, Any] | None:
    """A batch that stood still on its device longer than the plan itself could make it, if any.

    A batch's device time (its copies and compute, timed by the device's events) holds its own
    work and, at worst, a batch of every worker sharing its device (their streams take turns on
    the same SMs). A batch longer than the bound plus that much, a batch of each of those
    workers at its largest bucket's median, was held by something other than the plan: on
    H200 hosts a ResNet50 batch of 64 whose median is 4.3 ms took 326 ms, with the load
    generator 185 ms late beside it. A trial that failed beside such a batch is run again,
    as one during a stall of the whole host is (`load.scenarios.find_peak`, `disturbed`).
    Batches of CUDA units only; None where none stood still that long.
    """
    by_worker: dict[str, dict[int, list[int]]] = {}
    device_of: dict[str, str] = {}
    for b in batches:
        if b.device_ns > 0 and b.unit.startswith("cuda"):
            by_worker.setdefault(b.worker, {}).setdefault(b.bucket, []).append(b.device_ns)
            device_of[b.worker] = b.unit.split("/")[0]
    allowance: dict[str, float] = {}
    for worker, buckets in by_worker.items():
        judged = [statistics.median(t) for t in buckets.values() if len(t) >= STALL_MIN_BATCHES]
        if judged:
            allowance[device_of[worker]] = allowance.get(device_of[worker], 0.0) + max(judged)
    count, longest, threshold = 0, 0, 0.0
    for b in batches:
        device = device_of.get(b.worker)
        if device is None or device not in allowance:
            continue
        limit = bound_ms * 1e6 + allowance[device]
        if b.device_ns > limit:
            count += 1
            if b.device_ns > longest:
                longest, threshold = b.device_ns, limit
    if not count:
        return None
    return {"seen_by": "device", "stalls": count, "longest_ms": round(longest / 1e6, 3),
            "threshold_ms": round(threshold / 1e6, 3)}


def own_pause(gc: dict[str, Any] | None, stop: dict[str, Any] | None) -> bool:
    """Whether the runtime process's own full collection explains a batch's stop on the device.

    A collection holds the interpreter lock: no worker launches, so a batch whose device
    timing began before it (its copies in, then the graph's launch) stands as long. On an H200
    host a 548 ms collection, 548 ms of it on the CPU, came with a batch timed at 627 ms, and
    the trial was run again as if the host had stopped. That pause is the plan's process's,
    not the host's: a trial it failed stays failed. Judged by the collection's CPU time (a
    thread held off its core is the host's) against the stop.
    """
    if stop is None or not gc:
        return False
    return float(gc.get("full_max_cpu_ms") or 0.0) >= 0.5 * float(stop["longest_ms"])


def _not_own(run: TrialRun, seen: dict[str, Any] | None) -> dict[str, Any] | None:
    """`seen` (a device stall or stop of `run`), unless the trial's own collection explains it."""
    return None if own_pause(run.record.gc, seen) else seen


def _failed_with(trials: Sequence[dict[str, Any]], key: str, size: str, at_least: float = 0.0
                 ) -> tuple[list[dict[str, Any]], dict[str, Any], str] | None:
    """Failed trials whose `key` entry's `size` is at least `at_least`, else None.

    Returns them, the entry of the largest `size`, and their rates as one line.
    """
    hit = [t for t in trials if not t.get("valid") and t.get(key)
           and (t[key].get(size) or 0.0) >= at_least]
    if not hit:
        return None
    worst = max(hit, key=lambda t: t[key][size])[key]
    return hit, worst, ", ".join(f"{t['rate_qps']:.0f}" for t in hit)


def gc_note(trials: Sequence[dict[str, Any]], bound_ms: float) -> str | None:
    """A sentence where failed server trials held a full collection over the bound, else None."""
    found = _failed_with(trials, "gc", "full_max_cpu_ms", bound_ms)
    if found is None:
        return None
    hit, worst, rates = found
    return (f"the runtime's own full collection held the interpreter for up to "
            f"{worst['full_max_ms']:.0f} ms ({worst['full_max_cpu_ms']:.0f} ms on the CPU) in "
            f"{len(hit)} failed trial(s) (at {rates} qps): the plan's process paused, not the "
            "host, so those trials count as failed")


def stall_note(trials: Sequence[dict[str, Any]], bound_ms: float) -> str | None:
    """A sentence where failed server trials held device stalls (`device_stall`), else None."""
    found = _failed_with(trials, "device_stall", "longest_ms")
    if found is None:
        return None
    stalled, longest, rates = found
    failed = [t for t in trials if not t.get("valid")]
    return (f"the device stopped during {len(stalled)} of the {len(failed)} trials over the "
            f"bound (at {rates} qps): a batch of {longest['model']} at {longest['bucket']} "
            f"took up to {longest['longest_ms']:.1f} ms on the device against a median of "
            f"{longest['median_ms']:.2f} ms; a stall that long fails a {bound_ms:g} ms bound at "
            "any rate, so those trials measure this host's device, not the plan: rerun on "
            "another host before taking this edge as the plan's")


def offline_stall_note(stalls: Sequence[dict[str, Any]]) -> str | None:
    """A sentence where the offline trial was run again for a stall of the host, else None."""
    if not stalls:
        return None
    longest = max(s["longest_ms"] for s in stalls)
    rates = ", ".join(f"{s['items_per_s']:.0f}" for s in stalls if s.get("items_per_s"))
    return (f"the host stopped for up to {longest:.0f} ms during an offline trial, so it "
            f"was run again ({len(stalls)} time(s); the runs set aside gave {rates} items/s): "
            "a stall lowers the offline figure the peak is divided by")


def run_load(rt: TrialRuntime, settings: dict[str, Any], *, keep: KeepFn,
             shares: dict[str, float] | None = None, mix: list[dict[str, Any]] | None = None,
             progress: ProgressFn | None = None, confirm: bool = True,
             watch: HostWatch | None = None) -> dict[str, Any] | None:
    """Run a plan's load on the built runtime: one trial, or the peak search; the peak's record.

    With `find_peak` (server scenario): an offline trial gives the upper bound, then
    `find_peak` bisects server rates within `p99_bound_ms` (`confirm`: the edge is run again,
    the last valid rate and the first invalid one, in runs of `confirm_duration_s`). Every
    trial goes to `keep` as it ends. A `HostWatch` (`runtime.host_watch`; one of its own where
    none is given) sees the whole host's stalls: a failed trial during one is run again, at
    most `load.stall_retries` times, and so is an offline trial (`offline_upper`).
    Returns the search's record (None when there was no search or it was interrupted).
    """
    shares = shares if shares is not None else {m.name: m.share for m in rt.plan.models}
    trials: list[TrialRun] = []

    def one(s: dict[str, Any]) -> TrialRun:
        run = run_trial(rt, s, shares, mix, progress=progress, index=len(trials))
        trials.append(run)
        keep(run)
        return run

    if not (settings.get("scenario") == "server" and settings.get("find_peak")):
        one(settings)
        return None
    bound = settings.get("p99_bound_ms")
    if bound is None:
        raise UsageError("--find-peak needs a latency bound: set load.p99_bound_ms or pass --p99")
    # The host's hand-overs, probed before the search and after it: a peak that breaks at a
    # fraction of offline on a host slow to wake threads or to answer small device work is
    # named as the host's (`host_probe`).
    device = plan_cuda_device(rt.plan)
    before = probe_host(device=device)
    if watch is not None:
        return _search(rt, settings, one, watch.start(), before, device, float(bound), confirm)
    with HostWatch() as own:
        return _search(rt, settings, one, own, before, device, float(bound), confirm)


def host_stall(watch: HostWatch, result: ScenarioResult, bound_ms: float
               ) -> dict[str, Any] | None:
    """The whole host's stalls of at least the bound during a trial (`runtime.host_watch`)."""
    if not watch.available:
        return None
    watch.wait_caught_up()
    seen = watch.during(result.start_ns, result.end_ns, at_least_ms=bound_ms)
    return None if seen is None else {"seen_by": "host watch", **seen}


def offline_upper(one: Callable[[], TrialRun], watch: HostWatch, bound_ms: float,
                  retries: int) -> tuple[TrialRun, list[dict[str, Any]]]:
    """The offline trial a peak is divided by, and the stalls of those run again.

    It is run again (`retries` times at most) while the whole host stopped during it, or a
    batch stood still on the device (`device_stop`): a stall lowers the offline figure and so
    flatters the fraction.
    """
    run = one()
    stalls: list[dict[str, Any]] = []
    while not run.result.interrupted and len(stalls) < retries:
        # A stop the runtime's own collection explains is the plan's: the figure stands.
        stall = (host_stall(watch, run.result, bound_ms)
                 or _not_own(run, device_stop(run.batches, bound_ms)))
        if stall is None:
            break
        stalls.append({**stall, "items_per_s": run.record.items_per_s})
        run = one()
    return run, stalls


def _search(rt: TrialRuntime, settings: dict[str, Any], one: Callable[[dict[str, Any]], TrialRun],
            watch: HostWatch, before: HostProbe, device: str | None, bound: float,
            confirm: bool) -> dict[str, Any] | None:
    retries = int(settings.get("stall_retries", STALL_RETRIES))

    def offline_trial() -> TrialRun:
        return one({**settings, "scenario": "offline", "find_peak": False})

    offline, offline_stalls = offline_upper(offline_trial, watch, bound, retries)
    if offline.result.interrupted:
        return None
    upper = offline.record.items_per_s or 0.0
    phases: list[dict[str, Any]] = []
    stalls: list[dict[str, Any] | None] = []
    stops: list[dict[str, Any] | None] = []
    pauses: list[dict[str, Any] | None] = []

    def server(rate: float, min_duration_s: float | None = None) -> ScenarioResult:
        run = one(lengthened({**settings, "scenario": "server", "rate_qps": rate,
                               "find_peak": False}, min_duration_s))
        phases.append({m: v.phases.to_dict() for m, v in run.record.models.items()})
        # A stop the runtime's own full collection explains is not the device's or the host's:
        # the trial is not run again, and no note blames the device for it.
        stalls.append(_not_own(run, device_stall(run.batches, bound)))
        stops.append(_not_own(run, device_stop(run.batches, bound)))
        pauses.append(run.record.gc if run.record.gc and run.record.gc.get("full_collections")
                      else None)
        return run.result

    # With `confirm`, the edge is run twice (the last valid rate and the first invalid one):
    # one run of each does not place it on a host whose scheduling noise moves the p99. The
    # second runs are longer (`confirm_duration_s`), so one stall of the host does not decide.
    peak = find_peak(server, upper_qps=upper, bound_ms=bound, confirm=confirm,
                     confirm_duration_s=confirm_duration_s(settings),
                     disturbed=lambda result: host_stall(watch, result, bound) or stops[-1],
                     stall_retries=retries,
                     resolution=float(settings.get("peak_resolution", PEAK_RESOLUTION)))
    for entry, ph, stall, pause in zip(peak.trials, phases, stalls, pauses, strict=False):
        entry["phases"] = ph  # where each trial's time went, per model (runtime.metrics)
        entry["device_stall"] = stall
        entry["gc"] = pause  # the trial's full collections, where it had any
    if peak.peak_qps is None and peak.reason is not None:
        if upper <= 0:
            record = offline.record
            notes = "; ".join(record.validity_notes) or "no notes"
            errors = "; ".join(sorted({w.error for w in record.workers.values() if w.error}))
            peak.reason = (f"the offline trial completed no samples ({notes}"
                           + (f"; {errors}" if errors else "") + "), so there is no server rate "
                           "to search: fix what failed and run again")
        else:
            peak.reason = _no_peak_reason(rt, bound, peak.reason)
    # The offline trial again, after the search: a host whose speed moved during it would
    # otherwise pass its change for the plan's (`speed_note`).
    closing: TrialRun | None = None
    if upper > 0 and not (peak.trials and peak.trials[-1].get("interrupted")):
        closing, closing_stalls = offline_upper(offline_trial, watch, bound, retries)
        offline_stalls = offline_stalls + closing_stalls
        if closing.result.interrupted:
            closing = None
    peak.offline_after_items_per_s = closing.record.items_per_s if closing is not None else None
    after = probe_host(device=device)
    out = peak.record()
    out["host"] = {"before": before.to_dict(), "after": after.to_dict()}
    out["host_watch"] = watch.available
    out["offline_host_stalls"] = offline_stalls
    for note in (search_note(before, after, bound), gc_note(peak.trials, bound),
                 stall_note(peak.trials, bound),
                 offline_stall_note(offline_stalls), speed_note(peak)):
        if note is not None:
            out["notes"] = [*out.get("notes", []), note]
    return out


#: How far the offline rate may move between the trials before and after a peak search
#: before the search is said to have measured the host's change of speed.
SPEED_DRIFT = 0.10


def speed_note(peak: PeakResult) -> str | None:
    """A sentence where the offline rate moved beyond `SPEED_DRIFT` during the search, else None."""
    drift = peak.offline_drift
    if drift is None or abs(drift) <= SPEED_DRIFT:
        return None
    return (f"the plan's offline rate moved from {peak.offline_items_per_s:.0f} to "
            f"{peak.offline_after_items_per_s:.0f} items/s during the search ({drift:+.0%}): "
            "the host's speed changed while it ran, so the peak holds that change as well as "
            "the plan's limit; rerun on a steadier host before taking it as the plan's")


def best_at_peak(trials: Sequence[TrialSummary], peak: dict[str, Any] | None
                 ) -> TrialSummary | None:
    """The trial that answers a peak search: its best valid server trial at the peak rate.

    A repeated rate above the peak may have passed once: the peak's own trials answer. None
    when the search found no peak.
    """
    if peak is None or peak.get("peak_qps") is None:
        return None
    best = [t for t in trials if t.scenario == "server" and t.valid
            and t.rate_qps == peak["peak_qps"]]
    return max(best, key=lambda t: t.rate_qps or 0) if best else None


def search_answer(trials: Sequence[TrialSummary], peak: dict[str, Any] | None
                  ) -> TrialSummary | None:
    """The trial a peak search's run reports: `best_at_peak`, else its last server trial.

    Without a peak the last server rate tried says how the plan failed; the offline trial
    run after the search is not the answer. None when no search ran.
    """
    if peak is None:
        return None
    best = best_at_peak(trials, peak)
    if best is not None:
        return best
    server = [t for t in trials if t.scenario == "server"]
    return server[-1] if server else None


def _no_peak_reason(rt: TrialRuntime, bound_ms: float, searched: str) -> str:
    """Why no server rate held the bound, and what to do: one line for the peak record."""
    worst: tuple[float, str, str] | None = None  # (fastest batch ms of a model, name, ref)
    states = rt.workers()
    for entry in rt.plan.models:
        fastest = [s.estimate.expected_ns(s.buckets[0], entry.name) / 1e6 for s in states
                   if s.alive and s.model == entry.name]
        fastest = [ms for ms in fastest if ms > 0]
        if fastest and (worst is None or min(fastest) > worst[0]):
            worst = (min(fastest), entry.name, entry.model)
    if worst is None:
        return searched
    ms, name, ref = worst
    tune = f"`infermux tune --model {ref} --scenario server --p99 {bound_ms:g}ms`"
    if ms > bound_ms:
        shown = f"{ms:.0f}" if ms >= 10 else f"{ms:.2f}"
        return (f"the plan's batch latency alone is {shown} ms > {bound_ms:g} ms bound "
                f"(model {name}, its fastest worker at its smallest batch): find a plan that "
                f"can hold it with {tune}, or raise the bound")
    if rt.plan.dispatcher.batching == "deadline":
        # Batches are sized to the bound already: no queue delay is left to lower.
        return (f"{searched}; a batch of {name} alone takes {ms:.1f} ms, so queueing breaks the "
                f"bound: find a plan with {tune}")
    return (f"{searched}; a batch of {name} alone takes {ms:.1f} ms, so queueing and batching "
            f"waits break the bound: lower dispatcher.max_queue_delay_ms or find a plan with "
            f"{tune}")
