"""`infermux serve --front triton`: Triton's C++ server as the front, infermux's runtime behind.

With a Triton build present (the `nvidia-pytriton` wheel, installed without its pins, or
$INFERMUX_TRITON_HOME), a real server is driven by Triton's own clients: outputs equal the
network's over HTTP and gRPC, with the tensors in the requests and in system shared memory,
with the instances on this environment's numpy 2 and on a numpy 1; a killed Triton server is
restarted and answers again; SIGTERM answers every request Triton admitted before the runtime
stops. Without one, those
tests skip and say why; the configuration written for Triton and the bad-input lines are
checked either way.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from infermux.errors import UsageError
from infermux.serve.core import TensorSpec
from infermux.serve.triton_front import TritonHub, find_triton, model_config

ROOT = Path(__file__).resolve().parents[1]


def _triton_missing() -> str | None:
    try:
        find_triton()
    except UsageError as exc:
        return str(exc)
    return None


_MISSING = _triton_missing()
needs_triton = pytest.mark.skipif(_MISSING is not None, reason=f"no Triton build: {_MISSING}")


def test_the_model_configuration_names_every_tensor_its_batch_and_its_queue() -> None:
    info = SimpleNamespace(
        name="bert", max_batch_size=16, max_queue_items=96,
        inputs=[TensorSpec("input_ids", "INT64", (-1,)), TensorSpec("attention_mask", "INT64",
                                                                    (-1,))],
        outputs=[TensorSpec("logits", "FP32", (2,)), TensorSpec("hidden", "FP16", (-1, 8))])
    text = model_config(info, 3, "/tmp/x/link", answer_timeout_s=45)
    assert 'name: "bert"' in text and 'backend: "python"' in text
    assert "max_batch_size: 16" in text and "max_queue_size: 96" in text
    assert "max_queue_delay_microseconds: 0" in text  # the runtime's dispatcher batches
    # A native instance's batch is a descriptor the runtime takes in: Triton gathers for it.
    assert "max_queue_delay_microseconds: 300" in model_config(info, 3, "/l", backend="native",
                                                               queue_delay_ms=0.3)
    assert '{ name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] }' in text
    assert '{ name: "hidden" data_type: TYPE_FP16 dims: [ -1, 8 ] }' in text
    assert "count: 3 kind: KIND_CPU" in text
    assert 'string_value: "/tmp/x/link"' in text and 'string_value: "45"' in text
    # An output named without a shape takes its probed rank, every dim free.
    info.outputs, info.output_room = [TensorSpec("scores", "FP32", ())], ((4,),)
    assert '{ name: "scores" data_type: TYPE_FP32 dims: [ -1 ] }' in model_config(info, 1, "/l")
    info.outputs = [TensorSpec("text", "BYTES", (1,))]
    with pytest.raises(UsageError, match="'text' of model 'bert' is BYTES.*--front own"):
        model_config(info, 1, "/tmp/x/link")


def test_a_folder_without_triton_is_one_line_saying_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as err:
        find_triton(str(tmp_path))
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message
    assert "--triton-home" in message and "nvidia-pytriton" in message
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tritonserver").write_text("")
    # A build without the Python backend serves through the native backend; asked for the
    # Python one, it is one line naming what is missing and the way around it.
    install = find_triton(str(tmp_path))
    assert install.python_backend is None and install.stub is None
    assert "no Python backend" in (install.python_problem or "")
    settings = types.SimpleNamespace(triton_backend="python")
    with pytest.raises(UsageError, match="no Python backend.*--triton-backend native") as err:
        TritonHub._choose_backend(None, settings, 1, install)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler to build the native backend")
def test_the_native_backend_builds_once_and_rounds_fp16_outputs_as_numpy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend builds with the machine's compiler into a library named by its source
    (built once), and its FP32 → FP16 output conversion is IEEE round-to-nearest-even, bit for
    bit numpy's, subnormals, overflow and infinities included; a compiler that fails is one
    line naming it and `--triton-backend python`."""
    import ctypes

    from infermux.serve.triton_front import build_native_backend

    lib = build_native_backend(tmp_path)
    assert lib.parent == tmp_path and lib.name.startswith("libtriton_infermux-")
    built = lib.stat().st_mtime_ns
    assert build_native_backend(tmp_path) == lib and lib.stat().st_mtime_ns == built
    half = ctypes.CDLL(str(lib), mode=os.RTLD_LAZY).infermux_to_half  # Triton's symbols unbound
    half.argtypes, half.restype = [ctypes.c_float], ctypes.c_uint16
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(4000) * 10 ** rng.uniform(-9, 6, 4000),
                             [0.0, -0.0, 65504, 65519.99, 65520, 1e30, 6e-8, -6e-8, 2.98e-8,
                              np.inf, -np.inf]]).astype(np.float32)
    with np.errstate(over="ignore"):
        want = values.astype(np.float16).view(np.uint16)
    got = np.array([half(float(v)) for v in values], dtype=np.uint16)
    np.testing.assert_array_equal(got, want)
    monkeypatch.setenv("CC", "false")
    with pytest.raises(UsageError,
                       match=r"did not build with false \(exit code 1\): pass --triton-backend"):
        build_native_backend(tmp_path / "other")


def test_a_bad_front_or_options_it_cannot_take_exit_with_one_line(tmp_path: Path) -> None:
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({"name": "p", "models": [{"name": "net", "model": "digits-cnn",
                                "replicas": [{"unit": "cpu:0", "engine": "torch",
                                              "batch": 4}]}]}))
    for extra, expected in ((["--front", "grpcio"], "--front 'grpcio' is not a front"),
                            (["--front", "triton", "--api-key", "a:b=c"],
                             "only letters, digits and ._~+/- pass intact"),
                            (["--front", "triton", "--triton-backend", "cpp"],
                             "--triton-backend 'cpp' is not a backend"),
                            (["--front", "triton", "--triton-queue-delay", "2s"],
                             "--triton-queue-delay 2000ms is out of range: use 0 to 100ms"),
                            (["--front", "triton", "--triton-queue-delay", "soon"],
                             "--triton-queue-delay 'soon' is not a duration"),
                            (["--triton-queue-delay", "1ms"],
                             "--triton-queue-delay set Triton's front, and this server's front "
                             "is own: add --front triton, or leave it out"),
                            (["--front", "own", "--triton-backend", "native", "--triton-home",
                              str(tmp_path)],
                             "--triton-home, --triton-backend set Triton's front")):
        done = subprocess.run([sys.executable, "-m", "infermux", "serve", str(plan), "--no-store",
                               *extra], capture_output=True, text=True, timeout=120,
                              env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
        assert done.returncode != 0
        assert expected in done.stderr and "Traceback" not in done.stderr


# -- a real server (skips without a Triton build) ------------------------------------------------

tgrpc = pytest.importorskip("tritonclient.grpc")
import tritonclient.http as thttp  # noqa: E402
import tritonclient.utils.shared_memory as tshm  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests import test_serve, test_serve_fronts  # noqa: E402
from tests.test_serve import Server, _plan, _x  # noqa: E402
from tests.test_serve_fronts import _infer  # noqa: E402

#: The network's own outputs (a fixture of the module beside, on this module's `net_file`).
reference = test_serve.reference

#: The network file and its `slower` model (0.3 s a batch), shared with the own fronts' tests.
net_file = test_serve_fronts.net_file


#: A numpy 1 install for the stubs (`make triton` puts one here), for `--triton-python-path`.
NUMPY1 = Path(os.environ.get("INFERMUX_TEST_NUMPY1", ROOT / ".venv" / "opt" / "triton-numpy1"))


@pytest.fixture(scope="module", params=["native", "numpy2", "numpy1"])
def triton(net_file: Path, request: pytest.FixtureRequest) -> Any:
    """A served plan; its model instances infermux's C backend, or Python-backend stubs on this
    environment's numpy 2 or on a numpy 1."""
    extra = ["--triton-backend", "native" if request.param == "native" else "python"]
    if request.param == "numpy1":
        if not (NUMPY1 / "numpy").is_dir():
            pytest.skip(f"no numpy 1 install at {NUMPY1} (make triton makes one)")
        extra += ["--triton-python-path", str(NUMPY1)]
    srv = Server(net_file.parent, _plan("triton", f"{net_file}:build"), "--front", "triton",
                 "--fronts", "2", *extra)
    srv.backend = extra[1]  # type: ignore[attr-defined]
    yield srv
    code, out = srv.stop()
    assert code == 0, out
    stopped = json.loads(out[out.index("{"):])
    assert stopped["status"] == "complete" and stopped["models"]["net"]["requests_failed"] == 0


@needs_triton
def test_triton_describes_the_plan_s_model(triton: Any) -> None:
    assert triton.ready["front"] == "triton" and triton.ready["fronts"] == 2
    assert triton.ready["triton_backend"] == triton.backend
    client = thttp.InferenceServerClient(triton.http)
    assert client.is_server_ready() and client.is_model_ready("net")
    config = client.get_model_config("net")
    assert config["max_batch_size"] == 4 and config["input"][0]["dims"] == [3, 16, 16]
    # Triton's batcher waits for company only where an instance's batch is a descriptor.
    delay_ms = 0.3 if triton.backend == "native" else 0.0
    assert triton.ready["triton_queue_delay_ms"] == delay_ms
    assert int(config["dynamic_batching"].get("max_queue_delay_microseconds", 0)) == round(
        delay_ms * 1000)
    assert "system_shared_memory" in client.get_server_metadata()["extensions"]


@needs_triton
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_outputs_equal_the_network_through_triton(triton: Any, reference: Any,
                                                  protocol: str) -> None:
    """The front processes' test, through Triton: concurrent requests, then the statistics."""
    test_serve_fronts.test_outputs_equal_the_network_through_either_front(triton, reference,
                                                                          protocol)


def _send_together(client: Any, count: int) -> None:
    """`count` single-image gRPC requests sent at once, each answered without an error."""
    done = threading.Semaphore(0)
    failures: list[Any] = []

    def answered(result: Any, error: Any) -> None:
        if error is not None:
            failures.append(error)
        done.release()

    for k in range(count):
        x = _x(1, seed=k)
        tensor = tgrpc.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        client.async_infer("net", [tensor], answered)
    for _ in range(count):
        assert done.acquire(timeout=60)
    assert not failures, failures


@needs_triton
def test_every_client_request_in_a_triton_batch_is_counted_once(triton: Any) -> None:
    """Behind Triton a runtime request is a Triton batch of one or more client requests:
    infermux's `/metrics` and statistics count the client's requests, as Triton's own do."""
    key = 'nv_inference_request_success_total{model="net",version="1"}'
    client = tgrpc.InferenceServerClient(triton.grpc)

    def triton_counts() -> tuple[int, int]:
        stats = client.get_inference_statistics("net", as_json=True)["model_stats"][0]
        return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))

    try:
        for _ in range(5):  # until a round had Triton batch several requests
            before, (infers, executions) = triton.scrape().get(key, 0.0), triton_counts()
            _send_together(client, 48)
            # Both sides record a request once it is answered, a moment after its client has
            # its response: each is waited for.
            deadline = time.monotonic() + 10
            while triton_counts()[0] - infers < 48 and time.monotonic() < deadline:
                time.sleep(0.05)
            infers2, executions2 = triton_counts()
            assert infers2 - infers == 48
            while triton.scrape().get(key, 0.0) - before < 48 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert triton.scrape().get(key, 0.0) - before == 48
            if executions2 - executions < 48:
                return
        pytest.skip("Triton ran every request alone in five rounds: nothing batched to count")
    finally:
        client.close()


@needs_triton
def test_system_shared_memory_inputs_and_outputs_through_triton(triton: Any,
                                                                reference: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    x = _x(2, seed=11)
    y_ref = reference(x)
    handles = [tshm.create_shared_memory_region(f"in{tag}", f"/in{tag}", x.nbytes),
               tshm.create_shared_memory_region(f"out{tag}", f"/out{tag}", y_ref.nbytes)]
    client = tgrpc.InferenceServerClient(triton.grpc)
    try:
        tshm.set_shared_memory_region(handles[0], [x])
        client.register_system_shared_memory(f"in{tag}", f"/in{tag}", x.nbytes)
        client.register_system_shared_memory(f"out{tag}", f"/out{tag}", y_ref.nbytes)
        inp = tgrpc.InferInput("input", list(x.shape), "FP32")
        inp.set_shared_memory(f"in{tag}", x.nbytes)
        out = tgrpc.InferRequestedOutput("output")
        out.set_shared_memory(f"out{tag}", y_ref.nbytes)
        client.infer("net", [inp], outputs=[out])
        y = tshm.get_contents_as_numpy(handles[1], np.float32, list(y_ref.shape))
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    finally:
        # Triton's own bookkeeping, not infermux's: it once refused to unregister regions
        # a just-answered request had used, so a refusal here is not this test's failure.
        with contextlib.suppress(InferenceServerException):
            client.unregister_system_shared_memory()
        client.close()
        for h in handles:
            tshm.destroy_shared_memory_region(h)


@needs_triton
def test_an_api_key_guards_all_but_health_behind_triton(net_file: Path, reference: Any) -> None:
    """`--api-key` behind Triton's front: inference and metadata need `x-api-key: KEY` over
    HTTP and gRPC, the health probes stay open, a wrong key is refused."""
    srv = Server(net_file.parent, _plan("triton-key", f"{net_file}:build"), "--front", "triton",
                 "--fronts", "1", "--api-key", "s3cret")
    x = _x(2, seed=5)
    try:
        http = thttp.InferenceServerClient(srv.http)
        grpc = tgrpc.InferenceServerClient(srv.grpc)
        assert http.is_server_ready() and grpc.is_server_live()  # no key needed
        # Triton reads gRPC's restricted header with its prefix (the own fronts take both).
        for client, infer_input, header in (
                (http, thttp.InferInput, "x-api-key"),
                (grpc, tgrpc.InferInput, "triton-grpc-protocol-x-api-key")):
            tensor = infer_input("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            for headers in (None, {header: "wrong"}):
                with pytest.raises(InferenceServerException, match="x-api-key"):
                    client.infer("net", [tensor], headers=headers)
            with pytest.raises(InferenceServerException, match="x-api-key"):
                client.get_model_metadata("net")
            y = client.infer("net", [tensor], headers={header: "s3cret"}).as_numpy("output")
            np.testing.assert_allclose(y, reference(x), rtol=1e-5, atol=1e-5)
            assert client.get_model_metadata("net", headers={header: "s3cret"})
        grpc.close()
    finally:
        code, out = srv.stop()
    assert code == 0, out


@needs_triton
def test_requests_behind_triton_are_traced_in_triton_and_in_the_runtime(net_file: Path,
                                                                       reference: Any) -> None:
    """`--trace-requests 1` behind Triton: Triton's trace of every request (received, queued,
    the backend's span, sent) and the runtime's stages of every descriptor its instances sent,
    both summarized at stop, on the one clock."""
    trace = net_file.parent / "triton-trace.jsonl"
    srv = Server(net_file.parent, _plan("triton-trace", f"{net_file}:build"), "--front",
                 "triton", "--fronts", "1", "--trace-requests", "1", "--trace-file", str(trace))
    try:
        sent = 6
        for k in range(sent):  # one at a time: each its own Triton batch and descriptor
            x = _x(1, seed=k)
            np.testing.assert_allclose(_infer("grpc", srv, x), reference(x), rtol=1e-5,
                                       atol=1e-5)
    finally:
        code, out = srv.stop()
    assert code == 0, out
    traced = json.loads(out[out.index("{"):])["trace"]
    assert traced["requests"] == sent  # the runtime's side: frame read to answer written
    assert {"frame_read->admitted", "enqueued->taken", "outputs_written->answer_queued"} <= set(
        traced["gaps"])
    ours = traced["triton"]
    assert ours["path"] == f"{trace}.triton" and ours["requests"] == sent
    for gap in ("grpc_waitread_end->request_start", "queue_start->compute_start",
                "compute_output_start->compute_end", "request_end->grpc_send_end"):
        assert ours["gaps"][gap]["count"] == sent, gap
    # The backend's span holds the runtime's whole part of the request, so it is longer than
    # the runtime's stamps from reading the descriptor to writing the answer.
    span = sum(g["mean_ms"] for name, g in ours["gaps"].items()
               if name.startswith(("compute_start", "compute_input_end", "compute_output_start")))
    assert span >= traced["total"]["mean_ms"] * 0.9, (span, traced["total"])


@needs_triton
def test_triton_runs_on_glibc_s_heap_settings_only_when_asked(net_file: Path, reference: Any,
                                                             monkeypatch: Any) -> None:
    """`$INFERMUX_TRITON_MALLOC=heap` puts `TRITON_MALLOC` in `tritonserver`'s environment
    (and it serves as before); without it, or with allocator settings of the caller's own,
    glibc's are left alone."""
    from infermux.serve.triton_front import TRITON_MALLOC

    def environ(srv: Any) -> dict[str, str]:
        raw = Path(f"/proc/{srv.ready['front_pids'][0]}/environ").read_bytes()
        return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)

    for name in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    cases = [("heap", {}, TRITON_MALLOC), (None, {}, {}),
             ("heap", {"MALLOC_ARENA_MAX": "2"}, {"MALLOC_ARENA_MAX": "2"})]
    for setting, own, expected in cases:
        if setting:
            monkeypatch.setenv("INFERMUX_TRITON_MALLOC", setting)
        else:
            monkeypatch.delenv("INFERMUX_TRITON_MALLOC", raising=False)
        for name, value in own.items():
            monkeypatch.setenv(name, value)
        srv = Server(net_file.parent, _plan("triton-malloc", f"{net_file}:build"), "--front",
                     "triton", "--fronts", "1")
        try:
            env = environ(srv)
            assert {k: v for k, v in env.items() if k.startswith("MALLOC_")} == expected
            x = _x(2, seed=3)
            np.testing.assert_allclose(_infer("grpc", srv, x), reference(x), rtol=1e-5,
                                       atol=1e-5)
        finally:
            code, out = srv.stop()
        assert code == 0, out


@needs_triton
@pytest.mark.exclusive
def test_sigterm_answers_every_request_triton_admitted(net_file: Path, reference: Any) -> None:
    srv = Server(net_file.parent, _plan("triton-drain", f"{net_file}:slower"), "--front",
                 "triton", "--fronts", "1")
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def one(k: int) -> None:
        try:
            results[k] = _infer("grpc", srv, _x(1, seed=100 + k))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # admitted: a 0.3 s model with batches of 4 has several still to run
    code, out = srv.stop()
    for t in threads:
        t.join(60)
    assert code == 0, out
    assert not errors, errors
    assert len(results) == 8
    for k, y in results.items():
        np.testing.assert_allclose(y, reference(_x(1, seed=100 + k)), rtol=1e-5, atol=1e-5)
    stopped = json.loads(out[out.index("{"):])
    assert stopped["status"] == "complete"


@needs_triton
@pytest.mark.exclusive
def test_a_killed_triton_server_is_restarted_and_answers_again(net_file: Path,
                                                               reference: Any) -> None:
    srv = Server(net_file.parent, _plan("triton-restart", f"{net_file}:build"), "--front",
                 "triton", "--fronts", "1")
    try:
        x = _x(2, seed=5)
        np.testing.assert_allclose(_infer("grpc", srv, x), reference(x), rtol=1e-5, atol=1e-5)
        os.kill(srv.ready["front_pids"][0], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while True:  # refused while Triton restarts, then answered by the new one
            try:
                y = _infer("http", srv, x)
                break
            except Exception:  # noqa: BLE001 - connection refused / not ready yet
                assert time.monotonic() < deadline, "Triton was not restarted within 90 s"
                time.sleep(0.5)
        np.testing.assert_allclose(y, reference(x), rtol=1e-5, atol=1e-5)
    finally:
        code, out = srv.stop()
    assert code == 0, out
    stopped = json.loads(out[out.index("{"):])
    assert stopped["front_restarts"] == 1


@needs_triton
@pytest.mark.exclusive
@pytest.mark.parametrize("instances", [1, 2])
def test_past_triton_s_queue_a_request_is_refused_unavailable_never_reset(
        net_file: Path, reference: Any, instances: int) -> None:
    """A burst past the model's admission limit (`--max-queue 6`) on a 0.3 s/batch model: every
    request is answered or refused with 503 / UNAVAILABLE, none reset or lost, and what is
    answered is the network's output. The limit is Triton's queue, written from the plan, and
    behind it the native instances' slabs (one instance: its slab fills first) and the
    runtime's admission (two: each slab holds the whole limit, the runtime refuses, and its
    refusals reach the instances as ERROR frames)."""
    srv = Server(net_file.parent, _plan("triton-queue", f"{net_file}:slower"), "--front",
                 "triton", "--fronts", str(instances), "--max-queue", "6")
    outcomes: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(k: int) -> None:
        x = _x(1, seed=200 + k)
        try:
            y = _infer("grpc" if k % 2 else "http", srv, x)
            np.testing.assert_allclose(y, reference(x), rtol=1e-5, atol=1e-5)
            outcomes[k] = "ok"
        except InferenceServerException as exc:
            outcomes[k] = f"{exc.status()} {exc.message()}"
        except BaseException as exc:  # noqa: BLE001 - a reset or a wrong output is the finding
            errors.append(exc)

    try:
        config = thttp.InferenceServerClient(srv.http).get_model_config("net")
        assert config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] in (6, "6")
        threads = [threading.Thread(target=one, args=(k,)) for k in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert len(outcomes) == 32
        refused = [o for o in outcomes.values() if o != "ok"]
        assert refused and len(refused) < 32, outcomes
        assert all(o.split()[0] in ("503", "StatusCode.UNAVAILABLE") for o in refused), refused
        # Triton's queue (the Python stubs hold one batch each), or the native instances' and
        # the runtime's admission limit (they take every request at once).
        assert all("queue" in o or "admission limit" in o for o in refused), refused
        if instances == 2 and srv.ready["triton_backend"] == "native":
            assert any("in flight" in o for o in refused), refused  # the runtime's, relayed
    finally:
        code, out = srv.stop()
    assert code == 0, out
    stopped = json.loads(out[out.index("{"):])
    assert stopped["status"] == "complete"
    assert stopped["models"]["net"]["requests_failed"] == 0
    # infermux counts each client request it answered, and each it refused (an instance's
    # full slab, the runtime's limit); Triton's own queue refusals are Triton's to count.
    ours = [o for o in refused if "admission limit" in o or "in flight" in o]
    assert stopped["models"]["net"]["requests_ok"] == 32 - len(refused), (stopped, outcomes)
    assert stopped["models"]["net"]["requests_rejected"] == len(ours), (stopped, outcomes)


@needs_triton
def test_triton_s_queue_delay_gathers_a_native_instance_s_requests(net_file: Path) -> None:
    """`--triton-queue-delay`: Triton holds a request that long for others to join its batch,
    so 48 requests sent together reach the runtime in batches, not one by one."""
    srv = Server(net_file.parent, _plan("triton", f"{net_file}:build"), "--front", "triton",
                 "--fronts", "2", "--triton-backend", "native", "--triton-queue-delay", "40ms")
    client = tgrpc.InferenceServerClient(srv.grpc)
    try:
        assert srv.ready["triton_queue_delay_ms"] == 40.0
        _send_together(client, 48)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = client.get_inference_statistics("net", as_json=True)["model_stats"][0]
            if int(stats.get("inference_count", 0)) >= 48:
                break
            time.sleep(0.05)
        assert int(stats["inference_count"]) == 48
        # The plan's largest batch is 4: twelve batches when each waits to be full (with no
        # delay, 20-43 batches here in three runs).
        assert int(stats["execution_count"]) <= 16, stats
    finally:
        client.close()
        code, out = srv.stop()
    assert code == 0, out
