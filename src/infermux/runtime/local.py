"""The machinery of a runtime on one machine: the dispatcher, the workers, their hosts, restarts.

`_Runtime` builds a plan's workers once (child processes first, so they build in parallel
with this process's runners), starts them, restarts a failed one and shuts them down. Fronts
and the trial loop drive it through `LocalRuntime` (`runtime.api`), never directly.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from typing import Any

from infermux.engines import Runner, create_engine
from infermux.errors import InfermuxError, RunError, UsageError
from infermux.load.base import QuerySampleLibrary
from infermux.models import LoadedModel, ModelSpec, load_model
from infermux.progress import ProgressFn
from infermux.runtime.dispatcher import Batch, Dispatcher, WorkerState, failure_kind
from infermux.runtime.gcpause import GcPauses, freeze_heap, thaw_heap
from infermux.runtime.inputs import build_bucket_runners, item_length, length_group
from infermux.runtime.layout import WorkerPlan, bucket_options, layout_workers
from infermux.runtime.metrics import Recorder
from infermux.runtime.pipelined import PipelineWorker, build_pipeline, pipeline_buckets
from infermux.runtime.placement import LatencyEstimate, ModelLoad, rebalance
from infermux.runtime.plan import Plan
from infermux.runtime.process_host import ProcessHost, RunnerSpec
from infermux.runtime.worker import Worker
from infermux.units import Discovery, discover

__all__: list[str] = []


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


class _Runtime:
    """The built machinery of one plan: dispatcher, workers, hosts, sample libraries."""

    def __init__(self, plan: Plan, progress: ProgressFn | None) -> None:
        self.plan = plan
        self.progress = progress
        self.gc_pauses = GcPauses()
        self._frozen = False  # whether start() froze the heap (`runtime.gcpause.freeze_heap`)
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
        self.gc_pauses.install()  # the collector's pauses, for each trial (runtime.gcpause)
        # The built heap (the engines, the model, torch's ~350k objects) out of the full
        # collections' walk: on two cores one took 191 ms inside a trial (runtime.gcpause).
        self._frozen = freeze_heap()
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

    def shutdown(self, *, now: bool) -> None:
        self.gc_pauses.remove()
        if self._frozen:
            self._frozen = False
            thaw_heap()
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
