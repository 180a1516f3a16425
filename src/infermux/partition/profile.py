"""Profiles for balancing: segments timed on each unit, crossing tensors moved between units.

Everything at the stage batch size and for real.

Method: a segment is built by the torch engine like any model (`create_engine("torch").build`) and
run until `min_time_s` and `min_runs` both hold, after the engine's warm-up; its time is the median
of the engine's compute phase (CUDA events on GPUs, wall clock on CPUs, on the unit's cores).
Then the whole model is timed on each unit alone and on all units at once (threads, each on its
unit): pieces timed one by one run with warm caches and without neighbours, so their sum
underestimates a stage in a running pipeline. `Profile.scale` (whole model with every unit busy
÷ sum of its pieces alone) corrects each unit's piece times for both; the raw times are kept.
A transfer is timed as the pipeline performs it (`transfer.copy_into`, issued by the consumer),
median of `min_runs` copies after one untimed copy. Profiles are taken one at a time, alone: they
say nothing about contention, which is why the best candidates are then measured as pipelines.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infermux.engines import create_engine
from infermux.errors import UsageError
from infermux.models import LoadedModel
from infermux.models.graph import TensorInfo
from infermux.models.segments import Segment, segment_model
from infermux.partition.dp import placement
from infermux.progress import ProgressFn
from infermux.runtime.transfer import HOST, alloc, copy_into, dtype_of, pin_thread, stream_for
from infermux.units import Unit

__all__ = ["Profile", "profile_segments", "time_transfer"]



@dataclass
class Profile:
    """Seconds per batch of `batch` items: compute per (unit, piece), transfer per link.

    `transfer_s[(src, dst)][b]` is the time to move boundary `b`'s tensor(s) from `src`'s memory
    into `dst`'s input buffer, `src == dst` being the producer's copy into its own output buffer;
    `src` is `host` for the input (b = 0), `dst` is `host` for the outputs (b = n).
    """

    batch: int
    boundaries: list[str]
    units: list[str]
    compute_s: dict[str, list[float]] = field(default_factory=dict)
    transfer_s: dict[tuple[str, str], dict[int, float]] = field(default_factory=dict)
    bytes_per_item: list[int] = field(default_factory=list)
    whole_alone_s: dict[str, float] = field(default_factory=dict)
    whole_together_s: dict[str, float] = field(default_factory=dict)

    def scale(self, unit: str, *, alone: bool = False) -> float:
        """Whole model with all units busy (or alone) ÷ the sum of `unit`'s pieces.

        1 when the whole model was not timed.
        """
        whole = (self.whole_alone_s if alone else self.whole_together_s).get(unit)
        pieces = sum(self.compute_s[unit])
        return whole / pieces if whole and pieces > 0 else 1.0

    @property
    def pieces(self) -> int:
        """Number of atomic segments (boundaries − 1)."""
        return len(self.boundaries) - 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (transfer keys as `src>dst`)."""
        return {
            "batch": self.batch, "boundaries": self.boundaries, "units": self.units,
            "compute_s": self.compute_s, "bytes_per_item": self.bytes_per_item,
            "whole_alone_s": self.whole_alone_s, "whole_together_s": self.whole_together_s,
            "scale": {u: self.scale(u) for u in self.compute_s},
            "transfer_s": {f"{s}>{d}": {str(b): t for b, t in v.items()}
                           for (s, d), v in self.transfer_s.items()},
        }


def _shapes(infos: list[TensorInfo], batch: int) -> list[tuple[int, ...]]:
    return [(batch, *i.shape) for i in infos]


def time_transfer(
    src: Unit | None, dst: Unit | None, shapes: list[tuple[int, ...]], *, runs: int = 5
) -> float:
    """Median seconds to copy tensors of `shapes` from `src`'s memory into `dst`'s buffers.

    `None` stands for the host. The copy runs on `dst`'s cores or stream (the consumer pulls),
    except a copy into the host, which the producer `src` issues.
    """
    issuer = dst if dst is not None else src
    sources = [alloc(src, s) for s in shapes]
    for t in sources:
        t.normal_()
    targets = [alloc(dst, s, dtype_of(dst)) for s in shapes]
    stream = stream_for(issuer)
    times: list[float] = []
    with pin_thread(issuer):
        for i in range(runs + 1):
            start = time.perf_counter()
            for target, source in zip(targets, sources, strict=True):
                copy_into(target, source, stream)
            if i:  # the first copy warms caches and the allocator
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_runner(runner: Any, unit: Unit, min_time_s: float, min_runs: int) -> float:
    times: list[int] = []
    started = time.perf_counter()
    with pin_thread(unit):
        while len(times) < min_runs or time.perf_counter() - started < min_time_s:
            times.append(runner.run().compute_ns)
    return statistics.median(times) / 1e9


def _time_together(runners: list[Any], units: list[Unit], min_time_s: float,
                   min_runs: int, engines: list[str] | None = None) -> list[float]:
    """Median seconds per batch of each runner while all run at once, each on its unit."""
    results: list[float] = [0.0] * len(runners)
    errors: list[BaseException] = []
    start = threading.Barrier(len(runners))

    def loop(i: int) -> None:
        try:
            start.wait()
            engine = engines[i] if engines else "torch"
            results[i] = _time(runners[i], units[i], engine, min_time_s, min_runs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(len(runners))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _time_compute(runner: Any, unit: Unit, min_time_s: float, min_runs: int) -> float:
    """Median seconds of `runner.compute(x)` from a tensor in the unit's memory.

    That is what a stage of another engine than torch costs in a pipeline, the hand-off to and
    from torch tensors included.
    """
    x = alloc(unit, (runner.batch, *runner.input_shape), dtype_of(None))
    x.normal_()
    times: list[int] = []
    started = time.perf_counter()
    with pin_thread(unit):
        runner.compute(x)  # one untimed call: first-call allocations
        while len(times) < min_runs or time.perf_counter() - started < min_time_s:
            t0 = time.perf_counter_ns()
            runner.compute(x)
            times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e9


def _time(runner: Any, unit: Unit, engine: str, min_time_s: float, min_runs: int) -> float:
    if engine == "torch":
        return _time_runner(runner, unit, min_time_s, min_runs)
    return _time_compute(runner, unit, min_time_s, min_runs)


def profile_segments(
    model: LoadedModel,
    segments: list[Segment],
    units: list[Unit],
    batch: int,
    *,
    options: dict[str, Any] | None = None,
    engines: Sequence[str] = ("torch",),
    min_time_s: float = 0.2,
    min_runs: int = 3,
    progress: ProgressFn | None = None,
) -> Profile:
    """Time every segment on every (unit, engine) and every crossing tensor between units.

    Compute is keyed by placement (`cpu:0` for torch, `cpu:0@openvino`, see `dp.placement`);
    `options` go to the torch engine. Under contention (all units at once) only each unit's first
    engine is timed; the others' whole-model times are scaled by that unit's measured slow-down.
    """
    built = {name: create_engine(name) for name in engines}
    placed = [(u, e) for u in units for e in engines if built[e].supports(u)]
    if not placed:
        raise UsageError(f"no engine of {list(engines)} runs on {[u.id for u in units]}")
    boundaries = ["input", *(s.end for s in segments)]
    profile = Profile(batch, boundaries, [placement(u.id, e) for u, e in placed])
    profile.bytes_per_item = [segments[0].input.bytes_per_item] + [
        sum(o.bytes_per_item for o in s.outputs) for s in segments
    ]
    n = len(segments)
    steps = len(placed) * n + 1
    done = 0

    def opts(engine: str) -> dict[str, Any] | None:
        return options if engine == "torch" else None

    try:
        for unit, name in placed:
            engine = built[name]
            times = []
            for index, segment in enumerate(segments):
                if progress is not None:
                    progress(f"profile {placement(unit.id, name)} {segment.name}", done / steps)
                runner = engine.build(segment_model(model, segment, index), unit, batch, opts(name),
                                      data="device")
                times.append(_time(runner, unit, name, min_time_s, min_runs))
                runner.close()
                done += 1
            profile.compute_s[placement(unit.id, name)] = times
            engine.release()
        if progress is not None:
            progress("profile the whole model alone and on all units at once", done / steps)
        for unit, name in placed:
            runner = built[name].build(model, unit, batch, opts(name), data="device")
            profile.whole_alone_s[placement(unit.id, name)] = _time(runner, unit, name, min_time_s,
                                                                    min_runs)
            runner.close()
        first: dict[str, tuple[Unit, str]] = {}
        for unit, name in placed:
            first.setdefault(unit.id, (unit, name))
        runners = [built[e].build(model, u, batch, opts(e), data="device", instance=i + 1)
                   for i, (u, e) in enumerate(first.values())]
        together = _time_together(runners, [u for u, _ in first.values()], 2 * min_time_s,
                                  min_runs, [e for _, e in first.values()])
        for runner in runners:
            runner.close()
        slow: dict[str, float] = {}
        for (unit, name), t in zip(first.values(), together, strict=True):
            alone = profile.whole_alone_s[placement(unit.id, name)]
            slow[unit.id] = t / alone if alone > 0 else 1.0
        profile.whole_together_s = {placement(u.id, e): profile.whole_alone_s[placement(u.id, e)]
                                    * slow[u.id] for u, e in placed}
    finally:
        for engine in built.values():
            engine.release()
    if progress is not None:
        progress("profile transfers", done / steps)
    for unit in units:
        profile.transfer_s[(HOST, unit.id)] = {
            0: time_transfer(None, unit, _shapes([segments[0].input], batch))}
        profile.transfer_s[(unit.id, HOST)] = {
            n: time_transfer(unit, None, _shapes(segments[-1].outputs, batch))}
        for other in units:
            profile.transfer_s[(unit.id, other.id)] = {
                b: time_transfer(unit, other, _shapes(segments[b - 1].outputs, batch))
                for b in range(1, n)
            }
    if progress is not None:
        progress("profiled", 1.0)
    return profile
