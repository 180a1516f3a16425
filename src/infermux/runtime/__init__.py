"""The multi-tenant runtime: plans, workers, the dispatcher, placement and run metrics.

`run_plan(load_plan("plan.yaml"))` builds one worker per instance, drives the plan's load
(`infermux.load`) through the dispatcher and returns (and stores) what it measured: each
trial a `TrialSummary` (`runtime.trial`).
`start_runtime(plan)` builds and starts one with no load attached: a `Runtime` (the protocol
every front drives: submit, subscribe to outputs and completions, readiness, statistics, stop).
`runtime.peak` runs trials and peak searches on any `TrialRuntime` (this machine's or a
cluster's).
"""

from infermux.runtime.api import LocalRuntime, Runtime, RuntimeStats, Subscription, TrialRuntime
from infermux.runtime.dispatcher import Batch, Dispatcher, Item, WorkerState, batch_ready
from infermux.runtime.placement import LatencyEstimate, rebalance, slo_take
from infermux.runtime.plan import EXAMPLE_PLAN, Plan, load_plan, parse_plan
from infermux.runtime.session import RunReport, run_plan, start_runtime, with_load
from infermux.runtime.trial import TrialSummary

__all__ = [
    "EXAMPLE_PLAN",
    "Batch",
    "Dispatcher",
    "Item",
    "LatencyEstimate",
    "LocalRuntime",
    "Plan",
    "RunReport",
    "Runtime",
    "RuntimeStats",
    "Subscription",
    "TrialRuntime",
    "TrialSummary",
    "WorkerState",
    "batch_ready",
    "load_plan",
    "parse_plan",
    "rebalance",
    "run_plan",
    "slo_take",
    "start_runtime",
    "with_load",
]
