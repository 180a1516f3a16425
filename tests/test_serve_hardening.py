"""`infermux serve` against clients that misbehave: no request may take it down or exhaust it.

Real server processes on the CPU, driven by raw sockets and Triton's own clients: memory held
for request bodies is bounded over all connections; a second SIGTERM is stored as an
interruption; settings that could never admit a request are refused; the API key is never
stored and guards the metrics too; ready means every front accepts connections; gRPC at high
concurrency answers every call (outputs, or UNAVAILABLE past admission); a request the engine
rejects fails alone while the model keeps serving, and a broken device restarts its worker
within a restart budget per time window.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
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

from tests.test_serve import ROOT, Server

FAULTY = Path(__file__).parent / "engine_models" / "faulty.py"
_ITEM_VALUES = 3 * 16 * 16


def _plan(name: str, factory: str = "build", *, batch: int = 4, **dispatcher: Any,
          ) -> dict[str, Any]:
    return {"name": name, "models": [{"name": "net", "model": f"{FAULTY}:{factory}", "replicas": [
        {"unit": "cpu:0", "engine": "torch", "instances": 1, "batch": batch}]}],
        "dispatcher": {"max_queue_delay_ms": 1, **dispatcher}}


@contextlib.contextmanager
def _serving(tmp: Path, plan: dict[str, Any], *extra: str) -> Any:
    srv = Server(tmp, plan, *extra)
    try:
        yield srv
    finally:
        with contextlib.suppress(ProcessLookupError):
            srv.proc.kill()
        srv.proc.wait(10)


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 16, 16)).astype(np.float32)


def _post(srv: Server, x: np.ndarray, headers: dict[str, str] | None = None,
          ) -> tuple[int, dict[str, str], bytes]:
    import http.client

    header = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                     "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    conn = http.client.HTTPConnection(srv.http, timeout=60)
    try:
        conn.request("POST", "/v2/models/net/infer", body=header + x.tobytes(),
                     headers={"Inference-Header-Content-Length": str(len(header)),
                              **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g}s: {what}")
        time.sleep(0.05)


# -- memory: bodies held at once ------------------------------------------------------------------


def test_bodies_held_at_once_are_bounded_and_given_back(tmp_path: Path) -> None:
    # Clients that declare large bodies and send them slowly: each body is reserved from one
    # budget over all connections when its headers arrive; past it, 503 before any is read.
    with _serving(tmp_path, _plan("budget")) as srv:
        host, port = srv.http.split(":")
        declared = 4 * _ITEM_VALUES * 20  # a JSON body of 4 items, within a request's limit
        stalled: list[socket.socket] = []
        answers: list[bytes] = []
        for _ in range(12):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"POST /v2/models/net/infer HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\n"
                      b"Content-Length: " + str(declared).encode() + b"\r\n\r\n" + b"{" * 100)
            stalled.append(s)
        time.sleep(1.0)
        for s in stalled:
            s.settimeout(0.5)
            with contextlib.suppress(TimeoutError, socket.timeout):
                answers.append(s.recv(4096))
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert refused, "every stalled body was admitted: nothing bounds the bodies held"
        assert len(refused) < len(stalled)  # those that fit wait for their bodies
        head, _, body = refused[0].partition(b"\r\n\r\n")
        assert b"retry-after: 1" in head.lower()
        assert b"request bodies" in body
        for s in stalled:
            s.close()
        # The bodies' memory is given back when their connections go: a request fits again.
        _until(lambda: _post(srv, _x(4))[0] == 200, 20, "a request admitted after the stalls")
        code, out = srv.stop()
        assert code == 0, out


# -- shutdown -------------------------------------------------------------------------------------


def test_a_second_sigterm_is_stored_as_interrupted_with_the_requests_dropped(
        tmp_path: Path) -> None:
    import signal

    plan = _plan("twice", "slow", batch=1, cpu_workers="thread")  # 0.4 s a batch, one at a time
    with _serving(tmp_path, plan) as srv:
        codes: list[int] = []

        def call(k: int) -> None:
            with contextlib.suppress(OSError):
                codes.append(_post(srv, _x(1, seed=k))[0])

        threads = [threading.Thread(target=call, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        # Admitted: in flight, or already answered (on a loaded machine the first 0.4 s batch
        # may end before the sixth request arrives).
        _until(lambda: srv.scrape().get('infermux_items_in_flight{model="net"}', 0)
               + codes.count(200) >= 6, 30, "six requests admitted")
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)  # stop now: what is left is dropped
        out, _ = srv.proc.communicate(timeout=60)
        for t in threads:
            t.join(30)
        assert srv.proc.returncode == 1, out
        summary = json.loads(out[out.index("{"):])
        assert summary["status"] == "interrupted"
        dropped = summary["requests_dropped"]
        assert 1 <= dropped <= 6
        assert "second stop signal" in summary["error"] and str(dropped) in summary["error"]
        assert codes.count(503) == dropped and codes.count(200) == 6 - dropped
        from infermux.store import open_store

        with open_store(srv.db) as store:
            run = store.run(summary["run_id"])
        assert run["status"] == "interrupted"


# -- settings -------------------------------------------------------------------------------------


def _serve_cli(tmp_path: Path, plan: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    plan_file = tmp_path / "p.yaml"
    plan_file.write_text(json.dumps(plan))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "infermux", "serve", str(plan_file), *args],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)


def test_a_queue_smaller_than_the_largest_batch_is_refused_at_start(tmp_path: Path) -> None:
    done = _serve_cli(tmp_path, _plan("small", batch=4), "--max-queue", "3", "--no-store")
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    assert "--max-queue 3" in line and "4" in line and "net" in line


def test_the_api_key_is_never_stored_and_guards_the_metrics(tmp_path: Path) -> None:
    key = "s3cret-key-value"
    with _serving(tmp_path, _plan("auth"), f"--api-key={key}") as srv:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(srv.metrics, timeout=10)
        assert info.value.code == 401
        for header in ({"Authorization": f"Bearer {key}"}, {"X-API-Key": key}):
            request = urllib.request.Request(srv.metrics, headers=header)
            with urllib.request.urlopen(request, timeout=10) as reply:
                assert b"nv_inference_count" in reply.read()
        assert _post(srv, _x(1))[0] == 401
        assert _post(srv, _x(1), {"Authorization": f"Bearer {key}"})[0] == 200
        # gRPC metadata in every form a client may send, Triton's prefixed one included.
        import tritonclient.grpc as tgrpc
        from tritonclient.utils import InferenceServerException

        client = tgrpc.InferenceServerClient(srv.grpc)
        tensor = tgrpc.InferInput("input", [1, 3, 16, 16], "FP32")
        tensor.set_data_from_numpy(_x(1))
        try:
            with pytest.raises(InferenceServerException, match="API key"):
                client.infer("net", [tensor])
            for header in ({"authorization": f"Bearer {key}"}, {"x-api-key": key},
                           {"triton-grpc-protocol-x-api-key": key}):
                assert client.infer("net", [tensor], headers=header).as_numpy("output") is not None
        finally:
            client.close()
        code, out = srv.stop()
        assert code == 0, out
        run_id = json.loads(out[out.index("{"):])["run_id"]
    from infermux.store import open_store

    with open_store(srv.db) as store:
        run = store.run(run_id)
    assert key not in json.dumps(run, default=str)
    assert "--api-key=***" in run["command"]


def test_every_form_of_a_key_option_is_masked() -> None:
    from infermux.cli.serve import masked_argv

    argv = ["serve", "p.yaml", "--api-key", "k1", "--api-key=k2", "--metrics-port", "0"]
    assert masked_argv(argv) == ["serve", "p.yaml", "--api-key", "***", "--api-key=***",
                                 "--metrics-port", "0"]


# -- readiness ------------------------------------------------------------------------------------


def test_ready_only_once_every_front_accepts_connections(tmp_path: Path) -> None:
    # The HTTP port is fixed up front so the probe can hammer it while the server starts;
    # the moment it first says ready, the gRPC and metrics ports must accept connections too.
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    plan_file = tmp_path / "ready.yaml"
    plan_file.write_text(json.dumps(_plan("ready")))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "infermux", "serve", str(plan_file), "--http-port", str(ports[0]),
         "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--json", "--no-store",
         "--telemetry", "off"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "never ready"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready",
                                            timeout=5) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
        for port in ports[1:]:  # connection refused here is the defect
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert tgrpc.InferenceServerClient(f"127.0.0.1:{ports[1]}").is_server_ready()
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


# -- gRPC at high concurrency ---------------------------------------------------------------------


def test_grpc_at_concurrency_256_answers_every_call(tmp_path: Path) -> None:
    # 256 calls in flight at once over 8 channels (perf_analyzer shares a channel between
    # a few of its contexts): each call gets its outputs or, past admission, UNAVAILABLE
    # saying so; no connection is reset.
    with _serving(tmp_path, _plan("many", batch=8), "--max-queue", "64") as srv:
        x = _x(1, seed=1)
        results: list[tuple[str, str]] = []
        lock = threading.Lock()

        def done(result: Any, error: Any) -> None:
            with lock:
                if error is None:
                    results.append(("ok", ""))
                else:
                    results.append((error.status() or "", error.message() or ""))

        clients = [tgrpc.InferenceServerClient(srv.grpc) for _ in range(8)]
        tensor = tgrpc.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        for round_ in range(3):
            for k in range(256):
                clients[k % 8].async_infer("net", [tensor], callback=done,
                                           request_id=f"{round_}-{k}")
            want = 256 * (round_ + 1)
            _until(lambda want=want: len(results) >= want, 120, "every call answered")
        assert len(results) == 3 * 256
        oks = sum(1 for status, _ in results if status == "ok")
        refused = [m for status, m in results if status == "StatusCode.UNAVAILABLE"]
        others = [(s, m) for s, m in results if s not in ("ok", "StatusCode.UNAVAILABLE")]
        assert not others, others[:3]
        assert oks > 0
        assert all("admission limit" in m for m in refused), refused[:3]
        for c in clients:
            c.close()
        assert tgrpc.InferenceServerClient(srv.grpc).is_server_ready()
        code, out = srv.stop()
        assert code == 0, out
        summary = json.loads(out[out.index("{"):])["models"]["net"]
        assert summary["requests_ok"] == oks and summary["requests_rejected"] == len(refused)


@pytest.mark.parametrize("body", [
    b"\xff\xff\xff",                            # not a message: a field tag past the end
    b"\x0a\x05ne",                               # model_name's length past the end
    b"\x0a\x03net\x42\x80\x80\x80\x80\x10",        # raw contents: a varint length that never ends
    b"\x0a\x03net\x22\x04\x0a\x05in",                # an input whose name runs past its tensor
], ids=["garbage", "truncated-name", "endless-length", "truncated-input"])
def test_a_grpc_message_protobuf_cannot_parse_is_invalid_argument(
        grpc_server: Server, body: bytes) -> None:
    # grpc answers a deserializer's exception UNKNOWN ("Unexpected DecodeError"), a 500's
    # kin; the server answers INVALID_ARGUMENT saying what is wrong, and serves on.
    import grpc

    with grpc.insecure_channel(grpc_server.grpc) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(body, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "not an inference.ModelInferRequest" in (info.value.details() or "")
    assert tgrpc.InferenceServerClient(grpc_server.grpc).is_server_ready()


@pytest.fixture(scope="module")
def grpc_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with _serving(tmp_path_factory.mktemp("grpc_bad"), _plan("bad")) as srv:
        yield srv


def test_a_grpc_burst_past_admission_gets_only_answers_and_refusals_with_a_retry_hint(
        tmp_path: Path) -> None:
    # 3,000 calls at once over 8 channels against a model that holds 4 items at a time for
    # 0.4 s: nearly all are refused. Each call gets its outputs or UNAVAILABLE naming the
    # admission limit with a `retry-after` trailer (the refusal decided from the model's name
    # before decoding, `InferenceCore.refuse_early`): no reset, no cancel, none past its
    # deadline; the server's counts equal the client's to the call.
    import asyncio

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    calls = 3000
    x = _x(1, seed=2)
    request = service_pb2.ModelInferRequest(model_name="net")
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())

    async def burst(target: str) -> list[tuple[str, str, bool]]:
        channels = [grpc.aio.insecure_channel(target) for _ in range(8)]
        stubs = [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in channels]

        async def one(k: int) -> tuple[str, str, bool]:
            try:
                reply = await stubs[k % 8].ModelInfer(request, timeout=120)
                return "OK", reply.model_name, True
            except grpc.aio.AioRpcError as exc:
                hint = any(key == "retry-after" and value == "1"
                           for key, value in (exc.trailing_metadata() or ()))
                return exc.code().name, exc.details() or "", hint

        try:
            return await asyncio.gather(*(one(k) for k in range(calls)))
        finally:
            for c in channels:
                await c.close()

    with _serving(tmp_path, _plan("burst", "slow", batch=4), "--max-queue", "4") as srv:
        results = asyncio.run(burst(srv.grpc))
        codes = {code for code, _, _ in results}
        assert codes <= {"OK", "UNAVAILABLE"}, sorted(codes)
        refused = [(m, hint) for code, m, hint in results if code == "UNAVAILABLE"]
        oks = calls - len(refused)
        assert oks >= 4 and len(refused) > calls // 2
        assert all("admission limit" in m and hint for m, hint in refused), refused[:3]
        code, out = srv.stop()
        assert code == 0, out
        summary = json.loads(out[out.index("{"):])["models"]["net"]
        assert summary["requests_ok"] == oks and summary["requests_rejected"] == len(refused)


# -- an input's fault against the device's --------------------------------------------------------


def _reference(x: np.ndarray) -> np.ndarray:
    import torch

    from infermux.models import ModelSpec, load_model

    module = load_model(ModelSpec(f"{FAULTY}:build")).module
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


def _restarts(srv: Server) -> float:
    return sum(v for k, v in srv.scrape().items()
               if k.startswith("infermux_worker_restarts_total"))


@pytest.mark.parametrize("hosting", ["process", "thread"])
def test_an_input_the_engine_rejects_fails_alone_and_the_worker_serves_on(
        tmp_path: Path, hosting: str) -> None:
    # Four requests batched together (the batch waits 300 ms to fill), one with an input the
    # engine raises on: that one gets 400 naming the engine's error, the other three their
    # outputs (run again without it); the worker is neither taken out nor restarted.
    plan = _plan("reject", "poisonable", batch=4, cpu_workers=hosting)
    plan["dispatcher"]["max_queue_delay_ms"] = 300
    poison = np.full((1, 3, 16, 16), 2e6, dtype=np.float32)
    with _serving(tmp_path, plan, "--wait-when-idle") as srv:
        xs = {k: _x(1, seed=k) for k in range(3)}
        got: dict[Any, tuple[int, dict[str, str], bytes]] = {}

        def call(key: Any, x: np.ndarray) -> None:
            got[key] = _post(srv, x, {})

        threads = [threading.Thread(target=call, args=(k, x)) for k, x in xs.items()]
        threads.append(threading.Thread(target=call, args=("poison", poison)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        status, _, body = got["poison"]
        assert status == 400, body
        error = json.loads(body)["error"]
        assert "rejected the request's input" in error and "poisoned input" in error, error
        for k, x in xs.items():
            status, _, body = got[k]
            assert status == 200, body
            out = json.loads(body)
            data = np.array(out["outputs"][0]["data"], dtype=np.float32).reshape(1, 10)
            np.testing.assert_allclose(data, _reference(x), rtol=1e-5, atol=1e-5)
        client = tgrpc.InferenceServerClient(srv.grpc)
        tensor = tgrpc.InferInput("input", list(poison.shape), "FP32")
        tensor.set_data_from_numpy(poison)
        with pytest.raises(InferenceServerException) as info:
            client.infer("net", [tensor])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert client.is_model_ready("net") and client.is_server_ready()
        assert _restarts(srv) == 0
        metrics = srv.scrape()
        assert metrics['infermux_worker_alive{model="net",unit="cpu:0",worker="net/cpu:0#0"}'] == 1
        assert metrics['nv_inference_request_failure_total{model="net",reason="BACKEND",'
                       'version="1"}'] == 2
        code, out = srv.stop()
        assert code == 0, out


@pytest.mark.exclusive
def test_a_broken_device_restarts_its_worker_within_a_budget_per_window(tmp_path: Path) -> None:
    # `breakable` is broken for good by a marked input (as a device whose context was lost):
    # the worker's own check fails too, so it is restarted. One restart per 6 s window: the
    # second break within the window leaves the model not ready, until the window has passed.
    # (6 s: the first restart, a new process building its runners, must fit in it; forked
    # from the worker template it takes about a second.)
    plan = _plan("window", "breakable", batch=1)
    poison = np.full((1, 3, 16, 16), 2e6, dtype=np.float32)
    with _serving(tmp_path, plan, "--max-restarts", "1", "--restart-window", "6s") as srv:
        client = thttp.InferenceServerClient(srv.http, network_timeout=60)

        def infer(x: np.ndarray) -> np.ndarray:
            tensor = thttp.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            return client.infer("net", [tensor]).as_numpy("output")

        for restart in (1, 2):
            with pytest.raises(InferenceServerException) as info:
                infer(poison)
            assert "device lost" in info.value.message()
            if restart == 2:  # within the window of the first: out of restarts for now
                _until(lambda: not client.is_model_ready("net"), 10, "not ready")
                status, reason = _model_ready(srv)
                assert status == 503 and "restarted 1 times within 6s" in reason, reason
            _until(lambda: client.is_model_ready("net"), 90, f"ready after restart {restart}")
            np.testing.assert_allclose(infer(_x(1)), _reference(_x(1)), rtol=1e-5, atol=1e-5)
            assert _restarts(srv) == restart
        code, out = srv.stop()
        assert code == 0, out


def _model_ready(srv: Server) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{srv.http}/v2/models/net/ready", timeout=10) as r:
            return r.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}").get("error", "")
