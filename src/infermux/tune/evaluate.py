"""Trials: measuring a candidate plan for real, and remembering it in the store.

Two ways to measure, both real:

- `engine` — one config on one unit, timed in this process by the benchmark's `measure()`
  (warm-up excluded, device-synchronized, host→device copies counted): a runner per instance,
  built once per trial. Cheap (no worker processes to start), so the tuner's ladders use it.
  CPU configs with several instances are not measured this way: the runtime splits the cores
  between pinned processes, which threads in one process do not reproduce.
- `runtime` — the whole plan through `run_plan` under the offline scenario: the same workers,
  dispatcher and data path as `infermux run`. Every combination of units and the chosen plan are
  measured this way, because co-located units contend and solo figures do not add up.

Every trial is stored (`tune_trials`); a later tune on the same machine, model and trial
settings reuses it unless asked to measure afresh. Each trial leaves nothing built behind: its
runners and engine caches are released and, on a GPU, the allocator's cached memory returned
before the next one starts, so a long tune holds no more device memory than its largest trial.
"""

from __future__ import annotations

import gc
import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from infermux.errors import DeviceOutOfMemoryError, InfermuxError, UsageError
from infermux.models import LoadedModel, ModelSpec, load_model
from infermux.progress import ProgressFn
from infermux.runtime.plan import QUEUE_DELAY_MS
from infermux.store import Store
from infermux.tune.space import Candidate, Config
from infermux.units import Unit

__all__ = [
    "QUEUE_DELAY_MS",
    "Constraints",
    "Evaluator",
    "LiveEvaluator",
    "TableEvaluator",
    "Trial",
    "TrialSettings",
    "model_name",
]



def model_name(ref: str) -> str:
    """A plan-safe model name from a model reference (`path/net.py:make` → `net.make`)."""
    base = ref.rsplit("/", 1)[-1].removeprefix("timm:")
    base = re.sub(r"\.(py|onnx)(?=:|$)", "", base).replace(":", ".")
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", base)[:64] or "model"


@dataclass(frozen=True)
class TrialSettings:
    """How long each trial measures; part of the reuse key."""

    min_duration_s: float = 1.0
    min_queries: int = 64
    warmup_s: float = 0.3
    data: str = "host"
    #: Query lengths of models with a sequence length (`load.lengths`: 128, uniform:16-256,
    #: 32,64,128); None: each model's default length.
    lengths: str | None = None

    def __post_init__(self) -> None:
        if self.data not in ("host", "device"):
            raise UsageError(f"--data {self.data!r} unknown: use host or device")
        if self.lengths is not None:
            from infermux.load.samples import parse_lengths

            object.__setattr__(self, "lengths", parse_lengths(self.lengths).text)
        if self.min_duration_s <= 0:
            raise UsageError(f"--trial-duration {self.min_duration_s:g}s must be positive, "
                             "e.g. --trial-duration 2s")
        if self.min_queries < 1:
            raise UsageError(f"--trial-queries {self.min_queries} must be at least 1")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        data: dict[str, Any] = {"min_duration_s": self.min_duration_s,
                                "min_queries": self.min_queries, "warmup_s": self.warmup_s,
                                "data": self.data}
        if self.lengths is not None:  # absent otherwise: stored trials keep their reuse key
            data["lengths"] = self.lengths
        return data


@dataclass(frozen=True)
class Constraints:
    """Bounds a plan must hold; None means unbounded."""

    p99_bound_ms: float | None = None
    max_memory_bytes: int | None = None
    max_power_w: float | None = None

    def __post_init__(self) -> None:
        if self.p99_bound_ms is not None and self.p99_bound_ms <= 0:
            raise UsageError(f"--p99 {self.p99_bound_ms:g} ms must be positive, e.g. --p99 15ms")
        if self.max_memory_bytes is not None and self.max_memory_bytes <= 0:
            raise UsageError(f"--max-memory {self.max_memory_bytes} bytes must be positive, "
                             "e.g. --max-memory 8GiB")
        if self.max_power_w is not None and self.max_power_w <= 0:
            raise UsageError(f"--max-power {self.max_power_w:g} must be positive watts, "
                             "e.g. --max-power 300")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {"p99_bound_ms": self.p99_bound_ms, "max_memory_bytes": self.max_memory_bytes,
                "max_power_w": self.max_power_w}


@dataclass
class Trial:
    """One measured candidate: its figures, how it was measured and what it cost."""

    candidate: Candidate
    method: str  # engine | runtime
    status: str = "ok"  # ok | oom | error | invalid
    items_per_s: float | None = None
    #: The 99th percentile of one batch's latency (the worst config's), not a query's.
    p99_ms: float | None = None
    energy_per_item_j: float | None = None
    power_w: float | None = None
    memory_bytes: int | None = None
    #: Items per second of each unit inside this trial (what contention factors compare).
    per_unit: dict[str, float] = field(default_factory=dict)
    cost_s: float = 0.0
    reused: bool = False
    error: str | None = None
    record: dict[str, Any] = field(default_factory=dict, repr=False)
    #: Seconds spent building (engine runners, torch.compile, workers); part of `cost_s`.
    build_s: float | None = None

    @property
    def ok(self) -> bool:
        """Measured, valid and with a throughput."""
        return self.status == "ok" and self.items_per_s is not None

    def violations(self, constraints: Constraints) -> list[str]:
        """Why the trial breaks the constraints (empty when it holds them).

        The p99 bound is for queries of the server scenario: a query waits for the batch in
        service ahead of it and then for its own, so a batch must take at most half the bound.
        """
        out = []
        if not self.ok:
            out.append(f"{self.status}: {self.error or 'no measurement'}")
            return out
        bound = constraints.p99_bound_ms
        if bound is not None and (self.p99_ms is None or self.p99_ms > bound / 2):
            out.append(f"batch p99 {self.p99_ms:.1f} ms > half the bound ({bound / 2:g} ms)")
        cap = constraints.max_memory_bytes
        if cap is not None and self.memory_bytes is not None and self.memory_bytes > cap:
            out.append(f"memory {self.memory_bytes / 2**20:.0f} MiB > {cap / 2**20:.0f} MiB")
        watts = constraints.max_power_w
        if watts is not None and (self.power_w is None or self.power_w > watts):
            out.append(f"power {self.power_w} W > {watts:g} W")
        return out

    def to_dict(self, *, with_record: bool = False) -> dict[str, Any]:
        """The JSON-ready form: without the raw record for `--json`, with it for the store."""
        data: dict[str, Any] = {
            "plan": self.candidate.label(), "configs": [c.replica() | {"model": c.model}
                                                        for c in self.candidate.configs],
            "method": self.method, "status": self.status, "items_per_s": self.items_per_s,
            "p99_ms": self.p99_ms, "energy_per_item_j": self.energy_per_item_j,
            "power_w": self.power_w, "memory_bytes": self.memory_bytes,
            "per_unit": self.per_unit, "cost_s": self.cost_s, "build_s": self.build_s,
            "reused": self.reused, "error": self.error,
        }
        if with_record:
            data["record"] = self.record
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], candidate: Candidate) -> Trial:
        """A stored trial (`to_dict(with_record=True)`) of `candidate`, as the type.

        The candidate is the caller's (the store finds a trial by its candidate's key, and the
        stored `plan`/`configs` are only its description). Rows written before a trial kept
        its build time or raw record read with None and an empty record.
        """
        return cls(candidate, str(data["method"]), str(data["status"]), data.get("items_per_s"),
                   data.get("p99_ms"), data.get("energy_per_item_j"), data.get("power_w"),
                   data.get("memory_bytes"), dict(data.get("per_unit") or {}),
                   float(data.get("cost_s") or 0.0), bool(data.get("reused")), data.get("error"),
                   dict(data.get("record") or {}), data.get("build_s"))


class Evaluator(Protocol):
    """Measures candidates; the tuner's only window on the machine (injectable for tests)."""

    def evaluate(self, candidate: Candidate, method: str = "auto", *,
                 fresh: bool = False) -> Trial:
        """Measure `candidate`; `method` is `auto`, `engine` or `runtime`.

        `fresh`: measure now, whatever is stored, and store nothing (a check of the host).
        """
        ...


def can_engine(config: Config, units: dict[str, Unit],
               mixed_lengths: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether one config can be measured in this process faithfully.

    Not a model whose queries vary in length (`mixed_lengths`): an in-process trial runs one
    length, the runtime draws each query's own and batches them by length bucket.
    """
    unit = units.get(config.unit)
    return (unit is not None and not (unit.kind == "cpu" and config.instances > 1)
            and config.model not in mixed_lengths)


class TableEvaluator:
    """Answers from a function of the candidate: for replaying brute-force tables and for tests.

    `cost_s(candidate, method)` is the time each answer is said to cost; the tuner's budget
    counts it through the clock the tests inject.
    """

    def __init__(self, fn: Callable[[Candidate], Trial | None],
                 cost_s: Callable[[Candidate, str], float] | None = None,
                 on_cost: Callable[[float], None] | None = None) -> None:
        self.fn = fn
        self.cost = cost_s or (lambda _c, _m: 1.0)
        self.on_cost = on_cost
        self.calls: list[tuple[Candidate, str]] = []

    def evaluate(self, candidate: Candidate, method: str = "auto", *,
                 fresh: bool = False) -> Trial:
        """Look the candidate up; unknown candidates are `error` trials.

        `fresh` changes nothing: a table has no store.
        """
        used = "engine" if method == "auto" and candidate.solo else (
            "runtime" if method == "auto" else method)
        self.calls.append((candidate, used))
        cost = self.cost(candidate, used)
        if self.on_cost is not None:
            self.on_cost(cost)
        found = self.fn(candidate)
        if found is None:
            return Trial(candidate, used, status="error", error="not in the table", cost_s=cost)
        return replace(found, candidate=candidate, method=used, per_unit=dict(found.per_unit),
                       cost_s=cost, reused=False, record=dict(found.record))


class LiveEvaluator:
    """Measures for real on this machine and keeps every trial in the store."""

    def __init__(
        self,
        models: dict[str, ModelSpec],
        units: list[Unit],
        settings: TrialSettings,
        *,
        store: Store | None = None,
        run_id: int | None = None,
        fresh: bool = False,
        telemetry: bool = True,
        progress: ProgressFn | None = None,
        loaded: dict[str, LoadedModel] | None = None,
        seq_buckets: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.specs = models
        #: Per model with a sequence length, the buckets its plan compiles unless a config
        #: chooses others.
        self.seq_buckets = dict(seq_buckets or {})
        #: Models whose queries vary in length: measured through the runtime only.
        self.mixed_lengths = _mixed(settings.lengths, self.seq_buckets)
        self.units = {u.id: u for u in units}
        self.settings = settings
        self.store = store
        self.run_id = run_id
        self.fresh = fresh
        self.progress = progress
        self._models: dict[str, LoadedModel] = dict(loaded or {})
        self._engines: dict[str, Any] = {}
        #: Agreement references per model, by sequence length (computed on first need).
        self._references: dict[str, dict[int | None, Any]] = {}
        #: Per config computing below its unit's precision: why its outputs are wrong, or None.
        self._verdicts: dict[str, str | None] = {}
        self._sampler: Any = None
        self.power_devices: list[str] = []
        if telemetry:
            self._start_sampler(units)
        self.fingerprint = self._fingerprint()

    # -- setup ---------------------------------------------------------------------------------

    def _start_sampler(self, units: list[Unit]) -> None:
        from infermux.telemetry import Sampler

        try:
            self._sampler = Sampler.for_units(units, interval_s=0.1).start()
        except InfermuxError:
            self._sampler = None
            return
        self.power_devices = sorted(
            d for src in self._sampler.sources
            if src.name in ("nvml", "jetson") or getattr(src, "has_energy", False)
            for d in src.devices)

    def _fingerprint(self) -> str:
        import torch

        from infermux import __version__

        data = {
            "units": sorted((u.id, u.name) for u in self.units.values()),
            "models": {n: [s.ref, s.weights, list(s.input_shape or ())]
                       for n, s in sorted(self.specs.items())},
            "settings": self.settings.to_dict(), "torch": torch.__version__,
            "infermux": __version__,
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def model(self, name: str) -> LoadedModel:
        """The loaded model (loaded once)."""
        if name not in self._models:
            self._models[name] = load_model(self.specs[name])
        return self._models[name]

    def close(self) -> None:
        """Stop the sampler and free the engines' memory."""
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        self.release()

    def release(self) -> None:
        """Free what the last trial built: engine caches, runners and cached device memory.

        Called after every trial: a tune of many trials must not hold the runners of all of
        them (CUDA graphs, compiled modules, buffers) at once.
        """
        for engine in self._engines.values():
            engine.release()
        self._engines.clear()
        # Runners that a finished runtime left in reference cycles go now, so their device
        # memory is back in the allocator before its cache is emptied.
        gc.collect()
        _empty_device_cache()

    # -- measuring -----------------------------------------------------------------------------

    def evaluate(self, candidate: Candidate, method: str = "auto", *,
                 fresh: bool = False) -> Trial:
        """Measure `candidate` (or reuse the stored trial of the same candidate).

        `fresh`: measure it now and keep the figure out of the store (the search's check of
        the host's speed, `Tuner._check_speed`, must not become a figure later tunes reuse).
        """
        in_process = candidate.solo and can_engine(candidate.configs[0], self.units,
                                                   self.mixed_lengths)
        if method == "auto":
            method = "engine" if in_process else "runtime"
        if method == "engine" and not in_process:
            raise UsageError(f"{candidate.label()} cannot be measured in-process: use the runtime")
        key = f"{method}|{candidate.key()}"
        if not (self.fresh or fresh):
            old = self._stored(key)
            if old is not None:
                old.candidate = candidate
                return old
        started = time.perf_counter()
        try:
            trial = self._engine(candidate) if method == "engine" else self._runtime(candidate)
        finally:
            self.release()
        trial.cost_s = time.perf_counter() - started
        if not fresh:
            self._keep(key, trial)
        return trial

    def _stored(self, key: str) -> Trial | None:
        if self.store is None:
            return None
        found = self.store.tune_trial(self.fingerprint, key)
        if found is None:
            return None
        data, cost_s = found
        trial = replace(Trial.from_dict(data, Candidate(())), cost_s=0.0, reused=True)
        self._keep(key, trial, original_cost_s=cost_s)
        return trial

    def _keep(self, key: str, trial: Trial, original_cost_s: float | None = None) -> None:
        if self.store is None:
            return
        self.store.add_tune_trial(
            self.run_id, self.fingerprint, key, trial.candidate.label(),
            trial.to_dict(with_record=True),
            original_cost_s if original_cost_s is not None else trial.cost_s)

    def _engine(self, candidate: Candidate) -> Trial:
        from infermux import agreement
        from infermux.bench import BenchConfig, measure_point
        from infermux.engines import create_engine

        config = candidate.configs[0]
        unit = self.units[config.unit]
        model = self.model(config.model)
        engine = self._engines.setdefault(config.engine, create_engine(config.engine))
        options = config.replica()["options"]
        length = self._length(config)
        bench = BenchConfig(
            model=self.specs[config.model], units=unit.id, batches=[config.batch],
            engine=config.engine, instances=config.instances, data=self.settings.data,
            min_duration_s=self.settings.min_duration_s, min_queries=self.settings.min_queries,
            warmup_s=self.settings.warmup_s,
            max_duration_s=max(10.0, 4 * self.settings.min_duration_s),
            options=options, telemetry_interval_s=None,
            # Trials skip the agreement check (the engines' own precisions are checked by
            # bench), except where an option computes below the unit's precision (torch's
            # `precision: fp8`, LiteRT's int8): a fast wrong plan must not win.
            check_agreement=self._below_precision(config, unit))
        torch_device = _reset_peak_memory(unit)
        reference: dict[int | None, agreement.Reference] = self._references.setdefault(
            config.model, {})
        # A model of one query length runs at it (its one bucket); others have no length.
        point = measure_point(bench, config.engine, engine, model, unit, config.batch,
                              self._point_progress, reference, self._sampler, length=length)
        summary = point.point()
        if bench.check_agreement and summary.agreement:  # the runtime trials reuse the verdict
            self._verdicts[config.key()] = (
                None if summary.agreement.get("status") != "fail"
                else f"{config.label()}: {summary.agreement.get('message')}")
        status = summary.status
        if status == "ok" and not summary.valid:
            status = "invalid"
        rate = summary.items_per_s
        trial = Trial(candidate, "engine", status, rate if status == "ok" else None,
                      summary.p99_ms, summary.energy_per_item_j, summary.mean_power_w,
                      _peak_memory(torch_device),
                      {unit.id: rate} if status == "ok" and rate else {},
                      error=summary.error or (summary.validity_note or None),
                      record=summary.to_dict(), build_s=summary.build_s or None)
        return trial

    def _point_progress(self, label: str, fraction: float) -> None:
        if self.progress is not None:
            self.progress(label, fraction)

    def plan_dict(self, candidate: Candidate, *, load: dict[str, Any],
                  buckets: str = "none") -> dict[str, Any]:
        """The runtime Plan of `candidate` under `load`.

        Trials run `buckets: none` (their batches fill, and one runner per worker builds
        fastest); the written plan runs `pow2`, so a partial batch runs in a smaller bucket.
        """
        entries = [self._model_entry(name, [c for c in candidate.configs if c.model == name],
                                     buckets)
                   for name in sorted({c.model for c in candidate.configs})]
        if self.settings.lengths is not None and any("seq_buckets" in e for e in entries):
            load = {**load, "lengths": self.settings.lengths}
        return {"name": "tuned", "models": entries,
                "dispatcher": {"max_queue_delay_ms": QUEUE_DELAY_MS}, "load": load}

    def _model_entry(self, name: str, configs: list[Config], buckets: str) -> dict[str, Any]:
        """One model entry of the plan: its replicas, one per config."""
        spec = self.specs[name]
        entry: dict[str, Any] = {"name": name, "model": spec.ref, "replicas": [
            c.replica() | {"batch_buckets": buckets} for c in configs]}
        if spec.weights:
            entry["weights"] = spec.weights
        if spec.input_shape:
            entry["input_shape"] = list(spec.input_shape)
        # The model's sequence buckets: those its configs chose (all of them, where configs on
        # two units chose differently: one set per model entry), else its default.
        chosen = sorted({n for c in configs for n in (c.seq_buckets or ())})
        seq = chosen or list(self.seq_buckets.get(name, ()))
        if seq:
            entry["seq_buckets"] = seq
        return entry

    @staticmethod
    def _below_precision(config: Config, unit: Unit) -> bool:
        """Whether `config`'s options compute below its unit's precision (fp8, int8 options)."""
        return config.options_dict.get("precision", unit.mode) != unit.mode

    def _length(self, config: Config) -> int | None:
        """The one query length a trial of `config` runs at (its longest bucket), if any."""
        lengths = config.seq_buckets or self.seq_buckets.get(config.model)
        return max(lengths) if lengths else None

    def _agreement_refusal(self, candidate: Candidate) -> str | None:
        """Why a config of `candidate` computing below its unit's precision is wrong, if it is.

        A runtime trial runs no agreement check, so each such config not yet checked by an
        in-process trial is built once here and checked against the fp32 reference (the
        verdict kept per config) before its plan runs.
        """
        from infermux.bench import check_runner, engine_options
        from infermux.engines import create_engine

        for config in candidate.configs:
            unit = self.units[config.unit]
            if not self._below_precision(config, unit):
                continue
            key = config.key()
            if key not in self._verdicts:
                engine = self._engines.setdefault(config.engine, create_engine(config.engine))
                model = self.model(config.model)
                length = self._length(config)
                try:
                    runner = engine.build(model, unit, config.batch,
                                          engine_options(config.engine, config.options_dict),
                                          data=self.settings.data,
                                          **({"length": length} if length is not None else {}))
                    found = check_runner(runner, model,
                                         self._references.setdefault(config.model, {}))
                except InfermuxError as exc:
                    if isinstance(exc, UsageError):
                        raise
                    found = {"status": "fail", "message": str(exc)}
                finally:
                    engine.release()
                self._verdicts[key] = (None if found.get("status") != "fail" else
                                       f"{config.label()}: {found.get('message')}")
            if self._verdicts[key] is not None:
                return self._verdicts[key]
        return None

    def _runtime(self, candidate: Candidate) -> Trial:
        from infermux.runtime import run_plan
        from infermux.runtime.plan import parse_plan

        refusal = self._agreement_refusal(candidate)
        if refusal is not None:
            return Trial(candidate, "runtime", "invalid", error=f"WRONG RESULTS: {refusal}")
        s = self.settings
        plan = parse_plan(self.plan_dict(candidate, load={
            "scenario": "offline", "min_duration_s": s.min_duration_s,
            "min_queries": s.min_queries, "data": s.data,
            "max_duration_s": max(10.0, 4 * s.min_duration_s)}), source="tuner plan")
        marks: dict[str, int] = {}

        def progress(label: str, fraction: float) -> None:
            if label == "built":
                marks["t0"] = time.perf_counter_ns()
            if self.progress is not None:
                self.progress(f"{candidate.label()}: {label}", fraction)

        try:
            report = run_plan(plan, progress=progress)
        except InfermuxError as exc:
            if isinstance(exc, UsageError):
                raise
            status = "oom" if isinstance(exc, DeviceOutOfMemoryError) else "error"
            return Trial(candidate, "runtime", status, error=str(exc))
        t1 = time.perf_counter_ns()
        summary = report.final
        if summary is None:
            return Trial(candidate, "runtime", "error", error="the plan ran no trial")
        workers = list(summary.workers.values())
        failed = summary.failed_workers
        status = "ok" if summary.valid and not failed else "invalid"
        if failed:
            status = "oom" if any(w.status == "oom" for w in failed) else "error"
        per_unit: dict[str, float] = {}
        if status == "ok":
            for w in workers:
                unit = self._candidate_unit(w.unit, candidate)
                per_unit[unit] = per_unit.get(unit, 0.0) + (w.items_per_s or 0.0)
        # A batch's latency, as the engine trials measure it: from its launch to its outputs.
        # (The runtime's compute phase starts at the take, which for a worker that gathers the
        # next batch while one runs includes the batch ahead of it.)
        batch_p99 = [w.batch_p99_ms for w in workers]
        error = summary.failures()
        rec = summary.to_dict()
        trial = Trial(candidate, "runtime", status,
                      summary.items_per_s if status == "ok" else None,
                      max((c for c in batch_p99 if c is not None), default=None),
                      per_unit=per_unit,
                      error=error or ("; ".join(summary.validity_notes) or None),
                      record={k: rec.get(k) for k in ("duration_s", "completed_items",
                                                       "latency", "valid", "validity_notes")},
                      build_s=report.build.get("build_s"))
        if self._sampler is not None and "t0" in marks and trial.items_per_s:
            window = self._sampler.window(marks["t0"], t1)
            devices = sorted({self.units[u].telemetry_device for u in candidate.units})
            energy = window.summary(devices).record(summary.completed_items)
            trial.energy_per_item_j = energy.get("energy_per_item_j")
            trial.power_w = energy.get("mean_power_w")
        return trial


    def _candidate_unit(self, worker_unit: str, candidate: Candidate) -> str:
        """The candidate's unit a runtime worker ran on (a CPU worker runs on a share of it)."""
        if worker_unit in candidate.units or not worker_unit.startswith("cpu"):
            return worker_unit
        from infermux.units import parse_core_set

        cores = set(parse_core_set(worker_unit[4:])) if worker_unit.startswith("cpu:") else set()
        for unit_id in candidate.units:
            unit = self.units.get(unit_id)
            if unit is not None and unit.kind == "cpu" and cores <= set(unit.cores):
                return unit_id
        return worker_unit


def _mixed(lengths: str | None, seq_buckets: dict[str, tuple[int, ...]]) -> frozenset[str]:
    """The models with a sequence length whose queries do not all have one length."""
    if lengths is None:
        return frozenset()
    from infermux.load.samples import parse_lengths

    spread = parse_lengths(lengths)
    return frozenset(seq_buckets) if spread.low != spread.high else frozenset()


def _empty_device_cache() -> None:
    """Return the CUDA allocator's cached blocks to the device (no-op without CUDA in use)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _reset_peak_memory(unit: Unit) -> Any:
    if unit.kind != "cuda":
        return None
    import torch

    device = torch.device(unit.device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return device


def _peak_memory(device: Any) -> int | None:
    if device is None:
        return None
    import torch

    return int(torch.cuda.max_memory_allocated(device))
