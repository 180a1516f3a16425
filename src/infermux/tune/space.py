"""The tuner's search space: per unit its engines, batch sizes, instance counts and options.

A `Config` is one replica of one model (unit, engine, batch, instances, options). A `Candidate`
is a whole plan: configs of every model on distinct units. The `Space` enumerates what may be
combined; its size is what a brute-force search would measure. Units that share cores (`cpu`
and `openvino:CPU`, overlapping core sets) are alternatives: each is searched, never both in
one plan.

A model with a sequence length (a transformer taking token ids) has one more option: the
sequence-length buckets its plan compiles (`seq_buckets`), candidates derived from the lengths
its queries carry (`seq_bucket_sets`). Finer buckets pad less (`padding_efficiency`) but build
more runners and split a mixed load into more partial batches, so the set is measured like any
other option. It rides in a config's options under `seq_buckets` and leaves them for the plan's
model entry (`Config.replica` drops it).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from infermux.engines.fp8 import unit_reason
from infermux.load.samples import Lengths
from infermux.units import Unit

__all__ = [
    "COMPILE_MODES",
    "DEFAULT_COMPILE_MODES",
    "SEQ_KEY",
    "SLOW_BUILDS",
    "Candidate",
    "Config",
    "Space",
    "UnitSpace",
    "option_variants",
    "overlapping_units",
    "padding_efficiency",
    "seq_bucket_sets",
]

#: The option key of a config's sequence-length buckets (a model entry's field, not an engine's).
SEQ_KEY = "seq_buckets"
#: Bucket ends are rounded up to a multiple of this (kernels tile sequence lengths by 8).
_SEQ_ALIGN = 8
#: The fine bucket set of a range of lengths cuts it into about this many equal steps.
_FINE_STEPS = 8

#: Engines whose first build of a model is slow (LiteRT converts it, 15 s for
#: mobilenet_v3_small on two cores; TensorRT builds an engine, minutes): screened after the
#: others, so the first trials' cost, which sets what the budget expects of the next, is a
#: typical one, and a short budget still screens every quick engine.
SLOW_BUILDS = ("litert", "tensorrt")

#: torch.compile modes the tuner may try on GPUs.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: Those it tries unless told otherwise: max-autotune takes minutes per batch size, and the
#: torch engine runs `reduce-overhead` as `default` inside the runner's own CUDA graph, which
#: `default` already gets on a GPU (a second trial of the same thing).
DEFAULT_COMPILE_MODES = ("default",)


def _frozen(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(options.items()))


@dataclass(frozen=True)
class Config:
    """One replica: `instances` workers of `model` on `unit`, each taking batches of `batch`."""

    model: str
    unit: str
    engine: str
    batch: int
    instances: int = 1
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def make(cls, model: str, unit: str, engine: str, batch: int, instances: int = 1,
             options: dict[str, Any] | None = None) -> Config:
        """Build one with options given as a dict."""
        return cls(model, unit, engine, batch, instances, _frozen(options or {}))

    @property
    def options_dict(self) -> dict[str, Any]:
        """The engine options as a dict."""
        return dict(self.options)

    def key(self) -> str:
        """A canonical text key (what the store's reuse looks up)."""
        return json.dumps([self.model, self.unit, self.engine, self.batch, self.instances,
                           list(map(list, self.options))], sort_keys=True)

    def label(self) -> str:
        """`cpu openvino b8 ×2 {hint=latency}` for tables."""
        text = f"{self.unit} {self.engine} b{self.batch}"
        if self.instances > 1:
            text += f" ×{self.instances}"
        if self.options:
            text += " {" + ", ".join(
                f"seq={'/'.join(map(str, v))}" if k == SEQ_KEY else f"{k}={v}"
                for k, v in self.options) + "}"
        return text

    @property
    def compiled(self) -> bool:
        """Built with torch.compile: its build takes far longer than an eager one's."""
        return bool(self.options_dict.get("compile"))

    @property
    def seq_buckets(self) -> tuple[int, ...] | None:
        """The sequence lengths compiled, when the config chooses them (else the model's default)."""
        value = self.options_dict.get(SEQ_KEY)
        return tuple(value) if value else None

    def replica(self) -> dict[str, Any]:
        """The runtime Plan's replica entry (the sequence buckets belong to the model entry)."""
        options = {k: v for k, v in self.options if k != SEQ_KEY}
        return {"unit": self.unit, "engine": self.engine, "instances": self.instances,
                "batch": self.batch, "options": options}

    def with_(self, **changes: Any) -> Config:
        """A copy with fields changed (`options` as a dict)."""
        data: dict[str, Any] = {"model": self.model, "unit": self.unit, "engine": self.engine,
                "batch": self.batch, "instances": self.instances, "options": self.options_dict}
        data.update(changes)
        return Config.make(**data)


@dataclass(frozen=True)
class Candidate:
    """A whole plan: one config per (model, unit) pair, units never shared between configs."""

    configs: tuple[Config, ...]

    @classmethod
    def of(cls, *configs: Config) -> Candidate:
        """A candidate in a canonical order (so equal plans have equal keys)."""
        return cls(tuple(sorted(configs, key=lambda c: (c.model, c.unit))))

    @property
    def units(self) -> tuple[str, ...]:
        """The units the candidate occupies."""
        return tuple(c.unit for c in self.configs)

    @property
    def solo(self) -> bool:
        """One config on one unit."""
        return len(self.configs) == 1

    @property
    def compiled(self) -> bool:
        """Any of its configs is built with torch.compile."""
        return any(c.compiled for c in self.configs)

    @property
    def engines(self) -> frozenset[str]:
        """The engines its configs run on."""
        return frozenset(c.engine for c in self.configs)

    def key(self) -> str:
        """A canonical text key."""
        return "|".join(c.key() for c in self.configs)

    def label(self) -> str:
        """The configs' labels joined by `+`."""
        return " + ".join((f"{c.model}: " if len({x.model for x in self.configs}) > 1 else "")
                          + c.label() for c in self.configs)

    def add(self, config: Config) -> Candidate:
        """A copy with one more config."""
        return Candidate.of(*self.configs, config)

    def replace(self, old: Config, new: Config) -> Candidate:
        """A copy with `old` swapped for `new`."""
        return Candidate.of(*(new if c == old else c for c in self.configs))


def option_variants(engine: str, unit: Unit, *,
                    compile_modes: Sequence[str] = DEFAULT_COMPILE_MODES,
                    fp8: bool = False) -> list[dict[str, Any]]:
    """Engine options worth trying on `unit`; the first is the engine's own default.

    PyTorch on a GPU: CUDA graphs on (default) or off, then each of `compile_modes`
    (torch.compile's `default` unless told otherwise; `max-autotune` takes
    minutes per batch size, so only on request). Not on CPUs: a compile there takes minutes on
    few cores for no measured gain. With `fp8` (a network whose Linears hold most of its
    weights, `engines.fp8.WORTH_SHARE`) on an fp16/bf16 unit with FP8 tensor cores, each compile
    mode again with `precision: fp8`. OpenVINO: its throughput hint (default) or latency hint.
    ONNX Runtime: spinning intra-op threads (default) or not. LiteRT on an fp32 CPU unit: fp32
    (default) or int8 (calibrated on seeded noise: a speed measurement). Engines without knobs worth
    searching get only their default.
    """
    if engine == "torch" and unit.kind == "cuda":
        variants: list[dict[str, Any]] = [{}, {"cuda_graph": False}]
        variants += [{"compile": mode} for mode in compile_modes]
        if fp8 and not unit_reason(unit):
            # FP8 products pay off compiled, where their casts fuse into the kernels before.
            variants += [{"compile": mode, "precision": "fp8"} for mode in compile_modes] or [
                {"precision": "fp8"}]
        return variants
    if engine == "openvino":
        return [{}, {"hint": "latency"}]
    if engine == "onnxruntime" and unit.kind == "cpu":
        return [{}, {"allow_spinning": False}]
    if engine == "litert" and unit.kind == "cpu" and unit.mode == "fp32":
        return [{}, {"precision": "int8"}]
    return [{}]


def seq_bucket_sets(lengths: Lengths) -> list[tuple[int, ...]]:
    """Candidate `seq_buckets` for queries of `lengths`, the default first.

    One length: that length alone. A list of lengths: exactly those (nothing padded), then the
    longest alone. A range: powers of two above its low end up to its high end (the usual
    choice, the default), about eight equal steps ending at the high end (less padding, more
    runners), and the high end alone (one runner per batch, the most padding).
    """
    if lengths.low == lengths.high:
        return [(lengths.high,)]
    if lengths.choices:
        return [tuple(sorted(set(lengths.choices))), (lengths.high,)]
    low, high = lengths.low, lengths.high
    pow2: list[int] = []
    p = 1
    while p <= low:
        p *= 2
    while p < high:
        pow2.append(p)
        p *= 2
    pow2.append(high)
    step = -(-(high - low) // _FINE_STEPS)
    step = max(_SEQ_ALIGN, -(-step // _SEQ_ALIGN) * _SEQ_ALIGN)
    fine = sorted({high - k * step for k in range(_FINE_STEPS + 1) if high - k * step > low}
                  | {high})
    sets: list[tuple[int, ...]] = []
    for candidate in (tuple(pow2), tuple(fine), (high,)):
        if candidate not in sets:
            sets.append(candidate)
    return sets


def padding_efficiency(buckets: Sequence[int], lengths: Lengths) -> float:
    """Tokens queried ÷ tokens computed when each query is padded to its bucket (1.0: none).

    Exact for the distributions `load.lengths` draws: uniform over a range or equal odds over
    a list.
    """
    ends = sorted(buckets)
    values = list(lengths.choices) or list(lengths.drawn)  # a list's repeats weigh more
    padded = 0
    for n in values:
        bucket = next((b for b in ends if b >= n), None)
        if bucket is None:
            raise ValueError(f"length {n} is past the longest bucket {ends[-1]}")
        padded += bucket
    return sum(values) / padded


@dataclass
class UnitSpace:
    """What may run on one unit.

    `seq_sets` holds, per model with a sequence length, its candidate bucket sets (the
    default first): each engine option variant is tried with each set.
    """

    unit: Unit
    engines: list[str]
    batches: list[int]
    instances: list[int]
    options: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    seq_sets: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)

    def variants(self, engine: str, model: str | None = None) -> list[dict[str, Any]]:
        """The option variants of `engine` for `model`, the engine's and the model's default first.

        The default bucket set is no option (`{}`): the plan's model entry gets it anyway.
        """
        own = self.options.get(engine, [{}])
        sets = self.seq_sets.get(model or "", [])
        if len(sets) < 2:
            return own
        return [o | ({SEQ_KEY: s} if i else {}) for i, s in enumerate(sets) for o in own]

    def configs(self, model: str) -> list[Config]:
        """Every config of `model` on this unit."""
        return [Config.make(model, self.unit.id, e, b, i, o)
                for e in self.engines for o in self.variants(e, model)
                for b in self.batches for i in self.instances]


def overlapping_units(units: Sequence[Unit], host_cores: Iterable[int]) -> set[frozenset[str]]:
    """Pairs of unit ids that share cores, as alternatives the space never combines.

    `cpu` and `openvino:CPU` are the host's cores under two names; core sets overlap when they
    intersect. `host_cores` are the cores `cpu` and OpenVINO's CPU device run on.
    """
    everything = tuple(host_cores)

    def cores(unit: Unit) -> set[int]:
        if unit.kind == "cpu":
            return set(unit.cores or everything)
        if unit.kind == "openvino" and unit.device.upper().startswith("OPENVINO:CPU"):
            return set(everything)
        return set()

    pairs = set()
    for a, b in itertools.combinations(units, 2):
        if cores(a) & cores(b):
            pairs.add(frozenset((a.id, b.id)))
    return pairs


@dataclass
class Space:
    """The whole space: models × units, and which units may be combined.

    `overlaps` holds the pairs of unit ids that share cores: each is a candidate of its own,
    never combined with the other.
    """

    models: list[str]
    units: list[UnitSpace]
    overlaps: set[frozenset[str]] = field(default_factory=set)
    #: Models whose queries vary in length: measured through the runtime only (an in-process
    #: trial runs one length).
    mixed_lengths: set[str] = field(default_factory=set)

    def unit(self, unit_id: str) -> UnitSpace:
        """The space of one unit."""
        for u in self.units:
            if u.unit.id == unit_id:
                return u
        raise KeyError(unit_id)

    def compatible(self, unit_id: str, others: Iterable[str]) -> bool:
        """Whether `unit_id` may join a plan holding `others` (a distinct unit, no shared cores)."""
        return all(unit_id != o and frozenset((unit_id, o)) not in self.overlaps for o in others)

    def solo_configs(self) -> list[Config]:
        """Every single-unit config of every model."""
        return [c for m in self.models for u in self.units for c in u.configs(m)]

    def size(self) -> int:
        """Plans a brute-force search would measure.

        Every choice of one config or none per (model, unit), at least one config in all, on
        units that share no cores; with several models each unit serves one model or none.
        """
        per_unit = {u.unit.id: sum(len(u.configs(m)) for m in self.models) for u in self.units}
        # Units that share cores form small groups; a plan takes any set of units with no two
        # of a group's overlapping ones, so the count is a product over the groups.
        total = 1
        for group in self._groups():
            choices = 0
            for k in range(len(group) + 1):
                for chosen in itertools.combinations(group, k):
                    if any(frozenset(p) in self.overlaps
                           for p in itertools.combinations(chosen, 2)):
                        continue
                    count = 1
                    for unit_id in chosen:
                        count *= per_unit[unit_id]
                    choices += count
            total *= choices
        return total - 1

    def _groups(self) -> list[list[str]]:
        """The units in groups connected by shared cores (a unit sharing none is alone)."""
        groups: list[list[str]] = []
        for unit_id in (u.unit.id for u in self.units):
            linked = [g for g in groups if any(frozenset((unit_id, o)) in self.overlaps
                                               for o in g)]
            merged = [unit_id] + [x for g in linked for x in g]
            groups = [g for g in groups if g not in linked] + [merged]
        return groups

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "models": self.models,
            "units": [{"unit": u.unit.id, "engines": u.engines, "batches": u.batches,
                       "instances": u.instances, "options": u.options,
                       "seq_sets": {m: [list(s) for s in sets] for m, sets in u.seq_sets.items()}}
                      for u in self.units],
            "mixed_lengths": sorted(self.mixed_lengths),
            "overlaps": sorted(sorted(p) for p in self.overlaps),
            "solo_configs": len(self.solo_configs()),
            "plans": self.size(),
        }
