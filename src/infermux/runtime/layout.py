"""A plan laid out on this machine: each replica instance's unit, core share and hosting.

`layout_workers(plan, found)` resolves every replica's unit and splits a CPU replica's cores
between its instances; `bucket_options` gives one bucket's engine options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infermux.engines import create_engine
from infermux.errors import UsageError
from infermux.runtime.plan import Plan, Replica, options_for_bucket
from infermux.units import Discovery, Unit, select_units
from infermux.units.cpu import split_cores

__all__ = ["WorkerPlan", "bucket_options", "layout_workers"]


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


def bucket_options(replica: Replica, bucket: int) -> dict[str, Any]:
    """Engine options of one bucket's runner (`runtime.plan.options_for_bucket`)."""
    return options_for_bucket(replica.options, replica.buckets(), bucket)
