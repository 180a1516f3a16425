"""The offline benchmark: every batch size on every unit, measured honestly, stored as it goes.

Method (written into the code so no caller can skip it):
- warm-up first (at least `warmup_s` and 5 batches), excluded from every figure;
- each batch is timed from the start of its host→device copy to its outputs on the host, with
  the device synchronized before the clock is read; phases come from CUDA events;
- measurement goes on until both `min_duration_s` and `min_queries` (items) are reached — the
  MLPerf LoadGen validity rule — or `max_duration_s` passes, which makes the point invalid;
- with K instances, K runners (own stream, buffers and CUDA graph each) run in K threads from a
  common start; throughput is all items over the common window;
- a telemetry sampler (10 Hz by default) runs beside the whole sweep; each point's window gives
  its energy per item, mean and peak power, items/s per watt, per-unit utilisation and the
  validity flags of `infermux.telemetry.energy` (thermal/hardware slowdown, temperature at the
  slowdown point and other processes on the GPU make a point invalid);
- before timing, each point's runner is checked against the PyTorch fp32 reference on the same
  inputs (`infermux.agreement`); wrong results make the point invalid, loudly;
- a model of several inputs (token ids, masks, features) runs inputs generated from its spec
  (ids within the vocabulary, masks of ones) at each sequence length of `seq_buckets` (its
  default length without them); its points report tokens/s (items/s × length) beside items/s.

`engine="auto"` measures every engine usable here that supports the unit, side by side.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infermux import agreement
from infermux.engines import Runner, create_engine
from infermux.engines.base import DATA_PLACEMENTS, Engine, is_out_of_memory
from infermux.engines.select import engine_options, engines_for
from infermux.errors import DeviceOutOfMemoryError, InfermuxError, UsageError, first_line
from infermux.models import LoadedModel, ModelSpec, load_model
from infermux.progress import ProgressFn
from infermux.stats import LatencySummary, latency_summary_ms
from infermux.store import Sample, Store, recording
from infermux.telemetry import DEFAULT_INTERVAL_S, EnergySummary, Sampler, TelemetryWindow
from infermux.units import Unit, discover, select_units

__all__ = [
    "BatchLatency", "BenchConfig", "BenchPoint", "BenchReport", "Measurement", "PointEnergy",
    "check_runner", "engine_options", "engines_for", "measure",
    "measure_point", "run_bench",
]



@dataclass
class BenchConfig:
    """Everything that decides what a benchmark measures; stored with its results."""

    model: ModelSpec
    units: str = "cpu"
    batches: list[int] = field(default_factory=lambda: [1, 8, 64])
    engine: str = "torch"
    instances: int = 1
    data: str = "host"
    min_duration_s: float = 10.0
    min_queries: int = 1024
    warmup_s: float = 1.0
    max_duration_s: float | None = None
    options: dict[str, Any] = field(default_factory=dict)
    #: Telemetry sampling period; None turns the sampler off.
    telemetry_interval_s: float | None = DEFAULT_INTERVAL_S
    #: Check each point against the PyTorch fp32 reference (one small batch, before timing).
    check_agreement: bool = True
    #: Sequence lengths to measure a model with dynamic dims at (None: its default length).
    seq_buckets: list[int] | None = None

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise UsageError(f"--instances {self.instances} must be at least 1")
        if self.data not in DATA_PLACEMENTS:
            raise UsageError(f"--data {self.data!r} unknown: use host or device")
        if self.min_queries < 1:
            raise UsageError(f"--min-queries {self.min_queries} must be at least 1")
        if any(b <= 0 for b in self.batches):
            raise UsageError(f"batch sizes {self.batches} must all be at least 1")
        if self.seq_buckets is not None and (not self.seq_buckets
                                             or any(n <= 0 for n in self.seq_buckets)):
            raise UsageError(f"sequence lengths {self.seq_buckets} must all be at least 1")
        if self.max_duration_s is not None and self.max_duration_s < self.min_duration_s:
            raise UsageError(
                f"--max-duration {self.max_duration_s}s is shorter than --min-duration "
                f"{self.min_duration_s}s: raise it or drop it"
            )

    @property
    def deadline_s(self) -> float:
        """When a point stops even if its validity rule is not met."""
        return self.max_duration_s or max(60.0, 3 * self.min_duration_s)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {
            "model": {"ref": self.model.ref, "weights": self.model.weights,
                      "input_shape": list(self.model.input_shape or ())},
            "units": self.units, "batches": self.batches, "engine": self.engine,
            "instances": self.instances, "data": self.data,
            "min_duration_s": self.min_duration_s, "min_queries": self.min_queries,
            "warmup_s": self.warmup_s, "max_duration_s": self.deadline_s,
            "options": self.options, "telemetry_interval_s": self.telemetry_interval_s,
            "seq_buckets": self.seq_buckets,
        }


@dataclass
class Measurement:
    """Raw samples of one (unit, batch) point plus the setup that produced them."""

    model: str
    unit: str
    engine: str
    batch: int
    instances: int
    data: str
    min_duration_s: float
    min_queries: int
    samples: list[Sample] = field(default_factory=list)
    window_s: float = 0.0
    status: str = "ok"  # ok | oom | error | interrupted
    error: str | None = None
    build_s: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)
    weights_note: str = ""
    #: The measured window's telemetry and its summary (None when the sampler is off).
    telemetry: TelemetryWindow | None = field(default=None, repr=False)
    energy: EnergySummary | None = field(default=None, repr=False)
    #: The numerical agreement check (`infermux.agreement.Agreement.to_dict()`), None if not run.
    agreement: dict[str, Any] | None = None
    #: The sequence length of every item (a model with dynamic dims), None for fixed shapes.
    seq_len: int | None = None

    @property
    def items(self) -> int:
        """Items (queries, in offline terms) completed in the measured window."""
        return len(self.samples) * self.batch

    @property
    def throughput(self) -> float | None:
        """Items per second over the measured window."""
        return self.items / self.window_s if self.window_s > 0 and self.samples else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens (items × sequence length) per second, for a model with a sequence length."""
        rate = self.throughput
        return rate * self.seq_len if rate is not None and self.seq_len else None

    @property
    def validity(self) -> tuple[bool, str]:
        """(valid, why not): both the minimum duration and the minimum query count must hold."""
        if self.status != "ok":
            return False, f"{self.status}: {self.error or 'no measurement'}"
        if self.agreement is not None and self.agreement.get("status") == "fail":
            return False, f"WRONG RESULTS: {self.agreement.get('message')}"
        missing = []
        if self.window_s < self.min_duration_s:
            missing.append(f"ran {self.window_s:.2f}s < min duration {self.min_duration_s:g}s")
        if self.items < self.min_queries:
            missing.append(f"{self.items} items < min queries {self.min_queries}")
        if self.energy is not None:
            missing.extend(self.energy.invalid_flags)
        return (not missing), "; ".join(missing)

    @property
    def failed(self) -> bool:
        """True when the point measured nothing usable.

        It errored, ran out of memory, or its outputs disagree with the reference; an
        interrupted point is not a failure.
        """
        if self.status in ("error", "oom"):
            return True
        return self.agreement is not None and self.agreement.get("status") == "fail"

    def point(self) -> BenchPoint:
        """The point as stored and printed: setup, derived statistics, phase means."""
        valid, note = self.validity
        latency = latency_summary_ms([s.latency_ns for s in self.samples])
        phases: dict[str, float] = {}
        if self.samples:
            for phase in ("h2d", "compute", "d2h"):
                total = sum(getattr(s, f"{phase}_ns") for s in self.samples)
                phases[phase] = total / len(self.samples) / 1e6
        return BenchPoint(
            model=self.model, unit=self.unit, engine=self.engine, batch=self.batch,
            instances=self.instances, data=self.data, status=self.status, valid=valid,
            validity_note=note, items=self.items, window_s=self.window_s,
            items_per_s=self.throughput, build_s=self.build_s, options=self.options,
            error=self.error, weights_note=self.weights_note, agreement=self.agreement,
            seq_len=self.seq_len, tokens_per_s=self.tokens_per_s,
            latency=BatchLatency.from_dict(latency) if latency else None,
            h2d_ms=phases.get("h2d"), compute_ms=phases.get("compute"),
            d2h_ms=phases.get("d2h"),
            energy=(PointEnergy.from_dict(self.energy.record(self.items))
                    if self.energy is not None else None),
            sampler_cost=self.telemetry.cost.to_dict() if self.telemetry is not None else None,
        )


#: Percentiles of one batch's latency over a point's samples (`stats.LatencySummary`).
BatchLatency = LatencySummary


@dataclass(frozen=True, slots=True)
class PointEnergy:
    """What the telemetry sampler read over a point's measured window."""

    energy_j: float | None
    energy_per_item_j: float | None
    mean_power_w: float | None
    peak_power_w: float | None
    items_per_s_per_w: float | None
    energy_source: str | None
    energy_devices: list[str]
    energy_by_device_j: dict[str, float]
    #: Per device: utilisation, clocks, temperatures (`telemetry.DeviceSummary.to_dict()`).
    utilisation: dict[str, dict[str, Any]]
    #: Why the window's readings make the point invalid (slowdown, other processes, ...).
    telemetry_flags: list[str]
    telemetry_ticks: int

    def to_dict(self) -> dict[str, Any]:
        """The keys `telemetry.EnergySummary.record()` gives, in its order."""
        return {"energy_j": self.energy_j, "energy_per_item_j": self.energy_per_item_j,
                "mean_power_w": self.mean_power_w, "peak_power_w": self.peak_power_w,
                "items_per_s_per_w": self.items_per_s_per_w,
                "energy_source": self.energy_source, "energy_devices": self.energy_devices,
                "energy_by_device_j": self.energy_by_device_j, "utilisation": self.utilisation,
                "telemetry_flags": self.telemetry_flags, "telemetry_ticks": self.telemetry_ticks}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PointEnergy:
        """From `EnergySummary.record()` or a stored point carrying its keys."""
        return cls(data.get("energy_j"), data.get("energy_per_item_j"),
                   data.get("mean_power_w"), data.get("peak_power_w"),
                   data.get("items_per_s_per_w"), data.get("energy_source"),
                   list(data.get("energy_devices") or []),
                   dict(data.get("energy_by_device_j") or {}),
                   dict(data.get("utilisation") or {}),
                   list(data.get("telemetry_flags") or []), int(data.get("telemetry_ticks") or 0))


@dataclass(frozen=True, slots=True)
class BenchPoint:
    """One measured (unit, batch) point as stored and printed: setup and derived figures.

    Made by `Measurement.point()` from the raw samples; `to_dict()` is the stored JSON
    (`results.record_json`) and the `--json` entry, `from_dict()` reads it back (rows written
    by older versions too).
    """

    model: str
    unit: str
    engine: str
    batch: int
    instances: int
    data: str
    status: str  # ok | oom | error | interrupted
    valid: bool
    validity_note: str
    items: int
    window_s: float
    items_per_s: float | None
    build_s: float
    options: dict[str, Any]
    error: str | None
    weights_note: str
    #: The numerical agreement check (`infermux.agreement.Agreement.to_dict()`), None if not run.
    agreement: dict[str, Any] | None
    seq_len: int | None
    tokens_per_s: float | None
    #: One batch's latency over the samples; None when the point has none.
    latency: BatchLatency | None = None
    #: Mean per-batch phases (host→device copy, compute, device→host copy); None without samples.
    h2d_ms: float | None = None
    compute_ms: float | None = None
    d2h_ms: float | None = None
    energy: PointEnergy | None = None
    #: What the telemetry sampler itself cost (`telemetry.SamplerCost.to_dict()`).
    sampler_cost: dict[str, Any] | None = None

    @property
    def p99_ms(self) -> float | None:
        """One batch's 99th-percentile latency."""
        return self.latency.p99_ms if self.latency is not None else None

    @property
    def energy_per_item_j(self) -> float | None:
        """Energy per item over the window, where the sampler read energy."""
        return self.energy.energy_per_item_j if self.energy is not None else None

    @property
    def mean_power_w(self) -> float | None:
        """Mean power over the window, where the sampler read power."""
        return self.energy.mean_power_w if self.energy is not None else None

    def to_dict(self) -> dict[str, Any]:
        """The stored and printed form (the flat record older versions wrote, key for key)."""
        data: dict[str, Any] = {
            "model": self.model, "unit": self.unit, "engine": self.engine, "batch": self.batch,
            "instances": self.instances, "data": self.data, "status": self.status,
            "valid": self.valid, "validity_note": self.validity_note, "items": self.items,
            "window_s": self.window_s, "items_per_s": self.items_per_s,
            "build_s": self.build_s, "options": self.options, "error": self.error,
            "weights_note": self.weights_note, "agreement": self.agreement,
            "seq_len": self.seq_len, "tokens_per_s": self.tokens_per_s,
        }
        if self.latency is not None:
            data.update(self.latency.to_dict())
        for phase, value in (("h2d_ms", self.h2d_ms), ("compute_ms", self.compute_ms),
                             ("d2h_ms", self.d2h_ms)):
            if value is not None:
                data[phase] = value
        if self.energy is not None:
            data.update(self.energy.to_dict())
        if self.sampler_cost is not None:
            data["sampler_cost"] = self.sampler_cost
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchPoint:
        """A stored point (`to_dict()`'s output, or a row of `Store.run()`) as the type.

        Keys a row from an older version lacks take their neutral value; keys the store adds
        (`id`, `samples`, `raw_samples`) are not part of the point.
        """
        return cls(
            model=str(data["model"]), unit=str(data["unit"]), engine=str(data["engine"]),
            batch=int(data["batch"]), instances=int(data["instances"]), data=str(data["data"]),
            status=str(data["status"]), valid=bool(data["valid"]),
            validity_note=str(data.get("validity_note") or ""), items=int(data["items"]),
            window_s=float(data["window_s"]), items_per_s=data.get("items_per_s"),
            build_s=float(data.get("build_s") or 0.0), options=dict(data.get("options") or {}),
            error=data.get("error"), weights_note=str(data.get("weights_note") or ""),
            agreement=data.get("agreement"), seq_len=data.get("seq_len"),
            tokens_per_s=data.get("tokens_per_s"),
            latency=BatchLatency.from_dict(data) if "p50_ms" in data else None,
            h2d_ms=data.get("h2d_ms"), compute_ms=data.get("compute_ms"),
            d2h_ms=data.get("d2h_ms"),
            energy=PointEnergy.from_dict(data) if "telemetry_ticks" in data else None,
            sampler_cost=data.get("sampler_cost"),
        )


def measure(
    runners: list[Runner],
    *,
    min_duration_s: float,
    min_queries: int,
    warmup_s: float = 1.0,
    deadline_s: float = 60.0,
    progress: ProgressFn | None = None,
    label: str = "",
    on_window: Callable[[int, int], None] | None = None,
) -> tuple[list[Sample], float]:
    """Warm up, then run every runner in its own thread until the validity rule holds.

    Returns the samples of the measured window and its length in seconds. A KeyboardInterrupt
    stops the loop; the samples so far are attached to the exception as `samples`/`window_s`.
    `on_window(start_ns, end_ns)` receives the window on the `time.perf_counter_ns` clock
    (telemetry uses it to slice its series).
    """
    batch = runners[0].batch
    for runner in runners:
        warm_start = time.perf_counter()
        count = 0
        while count < 5 or time.perf_counter() - warm_start < warmup_s:
            runner.run()
            count += 1
    samples: list[Sample] = []
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    start_ns = time.perf_counter_ns()
    end_ns = [start_ns]

    def done(now_ns: int) -> bool:
        elapsed = (now_ns - start_ns) / 1e9
        return (elapsed >= min_duration_s and len(samples) * batch >= min_queries) or (
            elapsed >= deadline_s
        )

    def loop(instance: int, runner: Runner) -> None:
        try:
            while not stop.is_set():
                timing = runner.run()
                now = time.perf_counter_ns()
                with lock:
                    samples.append(Sample(instance, timing.latency_ns, timing.h2d_ns,
                                          timing.compute_ns, timing.d2h_ns))
                    end_ns[0] = max(end_ns[0], now)
                    if done(now):
                        stop.set()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=loop, args=(i, r), name=f"infermux-bench-{i}", daemon=True)
               for i, r in enumerate(runners[1:], start=1)]
    for thread in threads:
        thread.start()
    try:
        last_report = 0.0
        if len(runners) == 1:
            runner = runners[0]
            while not stop.is_set():
                timing = runner.run()
                now = time.perf_counter_ns()
                samples.append(Sample(0, timing.latency_ns, timing.h2d_ns, timing.compute_ns,
                                      timing.d2h_ns))
                end_ns[0] = now
                if done(now):
                    break
                if progress is not None and now / 1e9 - last_report > 0.1:
                    last_report = now / 1e9
                    progress(label, _fraction(now, start_ns, len(samples) * batch,
                                              min_duration_s, min_queries))
        else:
            loop_thread = threading.Thread(target=loop, args=(0, runners[0]), daemon=True)
            loop_thread.start()
            threads.append(loop_thread)
            while not stop.wait(0.1):
                if progress is not None:
                    with lock:
                        items = len(samples) * batch
                    progress(label, _fraction(time.perf_counter_ns(), start_ns, items,
                                              min_duration_s, min_queries))
    except KeyboardInterrupt as exc:
        stop.set()
        for thread in threads:
            thread.join(timeout=5)
        exc.samples = list(samples)  # type: ignore[attr-defined]
        exc.window_s = (end_ns[0] - start_ns) / 1e9  # type: ignore[attr-defined]
        raise
    stop.set()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    if on_window is not None:
        on_window(start_ns, end_ns[0])
    return samples, (end_ns[0] - start_ns) / 1e9


def _fraction(now_ns: int, start_ns: int, items: int, min_s: float, min_q: int) -> float:
    by_time = (now_ns - start_ns) / 1e9 / min_s if min_s > 0 else 1.0
    return max(0.0, min(1.0, by_time, items / min_q))


@dataclass
class BenchReport:
    """What `run_bench` returns: the run's id in the store and every measured point."""

    run_id: int | None
    model: LoadedModel
    units: list[Unit]
    measurements: list[Measurement]
    status: str  # complete | interrupted
    #: What the telemetry sampler read and what it could not (None when it was off).
    telemetry: dict[str, Any] | None = None

    @property
    def all_failed(self) -> bool:
        """True when there were points and every one of them failed (the command exits 1)."""
        return bool(self.measurements) and all(m.failed for m in self.measurements)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the run id, the model description and every point's record."""
        return {
            "run_id": self.run_id,
            "status": self.status,
            "model": self.model.describe(),
            "units": [u.id for u in self.units],
            "results": [m.point().to_dict() for m in self.measurements],
            "telemetry": self.telemetry,
        }


def run_bench(
    config: BenchConfig,
    *,
    store: Store | None = None,
    progress: ProgressFn | None = None,
    command: str = "",
) -> BenchReport:
    """Measure every (unit, batch) point of `config`; each point is stored as soon as it ends.

    A point that runs out of memory or fails is recorded with that status and the sweep goes
    on. Ctrl-C stores the point in progress as `interrupted` and ends the run with what it has.
    """
    found = discover()
    units = select_units(config.units, found)
    engines_for(config.engine, units)  # usage errors before the model is loaded
    model = load_model(config.model)
    lengths: list[int | None] = [None]
    if config.seq_buckets is not None:
        if not model.spec_io.dynamic_dims:
            raise UsageError(f"--seq {','.join(map(str, config.seq_buckets))}: {model.name!r} has "
                             "no dynamic dimension to set; drop --seq")
        lengths = list(config.seq_buckets)
    elif not model.spec_io.simple:
        model.spec_io.dims_for(None)  # a dynamic dim without a default size: one line, now
    plan = engines_for(config.engine, units, model)
    engines = {name: create_engine(name) for name in sorted({n for _, n in plan})}
    cfg = config.to_dict()
    cfg["resolved_units"] = [u.id for u in units]
    cfg["resolved_engines"] = [[u.id, n] for u, n in plan]
    cfg["model_description"] = model.describe()
    with recording(store, "bench", cfg, command) as rec:
        run_id = rec.run_id
        report = BenchReport(run_id, model, units, [], "complete")
        sampler = None
        if config.telemetry_interval_s is not None:
            sampler = Sampler.for_units(units, interval_s=config.telemetry_interval_s).start()
            report.telemetry = sampler.describe()
        reference: dict[int | None, agreement.Reference] = {}
        try:
            for unit, name in plan:
                for length, batch in ((n, b) for n in lengths for b in config.batches):
                    point = measure_point(config, name, engines[name], model, unit, batch,
                                          progress, reference, sampler, length=length)
                    report.measurements.append(point)
                    if store is not None and run_id is not None:
                        result_id = store.add_result(run_id, point.point(), point.samples)
                        if point.telemetry is not None:
                            store.add_telemetry(run_id, result_id, point.telemetry.rows())
                    if point.status == "interrupted":
                        raise KeyboardInterrupt
                engines[name].release()  # one (unit, engine) at a time holds memory
        except KeyboardInterrupt:
            report.status = "interrupted"
        finally:
            if sampler is not None:
                sampler.stop()
            rec.status = report.status
            rec.summary = {"points": len(report.measurements),
                           "valid": sum(1 for m in report.measurements if m.validity[0])}
            for engine in engines.values():
                engine.release()
    return report


References = dict[int | None, agreement.Reference] | list[agreement.Reference]


def check_runner(runner: Runner, model: LoadedModel,
                 reference: References) -> dict[str, Any]:
    """The point's agreement entry, against a reference computed on first use.

    One per sequence length in a dict; a list holds the one reference of a single length.
    """
    try:
        if isinstance(reference, list):
            if not reference:
                reference.append(agreement.reference_for(model, length=runner.length))
            ref = reference[0]
        else:
            if runner.length not in reference:
                reference[runner.length] = agreement.reference_for(model, length=runner.length)
            ref = reference[runner.length]
    except ImportError as exc:
        return agreement.skipped(runner, f"no reference runtime: {exc}").to_dict()
    return agreement.check(runner, ref).to_dict()


def measure_point(
    config: BenchConfig,
    engine_name: str,
    engine: Engine,
    model: LoadedModel,
    unit: Unit,
    batch: int,
    progress: ProgressFn | None,
    reference: References,
    sampler: Sampler | None = None,
    length: int | None = None,
) -> Measurement:
    """Build `instances` runners of `engine` for (unit, batch) and measure them as one point.

    Failures become the point's status (`oom`, `error`); only usage errors and Ctrl-C leave.
    """
    point = Measurement(
        model=model.name, unit=unit.id, engine=engine_name, batch=batch,
        instances=config.instances, data=config.data, min_duration_s=config.min_duration_s,
        min_queries=config.min_queries, weights_note=model.weights_note,
    )
    label = f"{unit.id} {engine_name} b{batch}" + (f" seq{length}" if length else "") + (
        f" ×{config.instances}" if config.instances > 1 else "")
    if progress is not None:
        progress(label, 0.0)
    try:
        options = engine_options(engine_name, config.options)
        runners = [
            engine.build(model, unit, batch, options, data=config.data, instance=i,
                         **({"length": length} if length is not None else {}))
            for i in range(config.instances)
        ]
        point.seq_len = runners[0].length
        point.build_s = sum(r.build_s for r in runners)
        point.options = runners[0].options
        window: list[int] = []
        if config.check_agreement:
            point.agreement = check_runner(runners[0], model, reference)
        point.samples, point.window_s = measure(
            runners, min_duration_s=config.min_duration_s, min_queries=config.min_queries,
            warmup_s=config.warmup_s, deadline_s=config.deadline_s, progress=progress,
            label=label, on_window=lambda t0, t1: window.extend((t0, t1)),
        )
        if sampler is not None and window:
            point.telemetry = sampler.window(window[0], window[1])
            point.energy = point.telemetry.summary([unit.telemetry_device])
    except KeyboardInterrupt as exc:
        point.status = "interrupted"
        point.error = "interrupted by the user"
        point.samples = getattr(exc, "samples", [])
        point.window_s = getattr(exc, "window_s", 0.0)
    except DeviceOutOfMemoryError as exc:
        point.status, point.error = "oom", str(exc)
    except InfermuxError as exc:
        if isinstance(exc, UsageError):
            raise
        point.status, point.error = "error", str(exc)
    except Exception as exc:  # noqa: BLE001 - one broken point must not end the sweep
        oom = is_out_of_memory(exc)
        point.status = "oom" if oom else "error"
        point.error = first_line(exc)
        if oom:
            engine.release()
    if progress is not None:
        progress(label, 1.0)
    return point
