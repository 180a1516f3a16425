"""Networks of several inputs through plans: the runtime, `run`, LoadGen and `serve`.

A two-input ONNX file (float features and int64 ids, exported from a ten-line torch module) and
a two-layer BERT built from a config folder run through plans with sequence-length buckets: a
query padded to its bucket gives the outputs of its unpadded run, every worker hosting (threads,
processes) feeds every input, and a plan or request whose input does not fit is one line.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from infermux.errors import UsageError
from infermux.iospec import IOSpec, TensorSpec
from infermux.load.base import Query
from infermux.load.samples import IOSamples, parse_lengths
from infermux.models import load_model
from infermux.runtime import parse_plan, run_plan, start_runtime


@pytest.fixture(scope="module")
def two(two_inputs):
    """(factory reference, ONNX file) of the two-input module (tests/conftest.py)."""
    return two_inputs


@pytest.fixture(scope="module")
def bert(tiny_bert):
    """A two-layer BERT's config folder, `hf:FOLDER` (tests/conftest.py)."""
    return tiny_bert


def _plan(ref, *, engine="torch", hosting="thread", seq_buckets=None, lengths=None, batch=4,
          **entry):
    model = {"name": "m", "model": ref, "replicas": [{"unit": "cpu:0", "engine": engine,
                                                      "batch": batch}], **entry}
    if seq_buckets is not None:
        model["seq_buckets"] = seq_buckets
    load = {"scenario": "offline", "min_duration_s": 0.3, "min_queries": 16, "sample_pool": 32}
    if lengths is not None:
        load["lengths"] = lengths
    return parse_plan({"models": [model], "dispatcher": {"cpu_workers": hosting}, "load": load})


def _served(rt, model, items):
    """Submit one query per item (every input given) and wait for each one's output rows."""
    got: dict[int, list[np.ndarray]] = {}
    done = threading.Event()

    def on_outputs(batch, outputs):
        for i, item in enumerate(batch.items):
            got[item.query] = [y[i] for y in outputs]
        if len(got) == len(items):
            done.set()

    sub = rt.subscribe(outputs=on_outputs)
    try:
        rt.submit([Query(i + 1, model, (0,), inputs=[item]) for i, item in enumerate(items)])
        assert done.wait(120), f"{len(got)} of {len(items)} answered"
    finally:
        sub.cancel()
    return [got[i + 1] for i in range(len(items))]


# -- step 1: the runtime ---------------------------------------------------------------------


def test_samples_are_padded_past_their_length_and_lengths_parse():
    spec = IOSpec((TensorSpec("input_ids", "int64", ("seq",), high=50),
                   TensorSpec("attention_mask", "int64", ("seq",), values="ones")))
    samples = IOSamples.generate(spec, "m", 64, 0, 32, parse_lengths("uniform:4-20"))
    assert samples.lengths is not None and 4 <= samples.lengths.min() <= samples.lengths.max() <= 20
    ids, mask = samples.arrays
    assert ids.shape == mask.shape == (64, 32)
    for s in range(64):
        n = samples.lengths[s]
        assert mask[s, :n].all() and not mask[s, n:].any() and not ids[s, n:].any()
    again = IOSamples.generate(spec, "m", 64, 0, 32, parse_lengths("uniform:4-20"))
    assert np.array_equal(again.arrays[0], ids)  # seeded: the same in every process
    assert parse_lengths(128).mean == 128 and parse_lengths("32,64").choices == (32, 64)
    for bad in ("uniform:0-5", "normal:3", "12,x", "uniform:9-3"):
        with pytest.raises(UsageError) as caught:
            parse_lengths(bad)
        assert bad in str(caught.value) and "\n" not in str(caught.value)


def test_a_padded_query_gives_its_unpadded_outputs_on_a_tiny_bert(bert):
    """A query of 11 tokens runs in the 16 bucket, one of 23 in the 32 bucket, batched
    together with others: each item's pooled output and its own positions of the last hidden
    state equal those of the network run on it alone, unpadded."""
    model = load_model(bert)
    names = [t.name for t in model.spec_io.inputs]
    rng = np.random.default_rng(1)
    items = []
    for n in (11, 23, 5, 16):
        ids = rng.integers(1, 100, size=n)
        items.append([ids, np.ones(n, np.int64), np.zeros(n, np.int64)][:len(names)])
    rt = start_runtime(_plan(bert, seq_buckets=[16, 32]))
    try:
        served = _served(rt, "m", items)
    finally:
        rt.stop(drain=False)
    out_names = [t.name for t in model.spec_io.outputs]
    for item, outs in zip(items, served, strict=True):
        with torch.inference_mode():
            alone = model.module(*[torch.from_numpy(np.asarray(a)[None]) for a in item])
        ref = dict(zip(out_names, [t[0].numpy() for t in alone], strict=True))
        got = dict(zip(out_names, outs, strict=True))
        n = len(item[0])
        np.testing.assert_allclose(got["pooler_output"], ref["pooler_output"], atol=1e-5)
        np.testing.assert_allclose(got["last_hidden_state"][:n], ref["last_hidden_state"],
                                   atol=1e-5)


def test_a_batch_takes_the_oldest_items_length_bucket_and_keeps_the_others_in_order():
    """Queries of lengths 10, 100, 12, 90, 11 (buckets 16 and 128): the first batch of 4 takes
    the three short ones, the next the two long ones, in arrival order."""
    from infermux.runtime import Dispatcher, LatencyEstimate, WorkerState

    from .conftest import Clock

    lengths = [10, 100, 12, 90, 11]
    clock = Clock()
    d = Dispatcher(["m"], max_queue_delay_ns=0, clock_ns=clock)
    d.group_of["m"] = lambda sample, data: int(lengths[sample] > 16)
    w = WorkerState(0, "w0", "cpu:0", "m", [1, 2, 4], {"m"}, LatencyEstimate(0.5))
    d.add_worker(w)
    d.submit([Query(i, "m", (i,)) for i in range(5)])
    first = d.poll(w)
    assert [it.sample for it in first.items] == [0, 2, 4] and first.bucket == 4
    w.in_flight = 0
    second = d.poll(w)
    assert [it.sample for it in second.items] == [1, 3] and second.bucket == 2


@pytest.mark.parametrize("hosting", ["thread", "process"])
def test_a_two_input_onnx_file_runs_a_plan_on_onnxruntime(two, hosting):
    report = run_plan(_plan(two[1], engine="onnxruntime", hosting=hosting, seq_buckets=[4, 8],
                            lengths="4,8"))
    final = report.final
    assert report.status == "complete", report.error
    assert final.valid and final.items_per_s > 0 and not final.failed, final


def test_a_tiny_bert_plan_on_torch_process_workers_serves_rows(bert):
    """A process-hosted worker's child builds every (batch, length) runner and runs served
    items of every input; its outputs match the thread worker's. Items of one length go to
    the child stacked per input, a batch of two lengths (3 and 5, one bucket) pickled."""
    items = [[np.arange(k, k + n) % 100, np.ones(n, np.int64), np.zeros(n, np.int64)]
             for k, n in enumerate((3, 5, 9, 9, 12))]
    answers = []
    for hosting in ("thread", "process"):
        rt = start_runtime(_plan(bert, hosting=hosting, seq_buckets=[8, 16], batch=2))
        try:
            answers.append(_served(rt, "m", items))
        finally:
            rt.stop(drain=False)
    for a, b in zip(*answers, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5)


def test_two_large_served_batches_in_a_worker_process_do_not_block_each_other(bert):
    """Two batches of 32 items × three 128-token inputs (98 KB each) sent back to back while
    the child answers the first (outputs of 512 KB): both are answered. Through the pipe,
    the second batch's send waited for the child, which waited to write the first answer."""
    from infermux.runtime.process_host import ProcessHost, RunnerSpec

    spec = RunnerSpec("m", bert, None, None, "torch", "cpu:0", (32,), {}, "host", 0, 4, 0,
                      seq_buckets=(128,), lengths=128)
    host = ProcessHost("m/cpu#0", (0,), [spec], depth=2, call_timeout_s=60.0)
    rows = [(np.arange(i, i + 128) % 100, np.ones(128, np.int64), np.zeros(128, np.int64))
            for i in range(32)]
    answers: list[list[np.ndarray] | None] = []

    def two_batches() -> None:
        host.send_rows("m", 32, rows)
        host.send_rows("m", 32, rows[::-1])
        answers.extend(host.receive()[1] for _ in range(2))

    try:
        host.start()
        host.wait_ready()
        caller = threading.Thread(target=two_batches, daemon=True)
        caller.start()
        caller.join(90)
        stuck = caller.is_alive()
        if stuck and host._proc is not None:
            host._proc.kill()  # unblocks the caller's send; close() would wait on the pipe too
        assert not stuck, "the two batches were never both answered"
    finally:
        host.close()
    first, second = answers
    assert first is not None and second is not None
    assert first[0].shape[:2] == (32, 128)
    np.testing.assert_allclose(first[0][0], second[0][-1], atol=1e-5)


@pytest.mark.parametrize(("inputs", "message"), [
    ([{"name": "features", "dtype": "float32", "shape": [16]}],
     "plan field models[0].inputs: input 'ids' is missing: the model takes ids: int64[batch, seq]"),
    ([{"name": "features", "dtype": "float32", "shape": [16]},
      {"name": "ids", "dtype": "int32", "shape": ["seq"]}],
     "plan field models[0].inputs[1]: input 'ids' is given as ids: int32[batch, seq], the "
     "model takes ids: int64[batch, seq] < 50"),
    ([{"name": "features", "dtype": "float32", "shape": [16]},
      {"name": "tokens", "dtype": "int64", "shape": ["seq"]}],
     "plan field models[0].inputs[1]: input 'tokens' is not one the model takes"),
])
def test_a_plan_input_that_does_not_fit_is_one_line(two, inputs, message):
    with pytest.raises(UsageError) as caught:
        run_plan(_plan(two[0], inputs=inputs))
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_model_without_a_mask_is_never_padded(two, bert):
    """The two-input network averages its ids' embeddings: padding 5 ids to 8 changes its
    scores, so its queries run only at the lengths it compiles. The tiny BERT masks its
    padding, so any length up to its longest runs, at its own outputs."""
    from infermux.engines import create_engine
    from infermux.runtime.inputs import SeqRunner
    from infermux.units import discover, select_units

    io = load_model(two[1]).spec_io
    assert not io.pads_exactly and load_model(bert).spec_io.pads_exactly
    ids = TensorSpec("ids", "int64", ("seq",))
    assert IOSpec((ids, TensorSpec("padding_mask", "int64", ("seq",)))).pads_exactly  # by name
    assert not IOSpec((ids, TensorSpec("segments", "int64", ("seq",)))).pads_exactly
    assert IOSpec((TensorSpec("x", "float32", (3,)),)).pads_exactly  # nothing to pad
    module = load_model(two[0]).module
    features, ids = np.zeros((1, 16), np.float32), np.arange(5)[None]
    padded = np.concatenate([ids, np.zeros((1, 3), np.int64)], axis=1)
    with torch.no_grad():  # why: the padding is data to this network
        assert not torch.allclose(module(torch.from_numpy(features), torch.from_numpy(ids)),
                                  module(torch.from_numpy(features), torch.from_numpy(padded)))
    with pytest.raises(UsageError, match=r"^plan field load.lengths: uniform:2-8 draws lengths "
                                         r"that m does not compile \(2, 3, 5, 6, \.\.\.\), and it has "
                                         r"no mask input .* \(e\.g\. 4,8\)"):
        run_plan(_plan(two[1], engine="onnxruntime", seq_buckets=[4, 8], lengths="uniform:2-8"))
    # Served rows that reach a runner anyway (the runtime's own API) fail there, not padded.
    engine, unit = create_engine("onnxruntime"), select_units("cpu", discover())[0]
    model = load_model(two[1])
    runner = SeqRunner(io, {n: engine.build(model, unit, 2, length=n) for n in (4, 8)})
    with pytest.raises(UsageError, match=r"sequence length 5 given; the model has no mask input"):
        runner.gather_input(runner.prepare_rows([[features[0], ids[0]]]), [0])
    runner.gather_input(runner.prepare_rows([[features[0], padded[0]]]), [0])
    assert runner.length == 8
    four = np.arange(4)
    with pytest.raises(UsageError, match=r"items of lengths \[4, 8\] in one batch"):
        runner.gather_input(runner.prepare_rows([[features[0], four], [features[0], padded[0]]]),
                            [0, 1])


def test_lengths_past_the_buckets_and_buckets_without_a_length_are_refused(two, tmp_path):
    with pytest.raises(UsageError, match=r"load.lengths uniform:2-64 go past "
                                         r"models\[0\].seq_buckets \[4, 8\]"):
        _plan(two[0], seq_buckets=[4, 8], lengths="uniform:2-64")
    with pytest.raises(UsageError, match=r"seq_buckets: the model has no dynamic dimension"):
        run_plan(_plan("tests/tiny_models.py:tiny_cnn", seq_buckets=[8]))


# -- step 2: `infermux run` and LoadGen ------------------------------------------------------


def test_run_takes_query_lengths_and_reports_tokens_per_second(two, tmp_path):
    """`infermux run --lengths 4,8` on a two-input ONNX file: queries are generated from its
    spec at lengths 4 and 8 (it has no mask, so only the lengths it compiles), and tokens/s
    (each query at its own length) is in the output, the JSON and the store."""
    import json
    import sqlite3

    import yaml

    from .conftest import invoke_cli

    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({
        "models": [{"name": "two", "model": two[1], "seq_buckets": [4, 8],
                    "replicas": [{"unit": "cpu:0", "engine": "onnxruntime", "batch": 4}]}],
        "dispatcher": {"cpu_workers": "thread"},
        "load": {"min_duration_s": 0.3, "min_queries": 32, "sample_pool": 64}}))
    db = tmp_path / "runs.db"
    run = invoke_cli("run", str(path), "--lengths", "4,8", "--json", "--db", str(db))
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)["result"]
    model = result["models"]["two"]
    assert 4 <= model["mean_length"] <= 8, model
    assert model["tokens_per_s"] == pytest.approx(model["items_per_s"] * model["mean_length"])
    assert result["tokens_per_s"] == pytest.approx(model["tokens_per_s"])
    with sqlite3.connect(db) as con:
        stored = json.loads(con.execute("SELECT record_json FROM run_trials").fetchone()[0])
    assert stored["tokens_per_s"] == pytest.approx(result["tokens_per_s"])
    text = invoke_cli("run", str(path), "--lengths", "8", "--no-store")
    assert text.returncode == 0, text.stderr
    assert "tok/s" in text.stdout
    bad = invoke_cli("run", str(path), "--lengths", "uniform:2-64", "--no-store")
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr
    assert "uniform:2-64" in lines[0] and "seq_buckets" in lines[0]


def test_fixed_lengths_run_at_their_bucket(bert):
    """Queries of 5 tokens run in the 8 bucket; tokens count their own length, not the bucket's."""
    report = run_plan(_plan(bert, seq_buckets=[8, 32], lengths=5, batch=2))
    model = report.final.models["m"]
    assert report.status == "complete" and model.mean_length == 5, model


# -- step 3: `serve` -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_server(bert, tmp_path_factory):
    """`infermux serve` of the tiny BERT (lengths 8 and 16 compiled) on a thread worker (the
    process path of served items is the plan test's above)."""
    from .test_serve import Server

    plan = {"name": "bert", "models": [{"name": "bert", "model": bert, "seq_buckets": [8, 16],
                                        "replicas": [{"unit": "cpu:0", "batch": 4}]}],
            "dispatcher": {"max_queue_delay_ms": 1, "cpu_workers": "thread"}}
    srv = Server(tmp_path_factory.mktemp("serve_bert"), plan, "--fronts", "1")
    yield srv
    code, out = srv.stop()
    assert code == 0, out


def _bert_request(n, length, seed=0):
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(1, 100, size=(n, length)),
            "attention_mask": np.ones((n, length), np.int64),
            "token_type_ids": np.zeros((n, length), np.int64)}


def _bert_reference(bert, request):
    module = load_model(bert).module
    with torch.inference_mode():
        outs = module(*[torch.from_numpy(request[k]) for k in
                        ("input_ids", "attention_mask", "token_type_ids")])
    return {"last_hidden_state": outs[0].numpy(), "pooler_output": outs[1].numpy()}


def test_serve_describes_every_input_and_output(bert_server):
    tgrpc = pytest.importorskip("tritonclient.grpc")
    thttp = pytest.importorskip("tritonclient.http")
    meta = thttp.InferenceServerClient(bert_server.http).get_model_metadata("bert")
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1]),
        ("token_type_ids", "INT64", [-1, -1])]
    assert [(t["name"], t["shape"]) for t in meta["outputs"]] == [
        ("last_hidden_state", [-1, -1, 32]), ("pooler_output", [-1, 32])]
    config = tgrpc.InferenceServerClient(bert_server.grpc).get_model_config("bert", as_json=True)
    assert [i["name"] for i in config["config"]["input"]] == [
        "input_ids", "attention_mask", "token_type_ids"]


@pytest.mark.parametrize(("protocol", "n", "length"), [("http", 2, 5), ("grpc", 3, 12)])
def test_serve_answers_int64_inputs_with_every_output(bert, bert_server, protocol, n, length):
    """Three INT64 inputs in, both outputs back at the request's own length, equal to the
    network's unpadded run (the batch ran padded to its length bucket)."""
    client_mod = pytest.importorskip(f"tritonclient.{protocol}")
    url = bert_server.http if protocol == "http" else bert_server.grpc
    client = client_mod.InferenceServerClient(url)
    request = _bert_request(n, length)
    inputs = []
    for name, array in request.items():
        tensor = client_mod.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    result = client.infer("bert", inputs)
    ref = _bert_reference(bert, request)
    for name in ("last_hidden_state", "pooler_output"):
        got = result.as_numpy(name)
        assert got.shape == ref[name].shape, (name, got.shape)
        np.testing.assert_allclose(got, ref[name], atol=1e-4)


@pytest.mark.parametrize(("change", "message"), [
    ({"input_ids": ("FP32", None)}, "input 'input_ids' datatype: FP32 is not accepted; the "
                                    "model takes INT64"),
    ({"attention_mask": ("INT64", (1, 6))}, "input 'attention_mask': seq is 6, another input "
                                            "has seq 5"),
    ({"all": ("INT64", (1, 20))}, "input 'input_ids': sequence length 20 given, the model takes "
                                  "at most 16"),
])
def test_serve_refuses_a_mistyped_or_misshapen_input_naming_it(bert_server, change, message):
    tgrpc = pytest.importorskip("tritonclient.grpc")
    thttp = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    for client_mod, url in ((thttp, bert_server.http), (tgrpc, bert_server.grpc)):
        inputs = []
        for name, array in _bert_request(1, 5).items():
            datatype, shape = change.get(name, change.get("all", ("INT64", None)))
            if shape is not None:
                array = np.ones(shape, np.int64)
            if datatype == "FP32":
                array = array.astype(np.float32)
            tensor = client_mod.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        with pytest.raises(InferenceServerException) as caught:
            client_mod.InferenceServerClient(url).infer("bert", inputs)
        assert message in str(caught.value), str(caught.value)


def _full_and_padded(seed):
    """A batch of 4 items of 16 tokens, and the same with item 1 cut to 9 tokens by its mask."""
    ids = np.random.default_rng(seed).integers(1, 100, size=(4, 16))
    full = [ids, np.ones((4, 16), np.int64), np.zeros((4, 16), np.int64)]
    padded = [ids, full[1].copy(), full[2]]
    padded[1][1, 9:] = 0
    return full, padded


def test_a_batch_without_padding_runs_without_the_mask_and_a_padded_one_with_it(bert):
    """`dense_attention`: the runner keeps a second forward that leaves the attention mask
    out (transformers then skips it) and runs it for batches whose masks are all ones; a
    batch with padding runs the masked forward. Both give the network's own outputs."""
    from infermux.engines import create_engine
    from infermux.units import discover, select_units

    model = load_model(bert)
    unit = select_units("cpu", discover())[0]
    engine = create_engine("torch")
    runner = engine.build(model, unit, 4, {"dense_attention": True}, length=16)
    assert runner._mask_at == [t.name for t in model.spec_io.inputs].index("attention_mask")
    # Off by default on a CPU: transformers' own check of the mask costs nothing there.
    assert engine.build(model, unit, 4, length=16)._mask_at is None
    full, padded = _full_and_padded(seed=3)
    ids = full[0]
    calls: list[bool] = []
    forward = runner._forward

    def spy(dense=False):
        calls.append(dense)
        return forward(dense)

    runner._forward = spy
    for arrays, dense in ((full, True), (padded, False), (full, True)):
        runner.set_inputs(arrays)
        runner.run()
        assert calls[-1] is dense
        with torch.inference_mode():
            ref = model.module(*[torch.from_numpy(a) for a in arrays])
        for got, want in zip(runner.outputs(), ref, strict=True):
            np.testing.assert_allclose(got, want.numpy(), atol=1e-5)
    # The padded item's outputs are not what the mask-free forward would give it (by far more
    # than the tolerance the outputs were held to above).
    with torch.inference_mode():
        unmasked = model.module(torch.from_numpy(ids), None,
                                torch.from_numpy(full[2]))
        masked = model.module(*[torch.from_numpy(a) for a in padded])
    assert np.abs(unmasked[1][1].numpy() - masked[1][1].numpy()).max() > 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_on_a_gpu_batches_with_and_without_padding_replay_their_own_graph(bert):
    """On a CUDA unit `dense_attention` is on by default: a graph with the mask and one
    without are captured; each batch replays its own and gives the network's outputs."""
    from infermux.engines import create_engine
    from infermux.units import discover, select_units

    model = load_model(bert)
    unit = select_units("cuda:0/fp32", discover())[0]
    runner = create_engine("torch").build(model, unit, 4, length=16)
    assert runner._graph is not None and runner._graph_dense is not None
    full, padded = _full_and_padded(seed=4)
    for arrays in (full, padded, full):
        runner.set_inputs(arrays)
        runner.run()
        with torch.inference_mode():
            ref = model.module(*[torch.from_numpy(a) for a in arrays])
        for got, want in zip(runner.outputs(), ref, strict=True):
            np.testing.assert_allclose(got, want.numpy(), atol=1e-4)
