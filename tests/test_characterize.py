"""`infermux characterize`: digits data and model, figures against numpy, variance detection, CLI."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from infermux.errors import UsageError
from tests.conftest import ROOT, invoke_cli

pytest.importorskip("sklearn", reason="the characterize extra (scikit-learn) is not installed")

STAND_INS = str(ROOT / "tests" / "characterize_engines.py")


@pytest.fixture(scope="module")
def digits_cnn(module_cache_dir):
    """digits-cnn trained in this module's fresh cache (once), as a loaded model."""
    from infermux.models import load_model

    return load_model("digits-cnn")


def test_digits_data_splits_and_the_trained_cnn(digits_cnn) -> None:
    import torch

    from infermux.characterize.data import load_data
    from infermux.characterize.digits import digits_splits

    splits = digits_splits()
    sets = [set(map(int, splits[k])) for k in ("train", "calibration", "test")]
    assert sum(len(s) for s in sets) == 1797 and len(set.union(*sets)) == 1797  # disjoint
    data = load_data(None, digits_cnn.input_shape, calibration_items=100)
    assert data.x.shape == (360, 1, 32, 32) and data.x.dtype == np.float32
    assert data.calibration.shape == (100, 1, 32, 32) and data.y is not None
    assert sorted(set(data.y.tolist())) == list(range(10))
    # The same digits adapted to another model's input: three channels, ImageNet-normalised.
    assert load_data("digits", (3, 64, 64), items=5).x.shape == (5, 3, 64, 64)
    assert not digits_cnn.randomly_initialised and "weights loaded" in digits_cnn.weights_note
    with torch.inference_mode():
        predicted = digits_cnn.module(torch.from_numpy(data.x)).argmax(dim=1).numpy()
    assert float(np.mean(predicted == data.y)) >= 0.95


def _wilson_by_hand(k: int, n: int) -> tuple[float, float]:
    z = 1.959963984540054
    p = k / n
    centre = (2 * k + z * z) / (2 * (n + z * z))
    half = z * math.sqrt(n * p * (1 - p) + z * z / 4) / (n + z * z)
    return centre - half, centre + half


def test_accuracy_figures_match_an_independent_computation() -> None:
    from infermux.characterize.metrics import accuracy_figures, spread

    rng = np.random.default_rng(7)
    reference = rng.standard_normal((500, 12)).astype(np.float32)
    logits = reference + 0.4 * rng.standard_normal((500, 12)).astype(np.float32)
    labels = np.where(rng.random(500) < 0.7, reference.argmax(axis=1), rng.integers(0, 12, 500))
    got = accuracy_figures(logits, labels, reference)

    top1_hits = int(np.sum(np.argmax(logits, axis=1) == labels))
    top5 = np.argpartition(-logits, 5, axis=1)[:, :5]
    top5_hits = int(sum(labels[i] in top5[i] for i in range(500)))
    agree_hits = int(np.sum(np.argmax(logits, axis=1) == np.argmax(reference, axis=1)))
    for key, hits in (("top1", top1_hits), ("top5", top5_hits), ("agree_top1", agree_hits)):
        assert got[key]["k"] == hits and got[key]["n"] == 500
        assert got[key]["value"] == pytest.approx(hits / 500)
        low, high = _wilson_by_hand(hits, 500)
        assert (got[key]["low"], got[key]["high"]) == (pytest.approx(low), pytest.approx(high))
    scipy_stats = pytest.importorskip("scipy.stats")
    ci = scipy_stats.binomtest(top1_hits, 500).proportion_ci(method="wilson")
    assert (got["top1"]["low"], got["top1"]["high"]) == (pytest.approx(ci.low), pytest.approx(ci.high))

    err = np.abs(logits.astype(np.float64) - reference)
    assert got["max_abs_err"] == pytest.approx(err.max())
    per_item = err.mean(axis=1)
    half = 1.959963984540054 * per_item.std(ddof=1) / math.sqrt(500)
    assert got["mean_abs_err"]["value"] == pytest.approx(err.mean())
    assert got["mean_abs_err"]["high"] - got["mean_abs_err"]["value"] == pytest.approx(half)
    assert got["rel_err"] == pytest.approx(err.max() / np.abs(reference).max())
    assert got["mean_rel_err"] == pytest.approx(err.mean() / np.abs(reference).mean())

    # Spread of output sets: byte-identical copies count once; flips are items whose pick moves.
    moved = reference.copy()
    moved[3] = moved[3][::-1]  # item 3's top-1 changes (a reversed row of distinct values)
    figures = spread([reference, reference.copy(), moved])
    assert figures.distinct == 2 and figures.sets == 3 and figures.top1_flips == 1
    assert figures.max_abs_diff == pytest.approx(np.abs(moved - reference).max())


@pytest.fixture
def stand_in_engines():
    """The stand-in engines registered in this process for one test, and taken out after it."""
    import importlib
    import sys

    from infermux.engines import base

    before = dict(base._ENGINES)
    name = "tests.characterize_engines"
    if name in sys.modules:
        importlib.reload(sys.modules[name])  # registers them again
    else:
        importlib.import_module(name)
    yield
    base._ENGINES.clear()
    base._ENGINES.update(before)  # later tests' `--engine auto` must not find them


def test_a_nondeterministic_engine_is_detected_and_a_deterministic_one_is_not(
        digits_cnn, stand_in_engines) -> None:
    from infermux.characterize import CharacterizeConfig, run_characterize
    from infermux.models import ModelSpec

    config = CharacterizeConfig(
        ModelSpec("digits-cnn", digits_cnn.spec.weights), units="cpu",
        engine="noisy-standin,steady-standin", builds=2, items=64, batch=16, batch_sizes=(4,),
        int8=False, latency_runs=3, latency_s=0.02, imports=(STAND_INS,))
    report = run_characterize(config)
    by_engine = {v.variant.engine: v for v in report.variants}
    noisy, steady = by_engine["noisy-standin"], by_engine["steady-standin"]
    assert noisy.status == steady.status == "ok", (noisy.error, steady.error)

    rebuild = noisy.baseline.rebuild()
    assert rebuild is not None and rebuild.distinct == 2 and rebuild.max_abs_diff > 0.01
    # Each build repeats itself exactly (the torch module may still depend on the batch size).
    assert "rebuild" in noisy.baseline.variance()
    assert "run-to-run" not in noisy.baseline.variance()
    assert noisy.baseline.run_to_run()["builds_varying"] == 0
    assert "no knob to pin" in " ".join(noisy.notes)

    still = steady.baseline.rebuild()
    assert still is not None and still.distinct == 1 and still.max_abs_diff == 0.0
    assert not {"rebuild", "run-to-run"} & set(steady.baseline.variance())
    assert steady.accuracy is not None and steady.accuracy["agree_top1"]["value"] == 1.0
    assert steady.accuracy["top1"]["value"] >= 0.9
    data = report.to_dict()
    assert [v["determinism"]["rebuild"]["distinct"] for v in data["variants"]] == [2, 1]
    json.dumps(data)  # JSON-ready all the way down


def test_cli_characterize_digits_end_to_end(digits_cnn, module_cache_dir, db: Path) -> None:
    proc = invoke_cli("characterize", "-m", "digits-cnn", "--units", "cpu", "--engine",
                      "torch,onnxruntime", "--builds", "2", "--json", "--db", str(db),
                      # Nine builds (two of each variant, one per knob study chasing torch's
                      # batch-size variance), each timing its batches briefly: 23.7 s to 19 s.
                      "--latency-time", "0.05s", "--latency-runs", "5",
                      env={"INFERMUX_CACHE_DIR": str(module_cache_dir)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    rows = {(v["engine"], v["precision"]): v for v in report["variants"]}
    assert sorted(rows) == [("onnxruntime", "fp32"), ("onnxruntime", "int8"), ("torch", "fp32")]
    for v in rows.values():
        assert v["status"] == "ok", v["error"]
        assert v["accuracy"]["top1"]["value"] >= 0.95
        assert v["determinism"]["builds_ok"] == 2
        assert v["determinism"]["latency"]["median_ms"] > 0
        for kind in v["determinism"]["variance"]:  # every variance found was chased
            assert v["causes"] and kind in v["removed_by"]
    assert rows[("torch", "fp32")]["accuracy"]["max_abs_err"] < 1e-4
    assert rows[("onnxruntime", "int8")]["computed_precision"] == "int8"
    with sqlite3.connect(db) as con:
        kind, status = con.execute("SELECT kind, status FROM runs WHERE id = ?",
                                   (report["run_id"],)).fetchone()
        assert (kind, status) == ("characterize", "complete")
        stored = con.execute("SELECT COUNT(*), SUM(builds_ok) FROM characterize_variants "
                             "WHERE run_id = ?", (report["run_id"],)).fetchone()
        assert stored == (3, 6)
        builds = con.execute("SELECT COUNT(*) FROM characterize_builds WHERE run_id = ? AND "
                             "study = 'baseline' AND status = 'ok'", (report["run_id"],)).fetchone()
        assert builds == (6,)


@pytest.mark.parametrize(("args", "message"), [
    (["-m", "resnet5000"], "unknown model 'resnet5000'"),
    (["-m", "digits-cnn", "--data", "{empty}"], "holds no images in class folders"),
    (["-m", "digits-cnn", "--builds", "0"], "--builds 0: at least 1 build is needed"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path: Path, capsys,
                                          module_cache_dir) -> None:
    from infermux.cli import main

    (tmp_path / "empty").mkdir()
    argv = ["characterize", *[a.replace("{empty}", str(tmp_path / "empty")) for a in args],
            "--db", str(tmp_path / "x.db")]
    with pytest.raises(SystemExit) as failed:
        main(argv)
    assert failed.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_every_build_of_a_randomly_initialised_model_gets_the_parents_weights(tmp_path: Path) -> None:
    import torch

    from infermux.characterize.run import _model_for_children
    from infermux.models import ModelSpec, load_model

    factory = tmp_path / "net.py"  # unseeded: every process initialises it differently
    factory.write_text("import torch\n\n\ndef build():\n    net = torch.nn.Linear(6, 4)\n"
                       "    net.input_shape = (6,)\n    return net\n")
    parent = load_model(f"{factory}:build")
    assert parent.randomly_initialised
    spec = _model_for_children(parent, tmp_path)
    assert spec["weights"] and Path(spec["weights"]).is_file()
    child = load_model(ModelSpec(spec["ref"], spec["weights"], tuple(spec["input_shape"])))
    x = torch.randn(3, 6)
    with torch.inference_mode():
        assert torch.equal(parent.module(x), child.module(x))
        assert not torch.equal(parent.module(x), load_model(f"{factory}:build").module(x))


def test_an_image_folder_is_preprocessed_to_the_models_input(tmp_path: Path) -> None:
    from PIL import Image

    from infermux.characterize.data import load_data

    for name, colour in (("a_red", (255, 0, 0)), ("b_blue", (0, 0, 255))):
        (tmp_path / name).mkdir()
        for i in range(5):
            Image.new("RGB", (40 + i, 50), colour).save(tmp_path / name / f"{i}.png")
    data = load_data(str(tmp_path), (3, 16, 16), calibration_items=2, seed=1)
    assert data.x.shape == (8, 3, 16, 16) and data.calibration.shape == (2, 3, 16, 16)
    assert data.classes == ["a_red", "b_blue"] and data.y is not None
    red = data.x[data.y == 0]
    assert red.size and np.allclose(red[:, 0], (1 - 0.485) / 0.229, atol=1e-5)
    assert np.allclose(red[:, 2], (0 - 0.406) / 0.225, atol=1e-5)
    grey = load_data(str(tmp_path), (1, 8, 8), items=3, calibration_items=0)
    assert grey.x.shape == (3, 1, 8, 8) and len(grey.calibration) == 0


def test_bad_data_files_name_the_problem(tmp_path: Path) -> None:
    from infermux.characterize.data import load_data

    np.savez(tmp_path / "wrong.npz", x=np.zeros((4, 3, 8, 8), np.float32), y=np.zeros(4))
    with pytest.raises(UsageError, match=r"x has shape \(4, 3, 8, 8\), the model takes"):
        load_data(str(tmp_path / "wrong.npz"), (1, 32, 32))
    np.savez(tmp_path / "ok.npz", x=np.ones((20, 1, 4, 4), np.float32), y=np.arange(20) % 3)
    data = load_data(str(tmp_path / "ok.npz"), (1, 4, 4), calibration_items=4)
    assert len(data.x) == 16 and len(data.calibration) == 4 and data.y is not None
    with pytest.raises(UsageError, match="does not exist"):
        load_data(str(tmp_path / "nowhere"), (1, 4, 4))
