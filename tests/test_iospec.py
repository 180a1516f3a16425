"""Networks of several inputs: specs read from ONNX files, factories and transformers; bench runs them.

The two-input model is a ten-line torch module (float features and int64 ids), used as a factory
and exported to an ONNX file as a user would; the transformer is a two-layer BERT built from a
config folder (`hf:FOLDER`). Both go through `run_bench` on every CPU engine installed here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from infermux.bench import BenchConfig, run_bench
from infermux.engines import create_engine
from infermux.errors import UsageError
from infermux.iospec import IOSpec, TensorSpec, from_module
from infermux.models import ModelSpec, load_model

from .conftest import invoke_cli


def _cpu_engines(model):
    """Every engine installed here that runs this model on the CPU."""
    from infermux.engines.select import engines_for
    from infermux.units import discover, select_units

    units = select_units("cpu", discover())
    return sorted({name for _, name in engines_for("auto", units, model)})


def _bench(ref, engine, **kw):
    config = BenchConfig(ModelSpec(ref), units="cpu", engine=engine, min_duration_s=0.1,
                         min_queries=4, warmup_s=0.0, telemetry_interval_s=None, **kw)
    return run_bench(config)


def test_specs_from_a_factory_and_its_onnx_file(two_inputs):
    factory, onnx_path = two_inputs
    from_factory = load_model(factory).spec_io
    assert [(t.name, t.dtype, t.shape) for t in from_factory.inputs] == [
        ("features", "float32", (16,)), ("ids", "int64", ("seq",))]
    assert from_factory.inputs[1].high == 50 and from_factory.default_dims == {"seq": 8}
    assert not from_factory.simple

    loaded = load_model(onnx_path)
    io = loaded.spec_io
    # Every input of the file, not the first; the vocabulary read from the embedding's Gather.
    assert [(t.name, t.dtype, t.shape) for t in io.inputs] == [
        ("features", "float32", (16,)), ("ids", "int64", ("seq",))]
    assert io.inputs[1].values == "ids" and io.inputs[1].high == 50
    assert [(t.name, t.shape) for t in io.outputs] == [("scores", (4,))]
    described = loaded.describe()
    assert [t["name"] for t in described["inputs"]] == ["features", "ids"]
    with pytest.raises(UsageError, match="'seq' has no size"):
        io.dims_for(None)
    batch = io.generate(3, io.dims_for(5))
    assert batch[0].shape == (3, 16) and batch[1].shape == (3, 5) and batch[1].dtype == np.int64
    assert batch[1].min() >= 0 and batch[1].max() < 50


def test_spec_from_sample_inputs_and_bad_specs():
    class Tagger(torch.nn.Module):
        sample_inputs = (torch.randint(0, 7, (2, 5)), torch.ones(2, 5, dtype=torch.long))

        def forward(self, tokens, mask):
            return tokens * mask

    io = from_module(Tagger())
    assert io is not None
    assert [(t.name, t.dtype, t.shape, t.values) for t in io.inputs] == [
        ("tokens", "int64", (5,), "ids"), ("mask", "int64", (5,), "ones")]
    assert io.inputs[0].high is not None and io.inputs[0].high <= 7
    with pytest.raises(UsageError, match="dtype 'complex64' is not one infermux runs"):
        TensorSpec("x", "complex64", (3,))
    with pytest.raises(UsageError, match="dimension -1 is neither"):
        TensorSpec("x", "float32", (-1,))
    with pytest.raises(UsageError, match="input names .* repeat"):
        IOSpec((TensorSpec("x"), TensorSpec("x")))


def test_two_input_onnx_file_runs_on_every_cpu_engine(two_inputs):
    _, onnx_path = two_inputs
    model = load_model(onnx_path)
    engines = _cpu_engines(model)
    assert "onnxruntime" in engines and "torch" not in engines  # torch runs modules, not files
    report = _bench(onnx_path, "auto", batches=[1, 3], seq_buckets=[4, 12])
    points = report.measurements
    assert {p.engine for p in points} == set(engines)
    assert {(p.batch, p.seq_len) for p in points} == {(1, 4), (3, 4), (1, 12), (3, 12)}
    for point in points:
        assert point.status == "ok", point.error
        assert point.agreement is not None and point.agreement["status"] == "pass", point.agreement
        assert point.tokens_per_s == pytest.approx(point.throughput * point.seq_len)
    assert not report.all_failed


def test_two_input_factory_on_torch_and_mistyped_inputs(two_inputs):
    factory, _ = two_inputs
    report = _bench(factory, "torch", batches=[2])  # the factory's default length: 8
    (point,) = report.measurements
    assert point.status == "ok" and point.seq_len == 8 and point.agreement["status"] == "pass"
    model = load_model(factory)
    from infermux.units import discover, select_units

    unit = select_units("cpu", discover())[0]
    for name in _cpu_engines(model):
        runner = create_engine(name).build(model, unit, 2, length=6)
        good = model.spec_io.generate(2, {"seq": 6})
        assert [o.shape for o in runner.infer_inputs(good)] == [(2, 4)]
        with pytest.raises(UsageError, match="input 'ids': dtype float32 given, the model takes "
                                             "int64"):
            runner.set_inputs([good[0], good[1].astype(np.float32)])
        with pytest.raises(UsageError, match=r"input 'ids': shape \(2, 7\) given, the runner "
                                             r"takes \(2, 6\)"):
            runner.set_inputs([good[0], np.zeros((2, 7), np.int64)])
        with pytest.raises(UsageError, match="1 inputs given, the model takes 2: features, ids"):
            runner.set_inputs([good[0]])


def test_tiny_bert_from_a_config_folder_on_every_cpu_engine(tiny_bert):
    model = load_model(tiny_bert)
    io = model.spec_io
    assert [(t.name, t.dtype, t.shape, t.values) for t in io.inputs] == [
        ("input_ids", "int64", ("seq",), "ids"), ("attention_mask", "int64", ("seq",), "ones"),
        ("token_type_ids", "int64", ("seq",), "ids")]
    assert io.inputs[0].high == 100 and io.default_dims == {"seq": 128}
    assert [(t.name, t.shape) for t in io.outputs] == [
        ("last_hidden_state", ("seq", 32)), ("pooler_output", (32,))]
    assert "randomly initialised" in model.weights_note
    engines = _cpu_engines(model)
    assert "torch" in engines and "onnxruntime" in engines
    report = _bench(tiny_bert, "auto", batches=[2], seq_buckets=[8, 16])
    assert {(p.engine, p.seq_len) for p in report.measurements} == {
        (e, n) for e in engines for n in (8, 16)}
    for point in report.measurements:
        assert point.status == "ok", point.error
        assert point.agreement["status"] == "pass", point.agreement
        record = point.point().to_dict()
        assert record["tokens_per_s"] == pytest.approx(record["items_per_s"] * point.seq_len)


def test_cli_shows_specs_and_benches_a_tiny_bert(tiny_bert, module_cache_dir, db):
    env = {"INFERMUX_CACHE_DIR": str(module_cache_dir)}
    shown = invoke_cli("models", "--model", tiny_bert, "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert [t["name"] for t in data["inputs"]] == ["input_ids", "attention_mask",
                                                   "token_type_ids"]
    assert [t["name"] for t in data["outputs"]] == ["last_hidden_state", "pooler_output"]
    table = invoke_cli("models", "--model", tiny_bert, env=env)
    assert "input_ids: int64[batch, seq] < 100" in table.stdout
    bench = invoke_cli("bench", "-m", tiny_bert, "-u", "cpu", "--engine", "torch", "-b", "2",
                       "--seq", "8", "--min-duration", "0.1s", "--min-queries", "4", "--warmup",
                       "0s", "--telemetry", "off", "--db", str(db), "--json", env=env)
    assert bench.returncode == 0, bench.stderr
    report = json.loads(bench.stdout)
    assert report["model"]["inputs"][0]["name"] == "input_ids"
    (result,) = report["results"]
    assert result["seq_len"] == 8 and result["tokens_per_s"] > 0
    assert result["agreement"]["status"] == "pass"
    bad = invoke_cli("bench", "-m", tiny_bert, "-u", "cpu", "--seq", "0", "--no-store", env=env)
    assert bad.returncode == 2 and "--seq '0'" in bad.stderr and "Traceback" not in bad.stderr


def test_a_request_is_checked_against_the_spec_input_by_input(two_inputs):
    io = load_model(two_inputs[0]).spec_io
    features, ids = np.zeros(16, np.float32), np.arange(6, dtype=np.int64)
    assert io.check_item({"features": features, "ids": ids}) == {"seq": 6}
    assert io.check_item([features, ids], lengths=[6, 12]) == {"seq": 6}
    cases = [
        ({"features": features}, "input 'ids' is missing: the model takes ids: int64[batch, seq]"),
        ({"features": features, "ids": ids, "mask": ids}, "input 'mask' is not one the model "
                                                          "takes"),
        ({"features": features, "ids": ids.astype(np.float32)},
         "input 'ids': float32[6] given, the model takes ids: int64[batch, seq] < 50"),
        ({"features": np.zeros(8, np.float32), "ids": ids},
         "input 'features': float32[8] given, the model takes features: float32[batch, 16]"),
    ]
    for values, message in cases:
        with pytest.raises(UsageError) as caught:
            io.check_item(values)
        assert str(caught.value).startswith(message), str(caught.value)
        assert "\n" not in str(caught.value)
    with pytest.raises(UsageError, match="seq 6 is not one of the sequence lengths"):
        io.check_item([features, ids], lengths=[8, 16])


def test_a_save_pretrained_folder_loads_its_weights(tiny_bert, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig.from_pretrained(tiny_bert.removeprefix("hf:"))
    torch.manual_seed(1)
    saved = transformers.BertModel(config).eval()
    saved.save_pretrained(str(tmp_path / "trained"))
    model = load_model(f"hf:{tmp_path / 'trained'}")
    assert model.weights_note == f"weights loaded from {tmp_path / 'trained'}"
    assert not model.randomly_initialised and model.name == "trained"
    ids = torch.randint(0, 100, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    with torch.inference_mode():
        want = saved(input_ids=ids, attention_mask=mask, token_type_ids=0 * mask).last_hidden_state
        got = model.module(ids, mask, 0 * mask)[0]
    torch.testing.assert_close(got, want)
    with pytest.raises(UsageError, match="model 'hf:bert-large' unknown: use one of bert-base"):
        load_model("hf:bert-large")
    from infermux.models import list_models

    assert list_models("*bert*")["hf"] == ["hf:bert-base", "hf:distilbert"]


def test_compare_keeps_points_of_two_lengths_apart():
    from infermux.cli.render import compare_rows

    def point(seq, rate):
        return {"model": "bert", "unit": "cpu", "engine": "torch", "batch": 8, "instances": 1,
                "data": "host", "seq_len": seq, "items_per_s": rate, "p99_ms": 1.0}

    a = {"id": 1, "results": [point(64, 100.0), point(128, 50.0)]}
    b = {"id": 2, "results": [point(64, 200.0), point(128, 50.0)]}
    rows = compare_rows(a, b)
    assert sorted((r["seq_len"], r["ratio"]) for r in rows) == [(64, 2.0), (128, 1.0)]
