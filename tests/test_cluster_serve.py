"""`infermux serve --cluster`: the v2 server in front of real Ray nodes on localhost.

The CLI serves a local plan on every node of `local:2` and must answer Triton's clients with
what the network computes: an input the network raises on (the node's worker then runs its own
samples: the input's fault) gets 400 / INVALID_ARGUMENT from the first node, tried on no other
and restarting nothing; a node whose device is lost (every batch raises there) has its pieces
answered by the other node. In process, the worker node of a two-node cluster is stopped (its
raylet and processes killed) while clients send requests, and every request must be answered:
with the right outputs (retried on the other node), or with an error once no node is left
(the head node's runtime actor is killed then: the head itself keeps the cluster up). With a
Triton build present, the same cluster serves behind Triton's front (`--front triton`).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
pytest.importorskip("ray", reason="the cluster needs Ray: pip install 'infermux[cluster]'")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from tests.conftest import invoke_cli
from tests.test_serve import NET, Server

CORES = sorted(os.sched_getaffinity(0))

#: `marked`: `poisonable`, whose device is lost in a process while a file marks it broken.
MARKED = '''

import os

MARKS = "@MARKS@"


class Marked(Poisonable):
    def forward(self, x):
        if os.path.exists(os.path.join(MARKS, "broken-" + str(os.getpid()))):
            raise RuntimeError("device lost")
        return super().forward(x)


def marked():
    torch.manual_seed(0)
    return Marked()
'''


@pytest.fixture(scope="module")
def net_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cluster_serve_net") / "net.py"
    path.write_text(NET + MARKED.replace("@MARKS@", str(path.parent)))
    return path


def _reference(net_file: Path, factory: str = "build") -> Any:
    import torch

    from infermux.models import ModelSpec, load_model

    module = load_model(ModelSpec(f"{net_file}:{factory}")).module

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(x)).numpy()

    return run


def _x(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 16, 16), dtype=np.float32)


def _infer(client: thttp.InferenceServerClient, x: np.ndarray) -> np.ndarray:
    inp = thttp.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return client.infer("net", [inp]).as_numpy("output")


def _four_clients(srv: Any, reference: Any, seed: int, grpc_too: bool = False) -> list[int]:
    """Four clients at once, six requests of 1-4 items each, every output checked against the
    network's (odd clients over gRPC with `grpc_too`, else all over HTTP); the items sent."""
    sent: list[int] = []
    bad: list[str] = []

    def one(k: int) -> None:
        for j in range(6):
            x = _x(1 + (k + j) % 4, seed=seed + 10 * k + j)
            if grpc_too and k % 2:
                inp = tgrpc.InferInput("input", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                got = tgrpc.InferenceServerClient(srv.grpc).infer("net", [inp]).as_numpy("output")
            else:
                got = _infer(thttp.InferenceServerClient(srv.http), x)
            sent.append(len(x))
            if got.shape != (len(x), 10) or not np.allclose(got, reference(x), atol=1e-5):
                bad.append(f"client {k} request {j}")

    threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not bad and len(sent) == 24, bad
    return sent


def test_a_bad_cluster_address_is_one_line(net_file: Path) -> None:
    plan = net_file.parent / "bad-address.yaml"
    plan.write_text(json.dumps({"name": "x", "models": [{"name": "net", "model": f"{net_file}:build",
                                                        "replicas": [{"unit": "cpu"}]}]}))
    proc = invoke_cli("serve", str(plan), "--cluster", "somewhere", "--http-port", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "'somewhere'" in proc.stderr and "local:N" in proc.stderr


def test_serve_cluster_answers_as_the_network_does(net_file: Path) -> None:
    plan = {"name": "tiny", "models": [{"name": "net", "model": f"{net_file}:marked",
                                        "replicas": [{"unit": f"cpu:{CORES[0]}", "batch": 4}]}],
            "dispatcher": {"cpu_workers": "thread", "max_queue_delay_ms": 1}}
    srv = Server(net_file.parent, plan, "--cluster", "local:2")
    reference = _reference(net_file, "marked")
    try:
        assert [n["node"] for n in srv.ready["nodes"]] == ["node-0", "node-1"]
        assert len(srv.ready["models"][0]["workers"]) == 2
        client = thttp.InferenceServerClient(srv.http, concurrency=4)
        assert client.is_server_ready() and client.is_model_ready("net")
        sent = _four_clients(srv, reference, seed=0)
        grpc = tgrpc.InferenceServerClient(srv.grpc)
        x = _x(3, seed=99)
        inp = tgrpc.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        assert np.allclose(grpc.infer("net", [inp]).as_numpy("output"), reference(x), atol=1e-5)
        stats = client.get_inference_statistics("net")["model_stats"][0]
        assert stats["inference_count"] >= sum(sent) + 3
        # The nodes' batches reach the statistics and /metrics, by node worker.
        metrics = srv.scrape()
        assert metrics['nv_inference_count_total{model="net",version="1"}'] >= sum(sent) + 3
        assert sum(v for k, v in metrics.items()
                   if k.startswith('infermux_worker_alive{') and 'worker="node-' in k) == 2
        # An input the network raises on is the input's fault (the node's worker then runs
        # its own samples): 400 / INVALID_ARGUMENT with the network's error from the first
        # node, tried on no other node, and the model stays ready (nothing restarts).
        poison = np.full((1, 3, 16, 16), 1e7, dtype=np.float32)
        with pytest.raises(InferenceServerException) as info:
            _infer(client, poison)
        assert info.value.status() == "400", info.value
        assert "rejected the request's input" in info.value.message()
        assert "poisoned input" in info.value.message()
        tensor = tgrpc.InferInput("input", list(poison.shape), "FP32")
        tensor.set_data_from_numpy(poison)
        with pytest.raises(InferenceServerException) as info:
            grpc.infer("net", [tensor])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
        assert "poisoned input" in info.value.message()
        assert client.is_model_ready("net")
        x = _x(2, seed=5)
        assert np.allclose(_infer(client, x), reference(x), atol=1e-5)
        # A device lost on node-0 (every batch raises there, its own samples too): the
        # worker's fault, so what it failed is answered by node-1. Four clients at once keep
        # both nodes routed to.
        pid = srv.ready["nodes"][0]["pid"]
        mark = net_file.parent / f"broken-{pid}"
        mark.touch()
        wrong: list[str] = []

        def lost(k: int) -> None:
            c = thttp.InferenceServerClient(srv.http, network_timeout=120)
            for j in range(4):
                x = _x(4, seed=200 + 10 * k + j)
                try:
                    if not np.allclose(_infer(c, x), reference(x), atol=1e-5):
                        wrong.append(f"client {k} request {j}: wrong outputs")
                except InferenceServerException as exc:
                    wrong.append(f"client {k} request {j}: {exc}")

        # The router sends each batch to the node it expects to finish first, so one round
        # may go to node-1 alone: rounds go on until node-0 has failed some (node-1 then
        # ran them again, which the retried counter shows).
        retried = srv.scrape().get("infermux_items_retried_total", 0.0)
        rounds = 0
        try:
            while rounds < 12:  # under a full test run's load, six were once not enough
                rounds += 1
                threads = [threading.Thread(target=lost, args=(k,)) for k in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(150)
                if srv.scrape().get("infermux_items_retried_total", 0.0) > retried:
                    break
        finally:
            mark.unlink()
        assert not wrong, wrong
    finally:
        code, out = srv.stop()
    assert code == 0, out
    stopped = json.loads(out[out.index("{\n"):])
    assert stopped["status"] == "complete" and stopped["models"]["net"]["requests_failed"] == 2
    nodes = stopped["nodes"]
    assert all(n["status"] == "ok" for n in nodes)
    # The poisoned inputs were each run once, on one node, and failed there alone.
    assert sum(n["rejected_items"] for n in nodes) == 2
    # Every other item was answered by one node (the server's probe of the outputs included);
    # node-0's lost device failed some, and node-1 answered them.
    by_name = {n["node"]: n for n in nodes}
    assert by_name["node-0"]["failed_items"] > 0, nodes
    assert by_name["node-1"]["failed_items"] == 0, nodes
    assert by_name["node-0"]["rerouted_items"] == 0, nodes  # failed by its device, not lost
    assert sum(n["completed_items"] for n in nodes) == sum(sent) + 3 + 2 + 1 + 16 * 4 * rounds, nodes


def test_serve_cluster_behind_triton_s_front_answers_as_the_network_does(net_file: Path) -> None:
    """`serve --cluster local:2 --front triton`: Triton's server parses the requests, the
    cluster's nodes run the batches; outputs over HTTP and gRPC equal the network's and both
    nodes' counts add up to what was sent."""
    from infermux.errors import UsageError
    from infermux.serve.triton_front import find_triton

    try:
        find_triton()
    except UsageError as exc:
        pytest.skip(f"no Triton build: {exc}")
    plan = {"name": "tiny-triton", "models": [{"name": "net", "model": f"{net_file}:build",
                                               "replicas": [{"unit": f"cpu:{CORES[0]}",
                                                             "batch": 4}]}],
            "dispatcher": {"cpu_workers": "thread", "max_queue_delay_ms": 1}}
    srv = Server(net_file.parent, plan, "--cluster", "local:2", "--front", "triton",
                 "--fronts", "1")
    reference = _reference(net_file)
    sent: list[int] = []
    try:
        assert srv.ready["front"] == "triton"
        assert [n["node"] for n in srv.ready["nodes"]] == ["node-0", "node-1"]
        sent = _four_clients(srv, reference, seed=300, grpc_too=True)
    finally:
        code, out = srv.stop()
    assert code == 0, out
    stopped = json.loads(out[out.index("{\n"):])
    assert stopped["status"] == "complete" and stopped["models"]["net"]["requests_failed"] == 0
    nodes = stopped["nodes"]
    assert all(n["status"] == "ok" for n in nodes)
    # Every item sent was run by one node, and the one item of the server's output probe.
    assert sum(n["completed_items"] for n in nodes) == sum(sent) + 1, nodes


@pytest.mark.exclusive
def test_a_node_lost_mid_serve_leaves_no_request_unanswered(net_file: Path) -> None:
    from infermux.cluster import open_cluster, parse_cluster_plan
    from infermux.cluster.serve import start_cluster_runtime
    from infermux.serve import InferenceServer, ServeSettings

    def node(name: str, local: int, core: int) -> dict[str, Any]:
        # The slow network (40 ms a batch) keeps requests in flight on both nodes.
        return {"name": name, "node": {"resource": f"infermux-local-{local}"},
                "plan": {"models": [{"name": "net", "model": f"{net_file}:slow",
                                     "replicas": [{"unit": f"cpu:{core}", "batch": 4}]}],
                         "dispatcher": {"cpu_workers": "thread", "max_queue_delay_ms": 1}}}

    plan = parse_cluster_plan({"name": "two", "nodes": [node("a", 0, CORES[0]),
                                                        node("b", 1, CORES[-1])],
                               "route": {"max_retries": 2},
                               "load": {"sample_pool": 4}})
    reference = _reference(net_file, "slow")
    handle = open_cluster("local:2")
    server = InferenceServer(None, ServeSettings(http_port=0, grpc_port=0, metrics_port=0,
                                                 telemetry_interval_s=0, max_restarts=0),
                             backend=lambda progress: start_cluster_runtime(plan, handle))
    ready = threading.Event()
    summary: dict[str, Any] = {}

    def serve() -> None:
        summary.update(asyncio.run(server.serve(lambda info: ready.set())).to_dict())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert ready.wait(120), "the server did not start"
        url = f"127.0.0.1:{server.ports['http']}"
        runtime = server.core.runtime
        stop = threading.Event()
        answers: list[tuple[float, str]] = []  # (answered at, "ok" | "wrong" | error)

        def client(k: int) -> None:
            c = thttp.InferenceServerClient(url, network_timeout=30.0)
            j = 0
            while not stop.is_set():
                x = _x(2, seed=100 * k + j)
                j += 1
                try:
                    got = _infer(c, x)
                    ok = np.allclose(got, reference(x), atol=1e-5)
                    answers.append((time.perf_counter(), "ok" if ok else "wrong"))
                except InferenceServerException as exc:
                    answers.append((time.perf_counter(), str(exc)))

        clients = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in clients:
            t.start()
        time.sleep(1.0)
        b = next(ln for ln in runtime.links if ln.name == "b")
        a = next(ln for ln in runtime.links if ln.name == "a")
        assert b.completed > 0 and a.completed > 0  # both served before the loss
        killed_at = time.perf_counter()
        handle.kill_node(b.node_id)
        time.sleep(2.0)
        stop.set()
        for t in clients:
            t.join(40)
        assert not any(t.is_alive() for t in clients), "a request hung"
        # Every request was answered with the network's outputs: what node b held was run
        # again on node a (the retries leave nothing for an error here).
        assert answers and all(r == "ok" for _, r in answers), [r for _, r in answers if r != "ok"]
        assert sum(1 for t, _ in answers if t > killed_at + 1.0) > 0  # served after the loss
        assert not b.alive and a.alive and b.lost_reason
        lost = [e for e in runtime.sut.events if e["event"] == "node_lost"]
        assert len(lost) == 1 and lost[0]["node"] == "b"
        # What it held (six clients keep both nodes busy) went to node a.
        assert lost[0]["rerouted_items"] == lost[0]["held_items"] > 0
        client_http = thttp.InferenceServerClient(url)
        assert client_http.is_model_ready("net")
        # With no node left the model is not ready, and a request is an error at once.
        handle.ray.kill(a.actor)
        deadline = time.monotonic() + 30
        while a.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not a.alive
        assert not client_http.is_model_ready("net")
        started = time.perf_counter()
        with pytest.raises(InferenceServerException, match="not ready"):
            _infer(client_http, _x(1, seed=7))
        assert time.perf_counter() - started < 5
    finally:
        server.stop()
        thread.join(60)
        handle.close()
    assert summary.get("nodes") and {n["node"]: n["status"] for n in summary["nodes"]} == {
        "a": "lost", "b": "lost"}
