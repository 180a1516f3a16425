"""`infermux serve --fronts N`: fronts in their own processes, tensors through shared memory.

A real server with two front processes on shared ports, driven by Triton's own clients:
outputs equal the network's over HTTP and gRPC, with the tensors in the requests and in
system shared memory (tritonclient's utilities, registered through one connection and used
through others, which the kernel spreads over both fronts); a killed front is restarted while
the other answers; past admission a request gets 503 / UNAVAILABLE, never a reset; SIGTERM
drains both fronts and answers every admitted request. The slab allocator and the link's
framing are checked directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from http.client import HTTPException
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("uvicorn")

import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
import tritonclient.utils.shared_memory as tshm
from tritonclient.utils import InferenceServerException

from infermux.serve.proxy import REQUEST, FrameReader, Kind, frame
from infermux.serve.shm import SlabLayout, SlotAllocator
from tests.test_serve import NET, Server, _bin_input, _plan, _raw, _x

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory")


#: A model slow enough (0.3 s a batch) that requests admitted together are still in flight
#: when the test looks, however loaded the machine.
_SLOWER = """

def slower():
    torch.manual_seed(0)
    return Net(0.3)
"""


@pytest.fixture(scope="module")
def net_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fronts_net") / "net.py"
    path.write_text(NET + _SLOWER)
    return path


@pytest.fixture(scope="module")
def reference(net_file: Path) -> Any:
    import torch

    from infermux.models import ModelSpec, load_model

    module = load_model(ModelSpec(f"{net_file}:build")).module

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(x)).numpy()

    return run


@pytest.fixture(scope="module")
def fronts2(net_file: Path) -> Any:
    srv = Server(net_file.parent, _plan("fronts", f"{net_file}:build"), "--fronts", "2")
    yield srv
    code, out = srv.stop()
    assert code == 0, out
    stopped = json.loads(out[out.index("{"):])
    assert stopped["status"] == "complete" and stopped["models"]["net"]["requests_failed"] == 0


def _front_pids(server_pid: int) -> set[int]:
    """The server's front processes, from /proc (its children whose command is the front's)."""
    pids: set[int] = set()
    for tid in os.listdir(f"/proc/{server_pid}/task"):
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{server_pid}/task/{tid}/children").read_text().split()
            for child in map(int, children):
                with contextlib.suppress(OSError):
                    if b"infermux.serve.fronts" in Path(f"/proc/{child}/cmdline").read_bytes():
                        pids.add(child)
    return pids


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def _client(protocol: str, srv: Server) -> Any:
    return thttp.InferenceServerClient(srv.http) if protocol == "http" \
        else tgrpc.InferenceServerClient(srv.grpc)


def _infer(protocol: str, srv: Server, x: np.ndarray) -> np.ndarray:
    """One request on a fresh connection (so the kernel picks a front for it)."""
    mod = thttp if protocol == "http" else tgrpc
    client = _client(protocol, srv)
    try:
        inp = mod.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        out = client.infer("net", [inp]).as_numpy("output")
        assert out is not None
        return out
    finally:
        client.close()


# -- the link and the slab, directly -------------------------------------------------------------

def test_slot_allocator_takes_first_fit_and_merges_what_is_given_back() -> None:
    a = SlotAllocator(10)
    assert [a.take(3), a.take(3), a.take(3)] == [0, 3, 6]
    assert a.take(2) is None and a.take(1) == 9
    a.give(3, 3)
    assert a.take(4) is None  # 3 free slots, not 4 in a row
    a.give(0, 3)
    assert a.take(6) == 0  # 0-2 and 3-5 merged into one run
    a.give(0, 6)
    a.give(6, 3)
    a.give(9, 1)
    assert a.free == 10 and a.take(10) == 0


def test_slab_layout_keeps_inputs_and_outputs_of_a_request_contiguous_and_apart() -> None:
    layout = SlabLayout((3, 2), ((4,), (1,)), slots=5)
    assert layout.slot_bytes == (6 + 4 + 1) * 4
    buf = bytearray(layout.slot_bytes * 5)
    x = layout.inputs(buf, 2, 3, np.dtype("<f4"))
    x[...] = 1.0
    y0, y1 = layout.outputs(buf, 2, 3)
    y0[...], y1[...] = 2.0, 3.0
    other = layout.inputs(buf, 0, 2, np.dtype("<f4"))
    assert not other.any() and x.shape == (3, 3, 2) and y0.shape == (3, 4)
    assert (layout.inputs(buf, 2, 3, np.dtype("<f4")) == 1.0).all()
    assert y1.ctypes.data + y1.nbytes <= np.frombuffer(buf, np.uint8).ctypes.data + len(buf)
    # The input region is one array of rows by slot: a request's rows are rows of it, and
    # each `SlabRow` knows its slot and region (FP16 rows in the same slots, half of each).
    rows = layout.rows(buf, np.dtype("<f4"), "k")
    assert [r.slab_slot for r in rows] == list(range(5)) and rows[3].slab_key == "k"
    assert rows[3].slab_region.shape == (5, 3, 2) and (rows[3] == 1.0).all()
    assert (rows[3].slab_region[2:5] == x).all() and not rows[1].any()
    half = layout.inputs(buf, 0, 1, np.dtype("<f2"))
    half[...] = 0.5
    assert (layout.rows(buf, np.dtype("<f2"), "h")[0] == 0.5).all() and (x == 1.0).all()


def test_a_runner_gathers_slab_rows_of_several_slabs_and_dtypes_by_slot(
        tiny_factory: str) -> None:
    """A batch's rows from two fronts' slabs, FP32 and FP16, gathered by slot index into a
    CPU runner's input buffer: the outputs equal the network's on the same rows."""
    import torch

    from infermux.engines import create_engine
    from infermux.models import load_model
    from infermux.units import discover, select_units

    model = load_model(f"{tiny_factory}:build")
    runner = create_engine("torch").build(model, select_units("cpu", discover(
        with_runtimes=False))[0], 8)
    layout = SlabLayout(tuple(runner.input_shape), ((10,),), slots=16)
    slabs = [bytearray(layout.slot_bytes * 16) for _ in range(2)]
    rng = np.random.default_rng(5)
    picks = [(0, "<f4", 3), (1, "<f4", 0), (0, "<f2", 9), (1, "<f4", 15), (0, "<f4", 4),
             (1, "<f2", 7)]
    rows, want = [], []
    made: dict[tuple[int, str], list[Any]] = {}
    for slab, dtype, slot in picks:
        x = rng.standard_normal((1, *runner.input_shape)).astype(dtype)
        layout.inputs(slabs[slab], slot, 1, np.dtype(dtype))[...] = x
        if (slab, dtype) not in made:
            made[slab, dtype] = layout.rows(slabs[slab], np.dtype(dtype), (slab, dtype))
        rows.append(made[slab, dtype][slot])
        want.append(x[0].astype(np.float32))
    one_slab = [k for k, r in enumerate(rows) if r.slab_key == (0, "<f4")]
    for chosen in (list(range(len(rows))), one_slab):  # mixed slabs and dtypes; one slab
        batch = [rows[k] for k in chosen]
        ref = np.stack([want[k] for k in chosen])
        runner.gather_input(runner.prepare_rows(batch), range(len(batch)))
        runner.run()
        got = runner.outputs()[0][:len(batch)]
        with torch.inference_mode():
            expected = model.module(torch.from_numpy(ref)).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_frames_split_wherever_the_stream_breaks() -> None:
    payload = b"".join(REQUEST.pack(rid, 0, 1, rid * 2, 1, 0, 1) for rid in range(50))
    stream = frame(Kind.INFER, payload) + frame(Kind.DRAIN, b"") + frame(Kind.STATE, b"{}")
    reader = FrameReader()
    got: list[tuple[int, bytes]] = []
    for at in range(0, len(stream), 7):
        got += reader.feed(stream[at:at + 7])
    assert got == [(Kind.INFER, payload), (Kind.DRAIN, b""), (Kind.STATE, b"{}")]
    assert [r[0] for r in REQUEST.iter_unpack(got[0][1])] == list(range(50))


def test_frames_sent_with_init_reach_the_front_s_link() -> None:
    """A front restarted as the server stops reads INIT with DRAIN behind it in one read: the
    frames after INIT, and a partial one, go on to its link instead of being dropped (the
    front then never drained, and the server waited out its drain timeout)."""
    import asyncio
    import pickle
    import socket

    from infermux.serve.fronts import _read_init
    from infermux.serve.proxy import Link

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    late = frame(Kind.STATE, b'{"closing": true}')
    ours.sendall(frame(Kind.INIT, pickle.dumps({"slot": 1})) + frame(Kind.DRAIN, b"")
                 + late[:3])
    init, reader, early = _read_init(theirs)
    assert init == {"slot": 1} and early == [(Kind.DRAIN, b"")]

    async def rest() -> list[tuple[int, bytes]]:
        got: list[tuple[int, bytes]] = []
        theirs.setblocking(False)
        await asyncio.get_running_loop().create_unix_connection(
            lambda: Link(lambda k, p: got.append((k, p)), lambda: None, reader), sock=theirs)
        ours.sendall(late[3:])
        for _ in range(200):
            if got:
                break
            await asyncio.sleep(0.01)
        return got

    assert asyncio.run(rest()) == [(Kind.STATE, b'{"closing": true}')]
    ours.close()


def test_front_counts_are_checked_and_defaulted_from_the_cores() -> None:
    from infermux.errors import UsageError
    from infermux.serve import ServeSettings
    from infermux.serve.fronts import default_fronts

    with pytest.raises(UsageError, match="--fronts 65 must be 0 to 64"):
        ServeSettings(fronts=65)
    assert ServeSettings(fronts=0).fronts == 0
    # Half the cores, at most 8; below four cores the fronts stay in the server process.
    assert [default_fronts(c) for c in (1, 2, 3, 4, 16, 64)] == [1, 1, 1, 2, 8, 8]


# -- a server with two front processes -----------------------------------------------------------

def test_two_fronts_start_on_shared_ports_and_describe_the_model(fronts2: Server) -> None:
    ready = fronts2.ready
    assert ready["fronts"] == 2 and len(ready["front_pids"]) == 2
    assert _front_pids(fronts2.proc.pid) == set(ready["front_pids"])
    meta = thttp.InferenceServerClient(fronts2.http).get_server_metadata()
    assert "system_shared_memory" in meta["extensions"]
    grpc_meta = tgrpc.InferenceServerClient(fronts2.grpc).get_server_metadata()
    assert "system_shared_memory" in grpc_meta.extensions
    config = thttp.InferenceServerClient(fronts2.http).get_model_config("net")
    assert config["max_batch_size"] == 4


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_outputs_equal_the_network_through_either_front(fronts2: Server, reference: Any,
                                                        protocol: str) -> None:
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def one(k: int) -> None:
        try:
            results[k] = _infer(protocol, fronts2, _x(1 + k % 3, seed=k))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for k, y in results.items():
        np.testing.assert_allclose(y, reference(_x(1 + k % 3, seed=k)), rtol=1e-5, atol=1e-5)
    assert len(results) == 12
    # The runtime's statistics reach the fronts within a push period (0.1 s).
    deadline = time.monotonic() + 10
    while True:
        stats = thttp.InferenceServerClient(fronts2.http).get_inference_statistics("net")
        if stats["model_stats"][0]["inference_stats"]["success"]["count"] >= 12:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_system_shared_memory_registered_once_serves_every_front(fronts2: Server, reference: Any,
                                                                 protocol: str) -> None:
    mod = thttp if protocol == "http" else tgrpc
    tag = uuid.uuid4().hex[:8]
    x = _x(3, seed=7)
    y_ref = reference(x)
    handles = [tshm.create_shared_memory_region(f"in{tag}", f"/in{tag}", x.nbytes),
               tshm.create_shared_memory_region(f"out{tag}", f"/out{tag}", y_ref.nbytes)]
    try:
        tshm.set_shared_memory_region(handles[0], [x])
        admin = _client(protocol, fronts2)
        admin.register_system_shared_memory(f"in{tag}", f"/in{tag}", x.nbytes)
        admin.register_system_shared_memory(f"out{tag}", f"/out{tag}", y_ref.nbytes)
        status = admin.get_system_shared_memory_status()
        names = {r["name"] for r in status} if protocol == "http" else set(status.regions)
        assert {f"in{tag}", f"out{tag}"} <= names
        # Eight more connections: the kernel spreads them over both fronts, and each front
        # knows the regions registered through another.
        for k in range(8):
            client = _client(protocol, fronts2)
            inp = mod.InferInput("input", list(x.shape), "FP32")
            inp.set_shared_memory(f"in{tag}", x.nbytes)
            out = mod.InferRequestedOutput("output")
            out.set_shared_memory(f"out{tag}", y_ref.nbytes)
            result = client.infer("net", [inp], outputs=[out])
            assert result.get_output("output") is not None
            y = tshm.get_contents_as_numpy(handles[1], np.float32, list(y_ref.shape))
            np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
            tshm.set_shared_memory_region(handles[1], [np.zeros_like(y_ref)])
            client.close()
            del k
        # A region that is not registered is named in a clear error, whichever front answers.
        admin.unregister_system_shared_memory(f"in{tag}")
        inp = mod.InferInput("input", list(x.shape), "FP32")
        inp.set_shared_memory(f"in{tag}", x.nbytes)
        with pytest.raises(InferenceServerException, match=f"in{tag}"):
            _client(protocol, fronts2).infer("net", [inp])
        admin.unregister_system_shared_memory()
        admin.close()
    finally:
        for h in handles:
            tshm.destroy_shared_memory_region(h)


@pytest.mark.exclusive
def test_a_killed_front_is_restarted_while_the_other_answers(fronts2: Server,
                                                             reference: Any) -> None:
    before = _front_pids(fronts2.proc.pid)
    assert len(before) == 2
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    # Once the victim is dead (its sockets closed with it; connections already queued on its
    # listener were reset, as with any process that dies), fresh connections all reach the
    # survivor.
    deadline = time.monotonic() + 30
    while _alive(victim):
        assert time.monotonic() < deadline, "the killed front did not die"
        time.sleep(0.01)
    x = _x(2, seed=3)
    deadline = time.monotonic() + 90
    answered = resets = 0
    while True:
        for protocol in ("http", "grpc"):
            try:
                got = _infer(protocol, fronts2, x)
            except (OSError, HTTPException, InferenceServerException) as exc:
                # A connection made while the set of fronts on the port changes (the killed one
                # gone, its replacement binding its own listener) was closed unanswered once in
                # a clean-clone run of the suite, not pinned down further: a client sees what
                # it would of any process restarting. More than one fails the test.
                resets += 1
                assert resets <= 1, f"connections reset while the front restarted: {exc!r}"
                continue
            np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-5)
            answered += 1
        now = _front_pids(fronts2.proc.pid)
        if len(now) == 2 and victim not in now:
            break
        assert time.monotonic() < deadline, f"the front was not restarted: {now}"
        time.sleep(0.2)
    assert answered >= 2
    # The new front serves too: enough fresh connections reach both.
    for k in range(10):
        np.testing.assert_allclose(_infer("http", fronts2, _x(1, seed=k)),
                                   reference(_x(1, seed=k)), rtol=1e-5, atol=1e-5)


def test_past_admission_503_no_reset_and_sigterm_drains_both_fronts(net_file: Path) -> None:
    srv = Server(net_file.parent, _plan("slowfronts", f"{net_file}:slower", cpu_workers="thread"),
                 "--max-queue", "6", "--fronts", "2")
    try:
        assert srv.ready["fronts"] == 2
        # 1. Overload over HTTP: 16 requests at once on a 0.3 s/batch model admitting 6 items.
        codes: list[int] = []
        retry: list[str | None] = []
        resets: list[BaseException] = []

        def post(k: int, out: list[int]) -> None:
            header = json.dumps({"inputs": [_bin_input()]}).encode()
            try:
                status, headers, _ = _raw(srv, "POST", "/v2/models/net/infer",
                                          {"Inference-Header-Content-Length": str(len(header))},
                                          header + _x(1, seed=k).tobytes())
            except OSError as exc:
                resets.append(exc)
                return
            out.append(status)
            if status == 503:
                retry.append(headers.get("retry-after"))

        threads = [threading.Thread(target=post, args=(k, codes)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not resets, resets
        assert sorted(set(codes)) == [200, 503], codes
        assert all(r == "1" for r in retry)

        # 2. The same over gRPC: UNAVAILABLE with a retry-after, nothing else.
        statuses: list[str] = []

        def grpc_one(k: int) -> None:
            client = tgrpc.InferenceServerClient(srv.grpc)
            inp = tgrpc.InferInput("input", [1, 3, 16, 16], "FP32")
            inp.set_data_from_numpy(_x(1, seed=k))
            try:
                client.infer("net", [inp])
                statuses.append("OK")
            except InferenceServerException as exc:
                statuses.append(str(exc.status()))

        threads = [threading.Thread(target=grpc_one, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert set(statuses) == {"OK", "StatusCode.UNAVAILABLE"}, statuses

        # 3. SIGTERM with 6 items admitted through both fronts: all answered, exit code 0.
        answered: list[int] = []
        threads = [threading.Thread(target=post, args=(100 + k, answered)) for k in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while srv.scrape().get('infermux_items_in_flight{model="net"}', 0) < 6:
            assert time.monotonic() < deadline, "requests were not admitted"
            time.sleep(0.005)
        fronts = _front_pids(srv.proc.pid)
        code, out = srv.stop()
        for t in threads:
            t.join(30)
        assert code == 0, out
        assert answered == [200] * 6 and not resets
        summary = json.loads(out[out.index("{"):])
        assert summary["status"] == "complete" and summary["front_restarts"] == 0
        assert summary["models"]["net"]["requests_failed"] == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in fronts)
        with pytest.raises(OSError):
            _raw(srv, "GET", "/v2/health/live", {}, b"")
    finally:
        with contextlib.suppress(ProcessLookupError):
            srv.proc.kill()
        srv.proc.wait(10)


def test_in_process_fronts_serve_system_shared_memory_too(net_file: Path,
                                                          reference: Any) -> None:
    srv = Server(net_file.parent, _plan("onefront", f"{net_file}:build"), "--fronts", "1")
    tag = uuid.uuid4().hex[:8]
    x = _x(2, seed=11)
    handle = tshm.create_shared_memory_region(f"in{tag}", f"/in{tag}", x.nbytes)
    try:
        assert srv.ready["fronts"] == 1
        tshm.set_shared_memory_region(handle, [x])
        client = tgrpc.InferenceServerClient(srv.grpc)
        assert "system_shared_memory" in client.get_server_metadata().extensions
        client.register_system_shared_memory(f"in{tag}", f"/in{tag}", x.nbytes)
        inp = tgrpc.InferInput("input", list(x.shape), "FP32")
        inp.set_shared_memory(f"in{tag}", x.nbytes)
        y = client.infer("net", [inp]).as_numpy("output")
        np.testing.assert_allclose(y, reference(x), rtol=1e-5, atol=1e-5)
        with pytest.raises(InferenceServerException, match="beyond"):
            client.register_system_shared_memory(f"big{tag}", f"/in{tag}", x.nbytes + 1)
        client.unregister_system_shared_memory()
    finally:
        tshm.destroy_shared_memory_region(handle)
        code, out = srv.stop()
        assert code == 0, out


def _gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(not _gpu(), reason="CUDA shared memory needs a GPU with its CUDA runtime")
def test_cuda_shared_memory_inputs_and_outputs(net_file: Path, reference: Any) -> None:
    cudashm = pytest.importorskip("tritonclient.utils.cuda_shared_memory")
    srv = Server(net_file.parent, _plan("cudashm", f"{net_file}:build"), "--fronts", "2")
    x = _x(2, seed=5)
    y_ref = reference(x)
    handles = [cudashm.create_shared_memory_region("cin", x.nbytes, 0),
               cudashm.create_shared_memory_region("cout", y_ref.nbytes, 0)]
    try:
        cudashm.set_shared_memory_region(handles[0], [x])
        client = tgrpc.InferenceServerClient(srv.grpc)
        assert "cuda_shared_memory" in client.get_server_metadata().extensions
        client.register_cuda_shared_memory("cin", cudashm.get_raw_handle(handles[0]), 0,
                                           x.nbytes)
        client.register_cuda_shared_memory("cout", cudashm.get_raw_handle(handles[1]), 0,
                                           y_ref.nbytes)
        for _ in range(4):  # fresh connections: both fronts
            c = tgrpc.InferenceServerClient(srv.grpc)
            inp = tgrpc.InferInput("input", list(x.shape), "FP32")
            inp.set_shared_memory("cin", x.nbytes)
            out = tgrpc.InferRequestedOutput("output")
            out.set_shared_memory("cout", y_ref.nbytes)
            c.infer("net", [inp], outputs=[out])
            y = cudashm.get_contents_as_numpy(handles[1], np.float32, list(y_ref.shape))
            np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
            c.close()
        client.unregister_cuda_shared_memory()
    finally:
        for h in handles:
            cudashm.destroy_shared_memory_region(h)
        code, out = srv.stop()
        assert code == 0, out


# -- a frame of requests at once: admission and accounting -------------------------------------


def test_a_frame_of_requests_is_admitted_in_order_and_counted_like_single_requests() -> None:
    """`InferenceCore.submit_many` on a real runtime: the admission limit holds across the
    requests of one call, refusals are counted, and every admitted request is one success, or
    as many as the client requests it carries (a Triton batch's), admitted or refused."""
    import asyncio

    from infermux.runtime import parse_plan, start_runtime
    from infermux.serve.core import InferenceCore, ProtocolError
    from infermux.serve.metrics import ServeMetrics
    from tests.conftest import TINY

    plan = parse_plan({
        "name": "frame", "models": [{"name": "tiny", "model": f"{TINY}:tiny_cnn",
                                     "replicas": [{"unit": "cpu:0", "batch": 4}]}],
        "dispatcher": {"cpu_workers": "thread", "max_queue_delay_ms": 1}})
    rt = start_runtime(plan)
    rows = np.random.default_rng(3).standard_normal((8, 3, 32, 32)).astype(np.float32)
    sizes = [1, 1, 1, 1, 2, 1, 1]  # 6 items fit the limit of 6; the last two do not
    clients = [1, 1, 1, 3, 1, 1, 2]  # request 3 a Triton batch of three, 6 one of two

    async def run() -> tuple[Any, ...]:
        metrics = ServeMetrics(rt)
        core = InferenceCore(rt, plan, max_queue_items=6, metrics=metrics)
        info = core.models["tiny"]
        expected = [await core.infer(info, rows[:n]) for n in (1, 2)]  # the single path
        answers: list[tuple[int, Any]] = []
        deliveries: list[int] = []
        all_in = asyncio.Event()

        def deliver(got: list[tuple[int, Any]]) -> None:
            answers.extend(got)
            deliveries.append(len(got))
            if len(answers) == 5:
                all_in.set()

        sink = core.batch_sink(deliver)
        outs = [[np.full((n, 10), np.nan, dtype=np.float32)] for n in sizes]
        refused = core.submit_many([(info, rows[:n], outs[k], k, clients[k]) for k, n in
                                    enumerate(sizes)], sink)
        in_flight = info.in_flight_items
        await asyncio.wait_for(all_in.wait(), 60)
        return core, info, expected, answers, deliveries, outs, refused, in_flight, metrics

    try:
        core, info, expected, answers, deliveries, outs, refused, in_flight, metrics = \
            asyncio.run(run())
    finally:
        rt.stop(drain=True)
    assert [k for k, _ in refused] == [5, 6] and in_flight <= 6
    assert all(isinstance(e, ProtocolError) and e.status == 503 and e.retry_after_s == 1.0
               for _, e in refused)
    assert sorted(k for k, _ in answers) == [0, 1, 2, 3, 4]
    assert sum(deliveries) == 5 and len(deliveries) <= 5  # answers come per runtime batch
    for k, result in answers:  # written into the arrays given, equal to the single path's
        assert result[0] is outs[k][0]
        np.testing.assert_allclose(result[0], expected[sizes[k] - 1][0], rtol=1e-5, atol=1e-6)
    s = info.stats
    assert (s.success.count, s.fail.count, s.rejected) == (7 + 2, 0, 1 + 2)
    assert s.inference_count == 6 + 3 and info.in_flight_items == info.in_flight_requests == 0
    assert core.summary()["tiny"].requests_rejected == 3
    text = metrics.text().decode()
    assert 'nv_inference_request_success_total{model="tiny",version="1"} 9.0' in text
    assert 'infermux_requests_rejected_total{model="tiny"} 3.0' in text
    assert 'infermux_items_in_flight{model="tiny"} 0.0' in text


def test_fronts_under_a_burst_count_every_request_once(net_file: Path) -> None:
    """A burst past admission through two fronts: answered + refused = sent, in the v2
    statistics, the Prometheus counters and the stored summary alike; never more items in
    flight than the limit."""
    srv = Server(net_file.parent, _plan("burst", f"{net_file}:slower", cpu_workers="thread"),
                 "--max-queue", "6", "--fronts", "2")
    codes: list[str] = []
    errors: list[BaseException] = []
    peak = [0.0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                peak[0] = max(peak[0], srv.scrape().get('infermux_items_in_flight{model="net"}', 0))
            time.sleep(0.01)

    def one(k: int) -> None:
        protocol = "http" if k % 2 else "grpc"
        try:
            _infer(protocol, srv, _x(1, seed=k))
            codes.append("ok")
        except InferenceServerException as exc:
            codes.append(str(exc.status()))
        except BaseException as exc:  # noqa: BLE001 - a reset or hang is what the test finds
            errors.append(exc)

    try:
        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=one, args=(k,)) for k in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stop.set()
        watcher.join(10)
        assert not errors, errors
        ok = codes.count("ok")
        refused = len(codes) - ok
        assert len(codes) == 32 and ok >= 1 and refused >= 1, codes
        assert set(codes) <= {"ok", "503", "StatusCode.UNAVAILABLE"}, codes
        assert peak[0] <= 6
        metrics = srv.scrape()
        assert metrics['nv_inference_request_success_total{model="net",version="1"}'] == ok
        assert metrics['infermux_requests_rejected_total{model="net"}'] == refused
        # Items run: each answered request's one, and the item that probed the outputs.
        assert metrics['nv_inference_count_total{model="net",version="1"}'] == ok + 1
        deadline = time.monotonic() + 10  # the fronts' statistics are pushed periodically
        while True:
            stats = thttp.InferenceServerClient(srv.http).get_inference_statistics("net")
            inference = stats["model_stats"][0]["inference_stats"]
            if inference["success"]["count"] >= ok or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (inference["success"]["count"], inference["fail"]["count"]) == (ok, 0)
        assert stats["model_stats"][0]["inference_count"] == ok + 1
    finally:
        code, out = srv.stop()
    assert code == 0, out
    summary = json.loads(out[out.index("{"):])["models"]["net"]
    assert (summary["requests_ok"], summary["requests_rejected"],
            summary["requests_failed"]) == (ok, refused, 0)
