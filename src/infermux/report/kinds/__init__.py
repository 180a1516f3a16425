"""One renderer per kind of run, registered by name; unknown kinds get the generic one.

A renderer fills a run's section (`render(run, section)`) and may name the run's headline
figure (`headline(run)` → (what, value, unit) or None) for the comparison of several runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from infermux.report.data import RunData
from infermux.report.page import Section

__all__ = ["Headline", "KindRenderer", "list_kinds", "register_kind", "renderer_for"]

#: (what the figure is, its value, its unit), e.g. ("best valid throughput", 812.4, "items/s").
Headline = tuple[str, float, str]


@dataclass(frozen=True)
class KindRenderer:
    """How one kind of run is drawn."""

    kind: str
    render: Callable[[RunData, Section], None]
    headline: Callable[[RunData], Headline | None]


_KINDS: dict[str, KindRenderer] = {}


def _no_headline(run: RunData) -> Headline | None:
    return None


def register_kind(kind: str, *, headline: Callable[[RunData], Headline | None] = _no_headline
                  ) -> Callable[[Callable[[RunData, Section], None]],
                                Callable[[RunData, Section], None]]:
    """Decorator: `@register_kind("bench", headline=fn)` on a `render(run, section)` function."""

    def wrap(fn: Callable[[RunData, Section], None]) -> Callable[[RunData, Section], None]:
        _KINDS[kind] = KindRenderer(kind, fn, headline)
        return fn

    return wrap


def _load_builtin() -> None:
    # Imported for their registrations.
    from infermux.report.kinds import (  # noqa: F401
        bench,
        characterize,
        generic,
        partition,
        runtime,
        study,
        telemetry,
        tune,
    )


def renderer_for(kind: str) -> KindRenderer:
    """The renderer of `kind`, or the generic one (records as tables) for kinds not known here."""
    _load_builtin()
    return _KINDS.get(kind) or _KINDS["generic"]


def list_kinds() -> list[str]:
    """Kinds with a renderer of their own."""
    _load_builtin()
    return sorted(k for k in _KINDS if k != "generic")
