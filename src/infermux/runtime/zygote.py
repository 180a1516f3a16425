"""Worker processes forked from a warm template instead of started as fresh interpreters.

A process-hosted CPU worker (`runtime.process_host`) used to be a fresh `python -m
infermux.runtime._child`: every start imported torch and the engines again, 2.5–4 s of a core on
a 2-core machine, paid by every run, every tuner trial of a CPU plan and every restart of a
failed worker. The template (`runtime._zygote`, started once per process that hosts workers)
imports those modules once and then only forks: a child starts with them already imported.

The template does nothing but import and fork: it starts no thread of its own, no OpenMP
region, initialises no CUDA and runs no operator, so a fork of it is as clean as a fresh
interpreter (PyTorch's own data loader workers are forks of a process that imported torch; the
one thread numpy's BLAS starts at import is made safe across a fork by that library itself).
Each child gets the environment and working directory of the moment it is asked for, and a new
session, as the fresh interpreter did. Variables that libraries read once, when they are
loaded (OpenMP's, the CUDA and allocator settings, `PYTHONPATH`), are part of the template's
identity: asking with other values starts a new template rather than handing a child libraries
set up for the old ones.

The template reaps its children and keeps their exit statuses; `ForkedChild` asks it for them,
so the host reads a forked child's end (an exit code, or the signal that killed it) as it
reads a `subprocess.Popen`'s. Where no template can start (not Linux, or its start fails), or
with `INFERMUX_FORK_WORKERS=0`, children are fresh interpreters as before.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["ForkedChild", "fork_enabled", "spawn_child"]

#: Environment variables read when a library is loaded (so a fork inherits the template's
#: values): a child asked for with other values gets a template of its own.
_LOAD_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "CUDA_", "PYTORCH_",
                       "TORCH_", "NVIDIA_", "LD_", "MALLOC_", "PYTHON")
#: How long a template may take to import torch and the engines before it is given up on.
_READY_TIMEOUT_S = 120.0

_lock = threading.Lock()
_template: _Template | None = None
#: The identity of a template that failed to start: not tried again for the same settings.
_failed: tuple[Any, ...] | None = None


def fork_enabled() -> bool:
    """Whether workers are forked from a template (Linux, unless `INFERMUX_FORK_WORKERS=0`)."""
    return (sys.platform.startswith("linux") and hasattr(socket, "send_fds")
            and os.environ.get("INFERMUX_FORK_WORKERS", "1") != "0")


def _identity(env: dict[str, str]) -> tuple[Any, ...]:
    loaded = tuple(sorted((k, v) for k, v in env.items() if k.startswith(_LOAD_TIME_PREFIXES)))
    return sys.executable, tuple(sys.path), loaded


class _Template:
    """The template process and the socket this process talks to it over."""

    def __init__(self, env: dict[str, str]) -> None:
        self.identity = _identity(env)
        #: The process that started it: a fork of that process must not share its socket.
        self.owner = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "infermux.runtime._zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, start_new_session=True,
                stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.sock = ours
        self.sock.settimeout(_READY_TIMEOUT_S)
        self._lock = threading.Lock()
        try:
            self._ask(("hello",))  # the template answers once its imports are done
        except BaseException:
            self.close()
            raise
        self.sock.settimeout(30.0)

    def _ask(self, msg: tuple[Any, ...], fds: tuple[int, ...] = ()) -> Any:
        with self._lock:
            data = pickle.dumps(msg)
            header = len(data).to_bytes(4, "little")
            payload = header + data
            # The descriptors go with the first bytes; whatever one send left follows.
            sent = socket.send_fds(self.sock, [payload], list(fds)) if fds else 0
            self.sock.sendall(payload[sent:])
            size = int.from_bytes(_read(self.sock, 4), "little")
            return pickle.loads(_read(self.sock, size))

    def spawn(self, fds: tuple[int, int], env: dict[str, str], cwd: str) -> int:
        reply = self._ask(("spawn", env, cwd), fds)
        if reply[0] != "pid":
            raise _ForkFailedError(reply[1])
        return int(reply[1])

    def status(self, pid: int) -> int | None:
        return self._ask(("status", pid))[1]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Close the socket: the template exits (its children run on, reaped by the system)."""
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _ForkFailedError(OSError):
    """The template is well but its fork failed (out of processes or memory)."""


def _read(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise EOFError("the worker template closed its socket")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _template_for(env: dict[str, str]) -> _Template | None:
    """The running template for `env`, started (or replaced) as needed; None if none starts."""
    global _template, _failed
    with _lock:
        current = _template
        if current is not None and current.owner != os.getpid():
            current = _template = None  # this process is a fork: the template is its parent's
        if current is not None and (current.identity != _identity(env) or not current.alive()):
            current.close()
            current = _template = None
        if current is None:
            if _failed == _identity(env):
                return None
            try:
                current = _template = _Template(env)
            except (OSError, EOFError, pickle.UnpicklingError):
                _failed = _identity(env)
                return None
        return current


class ForkedChild:
    """A child forked by the template, read as a `subprocess.Popen` is: pid, poll, wait, kill.

    Its exit status comes from the template, which reaps it.
    """

    def __init__(self, template: _Template, pid: int) -> None:
        self._template = template
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once ended (negative: the signal that ended it), else None."""
        if self.returncode is None:
            try:
                self.returncode = self._template.status(self.pid)
            except (OSError, EOFError):
                # The template is gone, and its record of the status with it: the pid says
                # whether the child still runs, and an end whose status is lost reads as 1.
                if not _pid_running(self.pid):
                    self.returncode = 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; `subprocess.TimeoutExpired` past `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.002
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker process {self.pid}", timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return code

    def kill(self) -> None:
        """SIGKILL, unless it has already ended (its pid is then not ours to signal)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _pid_running(pid: int) -> bool:
    """Whether `pid` runs: a zombie (ended, its status not yet collected) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A child whose template went away is reparented to the container's first process, which
    # may never collect it: signal 0 still finds it, /proc says it has ended.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def spawn_child(read_fd: int, write_fd: int, env: dict[str, str]
                ) -> subprocess.Popen[bytes] | ForkedChild:
    """A worker child reading batches from `read_fd` and answering on `write_fd`.

    Forked from the template where it can be; else a fresh interpreter
    (`python -m infermux.runtime._child`). The caller closes its copies of the two ends.
    """
    template = _template_for(env) if fork_enabled() else None
    if template is not None:
        try:
            return ForkedChild(template, template.spawn((read_fd, write_fd), env, os.getcwd()))
        except _ForkFailedError:
            pass  # this fork failed; a fresh interpreter may still start
        except (OSError, EOFError, pickle.UnpicklingError):
            template.close()  # a broken template is replaced at the next start
    return subprocess.Popen(
        [sys.executable, "-m", "infermux.runtime._child", str(read_fd), str(write_fd)],
        pass_fds=(read_fd, write_fd), env=env,
        # The parent handles Ctrl-C and ends the children itself.
        start_new_session=True,
    )
