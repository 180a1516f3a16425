"""Which engines run which units, and which options go to which engine.

`engines_for("auto", units, model)` is every usable engine that supports each unit and accepts
the model; a named engine that cannot is a usage error. `engine_options` splits a flat option
dict: plain keys go to every engine, `NAME.key` only to the engine NAME.
"""

from __future__ import annotations

from typing import Any

from infermux.engines.base import create_engine, engine_status, list_engines
from infermux.errors import UsageError
from infermux.models import LoadedModel
from infermux.units import Unit

__all__ = ["engine_options", "engines_for"]


def engines_for(spec: str, units: list[Unit], model: LoadedModel | None = None
                ) -> list[tuple[Unit, str]]:
    """(unit, engine) pairs to measure: `auto` → every usable engine that supports each unit.

    `spec` is one engine name, a comma-separated list, or `auto`. A named engine that cannot run
    a unit (or the model) is a usage error; `auto` skips it, and engines not installed, silently.
    """
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise UsageError(f"--engine {spec!r} is empty: use one of {', '.join(list_engines())}, auto")
    if names == ["auto"]:
        usable = [create_engine(n) for n, (ok, _) in engine_status().items() if ok]
        plan = [(u, e.name) for u in units for e in usable
                if e.supports(u) and (model is None or e.accepts(model))]
        if not plan:
            raise UsageError(f"no engine installed here runs {', '.join(u.id for u in units)}")
        return plan
    plan = []
    for name in names:
        engine = create_engine(name)  # unknown or uninstalled: one clear line
        if model is not None and not engine.accepts(model):
            raise UsageError(f"engine {name!r} cannot run model {model.name!r} "
                             f"({model.source}); use --engine auto or an ONNX engine")
        for unit in units:
            if not engine.supports(unit):
                raise UsageError(f"engine {name!r} cannot run on unit {unit.id!r}: "
                                 f"{engine.unsupported_reason(unit)} (or use --engine auto)")
            plan.append((unit, name))
    return sorted(plan, key=lambda p: units.index(p[0]))


def engine_options(engine: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options meant for `engine`: plain keys go to every engine, `NAME.key` only to NAME."""
    known = set(list_engines())
    chosen: dict[str, Any] = {}
    for key, value in options.items():
        prefix, dot, rest = key.partition(".")
        if dot and prefix in known:
            if prefix == engine:
                chosen[rest] = value
        elif dot:
            raise UsageError(f"option {key!r}: {prefix!r} is not an engine "
                             f"({', '.join(sorted(known))}); write ENGINE.option=value")
        else:
            chosen[key] = value
    return chosen
