"""The results store: one SQLite file holding every run of every kind.

`Store` owns every table and the run's lifecycle: the core (runs, benchmark results, raw
samples, telemetry), and one class per area (runtime, tuner, partitioner, characterization,
studies, cluster, training), each with its schema and the methods that write and read it. A run is
recorded with `Store.recording(kind, config, command)`, or `recording(store_or_none, ...)`
where storing is optional.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from infermux.errors import RunError
from infermux.store.characterize import CharacterizeTables
from infermux.store.cluster import ClusterTables
from infermux.store.core import DEFAULT_DB, RESULT_COLUMNS, Recording, Sample, StoreCore
from infermux.store.partition import PartitionTables
from infermux.store.runtime import RuntimeTables
from infermux.store.study import StudyTables
from infermux.store.train import TrainTables
from infermux.store.tune import TuneTables

__all__ = ["DEFAULT_DB", "RESULT_COLUMNS", "Recording", "Sample", "Store", "open_store",
           "recording"]


class Store(RuntimeTables, TuneTables, PartitionTables, CharacterizeTables, StudyTables,
            ClusterTables, TrainTables, StoreCore):
    """A SQLite file (default `./infermux.db`) with every area's tables; safe to reopen."""

    def __enter__(self) -> Store:
        return self


def open_store(path: str | Path | None) -> Store:
    """Open the store at `path` (default `./infermux.db`), translating failures to one line."""
    try:
        return Store(path or DEFAULT_DB)
    except sqlite3.Error as exc:  # pragma: no cover - disk full, permissions
        raise RunError(f"cannot open results database {str(path)!r}: {exc}") from exc


@contextmanager
def recording(store: Store | None, kind: str, config: dict[str, Any], command: str = "",
              env: dict[str, Any] | None = None) -> Iterator[Recording]:
    """`store.recording(...)`, or a `Recording` that stores nothing when `store` is None."""
    if store is None:
        yield Recording(None)
        return
    with store.recording(kind, config, command, env) as rec:
        yield rec
