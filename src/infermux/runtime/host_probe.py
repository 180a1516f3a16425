"""How quickly the host hands work over, between threads and to the device: beside a peak search.

A server trial's latency holds every hand-over between the runtime's threads (the load
generator, the dispatcher, the workers, completion) and every wait on the device. Where the
host is slow to wake a sleeping thread or to return from a device wait, each query pays it
several times, and the p99 bound breaks at a fraction of the offline rate whatever the plan:
on some GPU hosts every plan of a ResNet50 server tune, plain eager among them, broke a
15 ms bound above 1-5k queries/s, where on others the tuned plan held 0.94 of its offline rate.

`probe_host` measures, in well under a second:
- `wake`: a thread woken by another through a `threading.Event` after it slept (the other
  thread waits 0.5 ms between rounds, so the woken one has gone idle), round trip;
- `sleep_overshoot`: how late a 0.5 ms sleep returns;
- `device_wait` (a CUDA device only, when torch has already initialised CUDA): a tiny matmul
  launched and its event waited on, every 0.5 ms; `device_wait_after_idle` the same after the
  device has been left idle for 20 ms (a light server load leaves such gaps between batches);
- the share of CPU time stolen by the hypervisor (`/proc/stat`, Linux) over the probe.

`host_note` turns a probe into a sentence when a figure's p99 is over a tenth of the bound
(the share at which the load generator's lag is flagged too, `load.scenarios.LAG_SHARE`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from infermux.load.scenarios import LAG_SHARE
from infermux.stats import latency_summary_ms

__all__ = ["HostProbe", "describe_probes", "host_note", "plan_cuda_device", "probe_host",
           "search_note"]

#: The gap between rounds: long enough that the woken thread has gone to sleep.
GAP_S = 0.0005


#: Each figure's key, its name in a line of figures and in a note.
FIGURES = (("wake", "thread wake-up", "a sleeping thread's wake-up"),
           ("sleep_overshoot", "sleep overshoot", "a 0.5 ms sleep's overshoot"),
           ("device_wait", "device wait", "a tiny kernel's launch and wait"),
           ("device_wait_after_idle", "after 20 ms idle", "the same after 20 ms idle"))


def _summary(ns: list[int]) -> dict[str, float] | None:
    """`stats.latency_summary_ms` of the samples, with their count; None without any."""
    return {"n": len(ns), **latency_summary_ms(ns)} if ns else None


@dataclass
class HostProbe:
    """Latency summaries (ms) of the host's hand-overs, and the hypervisor's steal share."""

    seconds: float
    wake: dict[str, float] | None = None
    sleep_overshoot: dict[str, float] | None = None
    device_wait: dict[str, float] | None = None
    device_wait_after_idle: dict[str, float] | None = None
    device: str | None = None
    steal_pct: float | None = None
    loadavg_1m: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def _wake_round_trips(seconds: float) -> list[int]:
    ping, pong = threading.Event(), threading.Event()
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            if ping.wait(0.05):
                ping.clear()
                pong.set()

    thread = threading.Thread(target=answer, name="infermux-host-probe", daemon=True)
    thread.start()
    out: list[int] = []
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            time.sleep(GAP_S)
            t0 = time.perf_counter_ns()
            ping.set()
            if not pong.wait(1.0):
                break
            out.append(time.perf_counter_ns() - t0)
            pong.clear()
    finally:
        stop.set()
        ping.set()
        thread.join(1.0)
    return out


def _sleep_overshoots(seconds: float) -> list[int]:
    out: list[int] = []
    want = int(GAP_S * 1e9)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter_ns()
        time.sleep(GAP_S)
        out.append(max(0, time.perf_counter_ns() - t0 - want))
    return out


#: The idle gap before each of `device_wait_after_idle`'s rounds, and how many rounds.
IDLE_GAP_S = 0.02
IDLE_ROUNDS = 10


def _device_waits(device: str, seconds: float, gap_s: float = GAP_S,
                  rounds: int | None = None) -> list[int]:
    import torch

    out: list[int] = []
    with torch.cuda.device(device):  # the event on this device's stream, not device 0's
        x = torch.ones((64, 64), device=device)
        event = torch.cuda.Event()
        torch.cuda.synchronize(device)
        end = time.perf_counter() + seconds
        while (time.perf_counter() < end) if rounds is None else (len(out) < rounds):
            time.sleep(gap_s)
            t0 = time.perf_counter_ns()
            torch.mm(x, x)  # the launch is what is timed
            event.record()
            event.synchronize()
            out.append(time.perf_counter_ns() - t0)
    return out


def _cpu_times() -> list[int] | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def probe_host(seconds: float = 0.2, device: str | None = None) -> HostProbe:
    """Measure the host's thread wake-ups, sleeps and (on a CUDA device) device waits.

    `seconds` per figure. The device is probed only where torch has initialised CUDA already
    (a runtime's GPU workers have): the probe never starts a CUDA context of its own.
    """
    before = _cpu_times()
    t0 = time.perf_counter()
    probe = HostProbe(seconds=0.0)
    probe.wake = _summary(_wake_round_trips(seconds))
    probe.sleep_overshoot = _summary(_sleep_overshoots(seconds))
    if device is not None and device.startswith("cuda"):
        import sys

        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            probe.device = device
            probe.device_wait = _summary(_device_waits(device, seconds))
            probe.device_wait_after_idle = _summary(
                _device_waits(device, seconds, gap_s=IDLE_GAP_S, rounds=IDLE_ROUNDS))
    probe.seconds = time.perf_counter() - t0
    after = _cpu_times()
    if before is not None and after is not None and len(after) > 7:
        spent = [b - a for a, b in zip(before, after, strict=False)]
        total = sum(spent)
        probe.steal_pct = 100.0 * spent[7] / total if total > 0 else 0.0
    if hasattr(os, "getloadavg"):
        probe.loadavg_1m = os.getloadavg()[0]
    return probe


#: A figure whose p99 is over this share of the bound is named (as the load generator's lag).
NOTE_SHARE = LAG_SHARE


def host_note(probe: HostProbe | dict[str, Any], bound_ms: float | None) -> str | None:
    """A sentence where the host's hand-overs take a noticeable share of the bound, else None."""
    data = probe.to_dict() if isinstance(probe, HostProbe) else probe
    if bound_ms is None or bound_ms <= 0:
        return None
    said = []
    for key, _, what in FIGURES:
        figure = data.get(key)
        if figure and figure["p99_ms"] > NOTE_SHARE * bound_ms:
            said.append(f"{what} p99 {figure['p99_ms']:.2f} ms")
    steal = data.get("steal_pct")
    if steal is not None and steal >= 5.0:
        said.append(f"{steal:.0f}% of the CPU time stolen by the hypervisor")
    if not said:
        return None
    return ("the host is slow to hand work over (" + "; ".join(said) + f", against a "
            f"{bound_ms:g} ms bound): each query pays such hand-overs several times, so "
            "this host's peak says as much about the host as about the plan")


def search_note(before: HostProbe, after: HostProbe, bound_ms: float | None) -> str | None:
    """The note of a peak search's probes: the later one that found the host slow, if any."""
    said = [n for n in (host_note(before, bound_ms), host_note(after, bound_ms)) if n]
    return said[-1] if said else None


def plan_cuda_device(plan: Any) -> str | None:
    """The first CUDA device a plan's replicas run on (the probe's device), if any."""
    for model in getattr(plan, "models", ()):
        for replica in getattr(model, "replicas", None) or ():
            unit = str(getattr(replica, "unit", ""))
            if unit.startswith("cuda"):
                return unit.split("/")[0]
    return None


def describe_probes(probes: dict[str, Any]) -> str:
    """One line of named probes' p99s (`{"before": probe, "after": probe}` as recorded)."""
    parts = []
    for key, what, _ in FIGURES:
        got = [f"{p[key]['p99_ms'] * 1e3:.0f}" for p in probes.values() if p and p.get(key)]
        if got:
            parts.append(f"{what} p99 {' / '.join(got)} µs")
    steal = [f"{p['steal_pct']:.1f}" for p in probes.values()
             if p and p.get("steal_pct") is not None]
    if steal:
        parts.append(f"stolen CPU {' / '.join(steal)}%")
    return ", ".join(parts) or "not measured"
