"""The OpenVINO runner keeps the compiled model's optimal number of requests in flight.

Real OpenVINO on the CPU, a tiny CNN: a batch is split over the requests, so a caller that gives
every `run()` a new batch (a runtime worker, in its child process or a thread) keeps several
streams busy; outputs stay those of PyTorch fp32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from infermux import agreement
from infermux.engines import create_engine, engine_status
from infermux.engines.openvino import OvRunner, split_parts
from infermux.models import LoadedModel, load_model
from infermux.units import Unit

pytestmark = pytest.mark.skipif(not engine_status()["openvino"][0],
                                reason=f"engine openvino not usable here: "
                                       f"{engine_status()['openvino'][1]}")


@pytest.fixture(scope="module", autouse=True)
def _cache(module_cache_dir: Path) -> None:
    """Exports and engine caches of this module live in a fresh folder."""


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tests/tiny_models.py:tiny_cnn")


@pytest.fixture(scope="module")
def wide() -> LoadedModel:
    """Milliseconds per sub-batch on one core: long next to a submission."""
    return load_model("tests/tiny_models.py:wide_cnn")


def _torch_fp32(model: LoadedModel, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model.module(torch.from_numpy(x)).numpy()


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(got - ref))) / (float(np.max(np.abs(ref))) or 1.0)


def test_split_parts() -> None:
    assert split_parts(16, 2) == 2 and split_parts(16, 1) == 1 and split_parts(1, 4) == 1
    assert split_parts(4, 3) == 2  # 2 + 2, not 2 + 1 + 1 (one compiled sub-batch size)
    assert split_parts(5, 2) == 2  # 3 + 2, padded to 3 + 3
    assert split_parts(3, 8) == 3


def test_runner_keeps_optimal_requests_in_flight_for_new_batches(cpu: Unit,
                                                                 wide: LoadedModel) -> None:
    """What a runtime worker does per batch: gather new samples, run once, report."""
    engine = create_engine("openvino")
    runner = engine.build(wide, cpu, 8, {})
    assert isinstance(runner, OvRunner)
    optimal = runner.options["requests"]
    if optimal < 2:
        pytest.skip(f"the compiled model's optimal number of requests is {optimal} here")
    assert runner.options["sub_batches"] == split_parts(8, optimal) >= 2
    assert runner.options["sub_batch"] * runner.options["sub_batches"] >= 8
    samples = np.random.default_rng(0).standard_normal((64, *wide.input_shape)).astype(np.float32)
    pool = runner.prepare_pool(samples)
    rng = np.random.default_rng(1)
    peaks = []
    for _ in range(5):
        indices = rng.integers(0, len(samples), 8).tolist()
        runner.reset_peak_in_flight()
        runner.gather_input(pool, indices)
        timing = runner.run()
        assert timing.latency_ns > 0
        peaks.append(runner.peak_in_flight)
        assert _rel_err(runner.outputs()[0], _torch_fp32(wide, samples[indices])) < 1e-3
    # In flight at each submission: it and the earlier sub-batches OpenVINO has not finished;
    # every sub-batch is submitted before any is waited for. A sub-batch of this model takes
    # milliseconds, so only a host that stalls this thread between two submissions that long
    # sees one finish first.
    assert max(peaks) == runner.options["sub_batches"]
    assert sum(p >= 2 for p in peaks) >= 3, peaks
    result = agreement.check(runner, agreement.reference_for(wide))
    assert result.status == "pass", result.message
    engine.release()


def test_an_uneven_batch_is_padded_and_its_outputs_stay_right(cpu: Unit, tiny: LoadedModel) -> None:
    engine = create_engine("openvino")
    runner = engine.build(tiny, cpu, 5, {"requests": 2})
    assert runner.options["sub_batches"] == 2 and runner.options["sub_batch"] == 3
    x = np.random.default_rng(2).standard_normal((5, *tiny.input_shape)).astype(np.float32)
    (out,) = runner.infer(x)
    assert out.shape == (5, 10) and _rel_err(out, _torch_fp32(tiny, x)) < 1e-3
    # A partial gather (3 of 5 rows) pads the rest with zeros, as the base runner does.
    runner.gather_input(x, [4, 0, 2])
    runner.run()
    padded = np.concatenate([x[[4, 0, 2]], np.zeros((2, *tiny.input_shape), np.float32)])
    assert _rel_err(runner.outputs()[0], _torch_fp32(tiny, padded)) < 1e-3
    engine.release()


def test_batch_one_keeps_whole_batches_in_flight_when_rerun(cpu: Unit, wide: LoadedModel) -> None:
    """A batch of 1 cannot be split: repeated runs of one input fill the pool instead."""
    engine = create_engine("openvino")
    runner = engine.build(wide, cpu, 1, {"requests": 2})
    assert runner.options["sub_batches"] == 1
    x = np.random.default_rng(3).standard_normal((1, *wide.input_shape)).astype(np.float32)
    runner.set_input(x)
    runner.reset_peak_in_flight()
    runner.run()  # a new input runs once
    assert runner.peak_in_flight == 1
    for _ in range(10):
        runner.run()
    assert runner.peak_in_flight == 2
    assert _rel_err(runner.outputs()[0], _torch_fp32(wide, x)) < 1e-3
    engine.release()


def test_split_batch_false_runs_one_request_per_new_batch(cpu: Unit, tiny: LoadedModel) -> None:
    engine = create_engine("openvino")
    runner = engine.build(tiny, cpu, 4, {"requests": 2, "split_batch": False})
    assert runner.options["sub_batches"] == 1
    x = np.random.default_rng(4).standard_normal((4, *tiny.input_shape)).astype(np.float32)
    runner.set_input(x)  # waits for the warm-up's batches still in flight
    runner.reset_peak_in_flight()
    runner.run()
    (out,) = runner.outputs()
    assert runner.peak_in_flight == 1 and _rel_err(out, _torch_fp32(tiny, x)) < 1e-3
    engine.release()


def test_an_openvino_worker_process_serves_a_runtime_plan() -> None:
    """The runtime's default CPU hosting (a pinned child process calling run()) works."""
    from infermux.runtime.plan import parse_plan
    from infermux.runtime.session import run_plan

    plan = parse_plan({
        "name": "ov",
        "models": [{"name": "cnn", "model": "tests/tiny_models.py:tiny_cnn",
                    "replicas": [{"unit": "cpu", "engine": "openvino", "batch": 8,
                                  "batch_buckets": "none"}]}],
        "load": {"scenario": "offline", "min_duration_s": 0.5, "min_queries": 64},
    })
    report = run_plan(plan)
    assert report.status == "complete", report.error
    final = report.final
    assert final is not None and final.items_per_s > 0
    assert report.build["workers"][0]["hosting"] == "process"


_RELEASE_LOOP = '''
import sys, threading
import numpy as np
from infermux.engines import create_engine
from infermux.models import load_model
from infermux.units import discover, select_units

model = load_model("tests/tiny_models.py:tiny_cnn")
unit = select_units("cpu", discover())[0]
batch, rounds = int(sys.argv[1]), int(sys.argv[2])  # batch 4: split over 4 requests; 1: a pool


def spin():  # another thread wanting the interpreter lock, as a server's threads do
    n = 0
    while True:
        n += 1


threading.Thread(target=spin, daemon=True).start()
x = np.random.default_rng(0).standard_normal((batch, *model.input_shape)).astype(np.float32)
for k in range(rounds):
    engine = create_engine("openvino")
    runner = engine.build(model, unit, batch, {"requests": 4})
    for _ in range(5):
        runner.set_input(x)
        for _ in range(4):
            runner.run()
    runner.close()
    del runner
    engine.release()
    del engine
print("released", k + 1)
'''


@pytest.mark.parametrize(("batch", "rounds"), [(4, 80), (1, 30)], ids=["split", "pool"])
def test_runners_built_and_released_in_a_loop_never_hang(batch: int, rounds: int) -> None:
    """A runner released while another thread wants the interpreter lock: its compiled model's
    release joins OpenVINO's threads, so none of them may be waiting for the lock then. A
    Python completion callback could be: with one, this loop hung after 7-56 rounds of split
    batches in five of seven runs, and after 2-7 rounds of a pool in each of three; now a split
    batch has no Python callback, and a pool's is waited out before the release."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), str(root)]))
    try:
        done = subprocess.run([sys.executable, "-c", _RELEASE_LOOP, str(batch), str(rounds)],
                              cwd=root, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"building and releasing runners of batch {batch} hung")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"released {rounds}" in done.stdout
