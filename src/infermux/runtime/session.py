"""Running a Plan: resolve units, build workers, drive the load, summarise, store.

`run_plan(plan)` is the library entry point the CLI, the tuner and the benchmarks call. It
builds every worker once; a peak search reuses them for all its trials.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infermux.engines import Runner, create_engine
from infermux.errors import InfermuxError, RunError, UsageError
from infermux.load.base import CompletionFn, Query, QuerySampleLibrary
from infermux.load.scenarios import LoadGenerator, ScenarioResult, find_peak
from infermux.models import LoadedModel, ModelSpec, load_model
from infermux.progress import ProgressFn
from infermux.runtime.api import LocalRuntime
from infermux.runtime.dispatcher import Batch, Dispatcher, WorkerState, failure_kind
from infermux.runtime.inputs import build_bucket_runners, item_length, length_group
from infermux.runtime.metrics import Recorder, TrialSummary, summarise
from infermux.runtime.pipelined import PipelineWorker, build_pipeline, pipeline_buckets
from infermux.runtime.placement import LatencyEstimate, ModelLoad, rebalance
from infermux.runtime.plan import Plan, Replica, options_for_bucket, parse_plan
from infermux.runtime.worker import ProcessHost, RunnerSpec, Worker
from infermux.store import Recording, Store, recording
from infermux.units import Discovery, Unit, discover, select_units
from infermux.units.cpu import split_cores

__all__ = ["RunReport", "RuntimeSUT", "WorkerPlan", "bucket_options", "layout_workers", "run_plan",
           "start_runtime", "with_load"]

#: Trial t numbers its queries from t << _TRIAL_ID_BITS: ranges of trials never overlap.
_TRIAL_ID_BITS = 40


@dataclass
class WorkerPlan:
    """One instance of a replica: its name, unit (a core share for CPU) and hosting."""

    id: int
    name: str
    model: str
    model_index: int
    replica_index: int
    replica: Replica
    unit: Unit
    cores: tuple[int, ...]
    hosting: str  # thread | process


def layout_workers(plan: Plan, found: Discovery) -> list[WorkerPlan]:
    """Resolve every replica's unit on this machine and give each instance its share.

    A CPU replica's cores are split between its instances (disjoint, never oversubscribed).
    Errors name the plan field.
    """
    workers: list[WorkerPlan] = []
    for mi, entry in enumerate(plan.models):
        for ri, rep in enumerate(entry.replicas):
            where = f"models[{mi}].replicas[{ri}]"
            try:
                unit = select_units([rep.unit], found)[0]
            except UsageError as exc:
                raise UsageError(f"plan field {where}.unit: {exc}") from None
            try:
                engine = create_engine(rep.engine)
            except UsageError as exc:
                raise UsageError(f"plan field {where}.engine: {exc}") from None
            if not engine.supports(unit):
                raise UsageError(
                    f"plan field {where}.engine: {rep.engine!r} cannot run on {unit.id!r}; "
                    f"it runs {', '.join(engine.unit_kinds)} units"
                )
            if unit.kind == "cpu":
                if rep.instances > len(unit.cores):
                    raise UsageError(
                        f"plan field {where}.instances: {rep.instances} instances on {unit.id} "
                        f"({len(unit.cores)} usable cores) would oversubscribe it"
                    )
                shares = split_cores(unit.cores, rep.instances)
            else:
                shares = [()] * rep.instances
            for i, cores in enumerate(shares):
                wunit = unit
                if cores:
                    mode = "" if unit.mode == "fp32" else f"/{unit.mode}"
                    wunit = select_units(["cpu:" + "+".join(str(c) for c in cores) + mode],
                                         found)[0]
                hosting = (plan.dispatcher.cpu_workers if unit.kind == "cpu" else "thread")
                workers.append(WorkerPlan(
                    len(workers), f"{entry.name}/{wunit.id}#{i}", entry.name, mi, ri, rep, wunit,
                    tuple(cores), hosting,
                ))
    return workers


def _sample_library(plan: Plan, index: int, model: LoadedModel) -> QuerySampleLibrary:
    """Model `index`'s sample library (`runtime.inputs.sample_library`), checked against the plan."""
    from infermux.runtime.inputs import check_declared_inputs, sample_library

    entry = plan.models[index]
    where = f"models[{index}]"
    if entry.inputs is not None:
        check_declared_inputs(model.spec_io, entry.inputs, where)
    if entry.stages and not model.spec_io.simple:
        raise UsageError(f"plan field {where}.stages: {entry.model!r} takes several inputs "
                         f"({', '.join(t.name for t in model.spec_io.inputs)}); pipeline stages "
                         "run models of one float input: use replicas")
    return sample_library(entry.name, model, plan.load.sample_pool, plan.load.seed,
                          entry.seq_buckets, plan.load.lengths, where)


def bucket_options(replica: Replica, bucket: int) -> dict[str, Any]:
    """Engine options of one bucket's runner (`runtime.plan.options_for_bucket`)."""
    return options_for_bucket(replica.options, replica.buckets(), bucket)


def with_load(plan: Plan, **changes: Any) -> Plan:
    """A copy of `plan` with load settings changed (None values ignored), validated again."""
    data = plan.to_dict()
    data["load"].update({k: v for k, v in changes.items() if v is not None})
    return parse_plan(data, source="plan (with command-line overrides)")


class RuntimeSUT:
    """The runtime as a LoadGen system under test: queries in, completions out."""

    def __init__(self, dispatcher: Dispatcher, groups: dict[str, int] | None = None) -> None:
        self.dispatcher = dispatcher
        #: Length buckets per model batched by length: the backlog holds that many times more,
        #: so each bucket's batches can fill (batches take one bucket's items).
        self.groups = groups or {}

    def start(self, on_complete: CompletionFn) -> None:
        """Report completions to the load generator."""
        self.dispatcher.set_completion(on_complete)

    def issue(self, queries: Sequence[Query]) -> None:
        """Queue the queries' samples."""
        self.dispatcher.submit(queries)

    def capacity_items(self, model: str) -> int:
        """Items the live workers of `model` can hold at once."""
        return self.groups.get(model, 1) * sum(
            w.batch * w.depth for w in self.dispatcher.workers.values()
            if w.alive and (w.model == model or model in w.serves))

    def end(self) -> None:
        """Flush partial batches: no more queries will come."""
        self.dispatcher.end()


@dataclass
class RunReport:
    """What `run_plan` returns: the stored run id, status, every trial's record."""

    run_id: int | None
    plan: Plan
    status: str  # complete | interrupted | failed
    trials: list[dict[str, Any]] = field(default_factory=list)
    peak: dict[str, Any] | None = None
    build: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def final(self) -> dict[str, Any] | None:
        """The trial that answers the question: the last one, or the peak's best valid one."""
        if self.peak is not None and self.peak.get("peak_qps") is not None:
            # A repeated rate above the peak may have passed once: the peak's own trials answer.
            best = [t for t in self.trials if t.get("scenario") == "server" and t.get("valid")
                    and t.get("rate_qps") == self.peak["peak_qps"]]
            if best:
                return max(best, key=lambda t: t.get("rate_qps") or 0)
        return self.trials[-1] if self.trials else None

    @property
    def summary(self) -> TrialSummary:
        """The final trial, typed (empty when no trial ran)."""
        return TrialSummary.from_record(self.final)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"run_id": self.run_id, "status": self.status, "error": self.error,
                "plan": self.plan.to_dict(), "build": self.build, "peak": self.peak,
                "result": self.final, "trials": self.trials}


class _Runtime:
    """The built machinery of one plan: dispatcher, workers, hosts, sample libraries."""

    def __init__(self, plan: Plan, progress: ProgressFn | None) -> None:
        self.plan = plan
        self.progress = progress
        d = plan.dispatcher
        self.dispatcher = Dispatcher(
            [m.name for m in plan.models],
            max_queue_delay_ns=int(d.max_queue_delay_ms * 1e6),
            latency_bound_ns={m.name: int(m.latency_bound_ms * 1e6) if m.latency_bound_ms
                              else None for m in plan.models},
            deadline_ns={m.name: int((m.latency_bound_ms or plan.load.p99_bound_ms or 0) * 1e6)
                         for m in plan.models},
            batching=d.batching,
            policy=d.policy,
            max_retries=d.max_retries,
            dynamic=plan.placement == "dynamic",
        )
        self.recorder = Recorder()
        self.dispatcher.on_batch_done = self.recorder.on_batch_done
        self.workers: list[Worker] = []
        self.pipelines: list[PipelineWorker] = []
        self.states: list[WorkerState] = []
        self.hosts: list[ProcessHost] = []
        self.engines: dict[str, Any] = {}
        self.models: dict[str, LoadedModel] = {}
        self.qsl: dict[str, QuerySampleLibrary] = {}
        #: Sample pools shared by this process's workers (one per model, dtype and device).
        self.pools: dict[tuple[str, tuple[str, ...]], Any] = {}
        self.build_errors: dict[str, str] = {}
        self._placer: threading.Thread | None = None
        self._placer_stop = threading.Event()
        #: What `build()` returned (set by `start_runtime`).
        self.build_info: dict[str, Any] = {}
        #: By worker id: its layout, its thread, its process host (what a restart rebuilds).
        self.worker_plans: dict[int, WorkerPlan] = {}
        self.worker_by_id: dict[int, Worker] = {}
        self.host_by_id: dict[int, ProcessHost] = {}
        #: By pipeline worker id: its model entry's index and the units found (a restart
        #: builds the pipeline again from them).
        self.pipeline_plans: dict[int, tuple[int, Discovery]] = {}

    def _note(self, label: str, fraction: float) -> None:
        if self.progress is not None:
            self.progress(label, fraction)

    def build(self) -> dict[str, Any]:
        started = time.perf_counter()
        plan = self.plan
        needs_runtimes = any(not r.unit.startswith(("cpu", "cuda")) for m in plan.models
                             for r in m.replicas)
        found = discover(with_runtimes=needs_runtimes)
        layout = layout_workers(plan, found)
        for mi, entry in enumerate(plan.models):
            self._note(f"loading {entry.name}", mi / len(plan.models))
            try:
                self.models[entry.name] = load_model(ModelSpec(
                    entry.model, entry.weights,
                    tuple(entry.input_shape) if entry.input_shape else None))
            except UsageError as exc:
                raise UsageError(f"plan field models[{mi}].model: {exc}") from None
            self.qsl[entry.name] = _sample_library(plan, mi, self.models[entry.name])
        if any(q.io is not None and q.max_length is not None for q in self.qsl.values()):
            self.recorder.tokens_of = self._tokens
        for name, qsl in self.qsl.items():
            group = length_group(qsl)
            if group is not None:
                self.dispatcher.group_of[name] = group
        dynamic = plan.placement == "dynamic"
        # Child processes first: they build in parallel with this process's runners.
        for wp in layout:
            if wp.hosting != "process":
                continue
            host = ProcessHost(wp.name, wp.cores, self._specs(wp),
                               depth=plan.dispatcher.cpu_in_flight)
            host.start()
            self.hosts.append(host)
            self.host_by_id[wp.id] = host
        cpu_taken = {c for wp in layout for c in wp.cores}
        host_cores = tuple(c for c in sorted(os.sched_getaffinity(0)) if c not in cpu_taken)
        feeders = sum(1 for wp in layout if wp.unit.kind != "cpu")
        feeder_threads = max(1, len(host_cores) // max(1, feeders))
        hosts = iter(self.hosts)
        built_s: dict[str, float] = {}
        for i, wp in enumerate(layout):
            self.worker_plans[wp.id] = wp
            self._note(f"building {wp.name}", i / max(1, len(layout)))
            serves = {wp.model} if not dynamic else {m.name for m in plan.models}
            runners: dict[str, dict[int, Runner]] = {}
            error: str | None = None
            failure: str | None = None
            if wp.hosting == "process":
                host = next(hosts)
                try:
                    host.wait_ready()
                    runners = host.runners()
                except InfermuxError as exc:
                    error, failure = str(exc), failure_kind(exc)
            else:
                engine = self.engines.setdefault(wp.replica.engine,
                                                 create_engine(wp.replica.engine))
                for name in sorted(serves):
                    try:
                        runners[name] = build_bucket_runners(
                            engine, self.models[name], wp.unit, wp.replica.buckets(),
                            functools.partial(bucket_options, wp.replica), plan.load.data,
                            wp.id, self.qsl[name].seq_lengths)
                    except UsageError:
                        raise
                    except InfermuxError as exc:
                        if name == wp.model:
                            error, failure = str(exc), failure_kind(exc)
                            break
            built_s[wp.name] = sum(r.build_s for rs in runners.values() for r in rs.values())
            asynchronous = any(r.asynchronous for rs in runners.values() for r in rs.values())
            state = WorkerState(
                wp.id, wp.name, wp.unit.id, wp.model, wp.replica.buckets(),
                set(runners) if not error else {wp.model},
                LatencyEstimate(plan.dispatcher.estimate_alpha), depth=2 if asynchronous else 1,
            )
            if error is not None:
                state.alive = False
                state.error, state.failure = error, failure
                self.build_errors[wp.name] = error
            else:
                self._prime(state, runners)
            self.dispatcher.add_worker(state)
            self.states.append(state)
            if error is None:
                cores = wp.cores if wp.hosting == "thread" else ()
                threads = len(wp.cores) if wp.cores and wp.hosting == "thread" else None
                if wp.unit.kind != "cpu":
                    cores, threads = host_cores, feeder_threads
                self.workers.append(Worker(
                    state, runners, {m: self.qsl[m].data for m in runners}, self.dispatcher,
                    cores=cores, threads=threads, pools=self.pools,
                    just_in_time=plan.dispatcher.gpu_take == "just_in_time"))
                self.worker_by_id[wp.id] = self.workers[-1]
        pipe_rows = self._build_pipelines(found)
        for entry in plan.models:
            if not any(s.alive and s.model == entry.name for s in self.states):
                errors = "; ".join(self.build_errors.values()) or "no worker"
                raise RunError(f"no worker of model {entry.name!r} could be built: {errors}")
        self._note("built", 1.0)
        return {"build_s": time.perf_counter() - started, "runner_build_s": built_s,
                "workers": [{"worker": s.name, "unit": s.unit, "model": s.model,
                             "hosting": wp.hosting, "cores": list(wp.cores),
                             "buckets": s.buckets, "error": s.error}
                            for s, wp in zip(self.states, layout, strict=False)] + pipe_rows,
                "host_cores": list(host_cores)}

    def _tokens(self, batch: Batch) -> int:
        """Tokens of a batch's items at their own lengths (0 for a model without a length)."""
        qsl = self.qsl.get(batch.model)
        if qsl is None or qsl.io is None or qsl.max_length is None:
            return 0
        rows = batch.rows()
        if rows is None:
            return int(qsl.data.tokens(batch.samples))
        total = 0
        for row in rows:  # a served item: one array per input
            total += item_length(qsl.io, list(row)) or 0
        return total

    def _specs(self, wp: WorkerPlan) -> list[RunnerSpec]:
        """What a process-hosted worker's child builds: its model (every model, dynamic)."""
        plan = self.plan
        entries = [m for m in plan.models if plan.placement == "dynamic" or m.name == wp.model]
        return [RunnerSpec(
            m.name, m.model, m.weights, tuple(m.input_shape) if m.input_shape else None,
            wp.replica.engine, wp.unit.id, tuple(wp.replica.buckets()), wp.replica.options,
            plan.load.data, wp.id, plan.load.sample_pool, plan.load.seed,
            tuple(m.seq_buckets) if m.seq_buckets else None, plan.load.lengths)
            for m in entries]

    def can_restart(self, worker_id: int) -> bool:
        """Whether `restart_worker` can bring this worker back (replicas and pipelines)."""
        return worker_id in self.worker_plans or worker_id in self.pipeline_plans

    def restart_worker(self, worker_id: int, timeout_s: float = 300.0) -> None:
        """Bring a failed worker back into service; raises RunError when it cannot.

        A process-hosted worker gets a new child process (built like the first); a thread
        worker keeps its runners. Either way every runner must run one batch of the sample
        library before the worker takes requests again. A pipeline is built again from its
        model entry, stages and all.
        """
        if worker_id in self.pipeline_plans:
            self._restart_pipeline(worker_id)
            return
        state = self.dispatcher.workers[worker_id]
        wp = self.worker_plans.get(worker_id)
        old = self.worker_by_id.get(worker_id)
        if wp is None or old is None:
            raise RunError(f"worker {state.name} is not restartable (only replica workers are)")
        old.join(30)  # out of service: its thread leaves at its next look at the queue
        if old.thread.is_alive():
            raise RunError(f"worker {state.name}: its thread did not stop, so it is not restarted")
        runners = old.runners
        if wp.hosting == "process":
            previous = self.host_by_id.get(worker_id)
            if previous is not None:
                previous.close(timeout_s=2.0)
            host = ProcessHost(wp.name, wp.cores, self._specs(wp),
                               depth=self.plan.dispatcher.cpu_in_flight)
            host.start()
            if previous is not None and previous in self.hosts:
                self.hosts[self.hosts.index(previous)] = host
            else:
                self.hosts.append(host)
            self.host_by_id[worker_id] = host
            host.wait_ready(timeout_s)
            runners = host.runners()
        for model, per in runners.items():
            for bucket, runner in per.items():
                try:
                    runner.gather_input(runner.prepare_pool(self.qsl[model].data[:1]),
                                        [0] * bucket)
                    runner.run()
                except Exception as exc:  # noqa: BLE001 - the restart failed, with its reason
                    raise RunError(f"worker {state.name}: its {model} runner at batch {bucket} "
                                   f"failed its check after the restart: {exc}") from None
        new = Worker(state, runners, old.samples, self.dispatcher, cores=old.cores,
                     threads=old.threads, pools=self.pools, just_in_time=old.just_in_time)
        self.workers[self.workers.index(old)] = new
        self.worker_by_id[worker_id] = new
        self.dispatcher.revive(state)
        new.start()

    def _restart_pipeline(self, worker_id: int) -> None:
        state = self.dispatcher.workers[worker_id]
        mi, found = self.pipeline_plans[worker_id]
        entry = self.plan.models[mi]
        old = next((p for p in self.pipelines if p.state.id == worker_id), None)
        if old is not None:
            old.join(30)  # out of service: its feeder leaves at its next look at the queue
            if old.thread.is_alive():
                raise RunError(f"worker {state.name}: its feeder did not stop, so it is not "
                               "restarted")
            old.close()  # its stages stop; what it held was failed back to the dispatcher
        try:
            pipeline = build_pipeline(entry, self.models[entry.name], found, f"models[{mi}]")
        except InfermuxError as exc:
            raise RunError(f"worker {state.name}: the pipeline could not be built again: "
                           f"{exc}") from None
        new = PipelineWorker(state, pipeline, self.qsl[entry.name].data, self.dispatcher)
        if old is not None:
            self.pipelines[self.pipelines.index(old)] = new
        else:
            self.pipelines.append(new)
        self.dispatcher.revive(state)
        new.start()

    def _build_pipelines(self, found: Discovery) -> list[dict[str, Any]]:
        """One pipeline worker per model entry with `stages:` (its stages on their units)."""
        rows = []
        for mi, entry in enumerate(self.plan.models):
            if not entry.stages:
                continue
            self._note(f"building the {entry.name} pipeline", 0.9)
            name = f"{entry.name}/pipeline"
            started = time.perf_counter()
            error: str | None = None
            failure: str | None = None
            try:
                pipeline = build_pipeline(entry, self.models[entry.name], found, f"models[{mi}]")
            except UsageError:
                raise
            except InfermuxError as exc:
                error, pipeline, failure = str(exc), None, failure_kind(exc)
            units = "|".join("+".join(s.units) for s in entry.stages)
            first = entry.stages[0]
            # Batches it may hold: as many as its first stage's copies have input buffers.
            depth = max(2, first.buffers * len(first.units) * first.instances
                        * entry.pipeline_replicas)
            state = WorkerState(
                len(self.states), name, units, entry.name, pipeline_buckets(entry),
                {entry.name}, LatencyEstimate(self.plan.dispatcher.estimate_alpha), depth=depth)
            if pipeline is None:
                state.alive, state.error, state.failure = False, error, failure
                self.build_errors[name] = error or ""
            self.dispatcher.add_worker(state)
            self.states.append(state)
            self.pipeline_plans[state.id] = (mi, found)
            if pipeline is not None:
                self.pipelines.append(PipelineWorker(
                    state, pipeline, self.qsl[entry.name].data, self.dispatcher))
            rows.append({"worker": name, "unit": units, "model": entry.name, "hosting": "pipeline",
                         "cores": [c for s in entry.stages for c in s.cores()],
                         "buckets": state.buckets, "error": error,
                         "stages": entry.describe_stages(),
                         "build_s": time.perf_counter() - started})
        return rows

    def _prime(self, state: WorkerState, runners: dict[str, dict[int, Runner]]) -> None:
        """Seed the latency estimates from the build's warm-up: timed runs per model and bucket."""
        for model, per in runners.items():
            for bucket, runner in per.items():
                with contextlib.suppress(Exception):  # a failing runner fails in the run, visibly
                    runner.gather_input(runner.prepare_pool(self.qsl[model].data[:1]),
                                        [0] * bucket)
                    for _ in range(2):
                        state.estimate.update(bucket, runner.run().latency_ns, model)

    def start(self) -> None:
        for worker in self.workers:
            worker.start()
        for pipe in self.pipelines:
            pipe.start()
        if self.plan.placement == "dynamic":
            self._placer = threading.Thread(target=self._place_loop, name="infermux-placement",
                                            daemon=True)
            self._placer.start()

    def _place_loop(self) -> None:
        d = self.dispatcher
        while not self._placer_stop.wait(self.plan.placement_interval_s):
            with d.cond:
                now = d.clock_ns()
                loads = []
                for name in d.models:
                    live = [w for w in d.workers.values() if w.alive and w.model == name]
                    cap = 0.0
                    for w in live:
                        est = w.estimate.expected_ns(w.batch, name)
                        cap += w.batch / (est / 1e9) if est > 0 else 0.0
                    loads.append(ModelLoad(name, d.queued(name), [w.id for w in live], cap))
                idle = {w.id: (now - w.free_since_ns) / 1e9 for w in d.workers.values()
                        if w.alive and w.in_flight == 0}
                can = {w.id: set(w.serves) for w in d.workers.values()}
            move = rebalance(loads, idle, can)
            if move is not None:
                d.move(move.worker, move.dst, reason="queue growing while this worker idled")

    def run_trial(self, settings: dict[str, Any], shares: dict[str, float],
                  mix: list[dict[str, Any]] | None) -> tuple[ScenarioResult, dict[str, Any]]:
        # A trial starts from empty queues and zeroed counters (what an earlier trial left is
        # dropped, its late batches go unreported) and numbers its queries in a range of its
        # own, so nothing of an earlier trial can be credited to this one.
        dropped = self.dispatcher.begin_trial()
        self.recorder.reset()
        for pipe in self.pipelines:
            pipe.begin_window()
        gen = LoadGenerator(settings, shares, mix=mix, progress=self.progress,
                            id_base=self.dispatcher.trial << _TRIAL_ID_BITS)
        pools = {m: q.count for m, q in self.qsl.items()}
        groups = {m: len(q.seq_lengths) for m, q in self.qsl.items()
                  if m in self.dispatcher.group_of}
        result = gen.run(RuntimeSUT(self.dispatcher, groups), pools)
        record = summarise(result, list(self.recorder.records), self.states, {},
                           events=list(self.dispatcher.events))
        record["settings"] = settings
        if self.pipelines:
            record["pipelines"] = {p.state.model: p.stage_stats() for p in self.pipelines}
            for pipe in self.pipelines:
                row = record.get("workers", {}).get(pipe.state.name)
                if row is not None:
                    # Batches overlap in a pipeline: its busiest stage is its utilisation.
                    row["utilisation"] = max((st["busy"] for st in record["pipelines"][
                        pipe.state.model]), default=None)
        with self.dispatcher.cond:  # this trial's own counts (begin_trial zeroed them)
            record["retried_items"] = self.dispatcher.retried
            record["failed_items"] = self.dispatcher.failed_items
        record["dropped_from_earlier_trial"] = dropped
        return result, record

    def shutdown(self, *, now: bool) -> None:
        self._placer_stop.set()
        if now:
            self.dispatcher.stop()
        else:
            self.dispatcher.close()
        for worker in self.workers:
            worker.join(30)
        for pipe in self.pipelines:
            if now:
                pipe.close()  # stop the stages: what is in flight stays unfinished
            pipe.join(60)  # closed dispatcher: the feeder ends and the stages drain
            if not now:
                pipe.close()
        for host in self.hosts:
            host.close()
        for engine in self.engines.values():
            with contextlib.suppress(Exception):
                engine.release()


def start_runtime(plan: Plan, *, progress: ProgressFn | None = None,
                  record_batches: bool = True) -> LocalRuntime:
    """Build and start `plan`'s workers with no load generator attached (for a server).

    The caller drives it through the `Runtime` protocol (`infermux.runtime.api`): submit
    queries (with `Query.inputs` to get outputs back), subscribe to outputs and completions,
    and `stop(drain=True)` (finish what is queued) or `drain=False`. `record_batches` keeps
    every batch's record for a trial's summary (a server that runs for days passes False).
    """
    rt = _Runtime(plan, progress)
    try:
        rt.build_info = rt.build()
        rt.start()
    except BaseException:
        rt.shutdown(now=True)
        raise
    return LocalRuntime(rt, record_batches=record_batches)


def run_plan(
    plan: Plan,
    *,
    store: Store | None = None,
    progress: ProgressFn | None = None,
    command: str = "",
) -> RunReport:
    """Run `plan` under its load; every trial is stored as soon as it ends.

    Ctrl-C ends the run with what was measured (status `interrupted`); a worker that fails is
    taken out of service and the run goes on (its status and error are in the result).
    """
    load = plan.load
    if load.scenario == "server" and load.rate_qps is None and not load.find_peak:
        # Checked before any worker is built: a plan that cannot run costs nothing.
        raise UsageError("plan field load.rate_qps is required by the server scenario: "
                         "set it or pass --qps, or use --find-peak")
    rt = _Runtime(plan, progress)
    report = RunReport(None, plan, "complete")
    settings = load.model_dump(mode="json")
    shares = {m.name: m.share for m in plan.models}
    mix = [p.model_dump() for p in load.mix] if load.mix else None
    with recording(store, "run", {"plan": plan.to_dict(), "model": plan.name}, command) as rec:
        report.run_id = rec.run_id
        built = False
        try:
            report.build = rt.build()
            built = True
            rt.start()
            if load.scenario == "server" and load.find_peak:
                _peak(rt, report, settings, shares, mix, store)
            else:
                result, record = rt.run_trial(settings, shares, mix)
                _keep(rt, report, store, 0, result, record)
        except KeyboardInterrupt:
            report.status = "interrupted"
        except Exception as exc:
            report.status = "failed"
            report.error = str(exc) if isinstance(exc, InfermuxError) else f"{type(exc).__name__}: {exc}"
            raise
        finally:
            _finish(rt, report, rec, built)
    return report


def _finish(rt: _Runtime, report: RunReport, rec: Recording, built: bool) -> None:
    rt.shutdown(now=report.status != "complete" or not built)
    final = report.final or {}
    summary = {k: final.get(k) for k in ("scenario", "valid", "validity_notes", "duration_s",
                                           "items_per_s", "throughput_qps",
                                           "metric", "metric_value_ms", "completed",
                                           "failed")}
    summary["latency"] = final.get("latency")
    summary["peak"] = report.peak and {k: v for k, v in report.peak.items() if k != "trials"}
    summary["error"] = report.error
    summary["build_errors"] = rt.build_errors
    rec.status, rec.summary = report.status, summary


def _keep(rt: _Runtime, report: RunReport, store: Store | None, trial: int,
          result: ScenarioResult, record: dict[str, Any]) -> None:
    record["trial"] = trial
    report.trials.append(record)
    if result.interrupted:
        report.status = "interrupted"
    if store is not None and report.run_id is not None:
        store.add_runtime_trial(report.run_id, trial, record, result,
                                list(rt.recorder.records))


def _peak(rt: _Runtime, report: RunReport, settings: dict[str, Any], shares: dict[str, float],
          mix: list[dict[str, Any]] | None, store: Store | None) -> None:
    bound = settings.get("p99_bound_ms")
    if bound is None:
        raise UsageError("--find-peak needs a latency bound: set load.p99_bound_ms or pass --p99")
    offline = {**settings, "scenario": "offline", "find_peak": False}
    result, record = rt.run_trial(offline, shares, mix)
    _keep(rt, report, store, 0, result, record)
    if result.interrupted:
        return
    upper = record.get("items_per_s") or 0.0
    trial = [0]
    phases: list[dict[str, Any]] = []

    def server(rate: float) -> ScenarioResult:
        trial[0] += 1
        s = {**settings, "scenario": "server", "rate_qps": rate, "find_peak": False}
        res, rec = rt.run_trial(s, shares, mix)
        _keep(rt, report, store, trial[0], res, rec)
        phases.append({m: v.get("phases") for m, v in (rec.get("models") or {}).items()})
        return res

    # The edge is run twice (the last valid rate and the first invalid one): one run of each
    # does not place it on a host whose scheduling noise moves the p99 between runs.
    peak = find_peak(server, upper_qps=upper, bound_ms=bound, confirm=True)
    for entry, ph in zip(peak.trials, phases, strict=False):
        entry["phases"] = ph  # where each trial's time went, per model (runtime.metrics)
    if peak.peak_qps is None and peak.reason is not None:
        if upper <= 0:
            notes = "; ".join(record.get("validity_notes") or []) or "no notes"
            errors = "; ".join(sorted({w["error"] for w in record.get("workers", {}).values()
                                       if w.get("error")}))
            peak.reason = (f"the offline trial completed no samples ({notes}"
                           + (f"; {errors}" if errors else "") + "), so there is no server rate "
                           "to search: fix what failed and run again")
        else:
            peak.reason = _no_peak_reason(rt, bound, peak.reason)
    report.peak = peak.record()


def _no_peak_reason(rt: _Runtime, bound_ms: float, searched: str) -> str:
    """Why no server rate held the bound, and what to do: one line for the peak record."""
    worst: tuple[float, str, str] | None = None  # (fastest batch ms of a model, name, ref)
    for entry in rt.plan.models:
        fastest = [s.estimate.expected_ns(s.buckets[0], entry.name) / 1e6 for s in rt.states
                   if s.alive and s.model == entry.name]
        fastest = [ms for ms in fastest if ms > 0]
        if fastest and (worst is None or min(fastest) > worst[0]):
            worst = (min(fastest), entry.name, entry.model)
    if worst is None:
        return searched
    ms, name, ref = worst
    tune = f"`infermux tune --model {ref} --scenario server --p99 {bound_ms:g}ms`"
    if ms > bound_ms:
        shown = f"{ms:.0f}" if ms >= 10 else f"{ms:.2f}"
        return (f"the plan's batch latency alone is {shown} ms > {bound_ms:g} ms bound "
                f"(model {name}, its fastest worker at its smallest batch): find a plan that "
                f"can hold it with {tune}, or raise the bound")
    if rt.plan.dispatcher.batching == "deadline":
        # Batches are sized to the bound already: no queue delay is left to lower.
        return (f"{searched}; a batch of {name} alone takes {ms:.1f} ms, so queueing breaks the "
                f"bound: find a plan with {tune}")
    return (f"{searched}; a batch of {name} alone takes {ms:.1f} ms, so queueing and batching "
            f"waits break the bound: lower dispatcher.max_queue_delay_ms or find a plan with "
            f"{tune}")
