"""`infermux serve` when a worker fails mid-run: restarted a bounded number of times, or its
model marked not ready, while the other models keep serving; no admitted request is dropped.

Real faults: a worker's child process killed with SIGKILL (between batches, and while it runs
the batch of a request), and a model broken for good by a marked input, as a device whose
context was lost (tests/engine_models/faulty.py). Triton's own clients talk to a real
`infermux serve` process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from tests.conftest import worker_children
from tests.test_serve import Server

#: Asserts on timing or on processes coming and going: `make test` runs it in its serial pass.
pytestmark = pytest.mark.exclusive

FAULTY = Path(__file__).parent / "engine_models" / "faulty.py"


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 16, 16)).astype(np.float32)


def _reference(x: np.ndarray) -> np.ndarray:
    import torch

    from infermux.models import ModelSpec, load_model

    module = load_model(ModelSpec(f"{FAULTY}:build")).module
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


def _infer(client: Any, model: str, x: np.ndarray) -> np.ndarray:
    tensor = thttp.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor]).as_numpy("output")


def _until(check: Callable[[], bool], timeout_s: float, what: str,
           detail: Callable[[], Any] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            why = f" ({detail()})" if detail is not None else ""
            raise AssertionError(f"not within {timeout_s:g}s: {what}{why}")
        time.sleep(0.05)


def _ready_reason(srv: Server, model: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{srv.http}/v2/models/{model}/ready", timeout=10) as r:
            return r.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}").get("error", "")


def _restarts(srv: Server, model: str) -> float:
    return sum(v for k, v in srv.scrape().items()
               if k.startswith("infermux_worker_restarts_total") and f'model="{model}"' in k)


@contextlib.contextmanager
def _serving(plan: dict[str, Any], tmp: Path, *extra: str) -> Any:
    srv = Server(tmp, plan, *extra)
    try:
        yield srv
    finally:
        with contextlib.suppress(ProcessLookupError):
            srv.proc.kill()
        srv.proc.wait(10)


def test_a_killed_worker_process_is_restarted_and_its_request_answered(tmp_path: Path) -> None:
    # "slow" runs each batch for 0.4 s in a pinned child process; "net" serves beside it.
    plan = {"name": "kill", "models": [
        {"name": "slow", "model": f"{FAULTY}:slow",
         "replicas": [{"unit": "cpu:1", "instances": 1, "batch": 1}]},
        {"name": "net", "model": f"{FAULTY}:build",
         "replicas": [{"unit": "cpu:0", "instances": 1, "batch": 2}]}],
        "dispatcher": {"max_queue_delay_ms": 1}}
    with _serving(plan, tmp_path) as srv:
        client = thttp.InferenceServerClient(srv.http, network_timeout=60)
        pid = srv.ready["worker_pids"]["slow/cpu:1#0"]
        x = _x(1, seed=3)

        # 1. Killed between batches: noticed, the model is not ready while it restarts,
        # requests get 503 naming why; the other model serves throughout.
        os.kill(pid, signal.SIGKILL)
        _until(lambda: not client.is_model_ready("slow"), 5, "slow not ready after the kill")
        status, reason = _ready_reason(srv, "slow")
        assert status == 503 and "SIGKILL" in reason and "restarting" in reason, reason
        with pytest.raises(InferenceServerException) as info:
            _infer(client, "slow", x)
        assert "not ready" in info.value.message() and "restart" in info.value.message()
        assert client.is_model_ready("net")
        np.testing.assert_allclose(_infer(client, "net", _x(2)), _reference(_x(2)),
                                   rtol=1e-5, atol=1e-5)
        _until(lambda: client.is_model_ready("slow"), 60, "slow ready again after its restart",
               lambda: (_ready_reason(srv, "slow"), _restarts(srv, "slow")))
        np.testing.assert_allclose(_infer(client, "slow", x), _reference(x), rtol=1e-5, atol=1e-5)
        assert _restarts(srv, "slow") == 1

        # 2. Killed while it runs a request's batch: the request waits for the restart and
        # is answered with the right outputs, not dropped and not failed.
        pids = {p for p in _children(srv.proc.pid)}
        got: dict[str, Any] = {}

        def request() -> None:
            try:
                got["y"] = _infer(thttp.InferenceServerClient(srv.http, network_timeout=60),
                                  "slow", x)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                got["error"] = exc

        caller = threading.Thread(target=request)
        caller.start()
        time.sleep(0.2)  # inside the 0.4 s batch
        current = {p for p in _children(srv.proc.pid)}
        victim = _worker_child(srv, current, exclude=pid)
        os.kill(victim, signal.SIGKILL)
        caller.join(90)
        assert "error" not in got, got.get("error")
        np.testing.assert_allclose(got["y"], _reference(x), rtol=1e-5, atol=1e-5)
        assert _restarts(srv, "slow") == 2
        # It was in the batch the kill interrupted, and ran again on the restarted worker.
        assert srv.scrape()["infermux_items_retried_total"] == 1
        assert pids  # the server had children to kill
        stats = client.get_inference_statistics("slow")["model_stats"][0]["inference_stats"]
        assert int(stats["fail"]["count"]) == 0
        code, out = srv.stop()
        assert code == 0, out
        stopped = json.loads(out[out.index("{"):])
        assert stopped["restarts"]["slow/cpu:1#0"]["restarts"] == 2
        assert stopped["models"]["slow"]["requests_failed"] == 0


def _children(pid: int) -> list[int]:
    """Process ids of `pid`'s worker children."""
    return [p.pid for p in worker_children(pid)]


def _worker_child(srv: Server, children: set[int], exclude: int) -> int:
    """The child process that now hosts the `slow` worker (it was restarted: a new pid)."""
    for p in children:
        if p == exclude:
            continue
        with contextlib.suppress(OSError):
            if _affinity(p) == {1}:
                return p
    raise AssertionError(f"no worker child on core 1 among {sorted(children)}")


def _affinity(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


def test_a_model_whose_device_breaks_is_restarted_then_left_not_ready(tmp_path: Path) -> None:
    # `breakable` fails every batch once a marked input has run (a device whose context was
    # lost): the worker's check after the failure fails too, so it is the worker's fault and
    # its process is restarted (a new process is whole again), at most once here.
    plan = {"name": "raise", "models": [
        {"name": "fragile", "model": f"{FAULTY}:breakable",
         "replicas": [{"unit": "cpu:1", "instances": 1, "batch": 2}]},
        {"name": "net", "model": f"{FAULTY}:build",
         "replicas": [{"unit": "cpu:0", "instances": 1, "batch": 2}]}],
        "dispatcher": {"max_queue_delay_ms": 1}}
    poison = np.full((1, 3, 16, 16), 2e6, dtype=np.float32)
    with _serving(plan, tmp_path, "--max-restarts", "1") as srv:
        client = tgrpc.InferenceServerClient(srv.grpc)

        def infer(model: str, x: np.ndarray) -> np.ndarray:
            tensor = tgrpc.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            return client.infer(model, [tensor]).as_numpy("output")

        for restarts_left in (1, 0):
            with pytest.raises(InferenceServerException) as info:
                infer("fragile", poison)  # the device breaks: this request gets the error
            assert info.value.status() == "StatusCode.UNAVAILABLE"
            assert "device lost" in info.value.message()
            if restarts_left:
                _until(lambda: client.is_model_ready("fragile"), 30, "fragile restarted")
                np.testing.assert_allclose(infer("fragile", _x(1)), _reference(_x(1)),
                                           rtol=1e-5, atol=1e-5)
        # Out of restarts: not ready for good, saying why; "net" serves on.
        _until(lambda: not client.is_model_ready("fragile"), 5, "fragile left not ready")
        time.sleep(1.0)  # past the backoff a restart would have waited
        assert not client.is_model_ready("fragile") and not client.is_server_ready()
        with pytest.raises(InferenceServerException) as info:
            infer("fragile", _x(1))
        message = info.value.message()
        assert info.value.status() == "StatusCode.UNAVAILABLE"
        assert "not ready" in message and "restarted 1 times" in message, message
        assert "device lost" in message
        np.testing.assert_allclose(infer("net", _x(2)), _reference(_x(2)), rtol=1e-5, atol=1e-5)
        assert _restarts(srv, "fragile") == 1
        code, out = srv.stop()
        assert code == 0, out


def test_requests_waiting_for_a_restart_get_503_after_the_drain_timeout(tmp_path: Path) -> None:
    # "slow" runs each batch for 0.4 s in a child process; killed with requests queued for it,
    # its restart (a backoff, then a new child that imports torch and builds) takes longer than
    # the 1 s drain timeout: the waiting requests are answered 503, saying why, not held.
    plan = {"name": "expire", "models": [
        {"name": "slow", "model": f"{FAULTY}:slow",
         "replicas": [{"unit": "cpu:1", "instances": 1, "batch": 1}]}],
        "dispatcher": {"max_queue_delay_ms": 1}}
    with _serving(plan, tmp_path, "--drain-timeout", "1s") as srv:
        pid = srv.ready["worker_pids"]["slow/cpu:1#0"]
        x = _x(1, seed=5)
        results: dict[int, Any] = {}

        def request(i: int) -> None:
            try:
                results[i] = _infer(thttp.InferenceServerClient(srv.http, network_timeout=60),
                                    "slow", x)
            except InferenceServerException as exc:
                results[i] = exc

        callers = [threading.Thread(target=request, args=(i,)) for i in range(4)]
        for caller in callers:
            caller.start()
        time.sleep(0.2)  # one request in its 0.4 s batch, the others queued behind it
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for caller in callers:
            caller.join(60)
        waited_s = time.monotonic() - killed
        assert len(results) == 4, results
        refused = [r for r in results.values() if isinstance(r, InferenceServerException)]
        assert refused, "every request waited for the restart"
        for exc in refused:
            assert "has no live worker" in exc.message() and "waited 1s" in exc.message(), exc
            assert exc.status() == "503", exc.status()
        for r in results.values():  # any answered one was answered right
            if not isinstance(r, InferenceServerException):
                np.testing.assert_allclose(r, _reference(x), rtol=1e-5, atol=1e-5)
        assert waited_s < 15, waited_s
        # The worker comes back and serves.
        client = thttp.InferenceServerClient(srv.http, network_timeout=60)
        _until(lambda: client.is_model_ready("slow"), 60, "slow ready again after its restart",
               lambda: (_ready_reason(srv, "slow"), _restarts(srv, "slow")))
        np.testing.assert_allclose(_infer(client, "slow", x), _reference(x), rtol=1e-5, atol=1e-5)
        code, out = srv.stop()
        assert code == 0, out
