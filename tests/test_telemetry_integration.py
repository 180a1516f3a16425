"""Telemetry in the offline benchmark, the store and `infermux monitor`; NVML where a GPU is."""

from __future__ import annotations

import json
import time

import pytest

from infermux.bench import BenchConfig, run_bench
from infermux.cli import main
from infermux.models import ModelSpec
from infermux.store import Store
from infermux.telemetry import Sampler, SourceUnavailable


def _config(**kw):
    return BenchConfig(model=ModelSpec("mobilenet_v3_small"), units="cpu", batches=[2],
                       min_duration_s=0.4, min_queries=8, warmup_s=0.1, **kw)


def test_bench_point_carries_telemetry_and_stores_the_series(tmp_path):
    with Store(tmp_path / "t.db") as store:
        report = run_bench(_config(telemetry_interval_s=0.05), store=store)
        record = report.to_dict()["results"][0]
        assert record["status"] == "ok"
        for key in ("energy_per_item_j", "mean_power_w", "peak_power_w", "items_per_s_per_w",
                    "energy_source", "telemetry_flags", "sampler_cost"):
            assert key in record
        cpu = record["utilisation"]["cpu"]
        assert 0 < cpu["util_pct"] <= 100
        assert record["telemetry_ticks"] >= 3
        assert report.to_dict()["telemetry"]["sources"][-1]["source"] == "cpu"
        stored = store.run(report.run_id)["results"][0]
        rows = store.telemetry(result_id=stored["id"])
        assert len(rows) == record["telemetry_ticks"]
        assert all(r["device"] == "cpu" for r in rows)
        assert rows[0]["t_ns"] <= 0 < rows[-1]["t_ns"]  # relative to the window's start
        assert stored["energy_source"] == record["energy_source"]


def test_bench_without_telemetry_has_no_energy_fields():
    report = run_bench(_config(telemetry_interval_s=None))
    record = report.to_dict()["results"][0]
    assert "energy_per_item_j" not in record
    assert report.telemetry is None


def test_monitor_json_and_record(tmp_path, capsys):
    db = tmp_path / "m.db"
    main(["monitor", "--duration", "0.4s", "--interval", "50ms", "--record", "--db", str(db),
          "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["cpu"]["util_pct"] is not None
    assert data["sampler_cost"]["ticks"] >= 3
    with Store(db) as store:
        run = store.run(data["run_id"])
        assert run["kind"] == "monitor" and run["status"] == "complete"
        rows = store.telemetry(run_id=data["run_id"])
    assert len(rows) >= 3 and rows[0]["source"] == "cpu"


def test_monitor_rejects_a_bad_interval(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["monitor", "--duration", "1s", "--interval", "fast"])
    assert exit_info.value.code == 2
    assert "--interval 'fast' is not a duration" in capsys.readouterr().err


def test_nvml_on_a_real_gpu():
    from infermux.telemetry.nvml import NvmlSource

    try:
        source = NvmlSource()
    except SourceUnavailable as exc:
        pytest.skip(str(exc))
    try:
        with Sampler([source], interval_s=0.05) as sampler:
            t0 = time.perf_counter_ns()
            time.sleep(0.3)
            window = sampler.window(t0, time.perf_counter_ns())
        reading = window.ticks[-1].readings[0]
        assert reading.device == "cuda:0"
        assert reading.power_w is not None and reading.power_w > 0
        assert reading.clock_mhz is not None and reading.temp_c is not None
        summary = window.summary(["cuda:0"])
        assert summary.energy_j is not None and summary.energy_j > 0
        method = source.describe()["gpus"][0]["energy"]
        assert summary.devices["cuda:0"].energy_method == (
            "counter" if method == "counter" else "power-integrated")
    finally:
        source.close()
