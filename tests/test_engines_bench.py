"""`bench --engine auto`: every engine usable on a unit, side by side, each checked for agreement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infermux.bench import BenchConfig, Measurement, run_bench
from infermux.cli import main
from infermux.engines import create_engine, engine_status
from infermux.engines.select import engine_options, engines_for
from infermux.errors import UsageError
from infermux.models import ModelSpec
from infermux.store import Store
from infermux.units import discover

TINY = str(Path(__file__).parent / "engine_models" / "tinycnn.py")


def _usable_on_cpu() -> list[str]:
    return [n for n, (ok, _) in engine_status().items() if ok and n != "tensorrt"]


def test_auto_measures_every_usable_engine_side_by_side(tmp_path: Path) -> None:
    config = BenchConfig(model=ModelSpec(f"{TINY}:build"), units="cpu", batches=[1, 4],
                         engine="auto", min_duration_s=0.2, min_queries=8, warmup_s=0.05)
    with Store(tmp_path / "r.db") as store:
        report = run_bench(config, store=store)
        stored = store.run(report.run_id)
    engines = sorted({m.engine for m in report.measurements})
    assert engines == sorted(_usable_on_cpu())
    assert len(report.measurements) == 2 * len(engines)
    for point in report.measurements:
        assert point.status == "ok", point.error
        assert point.agreement is not None and point.agreement["status"] == "pass"
        assert point.agreement["reference"] == "torch-fp32-cpu"
        assert point.validity[0], point.validity[1]
    # The agreement entry is stored with each point.
    assert all(r["agreement"]["status"] == "pass" for r in stored["results"])
    assert [e for _, e in stored["config"]["resolved_engines"]] == [
        m.engine for m in report.measurements[::2]]


def test_a_point_with_wrong_results_is_invalid_and_says_so() -> None:
    point = Measurement(model="m", unit="cpu", engine="x", batch=1, instances=1, data="host",
                        min_duration_s=0.0, min_queries=1, window_s=1.0)
    point.agreement = {"status": "fail", "message": "relative error 0.4 > 0.001 allowed for fp32"}
    valid, note = point.validity
    assert not valid and note.startswith("WRONG RESULTS: relative error 0.4")
    summary = point.point()
    assert summary.valid is False and (summary.agreement or {})["status"] == "fail"


def test_engine_choice_errors_and_option_routing() -> None:
    cpu = [discover(with_runtimes=False).get("cpu")]
    with pytest.raises(UsageError, match="unknown engine 'tensorflow'"):
        engines_for("tensorflow", cpu)
    if engine_status()["tensorrt"][0]:
        with pytest.raises(UsageError, match="cannot run on unit 'cpu'"):
            engines_for("tensorrt", cpu)
    else:
        with pytest.raises(UsageError, match="not usable here"):
            engines_for("tensorrt", cpu)
    assert [n for _, n in engines_for("torch,onnxruntime", cpu)] == ["torch", "onnxruntime"]
    options = {"warmup_iters": 1, "onnxruntime.intra_op_threads": 1, "openvino.hint": "latency"}
    assert engine_options("onnxruntime", options) == {"warmup_iters": 1, "intra_op_threads": 1}
    assert engine_options("openvino", options) == {"warmup_iters": 1, "hint": "latency"}
    assert engine_options("torch", options) == {"warmup_iters": 1}
    with pytest.raises(UsageError, match="'onnx' is not an engine"):
        engine_options("torch", {"onnx.threads": 1})


def test_cli_bench_engine_auto_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "cli.db"
    main(["bench", "-m", f"{TINY}:build", "--units", "cpu", "--engine", "auto", "-b", "2",
          "--min-duration", "0.2s", "--min-queries", "4", "--warmup", "0.05s",
          "-o", "onnxruntime.intra_op_threads=1", "--db", str(db), "--json"])
    data = json.loads(capsys.readouterr().out)
    rows = {r["engine"]: r for r in data["results"]}
    assert sorted(rows) == sorted(_usable_on_cpu())
    if "onnxruntime" in rows:
        assert rows["onnxruntime"]["options"]["intra_op_threads"] == 1
    assert all(r["agreement"]["status"] == "pass" for r in rows.values())
    with pytest.raises(SystemExit) as failed:  # a usage error: one line, exit 2
        main(["bench", "-m", f"{TINY}:build", "--engine", "nope", "--db", str(db)])
    assert failed.value.code == 2
    assert "unknown engine 'nope'" in capsys.readouterr().err


def test_auto_on_an_onnx_file_leaves_out_the_torch_engine(tmp_path: Path) -> None:
    from infermux.export import export_onnx
    from infermux.models import load_model

    onnx_file = tmp_path / "tiny.onnx"
    onnx_file.write_bytes(export_onnx(load_model(f"{TINY}:build")).path.read_bytes())
    model = load_model(str(onnx_file))
    cpu = [discover(with_runtimes=False).get("cpu")]
    names = [n for _, n in engines_for("auto", cpu, model)]
    # Engines that convert torch modules (torch, litert) leave out an ONNX file.
    assert "torch" not in names and sorted(names) == sorted(
        n for n in _usable_on_cpu() if n != "torch" and create_engine(n).accepts(model))
    with pytest.raises(UsageError, match="cannot run model 'tiny'"):
        engines_for("torch", cpu, model)
    config = BenchConfig(model=ModelSpec(str(onnx_file)), units="cpu", batches=[2],
                         engine="auto", min_duration_s=0.1, min_queries=2, warmup_s=0.01)
    report = run_bench(config)
    assert {m.engine for m in report.measurements} == set(names)
    assert all(m.agreement and m.agreement["reference"] == "onnxruntime-fp32-cpu"
               and m.agreement["status"] == "pass" for m in report.measurements)
