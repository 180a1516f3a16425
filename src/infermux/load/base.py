"""The two sides of a load test: queries with sample indices, the sample library, the SUT."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["CompletionFn", "Query", "QuerySampleLibrary", "SystemUnderTest"]


@dataclass(frozen=True)
class Query:
    """One query: an id, the model it is for, and the indices of its samples in that model's QSL."""

    id: int
    model: str
    samples: tuple[int, ...]
    #: Inputs that came with the query (a server's request): row `s` of `inputs` is sample `s`,
    #: and the runtime returns the outputs. None: samples are indices into the model's QSL.
    inputs: Any = None


#: complete([(query_id, samples_done), ...], ok, when_ns): the SUT reports finished samples,
#: a batch at a time (one call per batch keeps the per-sample cost off the hot path).
CompletionFn = Callable[[Sequence[tuple[int, int]], bool, int], None]


class SystemUnderTest(Protocol):
    """What a load generator drives: it issues queries and is told when samples complete."""

    def start(self, on_complete: CompletionFn) -> None:
        """Get ready to take queries; report every finished sample through `on_complete`."""

    def issue(self, queries: Sequence[Query]) -> None:
        """Take queries; must return quickly (the work happens elsewhere)."""

    def capacity_items(self, model: str) -> int:
        """How many samples of `model` the SUT can work on at once (sizes the offline backlog)."""

    def end(self) -> None:
        """No more queries will come (the SUT may flush partial batches)."""


class QuerySampleLibrary:
    """A model's samples held in memory: `count` items of `input_shape`, float32, seeded.

    The data is synthetic unless given (throughput and latency do not depend on pixel values);
    the same name and seed give the same samples in every process. A model of several inputs
    (`io`) gets `IOSamples` instead (`infermux.load.samples`): every input, generated from its
    spec, `max_length` long, each sample as long as `lengths` draws.
    """

    def __init__(self, name: str, input_shape: tuple[int, ...], count: int, seed: int = 0,
                 data: np.ndarray | None = None, *, io: Any = None,
                 max_length: int | None = None, lengths: Any = None) -> None:
        self.name = name
        self.input_shape = tuple(input_shape)
        self.count = count
        self.seed = seed
        self._data: Any = data
        self.io = io
        self.max_length = max_length
        self.lengths = lengths
        #: The sequence lengths the model's runners are built at ([None]: no dynamic dims).
        self.seq_lengths: list[int | None] = [None]

    @property
    def data(self) -> Any:
        """All samples, generated on first use: `(count, *input_shape)` float32, or `IOSamples`."""
        if self._data is None and self.io is not None:
            from infermux.load.samples import IOSamples

            self._data = IOSamples.generate(self.io, self.name, self.count, self.seed,
                                            self.max_length, self.lengths)
        if self._data is None:
            rng = np.random.default_rng([self.seed, zlib.crc32(self.name.encode())])
            self._data = rng.standard_normal((self.count, *self.input_shape), dtype=np.float32)
        return self._data
