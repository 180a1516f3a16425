"""A server tune measures a CPU plan of lock-releasing engines hosted both ways, alternated,
and writes the hosting `choose_hosting` picks from the median peaks."""

import os
import time

import pytest
import yaml

from infermux.models import ModelSpec
from infermux.runtime import parse_plan
from infermux.tune import Constraints, TrialSettings, TuneRequest, run_tune
from infermux.tune import run as tune_run
from infermux.tune.hosting import HostingPeak, choose_hosting
from infermux.tune.run import (
    TuneReport,
    _choose_hosting_of,
    _cpu_workers,
    _hosted_as,
    _spin_free,
    _thread_hosted,
)
from infermux.units import Unit

from .conftest import TINY


def _plan(engine="onnxruntime", unit="cpu", **dispatcher):
    return {"name": "p", "models": [{"name": "m", "model": f"{TINY}:tiny_cnn", "replicas": [
        {"unit": unit, "engine": engine, "instances": 1, "batch": 4}]}],
        "dispatcher": {"max_queue_delay_ms": 2.0, **dispatcher},
        "load": {"scenario": "server", "p99_bound_ms": 50.0, "find_peak": True}}


def test_thread_hosting_is_tried_for_lock_releasing_cpu_engines_only():
    for engine in ("onnxruntime", "openvino", "litert"):
        plan = _plan(engine)
        threaded = _thread_hosted(plan)
        assert threaded is not None and threaded["dispatcher"]["cpu_workers"] == "thread"
        # Nothing else changes, and the original is left as it was.
        assert threaded["models"] == plan["models"] and "cpu_workers" not in plan["dispatcher"]
        assert threaded["dispatcher"]["max_queue_delay_ms"] == 2.0
        parse_plan(threaded)  # what is measured must be a valid plan
        assert (_cpu_workers(plan), _cpu_workers(threaded)) == ("process", "thread")
    # Torch's eager CPU runners hold the lock between kernels: processes only.
    assert _thread_hosted(_plan("torch")) is None
    # Already threads, or no CPU replica: nothing to compare.
    assert _thread_hosted(_plan(cpu_workers="thread")) is None
    gpu = _plan("torch", unit="cuda:0/fp16")
    assert _thread_hosted(gpu) is None and _cpu_workers(gpu) is None
    # One torch CPU replica beside an ONNX Runtime one keeps the whole plan in processes.
    mixed = _plan()
    mixed["models"][0]["replicas"].append({"unit": "cpu:1", "engine": "torch", "instances": 1,
                                           "batch": 4})
    assert _thread_hosted(mixed) is None


def test_a_later_plan_is_hosted_as_the_comparison_chose():
    threads, processes = {"cpu_workers": "thread"}, {"cpu_workers": "process"}
    assert _cpu_workers(_hosted_as(_plan(), threads)) == "thread"
    assert _hosted_as(_plan(), processes) == _plan() and _hosted_as(_plan(), None) == _plan()
    # A plan that cannot run its CPU workers as threads keeps its own hosting.
    assert _cpu_workers(_hosted_as(_plan("torch"), threads)) == "process"


def _runs(process, thread, p99=(None, None)):
    return ([HostingPeak("process", q, p99[0]) for q in process]
            + [HostingPeak("thread", q, p99[1]) for q in thread])


def test_hosting_is_decided_on_the_median_peak_not_one_lucky_run():
    # The figures of the loaded 2-core host: one process run far above its others.
    choice = choose_hosting(_runs([329.0, 180.0], [245.0, 300.0]))
    assert choice.cpu_workers == "thread"
    assert choice.median_peak_qps == {"process": 254.5, "thread": 272.5}
    assert "threads 272.5 vs processes 254.5" in choice.reason
    # A run with no peak counts as 0, so a hosting that fails half its runs loses.
    choice = choose_hosting(_runs([200.0, 210.0], [400.0, None]))
    assert (choice.cpu_workers, choice.median_peak_qps["thread"]) == ("process", 200.0)
    # One run each (no time for a second round): the higher peak wins.
    assert choose_hosting(_runs([100.0], [150.0])).cpu_workers == "thread"
    assert choose_hosting(_runs([150.0], [100.0])).cpu_workers == "process"


def test_a_tie_goes_to_the_lower_p99_then_to_processes():
    # Within 5%: the hosting whose peak trials kept more of the bound.
    tie = choose_hosting(_runs([300.0, 310.0], [305.0, 300.0], p99=(44.0, 31.0)))
    assert tie.cpu_workers == "thread" and "lower p99" in tie.reason
    tie = choose_hosting(_runs([300.0, 310.0], [305.0, 300.0], p99=(31.0, 44.0)))
    assert tie.cpu_workers == "process"
    # No p99 to tell them apart, or neither held the bound: the runtime's default.
    assert choose_hosting(_runs([300.0], [301.0])).cpu_workers == "process"
    none = choose_hosting(_runs([None], [None]))
    assert none.cpu_workers == "process" and "neither" in none.reason
    # Just outside the tie band, the higher median wins whatever the p99s.
    assert choose_hosting(_runs([300.0], [320.0], p99=(10.0, 49.0))).cpu_workers == "thread"
    with pytest.raises(ValueError):
        choose_hosting([])
    record = tie.to_dict()
    assert record["peaks_qps"] == {"process": [300.0, 310.0], "thread": [305.0, 300.0]}
    assert len(record["runs"]) == 4


def _fake_measure(report, peaks):
    """A `measure` handing out recorded find-peak figures in turn, as `_choose_by_server_peak`'s
    own does: one `server_peaks` row per run."""
    order = []

    def measure(plan, label, offline, **extra):
        hosting = _cpu_workers(plan)
        qps, p99 = peaks[hosting].pop(0)
        order.append(hosting)
        peak = {"peak_qps": qps, "edge_confirmed": True,
                "trials": [{"rate_qps": qps, "p99_ms": p99, "valid": True}]}
        report.server_peaks.append({"plan": label, "peak_qps": qps, "chosen": False,
                                    "cpu_workers": hosting, **extra,
                                    **tune_run._peak_figures(peak)})
        return peak, len(report.server_peaks) - 1
    return measure, order


def test_hostings_are_alternated_and_the_median_written():
    plan = _plan("openvino")
    threaded = _thread_hosted(plan)
    report = TuneReport(None, None, None, plan, None)
    measure, order = _fake_measure(report, {"process": [(329.0, 40.0), (180.0, 45.0)],
                                            "thread": [(245.0, 38.0), (300.0, 41.0)]})
    best = _choose_hosting_of(report, plan, threaded, "b8", 370.0, measure,
                              deadline=time.monotonic() + 3600)
    assert order == ["process", "thread", "process", "thread"]
    assert [r["hosting_round"] for r in report.server_peaks] == [1, 1, 2, 2]
    assert report.plan is threaded and report.hosting["cpu_workers"] == "thread"
    median, row, _ = best
    assert median == 272.5 and report.server_peaks[row]["cpu_workers"] == "thread"
    assert report.server_peaks[0]["peak_p99_ms"] == 40.0
    # Past the deadline after the first round: one run each, decided on those.
    report = TuneReport(None, None, None, plan, None)
    measure, order = _fake_measure(report, {"process": [(329.0, 40.0)],
                                            "thread": [(245.0, 38.0)]})
    _choose_hosting_of(report, plan, threaded, "b8", 370.0, measure,
                       deadline=time.monotonic())
    assert order == ["process", "thread"] and report.plan is plan


def test_server_tune_measures_both_hostings_and_writes_the_higher_peak(tmp_path, monkeypatch):
    # The bound is far above tiny_cnn's latency: only the plumbing is judged here (which
    # hosting wins on a shared 2-core host is bench/server_batching.py's question), against
    # the rows' own figures, so it runs beside the other tests, not in the serial pass. The small
    # space is searched well within the budget, which leaves the peaks their time. One round
    # of each hosting keeps the test short; the alternation is tested above. So do find-peak
    # trials of the search's own length (3× its 0.3 s, 48 queries) and no runtime check of the
    # chosen plan: neither the hostings' rows nor the choice depends on them.
    monkeypatch.setattr(tune_run, "HOSTING_ROUNDS", 1)
    req = TuneRequest(models=[ModelSpec(f"{TINY}:tiny_cnn")], units="cpu",
                      engines="onnxruntime", scenario="server",
                      constraints=Constraints(p99_bound_ms=1000.0), budget_s=150.0,
                      batches=[1, 4], max_instances=1, fine_tune=False, verify=False,
                      peak_min_duration_s=0.0, peak_min_queries=48,
                      trial=TrialSettings(min_duration_s=0.3, min_queries=48, warmup_s=0.1))
    out = tmp_path / "s.yaml"
    report = run_tune(req, out_path=out)
    rows = report.server_peaks
    assert [r["cpu_workers"] for r in rows[:2]] == ["process", "thread"]
    assert rows[0]["plan"] == rows[1]["plan"]
    chosen = next(r for r in rows if r["chosen"])
    # The hosting written is the one the rule picks from the two rows' own figures (peaks
    # within 5% are a tie that the lower p99 breaks, so not always the higher peak); a later
    # plan is written only past that hosting's peak.
    decided = choose_hosting([HostingPeak(r["cpu_workers"], r["peak_qps"], r["peak_p99_ms"],
                                          r["edge_confirmed"]) for r in rows[:2]])
    if chosen in rows[:2]:
        assert chosen["cpu_workers"] == decided.cpu_workers
    else:
        assert chosen["peak_qps"] > decided.median_peak_qps[decided.cpu_workers]
    text = out.read_text()
    data = yaml.safe_load(text)
    assert data["dispatcher"].get("cpu_workers", "process") == chosen["cpu_workers"]
    assert "CPU workers as processes" in text and "CPU workers as threads" in text
    # The decision and both hostings' trials are in the result; a later plan that wins was
    # measured, and is written, in the hosting the comparison chose.
    assert report.hosting["cpu_workers"] == chosen["cpu_workers"]
    assert report.hosting["written_cpu_workers"] == chosen["cpu_workers"]
    assert all(r["cpu_workers"] == decided.cpu_workers for r in rows[2:])
    workers = {"process": "processes", "thread": "threads"}[chosen["cpu_workers"]]
    assert f"# CPU workers as {workers}: " in text
    assert all(r["trials"] for r in rows[:2])
    # ONNX Runtime on both cores of one instance has an intra-op pool: a chosen plan whose pool
    # spins was also measured with it not spinning, and the plan written spins or not as the
    # higher peak said (the search may have chosen the option already: nothing to compare).
    if "allow_spinning=False" in rows[0]["plan"] or len(os.sched_getaffinity(0)) < 2:
        assert report.spinning is None
    else:
        assert report.spinning is not None, rows
        still = next(r for r in rows if r["plan"].endswith("(intra-op threads not spinning)"))
        assert report.spinning["not_spinning_peak_qps"] == still["peak_qps"]
        options = data["models"][0]["replicas"][0].get("options") or {}
        if chosen is still:
            assert report.spinning["allow_spinning"] is False
            assert options["allow_spinning"] is False
        elif chosen in rows[:2]:  # the spinning plan held the higher peak
            assert report.spinning["allow_spinning"] is True
            assert options.get("allow_spinning", True) is True


def test_spin_free_stops_the_pools_of_onnx_runtime_instances_with_more_than_one_core():
    two = Unit("cpu", "cpu", "cpu", "fp32", "x86", "cpu", cores=(0, 1))
    one = Unit("cpu:0", "cpu", "cpu", "fp32", "x86", "cpu", cores=(0,))
    gpu = Unit("cuda:0/fp16", "cuda", "cuda:0", "fp16", "H200", "cuda:0")
    units = {u.id: u for u in (two, one, gpu)}

    def plan(*replicas: dict) -> dict:
        return {"name": "p", "models": [{"name": "m", "model": "m", "replicas": list(replicas)}]}

    ort = {"unit": "cpu", "engine": "onnxruntime", "instances": 1, "batch": 8}
    stopped = _spin_free(plan(ort, {**ort, "engine": "openvino"}), units)
    assert stopped is not None
    first, second = stopped["models"][0]["replicas"]
    assert first["options"] == {"allow_spinning": False} and "options" not in second
    assert "options" not in ort  # the plan given is left as it was
    # One core per instance (two instances on two cores, or a one-core unit): no pool.
    assert _spin_free(plan({**ort, "instances": 2}), units) is None
    assert _spin_free(plan({**ort, "unit": "cpu:0"}), units) is None
    # A pool asked for by hand, spinning already off, a GPU unit, a unit not known.
    asked = _spin_free(plan({**ort, "instances": 2, "options": {"intra_op_threads": 2}}), units)
    assert asked is not None
    assert asked["models"][0]["replicas"][0]["options"]["allow_spinning"] is False
    assert _spin_free(plan({**ort, "options": {"allow_spinning": False}}), units) is None
    assert _spin_free(plan({**ort, "unit": "cuda:0/fp16"}), units) is None
    assert _spin_free(plan({**ort, "unit": "cpu:7"}), units) is None


def test_server_order_measures_the_shorter_predicted_query_first_among_near_ties():
    """Near the best offline figure, more workers go first, then the shorter predicted query.

    The figures are an H200's ResNet50 fp16 trials: b64 ×2 and b32 ×4 ran the same offline
    with the same batch p99, and b32 ×4 peaked at 0.94–0.97 of offline where b64 ×2 reached
    0.50–0.66. A candidate far below the best offline figure keeps its throughput order.
    """
    from infermux.tune.evaluate import Trial
    from infermux.tune.run import SERVER_TIE_SHARE, predicted_query_ms, server_order
    from infermux.tune.space import Candidate, Config

    def trial(batch, instances, items_per_s, p99_ms, status="ok"):
        config = Config.make("resnet50", "cuda:0/fp16", "torch", batch, instances,
                             {"compile": "default"})
        return Trial(Candidate.of(config), "runtime", status, items_per_s, p99_ms)

    b64x2 = trial(64, 2, 22_595.0, 5.7)
    b32x4 = trial(32, 4, 22_563.0, 6.0)
    b16x2 = trial(16, 2, 15_000.0, 2.0)  # far below the best: stays behind, whatever its p99
    slow = trial(128, 2, 23_000.0, 8.0)  # over half the 15 ms bound: not a server candidate
    broken = trial(8, 8, 30_000.0, 1.0, status="oom")
    bound = Constraints(p99_bound_ms=15.0)
    assert predicted_query_ms(b32x4) < predicted_query_ms(b64x2)
    order = server_order([b64x2, b16x2, slow, broken, b32x4, b64x2], bound)
    assert order == [b32x4, b64x2, b16x2]
    # Outside the tie share, throughput decides again.
    far = trial(32, 4, 22_595.0 * (1 - SERVER_TIE_SHARE) - 1.0, 6.0)
    assert server_order([b64x2, far], bound) == [b64x2, far]
    assert server_order([broken], bound) == []
    # Two H200 hosts' options stages: b32 ×4 at 0.875 of b64 ×4's figure is still measured
    # first, and before b64 ×1, whose batch alone predicts the shorter query (two workers' at
    # least, one worker's the shortest) but which peaked at 0.55-0.80 of its offline figure.
    b64x4 = trial(64, 4, 25_488.5, 7.0)
    b64x1 = trial(64, 1, 21_819.3, 3.2)
    assert predicted_query_ms(b64x1) < predicted_query_ms(b32x4)
    aa = server_order([b64x4, trial(64, 2, 24_601.0, 5.7), trial(32, 4, 22_291.2, 6.0), b64x1],
                      bound)
    assert [(t.candidate.configs[0].batch, t.candidate.configs[0].instances) for t in aa] == [
        (32, 4), (64, 4), (64, 2), (64, 1)]
