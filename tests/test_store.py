"""The store owns its tables and the run's lifecycle; old databases are migrated in place."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from infermux.store import Store, open_store, recording


def test_every_area_table_exists_on_open(tmp_path: Path) -> None:
    with open_store(tmp_path / "a.db") as store:
        names = {r[0] for r in store.connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table in ("runs", "results", "samples", "telemetry", "run_trials", "run_workers",
                  "tune_trials", "partition_candidates", "characterize_variants",
                  "study_points"):
        assert table in names


def test_recording_finishes_complete_with_the_summary(tmp_path: Path) -> None:
    with open_store(tmp_path / "a.db") as store:
        with store.recording("bench", {"model": "m"}, "infermux bench") as rec:
            rec.summary = {"points": 3}
        run = store.run(rec.run_id)  # type: ignore[arg-type]
    assert run["status"] == "complete" and run["summary"] == {"points": 3}
    assert run["command"] == "infermux bench"
    assert run["environment"]["python"]  # the environment was captured


def test_recording_marks_interrupt_and_failure(tmp_path: Path) -> None:
    with open_store(tmp_path / "a.db") as store:
        with pytest.raises(KeyboardInterrupt), store.recording("run", {}) as stopped:
            raise KeyboardInterrupt
        with pytest.raises(ValueError), store.recording("run", {}) as broken:
            raise ValueError("bad value\nsecond line")
        assert store.run(stopped.run_id)["status"] == "interrupted"  # type: ignore[arg-type]
        failed = store.run(broken.run_id)  # type: ignore[arg-type]
    assert failed["status"] == "failed"
    assert failed["summary"]["error"] == "ValueError: bad value"


def test_recording_without_a_store_records_nothing() -> None:
    with recording(None, "bench", {}) as rec:
        rec.summary = {"x": 1}
    assert rec.run_id is None


def test_a_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    from infermux.errors import UsageError

    with pytest.raises(UsageError, match="is a directory"):
        Store(tmp_path)


def test_export_json_keeps_raw_samples(tmp_path: Path) -> None:
    from infermux.store import Sample

    with open_store(tmp_path / "a.db") as store:
        with store.recording("bench", {}) as rec:
            assert rec.run_id is not None
            record = {"model": "m", "unit": "cpu", "engine": "torch", "batch": 2,
                      "instances": 1, "data": "host", "status": "ok", "valid": True,
                      "items": 4, "window_s": 1.0}
            store.add_result(rec.run_id, record, [Sample(0, 1000, 0, 900, 0)] * 2)
        runs = store.export_json([rec.run_id])
    assert runs[0]["results"][0]["raw_samples"][0]["latency_ns"] == 1000
    assert len(runs[0]["results"][0]["raw_samples"]) == 2
    json.dumps(runs)  # JSON-ready as it is


def test_a_version_1_database_is_migrated_in_place(tmp_path: Path) -> None:
    """Throughput had three names before schema version 2; an old file reads as a new one."""
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL,
            status TEXT NOT NULL, started_at TEXT NOT NULL, finished_at TEXT, command TEXT,
            config_json TEXT NOT NULL, env_json TEXT NOT NULL, summary_json TEXT);
        CREATE TABLE run_models (run_id INTEGER NOT NULL, trial INTEGER NOT NULL,
            model TEXT NOT NULL, completed INTEGER NOT NULL, failed INTEGER NOT NULL,
            throughput_samples_per_s REAL, p50_ms REAL, p99_ms REAL, queueing_p99_ms REAL,
            batching_wait_p99_ms REAL, compute_p99_ms REAL, batch_histogram_json TEXT NOT NULL,
            record_json TEXT NOT NULL);
    """)
    summary = {"throughput_samples_per_s": 12.5, "peak": {"offline_samples_per_s": 20.0}}
    old.execute("INSERT INTO runs (kind, status, started_at, config_json, env_json, "
                "summary_json) VALUES ('run', 'complete', 'now', '{}', '{}', ?)",
                (json.dumps(summary),))
    old.execute("INSERT INTO run_models VALUES (1, 0, 'm', 10, 0, 12.5, 1, 2, 0, 0, 1, '{}', ?)",
                (json.dumps({"models": [{"throughput_samples_per_s": 12.5}]}),))
    old.commit()
    old.close()
    with open_store(path) as store:
        run = store.run(1)
        columns = [r[1] for r in store.connection.execute("PRAGMA table_info(run_models)")]
        record = json.loads(store.connection.execute(
            "SELECT record_json FROM run_models").fetchone()[0])
        version = store.connection.execute(
            "SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    assert run["summary"] == {"items_per_s": 12.5, "peak": {"offline_items_per_s": 20.0}}
    assert "items_per_s" in columns and "throughput_samples_per_s" not in columns
    assert record == {"models": [{"items_per_s": 12.5}]}
    assert version == "2"
