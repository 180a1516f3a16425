"""Transformer encoders on the CPU engines: the export's attention form, ONNX Runtime's fused
graph and dynamic int8, against PyTorch's fp32 outputs; bad options as one line.

The network is a two-layer BERT built from a config folder (random weights, nothing downloaded).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infermux.agreement import TOLERANCES
from infermux.engines import create_engine
from infermux.engines.onnxruntime import OrtOptions
from infermux.errors import UsageError
from infermux.export import export_onnx
from infermux.hf import OWN_SDPA
from infermux.models import load_model
from infermux.units import Unit, discover, select_units

from .conftest import invoke_cli

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

_BATCH, _SEQ = 3, 16


@pytest.fixture(scope="module")
def bert(tiny_bert):
    return load_model(tiny_bert)


def _unit(spec):
    return select_units(spec, discover())[0]


def _inputs(model):
    arrays = model.spec_io.generate(_BATCH, {"seq": _SEQ}, np.random.default_rng(3))
    arrays[1][0, _SEQ // 2:] = 0  # one padded row: the mask must reach the fused attention
    return arrays


def _torch_outputs(model, arrays):
    with torch.inference_mode():
        return [t.numpy() for t in model.module(*(torch.from_numpy(a) for a in arrays))]


def _rel_err(got, want):
    return max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want,
                                                                           strict=True))


def test_the_export_writes_attention_out_and_leaves_torch_as_it_was(bert):
    exported = export_onnx(bert)
    ops = {n.op_type for n in onnx.load(str(exported.path)).graph.node}
    # matmul-softmax-matmul, not scaled_dot_product_attention's NaN-guarded form.
    assert "Softmax" in ops and "IsNaN" not in ops
    # torch keeps its own: transformers' SDPA under infermux's name (a None mask: no mask).
    assert bert.module.model.config._attn_implementation == OWN_SDPA
    assert bert.module.attention_shape() == (2, 32)


def test_fused_onnxruntime_equals_torch_and_records_what_it_fused(bert):
    arrays = _inputs(bert)
    want = _torch_outputs(bert, arrays)
    runner = create_engine("onnxruntime").build(bert, _unit("cpu"), _BATCH,
                                                {"transformer_fusion": True}, length=_SEQ)
    got = runner.infer_inputs(arrays)
    assert _rel_err(got, want) <= TOLERANCES["fp32"]
    assert runner.options["fused_operators"] == {
        "Attention": 2, "BiasGelu": 2, "EmbedLayerNormalization": 1, "SkipLayerNormalization": 4}
    assert runner.options["precision"] == "fp32"
    fused = onnx.load(runner.options["onnx_file"])
    assert {n.domain for n in fused.graph.node if n.op_type == "Attention"} == {"com.microsoft"}


@pytest.mark.parametrize("fusion", [False, True])
def test_dynamic_int8_is_within_the_int8_tolerance(bert, fusion):
    arrays = _inputs(bert)
    want = _torch_outputs(bert, arrays)
    runner = create_engine("onnxruntime").build(bert, _unit("cpu/int8"), _BATCH,
                                                {"transformer_fusion": fusion}, length=_SEQ)
    got = runner.infer_inputs(arrays)
    err = _rel_err(got, want)
    assert 1e-5 < err <= TOLERANCES["int8"], err  # really int8, and close enough
    assert runner.options["precision"] == "int8"
    assert runner.options["quantize_method"] == "dynamic"
    ops = {n.op_type for n in onnx.load(runner.options["onnx_file"]).graph.node}
    assert "DynamicQuantizeLinear" in ops or "DynamicQuantizeMatMul" in ops
    if fusion:
        assert "QAttention" in ops


def test_bad_options_are_one_line(bert, tiny_bert, module_cache_dir):
    engine = create_engine("onnxruntime")
    cases = [
        ({"transformer_fusion": "maybe"}, "cpu", "option transformer_fusion='maybe'"),
        ({"quantize_method": "dynamic"}, "cpu", "quantize_method=dynamic makes int8: use the "
                                                "unit cpu/int8"),
        ({"quantize_method": "minmax"}, "cpu/int8", "takes several or integer inputs; the "
                                                    "cpu/int8 precision needs a calibrated"),
    ]
    for options, unit, message in cases:
        with pytest.raises(UsageError) as caught:
            engine.build(bert, _unit(unit), 1, options, length=8)
        assert message in str(caught.value) and "\n" not in str(caught.value)
    gpu = Unit("cuda:0/fp32", "cuda", "cuda:0", "fp32", "H100", "cuda:0")
    with pytest.raises(UsageError, match="transformer_fusion=true is for ONNX Runtime's CPU "
                                         "provider, not 'cuda:0/fp32'"):
        OrtOptions(transformer_fusion=True).resolve(gpu)
    env = {"INFERMUX_CACHE_DIR": str(module_cache_dir)}
    bad = invoke_cli("bench", "-m", tiny_bert, "-u", "cpu", "--engine", "onnxruntime", "-b", "1",
                     "--seq", "8", "-o", "transformer_fusion=maybe", "--no-store", env=env)
    assert bad.returncode != 0 and "transformer_fusion" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_quantize_command_writes_the_dynamic_int8_file(tiny_bert, module_cache_dir, tmp_path):
    import json

    env = {"INFERMUX_CACHE_DIR": str(module_cache_dir)}
    out = tmp_path / "bert-int8.onnx"
    done = invoke_cli("quantize", "-m", tiny_bert, "--method", "dynamic", "--output", str(out),
                      "--no-store", "--json", env=env)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["quantize_method"] == "dynamic" and summary["model_precision"] == "int8"
    assert "MatMulInteger" in {n.op_type for n in onnx.load(str(out)).graph.node}
    static = invoke_cli("quantize", "-m", tiny_bert, "--no-store", env=env)
    assert static.returncode != 0 and "use --method dynamic" in static.stderr
    assert "Traceback" not in static.stderr


def test_infermux_s_sdpa_name_leaves_out_only_a_mask_that_would_mask_nothing():
    """No padding mask on a bidirectional attention: no mask. A padding mask, a sliding
    window shorter than the keys, or a caller that does not allow leaving it out (causal
    masks): the mask transformers' SDPA builds."""
    from transformers.masking_utils import bidirectional_mask_function, sdpa_mask

    from infermux.hf import own_sdpa_mask

    common = dict(batch_size=2, q_length=6, kv_length=6, mask_function=bidirectional_mask_function,
                  allow_is_causal_skip=False, allow_is_bidirectional_skip=True)
    assert own_sdpa_mask(attention_mask=None, **common) is None
    padded = torch.ones(2, 6, dtype=torch.bool)
    padded[1, 4:] = False
    got = own_sdpa_mask(attention_mask=padded, **common)
    assert got is not None and torch.equal(got, sdpa_mask(attention_mask=padded, **common))
    assert not bool(got[1, 0, 0, 5])  # the padding is masked
    window = own_sdpa_mask(attention_mask=None, local_size=3, **common)
    assert window is not None and torch.equal(window, sdpa_mask(attention_mask=None, local_size=3,
                                                            **common))
    assert own_sdpa_mask(attention_mask=None, local_size=8, **common) is None
    kept = {**common, "allow_is_bidirectional_skip": False}
    assert torch.equal(own_sdpa_mask(attention_mask=padded, **kept),
                   sdpa_mask(attention_mask=padded, **kept))
