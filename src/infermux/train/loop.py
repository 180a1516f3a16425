"""The training loop under measurement: one minibatch at a time, split into phases that add up.

Method (the reasons are the point):
- Each minibatch is cut by five host-clock timestamps into **fetch** (waiting on the loader: the
  stall, zero when a worker had the batch ready), **h2d** (host→device copy), **forward** (and
  the loss), **backward** and **optimizer** (the step and zeroing the gradients). On a CUDA
  device the stream is synchronized before each timestamp, so a phase is the device's work and
  not the launch of it; the cost is that the next copy cannot overlap the previous step, a
  fraction of a millisecond per step that is counted, not hidden.
- Timestamps are contiguous: a phase starts where the previous one ended and the next
  minibatch's fetch starts where this one's optimizer step ended. A pass's wall time is
  therefore exactly `startup` (building the loader's iterator: starting workers) + the phases of
  every minibatch + `tail` (the last fetch that found the epoch over, and stopping workers).
- The loader's own work is timed where it happens (in a worker or in this process) by the data
  set (`data.ImageFiles`): per item wall, CPU and read time, so a batch made in the background
  still tells its cost.
- CPU time is that of this process and its loader workers (`ProcessTreeCpu`), so a pass's CPU
  seconds can be turned into energy where no counter exists, and utilisation is known per core
  set.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from infermux.errors import DeviceOutOfMemoryError, RunError, UsageError
from infermux.train.knobs import OPTIMIZERS, Knobs

__all__ = [
    "PHASES",
    "PassResult",
    "ProcessTreeCpu",
    "Step",
    "Trainer",
    "make_loader",
    "pinned",
    "run_pass",
]

#: The phases of one minibatch, in order; they add up to its wall time.
PHASES = ("fetch", "h2d", "forward", "backward", "optimizer")


@dataclass
class Step:
    """One minibatch: its phases (ns), its items and what the loader spent making it."""

    seq: int
    items: int
    fetch_ns: int
    h2d_ns: int
    forward_ns: int
    backward_ns: int
    optimizer_ns: int
    #: Loader work for this batch, summed over its items: wall, CPU and file-read time (ns).
    load_ns: int = 0
    load_cpu_ns: int = 0
    read_ns: int = 0

    @property
    def wall_ns(self) -> int:
        """The minibatch's wall time: the sum of its phases."""
        return (self.fetch_ns + self.h2d_ns + self.forward_ns + self.backward_ns
                + self.optimizer_ns)

    @property
    def compute_ns(self) -> int:
        """Everything but the fetch stall."""
        return self.wall_ns - self.fetch_ns

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the wall time."""
        return {**asdict(self), "wall_ns": self.wall_ns}


@dataclass
class PassResult:
    """One pass over a loader (an epoch, or a profile's pass over a subset)."""

    steps: list[Step]
    startup_ns: int
    tail_ns: int
    t0_ns: int
    t1_ns: int
    cpu_s: float
    loss_first: float | None = None
    loss_last: float | None = None
    peak_memory_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    #: CPU seconds from the pass's start to the end of the minibatches asked for (`cpu_marks`
    #: of `run_pass`), and to the end of its last minibatch (before the tail)
    cpu_at: dict[int, float] = field(default_factory=dict)
    cpu_steps_s: float | None = None

    @property
    def wall_ns(self) -> int:
        """Measured wall time of the pass (host clock, start to end)."""
        return self.t1_ns - self.t0_ns

    @property
    def items(self) -> int:
        """Items trained on."""
        return sum(s.items for s in self.steps)

    @property
    def first_minibatch_ns(self) -> int | None:
        """Time to the first minibatch: building the iterator and waiting for its first batch."""
        return self.startup_ns + self.steps[0].fetch_ns if self.steps else None

    def split(self, count: int, cpu_s: float) -> tuple[PassResult, PassResult]:
        """The pass cut after its first `count` minibatches: (head, rest).

        The head holds the start-up and those minibatches, the rest the others and the tail;
        `cpu_s` is the CPU time of the head. Each part's wall time is its own.
        """
        head, rest = self.steps[:count], self.steps[count:]
        t_cut = self.t0_ns + self.startup_ns + sum(s.wall_ns for s in head)
        rest = [Step(**{**asdict(s), "seq": i}) for i, s in enumerate(rest)]
        first = PassResult(head, self.startup_ns, 0, self.t0_ns, t_cut, cpu_s, self.loss_first,
                           None, self.peak_memory_bytes, list(self.notes),
                           {i: c for i, c in self.cpu_at.items() if i < count},
                           self.cpu_at.get(count - 1))
        cut = self.cpu_at.get(count - 1)
        second = PassResult(rest, 0, self.tail_ns, t_cut, self.t1_ns, self.cpu_s - cpu_s, None,
                            self.loss_last, self.peak_memory_bytes, list(self.notes),
                            {i - count: c - cut for i, c in self.cpu_at.items()
                             if i >= count and cut is not None},
                            self.cpu_steps_s - cut if self.cpu_steps_s is not None
                            and cut is not None else None)
        return first, second

    def steady_cpu_s(self, ramp: int) -> float | None:
        """CPU seconds of the minibatches after the first `ramp` (no start-up, ramp or tail)."""
        if self.cpu_steps_s is None or len(self.steps) <= ramp:
            return None
        start = self.cpu_at.get(ramp - 1) if ramp else 0.0
        return None if start is None else self.cpu_steps_s - start

    def phase_totals_ns(self) -> dict[str, int]:
        """Each phase summed over the pass, with startup and tail."""
        totals = {p: sum(getattr(s, f"{p}_ns") for s in self.steps) for p in PHASES}
        return {"startup": self.startup_ns, **totals, "tail": self.tail_ns}

    def summary(self) -> dict[str, Any]:
        """Headline figures of the pass (times in s)."""
        wall_s = self.wall_ns / 1e9
        totals = self.phase_totals_ns()
        return {
            "steps": len(self.steps),
            "items": self.items,
            "wall_s": wall_s,
            "items_per_s": self.items / wall_s if wall_s > 0 else None,
            "phases_s": {k: v / 1e9 for k, v in totals.items()},
            "cpu_s": self.cpu_s,
            "loss_first": self.loss_first,
            "loss_last": self.loss_last,
            "peak_memory_bytes": self.peak_memory_bytes,
            "notes": self.notes,
        }


class ProcessTreeCpu:
    """CPU seconds of this process and its children (loader workers), live or already reaped."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._live: dict[int, float] = {}

    def _children(self) -> dict[int, float]:
        found: dict[int, float] = {}
        for child in self._me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                t = child.cpu_times()
                found[child.pid] = float(t.user + t.system)
        return found

    def snapshot(self) -> float:
        """Total CPU seconds so far: this process, reaped children and live children."""
        own = os.times()
        live = self._children()
        self._live = live
        return float(own.user + own.system + own.children_user + own.children_system
                     + sum(live.values()))


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # pragma: no cover - not Linux
        return [threading.get_native_id()]


@contextlib.contextmanager
def pinned(cores: tuple[int, ...] | None, threads: int, *, skip: tuple[int, ...] = ()
           ) -> Iterator[None]:
    """Run the block on `cores` with `threads` intra-op threads, then restore both.

    Every thread of this process is pinned (torch's intra-op pool exists before the block, and a
    thread keeps the affinity it had when created), except the native ids in `skip` (the
    telemetry sampler); loader workers forked inside the block inherit the core set.
    """
    import torch

    before_threads = torch.get_num_threads()
    before: dict[int, set[int]] = {}
    if cores is not None and hasattr(os, "sched_setaffinity"):
        for tid in _thread_ids():
            if tid in skip:
                continue
            with contextlib.suppress(OSError):
                before[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, cores)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before_threads)
        for tid, mask in before.items():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, mask)


def make_loader(dataset: Any, knobs: Knobs, *, indices: list[int] | None = None,
                seed: int = 0, device: str = "cpu", shuffle: bool = True) -> Any:
    """A DataLoader set to `knobs` over `dataset` (or the items `indices` of it), shuffled.

    With `shuffle` false the items come in the order of `indices`.
    """
    import torch
    from torch.utils.data import DataLoader, Subset

    data = Subset(dataset, indices) if indices is not None else dataset
    generator = torch.Generator()
    generator.manual_seed(seed)
    kwargs: dict[str, Any] = {}
    if knobs.workers > 0:
        kwargs = {"prefetch_factor": knobs.prefetch_factor,
                  "persistent_workers": knobs.persistent_workers}
    return DataLoader(data, batch_size=knobs.batch, shuffle=shuffle, num_workers=knobs.workers,
                      pin_memory=knobs.pin_memory, generator=generator, **kwargs)


class Trainer:
    """A model, its optimizer and loss on one device, in one precision; steps in phases."""

    def __init__(self, module: Any, *, device: str = "cpu", precision: str = "fp32",
                 optimizer: str = "sgd", lr: float | None = None) -> None:
        import torch

        if optimizer not in OPTIMIZERS:
            raise UsageError(f"--optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}: "
                             "e.g. --optimizer sgd")
        if lr is not None and not lr > 0:
            raise UsageError(f"--lr {lr} must be positive, e.g. --lr 0.01")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise UsageError(f"--unit {device}: no CUDA device is visible here; train on cpu")
        self.module = module.to(self.device).train()
        if optimizer == "sgd":
            self.optimizer: Any = torch.optim.SGD(self.module.parameters(), lr=lr or 0.01,
                                                  momentum=0.9)
        else:
            self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr or 1e-3)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.precision = precision
        dtype = {"amp": torch.float16 if self.cuda else torch.bfloat16, "bf16": torch.bfloat16,
                 "fp16": torch.float16}.get(precision)
        self._autocast_dtype = dtype
        self.scaler = torch.amp.GradScaler("cuda") if (self.cuda and dtype == torch.float16) \
            else None
        self._checked = False

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def _autocast(self) -> Any:
        import torch

        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def _check(self, out: Any, y: Any) -> None:
        if out.ndim != 2:
            raise UsageError(f"the model's output has shape {tuple(out.shape)}: training needs "
                             "(batch, classes) logits")
        top = int(y.max())
        if top >= out.shape[1]:
            raise UsageError(f"the data has class {top} but the model gives {out.shape[1]} "
                             f"logits: use a model with more outputs or --classes {out.shape[1]}")
        self._checked = True

    def step(self, x: Any, y: Any, non_blocking: bool) -> tuple[int, int, int, int, Any]:
        """One minibatch after its fetch: (h2d end, forward end, backward end, step end) ns, loss."""
        x = x.to(self.device, non_blocking=non_blocking)
        y = y.to(self.device, non_blocking=non_blocking)
        self._sync()
        t_h2d = time.perf_counter_ns()
        with self._autocast():
            out = self.module(x)
            if not self._checked:
                self._check(out, y)
            loss = self.loss_fn(out.float(), y)
        self._sync()
        t_fwd = time.perf_counter_ns()
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        self._sync()
        t_bwd = time.perf_counter_ns()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        return t_h2d, t_fwd, t_bwd, time.perf_counter_ns(), loss.detach()

    def peak_memory(self) -> int | None:
        """Peak device memory (CUDA) or this process's resident memory now (CPU), bytes."""
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated(self.device))
        return int(psutil.Process().memory_info().rss)


def _unpack(batch: Any) -> tuple[Any, Any, Any]:
    if isinstance(batch, (list, tuple)) and len(batch) == 3:
        return batch[0], batch[1], batch[2]
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1], None
    raise UsageError("the data set's items must be (x, y) or (x, y, timing): got "
                     f"{type(batch).__name__} of {len(batch) if hasattr(batch, '__len__') else '?'}")


def run_pass(trainer: Trainer, loader: Any, *, max_steps: int | None = None,
             on_step: Callable[[Step], None] | None = None,
             cpu: ProcessTreeCpu | None = None, cpu_marks: Collection[int] = ()) -> PassResult:
    """Train over `loader` once (or its first `max_steps` minibatches), timing every phase.

    `cpu_marks`: minibatches after which the process tree's CPU time is read (`cpu_at`), so a
    part of the pass (its steady minibatches) has its own CPU time.

    A device running out of memory raises `DeviceOutOfMemoryError`; every other failure of the
    model or the loader is a `RunError` naming the minibatch.
    """
    import torch

    cpu = cpu or ProcessTreeCpu()
    if trainer.cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    cpu0 = cpu.snapshot()
    steps: list[Step] = []
    losses: list[Any] = []
    cpu_at: dict[int, float] = {}
    cpu_steps: float | None = None
    non_blocking = bool(getattr(loader, "pin_memory", False))
    t0 = time.perf_counter_ns()
    iterator = iter(loader)
    t_prev = time.perf_counter_ns()
    startup = t_prev - t0
    try:
        while max_steps is None or len(steps) < max_steps:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            t_fetch = time.perf_counter_ns()
            x, y, timing = _unpack(batch)
            t_h2d, t_fwd, t_bwd, t_end, loss = trainer.step(x, y, non_blocking)
            step = Step(len(steps), int(y.shape[0]), t_fetch - t_prev, t_h2d - t_fetch,
                        t_fwd - t_h2d, t_bwd - t_fwd, t_end - t_bwd)
            if timing is not None:
                sums = timing.sum(dim=0).tolist()
                step.load_ns, step.load_cpu_ns, step.read_ns = (int(v) for v in sums[:3])
            steps.append(step)
            losses.append(loss)
            if step.seq in cpu_marks:
                cpu_at[step.seq] = cpu.snapshot() - cpu0
            if on_step is not None:
                on_step(step)
            t_prev = t_end
        if cpu_marks:
            cpu_steps = cpu.snapshot() - cpu0
        del iterator  # stops workers that do not persist: part of the pass's tail
    except torch.OutOfMemoryError as exc:
        raise DeviceOutOfMemoryError(
            f"out of device memory at minibatch {len(steps)} (batch {loader.batch_size}): "
            "use a smaller --batch") from exc
    except (RuntimeError, OSError) as exc:
        raise RunError(f"training failed at minibatch {len(steps)}: {type(exc).__name__}: "
                       f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    t1 = time.perf_counter_ns()
    cpu1 = cpu.snapshot()
    result = PassResult(steps, startup, t1 - t_prev, t0, t1, cpu1 - cpu0,
                        peak_memory_bytes=trainer.peak_memory(), cpu_at=cpu_at,
                        cpu_steps_s=cpu_steps)
    if losses:
        result.loss_first, result.loss_last = float(losses[0]), float(losses[-1])
    return result
