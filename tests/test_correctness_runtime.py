"""Runtime correctness on real workers: trials that start clean, peak searches that end with a
reason, batch completions stamped when collected, CPU children that cannot hang a run."""

from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np
import pytest
import yaml

from infermux.engines.base import BatchTiming, Runner
from infermux.errors import RunError
from infermux.iospec import IOSpec, TensorSpec
from infermux.load.base import Query
from infermux.load.samples import IOSamples
from infermux.runtime import Dispatcher, LatencyEstimate, WorkerState, parse_plan, run_plan
from infermux.runtime.api import LocalRuntime
from infermux.runtime.inputs import IORows, SeqRunner
from infermux.runtime.local import _Runtime
from infermux.runtime.peak import run_trial
from infermux.runtime.process_host import ProcessHost, RunnerSpec
from infermux.runtime.worker import Worker

from .conftest import TINY, invoke_cli, needs_two_cores


def plan(models, *, dispatcher=None, load=None, **kw):
    data = {"name": "test", "models": models, "dispatcher": {"cpu_workers": "thread",
                                                             **(dispatcher or {})},
            "load": {"min_duration_s": 0.3, "min_queries": 20, "sample_pool": 32, **(load or {})}}
    data.update(kw)
    return parse_plan(data)


def tiny(name="tiny", factory="tiny_cnn", **kw):
    return {"name": name, "model": f"{TINY}:{factory}", **kw}


# -- trials ----------------------------------------------------------------------------------


def test_what_an_earlier_trial_left_queued_is_never_served_into_the_next():
    rt = _Runtime(plan([tiny(replicas=[{"unit": "cpu:0", "batch": 4}])]), None)
    rt.build()
    try:
        # An earlier trial whose drain gave up left 50 items queued, numbered from 0 as a new
        # trial numbers its own queries.
        rt.dispatcher.submit([Query(i, "tiny", (i % 32,)) for i in range(50)])
        # The workers come up while the next trial is already issuing.
        timer = threading.Timer(0.3, rt.start)
        timer.start()
        settings = {**rt.plan.load.model_dump(mode="json"), "scenario": "server",
                    "rate_qps": 100.0, "min_duration_s": 0.6}
        run = run_trial(LocalRuntime(rt), settings, {"tiny": 1.0})
        result, record = run.result, run.record
        timer.join()
    finally:
        rt.shutdown(now=False)
    served = sum(r.size for r in rt.recorder.records)
    counts = result.counts()
    assert counts["unfinished"] == 0 and counts["failed"] == 0
    # Every batch served in the trial was the trial's own: nothing stale was credited.
    assert served == counts["completed_items"] == record.completed_items
    assert record.dropped_from_earlier_trial == 50
    # Each query completed after its own arrival, never before it.
    assert min(result.latencies_ns()) > 0


@needs_two_cores
def test_each_trial_of_a_peak_search_counts_its_own_retries():
    p = plan([tiny(factory="flaky_cnn", replicas=[
        {"unit": "cpu:0", "batch": 4, "batch_buckets": "none"},
        {"unit": "cpu:1", "batch": 4, "batch_buckets": "none"}])],
        load={"scenario": "server", "find_peak": True, "p99_bound_ms": 500,
              "min_duration_s": 0.3, "min_queries": 200})
    report = run_plan(p)
    assert report.status == "complete", report.error
    offline, *servers = report.trials
    assert offline.scenario == "offline" and offline.retried_items >= 1
    assert servers and all(t.retried_items == 0 and t.failed_items == 0 for t in servers)
    assert all(t.unfinished == 0 for t in report.trials)


# -- the peak search's ends ------------------------------------------------------------------


def test_an_empty_offline_trial_ends_the_peak_search_with_a_reason():
    p = plan([tiny(factory="failing_cnn", replicas=[{"unit": "cpu:0", "batch": 4}])],
             load={"scenario": "server", "find_peak": True, "p99_bound_ms": 50})
    report = run_plan(p)
    assert report.status == "complete", report.error
    peak = report.peak
    assert peak is not None and peak["peak_qps"] is None and peak["trials"] == []
    assert "offline trial completed no samples" in peak["reason"]
    assert "injected failure in a worker" in peak["reason"]
    assert len(report.trials) == 1 and report.trials[0].completed == 0


def test_no_rate_within_the_bound_says_the_batch_latency_alone_breaks_it():
    p = plan([tiny(factory="wide_cnn", replicas=[
        {"unit": "cpu:0", "batch": 64, "batch_buckets": "none"}])],
        dispatcher={"max_queue_delay_ms": 0},
        load={"scenario": "server", "find_peak": True, "p99_bound_ms": 2, "min_queries": 10})
    report = run_plan(p)
    peak = report.peak
    assert peak is not None and peak["peak_qps"] is None
    reason = peak["reason"]
    assert "the plan's batch latency alone is" in reason and "> 2 ms bound" in reason
    assert f"infermux tune --model {TINY}:wide_cnn --scenario server --p99 2ms" in reason


def test_infermux_run_prints_why_there_is_no_peak(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({
        "models": [tiny(factory="failing_cnn", replicas=[{"unit": "cpu:0", "batch": 4}])],
        "dispatcher": {"cpu_workers": "thread"},
        "load": {"min_duration_s": 0.3, "min_queries": 20}}))
    run = invoke_cli("run", str(path), "--no-store", "--find-peak", "--p99", "50")
    assert run.returncode == 0, run.stderr
    assert "no peak: the offline trial completed no samples" in " ".join(run.stdout.split())
    assert "host hand-overs (before / after the search): thread wake-up p99" in run.stdout


# -- pipelined GPU-style workers -------------------------------------------------------------


class SleepDevice(Runner):
    """An asynchronous runner whose 'device' is the clock: a batch is done `device_s` after its
    launch; gathering its inputs takes `gather_s` of host time."""

    engine = "sleep"
    asynchronous = True

    def __init__(self, batch: int, device_s: float, gather_s: float) -> None:
        self.batch = batch
        self.input_shape = (1,)
        self.options = {}
        self.device_s = device_s
        self.gather_s = gather_s
        self._done_at = 0.0
        self._launched_at = 0.0

    def gather_input(self, pool, indices) -> None:
        time.sleep(self.gather_s)

    def launch(self) -> None:
        self._launched_at = time.perf_counter()
        self._done_at = self._launched_at + self.device_s

    def done(self) -> bool:
        return time.perf_counter() >= self._done_at

    def collect(self) -> BatchTiming:
        left = self._done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return BatchTiming(latency_ns=int((time.perf_counter() - self._launched_at) * 1e9))

    def run(self) -> BatchTiming:
        self.launch()
        return self.collect()

    def set_input(self, batch: np.ndarray) -> None:
        pass

    def outputs(self) -> list[np.ndarray]:
        return []


TOKENS = IOSpec((TensorSpec("ids", "int64", ("seq",)), TensorSpec("mask", "int64", ("seq",))))


class SeqSleepDevice(SleepDevice):
    """`SleepDevice` for one sequence length of a model of two inputs (`TOKENS`)."""

    unit = "cuda:0"
    build_s = 0.0

    def __init__(self, batch: int, device_s: float, gather_s: float, length: int) -> None:
        super().__init__(batch, device_s, gather_s)
        self.length = length
        self.given: list[tuple[int, ...]] = []

    def set_inputs(self, arrays) -> None:
        self.given.append(tuple(a.shape for a in arrays))
        time.sleep(self.gather_s)


def seq_runner(batch: int, device_s: float, gather_s: float) -> SeqRunner:
    return SeqRunner(TOKENS, {n: SeqSleepDevice(batch, device_s, gather_s, n) for n in (8, 16)})


def test_a_runner_of_several_inputs_is_done_when_its_oldest_launched_batch_is():
    """`SeqRunner.done` asks the length's runner that runs the oldest batch: the pipelined GPU
    worker asks it whether to collect yet. It answered True while the batch ran."""
    runner = seq_runner(2, 0.05, 0.0)
    assert runner.done()  # nothing launched
    rows = IORows([[np.ones(6, np.int64), np.ones(6, np.int64)],
                   [np.ones(12, np.int64), np.ones(12, np.int64)]])
    runner.gather_input(rows, [0])
    runner.launch()
    runner.gather_input(rows, [1])
    runner.launch()
    assert not runner.done()  # the length-8 batch runs
    time.sleep(0.06)
    assert runner.done()
    runner.collect()
    assert runner.done()  # the length-16 one launched at once, over by now too
    assert runner.runners[8].given == [((2, 8), (2, 8))]
    assert runner.runners[16].given == [((2, 16), (2, 16))]


@pytest.mark.parametrize(("device_s", "gather_s", "primed"),
                         [(0.03, 0.08, True), (0.08, 0.03, True), (0.03, 0.08, False)],
                         ids=["gather-longer", "device-longer", "no-estimate-yet"])
def test_a_pipelined_batch_completes_when_collected_not_after_the_next_gather(device_s, gather_s,
                                                                            primed):
    batches = 6
    d = Dispatcher(["m"], max_queue_delay_ns=0)
    state = WorkerState(0, "gpu#0", "cuda:0/fp16", "m", [1], {"m"}, LatencyEstimate(), depth=2)
    if primed:  # as the runtime primes it after the build
        state.estimate.update(1, device_s * 1e9, "m")
    d.add_worker(state)
    spans: list[tuple[int, int]] = []
    taken: list[tuple[str, int]] = []  # each batch's gather path and device idle before it

    def done(w, b, start, end, timing):
        spans.append((start, end))
        taken.append((b.gather_path, b.idle_before_ns))

    d.on_batch_done = done
    finished = threading.Event()
    d.set_completion(lambda pairs, ok, t: len(spans) >= batches and finished.set())
    runner = SleepDevice(1, device_s, gather_s)
    worker = Worker(state, {"m": {1: runner}}, {"m": np.zeros((8, 1), np.float32)}, d)
    d.submit([Query(i, "m", (i,)) for i in range(batches)])
    worker.start()
    assert finished.wait(30)
    d.close()
    worker.join(10)
    assert len(spans) == batches
    latencies_ms = [(end - start) / 1e6 for start, end in spans]
    # Each batch's latency is its device time, never stretched to the next batch's gather.
    assert max(latencies_ms) < (device_s + 0.5 * abs(gather_s - device_s)) * 1e3, latencies_ms
    assert min(latencies_ms) >= device_s * 1e3 * 0.95, latencies_ms
    # And gathers still overlap the device: a cycle costs the longer of the two, not both
    # (from the first launch: overlapped 5 × longer + device, one after the other 5 × both +
    # device).
    # Without an estimate the first batches collect before gathering (no overlap to lose is
    # known yet); the stamps are exact either way.
    total_s = (spans[-1][1] - spans[0][0]) / 1e9
    longer, shorter = max(device_s, gather_s), min(device_s, gather_s)
    assert total_s < (batches - 1) * longer + device_s + (2 if primed else 3) * shorter, total_s
    # The first batch was gathered with nothing running and nothing collected before it.
    assert taken[0] == ("idle", 0), taken
    assert all(path in ("idle", "here", "helper", "after") for path, _ in taken), taken
    if primed and device_s > gather_s:
        # Each later gather ran under the batch before: the device never waited for one
        # (every item was queued from the start, so any gap would have been counted).
        assert all(path in ("here", "helper") for path, _ in taken[1:]), taken
        assert max(idle for _, idle in taken[1:]) < 0.5 * gather_s * 1e9, taken


# -- process-hosted CPU workers --------------------------------------------------------------


def _host(tmp_path, monkeypatch, timeout_s: float) -> tuple[ProcessHost, object]:
    switch = tmp_path / "switch"
    monkeypatch.setenv("INFERMUX_TEST_SWITCH", str(switch))
    core = min(os.sched_getaffinity(0))
    spec = RunnerSpec("m", f"{TINY}:switched_cnn", None, None, "torch", f"cpu:{core}", (1,), {},
                      "host", 0, 4, 0)
    host = ProcessHost("m/cpu#0", (core,), [spec], call_timeout_s=timeout_s)
    host.start()
    host.wait_ready()
    assert host.call("m", 1, [0]).latency_ns > 0
    return host, switch


def test_a_hung_child_is_stopped_and_its_call_raises(tmp_path, monkeypatch):
    host, switch = _host(tmp_path, monkeypatch, timeout_s=2.0)
    proc = host._proc
    try:
        switch.write_text("hang")
        started = time.monotonic()
        with pytest.raises(RunError, match="answered no batch in 2s"):
            host.call("m", 1, [0])
        assert time.monotonic() - started < 15
        assert proc is not None and proc.wait(10) is not None
        with pytest.raises(RunError, match="stopped"):
            host.call("m", 1, [0])
    finally:
        host.close()


def test_a_child_that_answers_with_an_error_is_closed(tmp_path, monkeypatch):
    host, switch = _host(tmp_path, monkeypatch, timeout_s=120.0)
    proc = host._proc
    try:
        switch.write_text("fail")
        with pytest.raises(RunError, match="injected failure in the child"):
            host.call("m", 1, [0])
        assert proc is not None and proc.wait(15) is not None
    finally:
        host.close()


@pytest.mark.parametrize("just_in_time", [False, True], ids=["early", "just-in-time"])
def test_a_just_in_time_worker_takes_its_next_batch_when_the_running_one_ends(just_in_time):
    """Items trickling in while a batch runs: an early worker takes the first as a batch of
    one; a just-in-time worker leaves them queued until the running batch is about to end and
    takes them together."""
    device_s = 0.12
    buckets = [1, 2, 4, 8]
    d = Dispatcher(["m"], max_queue_delay_ns=0)
    state = WorkerState(0, "gpu#0", "cuda:0/fp16", "m", buckets, {"m"}, LatencyEstimate(), depth=2)
    for b in buckets:
        state.estimate.update(b, device_s * 1e9, "m")
    d.add_worker(state)
    sizes: list[int] = []
    d.on_batch_done = lambda w, b, start, end, timing: sizes.append(len(b.items))
    done = threading.Event()
    d.set_completion(lambda pairs, ok, t: sum(sizes) >= 6 and done.set())
    # The first batch's gather takes 30 ms: an item arriving meanwhile is queued when it launches.
    runners = {b: SleepDevice(b, device_s, 0.03) for b in buckets}
    worker = Worker(state, {"m": runners}, {"m": np.zeros((8, 1), np.float32)}, d,
                    just_in_time=just_in_time)
    worker.start()
    d.submit([Query(0, "m", (0,))])
    time.sleep(0.01)
    for i in range(1, 6):  # five more, 15 ms apart, while the first batch gathers and runs
        d.submit([Query(i, "m", (i,))])
        time.sleep(0.015)
    assert done.wait(30)
    d.close()
    worker.join(10)
    assert sizes[0] == 1 and sum(sizes) == 6
    if just_in_time:
        assert sizes[1:] == [5], sizes
    else:
        assert len(sizes) >= 3 and sizes[1] < 5, sizes  # taken at the first launch


def _wait_for_a_launch(devices: list[SleepDevice]) -> None:
    """Until one of `devices` has launched a batch (10 s at most)."""
    deadline = time.monotonic() + 10
    while not any(r._launched_at for r in devices) and time.monotonic() < deadline:
        time.sleep(0.001)


def _one_gpu_worker(device_s: float, queue_delay_ns: int) -> tuple[Dispatcher, WorkerState]:
    """A dispatcher of model `m` and one pipelined worker's state, its estimate primed."""
    d = Dispatcher(["m"], max_queue_delay_ns=queue_delay_ns)
    state = WorkerState(0, "gpu#0", "cuda:0/fp16", "m", [1], {"m"}, LatencyEstimate(), depth=2)
    state.estimate.update(1, device_s * 1e9, "m")
    d.add_worker(state)
    return d, state


def test_a_launch_does_not_wait_for_a_report_when_the_helpers_gather_is_done():
    """The next batch's gather ran on the helper thread under the running batch and is over (or
    nearly) when that batch is collected: the next batch launches, then the one before is
    reported, so a slow report (answers to many requests) no longer keeps the device idle."""
    device_s, gather_s, report_s = 0.05, 0.03, 0.03
    batches = 8
    d, state = _one_gpu_worker(device_s, queue_delay_ns=0)
    taken: list[tuple[str, int]] = []
    reported = threading.Event()

    def done(w, b, start, end, timing):
        taken.append((b.gather_path, b.idle_before_ns))
        time.sleep(report_s)  # the report's own work, on the worker's thread
        if len(taken) >= batches:
            reported.set()

    d.on_batch_done = done
    worker = Worker(state, {"m": {1: SleepDevice(1, device_s, gather_s)}},
                    {"m": np.zeros((8, 1), np.float32)}, d, just_in_time=True)
    d.submit([Query(i, "m", (i,)) for i in range(batches)])
    worker.start()
    assert reported.wait(30)
    d.close()
    worker.join(10)
    # Every gather after the first goes to the helper (it is over half the device time left).
    helper = [idle for path, idle in taken if path == "helper"]
    assert len(helper) == batches - 1, taken
    # Before, each of them launched a report (30 ms) after the batch before was collected, so
    # the device idled at least that long. Now it waits only for what is left of the helper's
    # gather (about 10 ms here: the gather begins after the 30 ms report, 20 ms before the
    # running batch ends; more on a loaded machine, whose sleeps overshoot).
    assert max(helper) < 0.8 * report_s * 1e9, taken


@pytest.mark.parametrize("several_inputs", [False, True])
def test_a_batch_that_becomes_ready_while_one_runs_is_gathered_under_it(several_inputs):
    """A request arriving while the running batch is on the device: the worker takes it when
    the running batch is about to end and gathers it under that batch, rather than collecting
    first and gathering with the device idle. The same with a runner of several inputs (ids
    and a mask), which used to say its batch was over the moment it was launched."""
    device_s, gather_s = 0.08, 0.03
    d, state = _one_gpu_worker(device_s, queue_delay_ns=10_000_000)
    stamps: list[dict[str, int]] = []
    finished = threading.Event()

    def done(w, b, start, end, timing):
        stamps.append(dict(b.stamps))
        if len(stamps) == 2:
            finished.set()

    d.on_batch_done = done
    if several_inputs:
        runner = seq_runner(1, device_s, gather_s)
        pool = IOSamples.generate(TOKENS, "m", 8, 0, 16)
    else:
        runner, pool = SleepDevice(1, device_s, gather_s), np.zeros((8, 1), np.float32)
    worker = Worker(state, {"m": {1: runner}}, {"m": pool}, d, just_in_time=True)
    worker.start()
    d.submit([Query(0, "m", (0,))])
    _wait_for_a_launch(list(runner.runners.values()) if several_inputs else [runner])
    # The first batch is on the device; its worker asks for the next one 40 ms after the
    # launch (two gathers are over half the batch: half the batch before its expected end);
    # this one arrives 15 ms after the launch, its queue delay over 10 ms later.
    time.sleep(0.015)
    d.submit([Query(1, "m", (1,))])
    assert finished.wait(30)
    d.close()
    worker.join(10)
    first, second = stamps
    # Ready 55 ms before the first batch ends: gathered on the helper by then, launched as
    # soon as the first was collected. Collected first, it waited for its 30 ms gather.
    assert second["gather_end"] <= first["collect"], (first, second)
    assert second["launch"] - first["collect"] < 0.5 * gather_s * 1e9, (first, second)


class TaggedDevice(SleepDevice):
    """`SleepDevice` whose outputs are its batch's inputs, in one host buffer or two by turns
    (`outputs_survive_launch`), logging launches and reads: a read after the next launch of a
    one-buffer runner gets the next batch's outputs."""

    def __init__(self, device_s: float, gather_s: float, survive: bool) -> None:
        super().__init__(1, device_s, gather_s)
        self.outputs_survive_launch = survive
        self.log: list[tuple[str, float]] = []
        self._staged = np.zeros(1, np.float32)
        self._buffers = [np.zeros(1, np.float32), np.zeros(1, np.float32)]
        self._launched = self._collected = 0

    def gather_input(self, pool, indices) -> None:
        time.sleep(self.gather_s)
        self._staged = np.asarray(pool)[list(indices), 0].copy()

    def launch(self) -> None:
        super().launch()
        self._launched = 1 - self._launched if self.outputs_survive_launch else 0
        self._buffers[self._launched] = self._staged
        self.log.append(("launch", float(self._staged[0])))

    def collect(self) -> BatchTiming:
        timing = super().collect()
        self._collected = self._launched
        return timing

    def outputs(self) -> list[np.ndarray]:
        out = self._buffers[self._collected]
        self.log.append(("read", float(out[0])))
        return [out[:, None].copy()]


@pytest.mark.parametrize("survive", [False, True])
def test_a_batchs_outputs_are_read_after_the_next_launch_only_where_they_survive_it(survive):
    """A runner whose collected outputs survive the next launch (two host buffers by turns) has
    the next batch launched first and the outputs read after; one that does not has them read
    first. Either way every request gets its own outputs."""
    d, state = _one_gpu_worker(0.03, queue_delay_ns=0)
    answers: dict[int, float] = {}
    finished = threading.Event()

    def on_outputs(batch, outputs):
        for item, row in zip(batch.items, outputs[0], strict=True):
            answers[item.query] = float(row[0])
        if len(answers) == 6:
            finished.set()

    d.on_outputs = on_outputs
    runner = TaggedDevice(0.03, 0.003, survive)
    worker = Worker(state, {"m": {1: runner}}, {"m": np.zeros((8, 1), np.float32)}, d,
                    just_in_time=True)
    d.submit([Query(i, "m", (0,), inputs=np.full((1, 1), i, np.float32)) for i in range(6)])
    worker.start()
    assert finished.wait(30)
    d.close()
    worker.join(10)
    assert answers == {i: float(i) for i in range(6)}
    # Where batch k's outputs were read: before batch k+1's launch, or after it.
    log = runner.log
    reads_after_next_launch = sum(1 for before, now in itertools.pairwise(log)
                                  if now[0] == "read" and before == ("launch", now[1] + 1))
    if survive:
        assert reads_after_next_launch >= 4, runner.log
    else:
        assert reads_after_next_launch == 0, runner.log


def test_a_worker_waiting_for_its_next_batch_leaves_an_item_to_an_idle_worker():
    """Two workers of one model, one running a batch and waiting for its next, one idle: an item
    that arrives then goes to the idle one, which starts it at once."""
    device_s, gather_s = 0.3, 0.005
    d = Dispatcher(["m"], max_queue_delay_ns=0)
    states, runners, workers = [], [], []
    for k in range(2):
        state = WorkerState(k, f"gpu#{k}", "cuda:0/fp16", "m", [1], {"m"}, LatencyEstimate(),
                            depth=2)
        state.estimate.update(1, device_s * 1e9, "m")
        d.add_worker(state)
        runner = SleepDevice(1, device_s, gather_s)
        states.append(state)
        runners.append(runner)
        workers.append(Worker(state, {"m": {1: runner}}, {"m": np.zeros((8, 1), np.float32)}, d,
                              just_in_time=True))
    ran: list[tuple[int, str]] = []  # (query, worker)
    finished = threading.Event()

    def done(w, b, start, end, timing):
        ran.extend((it.query, w.name) for it in b.items)
        if len(ran) == 2:
            finished.set()

    d.on_batch_done = done
    for worker in workers:
        worker.start()
    d.submit([Query(0, "m", (0,))])
    _wait_for_a_launch(runners)
    # A full batch waiting: the busy worker asks for it at once (`_wait_to_take`), 250 ms
    # before its own batch ends, while the other waits idle.
    time.sleep(0.05)
    d.submit([Query(1, "m", (1,))])
    assert finished.wait(30)
    d.close()
    for worker in workers:
        worker.join(10)
    by_query = dict(ran)
    assert by_query[0] != by_query[1], ran


class _FailingSecondLaunch(SleepDevice):
    """A clock device whose second launch raises (a broken device, not an input)."""

    launches = 0

    def launch(self) -> None:
        self.launches += 1
        if self.launches == 2:
            raise RuntimeError("device lost")
        super().launch()


def test_a_collected_batch_is_answered_when_the_next_launch_fails():
    """Batch k was collected and read before k+1's launch raised: k's query completes, only
    k+1's items are handed back for a retry (before, both were)."""
    device_s, gather_s = 0.08, 0.03
    d, state = _one_gpu_worker(device_s, queue_delay_ns=0)
    outcomes: dict[int, bool] = {}
    settled = threading.Event()

    def completed(pairs, ok, t):
        for query, _ in pairs:
            outcomes[query] = ok
        if len(outcomes) == 2:
            settled.set()

    d.set_completion(completed)
    worker = Worker(state, {"m": {1: _FailingSecondLaunch(1, device_s, gather_s)}},
                    {"m": np.zeros((8, 1), np.float32)}, d, just_in_time=True)
    d.submit([Query(i, "m", (i,)) for i in range(2)])
    worker.start()
    assert settled.wait(30), outcomes
    d.close()
    worker.join(10)
    # The only worker is out of service: the second query fails once its retry finds none.
    assert outcomes == {0: True, 1: False}, outcomes


def test_a_batch_that_ends_before_its_estimate_is_answered_when_it_ends():
    """A just-in-time worker waiting to take its next batch notices the running one is over:
    its answers go out then, not at the (stale, far larger) estimate, while a partial batch
    waits in the queue."""
    device_s, estimate_s = 0.03, 0.6
    d = Dispatcher(["m"], max_queue_delay_ns=0)
    state = WorkerState(0, "gpu#0", "cuda:0/fp16", "m", [8], {"m"}, LatencyEstimate(), depth=2)
    state.estimate.update(8, estimate_s * 1e9, "m")  # measured once under a slow moment
    d.add_worker(state)
    spans: list[tuple[int, int, int]] = []
    d.on_batch_done = lambda w, b, start, end, timing: spans.append((len(b.items), start, end))
    answered: dict[int, float] = {}
    done = threading.Event()

    def on_complete(pairs, ok, t):
        for q, _ in pairs:
            answered[q] = time.perf_counter()
        if len(answered) >= 3:
            done.set()

    d.set_completion(on_complete)
    worker = Worker(state, {"m": {8: SleepDevice(8, device_s, 0.0)}},
                    {"m": np.zeros((8, 1), np.float32)}, d, just_in_time=True)
    worker.start()
    submitted = time.perf_counter()
    d.submit([Query(0, "m", (0,))])
    time.sleep(0.01)
    d.submit([Query(1, "m", (1,)), Query(2, "m", (2,))])  # queued behind the running batch
    assert done.wait(30)
    d.close()
    worker.join(10)
    first_ms = (answered[0] - submitted) * 1e3
    assert first_ms < 0.5 * estimate_s * 1e3, f"answered after {first_ms:.0f} ms"
    # The batch's measured latency is its device time, so the estimate comes down with it.
    _, start, end = spans[0]
    assert (end - start) / 1e6 < 0.5 * estimate_s * 1e3
    assert state.estimate.expected_ns(8, "m") < estimate_s * 1e9
    # The queued two still ran together, after it.
    assert [n for n, _, _ in spans] == [1, 2], spans
