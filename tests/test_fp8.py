"""FP8 matrix products (`engines.fp8`, the torch engine's `precision: fp8`) and the tuner's use of them.

The conversion runs on the CPU too (torch's `_scaled_mm` has a CPU kernel), so its arithmetic is
tested here on real modules; the engine's GPU build is tested where a GPU with FP8 tensor cores is.
"""

from __future__ import annotations

import pytest
import torch

from infermux.engines import fp8
from infermux.engines.pytorch import TorchOptions
from infermux.errors import UsageError
from infermux.tune.space import option_variants
from infermux.units import Unit


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 10))  # 10 outputs: not a multiple of 16


def _gpu(capability: str = "9.0", mode: str = "fp16") -> Unit:
    return Unit(id=f"cuda:0/{mode}", kind="cuda", device="cuda:0", mode=mode, name="GPU",
                contention_domain="gpu:0", details={"compute_capability": capability})


def test_calibration_records_each_convertible_linear_input_amax():
    model = _mlp()
    x = torch.randn(48, 64)
    amax = fp8.calibrate(model, [x])
    assert set(amax) == {"0", "2"}  # the 32→10 classifier is left in the unit's precision
    assert amax["0"] == pytest.approx(float(x.abs().max()))
    with torch.inference_mode():
        hidden = model[1](model[0](x))
    assert amax["2"] == pytest.approx(float(hidden.abs().max()), rel=1e-6)


def test_fp8_products_stay_close_to_the_network_and_fall_back_on_unaligned_rows():
    model = _mlp()
    x = torch.randn(48, 64)
    with torch.inference_mode():
        ref = model(x)
        ref_3 = model(x[:3])
    assert fp8.to_fp8(model, fp8.calibrate(model, [x]), fast_accum=False) == 2
    assert [type(m).__name__ for m in model] == ["_FP8Linear", "GELU", "_FP8Linear", "ReLU",
                                                 "Linear"]
    with torch.inference_mode():
        out = model(x)
        out_3 = model(x[:3])  # 3 rows: not a multiple of 16, the unit's own product
    rel = float((out - ref).abs().max() / ref.abs().max())
    # e4m3 keeps 3 mantissa bits: a few percent, far from a wrong network's error.
    assert 1e-4 < rel < 0.1
    assert torch.allclose(out_3, ref_3, atol=1e-6)


def test_activations_past_the_calibrated_range_saturate_instead_of_overflowing():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    fp8.to_fp8(model, fp8.calibrate(model, [torch.randn(16, 16) * 0.01]), fast_accum=False)
    with torch.inference_mode():
        out = model(torch.randn(16, 16) * 1000)
    assert torch.isfinite(out).all()


def test_linear_share_tells_transformers_from_convolution_nets():
    import torchvision

    assert fp8.linear_share(torchvision.models.resnet18()) == 0.0  # fc 512→1000
    assert fp8.linear_share(_mlp()) > 0.95
    assert fp8.linear_share(torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3))) == 0.0


@pytest.mark.parametrize(("unit", "words"), [
    (Unit(id="cpu", kind="cpu", device="cpu", mode="fp32", name="CPU", contention_domain="cpu"),
     "needs a CUDA unit"),
    (_gpu(mode="fp32"), "cuda:N/fp16 or cuda:N/bf16"),
    (_gpu(capability="8.0"), r"compute capability 8\.9 or later\), this GPU has 8\.0"),
])
def test_the_option_on_a_unit_that_cannot_run_it_is_one_clear_line(unit, words):
    with pytest.raises(UsageError, match=words) as info:
        TorchOptions(precision="fp8").resolve(unit, 2)
    assert "\n" not in str(info.value)
    assert "drop the option" in str(info.value)


def test_the_option_resolves_on_an_fp8_gpu_unit():
    opts = TorchOptions(precision="fp8").resolve(_gpu(), 2)
    assert opts.precision == "fp8"
    assert TorchOptions(precision="fp8").resolve(_gpu(mode="bf16"), 2).precision == "fp8"


def test_the_tuner_tries_fp8_only_where_it_can_run_and_the_network_warrants_it():
    with_fp8 = option_variants("torch", _gpu(), compile_modes=("default",), fp8=True)
    assert with_fp8[-1] == {"compile": "default", "precision": "fp8"}
    assert not any("precision" in v for v in option_variants(
        "torch", _gpu(), compile_modes=("default",), fp8=False))
    assert not any("precision" in v for v in option_variants(
        "torch", _gpu(capability="8.0"), compile_modes=("default",), fp8=True))
    assert not any("precision" in v for v in option_variants(
        "torch", _gpu(mode="fp32"), compile_modes=("default",), fp8=True))
    # no compile modes asked for: FP8 still gets its trial, uncompiled
    assert option_variants("torch", _gpu(), compile_modes=(), fp8=True)[-1] == {
        "precision": "fp8"}


@pytest.fixture(scope="module")
def small_bert(tmp_path_factory):
    """A two-layer BERT whose Linears hold most of its weights, as in BERT-base (random weights)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("smallbert")
    transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                            intermediate_size=256, vocab_size=100,
                            max_position_embeddings=64).save_pretrained(str(folder))
    return f"hf:{folder}"


def test_a_pooler_on_one_row_per_item_stays_in_the_unit_s_precision(small_bert):
    """Calibrated at 16 items of 32 tokens, every Linear of the encoder runs on 512 rows and
    the pooler on 16: the pooler is left out, and in the converted network it is the plain
    Linear it was, the encoder's products FP8."""
    import copy

    from infermux.models import load_model

    model = load_model(small_bert)
    io = model.spec_io
    inputs = [torch.from_numpy(a) for a in io.generate(16, io.dims_for(32), seed=0)]
    amax = fp8.calibrate(model.module, inputs)
    linears = {n for n, m in model.module.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears - set(amax) == {"model.pooler.dense"}
    net = copy.deepcopy(model.module)
    assert fp8.to_fp8(net, amax) == len(linears) - 1
    assert type(net.model.pooler.dense) is torch.nn.Linear
    assert type(net.model.encoder.layer[0].attention.self.query).__name__ == "_FP8Linear"


def test_the_tuner_weighs_fp8_by_the_loaded_networks(small_bert):
    from infermux.models import load_model
    from infermux.tune.run import _fp8_worth

    assert fp8.linear_share(load_model(small_bert).module) > 0.8
    assert _fp8_worth({"bert": load_model(small_bert)})
    assert not _fp8_worth({"resnet": load_model("resnet18")})


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < fp8.FP8_CAPABILITY,
                    reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
def test_a_small_bert_benches_with_fp8_products_and_passes_the_agreement_check(small_bert):
    from infermux.bench import BenchConfig, run_bench
    from infermux.models import ModelSpec

    report = run_bench(BenchConfig(ModelSpec(small_bert), units="cuda:0/fp16", batches=[32],
                                   engine="torch", min_duration_s=0.5, min_queries=64,
                                   warmup_s=0.2, options={"precision": "fp8"},
                                   seq_buckets=[32], telemetry_interval_s=None))
    point = report.to_dict()["results"][0]
    assert point["status"] == "ok", point["error"]
    assert point["agreement"]["precision"] == "fp8"
    assert point["agreement"]["status"] == "pass", point["agreement"]
