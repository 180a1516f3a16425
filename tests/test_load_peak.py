"""The server peak search on a noisy host: the edge confirmed by repeats, a lagging generator named."""

from __future__ import annotations

from collections import Counter
from typing import Any

from infermux.load import ScenarioResult, find_peak
from infermux.load.scenarios import bisection_steps
from tests.conftest import MS

BOUND_MS = 10.0


def _result(p99_ms: float, lag_ms: float = 0.0) -> ScenarioResult:
    settings = {"scenario": "server", "rate_qps": 100.0, "min_duration_s": 0, "min_queries": 1,
                "max_duration_s": None, "samples_per_query": 1, "seed": 0,
                "p99_bound_ms": BOUND_MS}
    res = ScenarioResult("server", settings, ["m"])
    res.query_model, res.query_samples, res.ok = ["m"] * 10, [1] * 10, [True] * 10
    res.scheduled_ns = [i * MS for i in range(10)]
    res.issued_ns = [i * MS + int(lag_ms * MS) for i in range(10)]
    res.completed_ns = [i * MS + int(p99_ms * MS) for i in range(10)]
    res.start_ns, res.end_ns = 0, 1_000_000_000
    return res


def test_the_edge_is_run_again_and_a_rate_that_passed_once_is_not_the_peak():
    calls: Counter[float] = Counter()

    def run(rate: float) -> ScenarioResult:
        calls[rate] += 1
        if rate <= 500:
            return _result(2.0)
        # 500-750 qps: valid on its first run only (a lucky run on a noisy host)
        return _result(4.0 if rate <= 750 and calls[rate] == 1 else 30.0)

    peak = find_peak(run, upper_qps=1000.0, bound_ms=BOUND_MS, iterations=3, confirm=True)
    # bisection: 500 valid, 750 valid (lucky), 875 invalid; then 750 again fails, so the rate
    # halfway down, 625, is run: valid (lucky) once, not twice; 500 is repeated and holds, and
    # 875 is repeated.
    assert [t["rate_qps"] for t in peak.trials] == [500, 750, 875, 750, 625, 625, 500, 875]
    assert [t.get("repeat", False) for t in peak.trials] == [False] * 3 + [True] * 5
    assert [t.get("between", False) for t in peak.trials] == [False] * 4 + [True] * 2 + [False] * 2
    assert peak.peak_qps == 500 and peak.edge_confirmed is False
    rec = peak.record()
    by_rate = {r["rate_qps"]: r for r in rec["repeats"]}
    assert by_rate[750]["valid"] == [True, False] and by_rate[750]["p99_spread_ms"] > 20
    assert by_rate[500]["p99_spread_ms"] < 0.1
    assert any("the edge moved between runs" in n for n in rec["notes"])


def test_the_repeats_are_longer_runs_whose_p99_one_short_stall_does_not_decide():
    def search(confirm_duration_s: float | None) -> tuple[Any, list[tuple[float, Any]]]:
        calls: list[tuple[float, Any]] = []

        def run(rate: float, *long: float) -> ScenarioResult:
            calls.append((rate, *long))
            if rate > 625:
                return _result(30.0)
            # The fourth run (the edge's repeat) meets a stall of the host; in a short run it
            # is over 1% of the queries, in a long one it is not.
            return _result(30.0 if len(calls) == 4 and not long else 4.0)

        peak = find_peak(run, upper_qps=1000.0, bound_ms=BOUND_MS, iterations=3, confirm=True,
                         confirm_duration_s=confirm_duration_s)
        return peak, calls

    peak, calls = search(12.0)
    assert calls == [(500,), (750,), (625,), (625, 12.0), (750, 12.0)]
    assert [t.get("min_duration_s") for t in peak.trials] == [None] * 3 + [12.0, 12.0]
    assert peak.peak_qps == 625 and peak.edge_confirmed is True
    peak, calls = search(None)
    # Short repeats (the rate alone, as before): the stall sinks 625, and the rate halfway
    # down to 500 is run twice (short runs hold twice, as the rates above had to).
    assert calls == [(500,), (750,), (625,), (625,), (562.5,), (562.5,), (750,)]
    assert peak.peak_qps == 562.5 and peak.edge_confirmed is False
    assert [t.get("between", False) for t in peak.trials] == [False] * 4 + [True] * 2 + [False]


def test_a_failed_long_repeat_tries_halfway_down_before_the_next_valid_rate():
    calls: list[tuple[float, Any]] = []

    def run(rate: float, *long: float) -> ScenarioResult:
        calls.append((rate, *long))
        return _result(4.0 if rate <= (600 if long else 700) else 30.0)

    peak = find_peak(run, upper_qps=1000.0, bound_ms=BOUND_MS, iterations=3, confirm=True,
                     confirm_duration_s=12.0)
    # 625 held a short run, not a long one; halfway down to 500, 562.5 holds its long run
    # (one long run decides), and 750 fails again.
    assert calls == [(500,), (750,), (625,), (625, 12.0), (562.5, 12.0), (750, 12.0)]
    assert peak.peak_qps == 562.5 and peak.edge_confirmed is False
    assert peak.trials[4]["between"] is True and peak.trials[4]["min_duration_s"] == 12.0
    # A gap under 2% of the failed rate is not split: the next valid rate is repeated.
    calls.clear()
    peak = find_peak(lambda rate, *long: _result(4.0 if rate <= (970 if long else 990) else 30),
                     upper_qps=1000.0, bound_ms=BOUND_MS, iterations=6, confirm=True,
                     confirm_duration_s=12.0)
    assert [t["rate_qps"] for t in peak.trials if t.get("repeat")] == [984.375, 968.75]
    assert peak.peak_qps == 968.75


def test_a_walk_down_from_a_dense_edge_counts_its_steps_two_percent_apart():
    # Every short run holds (the bisection climbs to 99% of offline in seven steps, its last
    # valid rates 1-3% apart); long runs hold only up to 880. Counting each of those rates as
    # a step, the walk gave up at 937.5 with no peak; counted 2% apart, it reaches 875.
    calls: list[tuple[float, Any]] = []

    def run(rate: float, *long: float) -> ScenarioResult:
        calls.append((rate, *long))
        return _result(4.0 if rate <= (880 if long else 995) else 30.0)

    peak = find_peak(run, upper_qps=1000.0, bound_ms=BOUND_MS, confirm=True,
                     confirm_duration_s=12.0)
    walked = [c[0] for c in calls if len(c) > 1]
    assert walked == [992.1875, 984.375, 968.75, 953.125, 937.5, 906.25, 875.0]
    assert peak.peak_qps == 875.0 and peak.edge_confirmed is False
    # Longer runs that hold only at 60%: the walk goes on to the bisection's lowest valid rate
    # rather than end with no peak.
    far = find_peak(lambda rate, *long: _result(4.0 if rate <= (600 if long else 995) else 30),
                    upper_qps=1000.0, bound_ms=BOUND_MS, confirm=True, confirm_duration_s=12.0)
    assert far.peak_qps == 500.0
    assert [t["rate_qps"] for t in far.trials if t.get("repeat")][-3:] == [750.0, 625.0, 500.0]


def test_a_steady_edge_is_confirmed_and_its_spread_reported():
    peak = find_peak(lambda rate: _result(2.0 if rate <= 600 else 30.0), upper_qps=1000.0,
                     bound_ms=BOUND_MS, iterations=4, confirm=True)
    assert peak.peak_qps == 562.5 and peak.edge_confirmed is True
    repeated = sorted(r["rate_qps"] for r in peak.record()["repeats"])
    assert repeated == [562.5, 625.0]
    assert peak.record()["p99_spread_ms"] < 0.1 and not peak.notes


def test_without_confirm_the_search_is_the_bisection_alone():
    peak = find_peak(lambda rate: _result(2.0 if rate <= 600 else 30.0), upper_qps=1000.0,
                     bound_ms=BOUND_MS, iterations=4)
    assert len(peak.trials) == 4 and peak.edge_confirmed is None and peak.peak_qps == 562.5


def test_the_search_places_the_edge_within_its_resolution_of_offline():
    # The plan holds up to 812 of 1000 qps: six halvings (1/64) can only say 797, below 0.8.
    def held(rate: float) -> ScenarioResult:
        return _result(2.0 if rate <= 812 else 30.0)

    assert find_peak(held, upper_qps=1000.0, bound_ms=BOUND_MS, iterations=6).peak_qps == 796.875
    fine = find_peak(held, upper_qps=1000.0, bound_ms=BOUND_MS)  # the default: 1% of offline
    assert len(fine.trials) == 7 and 812 - 10 <= fine.peak_qps <= 812
    finer = find_peak(held, upper_qps=1000.0, bound_ms=BOUND_MS, resolution=0.002)
    assert len(finer.trials) == 9 and 812 - 2 <= finer.peak_qps <= 812
    # The span counts from the lower rate given, not from nothing.
    assert bisection_steps(1000.0, 10.0) == 7 and bisection_steps(500.0, 10.0) == 6
    assert bisection_steps(1000.0, 1000.0) == 1 and bisection_steps(0.0, 10.0) == 1


def test_a_load_generator_that_falls_behind_is_flagged_not_taken_for_the_plan():
    # At 750 qps and above the generator issues 2 ms late: over a tenth of the 10 ms bound.
    peak = find_peak(lambda rate: _result(3.0, lag_ms=2.0 if rate >= 750 else 0.1),
                     upper_qps=1000.0, bound_ms=BOUND_MS, iterations=2)
    flags = {t["rate_qps"]: t["load_generator_lag"] for t in peak.trials}
    assert flags == {500: False, 750: True}
    rec = peak.record()
    assert rec["load_generator_lag_rates_qps"] == [750]
    assert any("load generator fell behind" in n and "750" in n for n in rec["notes"])
    assert peak.trials[1]["issue_lag_p99_ms"] > 1.0


def test_each_trial_counts_the_queries_over_the_bound():
    peak = find_peak(lambda rate: _result(30.0), upper_qps=1000.0, bound_ms=BOUND_MS,
                     iterations=1)
    assert peak.trials[0]["queries"] == 10 and peak.trials[0]["over_bound"] == 10


def test_a_peak_that_never_holds_twice_is_no_peak_and_says_so():
    calls: Counter[float] = Counter()

    def run(rate: float) -> ScenarioResult:
        calls[rate] += 1
        return _result(2.0 if calls[rate] == 1 and rate <= 600 else 30.0)

    peak = find_peak(run, upper_qps=1000.0, bound_ms=BOUND_MS, iterations=4, confirm=True)
    # valid once: 500, 562.5; both fail again (the walk down stops at the lowest valid rate)
    assert peak.peak_qps is None and peak.edge_confirmed is False
    # (the walk down tries 531.25, halfway to 500, twice: it holds its first run only)
    assert [t["rate_qps"] for t in peak.trials if t.get("repeat")] == [562.5, 531.25, 531.25,
                                                                       500, 625]
    assert "in every run" in (peak.reason or "") and "562" in (peak.reason or "")


class _StallingSUT:
    """Completes each query 1 ms after its issue; every issue holds the generator `stall_ms`.

    The stall stands for a generator kept off the interpreter by the workers' threads: on the
    fake clock its next queries go out late, by as much as the stall.
    """

    def __init__(self, clock: list[int], stall_ms: float) -> None:
        self.clock, self.stall_ns = clock, int(stall_ms * MS)

    def start(self, on_complete: Any) -> None:
        self.on_complete = on_complete

    def issue(self, queries: list[Any]) -> None:
        self.clock[0] += self.stall_ns
        self.on_complete([(q.id, len(q.samples)) for q in queries], True, self.clock[0] + MS)

    def capacity_items(self, model: str) -> int:
        return 1

    def end(self) -> None:
        pass


def _lagging_trial(stall_ms: float) -> dict[str, Any]:
    from infermux.load import LoadGenerator

    clock = [0]

    def sleep(s: float) -> None:
        clock[0] += int(s * 1e9)

    settings = {"scenario": "server", "rate_qps": 200.0, "min_duration_s": 1.0,
                "min_queries": 100, "max_duration_s": None, "seed": 0,
                "p99_bound_ms": BOUND_MS}
    gen = LoadGenerator(settings, {"m": 1.0}, clock_ns=lambda: clock[0], sleep=sleep)
    return gen.run(_StallingSUT(clock, stall_ms), {"m": 8}).record()


def test_a_single_server_trial_says_when_its_generator_fell_behind():
    # 200 qps (5 ms apart on average) with each issue holding the generator 4 ms: queries that
    # arrive within a stall go out late, and the lag p99 passes a tenth of the 10 ms bound.
    lagged = _lagging_trial(4.0)
    assert lagged["issue_lag"]["p99_ms"] > 1.0
    assert lagged["load_generator_lag"] is True
    assert "load generator fell behind" in lagged["load_generator_note"]
    assert f"{lagged['issue_lag']['p99_ms']:.1f} ms" in lagged["load_generator_note"]
    # The latency still runs from the scheduled arrival: the lag is in it, not hidden.
    assert lagged["latency"]["p99_ms"] > lagged["latency_from_issue"]["p99_ms"]
    steady = _lagging_trial(0.0)
    assert steady["issue_lag"]["p99_ms"] < 0.01
    assert steady["load_generator_lag"] is False and "load_generator_note" not in steady


def test_the_printed_headline_carries_the_lag_note():
    from infermux.cli.render import run_headline
    from infermux.runtime.trial import TrialSummary

    lagged = TrialSummary.from_dict(_lagging_trial(4.0))
    assert "load generator fell behind" in run_headline(lagged)
    assert "load generator" not in run_headline(TrialSummary.from_dict(_lagging_trial(0.0)))


def test_the_lag_note_starts_past_a_tenth_of_the_bound():
    from infermux.load.scenarios import LAG_SHARE, lag_note

    assert LAG_SHARE == 0.1
    assert lag_note(5.0, 50.0) is None  # a tenth exactly: not yet behind
    assert lag_note(None, 50.0) is None and lag_note(9.0, None) is None
    note = lag_note(5.1, 50.0)
    assert note is not None and "5.1 ms > 0.1 of the 50 ms bound" in note


def test_a_first_invalid_rate_that_holds_its_long_run_lifts_the_peak_and_the_search_goes_on():
    calls: list[tuple[float, Any]] = []

    def run(rate: float, *long: float) -> ScenarioResult:
        calls.append((rate, *long))
        stalled = rate == 750 and not long  # one stall of the host in 750's short run
        return _result(4.0 if rate <= 900 and not stalled else 30.0)

    peak = find_peak(run, upper_qps=1000.0, bound_ms=BOUND_MS, iterations=3, confirm=True,
                     confirm_duration_s=12.0)
    # 625 and 750 hold their long runs, so 750's short failure was the host's; the search
    # bisects 750-1000 in short trials (875 valid, 937.5 and 906.25 not) and 875 holds long.
    assert calls == [(500,), (750,), (625,), (625, 12.0), (750, 12.0), (875,), (937.5,),
                     (906.25,), (875, 12.0)]
    assert peak.peak_qps == 875 and peak.edge_confirmed is False
    assert any("750 qps failed its short run (p99 30.0 ms) and held its longer one" in n
               for n in peak.notes)
    assert any("longer runs decide" in n for n in peak.notes)
    # Above it, the highest rate that held short fails its long run: the next one down that
    # held short (875) is run long and holds.
    calls.clear()

    def top_fails_long(rate: float, *long: float) -> ScenarioResult:
        calls.append((rate, *long))
        stalled = rate == 750 and not long
        return _result(4.0 if rate <= (890 if long else 930) and not stalled else 30.0)

    peak = find_peak(top_fails_long, upper_qps=1000.0, bound_ms=BOUND_MS, iterations=3,
                     confirm=True, confirm_duration_s=12.0)
    assert calls[5:] == [(875,), (937.5,), (906.25,), (906.25, 12.0), (875, 12.0)]
    assert peak.peak_qps == 875
    # A long run that fails below it (625) keeps the first invalid rate out, though 750's own
    # long run holds: the peak is the halfway rate, and the search does not go above.
    def below_fails(rate: float, *long: float) -> ScenarioResult:
        held = (rate <= 600 or rate == 750) if long else rate != 750
        return _result(4.0 if held and rate <= 900 else 30.0)

    peak = find_peak(below_fails, upper_qps=1000.0, bound_ms=BOUND_MS, iterations=3,
                     confirm=True, confirm_duration_s=12.0)
    assert [t["rate_qps"] for t in peak.trials] == [500, 750, 625, 625, 562.5, 750]
    assert peak.trials[-1]["valid"] and peak.peak_qps == 562.5
    assert not any("failed its short run" in n for n in peak.notes)


def test_a_trial_that_failed_while_the_whole_host_stopped_is_run_again_and_left_out():
    """A failed trial with a stall of the host (`disturbed`) is run again and kept out of the
    search; one that held, or failed without a stall, counts as it came; the retries are
    bounded per rate and per search, and the note says what was run again."""
    calls: list[tuple[float, Any]] = []
    stalled_calls = {2, 5}  # the second and the fifth run met a stall of the host
    last: dict[str, int] = {}

    def run(rate: float, *long: float) -> ScenarioResult:
        calls.append((rate, *long))
        last["n"] = len(calls)
        return _result(30.0 if len(calls) in stalled_calls or rate > 700 else 4.0)

    def disturbed(result: ScenarioResult) -> dict[str, Any] | None:
        return ({"stalls": 1, "longest_ms": 350.0, "total_ms": 350.0, "at_s": 0.5}
                if last["n"] in stalled_calls else None)

    peak = find_peak(run, upper_qps=1000.0, bound_ms=BOUND_MS, iterations=3, confirm=True,
                     disturbed=disturbed)
    # 500 holds; 750 fails under a stall and again without one (it counts); 625 holds;
    # the edge's repeats: 625 fails under a stall, run again and holds; 750 fails.
    assert [t["rate_qps"] for t in peak.trials] == [500, 750, 750, 625, 625, 625, 750]
    assert [bool(t.get("disturbed")) for t in peak.trials] == [
        False, True, False, False, True, False, False]
    assert peak.trials[4]["host_stall"]["longest_ms"] == 350.0
    assert peak.peak_qps == 625 and peak.edge_confirmed is True
    # The disturbed runs are neither repeats' p99s nor "the edge moved".
    assert {r["rate_qps"]: r["valid"] for r in peak.repeats} == {625: [True, True],
                                                                  750: [False, False]}
    note = next(n for n in peak.notes if "host stopped" in n)
    assert "up to 350 ms during 2 of the 7 trials" in note
    assert "2 of them failed the 10 ms bound and were run again (at 750, 625 qps)" in note
    rec = peak.record()
    assert rec["host_stalls"] == {"trials": 2, "run_again": 2, "longest_ms": 350.0}
    # A host that stops in every run: each rate is tried 1 + stall_retries times, the search
    # spends twice stall_retries in all, and the trials that count say so.
    always = find_peak(lambda rate, *long: _result(30.0), upper_qps=1000.0, bound_ms=BOUND_MS,
                       iterations=3, disturbed=lambda r: {"stalls": 1, "longest_ms": 200.0,
                                                          "total_ms": 200.0, "at_s": 0.1},
                       stall_retries=1)
    assert [t["rate_qps"] for t in always.trials] == [500, 500, 250, 250, 125]
    assert [bool(t.get("disturbed")) for t in always.trials] == [True, False, True, False, False]
    assert always.peak_qps is None
    assert any("count, the retries being spent" in n for n in always.notes)
    # stall_retries=0 runs nothing again and still names the stalls.
    none_again = find_peak(lambda rate, *long: _result(30.0), upper_qps=1000.0,
                           bound_ms=BOUND_MS, iterations=2, stall_retries=0,
                           disturbed=lambda r: {"stalls": 1, "longest_ms": 200.0,
                                                "total_ms": 200.0, "at_s": 0.1})
    assert [t["rate_qps"] for t in none_again.trials] == [500, 250]
    assert not any(t.get("disturbed") for t in none_again.trials)
    # A trial that held despite a stall is not run again.
    held = find_peak(lambda rate, *long: _result(4.0), upper_qps=1000.0, bound_ms=BOUND_MS,
                     iterations=2, disturbed=lambda r: {"stalls": 1, "longest_ms": 20.0,
                                                        "total_ms": 20.0, "at_s": 0.1})
    assert [t["rate_qps"] for t in held.trials] == [500, 750]
