"""`infermux serve` as a real process, driven by Triton's own clients (tritonclient HTTP/gRPC).

Outputs are compared with the same network run directly in this process; malformed requests
(a corpus of them) must get a 4xx with a JSON error; metrics must move as requests complete;
a full queue answers 503 with Retry-After; SIGTERM under load answers every admitted request
and exits 0.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
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

ROOT = Path(__file__).resolve().parents[1]

NET = '''
import os
import time

import torch
from torch import nn


class Net(nn.Module):
    input_shape = (3, 16, 16)

    def __init__(self, delay_s=0.0):
        super().__init__()
        self.delay_s = delay_s
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.body(x)


def build():
    torch.manual_seed(0)
    return Net()


def slow():
    torch.manual_seed(0)
    return Net(0.04)


class Held(Net):
    """40 ms a batch, and held while a file `hold` exists in the server's directory."""

    def forward(self, x):
        while os.path.exists("hold"):
            time.sleep(0.005)
        return super().forward(x)


def held():
    torch.manual_seed(0)
    return Held(0.04)


class Poisonable(Net):
    def forward(self, x):
        if bool((x > 1e6).any()):
            raise RuntimeError("poisoned input")
        return super().forward(x)


def poisonable():
    torch.manual_seed(0)
    return Poisonable()
'''


class Server:
    """An `infermux serve` process on free ports; its ready line parsed."""

    def __init__(self, tmp: Path, plan: dict[str, Any], *extra: str) -> None:
        plan_file = tmp / f"{plan['name']}.yaml"
        plan_file.write_text(json.dumps(plan))
        self.db = tmp / "serve.db"
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infermux", "serve", str(plan_file), "--http-port", "0",
             "--grpc-port", "0", "--metrics-port", "0", "--json", "--db", str(self.db),
             "--telemetry", "off", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"server did not start: {self.proc.stderr.read()}")  # type: ignore[union-attr]
        self.ready = json.loads(line)
        self.http = f"127.0.0.1:{self.ready['http_port']}"
        self.grpc = f"127.0.0.1:{self.ready['grpc_port']}"
        self.metrics = f"http://127.0.0.1:{self.ready['metrics_port']}/metrics"

    def stop(self, timeout_s: float = 60) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, out

    def scrape(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.metrics, timeout=10).read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                values[key] = float(value)
        return values


def _plan(name: str, factory: str, **dispatcher: Any) -> dict[str, Any]:
    return {"name": name, "models": [{"name": "net", "model": factory, "replicas": [
        {"unit": "cpu:0", "engine": "torch", "instances": 1, "batch": 4}]}],
        "dispatcher": {"max_queue_delay_ms": 1, **dispatcher}}


@pytest.fixture(scope="module")
def net_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serve_net") / "net.py"
    path.write_text(NET)
    return path


@pytest.fixture(scope="module")
def server(net_file: Path) -> Any:
    # CPU workers as processes (the default): inputs and outputs cross the child's pipe.
    srv = Server(net_file.parent, _plan("main", f"{net_file}:build"))
    yield srv
    code, out = srv.stop()
    assert code == 0, out
    stopped = json.loads(out[out.index("{"):])
    assert stopped["event"] == "stopped" and stopped["status"] == "complete"
    assert stopped["models"]["net"]["requests_failed"] == 0
    # The runtime process's collector pauses are in the summary.
    gc = stopped["gc"]
    assert gc["full_max_ms"] <= gc["full_total_ms"] <= gc["total_ms"] and gc["collections"] >= 0


@pytest.fixture(scope="module")
def reference(net_file: Path) -> Any:
    import torch

    from infermux.models import ModelSpec, load_model

    module = load_model(ModelSpec(f"{net_file}:build")).module

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(x)).numpy()

    return run


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 16, 16), dtype=np.float32)


# -- HTTP with tritonclient -----------------------------------------------------------------------


def test_http_metadata_config_and_health(server: Server) -> None:
    client = thttp.InferenceServerClient(server.http)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("net") and client.is_model_ready("net", "1")
    meta = client.get_server_metadata()
    assert {"binary_tensor_data", "statistics", "model_configuration"} <= set(meta["extensions"])
    model = client.get_model_metadata("net")
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 16, 16]}]
    assert model["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]
    config = client.get_model_config("net", "1")
    assert config["max_batch_size"] == 4
    assert config["input"][0]["dims"] == [3, 16, 16] and config["output"][0]["name"] == "output"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 1000
    index = client.get_model_repository_index()
    assert index == [{"name": "net", "version": "1", "state": "READY"}]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("n", [1, 3])
def test_http_infer_equals_the_network(server: Server, reference: Any, binary: bool, n: int) -> None:
    client = thttp.InferenceServerClient(server.http)
    x = _x(n, seed=n)
    tensor = thttp.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    out = thttp.InferRequestedOutput("output", binary_data=binary)
    result = client.infer("net", [tensor], outputs=[out], request_id="r-7")
    assert result.get_response()["id"] == "r-7"
    np.testing.assert_allclose(result.as_numpy("output"), reference(x), rtol=1e-5, atol=1e-5)


def test_http_concurrent_requests_each_get_their_own_rows(server: Server, reference: Any) -> None:
    # Requests batched together by the dispatcher must come back to the right caller, in order.
    results: dict[int, np.ndarray] = {}

    def one(k: int) -> None:
        client = thttp.InferenceServerClient(server.http)
        x = _x(1 + k % 3, seed=100 + k)
        tensor = thttp.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        results[k] = client.infer("net", [tensor]).as_numpy("output") - reference(x)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 12
    assert max(float(np.abs(d).max()) for d in results.values()) < 1e-4


def test_http_statistics_count_requests(server: Server) -> None:
    client = thttp.InferenceServerClient(server.http)
    before = client.get_inference_statistics("net")["model_stats"][0]
    x = _x(2)
    tensor = thttp.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    client.infer("net", [tensor])
    after = client.get_inference_statistics("net")["model_stats"][0]
    success = after["inference_stats"]["success"]["count"]
    assert success == before["inference_stats"]["success"]["count"] + 1
    assert after["inference_count"] == before["inference_count"] + 2
    assert after["batch_stats"] and after["inference_stats"]["compute_infer"]["ns"] > 0


# -- gRPC with tritonclient -----------------------------------------------------------------------


def test_grpc_metadata_config_and_infer(server: Server, reference: Any) -> None:
    client = tgrpc.InferenceServerClient(server.grpc)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("net")
    assert "statistics" in client.get_server_metadata(as_json=True)["extensions"]
    model = client.get_model_metadata("net", as_json=True)
    assert model["inputs"][0]["shape"] == ["-1", "3", "16", "16"]
    config = client.get_model_config("net", as_json=True)["config"]
    assert config["max_batch_size"] == 4 and config["dynamic_batching"]
    for n in (1, 4):
        x = _x(n, seed=10 + n)
        tensor = tgrpc.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("net", [tensor], outputs=[tgrpc.InferRequestedOutput("output")],
                              request_id="g-1")
        assert result.get_response().id == "g-1"
        np.testing.assert_allclose(result.as_numpy("output"), reference(x), rtol=1e-5, atol=1e-5)
    stats = client.get_inference_statistics("net", as_json=True)["model_stats"][0]
    assert int(stats["inference_count"]) >= 5


@pytest.mark.parametrize("case", [
    ("unknown model", "nope", "input", [1, 3, 16, 16], "FP32", "not served"),
    ("wrong input name", "net", "x", [1, 3, 16, 16], "FP32", "input name 'x'"),
    ("wrong datatype", "net", "input", [1, 3, 16, 16], "INT32", "datatype"),
    ("wrong shape", "net", "input", [1, 3, 8, 8], "FP32", "shape"),
    ("batch over max", "net", "input", [5, 3, 16, 16], "FP32", "max_batch_size"),
], ids=lambda c: c[0])
def test_grpc_rejects_bad_requests(server: Server, case: tuple[Any, ...]) -> None:
    _, model, name, shape, dtype, words = case
    client = tgrpc.InferenceServerClient(server.grpc)
    tensor = tgrpc.InferInput(name, shape, dtype)
    size = int(np.prod(shape))
    tensor.set_data_from_numpy(np.zeros(shape, np.int32 if dtype == "INT32" else np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, [tensor])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
    assert words in info.value.message()
    del size


def test_grpc_wrong_byte_count_is_invalid(server: Server) -> None:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="net")
        request.inputs.add(name="input", datatype="FP32", shape=[1, 3, 16, 16])
        request.raw_input_contents.append(b"\0" * 100)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "100 bytes" in (info.value.details() or "")


# -- malformed HTTP requests: a corpus, every one a 4xx with a JSON error -------------------------

_ITEM = 3 * 16 * 16 * 4
_OK_INPUT = {"name": "input", "datatype": "FP32", "shape": [1, 3, 16, 16]}


def _binary(header: Any, data: bytes, length: int | None = None) -> tuple[dict[str, str], bytes]:
    head = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return ({"Inference-Header-Content-Length": str(len(head) if length is None else length)},
            head + data)


def _jsonb(payload: Any) -> tuple[dict[str, str], bytes]:
    return {"Content-Type": "application/json"}, json.dumps(payload).encode()


def _bin_input(**changes: Any) -> dict[str, Any]:
    return {**_OK_INPUT, "parameters": {"binary_data_size": _ITEM}, **changes}


MALFORMED: list[tuple[str, str, str, tuple[dict[str, str], bytes], int, str]] = [
    ("unknown model", "POST", "/v2/models/nope/infer", _jsonb({"inputs": []}), 400, "not served"),
    ("unknown version", "POST", "/v2/models/net/versions/9/infer",
     _jsonb({"inputs": [_OK_INPUT]}), 400, "version"),
    ("metadata of unknown model", "GET", "/v2/models/nope", ({}, b""), 400, "not served"),
    ("config of unknown model", "GET", "/v2/models/nope/config", ({}, b""), 400, "not served"),
    ("not JSON", "POST", "/v2/models/net/infer", ({}, b"{not json"), 400, "not valid JSON"),
    ("JSON not an object", "POST", "/v2/models/net/infer", _jsonb([1, 2]), 400, "object"),
    ("empty body", "POST", "/v2/models/net/infer", ({}, b""), 400, "JSON"),
    ("no inputs", "POST", "/v2/models/net/infer", _jsonb({}), 400, "inputs"),
    ("inputs not a list", "POST", "/v2/models/net/infer", _jsonb({"inputs": {}}), 400, "inputs"),
    ("input not an object", "POST", "/v2/models/net/infer", _jsonb({"inputs": [3]}), 400,
     "inputs[0]"),
    ("wrong input name", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "name": "x", "data": [0.0] * 768}]}), 400, "input name"),
    ("unknown datatype", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "datatype": "FLOAT", "data": [0.0] * 768}]}), 400,
     "datatype"),
    ("wrong datatype", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "datatype": "INT64", "data": [0] * 768}]}), 400,
     "datatype"),
    ("shape not a list", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "shape": "1x3x16x16", "data": [0.0] * 768}]}), 400, "shape"),
    ("shape of floats", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "shape": [1.0, 3, 16, 16], "data": [0.0] * 768}]}), 400,
     "shape"),
    ("wrong item shape", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "shape": [1, 3, 8, 8], "data": [0.0] * 192}]}), 400,
     "shape"),
    ("batch over max", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "shape": [5, 3, 16, 16], "data": [0.0] * 3840}]}), 400,
     "max_batch_size"),
    ("batch zero", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "shape": [0, 3, 16, 16], "data": []}]}), 400, "batch 0"),
    ("too few values", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "data": [0.0] * 10}]}), 400, "10 values"),
    ("ragged data", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "data": [[0.0], [0.0, 1.0]]}]}), 400, "regular"),
    ("strings as data", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "data": ["a"] * 768}]}), 400, "numbers"),
    ("data not a list", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "data": 1.0}]}), 400, "list"),
    ("neither data nor binary", "POST", "/v2/models/net/infer", _jsonb({"inputs": [_OK_INPUT]}),
     400, "neither"),
    ("input twice", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "data": [0.0] * 768}] * 2}), 400, "twice"),
    ("binary: too few bytes", "POST", "/v2/models/net/infer",
     _binary({"inputs": [_bin_input()]}, b"\0" * 100), 400, "100 follow"),
    ("binary: extra bytes", "POST", "/v2/models/net/infer",
     _binary({"inputs": [_bin_input()]}, b"\0" * (_ITEM + 4)), 400, "declare"),
    ("binary: size does not fit the shape", "POST", "/v2/models/net/infer",
     _binary({"inputs": [_bin_input(parameters={"binary_data_size": 16})]}, b"\0" * 16), 400,
     "needs"),
    ("binary: size not a number", "POST", "/v2/models/net/infer",
     _binary({"inputs": [_bin_input(parameters={"binary_data_size": "3072"})]}, b"\0" * _ITEM),
     400, "byte count"),
    ("binary: negative size", "POST", "/v2/models/net/infer",
     _binary({"inputs": [_bin_input(parameters={"binary_data_size": -1})]}, b""), 400,
     "byte count"),
    ("binary: both data and size", "POST", "/v2/models/net/infer",
     _binary({"inputs": [_bin_input(data=[0.0] * 768)]}, b"\0" * _ITEM), 400, "both"),
    ("header length not a number", "POST", "/v2/models/net/infer",
     ({"Inference-Header-Content-Length": "ten"}, b"{}"), 400, "not an integer"),
    ("header length past the body", "POST", "/v2/models/net/infer",
     _binary({"inputs": [_bin_input()]}, b"", length=10_000), 400, "outside"),
    ("header length zero", "POST", "/v2/models/net/infer",
     _binary({"inputs": [_bin_input()]}, b"\0" * _ITEM, length=0), 400, "outside"),
    ("header length cuts the JSON", "POST", "/v2/models/net/infer",
     _binary({"inputs": [_bin_input()]}, b"\0" * _ITEM, length=5), 400, "JSON"),
    ("unknown output", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "data": [0.0] * 768}], "outputs": [{"name": "y"}]}), 400,
     "output name"),
    ("outputs not a list", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "data": [0.0] * 768}], "outputs": "output"}), 400,
     "outputs"),
    ("classification asked", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "data": [0.0] * 768}],
             "outputs": [{"name": "output", "parameters": {"classification": 3}}]}), 400,
     "classification"),
    ("binary_data_output not a bool", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "data": [0.0] * 768}],
             "parameters": {"binary_data_output": "yes"}}), 400, "true or false"),
    ("parameters not an object", "POST", "/v2/models/net/infer",
     _jsonb({"inputs": [{**_OK_INPUT, "data": [0.0] * 768}], "parameters": [1]}), 400,
     "parameters"),
    ("id not a string", "POST", "/v2/models/net/infer",
     _jsonb({"id": 5, "inputs": [{**_OK_INPUT, "data": [0.0] * 768}]}), 400, "id"),
    ("unsupported content encoding", "POST", "/v2/models/net/infer",
     ({"Content-Encoding": "br"}, b"xx"), 400, "Content-Encoding"),
    ("corrupt gzip", "POST", "/v2/models/net/infer",
     ({"Content-Encoding": "gzip"}, b"not gzip"), 400, "gzip"),
    ("GET on infer", "GET", "/v2/models/net/infer", ({}, b""), 405, "POST"),
    ("POST on metadata", "POST", "/v2/models/net", ({}, b"{}"), 405, "GET"),
    ("unknown route", "GET", "/v2/models/net/nothing", ({}, b""), 404, "no route"),
    ("outside /v2", "GET", "/v1/models", ({}, b""), 404, "/v2"),
    ("body too large", "POST", "/v2/models/net/infer", ({}, b"0" * (3 << 20)), 413, "larger"),
    # A small compressed body that inflates far past what any request of the model needs.
    ("gzip bomb", "POST", "/v2/models/net/infer",
     ({"Content-Encoding": "gzip"}, gzip.compress(b" " * (16 << 20), 9)), 413, "inflates"),
    ("deflate bomb", "POST", "/v2/models/net/infer",
     ({"Content-Encoding": "deflate"}, zlib.compress(b" " * (16 << 20), 9)), 413, "inflates"),
    # Binary tensors are counted at their exact size, not at a JSON number's 25 characters.
    ("binary: body past the largest binary request", "POST", "/v2/models/net/infer",
     _binary({"inputs": [_bin_input()]}, b"\0" * 400_000), 413, "larger"),
    ("binary: JSON header past its allowance", "POST", "/v2/models/net/infer",
     _binary({"inputs": [_bin_input()], "pad": "x" * 200_000}, b"\0" * _ITEM), 413, "header"),
    ("deeply nested JSON", "POST", "/v2/models/net/infer",
     ({}, b"[" * 20_000 + b"]" * 20_000), 400, "nested"),
    ("deeply nested data", "POST", "/v2/models/net/infer",
     ({}, b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 16, 16], "data": '
      + b"[" * 5_000 + b"]" * 5_000 + b"}]}"), 400, "nested"),
    ("NUL bytes as JSON", "POST", "/v2/models/net/infer", ({}, b"\0" * 64), 400, "JSON"),
    ("invalid UTF-8 header", "POST", "/v2/models/net/infer", ({}, b'{"id": "\xff\xfe"}'), 400,
     "JSON"),
]


def _raw(server: Server, method: str, path: str, headers: dict[str, str], body: bytes,
         ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(server.http, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_the_malformed_corpus_is_large_enough() -> None:
    assert len(MALFORMED) >= 30


@pytest.mark.parametrize("case", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_http_malformed_request_gets_4xx_with_error(server: Server, case: Any) -> None:
    _, method, path, (headers, body), status, words = case
    got, _, payload = _raw(server, method, path, headers, body)
    assert got == status, payload
    error = json.loads(payload)["error"]
    assert words in error, error


def test_http_gzip_body_and_json_outputs(server: Server, reference: Any) -> None:
    x = _x(1, seed=3)
    body = json.dumps({"inputs": [{**_OK_INPUT, "data": x.ravel().tolist()}]}).encode()
    status, headers, payload = _raw(server, "POST", "/v2/models/net/versions/1/infer",
                                    {"Content-Encoding": "gzip"}, gzip.compress(body))
    assert status == 200 and headers["content-type"] == "application/json"
    out = json.loads(payload)["outputs"][0]
    assert out["shape"] == [1, 10]
    np.testing.assert_allclose(np.array(out["data"]).reshape(1, 10), reference(x), atol=1e-5)


def test_server_is_healthy_after_the_corpus(server: Server) -> None:
    assert _raw(server, "GET", "/v2/health/ready", {}, b"")[0] == 200


# -- metrics --------------------------------------------------------------------------------------


def test_metrics_move_as_requests_complete(server: Server) -> None:
    key = '{model="net",version="1"}'
    before = server.scrape()
    client = thttp.InferenceServerClient(server.http)
    x = _x(3)
    tensor = thttp.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    client.infer("net", [tensor])
    after = server.scrape()
    assert after[f"nv_inference_request_success_total{key}"] == \
        before.get(f"nv_inference_request_success_total{key}", 0) + 1
    assert after[f"nv_inference_count_total{key}"] == before[f"nv_inference_count_total{key}"] + 3
    for name in ("nv_inference_request_duration_us_total", "nv_inference_queue_duration_us_total",
                 "nv_inference_compute_infer_duration_us_total"):
        assert after[name + key] > before.get(name + key, 0)
    assert after['infermux_batch_size_count{model="net"}'] > before['infermux_batch_size_count{model="net"}']
    worker = [k for k in after if k.startswith("infermux_worker_items_total")]
    assert worker and after[worker[0]] >= 3
    assert any(k.startswith("infermux_worker_alive") and v == 1 for k, v in after.items())
    assert "nv_cpu_utilization" in after


# -- admission and shutdown under load ------------------------------------------------------------


def test_full_queue_answers_503_and_sigterm_answers_every_admitted_request(net_file: Path) -> None:
    hold = net_file.parent / "hold"
    srv = Server(net_file.parent, _plan("held", f"{net_file}:held", cpu_workers="thread"),
                 "--max-queue", "6")
    try:
        # 1. Overload: 16 requests at once on a 40 ms/batch model admitting 6 items, its first
        # batch held until the server has answered some with 503 (a loaded host cannot drain
        # the queue between two requests' arrivals and so admit them all).
        codes: list[int] = []
        retry: list[str | None] = []

        def post(k: int, out: list[int]) -> None:
            x = _x(1, seed=k)
            header = json.dumps({"inputs": [_bin_input()]}).encode()
            status, headers, _ = _raw(srv, "POST", "/v2/models/net/infer",
                                      {"Inference-Header-Content-Length": str(len(header))},
                                      header + x.tobytes())
            out.append(status)
            if status == 503:
                retry.append(headers.get("retry-after"))

        hold.touch()
        threads = [threading.Thread(target=post, args=(k, codes)) for k in range(16)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while 503 not in codes and time.monotonic() < deadline:
            time.sleep(0.005)
        hold.unlink()
        for t in threads:
            t.join(60)
        assert sorted(set(codes)) == [200, 503], codes
        assert all(r == "1" for r in retry)
        rejected = srv.scrape()['infermux_requests_rejected_total{model="net"}']
        assert rejected == codes.count(503)
        assert _raw(srv, "GET", "/v2/health/ready", {}, b"")[0] == 200

        # 2. SIGTERM with 6 items admitted and in flight (held, so none can finish before the
        # signal however slowly the requests arrive): all six are answered, exit code 0.
        answered: list[int] = []
        hold.touch()
        threads = [threading.Thread(target=post, args=(100 + k, answered)) for k in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while srv.scrape().get('infermux_items_in_flight{model="net"}', 0) < 6:
            assert time.monotonic() < deadline, "requests were not admitted"
            time.sleep(0.005)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        hold.unlink()
        out, _ = srv.proc.communicate(timeout=60)
        code = srv.proc.returncode
        for t in threads:
            t.join(30)
        assert code == 0, out
        assert answered == [200] * 6
        summary = json.loads(out[out.index("{"):])
        assert summary["status"] == "complete"
        assert summary["models"]["net"]["requests_rejected"] == codes.count(503)
        # After the shutdown nothing listens any more.
        with pytest.raises(OSError):
            _raw(srv, "GET", "/v2/health/live", {}, b"")
        # The run is in the store.
        from infermux.store import open_store

        with open_store(srv.db) as store:
            run = store.run(summary["run_id"])
        assert run["kind"] == "serve" and run["status"] == "complete"
    finally:
        hold.unlink(missing_ok=True)
        with contextlib.suppress(ProcessLookupError):
            srv.proc.kill()
        srv.proc.wait(10)


def test_bad_serve_arguments_are_one_line(tmp_path: Path, net_file: Path) -> None:
    plan = tmp_path / "p.yaml"
    plan.write_text(json.dumps(_plan("p", f"{net_file}:build")))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for args, words in ((["--http-port", "70000"], "--http-port 70000"),
                        (["--max-queue", "0"], "--max-queue 0"),
                        (["--max-restarts", "-1"], "--max-restarts -1"),
                        (["--drain-timeout", "soon"], "--drain-timeout"),
                        (["--loop", "tokio"], "--loop 'tokio'"),
                        (["--connection-age", "-5s"], "--connection-age")):
        done = subprocess.run([sys.executable, "-m", "infermux", "serve", str(plan), *args],
                              capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 2, done.stderr
        assert words in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    done = subprocess.run([sys.executable, "-m", "infermux", "serve", str(tmp_path / "none.yaml")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "does not exist" in done.stderr


def test_a_failed_worker_marks_its_model_not_ready_while_others_serve(net_file: Path) -> None:
    # `breakable` fails every batch once a marked input has run (a device whose context was
    # lost): the worker's fault, not the input's.
    plan = {"name": "two", "models": [
        {"name": "net", "model": f"{net_file}:build",
         "replicas": [{"unit": "cpu:0", "instances": 1, "batch": 4}]},
        {"name": "fragile", "model": f"{ROOT / 'tests' / 'engine_models' / 'faulty.py'}:breakable",
         "replicas": [{"unit": "cpu:1", "instances": 1, "batch": 4}]}],
        "dispatcher": {"max_queue_delay_ms": 1, "cpu_workers": "thread"}}
    # No restarts here (tests/test_serve_faults.py has them): the model stays not ready.
    srv = Server(net_file.parent, plan, "--max-restarts", "0")
    try:
        client = thttp.InferenceServerClient(srv.http)

        def infer(model: str, x: np.ndarray) -> Any:
            tensor = thttp.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            return client.infer(model, [tensor])

        assert infer("fragile", _x(1)).as_numpy("output").shape == (1, 10)
        poison = np.full((1, 3, 16, 16), 1e7, dtype=np.float32)
        with pytest.raises(InferenceServerException) as info:
            infer("fragile", poison)
        assert "failed" in info.value.message() and "device lost" in info.value.message()
        assert not client.is_model_ready("fragile") and not client.is_server_ready()
        with pytest.raises(InferenceServerException) as info:
            infer("fragile", _x(1))
        assert "not ready" in info.value.message()
        assert client.is_model_ready("net")
        assert infer("net", _x(2)).as_numpy("output").shape == (2, 10)
        metrics = srv.scrape()
        alive = {k: v for k, v in metrics.items() if k.startswith("infermux_worker_alive")}
        assert sorted(alive.values()) == [0.0, 1.0]
        failed = 'nv_inference_request_failure_total{model="fragile",reason="BACKEND",version="1"}'
        assert metrics[failed] == 1
        code, out = srv.stop()
        assert code == 0, out
    finally:
        with contextlib.suppress(ProcessLookupError):
            srv.proc.kill()
        srv.proc.wait(10)


def test_a_pipelined_model_is_served_with_its_own_outputs(net_file: Path, reference: Any) -> None:
    # A model entry with `stages:` runs through the pipeline executor: request rows are fed
    # into its input slots and each chunk's outputs come back to the right request.
    plan = {"name": "piped", "models": [{"name": "net", "model": f"{net_file}:build", "stages": [
        {"start": "input", "end": "body_1", "units": ["cpu:0"], "batch": 2},
        {"start": "body_1", "end": "output", "units": ["cpu:1"], "batch": 2}]}],
        "dispatcher": {"max_queue_delay_ms": 1}}
    srv = Server(net_file.parent, plan)
    try:
        client = tgrpc.InferenceServerClient(srv.grpc)
        for n, seed in ((1, 5), (2, 6), (2, 7)):
            x = _x(n, seed=seed)
            tensor = tgrpc.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            got = client.infer("net", [tensor]).as_numpy("output")
            np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-5)
        stages = [k for k in srv.scrape() if k.startswith("infermux_pipeline_stage_busy")]
        assert len(stages) == 2
        code, out = srv.stop()
        assert code == 0, out
    finally:
        with contextlib.suppress(ProcessLookupError):
            srv.proc.kill()
        srv.proc.wait(10)


# -- large and FP16 requests (the body collected whole, rows copied straight in) -------------------


def _infer_raw(server: Server, x: np.ndarray, datatype: str, *, chunked: bool = False,
               ) -> np.ndarray:
    header = json.dumps({"inputs": [{"name": "input", "datatype": datatype, "shape": list(x.shape),
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()
    headers = {"Inference-Header-Content-Length": str(len(header))}
    conn = http.client.HTTPConnection(server.http, timeout=30)
    try:
        if chunked:  # no Content-Length: the body arrives in pieces, uvicorn's own way
            parts = [header, x.tobytes()[:1000], x.tobytes()[1000:]]
            conn.request("POST", "/v2/models/net/infer", body=iter(parts), headers=headers,
                         encode_chunked=True)
        else:
            conn.request("POST", "/v2/models/net/infer", body=header + x.tobytes(),
                         headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
        assert resp.status == 200, payload[:300]
    finally:
        conn.close()
    size = int(resp.getheader("Inference-Header-Content-Length"))
    out = json.loads(payload[:size])["outputs"][0]
    return np.frombuffer(payload[size:], dtype="<f4").reshape(out["shape"])


def test_fp16_and_fp32_requests_agree_on_process_workers(server: Server, reference: Any) -> None:
    x = _x(3, seed=11).astype(np.float16)
    ref = reference(x.astype(np.float32))
    np.testing.assert_allclose(_infer_raw(server, x, "FP16"), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_infer_raw(server, x.astype(np.float32), "FP32"), ref,
                               rtol=1e-5, atol=1e-5)


def test_thread_workers_copy_rows_of_either_dtype_and_bodies_of_any_framing(
        net_file: Path, reference: Any) -> None:
    # Thread workers: each request's rows are copied straight into the runner's input buffer.
    srv = Server(net_file.parent, _plan("rows", f"{net_file}:build", cpu_workers="thread"))
    try:
        xs = {k: _x(1 + k % 4, seed=20 + k) for k in range(12)}
        results: dict[int, np.ndarray] = {}

        def call(k: int) -> None:  # FP16 and FP32 requests batched together
            x = xs[k].astype(np.float16) if k % 2 else xs[k]
            results[k] = _infer_raw(srv, x, "FP16" if k % 2 else "FP32", chunked=k % 3 == 0)

        threads = [threading.Thread(target=call, args=(k,)) for k in xs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == sorted(xs)
        for k, x in xs.items():
            sent = x.astype(np.float16).astype(np.float32) if k % 2 else x
            np.testing.assert_allclose(results[k], reference(sent), rtol=1e-5, atol=1e-5)
    finally:
        code, out = srv.stop()
    assert code == 0, out


def test_models_on_fp16_units_declare_fp16_inputs() -> None:
    from infermux.runtime.plan import ModelEntry
    from infermux.serve.core import _input_datatype

    def entry(*units: str) -> ModelEntry:
        return ModelEntry.model_validate({"name": "m", "model": "resnet50", "replicas": [
            {"unit": u, "engine": "torch"} for u in units]})

    assert _input_datatype(entry("cuda:0/fp16", "cuda:1/fp16")) == "FP16"
    assert _input_datatype(entry("cuda:0/fp16", "cpu:0")) == "FP32"
    assert _input_datatype(entry("cpu:0")) == "FP32"
    assert _input_datatype(entry("cuda:0/bf16")) == "FP32"


def test_infer_request_parser_leaves_raw_contents_in_place() -> None:
    from tritonclient.grpc import service_pb2

    from infermux.serve.grpc_front import (
        ZERO_COPY_MIN_BYTES,
        InferRequest,
        Undecodable,
        parse_infer_request,
    )

    request = service_pb2.ModelInferRequest(model_name="net", model_version="1", id="r")
    request.parameters["priority"].int64_param = 3
    request.inputs.add(name="input", datatype="FP16", shape=[2, 3])
    request.outputs.add(name="output")
    x = np.arange(6, dtype=np.float16)
    request.raw_input_contents.extend([x.tobytes(), b""])
    # A small message is protobuf's to parse whole (the walk would cost more than the copy).
    small = parse_infer_request(request.SerializeToString())
    assert isinstance(small, service_pb2.ModelInferRequest) and small == request
    small_bad = parse_infer_request(request.SerializeToString()[:-3])
    assert isinstance(small_bad, Undecodable) and "Error parsing" in small_bad.error
    big = np.arange(ZERO_COPY_MIN_BYTES, dtype=np.float16)  # a large tensor stays in place
    request.inputs[0].shape[:] = [1, big.size]
    request.raw_input_contents[0] = big.tobytes()
    wire = request.SerializeToString()
    parsed = parse_infer_request(wire)
    assert isinstance(parsed, InferRequest)
    assert all(v.obj is wire for v in parsed.raw)  # views of the message, not copies
    assert [bytes(v) for v in parsed.raw] == list(request.raw_input_contents)
    parsed.message.raw_input_contents.extend(bytes(v) for v in parsed.raw)
    assert parsed.message == request
    # Bytes protobuf cannot parse come back as its own error, for an INVALID_ARGUMENT answer.
    bad = parse_infer_request(wire[:-3])
    assert isinstance(bad, Undecodable) and "Error parsing" in bad.error, bad
