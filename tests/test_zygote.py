"""Worker children forked from the template (`runtime.zygote`): what a fresh interpreter gave.

Real processes throughout: the template imports torch once and forks; each child must still
see the environment and directory of the moment it was asked for, end with a status its host
reads (the signal that killed it), and a setting libraries read at load time must get a
template of its own.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from infermux.errors import RunError
from infermux.runtime import zygote
from infermux.runtime._zygote import TEMPLATE_NAME, WORKER_NAME
from infermux.runtime.process_host import ProcessHost, RunnerSpec

_TINY = Path(__file__).parent / "tiny_models.py"  # absolute: one test changes directory
pytestmark = pytest.mark.skipif(not zygote.fork_enabled(), reason="workers are forked on Linux")


def _started(name: str = "m/cpu#0", factory: str = "tiny_cnn") -> ProcessHost:
    core = min(os.sched_getaffinity(0))
    spec = RunnerSpec("m", f"{_TINY}:{factory}", None, None, "torch", f"cpu:{core}", (1,), {},
                      "host", 0, 4, 0)
    host = ProcessHost(name, (core,), [spec], call_timeout_s=60.0)
    host.start()
    host.wait_ready()
    return host


def test_a_forked_worker_runs_in_the_callers_environment_and_reports_its_end(
        tmp_path, monkeypatch):
    # The switched network raises once the file its variable names says "fail": a child
    # started before the variable was set runs on, one started after it raises.
    switch = tmp_path / "switch"
    monkeypatch.delenv("INFERMUX_TEST_SWITCH", raising=False)
    host = _started(factory="switched_cnn")
    try:
        assert host.call("m", 1, [0]).latency_ns > 0
        child = psutil.Process(host.pid)
        assert child.name() == WORKER_NAME
        assert child.parent().name() == TEMPLATE_NAME  # forked, not a fresh interpreter
        assert host.exited() is None
        # Another child, asked for from another directory with the variable set: it has
        # both, from the same template (a variable no library reads at load time).
        template = child.parent().pid
        monkeypatch.setenv("INFERMUX_TEST_SWITCH", str(switch))
        monkeypatch.chdir(tmp_path)
        other = _started("m/cpu#1", factory="switched_cnn")
        try:
            second = psutil.Process(other.pid)
            assert second.cwd() == str(tmp_path) and second.parent().pid == template
            switch.write_text("fail")
            with pytest.raises(RunError, match="injected failure in the child"):
                other.call("m", 1, [0])
        finally:
            other.close()
        assert host.call("m", 1, [0]).latency_ns > 0  # the first child kept its environment
        # Killed: its host reads the signal, as it did from a process it had started itself.
        os.kill(host.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while host.exited() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host.exited() == -signal.SIGKILL
        assert "killed by SIGKILL" in host.death()
    finally:
        host.close()


def test_a_setting_read_at_load_time_gets_a_template_of_its_own(monkeypatch):
    host = _started()
    try:
        first = psutil.Process(host.pid).parent().pid
    finally:
        host.close()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # read by OpenMP when torch loads it
    host = _started()
    try:
        template = psutil.Process(host.pid).parent()
        assert template.pid != first and template.environ()["OMP_WAIT_POLICY"] == "PASSIVE"
        assert not psutil.pid_exists(first) or psutil.Process(first).status() == "zombie"
    finally:
        host.close()


def test_without_forking_a_worker_is_a_fresh_interpreter(monkeypatch):
    monkeypatch.setenv("INFERMUX_FORK_WORKERS", "0")
    host = _started()
    try:
        child = psutil.Process(host.pid)
        assert "infermux.runtime._child" in " ".join(child.cmdline())
        assert child.parent().pid == os.getpid()
        assert host.call("m", 1, [0]).latency_ns > 0
    finally:
        host.close()
    assert host.exited() == 0


def test_an_ended_child_not_yet_collected_reads_as_ended():
    """A zombie (ended, its status not collected, as under a first process that never reaps
    what is reparented to it) is not running; a live process is."""
    import subprocess as sp
    import sys

    child = sp.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while zygote._pid_running(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not zygote._pid_running(child.pid)  # ended, yet still ours to collect
    assert os.kill(child.pid, 0) is None  # signal 0 still finds it
    assert child.poll() == 0
    assert zygote._pid_running(os.getpid())
