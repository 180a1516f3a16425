"""Models of several inputs in the runtime: one runner per (batch, length) bucket, padding.

A worker holds one runner per batch bucket (`dict[bucket, Runner]`) for every model. For a
model of several inputs that runner is a `SeqRunner`: it holds an engine runner per sequence
length the plan compiles (`seq_buckets`; one, at no length, when the model has no dynamic
dims) and, for each batch, picks the shortest that holds the batch's longest item. Every input
of the batch is gathered, cut or padded to that length (ids 0, mask 0: the padding stays out of
attention, so an item's outputs equal its unpadded run's) and handed to the engine runner's
`set_inputs`. Batch rows past the batch's items repeat its first item: a row of all-zero mask
is not a valid input for every network.

Why one runner per bucket pair rather than a dynamic-length graph: CUDA graphs and
`torch.compile(dynamic=False)` are specialised to one shape, as the batch buckets already are,
and a plan that lists its lengths knows what it will compile before it runs.

A batch takes the items of its oldest item's length bucket (`length_group`, read by the
dispatcher), so short queries are batched with short ones: batched with whatever came, a batch
of 128 queries of uniform 16–256 tokens nearly always held one past 128 and ran at 256 (on the
2-core dev machine, a two-layer BERT's mixed-length tokens/s was 0.38 of the fixed length's
at the mean length before, see docs/architecture-runtime.md). The runner still picks the
length from the batch's longest item, so a served batch is right whatever it holds.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from infermux.engines.base import BatchTiming, Engine, Runner
from infermux.errors import RunError, UsageError
from infermux.iospec import IOSpec, TensorSpec
from infermux.load.base import QuerySampleLibrary
from infermux.load.samples import IOSamples, parse_lengths
from infermux.models import LoadedModel
from infermux.units import Unit

__all__ = ["IORows", "SeqRunner", "StackedRows", "build_bucket_runners", "check_declared_inputs",
           "item_length", "length_group", "sample_library", "seq_axis", "seq_lengths"]


class IORows:
    """A served batch's own inputs: per item, one array per input (no batch axis)."""

    __slots__ = ("rows",)

    def __init__(self, rows: Sequence[Sequence[np.ndarray]]) -> None:
        self.rows = rows


class StackedRows:
    """A served batch's own inputs of one length: per input, its items stacked `(n, ...)`."""

    __slots__ = ("arrays",)

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        self.arrays = arrays


def item_length(io: IOSpec, item: Sequence[np.ndarray]) -> int | None:
    """One item's sequence length: the size of its first dynamic dim (None without one)."""
    at = seq_axis(io)
    return None if at is None else int(np.shape(item[at[0]])[at[1]])


def seq_axis(io: IOSpec) -> tuple[int, int] | None:
    """(input index, axis) of the model's first dynamic dim in an item, or None."""
    for j, spec in enumerate(io.inputs):
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, str):
                return j, axis
    return None


def seq_lengths(io: IOSpec, seq_buckets: Sequence[int] | None, where: str) -> list[int | None]:
    """The lengths a model's runners are built at: the plan's buckets, else its default."""
    if not io.dynamic_dims:
        if seq_buckets:
            raise UsageError(f"plan field {where}.seq_buckets: the model has no dynamic "
                             "dimension (a sequence length) to compile at; drop seq_buckets")
        return [None]
    if seq_buckets:
        return [*sorted(set(seq_buckets))]
    try:
        dims = io.dims_for(None)
    except UsageError:
        raise UsageError(f"plan field {where}.seq_buckets is missing: the model's "
                         f"{', '.join(io.dynamic_dims)} has no default size; give the sequence "
                         "lengths to compile, e.g. seq_buckets: [64, 128]") from None
    return [max(dims.values())]


def sample_library(name: str, model: LoadedModel, count: int, seed: int,
                   seq_buckets: Sequence[int] | None, lengths: int | str | None,
                   where: str) -> QuerySampleLibrary:
    """A model's sample library and the lengths its runners are built at (`seq_lengths`).

    A model with a sequence length holds samples at the longest of its `seq_buckets`, each as
    long as `lengths` (`load.lengths`) draws; the same arguments give the same samples in
    every process (a process-hosted worker's child makes its own copy).
    """
    io = model.spec_io
    built = seq_lengths(io, seq_buckets, where)
    if io.simple:
        qsl = QuerySampleLibrary(name, model.input_shape, count, seed)
    else:
        longest = built[-1]
        spread = parse_lengths(lengths) if lengths is not None and longest is not None else None
        if spread is not None and longest is not None and spread.high > longest:
            raise UsageError(f"plan field load.lengths: {lengths} go past the longest length "
                             f"{name} compiles, {longest}: set {where}.seq_buckets up to at "
                             f"least {spread.high} or shorten the lengths")
        if spread is not None and not io.pads_exactly:
            off = [n for n in spread.drawn if n not in built]
            if off:
                raise UsageError(f"plan field load.lengths: {lengths} draws lengths that {name} "
                                 f"does not compile ({', '.join(map(str, off[:4]))}"
                                 f"{', ...' if len(off) > 4 else ''}), and it has no mask input "
                                 "to pad them under without changing its outputs: give lengths "
                                 f"it compiles (e.g. {','.join(str(n) for n in built)}) or add "
                                 f"them to {where}.seq_buckets")
        qsl = QuerySampleLibrary(name, model.input_shape, count, seed, io=io,
                                 max_length=longest, lengths=spread)
    qsl.seq_lengths = built
    return qsl


def length_group(qsl: QuerySampleLibrary) -> Callable[[int, Any], int] | None:
    """An item's length bucket (index into the compiled lengths), for the dispatcher.

    From its QSL sample's length, or from its own inputs (a served item). None when the model
    compiles one length or none: every item is in one group.
    """
    lengths = [n for n in qsl.seq_lengths if n is not None]
    if qsl.io is None or len(lengths) < 2:
        return None
    at = seq_axis(qsl.io)
    bounds = np.asarray(lengths)
    samples = qsl.data
    by_sample = (np.searchsorted(bounds, samples.lengths) if samples.lengths is not None
                 else np.zeros(samples.count, dtype=np.int64))

    def group(sample: int, data: Any) -> int:
        if data is None:
            return int(by_sample[sample])
        if at is None:
            return 0
        # Per served item, on the submitting thread: bisect on the list, not a numpy call.
        return bisect.bisect_left(lengths, np.shape(data[at[0]])[at[1]])

    return group


def check_declared_inputs(io: IOSpec, declared: Sequence[Any], where: str) -> None:
    """A plan's `inputs` must be the model's: one line naming the first that is not."""
    given = [TensorSpec.coerce(d, f"input{i}") for i, d in enumerate(declared)]
    takes = {t.name: t for t in io.inputs}
    names = {t.name for t in given}
    for i, spec in enumerate(given):
        own = takes.get(spec.name)
        if own is None:
            raise UsageError(f"plan field {where}.inputs[{i}]: input {spec.name!r} is not one "
                             f"the model takes: it takes "
                             f"{', '.join(t.text() for t in io.inputs)}")
        if spec.dtype != own.dtype or (spec.shape and spec.shape != own.shape):
            raise UsageError(f"plan field {where}.inputs[{i}]: input {spec.name!r} is given as "
                             f"{spec.text()}, the model takes {own.text()}")
    missing = [t for t in io.inputs if t.name not in names]
    if missing:
        raise UsageError(f"plan field {where}.inputs: input {missing[0].name!r} is missing: the "
                         f"model takes {missing[0].text()}; list every input or drop inputs")


class SeqRunner(Runner):
    """One batch bucket of a model of several inputs: an engine runner per length bucket.

    `gather_input` picks the length and fills that runner's inputs; `launch`/`collect` keep the
    order of batches in flight (a GPU worker gathers the next batch while one runs), and
    `outputs()` is the last collected batch's, at its length.
    """

    def __init__(self, io: IOSpec, runners: dict[int | None, Runner]) -> None:
        self.io = io
        self.runners = runners
        self.lengths = sorted(k for k in runners if k is not None)
        first = next(iter(runners.values()))
        self.engine = first.engine
        self.unit = first.unit
        self.batch = first.batch
        self.input_shape = first.input_shape
        self.input_specs = io.inputs
        self.options = first.options
        self.build_s = sum(r.build_s for r in runners.values())
        self.asynchronous = any(r.asynchronous for r in runners.values())
        # `outputs()` reads the collected batch's length runner, whose outputs survive a launch
        # where every length's do.
        self.outputs_survive_launch = all(r.outputs_survive_launch for r in runners.values())
        self.length = self.lengths[-1] if self.lengths else None
        self._staged: Runner | None = None
        self._running: list[Runner] = []
        self._collected: Runner = first
        #: Tokens of the last gathered batch's items (their own lengths, not the padding).
        self.tokens = 0
        self._seq_axis = seq_axis(io)

    def bucket_for(self, length: int | None) -> int | None:
        """The shortest compiled length that holds `length`."""
        if length is None or not self.lengths:
            return None
        for size in self.lengths:
            if size >= length:
                return size
        raise UsageError(f"sequence length {length} is longer than the longest compiled, "
                         f"{self.lengths[-1]}: send at most {self.lengths[-1]} or add a longer "
                         "seq_bucket to the plan")

    def prepare_pool(self, samples: Any) -> Any:
        """The model's `IOSamples`, read as they are."""
        if not isinstance(samples, IOSamples):
            raise RunError(f"a runner of several inputs ({', '.join(t.name for t in self.io.inputs)}) "
                           "takes samples of every input, not one array")
        return samples

    def prepare_rows(self, rows: Sequence[Sequence[np.ndarray]]) -> IORows:
        """A served batch's items (every input of each) as `gather_input` reads them."""
        return IORows(rows)

    def pool_layout(self) -> tuple[str, ...]:
        """One layout: host arrays of every input."""
        return ("io",)

    def gather_input(self, pool: Any, indices: Sequence[int]) -> None:
        """Fill every input of the length bucket that holds the longest of `indices`."""
        n = len(indices)
        if n == 0 or n > self.batch:
            raise RunError(f"{n} items for a batch of {self.batch}")
        if isinstance(pool, IORows):
            arrays, length, tokens = self._from_rows(pool.rows, indices)
        elif isinstance(pool, StackedRows):
            arrays, length, tokens = self._from_stacked(pool)
        else:
            arrays, length, tokens = self._from_pool(pool, indices)
        runner = self.runners[length]
        runner.set_inputs(arrays)
        self._staged = runner
        self.length = length
        self.tokens = tokens

    def _from_pool(self, pool: IOSamples, indices: Sequence[int]
                   ) -> tuple[list[np.ndarray], int | None, int]:
        length = self.bucket_for(pool.length_of(indices))
        rows = list(indices) + [indices[0]] * (self.batch - len(indices))
        arrays = []
        for spec, array in zip(self.io.inputs, pool.arrays, strict=True):
            picked = array[rows]
            if length is not None and length != pool.max_length:
                cut = tuple(slice(0, length) if isinstance(d, str) else slice(None)
                            for d in spec.shape)
                index = (slice(None), *cut)
                picked = np.ascontiguousarray(picked[index])
            arrays.append(picked)
        return arrays, length, pool.tokens(indices)

    def _from_rows(self, rows: Sequence[Sequence[np.ndarray]], indices: Sequence[int]
                   ) -> tuple[list[np.ndarray], int | None, int]:
        items = [rows[i] for i in indices]
        try:  # items of one shape (one length): each input stacked in one copy
            stacked = [np.stack([item[j] for item in items]) for j in range(len(self.io.inputs))]
        except ValueError:
            stacked = None
        if stacked is not None:
            return self._from_stacked(StackedRows(stacked))
        at = self._seq_axis
        own = [] if at is None else [np.shape(item[at[0]])[at[1]] for item in items]
        length = self.bucket_for(max(own, default=None))
        if not self.io.pads_exactly and any(n != length for n in own):
            self._refuse_padding(own, length)
        dims = self.io.dims_for(length) if length is not None else {}
        arrays = []
        for j, spec in enumerate(self.io.inputs):
            out = np.zeros((self.batch, *spec.resolve(dims)), dtype=spec.numpy_dtype)
            for i, item in enumerate(items):
                value = np.asarray(item[j])
                where: tuple[int | slice, ...] = (i, *(slice(0, s) for s in value.shape))
                out[where] = value
            out[len(items):] = out[0]
            arrays.append(out)
        return arrays, length, sum(own)

    def _from_stacked(self, rows: StackedRows) -> tuple[list[np.ndarray], int | None, int]:
        """Items of one length, each input stacked: padded to the batch and the length bucket."""
        n = len(rows.arrays[0])
        at = self._seq_axis
        own = None if at is None else rows.arrays[at[0]].shape[1 + at[1]]
        length = self.bucket_for(own)
        if own != length and not self.io.pads_exactly:
            self._refuse_padding([own], length)
        dims = self.io.dims_for(length) if length is not None else {}
        arrays = []
        for spec, stacked in zip(self.io.inputs, rows.arrays, strict=True):
            out = np.zeros((self.batch, *spec.resolve(dims)), dtype=spec.numpy_dtype)
            where = (slice(0, n), *(slice(0, s) for s in stacked.shape[1:]))
            out[where] = stacked
            out[n:] = out[0]
            arrays.append(out)
        return arrays, length, n * (own or 0)

    def _refuse_padding(self, own: Sequence[int | None], length: int | None) -> None:
        """A model without a mask: items not at the batch's `length` cannot be padded to it.

        The dispatcher never batches them so (each length is its own group); rows handed in by
        other means (the runtime's own API) are refused rather than padded.
        """
        for n in own:
            why = self.io.unpadded_error(n, self.lengths)
            if why is not None:
                raise UsageError(why)
        raise UsageError(f"items of lengths {sorted({n for n in own if n is not None})} in one "
                         f"batch: the model has no mask input, so each runs only at its own "
                         f"length, in a batch of that length alone")

    def set_input(self, batch: np.ndarray) -> None:
        """Not for several inputs: `set_inputs`."""
        raise RunError("a runner of several inputs takes every input (set_inputs)")

    def set_inputs(self, arrays: Sequence[np.ndarray]) -> None:
        """One batch of every input, at a compiled length (its runner checks the rest)."""
        shapes = [np.shape(a) for a in arrays]
        length = item_length(self.io, [np.asarray(a)[0] for a in arrays]) if shapes else None
        runner = self.runners[self.bucket_for(length) if length is not None else None]
        runner.set_inputs(arrays)
        self._staged = runner
        self.length = runner.length

    def launch(self) -> None:
        """Start the gathered batch on its length's runner."""
        if self._staged is None:
            raise RunError("no batch was gathered to launch")
        runner, self._staged = self._staged, None
        runner.launch()
        self._running.append(runner)

    def done(self) -> bool:
        """Whether the oldest launched batch is over (its length's runner's `done`).

        Without it a runner of several inputs answered the base class's True at once, so a
        just-in-time GPU worker took every running batch for finished: it collected at once,
        and gathered each next batch with the device idle (served BERT-base: 5–6 ms idle
        before each 6–11 ms batch, every gather on that path).
        """
        return self._running[0].done() if self._running else True

    def collect(self) -> BatchTiming:
        """Wait for the oldest launched batch."""
        if not self._running:
            raise RunError("no batch was launched to collect")
        runner = self._running.pop(0)
        self._collected = runner
        return runner.collect()

    def run(self) -> BatchTiming:
        """One batch, to completion (the last one again when none was gathered)."""
        if self._staged is None:  # a timed repeat of the last batch (warm-up, estimates)
            self._staged = self._collected
        self.launch()
        return self.collect()

    def outputs(self) -> list[np.ndarray]:
        """The last collected batch's outputs, at its length."""
        return self._collected.outputs()

    def close(self) -> None:
        """Close every length's runner."""
        for runner in self.runners.values():
            runner.close()


def build_bucket_runners(engine: Engine, model: LoadedModel, unit: Unit, buckets: Sequence[int],
                         options_for: Callable[[int], dict[str, Any]], data: str, instance: int,
                         lengths: Sequence[int | None]) -> dict[int, Runner]:
    """A worker's runners of one model, by batch bucket (a `SeqRunner` each for several inputs)."""
    if model.spec_io.simple:
        return {b: engine.build(model, unit, b, options_for(b), data=data, instance=instance)
                for b in buckets}
    return {b: SeqRunner(model.spec_io, {
        n: engine.build(model, unit, b, options_for(b), data=data, instance=instance, length=n)
        for n in lengths}) for b in buckets}
