"""Samples of models with several inputs, and the sequence lengths queries carry.

A model of one float input keeps its samples in one array (`QuerySampleLibrary.data`). A model
of several named inputs (token ids, masks, features) gets an `IOSamples`: one array per input,
every sample at the longest length the plan compiles, and each sample's own length. Positions
past a sample's length are padding: ids 0 and mask 0, so a runner built at any length at least
the sample's runs it as if unpadded (the mask keeps the padding out of attention).

`Lengths` is how long the queries of a load are (`load.lengths`): a fixed length (`128`), a
uniform distribution (`uniform:16-256`) or an equal choice among a few (`32,64,128`).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infermux.errors import UsageError
from infermux.iospec import IOSpec

__all__ = ["IOSamples", "Lengths", "parse_lengths"]

_UNIFORM = re.compile(r"^uniform:(\d+)-(\d+)$")
_LENGTHS_HELP = "a length (128), uniform:16-256, or a list of lengths (32,64,128)"


@dataclass(frozen=True)
class Lengths:
    """How long queries are: `low`–`high` uniform, or one of `choices` (equal odds)."""

    text: str
    low: int
    high: int
    choices: tuple[int, ...] = ()

    @property
    def mean(self) -> float:
        """The mean length of a query."""
        if self.choices:
            return float(np.mean(self.choices))
        return (self.low + self.high) / 2

    @property
    def drawn(self) -> tuple[int, ...]:
        """Every length a query may have, each once, ascending."""
        return tuple(sorted(set(self.choices))) if self.choices else tuple(
            range(self.low, self.high + 1))

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` lengths, int64."""
        if self.choices:
            return rng.choice(np.asarray(self.choices, dtype=np.int64), size=count)
        return rng.integers(self.low, self.high + 1, size=count, dtype=np.int64)


def parse_lengths(value: Any) -> Lengths:
    """A `load.lengths` value as `Lengths`; a bad one is one UsageError line."""
    text = str(value).strip().replace(" ", "")
    bad = UsageError(f"lengths {value!r} unknown: use {_LENGTHS_HELP}")
    if isinstance(value, bool):
        raise bad
    match = _UNIFORM.match(text)
    if match:
        low, high = int(match.group(1)), int(match.group(2))
        if not 1 <= low <= high:
            raise UsageError(f"lengths {value!r}: the range must go from 1 or more up, "
                             "e.g. uniform:16-256")
        return Lengths(text, low, high)
    parts = text.split(",")
    if not all(p.isdigit() for p in parts):
        raise bad
    choices = tuple(int(p) for p in parts)
    if min(choices) < 1:
        raise UsageError(f"lengths {value!r}: every length must be at least 1")
    return Lengths(text, min(choices), max(choices), choices if len(choices) > 1 else ())


class IOSamples:
    """Every input's samples at the longest length, and each sample's own length.

    `arrays[i]` is input i's samples, `(count, *shape at max_length)`; `lengths[s]` is sample
    s's length (None when the model has no dynamic dims: every sample is whole).
    """

    def __init__(self, io: IOSpec, arrays: Sequence[np.ndarray], lengths: np.ndarray | None,
                 max_length: int | None) -> None:
        self.io = io
        self.arrays = list(arrays)
        self.lengths = lengths
        self.max_length = max_length

    @classmethod
    def generate(cls, io: IOSpec, name: str, count: int, seed: int, max_length: int | None,
                 lengths: Lengths | None = None) -> IOSamples:
        """Seeded samples from the spec, each as long as `lengths` draws.

        Ids within the vocabulary, masks of ones up to each sample's length; without `lengths`
        every sample is `max_length` long. The same name, seed and settings give the same
        samples in every process.
        """
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        dims = io.dims_for(max_length) if io.dynamic_dims else {}
        arrays = [spec.generate(count, dims, rng) for spec in io.inputs]
        if not io.dynamic_dims or max_length is None:
            return cls(io, arrays, None, None)
        if lengths is not None and lengths.high > max_length:
            raise UsageError(f"lengths {lengths.text} go past the longest sequence length "
                             f"compiled, {max_length}: raise seq_buckets or lower the lengths")
        own = (lengths.draw(rng, count) if lengths is not None
               else np.full(count, max_length, dtype=np.int64))
        keep = np.arange(max_length)[None, :] < own[:, None]  # (count, max_length)
        for spec, array in zip(io.inputs, arrays, strict=True):
            for axis, dim in enumerate(spec.shape, start=1):
                if isinstance(dim, str):
                    shape = [count] + [1] * (array.ndim - 1)
                    shape[axis] = max_length
                    array *= keep.reshape(shape).astype(array.dtype)
        return cls(io, arrays, own, max_length)

    @property
    def count(self) -> int:
        """How many samples."""
        return len(self.arrays[0])

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, rows: slice) -> IOSamples:
        """Some of the samples (a slice), e.g. `[:1]` for a warm-up batch."""
        return IOSamples(self.io, [a[rows] for a in self.arrays],
                         None if self.lengths is None else self.lengths[rows], self.max_length)

    def length_of(self, indices: Sequence[int]) -> int | None:
        """The longest of the samples `indices` (None without dynamic dims)."""
        if self.lengths is None:
            return None
        return int(self.lengths[list(indices)].max())

    def tokens(self, indices: Sequence[int]) -> int:
        """Tokens in samples `indices` (each sample's length; 0 without dynamic dims)."""
        if self.lengths is None:
            return 0
        return int(self.lengths[list(indices)].sum())
