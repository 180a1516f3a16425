"""Running a Plan: build its runtime, drive its load, store every trial.

`run_plan(plan)` is the library entry point the CLI, the tuner and the benchmarks call. It
builds every worker once (`runtime.local`, laid out by `runtime.layout`) and drives the plan's
load through the trial loop every runtime shares (`runtime.peak`): a peak search reuses the
workers for all its trials. `start_runtime(plan)` builds and starts one for a front instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infermux.errors import InfermuxError, UsageError
from infermux.progress import ProgressFn
from infermux.runtime.api import LocalRuntime
from infermux.runtime.local import _Runtime
from infermux.runtime.peak import TrialRun, run_load, search_answer
from infermux.runtime.plan import Plan, parse_plan
from infermux.runtime.trial import TrialSummary
from infermux.store import Recording, Store, recording

__all__ = ["RunReport", "run_plan", "start_runtime", "with_load"]


def with_load(plan: Plan, **changes: Any) -> Plan:
    """A copy of `plan` with load settings changed (None values ignored), validated again."""
    data = plan.to_dict()
    data["load"].update({k: v for k, v in changes.items() if v is not None})
    return parse_plan(data, source="plan (with command-line overrides)")


@dataclass
class RunReport:
    """What `run_plan` returns: the stored run id, status, every trial's record."""

    run_id: int | None
    plan: Plan
    status: str  # complete | interrupted | failed
    trials: list[TrialSummary] = field(default_factory=list)
    peak: dict[str, Any] | None = None
    build: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def final(self) -> TrialSummary | None:
        """The trial that answers the question: the last one, or the peak search's (`search_answer`)."""
        answer = search_answer(self.trials, self.peak)
        if answer is not None:
            return answer
        return self.trials[-1] if self.trials else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        final = self.final
        return {"run_id": self.run_id, "status": self.status, "error": self.error,
                "plan": self.plan.to_dict(), "build": self.build, "peak": self.peak,
                "result": final.to_dict() if final is not None else None,
                "trials": [t.to_dict() for t in self.trials]}


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
    runtime = LocalRuntime(rt)
    report = RunReport(None, plan, "complete")
    settings = load.model_dump(mode="json")
    mix = [p.model_dump() for p in load.mix] if load.mix else None

    def keep(run: TrialRun) -> None:
        report.trials.append(run.record)
        if run.result.interrupted:
            report.status = "interrupted"
        if store is not None and report.run_id is not None:
            store.add_runtime_trial(report.run_id, run.index, run.record.to_dict(), run.result,
                                    run.batches)

    with recording(store, "run", {"plan": plan.to_dict(), "model": plan.name}, command) as rec:
        report.run_id = rec.run_id
        built = False
        try:
            report.build = rt.build()
            built = True
            rt.start()
            report.peak = run_load(runtime, settings, keep=keep, mix=mix, progress=progress)
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
    final = report.final.to_dict() if report.final is not None else {}
    summary = {k: final.get(k) for k in ("scenario", "valid", "validity_notes", "duration_s",
                                           "items_per_s", "throughput_qps",
                                           "metric", "metric_value_ms", "completed",
                                           "failed")}
    summary["latency"] = final.get("latency")
    summary["peak"] = report.peak and {k: v for k, v in report.peak.items() if k != "trials"}
    summary["error"] = report.error
    summary["build_errors"] = rt.build_errors
    rec.status, rec.summary = report.status, summary
