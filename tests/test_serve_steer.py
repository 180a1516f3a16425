"""New gRPC connections steered to the least loaded front process (serve/steer.py).

The classic BPF program is attached to real SO_REUSEPORT groups and real connections are
counted where the kernel put them; the runtime process's picture of the group's order is
checked against the kernel's own when a socket leaves. Then a real server with two front
processes: with one client busy on one front, every new connection goes to the other; and
with `--connection-age`, a client's connection is replaced while its calls go on, none failed.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infermux.serve.steer import Steering, attach, listening_sockets, program, weights

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="SO_ATTACH_REUSEPORT_CBPF is Linux's")


def _group(n: int) -> tuple[list[socket.socket], int]:
    """`n` listening sockets sharing a port (SO_REUSEPORT), in the order they joined."""
    socks: list[socket.socket] = []
    port = 0
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", port))
        port = s.getsockname()[1]
        s.listen(1024)
        s.setblocking(False)
        socks.append(s)
    return socks, port


def _landed(socks: list[socket.socket], port: int, connections: int) -> collections.Counter[int]:
    """Open `connections` to `port`; how many each socket of the group accepted."""
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    got: collections.Counter[int] = collections.Counter()
    deadline = time.monotonic() + 5
    while sum(got.values()) < connections and time.monotonic() < deadline:
        for i, s in enumerate(socks):
            try:
                conn, _ = s.accept()
            except BlockingIOError:
                continue
            got[i] += 1
            conn.close()
    for c in clients:
        c.close()
    return got


def test_the_program_draws_each_socket_by_its_share() -> None:
    socks, port = _group(3)
    try:
        attach(socks[1], program([0, 1, 2], [0.0, 3.0, 1.0]))
        got = _landed(socks, port, 400)
        assert got[0] == 0
        assert sum(got.values()) == 400
        assert 240 <= got[1] <= 360, got  # 300 expected; binomial sd ~8.7
        attach(socks[0], program([0, 1, 2], [0.0, 0.0, 1.0]))  # any member replaces it
        assert _landed(socks, port, 50) == {2: 50}
    finally:
        for s in socks:
            s.close()


def test_the_picture_of_the_group_follows_the_kernel_when_a_socket_leaves() -> None:
    socks, port = _group(4)
    steering = Steering()
    for s in socks:
        steering.join(s)
    try:
        socks[1].close()  # the kernel moves the last socket into its place
        steering.leave(socks[1])
        assert steering.members == [socks[0], socks[3], socks[2]]
        live = [socks[0], socks[2], socks[3]]
        for index, member in enumerate(steering.members):
            attach(socks[0], program([index], [1.0]))
            got = _landed(live, port, 10)
            assert got == {live.index(member): 10}, (index, got)
    finally:
        for s in socks:
            s.close()


def test_new_connections_go_to_the_fronts_with_fewest() -> None:
    assert weights([0.0, 0.0, 0.0]) == [1.0, 1.0, 1.0]  # nothing known: alike
    assert weights([2.0, 2.0]) == [1.0, 1.0]  # balanced: alike
    assert weights([3.0, 1.0, 1.0, 2.0]) == [0.0, 1.0, 1.0, 0.0]
    steering = Steering()
    assert steering.table({}) is None  # one front or none: nothing to steer
    steering.join("a")
    steering.join("b")
    assert steering.table({"a": 900.0, "b": 0.0}) == [[0, 0.0], [1, 1.0]]


# -- through a real server --------------------------------------------------------------------

tgrpc = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("uvicorn")
psutil = pytest.importorskip("psutil")

from tests.test_serve import NET, Server, _plan  # noqa: E402
from tests.test_serve_fronts import _front_pids  # noqa: E402


def _client(srv: Server) -> Any:
    """A client on a connection of its own (grpc would otherwise share one between clients)."""
    return tgrpc.InferenceServerClient(srv.grpc, channel_args=[
        ("grpc.use_local_subchannel_pool", 1)])


def _infer(client: Any) -> None:
    x = np.ones((1, 3, 16, 16), dtype=np.float32)
    inp = tgrpc.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    assert client.infer("net", [inp]).as_numpy("output") is not None


def _mine(port: int) -> set[int]:
    """Local ports of this process's established connections to `port`."""
    return {c.laddr.port for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.port == port and c.status == "ESTABLISHED"}


def _front_of(srv: Server, local_port: int) -> int:
    """The front process holding the server side of this process's connection from `port`."""
    grpc_port = srv.ready["grpc_port"]
    for pid in _front_pids(srv.proc.pid):
        for c in psutil.Process(pid).net_connections("tcp"):
            if c.laddr.port == grpc_port and c.raddr and c.raddr.port == local_port:
                return pid
    raise AssertionError(f"no front holds the connection from port {local_port}")


def _steered_away_from_busy(srv: Server, clients: int = 5) -> tuple[int, list[int]]:
    """A client kept busy, then `clients` fresh ones a second apart: (busy front, theirs)."""
    grpc_port = srv.ready["grpc_port"]
    stop = threading.Event()
    failures: list[BaseException] = []
    busy = _client(srv)
    _infer(busy)
    (busy_port,) = _mine(grpc_port)
    busy_front = _front_of(srv, busy_port)

    def keep_busy() -> None:
        try:
            while not stop.is_set():
                _infer(busy)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            failures.append(exc)

    thread = threading.Thread(target=keep_busy)
    thread.start()
    fronts = []
    try:
        for _ in range(clients):
            time.sleep(1.0)
            before = _mine(grpc_port)
            client = _client(srv)
            _infer(client)
            (port,) = _mine(grpc_port) - before
            fronts.append(_front_of(srv, port))
            client.close()
    finally:
        stop.set()
        thread.join(30)
        busy.close()
    assert not failures, failures
    return busy_front, fronts


@pytest.fixture
def net_file(tmp_path: Path) -> Path:
    path = tmp_path / "net.py"
    path.write_text(NET)
    return path


def test_new_connections_go_to_the_front_the_busy_client_is_not_on(net_file: Path) -> None:
    srv = Server(net_file.parent, _plan("steer", f"{net_file}:build"), "--fronts", "2",
                 "--connection-age", "0")
    try:
        busy_front, fronts = _steered_away_from_busy(srv)
        # By the kernel's hash alone, all five would miss the busy front 1 time in 32.
        assert busy_front not in fronts, (busy_front, fronts)
    finally:
        code, out = srv.stop()
    assert code == 0, out


def test_a_connection_is_replaced_after_its_age_and_no_call_fails(net_file: Path) -> None:
    srv = Server(net_file.parent, _plan("age", f"{net_file}:build"), "--fronts", "2",
                 "--connection-age", "1s")
    try:
        grpc_port = srv.ready["grpc_port"]
        client = _client(srv)
        seen: set[int] = set()
        calls = 0
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            _infer(client)  # raises on a failed call
            calls += 1
            seen |= _mine(grpc_port)
        client.close()
        assert calls > 20
        assert len(seen) >= 2, seen  # the first connection went away, another took its calls
    finally:
        code, out = srv.stop()
    assert code == 0, out


def test_a_front_finds_its_own_listening_socket_once() -> None:
    socks, port = _group(1)
    other = socket.create_server(("127.0.0.1", 0))
    dup = os.dup(socks[0].fileno())  # grpc holds its listener under several descriptors
    try:
        found = listening_sockets(port)
        assert [s.getsockname()[1] for s in found] == [port]
        for s in found:
            s.close()
    finally:
        os.close(dup)
        other.close()
        socks[0].close()


def test_steering_follows_the_group_after_a_front_is_restarted(net_file: Path) -> None:
    """The first front's socket leaves the group; the kernel moves the last into its place.

    Three fronts at indices [0, 1, 2]; the one at 0 is killed, so the group is [2, 1] and the
    restarted front joins as [2, 1, 0']. A picture that only dropped the dead socket ([1, 2,
    0']) would steer away from the wrong front whenever the busy client is on front 1 or 2.
    """
    srv = Server(net_file.parent, _plan("restart", f"{net_file}:build"), "--fronts", "3",
                 "--connection-age", "0")
    try:
        victim = srv.ready["front_pids"][0]  # the first to open the port: index 0
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while True:
            now = _front_pids(srv.proc.pid)
            if len(now) == 3 and victim not in now:
                break
            assert time.monotonic() < deadline, f"the front was not restarted: {now}"
            time.sleep(0.2)
        time.sleep(2.0)  # its gRPC port opened and READY sent
        busy_front, fronts = _steered_away_from_busy(srv)
        assert busy_front not in fronts, (busy_front, fronts)
    finally:
        code, out = srv.stop()
    assert code == 0, out
