import numpy as np
import pytest
import torch

from infermux.engines import create_engine, engine_status, list_engines
from infermux.errors import UsageError
from infermux.models import load_model
from infermux.units import discover, select_units

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


@pytest.fixture(scope="module")
def found():
    return discover(with_runtimes=False)


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return load_model(f"{tiny_factory}:build")


def test_registry():
    assert "torch" in list_engines()
    assert engine_status()["torch"] == (True, "")
    with pytest.raises(UsageError, match="unknown engine 'nope'"):
        create_engine("nope")


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_cpu_runner_matches_plain_forward(found, tiny, batch):
    engine = create_engine("torch")
    unit = select_units("cpu", found)[0]
    runner = engine.build(tiny, unit, batch)
    x = np.random.default_rng(batch).standard_normal((batch, 3, 32, 32)).astype(np.float32)
    (out,) = runner.infer(x)
    with torch.inference_mode():
        expected = tiny.module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert runner.options["threads"] == len(unit.cores)
    assert runner.options["cuda_graph"] is False
    timing = runner.run()
    assert timing.latency_ns > 0 and timing.compute_ns == timing.latency_ns
    assert engine.build(tiny, unit, batch) is runner  # cached per (model, unit, options, batch)
    assert engine.build(tiny, unit, batch, instance=1) is not runner


def test_core_set_unit_limits_threads(found, tiny):
    first = min(found.cpu["usable_cores"])
    unit = select_units(f"cpu:{first}", found)[0]
    runner = create_engine("torch").build(tiny, unit, 2)
    runner.run()
    assert runner.options["threads"] == 1
    assert torch.get_num_threads() == 1


def test_mobilenet_runner_matches(found):
    model = load_model("mobilenet_v3_small")
    runner = create_engine("torch").build(model, select_units("cpu", found)[0], 2)
    x = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
    (out,) = runner.infer(x)
    with torch.inference_mode():
        expected = model.module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("options", "message"), [
    ({"cuda_graph": True}, "needs a CUDA unit"),
    ({"compile": "fastest"}, "compile='fastest'"),
    ({"turbo": 1}, "turbo"),
    ({"wait": "sleep"}, "wait=sleep is how a CUDA unit's runner waits"),
    ({"wait": "nap"}, "wait"),
])
def test_bad_options(found, tiny, options, message):
    with pytest.raises(UsageError, match=message):
        create_engine("torch").build(tiny, select_units("cpu", found)[0], 1, options)


def test_wrong_input_shape_is_rejected(found, tiny):
    runner = create_engine("torch").build(tiny, select_units("cpu", found)[0], 2)
    with pytest.raises(UsageError, match="runner takes"):
        runner.set_input(np.zeros((3, 3, 32, 32), np.float32))


def test_a_sleeping_wait_sleeps_through_most_of_the_shortest_recent_device_time():
    """`wait: sleep` sleeps from the launch to 0.8 of the shortest recent batch's device time,
    never for less than 0.2 ms, and not before a batch was timed; the least time follows a
    shorter batch at once and a longer one by 5% of the gap."""
    from infermux.engines.pytorch import SLEEP_SHARE, device_floor, sleep_before_wait

    ms = 1_000_000
    assert SLEEP_SHARE == 0.8
    assert sleep_before_wait(0, 2 * ms, 10 * ms) == pytest.approx(0.006)
    assert sleep_before_wait(0, int(7.9 * ms), 10 * ms) == 0.0  # 0.1 ms left: spin
    assert sleep_before_wait(0, 9 * ms, 10 * ms) == 0.0  # past it
    assert sleep_before_wait(0, 0, 0) == 0.0  # nothing timed yet
    assert device_floor(0, 9 * ms) == 9 * ms
    assert device_floor(10 * ms, 6 * ms) == 6 * ms
    assert device_floor(10 * ms, 20 * ms) == int(10.5 * ms)
    assert device_floor(10 * ms, 0) == 10 * ms


@needs_cuda
@pytest.mark.parametrize("wait", ["sleep", "block"])
def test_cuda_runners_that_sleep_or_block_give_the_spinning_ones_outputs(found, tiny, wait):
    unit = select_units("cuda:0/fp32", found)[0]
    engine = create_engine("torch")
    spin, other = engine.build(tiny, unit, 4), engine.build(tiny, unit, 4, {"wait": wait})
    assert other.options["wait"] == wait and spin.options["wait"] == "spin"
    x = np.random.default_rng(2).standard_normal((4, 3, 32, 32)).astype(np.float32)
    # The tiny model's batches are shorter than the shortest sleep (0.2 ms), so this checks
    # the outputs of both waits; the sleep's arithmetic is the test above.
    for _ in range(3):
        np.testing.assert_allclose(other.infer(x)[0], spin.infer(x)[0], rtol=1e-5, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_cuda_runner_graph_matches_eager(found, tiny, mode):
    unit = select_units(f"cuda:0/{mode}", found)[0]
    engine = create_engine("torch")
    graph = engine.build(tiny, unit, 4)
    eager = engine.build(tiny, unit, 4, {"cuda_graph": False})
    assert graph.options["cuda_graph"] and not eager.options["cuda_graph"]
    x = np.random.default_rng(1).standard_normal((4, 3, 32, 32)).astype(np.float32)
    a, b = graph.infer(x)[0], eager.infer(x)[0]
    with torch.inference_mode():
        ref = tiny.module(torch.from_numpy(x)).numpy()
    tol = 1e-4 if mode == "fp32" else 2e-2
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    np.testing.assert_allclose(a, ref, rtol=tol, atol=tol)
    timing = graph.run()
    assert timing.h2d_ns > 0 and timing.compute_ns > 0


def test_self_graphing_compile_modes_run_in_the_runners_own_graph():
    from infermux.engines.pytorch import TorchOptions
    from infermux.units import Unit

    gpu = Unit("cuda:0/fp16", "cuda", "cuda:0", "fp16", "H100", "cuda:0")
    for mode in ("reduce-overhead", "max-autotune"):
        assert TorchOptions(compile=mode).resolve(gpu, 4).cuda_graph is True
        with pytest.raises(UsageError, match=f"cuda_graph=false conflicts with compile='{mode}'"):
            TorchOptions(compile=mode, cuda_graph=False).resolve(gpu, 4)
    assert TorchOptions(compile="default", cuda_graph=False).resolve(gpu, 4).cuda_graph is False


@needs_cuda
def test_reduce_overhead_runner_runs_from_other_threads(found, tiny):
    """Runtime workers run runners built elsewhere; torch's own graph trees asserted there."""
    import threading

    unit = select_units("cuda:0/fp32", found)[0]
    engine = create_engine("torch")
    runners = [engine.build(tiny, unit, 4, {"compile": "reduce-overhead"}, instance=i)
               for i in range(2)]
    x = np.random.default_rng(2).standard_normal((4, 3, 32, 32)).astype(np.float32)
    with torch.inference_mode():
        ref = tiny.module(torch.from_numpy(x)).numpy()
    outs: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                outs[i] = runners[i].infer(x)[0]
        except Exception as exc:  # noqa: BLE001 - any failure is reported below, with its type
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, repr(errors)
    for i in range(2):
        np.testing.assert_allclose(outs[i], ref, rtol=1e-3, atol=1e-3)


@needs_cuda
def test_a_collected_batchs_outputs_survive_the_next_launch_on_a_gpu(found, tiny):
    """A GPU runner writes each launch's outputs to the other of two host buffers: after batch
    A is collected and batch B launched, `outputs()` is still A's; after B is collected, B's
    (the worker reads A's after B's launch, `outputs_survive_launch`)."""
    unit = select_units("cuda:0/fp32", found)[0]
    runner = create_engine("torch").build(tiny, unit, 4)
    assert runner.outputs_survive_launch
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((4, 3, 32, 32)).astype(np.float32) for _ in range(2))
    want_a, want_b = runner.infer(a)[0], runner.infer(b)[0]
    runner.set_input(a)
    runner.launch()
    runner.collect()
    runner.set_input(b)
    runner.launch()
    np.testing.assert_allclose(runner.outputs()[0], want_a, rtol=1e-5, atol=1e-5)
    runner.collect()
    np.testing.assert_allclose(runner.outputs()[0], want_b, rtol=1e-5, atol=1e-5)
    cpu = create_engine("torch").build(tiny, select_units("cpu", found)[0], 4)
    assert not cpu.outputs_survive_launch  # a CPU batch runs in its launch


@needs_cuda
def test_cuda_device_data_skips_copy(found, tiny):
    unit = select_units("cuda:0/fp16", found)[0]
    runner = create_engine("torch").build(tiny, unit, 4, data="device")
    assert runner.run().h2d_ns < 50_000


@needs_cuda
@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_cuda_gather_from_pool_matches_direct_input(found, tiny, mode):
    unit = select_units(f"cuda:0/{mode}", found)[0]
    runner = create_engine("torch").build(tiny, unit, 8)
    samples = np.random.default_rng(2).standard_normal((32, 3, 32, 32)).astype(np.float32)
    pool = runner.prepare_pool(samples)
    for indices in ([3, 4, 5, 9, 0, 31, 30, 7], [5, 6]):  # a full and a partial batch
        runner.gather_input(pool, indices)
        runner.run()
        got = runner.outputs()[0][: len(indices)]
        full = np.zeros((8, 3, 32, 32), np.float32)
        full[: len(indices)] = samples[indices]
        want = runner.infer(full)[0][: len(indices)]
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


POOL_MODEL = '''
import torch
from torch import nn


class Pool(nn.Module):
    input_shape = (3, 224, 224)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        return self.fc(x.mean((2, 3)))


def build():
    torch.manual_seed(0)
    return Pool()
'''


def test_large_gather_is_split_over_threads_and_exact(found, tmp_path):
    path = tmp_path / "pool.py"
    path.write_text(POOL_MODEL)
    model = load_model(f"{path}:build")
    runner = create_engine("torch").build(model, select_units("cpu", found)[0], 48)
    samples = np.random.default_rng(3).standard_normal((64, 3, 224, 224)).astype(np.float32)
    pool = runner.prepare_pool(samples)
    indices = list(np.random.default_rng(4).integers(0, 64, 48))  # 29 MB: three threads
    runner.gather_input(pool, indices)
    assert runner._gather_pool is not None  # the threaded path was taken
    runner.run()
    with torch.inference_mode():
        want = model.module(torch.from_numpy(samples[indices])).numpy()
    np.testing.assert_array_equal(runner.outputs()[0], want)
    runner.close()
