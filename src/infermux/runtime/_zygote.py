"""The worker template (`python -m infermux.runtime._zygote FD`): imports once, then forks.

It imports what a worker child needs (torch, numpy, the engines' common code, the runtime's
inputs), answers `hello`, then serves requests on the socket `FD` from the process that
started it (`runtime.zygote`): `spawn` forks a worker child (`runtime._child.child_main`) on
the two pipe ends passed with the request, in the environment and directory given; `status`
says whether a child has ended, and how. It reaps its children as they end and exits when that
process closes the socket (it has ended). It runs nothing else: no thread of its own, no
operator, no CUDA, so each fork starts as clean as a fresh interpreter would.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys


def _preload() -> None:
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import infermux.engines
    import infermux.models
    import infermux.runtime._child
    import infermux.runtime.inputs
    import infermux.runtime.plan
    import infermux.units  # noqa: F401


def _receive(sock: socket.socket) -> tuple[tuple, list[int]] | None:
    """One request and the descriptors sent with it; None once the other end has closed."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
    if not data:
        return None
    while len(data) < 4:
        more = sock.recv(4 - len(data))
        if not more:
            return None
        data += more
    size = int.from_bytes(data[:4], "little")
    body = data[4:]
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return pickle.loads(body), fds


def _answer(sock: socket.socket, msg: tuple) -> None:
    data = pickle.dumps(msg)
    sock.sendall(len(data).to_bytes(4, "little") + data)


#: The process names (`/proc/PID/comm`, what `ps`, `top` and psutil's `name()` show) of the
#: template and of the worker children forked from it: their command lines are the template's.
TEMPLATE_NAME = "infermux-tmpl"
WORKER_NAME = "infermux-worker"


def _name_process(name: str) -> None:
    """Set this process's name as `ps` shows it (Linux's `PR_SET_NAME`; 15 bytes at most)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, name.encode()[:15], 0, 0, 0)


def _reap(ended: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        ended[pid] = os.waitstatus_to_exitcode(status)


def _child(sock: socket.socket, fds: list[int], env: dict[str, str], cwd: str) -> None:
    """In the fork: become the worker child, as `python -m infermux.runtime._child` would."""
    from multiprocessing.connection import Connection

    from infermux.runtime._child import child_main

    code = 0
    try:
        sock.close()
        os.setsid()
        _name_process(WORKER_NAME)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        child_main(Connection(fds[0], writable=False), Connection(fds[1], readable=False))
    except BaseException:  # noqa: BLE001 - the parent sees the pipe close and the exit code
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    _name_process(TEMPLATE_NAME)
    _preload()
    ended: dict[int, int] = {}
    while True:
        request = _receive(sock)
        _reap(ended)
        if request is None:
            return
        msg, fds = request
        if msg[0] == "hello":
            _answer(sock, ("hello",))
        elif msg[0] == "status":
            _answer(sock, ("status", ended.pop(msg[1], None)))
        elif msg[0] == "spawn":
            try:
                pid = os.fork()
            except OSError as exc:
                for f in fds:
                    os.close(f)
                _answer(sock, ("error", str(exc)))
                continue
            if pid == 0:
                _child(sock, fds, msg[1], msg[2])
            for f in fds:
                os.close(f)
            ended.pop(pid, None)  # an earlier child's status under a pid now reused
            _answer(sock, ("pid", pid))


if __name__ == "__main__":
    main(int(sys.argv[1]))
    os._exit(0)  # nothing to tear down: the imports were only for the forks
