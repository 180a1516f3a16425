"""Where a served request waits: the stage trace (`serve --trace-requests`) and the waits it found.

A real server with two front processes traces every request: each one's stages, from the front
that received it to the front that answered, come back in order on one clock, and the summary
names every gap. The runtime's pipelined worker (the GPU loop, driven by a runner whose
'device' is the clock) collects a finished batch when its device time says it ends, whatever
its host-side estimate became, and reports it before the next batch's gather.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("uvicorn")

import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from infermux.engines.base import BatchTiming
from infermux.load.base import Query
from infermux.runtime import Dispatcher, LatencyEstimate, WorkerState
from infermux.runtime.worker import Worker
from infermux.serve.trace import STAGES, summarize
from tests.test_correctness_runtime import SleepDevice
from tests.test_serve import NET, Server, _plan, _x


class DeviceTimed(SleepDevice):
    """A `SleepDevice` that reports its batch's device time, as a GPU runner does (CUDA events)."""

    def collect(self) -> BatchTiming:
        timing = super().collect()
        return BatchTiming(latency_ns=timing.latency_ns, compute_ns=int(self.device_s * 1e9))


def _pipelined(runners: dict[int, Any], host_estimate_s: float) -> tuple[Dispatcher, Worker]:
    buckets = sorted(runners)
    d = Dispatcher(["m"], max_queue_delay_ns=0)
    state = WorkerState(0, "gpu#0", "cuda:0/fp16", "m", buckets, {"m"}, LatencyEstimate(),
                        depth=2)
    for b in buckets:
        state.estimate.update(b, host_estimate_s * 1e9, "m")
    d.add_worker(state)
    worker = Worker(state, {"m": runners}, {"m": np.zeros((8, 1), np.float32)}, d,
                    just_in_time=True)
    return d, worker


def test_a_finished_batch_is_collected_when_the_device_says_though_the_host_estimate_is_stale(
) -> None:
    """The worker's host estimate (launch → collect) says 0.6 s, the device takes 20 ms. Lone
    requests: each batch, the first included (the runner says when its device work is done),
    is collected when its device time ends, not held until the stale estimate while the
    worker waits to take the next (which also kept the estimate stale: it learnt its own
    wait)."""
    device_s = 0.02
    d, worker = _pipelined({b: DeviceTimed(b, device_s, 0.0) for b in (1, 2, 4, 8)}, 0.6)
    spans_s: list[float] = []
    reported = threading.Condition()

    def on_batch(w: Any, b: Any, start: int, end: int, timing: Any) -> None:
        with reported:
            spans_s.append((end - start) / 1e9)
            reported.notify_all()

    d.on_batch_done = on_batch
    worker.start()
    try:
        for i in range(4):
            d.submit([Query(i, "m", (i,))])
            with reported:
                assert reported.wait_for(lambda n=i + 1: len(spans_s) >= n, 10), spans_s
    finally:
        d.close()
        worker.join(10)
    assert max(spans_s) < 0.2, spans_s


def test_a_batch_is_reported_before_the_next_batch_gathers() -> None:
    """Gathers longer than the device (a large served batch): batch k's answer goes out when
    k is collected, not after batch k+1's gather and launch."""
    device_s, gather_s = 0.02, 0.12
    d, worker = _pipelined({1: DeviceTimed(1, device_s, gather_s)}, device_s)
    late_s: list[float] = []
    done = threading.Event()

    def on_batch(w: Any, b: Any, start: int, end: int, timing: Any) -> None:
        late_s.append((time.perf_counter_ns() - b.stamps["collect"]) / 1e9)
        if len(late_s) >= 5:
            done.set()

    d.on_batch_done = on_batch
    d.submit([Query(i, "m", (i,)) for i in range(5)])  # a backlog: each batch has a next
    worker.start()
    try:
        assert done.wait(30)
    finally:
        d.close()
        worker.join(10)
    assert max(late_s) < gather_s / 2, late_s


@pytest.fixture(scope="module")
def net_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace_net") / "net.py"
    path.write_text(NET)
    return path


def test_every_request_is_traced_through_both_fronts_and_summarized(net_file: Path) -> None:
    trace = net_file.parent / "trace.jsonl"
    # Thread-hosted CPU workers run the one-batch loop, which stamps every stage.
    srv = Server(net_file.parent, _plan("traced", f"{net_file}:build", cpu_workers="thread"),
                 "--fronts", "2",
                 "--trace-requests", "1", "--trace-file", str(trace))
    sent = 0
    try:
        for k in range(6):  # fresh connections: the kernel spreads them over both fronts
            client: Any = (thttp.InferenceServerClient(srv.http) if k % 2
                           else tgrpc.InferenceServerClient(srv.grpc))
            mod: Any = thttp if k % 2 else tgrpc
            inp = mod.InferInput("input", [1, 3, 16, 16], "FP32")
            inp.set_data_from_numpy(_x(1, seed=k))
            assert client.infer("net", [inp]).as_numpy("output").shape == (1, 10)
            client.close()
            sent += 1
    finally:
        code, out = srv.stop()
    assert code == 0, out
    summary = json.loads(out[out.index("{"):])
    traced = summary["trace"]
    assert traced["path"] == str(trace) and traced["every"] == 1
    # The request that probes the outputs at start-up is the core's own, never traced.
    assert traced["requests"] == sent
    # Every stage of a request through a front process, in order, one clock for all.
    expected = [f"{a}->{b}" for a, b in itertools.pairwise(STAGES)]
    assert list(traced["gaps"]) == expected
    assert all(g["count"] == sent and g["p50_ms"] >= 0 for g in traced["gaps"].values())
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    fronts = {r["front"] for r in lines}
    assert len(lines) == sent and fronts <= set(summary["front_pids"])
    assert summarize(str(trace))["requests"] == sent


def test_requests_of_a_model_of_several_inputs_are_traced_in_the_runtime_too(
        net_file: Path, two_inputs: tuple[str, str]) -> None:
    """A model of float features and int64 ids through two front processes: the runtime's
    stages of each traced request are written beside the fronts' (they were skipped)."""
    trace = net_file.parent / "two.jsonl"
    plan = _plan("two", two_inputs[0], cpu_workers="thread")
    plan["models"][0]["seq_buckets"] = [8]
    srv = Server(net_file.parent, plan, "--fronts", "2", "--trace-requests", "1",
                 "--trace-file", str(trace))
    sent = 0
    try:
        for k in range(4):
            client = tgrpc.InferenceServerClient(srv.grpc)
            features = tgrpc.InferInput("features", [1, 16], "FP32")
            features.set_data_from_numpy(np.full((1, 16), k, np.float32))
            ids = tgrpc.InferInput("ids", [1, 8], "INT64")
            ids.set_data_from_numpy(np.arange(8, dtype=np.int64)[None] + k)
            assert client.infer("net", [features, ids]).as_numpy("scores").shape == (1, 4)
            client.close()
            sent += 1
    finally:
        code, out = srv.stop()
    assert code == 0, out
    traced = json.loads(out[out.index("{"):])["trace"]
    assert traced["requests"] == sent
    gaps = traced["gaps"]
    for gap in ("front_sent->frame_read", "enqueued->taken", "launch->launched",
                "launched->collect", "written->front_got"):
        assert gaps[gap]["count"] == sent, (gap, gaps)
    # Each traced request's batch: its bucket (one request a batch here), items, device time.
    ((_, batches),) = traced["batches"].items()
    assert batches["requests"] == sent and batches["mean_items"] == 1, traced["batches"]
    assert batches["device"]["count"] == sent and batches["device"]["mean_ms"] > 0


def test_the_in_process_fronts_trace_from_admission_to_the_resumed_handler(net_file: Path,
                                                                         ) -> None:
    trace = net_file.parent / "inproc.jsonl"
    srv = Server(net_file.parent, _plan("inproc", f"{net_file}:build", cpu_workers="thread"),
                 "--fronts", "1", "--trace-requests", "2", "--trace-file", str(trace))
    try:
        client = tgrpc.InferenceServerClient(srv.grpc)
        for k in range(4):
            inp = tgrpc.InferInput("input", [1, 3, 16, 16], "FP32")
            inp.set_data_from_numpy(_x(1, seed=k))
            client.infer("net", [inp])
        client.close()
    finally:
        code, out = srv.stop()
    assert code == 0, out
    traced = json.loads(out[out.index("{"):])["trace"]
    # Every 2nd request (the start-up probe took no number of its own: 4 sent, 2 traced).
    assert traced["requests"] == 2
    gaps = list(traced["gaps"])
    assert gaps[0] == "admitted->enqueued" and gaps[-1] == "answer_queued->written", gaps
    assert "enqueued->taken" in gaps and "launched->collect" in gaps


def test_a_negative_trace_rate_is_refused_in_one_line(net_file: Path, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.test_serve import ROOT

    plan = tmp_path / "p.json"
    plan.write_text(json.dumps(_plan("bad", f"{net_file}:build")))
    done = subprocess.run([sys.executable, "-m", "infermux", "serve", str(plan),
                           "--trace-requests", "-2", "--no-store"], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
                          timeout=120)
    assert done.returncode != 0
    assert "--trace-requests -2 must be 0 (off)" in done.stderr
    assert "Traceback" not in done.stderr
