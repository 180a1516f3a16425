"""`infermux serve --fronts 2` of networks of several inputs: every input through the slabs.

One server with two front processes serves a two-layer BERT (three INT64 inputs, sequence
buckets 8 and 16, two outputs of which one has the sequence dim) and the two-input module
(FP32 features and INT64 ids) from tests/conftest.py. Driven by Triton's own clients over HTTP
and gRPC, on fresh connections (the kernel spreads them over both fronts): the outputs equal
the network's own run at the request's length, with the tensors in the requests and in system
shared memory; a bad input is a 400 / INVALID_ARGUMENT naming it. The slab layout of several
inputs is checked directly.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("uvicorn")

import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
import tritonclient.utils.shared_memory as tshm
from tritonclient.utils import InferenceServerException

from infermux.serve.shm import SlabLayout
from tests.test_serve import Server

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory")

_BERT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


#: A classifier that answers its scores (FP32), its best class (INT64) and an id past FP32's 24
#: bits (INT64): integer outputs must cross every front as themselves, exactly, under the
#: names the module gives them.
LABELS = '''
import torch
from torch import nn


class Labels(nn.Module):
    input_shape = (3, 2, 2)
    outputs = ["scores", "label", "big"]

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        scores = self.head(x.flatten(1))
        label = scores.argmax(1)
        return scores, label, label + 2**40 + 3


def build():
    torch.manual_seed(0)
    return Labels()
'''


@pytest.fixture(scope="module")
def labels(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The factory reference of `LABELS`, written to a file."""
    path = tmp_path_factory.mktemp("labels") / "labels.py"
    path.write_text(LABELS)
    return f"{path}:build"


def _several_plan(tiny_bert: str, two_inputs: tuple[str, str]) -> dict[str, Any]:
    return {"name": "several", "models": [
        {"name": "bert", "model": tiny_bert, "seq_buckets": [8, 16],
         "replicas": [{"unit": "cpu:0", "batch": 4}]},
        {"name": "two", "model": two_inputs[0], "seq_buckets": [8],
         "replicas": [{"unit": "cpu:1", "engine": "torch", "batch": 4}]}],
        "dispatcher": {"max_queue_delay_ms": 1, "cpu_workers": "thread"}}


@pytest.fixture(scope="module")
def server(tiny_bert: str, two_inputs: tuple[str, str],
           tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = Server(tmp_path_factory.mktemp("serve_several"), _several_plan(tiny_bert, two_inputs),
                 "--fronts", "2")
    yield srv
    code, out = srv.stop()
    assert code == 0, out


def _need_triton() -> None:
    """Skip, saying why, where no Triton build is found."""
    from infermux.errors import UsageError
    from infermux.serve.triton_front import find_triton

    try:
        find_triton()
    except UsageError as exc:
        pytest.skip(f"no Triton build: {exc}")


@pytest.fixture(scope="module", params=["native", "python"])
def triton_server(tiny_bert: str, two_inputs: tuple[str, str],
                  tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    """The same plan behind Triton's server (`--front triton`), where a Triton build exists:
    its instances infermux's native backend, or Python-backend stubs."""
    _need_triton()
    srv = Server(tmp_path_factory.mktemp("serve_several_triton"),
                 _several_plan(tiny_bert, two_inputs), "--front", "triton", "--fronts", "2",
                 "--triton-backend", request.param)
    assert srv.ready["triton_backend"] == request.param
    yield srv
    code, out = srv.stop()
    assert code == 0, out


@pytest.fixture(scope="module")
def bert_module(tiny_bert: str) -> Any:
    from infermux.models import load_model

    return load_model(tiny_bert).module


@pytest.fixture(scope="module")
def two_module(two_inputs: tuple[str, str]) -> Any:
    from infermux.models import load_model

    return load_model(two_inputs[0]).module


def _bert_request(n: int, length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(1, 100, size=(n, length)),
            "attention_mask": np.ones((n, length), np.int64),
            "token_type_ids": np.zeros((n, length), np.int64)}


def _bert_reference(module: Any, request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import torch

    with torch.inference_mode():
        outs = module(*[torch.from_numpy(request[k]) for k in _BERT_INPUTS])
    return {"last_hidden_state": outs[0].numpy(), "pooler_output": outs[1].numpy()}


def _infer(protocol: str, srv: Server, model: str, request: dict[str, np.ndarray],
           outputs: list[str]) -> dict[str, np.ndarray]:
    """One request on a fresh connection (so the kernel picks a front for it)."""
    mod = thttp if protocol == "http" else tgrpc
    client = mod.InferenceServerClient(srv.http if protocol == "http" else srv.grpc)
    try:
        inputs = []
        for name, array in request.items():
            datatype = "FP32" if array.dtype == np.float32 else "INT64"
            tensor = mod.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer(model, inputs)
        return {name: result.as_numpy(name) for name in outputs}
    finally:
        client.close()


_POOLED = """
from infermux import hf


def build():
    net = hf.build({folder!r})
    net.outputs = [t for t in net.outputs if t.name == "pooler_output"]
    net.output_names = ["pooler_output"]
    return net
"""


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_outputs_of_one_shape_are_answered_in_the_requests_slots(
        tiny_bert: str, bert_module: Any, tmp_path: Any, protocol: str) -> None:
    """The BERT as a service answering only its pooled vector (no sequence dim in any output):
    the runtime writes each answer into the request's slots (no shapes frame) and requests of
    several lengths and sizes through two fronts get the network's pooled outputs."""
    factory = tmp_path / "pooled.py"
    factory.write_text(_POOLED.format(folder=tiny_bert.removeprefix("hf:")))
    plan = {"name": "pooled", "models": [
        {"name": "bert", "model": f"{factory}:build", "seq_buckets": [8, 16],
         "replicas": [{"unit": "cpu:0", "batch": 4}]}],
        "dispatcher": {"max_queue_delay_ms": 1, "cpu_workers": "thread"}}
    srv = Server(tmp_path, plan, "--fronts", "2")
    shapes = [(1, 5), (3, 12), (2, 16), (4, 8), (1, 16)]
    try:
        got = [_infer(protocol, srv, "bert", _bert_request(n, length, k), ["pooler_output"])
               for k, (n, length) in enumerate(shapes)]
    finally:
        code, out = srv.stop()
    assert code == 0, out
    for k, (n, length) in enumerate(shapes):
        want = _bert_reference(bert_module, _bert_request(n, length, k))["pooler_output"]
        assert got[k]["pooler_output"].shape == want.shape == (n, want.shape[1])
        np.testing.assert_allclose(got[k]["pooler_output"], want, atol=1e-4)


def test_slab_layout_of_several_inputs_packs_them_at_the_request_length() -> None:
    # features (16,) FP32 and ids (seq,) INT64, longest length 8; outputs (seq, 2) and (4,),
    # (8, 2) and (4,) at the longest length.
    layout = SlabLayout((), ((8, 2), (4,)), (((16,), "<f4"), ((-1,), "<i8")), 8, slots=6)
    assert layout.input_item_bytes == 16 * 4 + 8 * 8
    assert layout.slot_bytes == 16 * 4 + 8 * 8 + 8 * 2 * 4 + 4 * 4
    buf = bytearray(layout.slot_bytes * 6)
    features, ids = layout.several_inputs(buf, 2, 3, 5)
    assert features.shape == (3, 16) and ids.shape == (3, 5) and ids.dtype == np.int64
    features[...], ids[...] = 1.5, 7
    hidden, scores = layout.outputs(buf, 2, 3, [(5, 2), (4,)])
    assert hidden.shape == (3, 5, 2) and scores.shape == (3, 4)
    hidden[...], scores[...] = 2.0, 3.0
    # Each array of the request lies apart from the others, its inputs in its three slots'
    # part of the input region and its outputs in theirs of the output region.
    base = np.frombuffer(buf, np.uint8).ctypes.data
    spans = sorted((a.ctypes.data - base, a.ctypes.data - base + a.nbytes)
                   for a in (features, ids, hidden, scores))
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    inputs_at, outputs_at = 6 * layout.input_item_bytes, sum(layout.output_item_bytes)
    assert spans[0][0] == 2 * layout.input_item_bytes
    assert spans[1][1] <= 5 * layout.input_item_bytes
    assert spans[2][0] == inputs_at + 2 * outputs_at
    assert spans[-1][1] <= inputs_at + 5 * outputs_at
    assert (layout.several_inputs(buf, 2, 3, 5)[1] == 7).all()
    assert not np.frombuffer(buf, np.uint8)[:2 * layout.input_item_bytes].any()
    with pytest.raises(ValueError, match="exceed the slab's room"):
        layout.outputs(buf, 2, 3, [(9, 2), (4,)])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_several_inputs_through_either_front_equal_the_network(
        server: Server, bert_module: Any, two_module: Any, protocol: str) -> None:
    """BERT requests of several lengths and sizes, and two-input requests, at once."""
    import torch

    assert server.ready["fronts"] == 2
    results: dict[int, dict[str, np.ndarray]] = {}
    errors: list[BaseException] = []
    shapes = [(1, 5), (3, 12), (2, 16), (4, 8), (2, 3), (1, 16)]

    def bert(k: int) -> None:
        try:
            n, length = shapes[k]
            results[k] = _infer(protocol, server, "bert", _bert_request(n, length, k),
                                ["last_hidden_state", "pooler_output"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def two(k: int) -> None:
        try:
            rng = np.random.default_rng(k)
            request = {"features": rng.standard_normal((1 + k % 3, 16)).astype(np.float32),
                       "ids": rng.integers(0, 50, size=(1 + k % 3, 8))}
            results[100 + k] = _infer(protocol, server, "two", request, ["scores"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=bert, args=(k,)) for k in range(len(shapes))]
    threads += [threading.Thread(target=two, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(results) == len(shapes) + 4
    for k, (n, length) in enumerate(shapes):
        ref = _bert_reference(bert_module, _bert_request(n, length, k))
        for name, want in ref.items():
            got = results[k][name]
            assert got.shape == want.shape, (k, name, got.shape)
            np.testing.assert_allclose(got, want, atol=1e-4)
    for k in range(4):
        rng = np.random.default_rng(k)
        features = rng.standard_normal((1 + k % 3, 16)).astype(np.float32)
        ids = rng.integers(0, 50, size=(1 + k % 3, 8))
        with torch.inference_mode():
            want = two_module(torch.from_numpy(features), torch.from_numpy(ids)).numpy()
        np.testing.assert_allclose(results[100 + k]["scores"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_several_inputs_through_triton_equal_the_network(
        triton_server: Server, bert_module: Any, two_module: Any, protocol: str) -> None:
    """The same requests through Triton's server: each Triton batch (one length) to the runtime."""
    test_several_inputs_through_either_front_equal_the_network(
        triton_server, bert_module, two_module, protocol)


def _integer_outputs_exact(srv: Server, labels: str) -> None:
    """The labels model's class and big id come back INT64 and exact over HTTP (binary and
    JSON) and gRPC, as its metadata says, under its own names; its scores stay FP32."""
    import torch

    from infermux.models import load_model

    module = load_model(labels).module
    x = np.random.default_rng(0).standard_normal((3, 3, 2, 2)).astype(np.float32)
    with torch.no_grad():
        want = [t.numpy() for t in module(torch.from_numpy(x))]
    assert want[2].max() > 2**40  # past what FP32 holds exactly
    names = ["scores", "label", "big"]
    for mod, url in ((thttp, srv.http), (tgrpc, srv.grpc)):
        client = mod.InferenceServerClient(url)
        try:
            meta = client.get_model_metadata("labels")
            outputs = meta["outputs"] if isinstance(meta, dict) else [
                {"name": o.name, "datatype": o.datatype} for o in meta.outputs]
            assert [(o["name"], o["datatype"]) for o in outputs] == list(
                zip(names, ["FP32", "INT64", "INT64"], strict=True))
            tensor = mod.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            for binary in ((True, False) if mod is thttp else (True,)):
                asked = ([thttp.InferRequestedOutput(n, binary_data=binary) for n in names]
                         if mod is thttp else None)
                result = client.infer("labels", [tensor], outputs=asked)
                np.testing.assert_allclose(result.as_numpy("scores"), want[0], atol=1e-5)
                for name, expected in zip(names[1:], want[1:], strict=True):
                    got = result.as_numpy(name)
                    assert got.dtype == np.int64, (url, binary, name, got.dtype)
                    np.testing.assert_array_equal(got.reshape(expected.shape), expected)
        finally:
            client.close()


@pytest.mark.parametrize("front", ["own", "own:onnx", "triton:native", "triton:python"])
def test_integer_outputs_cross_every_front_as_themselves(labels: str, front: str,
                                                         tmp_path_factory: pytest.TempPathFactory
                                                         ) -> None:
    """Two front processes, or Triton's server with either backend: the slabs hold each output
    in its own dtype, and Triton's configuration states it. `own:onnx` serves the module's
    ONNX export (its graph's output names, its int64 outputs) on ONNX Runtime."""
    kind, _, backend = front.partition(":")
    folder = tmp_path_factory.mktemp("serve_labels")
    model, engine = labels, "torch"
    if backend == "onnx":
        import torch

        from infermux.models import load_model

        model, engine, backend = str(folder / "labels.onnx"), "onnxruntime", ""
        torch.onnx.export(load_model(labels).module, (torch.zeros(1, 3, 2, 2),), model,
                          input_names=["input"], output_names=["scores", "label", "big"],
                          dynamic_axes={n: {0: "batch"} for n in ("input", "scores", "label",
                                                                   "big")}, dynamo=False)
    if kind == "triton":
        _need_triton()
    plan = {"name": "labels", "models": [
        {"name": "labels", "model": model,
         "replicas": [{"unit": "cpu:0", "engine": engine, "batch": 4}]}],
        "dispatcher": {"max_queue_delay_ms": 1, "cpu_workers": "thread"}}
    srv = Server(folder, plan, "--fronts", "2", "--front", kind,
                 *(["--triton-backend", backend] if backend else []))
    try:
        _integer_outputs_exact(srv, labels)
        if kind == "triton":
            assert srv.ready["triton_backend"] == backend
            config = thttp.InferenceServerClient(srv.http).get_model_config("labels")
            assert [o["data_type"] for o in config["output"]] == [
                "TYPE_FP32", "TYPE_INT64", "TYPE_INT64"]
    finally:
        code, out = srv.stop()
    assert code == 0, out


def test_triton_answers_only_the_outputs_asked_for(triton_server: Server,
                                                  bert_module: Any) -> None:
    request = _bert_request(2, 12, seed=3)
    client = tgrpc.InferenceServerClient(triton_server.grpc)
    try:
        inputs = []
        for name, array in request.items():
            tensor = tgrpc.InferInput(name, list(array.shape), "INT64")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer("bert", inputs,
                              outputs=[tgrpc.InferRequestedOutput("pooler_output")])
    finally:
        client.close()
    assert result.get_output("last_hidden_state") is None
    want = _bert_reference(bert_module, request)["pooler_output"]
    np.testing.assert_allclose(result.as_numpy("pooler_output"), want, atol=1e-4)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_several_inputs_from_system_shared_memory(server: Server, bert_module: Any,
                                                  protocol: str) -> None:
    """Every input read from the client's regions and both outputs written into one."""
    mod = thttp if protocol == "http" else tgrpc
    tag = uuid.uuid4().hex[:8]
    request = _bert_request(2, 6, seed=11)
    ref = _bert_reference(bert_module, request)
    in_bytes = sum(a.nbytes for a in request.values())
    out_bytes = sum(a.nbytes for a in ref.values())
    handles = [tshm.create_shared_memory_region(f"in{tag}", f"/in{tag}", in_bytes),
               tshm.create_shared_memory_region(f"out{tag}", f"/out{tag}", out_bytes)]
    url = server.http if protocol == "http" else server.grpc
    try:
        tshm.set_shared_memory_region(handles[0], [request[k] for k in _BERT_INPUTS])
        admin = mod.InferenceServerClient(url)
        admin.register_system_shared_memory(f"in{tag}", f"/in{tag}", in_bytes)
        admin.register_system_shared_memory(f"out{tag}", f"/out{tag}", out_bytes)
        for _ in range(4):  # fresh connections: both fronts serve them
            client = mod.InferenceServerClient(url)
            inputs, offset = [], 0
            for name in _BERT_INPUTS:
                tensor = mod.InferInput(name, list(request[name].shape), "INT64")
                tensor.set_shared_memory(f"in{tag}", request[name].nbytes, offset)
                inputs.append(tensor)
                offset += request[name].nbytes
            outputs, offset = [], 0
            for name, want in ref.items():
                out = mod.InferRequestedOutput(name)
                out.set_shared_memory(f"out{tag}", want.nbytes, offset)
                outputs.append(out)
                offset += want.nbytes
            client.infer("bert", inputs, outputs=outputs)
            offset = 0
            for want in ref.values():
                got = tshm.get_contents_as_numpy(handles[1], np.float32, list(want.shape),
                                                 offset=offset)
                np.testing.assert_allclose(got, want, atol=1e-4)
                offset += want.nbytes
            tshm.set_shared_memory_region(handles[1], [np.zeros(out_bytes // 4, np.float32)])
            client.close()
        admin.unregister_system_shared_memory()
        admin.close()
    finally:
        for h in handles:
            tshm.destroy_shared_memory_region(h)


@pytest.mark.parametrize(("model", "change", "message"), [
    ("bert", {"input_ids": ("FP32", None)},
     "input 'input_ids' datatype: FP32 is not accepted; the model takes INT64"),
    ("bert", {"attention_mask": ("INT64", (1, 6))},
     "input 'attention_mask': seq is 6, another input has seq 5"),
    ("bert", {"all": ("INT64", (1, 20))},
     "input 'input_ids': sequence length 20 given, the model takes at most 16"),
    ("two", {"features": ("FP32", (1, 15))}, "input 'features' shape [1, 15] does not match"),
    # Its ids are a bag of embeddings with no mask: padding 5 ids to 8 would change its scores.
    ("two", {"ids": ("INT64", (1, 5))}, "input 'ids': sequence length 5 given; model 'two' has "
     "no mask input, so padding would change its outputs, and it runs only at the lengths it "
     "compiles (8)"),
])
def test_a_bad_input_is_400_or_invalid_argument_naming_it(server: Server, model: str,
                                                          change: dict[str, Any],
                                                          message: str) -> None:
    _refused_naming_it(server, model, change, message)


def test_behind_triton_a_model_without_a_mask_refuses_a_length_it_does_not_compile(
        triton_server: Server) -> None:
    """Triton passes any length of a -1 dim; the runtime refuses one it cannot pad, each
    backend's request answered with the runtime's line, and the model serves on."""
    _refused_naming_it(triton_server, "two", {"ids": ("INT64", (1, 5))},
                       "sequence length 5 given; model 'two' has no mask input")
    request = {"features": np.zeros((2, 16), np.float32), "ids": np.ones((2, 8), np.int64)}
    assert _infer("grpc", triton_server, "two", request, ["scores"])["scores"].shape == (2, 4)


def _refused_naming_it(server: Server, model: str, change: dict[str, Any], message: str) -> None:
    for protocol, mod, url in (("http", thttp, server.http), ("grpc", tgrpc, server.grpc)):
        request = (_bert_request(1, 5, 0) if model == "bert" else
                   {"features": np.zeros((1, 16), np.float32), "ids": np.ones((1, 5), np.int64)})
        inputs = []
        for name, array in request.items():
            datatype, shape = change.get(name, change.get("all", (None, None)))
            if shape is not None:
                array = np.ones(shape, array.dtype)
            datatype = datatype or ("FP32" if array.dtype == np.float32 else "INT64")
            if datatype == "FP32":
                array = array.astype(np.float32)
            tensor = mod.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        with pytest.raises(InferenceServerException) as caught:
            mod.InferenceServerClient(url).infer(model, inputs)
        assert message in str(caught.value), (protocol, str(caught.value))
        assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), (
            protocol, caught.value.status())


#: Int32 ids and a bool mask (a masked mean of embeddings), answering FP16 scores and a BOOL
#: flag per score: inputs of the datatypes exporters write besides INT64, padded under the mask.
MASKED = '''
import torch
from torch import nn


class Masked(nn.Module):
    inputs = [{"name": "ids", "dtype": "int32", "shape": ["seq"]},
              {"name": "mask", "dtype": "bool", "shape": ["seq"]}]
    default_dims = {"seq": 8}

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids, mask):
        weight = mask.to(torch.float32).unsqueeze(-1)
        pooled = (self.embed(ids.long()) * weight).sum(1) / weight.sum(1).clamp(min=1)
        scores = self.head(pooled)
        return scores.to(torch.float16), scores > 0


def build():
    torch.manual_seed(0)
    return Masked()
'''


@pytest.mark.parametrize("front", ["own", "triton"])
def test_int32_ids_and_a_bool_mask_are_padded_under_the_mask(
        front: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """An ONNX file of INT32 ids and a BOOL mask: requests of 5 and 13 tokens (buckets 8 and
    16) answer as the file does unpadded, its FP16 output as FP32 and its flags as BOOL."""
    import onnxruntime as ort
    import torch

    from infermux.models import load_model

    if front == "triton":
        _need_triton()
    folder = tmp_path_factory.mktemp("serve_masked")
    (folder / "masked.py").write_text(MASKED)
    path = str(folder / "masked.onnx")
    torch.onnx.export(load_model(f"{folder / 'masked.py'}:build").module,
                      (torch.zeros(2, 7, dtype=torch.int32), torch.ones(2, 7, dtype=torch.bool)),
                      path, input_names=["ids", "mask"], output_names=["scores", "flag"],
                      dynamic_axes={"ids": {0: "b", 1: "seq"}, "mask": {0: "b", 1: "seq"},
                                    "scores": {0: "b"}, "flag": {0: "b"}}, dynamo=False)
    plan = {"name": "masked", "models": [
        {"name": "masked", "model": path, "seq_buckets": [8, 16],
         "replicas": [{"unit": "cpu:0", "engine": "onnxruntime", "batch": 4}]}],
        "dispatcher": {"max_queue_delay_ms": 1, "cpu_workers": "thread"}}
    srv = Server(folder, plan, "--fronts", "2", "--front", front)
    session = ort.InferenceSession(path)
    rng = np.random.default_rng(0)
    try:
        for mod, url in ((thttp, srv.http), (tgrpc, srv.grpc)):
            client = mod.InferenceServerClient(url)
            meta = client.get_model_metadata("masked")
            outputs = meta["outputs"] if isinstance(meta, dict) else [
                {"name": o.name, "datatype": o.datatype} for o in meta.outputs]
            assert [(o["name"], o["datatype"]) for o in outputs] == [("scores", "FP32"),
                                                                     ("flag", "BOOL")]
            for length in (5, 13):
                ids = rng.integers(0, 100, (3, length)).astype(np.int32)
                mask = np.ones((3, length), bool)
                mask[1, length - 2:] = False  # the client's own padding, masked too
                tensors = []
                for name, array, datatype in (("ids", ids, "INT32"), ("mask", mask, "BOOL")):
                    tensor = mod.InferInput(name, list(array.shape), datatype)
                    tensor.set_data_from_numpy(array)
                    tensors.append(tensor)
                result = client.infer("masked", tensors)
                scores, flag = session.run(None, {"ids": ids, "mask": mask})
                np.testing.assert_allclose(result.as_numpy("scores"), scores.astype(np.float32),
                                           atol=2e-3)
                got = result.as_numpy("flag")
                assert got.dtype == np.bool_
                np.testing.assert_array_equal(got, flag)
            client.close()
    finally:
        code, out = srv.stop()
    assert code == 0, out
