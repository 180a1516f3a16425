import pickle

import pytest
import torch

from infermux.errors import UsageError
from infermux.models import ModelSpec, list_models, load_model


def test_torchvision_name():
    model = load_model("mobilenet_v3_small")
    assert model.source == "torchvision"
    assert model.input_shape == (3, 224, 224)
    assert model.randomly_initialised and "randomly initialised" in model.weights_note
    assert not model.module.training
    assert model.describe()["parameters"] > 1_000_000


def test_a_randomly_initialised_network_computes_within_fp16_range():
    # A fresh torchvision network's batch norms assume unit-variance inputs, so its activations
    # shrank block by block: mobilenet_v3_small's logits were ~1e-9, zeros in fp16, and no fp16
    # engine could agree with it. Its norms now hold its own activations' statistics.
    from infermux.agreement import TOLERANCES, _compare

    model = load_model("mobilenet_v3_small")
    assert not model.module.training
    x = torch.randn(4, *model.input_shape, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model.module(x)
        half = pickle.loads(pickle.dumps(model.module)).half()(x.half()).float()
    assert float(ref.abs().max()) > 1e-3
    found = _compare([half.numpy()], [ref.numpy()], 4, TOLERANCES["fp16"], "fp16")
    assert not isinstance(found, str) and not found.problems, found
    # Every item's class agrees, or (random weights: logits a few 1e-4 apart) is a near tie.
    assert round(found.top1 * 4) + found.near_ties == 4, found
    # A network whose outputs were not that small keeps its initial statistics (a ResNet so
    # settled grows its residual stream past the fp16 tolerance).
    resnet = load_model("resnet18").module
    assert all(bool((bn.running_var == 1).all()) for bn in resnet.modules()
               if isinstance(bn, torch.nn.BatchNorm2d))


def test_timm_name():
    pytest.importorskip("timm")
    model = load_model(ModelSpec("timm:resnet10t"))
    assert model.source == "timm"
    assert model.input_shape == (3, 176, 176)  # from the model's own pretrained_cfg
    out = model.module(torch.randn(1, *model.input_shape))
    assert out.shape == (1, 1000)


def test_factory_file(tiny_factory):
    model = load_model(f"{tiny_factory}:build")
    assert model.source == "factory"
    assert model.input_shape == (3, 32, 32)  # from the module's input_shape attribute
    assert model.name == "tiny:build"


def test_factory_errors(tiny_factory):
    with pytest.raises(UsageError, match="has no function 'nope'"):
        load_model(f"{tiny_factory}:nope")
    with pytest.raises(UsageError, match="not a torch.nn.Module"):
        load_model(f"{tiny_factory}:not_a_module")
    with pytest.raises(UsageError, match="pass --input-shape"):
        load_model(f"{tiny_factory}:no_shape")
    assert load_model(ModelSpec(f"{tiny_factory}:no_shape", input_shape=(4,))).input_shape == (4,)
    with pytest.raises(UsageError, match="does not exist"):
        load_model("missing_file.py:build")


def test_onnx_file(tmp_path, tiny_factory):
    pytest.importorskip("onnx")
    model = load_model(f"{tiny_factory}:build")
    path = tmp_path / "tiny.onnx"
    torch.onnx.export(model.module, (torch.randn(1, 3, 32, 32),), str(path), dynamo=False,
                      input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    loaded = load_model(str(path))
    assert loaded.source == "onnx" and loaded.module is None
    assert loaded.input_shape == (3, 32, 32)
    assert not loaded.randomly_initialised


def test_unknown_model_lists_close_names():
    with pytest.raises(UsageError, match="close names: resnet50") as info:
        load_model("resnet5")
    assert "unknown model 'resnet5'" in str(info.value)


def test_weights_state_dict_and_checkpoint(tmp_path, tiny_factory):
    source = load_model(f"{tiny_factory}:build")
    with torch.no_grad():
        for p in source.module.parameters():
            p.add_(1.0)
    state = source.module.state_dict()
    plain = tmp_path / "plain.pt"
    torch.save(state, plain)
    ckpt = tmp_path / "ckpt.pth"
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in state.items()}}, ckpt)
    x = torch.randn(2, 3, 32, 32)
    expected = source.module(x)
    for path in (plain, ckpt):
        loaded = load_model(ModelSpec(f"{tiny_factory}:build", weights=str(path)))
        assert loaded.weights_note == f"weights loaded from {path.name}"
        assert not loaded.randomly_initialised
        torch.testing.assert_close(loaded.module(x), expected)


class Evil:
    def __reduce__(self):
        return (print, ("pickled code ran",))


def test_weights_never_run_pickled_code(tmp_path, tiny_factory, capsys):
    path = tmp_path / "evil.pt"
    with path.open("wb") as f:
        pickle.dump({"state_dict": Evil()}, f)
    with pytest.raises(UsageError, match="not a readable state dict"):
        load_model(ModelSpec(f"{tiny_factory}:build", weights=str(path)))
    assert "pickled code ran" not in capsys.readouterr().out


def test_mismatched_corrupt_and_missing_weights(tmp_path, tiny_factory):
    wrong = tmp_path / "wrong.pt"
    torch.save(torch.nn.Linear(3, 3).state_dict(), wrong)
    with pytest.raises(UsageError, match="does not match the architecture"):
        load_model(ModelSpec(f"{tiny_factory}:build", weights=str(wrong)))
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"\x00not a checkpoint")
    with pytest.raises(UsageError, match="not a readable state dict"):
        load_model(ModelSpec(f"{tiny_factory}:build", weights=str(corrupt)))
    with pytest.raises(UsageError, match="does not exist"):
        load_model(ModelSpec(f"{tiny_factory}:build", weights=str(tmp_path / "none.pt")))


def test_list_models():
    found = list_models("resnet*")
    assert "resnet50" in found["torchvision"]
    assert all(n.startswith("resnet") for n in found["torchvision"])
