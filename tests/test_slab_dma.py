"""Served rows to a GPU straight from the front processes' slabs: page-locking chunks of the
slabs in place (`engines.host_pins.HostPins`) and the torch runner's DMA path."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from infermux.serve.shm import SlabLayout


def test_slab_chunks_are_page_locked_once_as_rows_need_them() -> None:
    """`HostPins` locks a slab in chunks of whole rows, each starting on a page, covering the
    rows copied, each chunk once (FP32 and FP16 views of one slab share them), never past the
    slab's input region, and no row in two chunks (CUDA refuses a copy that spans two
    registrations); a chunk refused is not asked again and its rows are reported unlocked."""
    import mmap

    from infermux.engines.host_pins import HostPins
    from infermux.serve.shm import Segment

    page = mmap.PAGESIZE
    calls: list[tuple[int, int]] = []
    refuse: set[int] = set()

    def register(address: int, size: int) -> bool:
        calls.append((address, size))
        return address not in refuse

    # Rows of 1.5 pages: two rows are three pages, so a chunk of about 5 pages holds 2 rows.
    layout = SlabLayout((3 * page // 8,), ((10,),), slots=40)
    stride = layout.input_item_bytes
    assert stride == 3 * page // 2
    seg = Segment.new("infermux-test-pins", layout.slot_bytes * 40)
    try:
        f32 = layout.rows(seg.map, np.dtype("<f4"), "a")[0].slab_region
        f16 = layout.rows(seg.map, np.dtype("<f2"), "b")[0].slab_region
        base = f32.__array_interface__["data"][0]
        pins = HostPins(register, chunk_bytes=5 * page)
        assert pins.rows_per_chunk(stride) == 2
        chunk = 2 * stride
        assert pins.ensure(f32, [0]) and calls == [(base, chunk)]
        assert pins.ensure(f16, [1]) and len(calls) == 1  # the same chunk, any dtype
        assert pins.ensure(f32, [2]) and calls[1:] == [(base + chunk, chunk)]
        assert pins.ensure(f16, [3]) and len(calls) == 2
        end = base + 40 * stride
        assert pins.ensure(f32, [39])
        last = calls[-1]
        assert last[0] + last[1] == -(-end // page) * page  # the last chunk ends on its page
        assert all(a % page == 0 for a, _ in calls)
        for slot in range(40):  # every row lies within one chunk
            row = base + slot * stride
            assert sum(a <= row and row + stride <= a + s for a, s in calls
                       if a == base + slot // 2 * chunk) == (1 if slot in (0, 1, 2, 3, 38, 39)
                                                             else 0)
        starts = [a for a, _ in calls]
        assert len(set(starts)) == len(starts)  # no range locked twice
        refuse.add(base + 3 * chunk)  # rows 6 and 7
        n = len(calls)
        assert not pins.ensure(f32, [7]) and len(calls) == n + 1
        assert not pins.ensure(f16, [6]) and len(calls) == n + 1  # not asked again
        assert pins.ensure(f32, [0, 1, 2]) and len(calls) == n + 1
        # Rows whose chunks are locked, on either side of a refused one: locked, nothing asked
        # (the refused chunk between them is not theirs).
        assert pins.ensure(f32, [0, 39]) and len(calls) == n + 1
        assert pins.locked_bytes() == sum(s for a, s in calls if a not in refuse)
        # A stride with fewer powers of two: a chunk is a multiple of 256 such rows (525 pages),
        # however small `chunk_bytes`.
        assert HostPins(register, chunk_bytes=1 << 20).rows_per_chunk(8400) == 256
        assert HostPins(register, chunk_bytes=32 << 20).rows_per_chunk(8400) == 3840
        assert HostPins(register, chunk_bytes=32 << 20).rows_per_chunk(147 * page) == 55
    finally:
        seg.unlink()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_a_gpu_runner_copies_slab_rows_to_the_device_by_dma(tiny_factory: str, mode: str) -> None:
    """Rows in two fronts' slabs (shared memory) go to a GPU runner's device buffer from where
    they lie: FP32 and FP16 rows (converted on the device where they are not the compute
    dtype), two batches back to back; outputs equal the network's on the same rows."""
    import torch

    from infermux.engines import create_engine
    from infermux.engines.host_pins import host_pins
    from infermux.models import load_model
    from infermux.serve.shm import Segment
    from infermux.units import discover, select_units

    model = load_model(f"{tiny_factory}:build")
    unit = select_units(f"cuda:0/{mode}", discover(with_runtimes=False))[0]
    runner = create_engine("torch").build(model, unit, 8)
    layout = SlabLayout(tuple(runner.input_shape), ((10,),), slots=16)
    segs = [Segment.new("infermux-test-dma", layout.slot_bytes * 16) for _ in range(2)]
    try:
        rng = np.random.default_rng(7)
        made: dict[tuple[int, str], list[Any]] = {}
        locked = host_pins().locked_bytes()
        for dtype in ("<f4", "<f2", "<f4"):
            picks = [(k % 2, int(rng.integers(16))) for k in range(6)]
            rows, want = [], []
            for slab, slot in picks:
                x = rng.standard_normal((1, *runner.input_shape)).astype(dtype)
                layout.inputs(segs[slab].map, slot, 1, np.dtype(dtype))[...] = x
                if (slab, dtype) not in made:
                    made[slab, dtype] = layout.rows(segs[slab].map, np.dtype(dtype), slab)
                rows.append(made[slab, dtype][slot])
                want.append(x[0].astype(np.float32))
            runner.gather_input(runner.prepare_rows(rows), range(len(rows)))
            assert runner._direct is not None  # by DMA, not through the staging buffer
            runner.run()
            got = runner.outputs()[0][:len(rows)]
            with torch.inference_mode():
                expected = model.module(torch.from_numpy(np.stack(want))).numpy()
            tol = 1e-4 if mode == "fp32" else 2e-2
            np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
        assert host_pins().locked_bytes() > locked
    finally:
        for seg in segs:
            seg.unlink()
