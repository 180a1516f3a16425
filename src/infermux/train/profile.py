"""`train-profile`: measure training over a grid of knobs, minibatch by minibatch, within a budget.

For each configuration of the grid, in a fresh copy of the model (same initial weights), on its
core set, with its loader:
- **profile** (default): a random subset of the data set, `steps` minibatches long, is trained
  over twice: a **cold** half with the data set's files dropped from the page cache first (what
  an epoch that reads from the medium sees) and a **warm** half over the same, now cached, files
  (what later epochs see when the data set fits in memory). Without persistent workers the two
  halves are one loader over the subset and (part of) the subset again (one start-up, cut in
  two after the subset). Both halves together stay within `profile_share` of an epoch's
  minibatches (the cold one holds the loader's ramp; each at least 3 steady minibatches).
- **epoch**: the same two passes over the whole data set: the first and a later epoch, measured
  in full (what `train-predict --validate` compares predictions with).

Every minibatch's phases (`loop.run_pass`), each pass's CPU time, energy (telemetry counters;
where none is readable, CPU time × a stated watts-per-core model, labelled as modelled), the
machine's load from other processes, and the power mode are recorded; with a store, every pass
and minibatch is written as it is measured (run kind `train`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import shutil
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from infermux.errors import DeviceOutOfMemoryError, InfermuxError, RunError, UsageError
from infermux.models import LoadedModel, ModelSpec, load_model
from infermux.store import Recording, Store, recording
from infermux.train import records
from infermux.train.data import (
    DataSpec,
    evict,
    fs_type,
    open_dataset,
    resolve_storage,
    stage,
    write_synthetic,
)
from infermux.train.knobs import Grid, Knobs
from infermux.train.loop import PassResult, ProcessTreeCpu, Trainer, make_loader, pinned, run_pass
from infermux.train.power import PowerMode, read_power_mode, set_power_mode
from infermux.train.records import PassRecord

__all__ = [
    "DEFAULT_WATTS_PER_CORE",
    "PROBE_POWER_S",
    "SHORT_PROFILE_ADVICE",
    "PassRecord",
    "TrainConfig",
    "TrainReport",
    "TrainSetup",
    "measure_compute",
    "measure_configs",
    "prepare",
    "profile_steps",
    "recorded",
    "run_train_profile",
    "settle",
]

ProgressFn = Callable[[str, float], None]
#: The CPU energy model used where no power counter is readable: watts per busy core. A stated
#: assumption (a server core under load, e.g. a 64-core 225 W package: ~3.5 W per core), not a
#: measurement; every figure it produces is labelled `modelled`.
DEFAULT_WATTS_PER_CORE = 3.5
#: The share of a profile's budget (`TrainConfig.profile_share` of an epoch) spent on its
#: minibatches; the rest is for its loader's start-up, the first minibatch's wait and the tail.
MINIBATCH_SHARE = 0.6
#: Minibatches of a compute probe (`measure_compute`): after the warm-up of its precision and
#: batch size, each is a steady minibatch (no loader workers, no ramp).
COMPUTE_PROBE_STEPS = 3
#: Mean cores used by other processes above which a pass is flagged as measured on a shared machine.
SHARED_CORES_FLAG = 0.25


@dataclass
class TrainConfig:
    """What to train, on which data and unit, over which knobs, and how long to profile."""

    model: ModelSpec
    grid: Grid
    data: DataSpec = field(default_factory=DataSpec)
    unit: str = "cpu"
    optimizer: str = "sgd"
    lr: float | None = None
    #: Most minibatches profiled per configuration (cold + warm halves together).
    profile_steps: int = 80
    #: Most share of an epoch profiled per configuration (both passes together).
    profile_share: float = 0.1
    budget_s: float | None = None
    #: Folder for `--storage disk` (default: the infermux cache's train-data folder).
    disk_dir: str | None = None
    telemetry_interval_s: float | None = 0.1
    watts_per_core: float = DEFAULT_WATTS_PER_CORE
    #: Set this Jetson power mode (id or name) first; None leaves the mode as it is.
    power_mode: str | None = None
    jetson_clocks: bool = False
    #: Keep data sets copied to a tmpfs after the run (default: removed, they take memory).
    keep_tmpfs: bool = False
    seed: int = 0
    #: Before the first profile, train on one batch until its step time settles, for at most
    #: this long (`settle`; 0 = not at all).
    settle_s: float = 3.0

    def validate(self) -> None:
        """One line naming a bad value and what is allowed."""
        self.data.validate()
        if not self.unit == "cpu" and not self.unit.startswith("cuda:"):
            raise UsageError(f"--unit {self.unit!r}: training runs on cpu or cuda:N (e.g. "
                             "cuda:0); core sets are given with --cores")
        if self.profile_steps < 6:
            raise UsageError(f"--profile-steps {self.profile_steps} is too few: at least 6 "
                             "(3 per pass), e.g. --profile-steps 40")
        if not 0 < self.profile_share <= 1:
            raise UsageError(f"--profile-share {self.profile_share} must be in (0, 1], e.g. 0.1")
        if self.budget_s is not None and self.budget_s <= 0:
            raise UsageError(f"--budget {self.budget_s}s must be positive, e.g. --budget 10m")
        if self.settle_s < 0:
            raise UsageError(f"--settle {self.settle_s} s must be 0 (off) or more, e.g. 3s")
        if self.watts_per_core <= 0:
            raise UsageError(f"--watts-per-core {self.watts_per_core} must be positive, e.g. 3.5")
        if self.jetson_clocks and self.power_mode is None:
            raise UsageError("--jetson-clocks needs --power-mode: name the mode to set with it")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (stored with the run)."""
        data = asdict(self)
        data["model"] = asdict(self.model)
        data["grid"] = self.grid.to_dict()
        data["data"] = self.data.to_dict()
        return data


@dataclass
class TrainSetup:
    """What the configurations share: the model, the staged data sets, the sampler, the store."""

    config: TrainConfig
    model: LoadedModel
    pristine: Any  # the module's initial state, copied for every configuration
    datasets: dict[str, tuple[Path, Any]]  # storage → (staged path, Dataset)
    dataset_items: int
    power: PowerMode
    sampler: Any = None
    store: Store | None = None
    run_id: int | None = None
    notes: list[str] = field(default_factory=list)
    cleanup: list[Path] = field(default_factory=list)
    #: (precision, batch) pairs already warmed up (`warm_up`)
    warmed: set[tuple[str, int]] = field(default_factory=set)
    #: What `settle` did (empty until it ran; shared by copies of the setup made with
    #: `dataclasses.replace`, as `warmed` is).
    settled: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        """The torch device trained on."""
        return self.config.unit

    def close(self) -> None:
        """Stop the sampler; remove tmpfs copies unless asked to keep them."""
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None
        for path in self.cleanup:
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                (path.parent / f".{path.name}.staged").unlink()
        self.cleanup = []


#: What a short profile's flag advises; dropped from the flags where the run says once that
#: its epochs are too short for any profile (`run.short_epoch_line`).
SHORT_PROFILE_ADVICE = (": the profile share of an epoch is too small for this batch; use more "
                        "data or a larger --profile-share")

def _disk_root(config: TrainConfig) -> Path:
    if config.disk_dir:
        return Path(config.disk_dir).expanduser()
    from infermux.export import cache_dir

    return cache_dir() / "train-data"


def prepare(config: TrainConfig, *, progress: ProgressFn | None = None,
            storages: list[str] | None = None) -> TrainSetup:
    """Validate, read (or set) the power mode, load the model, write and stage the data sets."""
    config.validate()
    power = (set_power_mode(config.power_mode, jetson_clocks=config.jetson_clocks)
             if config.power_mode is not None else read_power_mode())
    model = load_model(config.model)
    if model.module is None:
        raise UsageError(f"{model.name} is an ONNX file: training needs a torch model "
                         "(torchvision or timm name, or file.py:function)")
    disk = resolve_storage("disk", _disk_root(config))
    if config.data.source == "synthetic":
        if progress is not None:
            progress(f"writing {config.data.count} synthetic {config.data.fmt} images", 0.0)
        source = write_synthetic(config.data, disk)
        if not config.disk_dir:  # in the cache: keep its size bound, if one is set
            from infermux.cache import bound_after_write
            from infermux.export import cache_dir

            bound_after_write(cache_dir(), source)
    else:
        source = Path(config.data.source)
    datasets: dict[str, tuple[Path, Any]] = {}
    cleanup: list[Path] = []
    for storage in storages or list(dict.fromkeys(config.grid.storage)):
        folder = resolve_storage(storage, disk)
        path = stage(source, folder)
        if storage == "tmpfs" and not config.keep_tmpfs and path.resolve() != source.resolve():
            cleanup.append(path)
        datasets[storage] = (path, open_dataset(path, model.input_shape))
    sizes = {len(d) for _, d in datasets.values()}
    notes = [f"model: {model.weights_note}"]
    notes += [f"storage {s}: {p} ({fs_type(p)})" for s, (p, _) in datasets.items()]
    return TrainSetup(config, model, copy.deepcopy(model.module).cpu().state_dict(), datasets,
                      min(sizes), power, notes=notes, cleanup=cleanup)


def profile_steps(config: TrainConfig, knobs: Knobs, items: int) -> tuple[int, int]:
    """Minibatches of the cold and the warm half of a profile.

    Both halves together stay within `MINIBATCH_SHARE` (60%) of `profile_share` of an epoch's
    minibatches (the profile's start-up, its loader's ramp and tail come on top; on a GPU host
    they took the other 40%) and within `profile_steps`. The cold half holds the
    ramp (`steady.warmup_steps`: the loader's first round of batches) and as many steady
    minibatches as the warm half, which continues the same loader and has no ramp; each half has
    at least 3 steady minibatches, so a tiny epoch may be profiled beyond its share
    (`train-predict` reports the share profiled). The steady part aimed at is
    `steady.MIN_STEADY_STEPS` minibatches per half; a shorter one is flagged.
    """
    from infermux.train.steady import warmup_steps

    per_epoch = math.ceil(items / knobs.batch)
    total = min(config.profile_steps, math.floor(MINIBATCH_SHARE * config.profile_share
                                                     * per_epoch))
    ramp = warmup_steps(knobs.workers)
    steady = max(3, (total - ramp) // 2)
    cold = min(per_epoch, ramp + steady)
    return cold, min(cold, steady)


def _run_recorded(setup: TrainSetup, rec: PassRecord, trainer: Any, loader: Any, cpu: Any,
                  cpu_marks: set[int]) -> None:
    """Run one pass into `rec`: its result and energy, or why it failed (out of memory or not)."""
    try:
        rec.result = run_pass(trainer, loader, cpu=cpu, cpu_marks=cpu_marks)
    except DeviceOutOfMemoryError as exc:
        rec.status, rec.error = "oom", str(exc)
    except InfermuxError as exc:
        rec.status, rec.error = "failed", str(exc)
    if rec.result is not None:
        _energy(setup, rec.result, rec)


def _energy(setup: TrainSetup, result: PassResult, rec: PassRecord) -> None:
    """Energy and load of a pass: telemetry where a counter exists, else the stated CPU model."""
    summary = None
    if setup.sampler is not None:
        window = setup.sampler.window(result.t0_ns, result.t1_ns)
        summary = window.summary([setup.device.split(":")[0] if setup.device == "cpu"
                                  else setup.device])
        rec.extra["telemetry"] = {k: v for k, v in summary.record(result.items).items()
                                  if k in ("mean_power_w", "peak_power_w", "utilisation",
                                           "telemetry_flags", "energy_by_device_j")}
        rec.extra["_window"] = window
        rec.flags += summary.invalid_flags
        cpu = summary.devices.get("cpu")
        if cpu is not None and cpu.util_pct is not None:
            cores = os.cpu_count() or 1
            wall = result.wall_ns / 1e9
            others = max(0.0, cpu.util_pct / 100.0 * cores * wall - result.cpu_s) / wall
            rec.extra["others_cores"] = others
            if others > SHARED_CORES_FLAG:
                rec.flags.append(f"shared machine: other processes used {others:.2f} cores "
                                 "on average")
    if summary is not None and summary.energy_j is not None:
        rec.energy_j, rec.energy_source = summary.energy_j, summary.energy_source
    else:
        rec.energy_j = result.cpu_s * setup.config.watts_per_core
        rec.energy_source = (f"modelled: CPU time of the training process and its loader "
                             f"workers × {setup.config.watts_per_core:g} W per busy core (no "
                             "power counter readable)")
    with contextlib.suppress(OSError):
        rec.extra["loadavg"] = float(Path("/proc/loadavg").read_text().split()[0])


def _subset(items: int, count: int, seed: int) -> list[int]:
    order = list(range(items))
    random.Random(seed).shuffle(order)
    return order[:count]


def _measure_one(setup: TrainSetup, index: int, knobs: Knobs, kind: str) -> list[PassRecord]:
    """Two passes of one configuration: cold (first) and warm (later).

    A profile of a configuration without persistent workers is one loader over a random subset
    and then the same subset again, reshuffled, cut in two after the subset: the loader starts
    once (its start-up is in the cold half, its tail in the warm one), so the share of the epoch
    spent profiling buys steady minibatches rather than a second start. With persistent
    workers, and for full epochs, the two passes are separate (the later one reuses the
    workers, as a later epoch does).
    """
    import torch

    from infermux.train.steady import MIN_STEADY_STEPS, warmup_steps

    config = setup.config
    path, dataset = setup.datasets[knobs.storage]
    items = setup.dataset_items
    indices = None
    split = 0
    if kind == "profile" or kind.startswith("probe"):  # probe, probe:N
        steps, warm_steps = profile_steps(config, knobs, items)
        per = min(steps, items // knobs.batch)
        if not knobs.persistent_workers and per >= 1:
            subset = _subset(items, per * knobs.batch, config.seed + index)
            again = list(subset)
            random.Random(config.seed + index + 1).shuffle(again)
            indices, split = subset + again[:min(per, warm_steps) * knobs.batch], per
        else:
            indices = _subset(items, min(items, steps * knobs.batch), config.seed + index)
    recs = [PassRecord(index, knobs, kind, name, dataset_items=items) for name in ("cold", "warm")]
    module = copy.deepcopy(setup.model.module)
    module.load_state_dict(setup.pristine)
    skip = (setup.sampler._thread.native_id,) if setup.sampler is not None else ()
    torch.manual_seed(config.seed)
    cpu = ProcessTreeCpu()
    with pinned(knobs.cores, knobs.threads, skip=tuple(t for t in skip if t)), \
            warnings.catch_warnings():
        # The loader warns when workers outnumber cores; that is a knob measured here.
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        trainer = Trainer(module, device=setup.device, precision=knobs.precision,
                          optimizer=config.optimizer, lr=config.lr)
        loader = make_loader(dataset, knobs, indices=indices, seed=config.seed + index,
                             device=setup.device, shuffle=not split)
        if split:
            recs[0].extra["eviction"] = evict(path)
            if not recs[0].extra["eviction"]["evicted"] and \
                    recs[0].extra["eviction"]["fs"] in ("tmpfs", "ramfs"):
                recs[0].extra["in_memory"] = True
            ramp = min(split, warmup_steps(knobs.workers))
            try:
                whole = run_pass(trainer, loader, cpu=cpu, cpu_marks={ramp - 1, split - 1})
                halves = whole.split(split, whole.cpu_at.get(split - 1, 0.0))
                for rec, half in zip(recs, halves, strict=True):
                    rec.result = half
                    rec.extra["split"] = True
                    _energy(setup, half, rec)
            except DeviceOutOfMemoryError as exc:
                recs[0].status, recs[0].error = "oom", str(exc)
            except InfermuxError as exc:
                recs[0].status, recs[0].error = "failed", str(exc)
        else:
            for rec in recs:
                if rec.pass_name == "cold":
                    rec.extra["eviction"] = evict(path)
                _run_recorded(setup, rec, trainer, loader, cpu,
                              {warmup_steps(knobs.workers) - 1})
                if rec.status != "ok":
                    break
    if kind == "profile" or kind.startswith("probe"):  # probe, probe:N
        for rec in recs:
            if rec.result is not None:
                ramp = 0 if (split and rec.pass_name == "warm") else warmup_steps(knobs.workers)
                steady_steps = len(rec.result.steps) - ramp
                rec.extra["steady_cpu_s"] = rec.result.steady_cpu_s(ramp)
                if steady_steps < MIN_STEADY_STEPS:
                    rec.flags.append(f"short profile: {steady_steps} steady minibatches "
                                     f"(aimed at {MIN_STEADY_STEPS})" + SHORT_PROFILE_ADVICE)
    for rec in recs:
        if rec.result is None and rec.status == "ok":
            rec.status, rec.error = "skipped", "an earlier pass of this configuration failed"
    del loader
    return recs


def warm_up(setup: TrainSetup, knobs: Knobs, steps: int = 3) -> None:
    """A few unrecorded minibatches on a throwaway copy of the model, once per run.

    The first minibatches a process trains pay for one-off set-up (the device's context and
    libraries, the allocator's pools, the thread pool, and each precision and batch size's
    kernels): without this, the first configuration measured of each would carry it and its
    profile would mislead every prediction drawn from it. Once per (precision, batch).
    """
    import torch

    _, dataset = setup.datasets[knobs.storage]
    t0 = time.perf_counter()
    module = copy.deepcopy(setup.model.module)
    with pinned(knobs.cores, knobs.threads):
        trainer = Trainer(module, device=setup.device, precision=knobs.precision,
                          optimizer=setup.config.optimizer, lr=setup.config.lr)
        loader = make_loader(dataset, replace(knobs, workers=0, prefetch_factor=2,
                                              persistent_workers=False, pin_memory=False),
                             indices=list(range(min(len(dataset), steps * knobs.batch))))
        with contextlib.suppress(InfermuxError):
            run_pass(trainer, loader, max_steps=steps)
    del module, trainer
    if setup.device.startswith("cuda"):
        torch.cuda.empty_cache()
    setup.warmed.add((knobs.precision, knobs.batch))
    setup.notes.append(f"warm-up: {steps} unrecorded minibatches of {knobs.precision} batch "
                       f"{knobs.batch} first ({time.perf_counter() - t0:.1f} s)")


#: `settle`: step times are compared in blocks of this many minibatches ...
SETTLE_BLOCK = 4
#: ... and the machine is settled when a block's mean is within this share of the one before.
SETTLE_TOLERANCE = 0.05


def settle(setup: TrainSetup, knobs: Knobs) -> dict[str, Any]:
    """Train on one batch of `knobs` until its step time settles; once per run, unrecorded.

    The first profile of a run is the drift reference (`run._validate` re-profiles it beside
    every validated configuration): on an H100/H200 host its steady minibatches were still
    speeding up after the few warm-up minibatches (a MobileNet's batch-32 steps went from
    30–46 ms to 21–23 ms over its first profile), so every later probe read as the machine
    "drifting" faster by 10–35%. Blocks of `SETTLE_BLOCK` minibatches run until a block's
    mean is within `SETTLE_TOLERANCE` of the block before (or `TrainConfig.settle_s` is
    spent); what it saw is returned and kept in `setup.settled` (and the run's notes).
    """
    import torch

    if setup.settled or setup.config.settle_s <= 0:
        return setup.settled
    if (knobs.precision, knobs.batch) not in setup.warmed:
        warm_up(setup, knobs)
    _, dataset = setup.datasets[knobs.storage]
    module = copy.deepcopy(setup.model.module)
    t0 = time.perf_counter()
    blocks: list[float] = []
    with pinned(knobs.cores, knobs.threads):
        trainer = Trainer(module, device=setup.device, precision=knobs.precision,
                          optimizer=setup.config.optimizer, lr=setup.config.lr)
        loader = make_loader(dataset, replace(knobs, workers=0, prefetch_factor=2,
                                              persistent_workers=False),
                             indices=list(range(min(len(dataset), knobs.batch))))
        x, y = next(iter(loader))[:2]
        while time.perf_counter() - t0 < setup.config.settle_s:
            times = []
            for _ in range(SETTLE_BLOCK):
                t = time.perf_counter_ns()
                trainer.step(x, y, non_blocking=False)
                times.append(time.perf_counter_ns() - t)
            blocks.append(statistics.fmean(times) / 1e9)
            if len(blocks) >= 2 and abs(blocks[-1] / blocks[-2] - 1) <= SETTLE_TOLERANCE:
                break
    del module, trainer
    if setup.device.startswith("cuda"):
        torch.cuda.empty_cache()
    spent = time.perf_counter() - t0
    steady_ = len(blocks) >= 2 and abs(blocks[-1] / blocks[-2] - 1) <= SETTLE_TOLERANCE
    setup.settled.update(
        label=knobs.label, minibatches=SETTLE_BLOCK * len(blocks), s=spent,
        first_block_ms=1e3 * blocks[0] if blocks else None,
        last_block_ms=1e3 * blocks[-1] if blocks else None, settled=steady_)
    setup.notes.append(
        f"settling: {SETTLE_BLOCK * len(blocks)} unrecorded minibatches of {knobs.label} before "
        f"the first profile ({spent:.1f} s), step {1e3 * blocks[0]:.1f} → "
        f"{1e3 * blocks[-1]:.1f} ms per minibatch"
        + ("" if steady_ else f"; not settled within {setup.config.settle_s:g} s")
        if blocks else "settling: no minibatch fitted in the time given")
    return setup.settled


def measure_configs(setup: TrainSetup, configs: list[Knobs], *, kind: str = "profile",
                    progress: ProgressFn | None = None, budget_s: float | None = None,
                    indices: list[int] | None = None, extra: dict[str, Any] | None = None
                    ) -> tuple[list[PassRecord], list[Knobs]]:
    """Measure each configuration (two passes each) within `budget_s`; (passes, skipped).

    A configuration starts only if the mean time of those measured so far still fits in the
    budget; the first always runs. `indices` number the configurations (default: their position
    in `configs`; a prediction passes their position in the whole grid). Passes are stored as
    they are measured. `extra`: added to every pass's record (what a drift probe is for).
    """
    started = time.perf_counter()
    done: list[float] = []
    passes: list[PassRecord] = []
    skipped: list[Knobs] = []
    for knobs in configs:
        # Each precision and batch size's first minibatches choose their kernels (autocast,
        # cuDNN's heuristics per shape): paid once, before any is measured.
        if (knobs.precision, knobs.batch) not in setup.warmed:
            warm_up(setup, knobs)
    if kind == "profile" and configs:
        # The first profile is the drift reference: measured on a machine already settled.
        settle(setup, configs[0])
    for i, knobs in enumerate(configs):
        elapsed = time.perf_counter() - started
        if budget_s is not None and done and elapsed + sum(done) / len(done) > budget_s:
            skipped.append(knobs)
            continue
        if progress is not None:
            progress(f"{kind} {knobs.label}", i / max(1, len(configs)))
        t0 = time.perf_counter()
        recs = _measure_one(setup, indices[i] if indices is not None else i, knobs, kind)
        done.append(time.perf_counter() - t0)
        for rec in recs:
            rec.extra.update(extra or {})
            window = rec.extra.pop("_window", None)
            if setup.store is not None and setup.run_id is not None:
                records.add_pass(setup.store, setup.run_id, rec, model_name=setup.model.name,
                                 unit=_unit_label(setup.device, knobs),
                                 telemetry_rows=window.rows() if window is not None else None)
        passes += recs
    return passes, skipped


def measure_compute(setup: TrainSetup, knobs: Knobs, index: int,
                    steps: int = COMPUTE_PROBE_STEPS, *, kind: str = "compute",
                    power_s: float = 0.0, max_steps: int | None = None,
                    max_steps_time: float | None = None,
                    extra: dict[str, Any] | None = None) -> PassRecord:
    """A compute probe: `steps` minibatches of `knobs`' batch and precision, no loader workers.

    What a batch size's minibatch costs the device, measured where no profile of that batch
    size fits in the rule (an epoch of a few dozen minibatches): a GPU runs a larger batch
    faster per image than a line from a smaller one predicts, so the compute term at that batch
    is measured, not extrapolated. After the warm-up of its precision and batch size (once per
    run, as for a profile), every minibatch is steady; one batch is loaded (no workers, in the
    first minibatch's fetch) and trained on `steps` times (`_Repeated`): the probe costs one
    batch's loading, not `steps`. Kind `compute`, pass `warm`;
    `index` is a configuration of the grid it stands for (its batch, precision and cores).

    `power_s`: where a power counter measures the device (NVML, RAPL), the probe goes on
    stepping the same batch until its minibatches after the first have lasted this long (at
    most `max_steps` minibatches in all), so its mean power at this batch is a counter's read
    over a few sampler intervals, not one (`extra["power_w"]`, the minibatches after the first:
    the first holds the batch's loading). `max_steps_time`: no minibatch past the first `steps`
    starts once the probe, its start and first batch's loading included, has lasted that many
    of its own minibatches (`_Repeated`): its share of the rule's cost held in time, where a
    count of minibatches alone left the loading out (a GPU run's probes overran the rule's
    total by up to 8%). `kind`: `drift:N` for a validated configuration's
    drift probe (`run._validate`), never fitted on.
    """
    if (knobs.precision, knobs.batch) not in setup.warmed:
        warm_up(setup, knobs)
    probe = replace(knobs, workers=0, prefetch_factor=2, persistent_workers=False)
    _, dataset = setup.datasets[knobs.storage]
    items = setup.dataset_items
    rec = PassRecord(index, probe, "compute", "warm", dataset_items=items)
    module = copy.deepcopy(setup.model.module)
    module.load_state_dict(setup.pristine)
    skip = (setup.sampler._thread.native_id,) if setup.sampler is not None else ()
    cpu = ProcessTreeCpu()
    with pinned(knobs.cores, knobs.threads, skip=tuple(t for t in skip if t)):
        trainer = Trainer(module, device=setup.device, precision=knobs.precision,
                          optimizer=setup.config.optimizer, lr=setup.config.lr)
        loader = _Repeated(make_loader(dataset, probe, device=setup.device, shuffle=False,
                                       indices=_subset(items, min(items, knobs.batch),
                                                       setup.config.seed + index)), steps,
                           min_s=power_s, max_times=max(steps, max_steps or steps),
                           max_steps_time=max_steps_time,
                           # A counter read where the power window starts: the window is
                           # then between two reads, none interpolated from before it.
                           on_repeat=setup.sampler.flush
                           if power_s > 0 and setup.sampler is not None else None)
        _run_recorded(setup, rec, trainer, loader, cpu, {steps - 1})
    rec.kind = kind
    rec.extra.update(extra or {})
    if rec.result is not None:
        rec.extra["steady_cpu_s"] = rec.result.steady_cpu_s(0)
        _probe_power(setup, rec)
    window = rec.extra.pop("_window", None)
    if setup.store is not None and setup.run_id is not None:
        records.add_pass(setup.store, setup.run_id, rec, model_name=setup.model.name,
                         unit=_unit_label(setup.device, knobs),
                         telemetry_rows=window.rows() if window is not None else None)
    return rec


#: A compute probe's mean power is read over this long where a counter measures it and the
#: profile share of its epoch allows (`measure_compute`'s `power_s`): the sampler reads the
#: counter every 0.1 s, so a window of one read is mostly the counter's granularity. The
#: window starts with a read of its own (`_Repeated`'s `on_repeat`) and ends with one (the
#: telemetry window's flush), so nothing outside it is interpolated in. One second: on an
#: H200 run the counter's and the sampled power's means over the same pass were 0.57-1.48x
#: apart in windows under a second and 0.92-1.04x from one second up, and every batch-128
#: probe read under its run's epochs at that batch (400 W against 537-543 W for a ViT in fp32;
#: `bench/power_windows.py`).
PROBE_POWER_S = 1.0


def _probe_power(setup: TrainSetup, rec: PassRecord) -> None:
    """A compute probe's mean power over its minibatches after the first (W), where measured.

    The first minibatch holds the batch's loading (the device mostly waits); the others are
    the same batch trained again, the device as busy as at that batch in an epoch's compute.
    Only a counter's reading (NVML, RAPL) is kept apart; a modelled energy is the pass's own.
    """
    result = rec.result
    if result is None or len(result.steps) < 2:
        return
    if setup.sampler is None or str(rec.energy_source).startswith(("modelled", "none")):
        if rec.energy_j and result.wall_ns:
            rec.extra["power_w"] = rec.energy_j / (result.wall_ns / 1e9)
            rec.extra["power_s"] = result.wall_ns / 1e9
        return
    t0 = result.t0_ns + result.startup_ns + result.steps[0].wall_ns
    t1 = t0 + sum(s.wall_ns for s in result.steps[1:])
    summary = setup.sampler.window(t0, t1).summary([setup.device])
    if summary.energy_j is not None and t1 > t0:
        rec.extra["power_w"] = summary.energy_j / ((t1 - t0) / 1e9)
        rec.extra["power_s"] = (t1 - t0) / 1e9


class _Repeated:
    """A loader's first batch, then the same tensors `times` − 1 times more (no load timing).

    With `min_s`, the repeats go on (up to `max_times` in all) until those after the first
    have lasted that long: a probe's power window. With `max_steps_time`, no repeat past the
    first `times` starts once the whole, the first batch's loading included, has lasted that
    many of its own repeats (their mean so far): the probe's share of the rule's cost in
    minibatches, counted in time. An epoch's minibatch at this batch is no shorter than a
    repeat (the same compute, and a loader's or its fetch's time besides), so the probe's time
    over its epoch's is then at most that share.
    """

    def __init__(self, loader: Any, times: int, *, min_s: float = 0.0,
                 max_times: int | None = None, max_steps_time: float | None = None,
                 on_repeat: Callable[[], Any] | None = None) -> None:
        self.loader, self.times = loader, times
        self.min_s, self.max_times = min_s, max(times, max_times or times)
        self.max_steps_time = max_steps_time
        self.on_repeat = on_repeat
        self.pin_memory = getattr(loader, "pin_memory", False)
        self.batch_size = getattr(loader, "batch_size", None)

    def __iter__(self) -> Iterator[Any]:
        import torch

        began = time.perf_counter()
        batch = next(iter(self.loader))
        yield batch
        x, y, *rest = batch
        # Timed from the first repeat asked for: the first minibatch (the loading) is over.
        if self.on_repeat is not None:
            self.on_repeat()
        t0 = time.perf_counter()
        n = 1
        while n < self.times or (n < self.max_times
                                 and time.perf_counter() - t0 < self.min_s
                                 and not self._over(began, t0, n)):
            # The items were loaded once: the repeats carry no loading time of their own.
            yield (x, y, torch.zeros_like(rest[0])) if rest else (x, y)
            n += 1

    def _over(self, began: float, t0: float, n: int) -> bool:
        """Whether the probe has used its share (`max_steps_time`) after `n` minibatches."""
        if self.max_steps_time is None or n < 2:
            return False
        now = time.perf_counter()
        return now - began >= self.max_steps_time * (now - t0) / (n - 1)


def _unit_label(device: str, knobs: Knobs) -> str:
    if device == "cpu" and knobs.cores is not None:
        return "cpu:" + knobs.label.split(" c", 1)[1].split(" ")[0]
    return device


@dataclass
class TrainReport:
    """A profile (or prediction) run: every pass, what was skipped, the best settings."""

    run_id: int | None
    model: dict[str, Any]
    configs: list[Knobs]
    passes: list[PassRecord]
    skipped: list[Knobs]
    power: PowerMode
    dataset_items: int
    notes: list[str]
    status: str = "complete"
    elapsed_s: float = 0.0
    best: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: passes (without minibatches), best settings, notes."""
        return {
            "run_id": self.run_id, "status": self.status, "model": self.model,
            "dataset_items": self.dataset_items, "power_mode": self.power.to_dict(),
            "configs": [k.to_dict() | {"label": k.label} for k in self.configs],
            "passes": [p.to_dict() for p in self.passes],
            "skipped": [k.label for k in self.skipped], "best": self.best,
            "notes": self.notes, "elapsed_s": self.elapsed_s,
        }


@contextlib.contextmanager
def recorded(setup: TrainSetup, store: Store | None, command: str, extra: dict[str, Any]
             ) -> Iterator[Recording]:
    """The run in the store (kind `train`), begun and finished however the block ends.

    Without a store the `Recording` stores nothing; its status is still kept (`failed` or
    `interrupted` when the block raises).
    """
    from infermux.env import capture_environment

    cfg = setup.config.to_dict() | {"model_description": setup.model.describe(),
                                    "dataset_items": setup.dataset_items} | extra
    env = capture_environment() | {"power_mode": setup.power.to_dict()}
    rec = Recording(None)
    try:
        with recording(store, "train", cfg, command, env) as rec:
            if rec.run_id is not None:
                setup.store, setup.run_id = store, rec.run_id
            yield rec
    except KeyboardInterrupt:
        rec.status = "interrupted"
        raise
    except BaseException:
        if rec.status in ("complete", "running"):
            rec.status = "failed"
        raise


def start_sampler(setup: TrainSetup) -> None:
    """The telemetry sampler for the unit trained on (None when turned off)."""
    from infermux.telemetry import Sampler
    from infermux.units import discover, select_units

    interval = setup.config.telemetry_interval_s
    if interval is None:
        return
    # A GPU's telemetry is the same whatever its numeric mode: any unit of the device will do.
    ref = setup.device if setup.device == "cpu" or "/" in setup.device else f"{setup.device}/*"
    units = select_units(ref, discover(with_runtimes=False))[:1]
    setup.sampler = Sampler.for_units(units, interval_s=interval).start()
    setup.notes += [n for n in setup.sampler.describe()["notes"] if "rapl" in n or "nvml" in n]


def best_settings(passes: list[PassRecord]) -> dict[str, Any]:
    """The configurations with the shortest later epoch and the least energy per item."""
    from infermux.train.steady import profile_estimate

    by_config: dict[int, list[dict[str, Any]]] = {}
    for p in passes:
        if p.status == "ok":
            by_config.setdefault(p.config, []).append(p.as_data())
    estimates = []
    for cfg, data in by_config.items():
        est = profile_estimate(data)
        if est is not None:
            estimates.append((cfg, data[0]["label"], est))
    if not estimates:
        return {}
    fastest = min(estimates, key=lambda e: e[2]["later_s"])
    energies = [e for e in estimates if e[2].get("later_energy_j") is not None]
    best = {"time": {"config": fastest[0], "label": fastest[1],
                     "epoch_s": fastest[2]["later_s"], "first_epoch_s": fastest[2]["first_s"]}}
    if energies:
        frugal = min(energies, key=lambda e: e[2]["later_energy_j"])
        best["energy"] = {"config": frugal[0], "label": frugal[1],
                          "epoch_energy_j": frugal[2]["later_energy_j"],
                          "epoch_s": frugal[2]["later_s"],
                          "energy_source": frugal[2].get("energy_source")}
    return best


def run_train_profile(config: TrainConfig, *, store: Store | None = None,
                      progress: ProgressFn | None = None, command: str = "") -> TrainReport:
    """Profile every configuration of the grid within the budget (see the module docstring)."""
    started = time.perf_counter()
    configs = config.grid.configs(config.unit)
    setup = prepare(config, progress=progress)
    report = TrainReport(None, setup.model.describe(), configs, [], [], setup.power,
                         setup.dataset_items, setup.notes)
    rec = Recording(None)
    try:
        with recorded(setup, store, command, {"configs": [k.label for k in configs]}) as rec:
            report.run_id = rec.run_id
            start_sampler(setup)
            remaining = None if config.budget_s is None else (
                config.budget_s - (time.perf_counter() - started))
            report.passes, report.skipped = measure_configs(setup, configs, progress=progress,
                                                            budget_s=remaining)
            report.best = best_settings(report.passes)
            if not any(p.status == "ok" for p in report.passes):
                rec.status = "failed"
            if report.skipped:
                report.notes.append(f"{len(report.skipped)} configuration(s) did not fit in the "
                                    f"budget: {', '.join(k.label for k in report.skipped)}")
            rec.summary = {
                "configs": len(configs), "measured": len({p.config for p in report.passes}),
                "skipped": len(report.skipped), "best": report.best,
                "elapsed_s": time.perf_counter() - started}
        return report
    finally:
        report.status = rec.status
        report.elapsed_s = time.perf_counter() - started
        setup.close()


def check_device(unit: str) -> None:
    """Fail early, in one line, when the unit's device is not here."""
    if unit.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RunError(f"--unit {unit}: no CUDA device is visible here; use --unit cpu")
