"""Workers: one per instance. Each pulls batches from the dispatcher and runs them on its unit.

Hosting, decided by measurement (docs/benchmarks.md, bench/runtime_cpu_modes.py):
- GPU workers are threads of the one process (one CUDA context). Each owns its runners: a CUDA
  stream, pinned host buffers and one captured CUDA graph per batch bucket. A GPU runner's
  `launch()` returns at once, so the worker gathers the next batch into the pinned buffer while
  the current one computes (a long gather on a helper thread, while the worker waits for the
  current batch: a batch's completion is stamped when it is collected, never after the next
  one's gather); copies of one worker overlap the compute of the others.
- CPU workers get an explicit, disjoint core set. By default each is a pinned child process
  (`process_host.ProcessHost`): threads stall on the GIL when per-batch Python work is large
  next to the kernels (2 pinned threads gave 1.08× one at batch 1, 2 processes 1.82×). The
  worker thread in this process only relays sample indices and timings through a pipe; the
  child holds its own runners and its own copy of the (seeded) sample library. The thread sends
  the next batch while the child runs one (`dispatcher.cpu_in_flight: 2`), so the child never
  idles for the relay (`Worker._loop_relayed`). `cpu_workers: thread` keeps them as pinned
  threads instead.

A served batch (its items bring their own inputs) that raises is not taken for the worker's
fault at once: the worker runs a batch of its own samples on the same runner. If that runs, the
fault was an input's (`Dispatcher.rejected`: that request fails alone, the worker serves on);
if it does not, the device is at fault and the worker leaves service to be restarted. Only an
engine raising counts as a suspect input; a dead or hung process and out-of-memory never do.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from infermux.engines.base import BatchTiming, Runner, is_out_of_memory
from infermux.errors import DeviceOutOfMemoryError, RunError
from infermux.runtime.dispatcher import WAIT_FOREVER, Batch, Dispatcher, WorkerState
from infermux.runtime.process_host import (
    BatchRaisedError,
    ProcessHost,
    ProxyRunner,
    ServedRows,
    host_of,
)

__all__ = ["Worker"]


class Worker:
    """The thread that serves one worker: pull a batch, gather its samples, run, report."""

    def __init__(
        self,
        state: WorkerState,
        runners: dict[str, dict[int, Runner]],
        samples: dict[str, np.ndarray],
        dispatcher: Dispatcher,
        *,
        cores: Sequence[int] = (),
        threads: int | None = None,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        pools: dict[tuple[str, tuple[str, ...]], Any] | None = None,
        just_in_time: bool = False,
    ) -> None:
        self.state = state
        #: Take the next batch only when the running one is about to end (see `_wait_to_take`).
        self.just_in_time = just_in_time
        self.runners = runners
        self.samples = samples
        self.dispatcher = dispatcher
        self.cores = tuple(cores)
        self.threads = threads
        self.clock_ns = clock_ns
        # Sample pools by (model, dtype and device): shared by the workers given the same dict
        # (every instance on one GPU reads one copy; pools are only read once made).
        self._pools: dict[tuple[str, tuple[str, ...]], Any] = pools if pools is not None else {}
        #: A process-hosted worker's relay: the moving average of a batch's round trip to its
        #: child beyond the child's own time for it (`_loop_relayed`), ns.
        self.relay_ns = 0.0
        #: A batch's report (`Dispatcher.finished`: its answers, the worker freed) on this
        #: thread, moving average, ns.
        self.report_ns = 0.0
        self.thread = threading.Thread(target=self._main, name=f"infermux-{state.name}",
                                       daemon=True)

    def start(self) -> None:
        """Start serving."""
        self.thread.start()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the worker to exit (at once if it never started: a run that failed to build)."""
        if self.thread.is_alive() or self.thread.ident is not None:
            self.thread.join(timeout_s)

    def _pool(self, model: str, runner: Runner) -> Any:
        key = (model, runner.pool_layout())
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = runner.prepare_pool(self.samples[model])
        return pool

    def _runner(self, batch: Batch) -> Runner:
        return self.runners[batch.model][batch.bucket]

    def _source(self, runner: Runner, batch: Batch) -> tuple[Any, Sequence[int]]:
        """(pool, rows) that `gather_input` reads the batch from.

        The shared sample pool and the items' QSL indices; or, for items that brought their
        own inputs (a server's requests), those rows as the runner reads them.
        """
        rows = batch.rows()
        if rows is None:
            return self._pool(batch.model, runner), batch.samples
        if isinstance(runner, ProxyRunner) and runner.io:  # every input of each item
            return ServedRows(rows), range(len(rows))
        direct = getattr(runner, "prepare_rows", None)
        if direct is not None:  # rows copied once, straight into the runner's input buffer
            return direct(rows), range(len(rows))
        stacked = np.stack(rows).astype(np.float32, copy=False)
        if isinstance(runner, ProxyRunner):
            return ServedRows(stacked), range(len(rows))
        return runner.prepare_pool(stacked), range(len(rows))

    @staticmethod
    def _outputs(runner: Runner, batch: Batch) -> list[np.ndarray] | None:
        """The batch's outputs, a row per item, when its items brought their own inputs."""
        if not batch.items or batch.items[0].data is None:
            return None
        n = len(batch.items)
        return [np.asarray(y)[:n] for y in runner.outputs()]

    def _main(self) -> None:
        if self.cores:
            with contextlib.suppress(OSError):  # a core set this process may not use
                os.sched_setaffinity(0, self.cores)
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        host = host_of(self.runners)
        asynchronous = any(r.asynchronous for rs in self.runners.values() for r in rs.values())
        if host is not None and host.depth > 1:
            self._loop_relayed(host)
        elif asynchronous:
            self._loop_pipelined()
        else:
            self._loop()

    def _loop(self) -> None:
        d, w = self.dispatcher, self.state
        while (batch := d.next_batch(w)) is not None:
            try:
                runner = self._runner(batch)
                start = self.clock_ns()
                runner.gather_input(*self._source(runner, batch))
                batch.stamps["gather_begin"] = start
                batch.stamps["gather_end"] = batch.stamps["launch"] = self.clock_ns()
                runner.launch()
                batch.stamps["launched"] = self.clock_ns()
                timing = runner.collect()
                end = batch.stamps["collect"] = self.clock_ns()
                outputs = self._outputs(runner, batch)
            except Exception as exc:  # noqa: BLE001 - the input's fault, or the worker's
                if self._input_fault([batch], exc):
                    d.rejected(w, [batch], _translate(exc, w))
                    continue
                d.failed(w, [batch], _translate(exc, w))
                return
            batch.stamps["reported"] = self.clock_ns()
            d.finished(w, batch, start, end, timing, outputs)

    def _input_fault(self, batches: Sequence[Batch], exc: BaseException) -> bool:
        """Whether served `batches` raised for their inputs, not for the worker.

        The engine raised (nothing died, hung or ran out of memory) and this worker still runs
        a batch of its own samples.
        """
        served = bool(batches) and all(b.rows() is not None for b in batches)
        return served and _suspect(exc) and self._healthy(batches[0])

    def _healthy(self, batch: Batch) -> bool:
        """Whether `batch`'s runner still runs a batch of the model's own samples.

        Every row of the bucket is written: rows left from the batch that raised would make
        the check fail for the input's sake.
        """
        runner = self.runners.get(batch.model, {}).get(batch.bucket)
        if runner is None:
            return False
        try:
            runner.gather_input(self._pool(batch.model, runner), [0] * batch.bucket)
            runner.launch()
            runner.collect()
        except Exception:  # noqa: BLE001 - any failure here is the worker's, not the input's
            return False
        return True

    def _wait_to_take(self, start_ns: float, end_ns: float, gather_ns: float,
                      running: Runner) -> bool:
        """Wait until the running batch is about to end, unless a full batch waits already.

        True when the running batch is over already (`running.done()`, asked at every wake and
        at least every `_DONE_POLL_NS`): its answers must not wait for its estimate. Under
        server load the estimate of a bucket can be far above what the batch takes now (it was
        measured offline beside the other instance, or once under a slow moment, and a batch
        collected late is measured late, so the average kept itself up); holding a finished
        batch until then held every answer in it, and in a closed loop of clients that held
        the next requests too: on an H200 host served ResNet50 spent 27 ms of its 37 ms in
        the server outside the queue and the device, with the GPU idle four fifths of the time.

        Taking the next batch the moment items arrive commits them to this worker's turn after
        its running batch, while another worker may free sooner, and takes a small batch where
        a fuller one was a moment away: under server load that was most of the tail. Waiting
        until two gathers (and a little slack) before the expected end keeps the gather
        overlapped with the device, on this thread (`_loop_pipelined`'s `here`); where two
        gathers are over half the running batch (a long gather: BERT's 128 rows of ids and
        masks took 2.8 ms beside a 5.8 ms batch), the take waits until the greater of 1.25
        gathers and half the batch is left, and the gather goes to the helper: taken at the
        launch, the batch would hold only what had come during the launch.
        A full batch waiting is taken at once (offline load).
        Under deadline batching the take then asks the dispatcher, which counts this running
        batch (`busy_until_ns`) in the oldest item's deadline: a partial batch that may still
        wait stays queued (for this worker once it frees, or for an idle one).
        """
        d, w = self.dispatcher, self.state
        lead = 2 * gather_ns
        if lead > 0.5 * (end_ns - start_ns):
            lead = max(1.25 * gather_ns, 0.5 * (end_ns - start_ns))
        take_at = end_ns - lead - _TAKE_SLACK_NS
        with d.cond:
            while True:
                if running.done():
                    return True
                left = take_at - self.clock_ns()
                if left <= 0 or d.closed or d.queued(w.model) >= w.batch:
                    return False
                d.cond.wait(min(left, _DONE_POLL_NS) / 1e9)

    def _take_while_running(self, running: Runner, end_ns: float,
                            gather_ns: float) -> Batch | None:
        """The next batch once the dispatcher gives one while `running` runs, else None.

        None once the running batch has ended (or the worker should exit). Asked when the
        running batch is about to end: a batch taken now is gathered under it. When none is
        ready yet (its items not there, or within the queue delay or the deadline's slack),
        waiting here rather than collecting first keeps that overlap for a batch that becomes
        ready before the running one ends; before, the worker collected and reported, then
        took, gathered and launched with the device idle throughout. Wakes when the queue
        changes, when the dispatcher's wait is over, and at the running batch's expected end
        (then every `_DONE_POLL_NS` until it is done). Items an idle worker of the model would
        finish sooner are left to it (`Dispatcher.leave_to_idle`, as `take_ahead` does).
        The queue delay is counted to the batch's launch (`Dispatcher.poll`'s `launch_ns`):
        when the running batch ends, or when a gather begun now would end, if later.
        """
        d, w = self.dispatcher, self.state
        with d.cond:
            while True:
                launch_ns = int(max(end_ns, self.clock_ns() + gather_ns))
                # What an idle worker of the model would finish sooner is left to it.
                got = WAIT_FOREVER if d.leave_to_idle(w) else d.poll(w, launch_ns)
                if got is None or isinstance(got, Batch):
                    return got
                if running.done():
                    return None
                left_s = (end_ns - self.clock_ns()) / 1e9
                d.cond.wait(min(got, left_s if left_s > 0 else _DONE_POLL_NS / 1e9))

    def _loop_pipelined(self) -> None:
        """Gather batch k+1 while batch k runs on the device, then collect k and launch k+1.

        k's completion is stamped the moment `collect()` returns, never after k+1's gather,
        and reported then too unless k+1 was gathered already (then k+1 launches first).
        k is expected to end at its launch plus the runner's measured device time for its
        bucket (the worker's latency estimate until one was collected).
        Where k+1's gather goes depends on what is expected to remain of k (its latency
        estimate): nothing (the device idles) — collect k first, then gather; more than twice
        the gather — gather here, then collect (which still waits for k: the stamp is exact,
        and no thread hand-over is paid); less — on a helper thread while this one waits in
        `collect()`, so the gather overlaps k without lengthening k's latency.
        """
        d, w = self.dispatcher, self.state
        if self.threads and self.threads > 1:
            import torch

            # The gather's threads leave a core to this thread, which waits on the device
            # meanwhile (measured on an H100 host: a full-width gather beside the waiting
            # thread ran a ResNet18 batch-32 cycle at 2.5 ms instead of 1.3 ms).
            torch.set_num_threads(self.threads - 1)
        # (batch, runner, launched at, expected to end at)
        pending: tuple[Batch, Runner, int, float] | None = None
        helper: _Helper | None = None
        gather_ns = 0.0  # moving average of one gather's duration
        # Moving average of a batch's time on the device by (model, bucket), from the
        # runner's own device timing. A pending batch's expected end comes from it, not from
        # the worker's latency estimate: that one learns launch → collect on the host, which
        # includes this loop's own wait to take the next batch (`_wait_to_take` waits until
        # the expected end), so any late wake-up (a busy interpreter lock under server load)
        # lengthened the next wait, and finished batches sat on the device uncollected while
        # the worker waited for a full batch (docs/architecture-serve.md, hidden waits).
        device_ns: dict[tuple[str, int], float] = {}
        last_collect_ns = 0  # when this worker's previous batch was collected
        try:
            while True:
                if pending is not None and self.just_in_time and self._wait_to_take(
                        pending[2], pending[3], gather_ns, pending[1]):
                    # It ended before its estimate: answer it now, then take the next batch
                    # as an idle worker does (queue delay and all).
                    p_batch, p_runner, p_start, _ = pending
                    pending = None
                    try:
                        timing = p_runner.collect()
                        ended = last_collect_ns = p_batch.stamps["collect"] = self.clock_ns()
                        outputs = self._outputs(p_runner, p_batch)
                    except Exception as exc:  # noqa: BLE001 - the inputs' fault, or the worker's
                        if self._input_fault([p_batch], exc):
                            d.rejected(w, [p_batch], _translate(exc, w))
                            continue
                        d.failed(w, [p_batch], _translate(exc, w))
                        return
                    _learn_device_time(device_ns, p_batch, timing)
                    self._report((p_batch, p_start, ended, timing, outputs))
                    continue
                if pending is not None and self.just_in_time:
                    batch = self._take_while_running(pending[1], pending[3], gather_ns)
                else:
                    batch = d.next_batch(w, block=pending is None)
                if batch is None and pending is None:
                    return
                held = [b for b in (pending[0] if pending else None, batch) if b is not None]
                on_helper = False
                # k's outputs, read after k+1's launch where the runner keeps them (below).
                unread: tuple[Runner, Batch] | None = None
                try:
                    done: tuple[Batch, int, int, BatchTiming, Any] | None = None
                    where = ""
                    if batch is not None:
                        runner = self._runner(batch)
                        pool, rows = self._source(runner, batch)
                        left = 0.0 if pending is None else pending[3] - self.clock_ns()
                        where = ("idle" if pending is None else "here" if gather_ns < 0.5 * left
                                 else "after" if left <= 0 else "helper")
                        if where in ("here", "idle"):
                            took = self.clock_ns()
                            runner.gather_input(pool, rows)
                            ended = self.clock_ns()
                            gather_ns = _average(gather_ns, ended - took)
                            batch.stamps.update(gather_begin=took, gather_end=ended)
                        elif where == "helper":
                            helper = helper or _Helper(f"infermux-{w.name}-gather", self.cores,
                                                       self.clock_ns)
                            helper.submit(runner.gather_input, pool, rows)
                            on_helper = True
                    if pending is not None:
                        p_batch, p_runner, p_start, _ = pending
                        timing = p_runner.collect()
                        p_batch.stamps["collect"] = p_end = last_collect_ns = self.clock_ns()
                        _learn_device_time(device_ns, p_batch, timing)
                        report_first = where == "after" or (
                            where == "helper" and helper is not None
                            and helper.left_ns(gather_ns) > self.report_ns)
                        if (batch is not None and not report_first
                                and p_runner.outputs_survive_launch):
                            # k+1 launches first; k's outputs stay its own through that launch
                            # (the runner's other host buffers), so they are read after it:
                            # read before, their copies and the interpreter lock's hand-overs
                            # on a busy server kept the device idle.
                            done = (p_batch, p_start, p_end, timing, None)
                            unread = (p_runner, p_batch)
                        else:
                            # Read before the next launch, which may reuse the output buffers.
                            done = (p_batch, p_start, p_end, timing,
                                    self._outputs(p_runner, p_batch))
                        if report_first:
                            # The next launch waits for a gather: k's answer must not (it
                            # did, a gather and a launch per batch, before it was reported).
                            # On the helper the gather goes on meanwhile. A gather the helper
                            # has finished, or will before a report would, is not waited for
                            # that long: k+1 launches first, as after a gather here (the
                            # report, k's outputs to each of its requests, took 1.2 ms of a
                            # served BERT batch's cycle while the device had nothing to run).
                            held = [batch] if batch is not None else []
                            report, done = done, None  # reported once, whatever happens
                            self._report(report)
                    if where == "after":
                        assert batch is not None
                        took = self.clock_ns()
                        runner.gather_input(pool, rows)
                        ended = self.clock_ns()
                        gather_ns = _average(gather_ns, ended - took)
                        batch.stamps.update(gather_begin=took, gather_end=ended)
                    elif on_helper:
                        assert helper is not None and batch is not None
                        on_helper = False
                        _, began, ended = helper.result()
                        gather_ns = _average(gather_ns, ended - began)
                        batch.stamps.update(gather_begin=began, gather_end=ended)
                    pending = None
                    if batch is not None:
                        start = batch.stamps["launch"] = self.clock_ns()
                        runner.launch()
                        batch.stamps["launched"] = self.clock_ns()
                        batch.gather_path = where
                        if last_collect_ns and batch.items[0].enqueued_ns < last_collect_ns:
                            batch.idle_before_ns = start - last_collect_ns
                        expected = (device_ns.get((batch.model, batch.bucket))
                                    or w.estimate.expected_ns(batch.bucket, batch.model))
                        pending = (batch, runner, start, start + expected)
                    if unread is not None and done is not None:
                        done = (*done[:4], self._outputs(*unread))
                        unread = None
                except Exception as exc:  # noqa: BLE001 - the inputs' fault, or the worker's
                    if on_helper and helper is not None:
                        with contextlib.suppress(Exception):  # it must not write on, unseen
                            helper.result()
                    if done is not None and unread is not None:
                        # k+1's launch failed: k's outputs are still in their own buffers.
                        try:
                            done = (*done[:4], self._outputs(*unread))
                        except Exception:  # noqa: BLE001 - unread: k goes back with k+1
                            done = None
                    if done is not None:  # k was collected and read: its answer stands,
                        report, done = done, None  # whatever k+1 did
                        held = [b for b in held if b is not report[0]]
                        self._report(report)
                    if self._input_fault(held, exc):
                        d.rejected(w, held, _translate(exc, w))
                        pending = None
                        continue
                    d.failed(w, held, _translate(exc, w))
                    return
                if done is not None:
                    self._report(done)
        finally:
            if helper is not None:
                helper.close()

    def _report(self, done: tuple[Batch, int, int, BatchTiming, Any]) -> None:
        """`Dispatcher.finished` for a collected batch (batch, start, end, timing, outputs)."""
        batch, start, end, timing, outputs = done
        batch.stamps["reported"] = began = self.clock_ns()
        self.dispatcher.finished(self.state, batch, start, end, timing, outputs)
        # Its answers to every request of the batch, on this thread: what a launch put behind
        # a report waits for.
        self.report_ns = _average(self.report_ns, self.clock_ns() - began)

    def _loop_relayed(self, host: ProcessHost) -> None:
        """A process-hosted worker: keep the next batch in the child's pipe while it runs one.

        Sending a batch only after the previous answer was read left the child's cores idle for
        the whole relay, every batch: the answer crossing the pipe, this thread waking (it
        shares the GIL with the server's fronts and the load generator), taking the next batch
        and sending it. Here batch k+1 is sent while k runs, at most `host.depth` in flight, and
        the child runs its pipe in order. k+1 is taken as `_wait_to_take` takes a GPU worker's:
        at once when a full batch waits, else when k is expected to end within two relays
        (`busy_until_ns`, the dispatcher's estimate), through `Dispatcher.take_ahead`, which
        leaves it to an idle worker that would finish it sooner. Meanwhile this thread waits on
        the pipe, so k's answer is reported the moment it comes.

        Answers are reported in order. A batch's start is when it was sent or, if it waited in
        the pipe, when the answer before it came: batches never overlap in the records, and
        the latency estimate is the child's time per batch, what `busy_until_ns` adds up. A
        failure (the child died, hung or raised) hands every batch in flight back to the
        dispatcher (`failed`), as the pipelined loop does with the two batches it holds.
        """
        d, w = self.dispatcher, self.state
        # (batch, sent at, sent to a child that held nothing: its round trip is all relay)
        pending: deque[tuple[Batch, int, bool]] = deque()
        last_end = 0
        while True:
            batch: Batch | None = None
            if not pending:
                batch = d.next_batch(w)
                if batch is None:
                    return
            elif len(pending) < host.depth and self._send_ahead(host):
                batch = d.take_ahead(w)
            if batch is not None:
                sent = self.clock_ns()
                try:
                    rows = batch.rows()
                    if rows is None:
                        host.send(batch.model, batch.bucket, batch.samples)
                    else:
                        host.send_rows(batch.model, batch.bucket, rows)
                except Exception as exc:  # noqa: BLE001 - every failure takes the worker out
                    d.failed(w, [p[0] for p in pending] + [batch], _translate(exc, w))
                    return
                pending.append((batch, sent, not pending))
                continue
            try:
                timing, outputs = host.receive(keep_alive=True)
            except Exception as exc:  # noqa: BLE001 - the input's fault, or the worker's
                if not self._relayed_input_fault(host, pending, exc):
                    d.failed(w, [p[0] for p in pending], _translate(exc, w))
                    return
                last_end = self.clock_ns()
                continue
            end = self.clock_ns()
            done, sent, alone = pending.popleft()
            if alone:
                self.relay_ns = _average(self.relay_ns, max(0, end - sent - timing.latency_ns))
            start, last_end = max(sent, last_end), end
            done.stamps.update(launch=start, collect=end, reported=self.clock_ns())
            d.finished(w, done, start, end, timing, outputs)

    def _relayed_input_fault(self, host: ProcessHost,
                             pending: deque[tuple[Batch, int, bool]], exc: BaseException) -> bool:
        """Whether the oldest batch in the child raised for its input, not for the worker.

        The batches behind it are answered first (the child runs them in order), then the
        input's fault is told from the worker's (`_input_fault`).

        True when it was the input's and everything held is dealt with (`Dispatcher.rejected`);
        False leaves what is still in `pending` to `Dispatcher.failed` by the caller.
        """
        d, w = self.dispatcher, self.state
        if not isinstance(exc, BatchRaisedError) or pending[0][0].rows() is None:
            return False
        raised = [pending.popleft()[0]]
        while pending:
            batch, sent, _ = pending[0]
            try:
                timing, outputs = host.receive(keep_alive=True)
            except BatchRaisedError:
                raised.append(pending.popleft()[0])
                continue
            except Exception:  # noqa: BLE001 - the worker's fault: the caller fails it all
                pending.extendleft(reversed([(b, 0, False) for b in raised]))
                return False
            pending.popleft()
            d.finished(w, batch, sent, self.clock_ns(), timing, outputs)
        if self._input_fault(raised, exc):
            d.rejected(w, raised, _translate(exc, w))
            return True
        pending.extend((b, 0, False) for b in raised)
        return False

    def _send_ahead(self, host: ProcessHost) -> bool:
        """Wait until the next batch should be taken (True) or the oldest answer came (False).

        A full batch waiting is taken at once; otherwise the time to take it is two relays and
        a little slack before the running batch is expected to end, as `_wait_to_take` does
        for GPU workers (the items stay in the queue for whichever worker frees first, and the
        batch fills). The wait is on the child's pipe, not on new items.
        """
        d, w = self.dispatcher, self.state
        with d.cond:
            if d.queued(w.model) >= w.batch:
                return True
            take_at = w.busy_until_ns - 2 * self.relay_ns - _TAKE_SLACK_NS
        left = take_at - self.clock_ns()
        return left <= 0 or not host.answer_ready(left / 1e9)


#: Slack before a running batch's expected end at which a just-in-time worker takes the next.
_TAKE_SLACK_NS = 200_000
#: How often a just-in-time worker waiting to take its next batch asks whether the running one
#: is over (it is also asked whenever queries arrive): the most a finished batch's answers wait.
_DONE_POLL_NS = 200_000


def _learn_device_time(device_ns: dict[tuple[str, int], float], batch: Batch,
                       timing: BatchTiming) -> None:
    """Fold a collected batch's device time (copy in, compute, copy out) into its bucket's average."""
    on_device = timing.device_ns
    if on_device > 0:
        key = (batch.model, batch.bucket)
        device_ns[key] = _average(device_ns.get(key, 0.0), on_device)


def _average(old: float, new: float, alpha: float = 0.2) -> float:
    return float(new) if old <= 0 else old + alpha * (new - old)


class _Helper:
    """A pipelined worker's second thread: runs one call at a time (a gather), timed."""

    def __init__(self, name: str, cores: Sequence[int], clock_ns: Callable[[], int]) -> None:
        self._cores = tuple(cores)
        self._clock_ns = clock_ns
        self._cond = threading.Condition()
        self._job: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
        self._busy = False
        self._started_ns = 0
        self._outcome: tuple[Any, int, int] = (None, 0, 0)
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start `fn(*args)` on the thread; collect it with `result()` before the next."""
        with self._cond:
            self._job, self._busy, self._error = (fn, args), True, None
            self._started_ns = self._clock_ns()
            self._cond.notify_all()

    def left_ns(self, expected_ns: float) -> float:
        """How long the call in hand should still run, were it to take `expected_ns` (0 if done)."""
        with self._cond:
            if not self._busy:
                return 0.0
            return max(0.0, expected_ns - (self._clock_ns() - self._started_ns))

    def result(self) -> tuple[Any, int, int]:
        """(its return value, the clock when it started, when it returned); or its error."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            error, self._error = self._error, None
            outcome = self._outcome
        if error is not None:
            raise error
        return outcome

    def close(self) -> None:
        """End the thread (after the call in hand)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _main(self) -> None:
        if self._cores:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._cores)
        while True:
            with self._cond:
                while self._job is None and not self._stop:
                    self._cond.wait()
                if self._job is None:
                    return
                fn, args = self._job
                self._job = None
            error: BaseException | None = None
            value: Any = None
            began = self._clock_ns()
            try:
                value = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - raised in the worker by result()
                error = exc
            ended = self._clock_ns()
            with self._cond:
                self._busy, self._error, self._outcome = False, error, (value, began, ended)
                self._cond.notify_all()


def _suspect(exc: BaseException) -> bool:
    """Whether `exc` may be an input's fault: the engine raised on a batch.

    In this process, or in a worker's child that still runs; never a death, a hang or running
    out of memory.
    """
    if isinstance(exc, BatchRaisedError):
        return True
    return not isinstance(exc, RunError) and not is_out_of_memory(exc)


def _translate(exc: BaseException, w: WorkerState) -> BaseException:
    if isinstance(exc, RunError):
        return exc
    if is_out_of_memory(exc):
        return DeviceOutOfMemoryError(f"worker {w.name} on {w.unit} ran out of device memory")
    return RunError(f"worker {w.name} on {w.unit}: {type(exc).__name__}: {exc}")
