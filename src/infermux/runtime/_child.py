"""The child process of a process-hosted CPU worker (`python -m infermux.runtime._child`).

It pins itself to its cores, builds its runners and its copy of the sample library, then runs
batches of sample indices sent by the parent's worker thread until told to close. A served batch
comes as float rows in shared memory, or, for a model of several inputs, as each item's inputs
through the pipe (token ids are small next to images, and their lengths differ per item).

Batches are run in the order they arrive; the parent may send the next one before it has read
the previous answer (`ProcessHost.depth`), so the child finds it waiting in its pipe. Each
answer says whether its batch was already waiting when the compute of the one before ended
(looked at before that one was answered), and otherwise how long the child idled for it after
that answer: what the relay through the parent cost this core.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from infermux.engines.base import Runner, is_out_of_memory
from infermux.runtime.inputs import IORows, StackedRows


def child_main(conn_in: Any, conn_out: Any) -> None:
    """Pin, build every runner, then serve batches until told to close.

    Ctrl-C is ignored here: the parent ends the run and closes its children.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cores, specs = conn_in.recv()
    try:
        if cores:
            os.sched_setaffinity(0, cores)
        import torch

        torch.set_num_threads(max(1, len(cores) or (os.cpu_count() or 1)))
        from infermux.engines import create_engine
        from infermux.models import ModelSpec, load_model
        from infermux.runtime.inputs import SeqRunner, build_bucket_runners, sample_library
        from infermux.runtime.plan import options_for_bucket
        from infermux.units import discover, select_units

        found = discover(with_runtimes=False)
        engines: dict[str, Any] = {}
        runners: dict[tuple[str, int], Runner] = {}
        pools: dict[str, Any] = {}
        info: dict[str, dict[int, dict[str, Any]]] = {}
        for spec in specs:
            unit = select_units([spec.unit], found)[0]
            model = load_model(ModelSpec(spec.ref, spec.weights, spec.input_shape))
            engine = engines.setdefault(spec.engine, create_engine(spec.engine))
            qsl = sample_library(spec.model, model, spec.pool_count, spec.seed,
                                 spec.seq_buckets, spec.lengths, spec.model)
            info[spec.model] = {}
            built = build_bucket_runners(
                engine, model, unit, spec.buckets,
                functools.partial(options_for_bucket, spec.options, spec.buckets),
                spec.data, spec.instance, qsl.seq_lengths)
            for bucket, runner in built.items():
                runners[(spec.model, bucket)] = runner
                pools.setdefault(spec.model, runner.prepare_pool(qsl.data))
                info[spec.model][bucket] = {
                    "engine": runner.engine, "unit": runner.unit, "build_s": runner.build_s,
                    "input_shape": list(runner.input_shape), "options": runner.options,
                    "io": isinstance(runner, SeqRunner),
                }
        conn_out.send(("ready", info))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn_out.send(("error", is_out_of_memory(exc), f"{type(exc).__name__}: {exc}"))
        return
    shared: dict[str, Any] = {}  # shared memory blocks of served rows, by name
    answered_ns = time.perf_counter_ns()
    waiting = False  # was the next batch in the pipe when the last one's compute ended?
    while True:
        try:
            msg = conn_in.recv()
        except EOFError:
            break
        if msg[0] == "close":
            break
        early, idle_ns = waiting, 0 if waiting else time.perf_counter_ns() - answered_ns
        kind, model_name, bucket, indices = msg
        try:
            runner = runners[(model_name, bucket)]
            if kind == "rows":  # a served batch of several inputs: per item, every input
                name, nbytes = indices
                items = pickle.loads(_attach(shared, name).buf[:nbytes])
                shape = (len(items),)
                runner.gather_input(IORows(items), range(len(items)))
                del items
            elif kind == "arrays":  # the same, stacked per input (items of one shape)
                name, specs = indices
                buf = _attach(shared, name).buf
                arrays = [np.ndarray(shape, np.dtype(dtype), buffer=buf, offset=offset)
                          for dtype, shape, offset in specs]
                shape = (len(arrays[0]),)
                runner.gather_input(StackedRows(arrays), range(shape[0]))
                del arrays
            elif kind == "shm":  # a served batch: its own input rows, outputs sent back
                name, shape = indices
                rows = np.ndarray(shape, np.float32, buffer=_attach(shared, name).buf)
                runner.gather_input(runner.prepare_pool(rows), range(len(rows)))
                del rows
            else:
                runner.gather_input(pools[model_name], indices)
            timing = runner.run()
            # Looked at before this batch is answered: a parent that sends only after reading
            # the answer can never have sent the next one by now.
            waiting = conn_in.poll(0)
            times = (timing.latency_ns, timing.h2d_ns, timing.compute_ns, timing.d2h_ns)
            outputs = None
            if kind in ("shm", "rows", "arrays"):
                n = shape[0]
                outputs = [np.array(y[:n]) for y in runner.outputs()]
            conn_out.send(("ok", times, outputs, (early, idle_ns)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
            waiting = False
            conn_out.send(("error", is_out_of_memory(exc), f"{type(exc).__name__}: {exc}"))
        answered_ns = time.perf_counter_ns()
    for block in shared.values():
        with contextlib.suppress(Exception):
            block.close()


def _attach(shared: dict[str, Any], name: str) -> Any:
    """The parent's shared memory block `name`, attached once (the parent owns and unlinks it)."""
    block = shared.get(name)
    if block is None:
        from multiprocessing import resource_tracker
        from multiprocessing.shared_memory import SharedMemory

        block = shared[name] = SharedMemory(name=name)
        # Python < 3.13 registers an attached block too, and its tracker would unlink the
        # parent's block when this process exits.
        with contextlib.suppress(Exception):
            resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
    return block


if __name__ == "__main__":
    child_main(Connection(int(sys.argv[1]), writable=False),
               Connection(int(sys.argv[2]), readable=False))
    # Nothing of the child outlives it (its caches were written atomically when built), so it
    # skips the interpreter's teardown of torch and the engines: a second or two per worker
    # that every close, restart and end of run would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
