"""The Plan: what to run where, how to dispatch it, and what load to put on it.

A Plan is the one contract between whoever decides (a person's YAML, the tuner, the partitioner)
and the runtime. It is validated when it is built: every error names the field path, the bad
value and what is allowed, as one line.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from infermux.errors import UsageError
from infermux.load.scenarios import PEAK_RESOLUTION, STALL_RETRIES
from infermux.units import parse_core_set

__all__ = [
    "EXAMPLE_PLAN",
    "QUEUE_DELAY_MS",
    "DispatcherSettings",
    "LoadSettings",
    "MixPhase",
    "ModelEntry",
    "Plan",
    "Replica",
    "ServeDefaults",
    "Stage",
    "fine_buckets",
    "load_plan",
    "options_for_bucket",
    "parse_plan",
]

SCENARIOS = ("offline", "server", "single-stream", "multi-stream")
#: The dispatcher's queue delay (ms) when a plan gives none: the one default of every plan the
#: runtime, the tuner, the partitioner and the studies build (a server tune then tries others).
QUEUE_DELAY_MS = 2.0
_UNIT_RE = re.compile(
    r"^(cpu(:[0-9+\-]+)?(/(fp32|int8))?|cuda:\d+/(fp32|tf32|fp16|bf16)|dla:\d+/(fp16|int8)|openvino:[A-Za-z0-9_.]+)$"
)
_UNIT_HELP = "cpu, cpu:0-3, cpu:0-3/int8, cuda:0/fp16 (fp32, tf32, fp16, bf16), dla:0/fp16 or openvino:CPU"


def _check_unit(value: str) -> str:
    if not _UNIT_RE.match(value):
        raise ValueError(f"unit {value!r} is not a unit id; allowed: {_UNIT_HELP}")
    if value.startswith("cpu:"):
        parse_core_set(value[4:])
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Replica(_Strict):
    """Instances of one model on one unit; every instance is one worker."""

    unit: str = Field(description=_UNIT_HELP)
    engine: str = "torch"
    instances: int = Field(1, ge=1, le=64)
    batch: int = Field(1, ge=1, le=4096)
    #: Batch sizes with their own runner (a partial batch runs in the smallest that holds it,
    #: padded): `pow2` = 1, 2, 4, ... up to `batch`; `fine` = powers of two below half the
    #: batch, then steps of an eighth of it (`fine_buckets`); `none` = only `batch` (always
    #: padded).
    batch_buckets: Literal["pow2", "fine", "none"] | list[int] = "pow2"
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("unit")
    @classmethod
    def _unit(cls, value: str) -> str:
        return _check_unit(value)

    @field_validator("batch_buckets")
    @classmethod
    def _buckets(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or any(b < 1 for b in value)):
            raise ValueError(f"batch_buckets {value!r} must be positive batch sizes, pow2, fine "
                             "or none")
        return value

    @model_validator(mode="after")
    def _fit(self) -> Replica:
        if isinstance(self.batch_buckets, list) and max(self.batch_buckets) > self.batch:
            raise ValueError(
                f"batch_buckets {self.batch_buckets} go past batch {self.batch}: "
                "every bucket must be at most the batch size"
            )
        cores = self.cores
        if cores and self.instances > len(cores):
            raise ValueError(
                f"{self.instances} instances on {self.unit} ({len(cores)} cores) oversubscribe it: "
                f"use at most {len(cores)} instances or a larger core set"
            )
        return self

    @property
    def cores(self) -> tuple[int, ...]:
        """The explicit core set of a `cpu:` unit; empty for other units and bare `cpu`."""
        return parse_core_set(self.unit[4:]) if self.unit.startswith("cpu:") else ()

    def buckets(self) -> list[int]:
        """The batch sizes that get a runner, ascending, always ending at `batch`."""
        if self.batch_buckets == "none":
            return [self.batch]
        if self.batch_buckets == "pow2":
            sizes = [1 << i for i in range(self.batch.bit_length()) if (1 << i) < self.batch]
            return [*sizes, self.batch]
        if self.batch_buckets == "fine":
            return fine_buckets(self.batch)
        return sorted({*self.batch_buckets, self.batch})


def fine_buckets(batch: int) -> list[int]:
    """Powers of two below half of `batch`, then every eighth of it from the half up.

    Under server load a worker takes whatever has queued, so its batches spread over every
    size between half the batch and the batch; in power-of-two buckets each of those runs at
    the whole batch's cost (a batch of 33 pads to 64). Eighths cap the padding at an eighth
    of the batch where the load near the peak lands. Measured against `pow2` it was not
    better on every host, so it is not the default (docs/architecture-runtime.md).
    """
    half = max(1, batch // 2)
    step = max(1, batch // 8)
    low = [1 << i for i in range(half.bit_length()) if (1 << i) < half]
    return sorted({*low, *range(half, batch, step), batch})


class Stage(_Strict):
    """One pipeline stage: the segment between two boundaries, where it runs, and how it is fed.

    `start`/`end` are `input`, a cut point's node name (see `infermux partition --show`) or
    `output`. A stage on several `units`, or with `instances` > 1 per unit, is duplicated: each
    copy takes whole batches from the same inbound link. `buffers` is how many batches each copy
    may have written and not yet consumed downstream: it bounds the link's memory. Any engine
    that runs the stage's units builds its segment (ONNX engines from the segment's export).
    """

    start: str = "input"
    end: str = "output"
    units: list[str] = Field(min_length=1)
    engine: str = "torch"
    instances: int = Field(1, ge=1, le=64)
    batch: int = Field(1, ge=1, le=4096)
    buffers: int = Field(2, ge=1, le=64)
    options: dict[str, Any] = Field(default_factory=dict)
    #: What the partitioner predicted for one batch of this stage (informational).
    predicted_time_s: float | None = None

    @field_validator("units")
    @classmethod
    def _units(cls, value: list[str]) -> list[str]:
        for unit in value:
            _check_unit(unit)
        return value

    def cores(self) -> tuple[int, ...]:
        """Every explicit core of the stage's `cpu:` units."""
        return tuple(c for u in self.units if u.startswith("cpu:") for c in parse_core_set(u[4:]))


class ModelEntry(_Strict):
    """One network of the plan and where it runs: data-parallel replicas, pipeline stages, or both."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$", max_length=64)
    model: str = Field(description="resnet50, timm:NAME, path/file.py:function or file.onnx")
    weights: str | None = None
    input_shape: list[int] | None = None
    replicas: list[Replica] = Field(default_factory=list)
    #: Pipeline stages, in order: the network cut into contiguous segments across units.
    stages: list[Stage] | None = None
    #: Whole copies of the pipeline that share its input and output.
    pipeline_replicas: int = Field(1, ge=1, le=16)
    #: A latency bound per query: SLO-aware placement keeps queries off units that would break it.
    latency_bound_ms: float | None = Field(None, gt=0)
    #: Share of the queries that go to this model (normalised over the plan's models).
    share: float = Field(1.0, ge=0)
    #: What the planner that wrote this entry predicted and measured (informational, items/s).
    predicted_items_per_s: float | None = None
    measured_items_per_s: float | None = None
    #: The model's inputs, when the plan states them (checked against the model's own spec:
    #: a missing, unknown or mistyped one is an error): `{name, dtype, shape}` each.
    inputs: list[dict[str, Any]] | None = None
    #: Sequence lengths compiled (a runner per batch and length bucket); a query runs at the
    #: shortest that holds it, padded with its mask set. None: the model's default length.
    seq_buckets: list[int] | None = None

    @field_validator("seq_buckets")
    @classmethod
    def _seq(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(s < 1 for s in value)):
            raise ValueError(f"seq_buckets {value} must be sequence lengths of 1 or more, "
                             "e.g. [32, 64, 128, 256]")
        return value

    @field_validator("input_shape")
    @classmethod
    def _shape(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(s <= 0 for s in value)):
            raise ValueError(f"input_shape {value} needs positive sizes, e.g. [3, 224, 224]")
        return value

    @field_validator("stages")
    @classmethod
    def _stages(cls, value: list[Stage] | None) -> list[Stage] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("stages is empty: give at least one stage, or drop stages and use replicas")
        if value[0].start != "input":
            raise ValueError(f"the first stage must start at 'input', not {value[0].start!r}")
        if value[-1].end != "output":
            raise ValueError(f"the last stage must end at 'output', not {value[-1].end!r}")
        for a, b in itertools.pairwise(value):
            if a.end != b.start:
                raise ValueError(f"stages must be contiguous: one ends at {a.end!r}, the next "
                                 f"starts at {b.start!r}")
        return value

    @model_validator(mode="after")
    def _runs_somewhere(self) -> ModelEntry:
        if not self.replicas and not self.stages:
            raise ValueError(f"model {self.name!r} has neither replicas nor stages: give it one of them")
        return self

    @property
    def chunk(self) -> int:
        """Items per pipeline link slot: the gcd of the stage batches."""
        return math.gcd(*(s.batch for s in self.stages or []))

    def describe_stages(self) -> str:
        """`input→layer2_1_relu_1 @cpu:0 | …→output @cpu:1` for tables."""
        parts = []
        for s in self.stages or []:
            units = "+".join(s.units) + (f"×{s.instances}" if s.instances > 1 else "")
            engine = "" if s.engine == "torch" else f" {s.engine}"
            parts.append(f"{s.start}→{s.end} @{units}{engine} b{s.batch}")
        text = " | ".join(parts)
        return text if self.pipeline_replicas == 1 else f"{self.pipeline_replicas}× [{text}]"


class DispatcherSettings(_Strict):
    """How queries reach workers."""

    #: `pull`: one queue per model, free workers pull (work stealing); `round_robin`: each
    #: query is assigned to the next worker on arrival (the blind baseline).
    policy: Literal["pull", "round_robin"] = "pull"
    #: The longest a worker waits for a fuller batch after the oldest query arrived, where no
    #: latency bound sizes the batch (`batching`).
    max_queue_delay_ms: float = Field(QUEUE_DELAY_MS, ge=0, le=60_000)
    #: How long a partial batch waits. `deadline`: with a latency bound (the model's
    #: `latency_bound_ms`, else `load.p99_bound_ms`), as long as its oldest query can still
    #: finish in time, from the worker's measured batch latency and when it frees up; without
    #: one, `max_queue_delay_ms`. `queue_delay`: always `max_queue_delay_ms`. The default is
    #: `queue_delay`: alternated on three H200 hosts (ResNet50 fp16 b64 ×2, p99 15 ms), the
    #: deadline rule's peaks were 0.50–0.73 of offline and the queue delay's 0.50–0.80 (means
    #: 0.63 and 0.71; docs/benchmarks.md), so the deadline rule is opt-in until it wins.
    batching: Literal["deadline", "queue_delay"] = "queue_delay"
    #: Weight of the newest batch in the moving-average latency estimate of each worker.
    estimate_alpha: float = Field(0.2, gt=0, le=1)
    #: How CPU-unit workers are hosted: `process` (one pinned process each) or `thread`.
    cpu_workers: Literal["process", "thread"] = "process"
    #: Batches a CPU worker's process holds at once: 2 sends the next while one runs, so the
    #: process never idles for the relay through this one; 1 sends each after the last answer.
    cpu_in_flight: int = Field(2, ge=1, le=2)
    #: A failed batch is retried on another worker this many times before its queries fail.
    max_retries: int = Field(2, ge=0, le=10)
    #: When a GPU worker takes its next batch while one runs: `early`, as soon as items wait;
    #: `just_in_time`, when the running batch is about to end (or a full batch waits), so the
    #: items stay in the model's queue for whichever worker frees first and the batch fills.
    gpu_take: Literal["early", "just_in_time"] = "just_in_time"


class ServeDefaults(_Strict):
    """How `infermux serve` serves the plan where its command line does not say.

    `tune --served` writes the front and the front count it served the written plan through,
    so `infermux serve PLAN` serves it as it was measured; `--front` and `--fronts` override.
    """

    #: `own`: infermux's fronts; `triton`: Triton's server as the front (needs a Triton build).
    front: Literal["own", "triton"] = "own"
    #: Front processes (`own`) or model instances (`triton`); None: serve's default for the host.
    fronts: int | None = Field(None, ge=0, le=64)


class MixPhase(_Strict):
    """From `at_s` seconds on, queries go to models in these proportions."""

    at_s: float = Field(ge=0)
    shares: dict[str, float]

    @field_validator("shares")
    @classmethod
    def _shares(cls, value: dict[str, float]) -> dict[str, float]:
        if not value or any(v < 0 for v in value.values()) or sum(value.values()) <= 0:
            raise ValueError(f"shares {value} must be non-negative with a positive sum")
        return value


class LoadSettings(_Strict):
    """The load, after MLPerf LoadGen's scenarios and validity rules."""

    scenario: Literal["offline", "server", "single-stream", "multi-stream"] = "offline"
    #: Server: the mean Poisson arrival rate in queries per second.
    rate_qps: float | None = Field(None, gt=0)
    #: Server: the run is valid only if the 99th percentile latency is at most this.
    p99_bound_ms: float | None = Field(None, gt=0)
    #: Server: search the highest rate whose p99 holds the bound.
    find_peak: bool = False
    min_duration_s: float = Field(10.0, ge=0)
    min_queries: int = Field(1024, ge=1)
    #: Hard stop: issuing ends here even if the validity rule is not met (the run is invalid).
    max_duration_s: float | None = Field(None, gt=0)
    #: Find-peak: how long the runs that confirm the edge last (the last valid rate and the
    #: first invalid one, run again). None: `runtime.peak.CONFIRM_SCALE` x min_duration_s.
    confirm_duration_s: float | None = Field(None, gt=0)
    #: Find-peak: how many times a trial that failed while the host stopped is run again (a
    #: stall at least as long as the bound, seen by a process that does none of the plan's
    #: work, `runtime.host_watch`, or a batch that stood still on its device longer than the
    #: plan could make it, `runtime.peak.device_stop`); 0 counts every trial as it came.
    stall_retries: int = Field(STALL_RETRIES, ge=0, le=10)
    #: Find-peak: how finely the edge is placed, as a share of the offline throughput (the
    #: bisection stops when the span left is this narrow; each halving is one more trial).
    peak_resolution: float = Field(PEAK_RESOLUTION, ge=0.001, le=0.25)
    samples_per_query: int = Field(8, ge=1, le=1024)
    #: The query sample library: how many distinct samples per model are held in memory.
    sample_pool: int = Field(256, ge=1, le=65536)
    seed: int = 0
    mix: list[MixPhase] | None = None
    #: `host`: samples start in host memory and the copy is timed; `device`: pre-staged.
    data: Literal["host", "device"] = "host"
    #: How long queries of models with a sequence length are: a length (128), uniform:16-256,
    #: or lengths chosen with equal odds (32,64,128). None: the longest compiled length.
    lengths: int | str | None = None

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            from infermux.load.samples import parse_lengths

            try:
                parse_lengths(value)
            except UsageError as exc:
                raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> LoadSettings:
        if self.max_duration_s is not None and self.max_duration_s < self.min_duration_s:
            raise ValueError(
                f"max_duration_s {self.max_duration_s} is shorter than min_duration_s "
                f"{self.min_duration_s}: raise it or drop it"
            )
        if self.mix:
            times = [p.at_s for p in self.mix]
            if times != sorted(times) or times[0] != 0:
                raise ValueError(f"mix phases start at {times}: they must begin at 0 and ascend")
        return self


class Plan(_Strict):
    """Models and their replicas, the dispatcher, the placement policy and the load."""

    name: str = "plan"
    models: list[ModelEntry] = Field(min_length=1)
    dispatcher: DispatcherSettings = Field(default_factory=lambda: DispatcherSettings.model_validate({}))
    #: `static`: workers serve their own model; `dynamic`: idle workers move to the model whose
    #: queue grows (each worker holds a runner for every model).
    placement: Literal["static", "dynamic"] = "static"
    #: Seconds between two placement decisions (dynamic placement).
    placement_interval_s: float = Field(0.2, gt=0, le=60)
    #: `none`: CPU workers get disjoint core sets (every plan the tuner writes). `cores`: an
    #: opt-in of `infermux study`, whose CME points run several models at once on one core
    #: set to measure the contention the papers measured; recorded with every run.
    sharing: Literal["none", "cores"] = "none"
    load: LoadSettings = Field(default_factory=lambda: LoadSettings.model_validate({}))
    #: `infermux serve`'s front where its command line names none (`tune --served` writes it).
    serve: ServeDefaults | None = None

    @model_validator(mode="after")
    def _whole(self) -> Plan:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names {dupes} appear twice: give every model its own name")
        owners: dict[int, str] = {}
        whole_cpu = []
        for mi, model in enumerate(self.models):
            users = [(f"models[{mi}].replicas[{ri}]", rep.unit, rep.cores)
                     for ri, rep in enumerate(model.replicas)]
            # The stages of one pipeline may share cores (their threads take turns), so a
            # pipeline owns the union of its stages' cores once.
            piped = {u: f"models[{mi}].stages" for s in model.stages or [] for u in s.units}
            users.extend((where, u, parse_core_set(u[4:]) if u.startswith("cpu:") else ())
                         for u, where in piped.items())
            mine: set[int] = set()
            for where, unit, cores in users:
                if unit.partition("/")[0] == "cpu":  # cpu, cpu/int8: every core
                    whole_cpu.append(where)
                for core in cores:
                    if where.endswith(".stages") and core in mine:
                        continue
                    if where.endswith(".stages"):
                        mine.add(core)
                    if core in owners and self.sharing == "none":
                        raise ValueError(
                            f"{where}.unit {unit!r} shares core {core} with {owners[core]}: "
                            "CPU workers get disjoint core sets; split the cores between them"
                        )
                    owners[core] = f"{where} ({unit})"
        if whole_cpu and (owners or len(whole_cpu) > 1) and self.sharing == "none":
            raise ValueError(
                f"{whole_cpu[0]}.unit 'cpu' takes every core but other replicas use CPU cores too: "
                "give each CPU replica its own core set, e.g. cpu:0-1 and cpu:2-3"
            )
        if self.load.mix:
            for pi, phase in enumerate(self.load.mix):
                unknown = sorted(set(phase.shares) - set(names))
                if unknown:
                    raise ValueError(
                        f"load.mix[{pi}].shares names {unknown}, not models of this plan "
                        f"(models: {', '.join(names)})"
                    )
        if self.load.lengths is not None:
            from infermux.load.samples import parse_lengths

            longest = parse_lengths(self.load.lengths).high
            for mi, model in enumerate(self.models):
                if model.seq_buckets and longest > max(model.seq_buckets):
                    raise ValueError(
                        f"load.lengths {self.load.lengths} go past models[{mi}].seq_buckets "
                        f"{model.seq_buckets}: add a bucket of at least {longest} or shorten "
                        "the lengths")
        if all(m.share == 0 for m in self.models) and not self.load.mix:
            raise ValueError("every model has share 0: give at least one model a positive share")
        return self

    @model_validator(mode="after")
    def _policy_fits_placement(self) -> Plan:
        if self.dispatcher.policy == "round_robin" and self.placement == "dynamic":
            raise ValueError(
                "dispatcher.policy 'round_robin' cannot go with placement 'dynamic': round robin "
                "binds each query to a worker of its model when it arrives, and a worker moved to "
                "another model would strand them; use policy: pull with placement: dynamic, or "
                "round_robin with placement: static"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (what is stored with every run)."""
        return self.model_dump(mode="json")


def _path(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text or "plan"


def _allowed(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """The fields allowed where an unknown key was found."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return ""
        annotation = field.annotation
        args = getattr(annotation, "__args__", ()) or (annotation,)
        nested = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested:
            return ""
        current = nested[0]
    return ", ".join(getattr(current, "model_fields", {}))


def parse_plan(data: Any, *, source: str = "plan") -> Plan:
    """Validate a plan given as a dict; a UsageError names the field path, value and fix."""
    if not isinstance(data, dict):
        raise UsageError(f"{source}: a plan is a mapping with a `models` list, not {type(data).__name__}")
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        path = _path(loc)
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            allowed = _allowed(Plan, loc)
            raise UsageError(
                f"{source}: field {path} is not a plan field; allowed here: {allowed}"
            ) from None
        if err["type"] == "missing":
            raise UsageError(f"{source}: field {path} is required but missing") from None
        if err["type"] in ("value_error", "assertion_error") and not loc:
            raise UsageError(f"{source}: {msg}") from None
        value = err.get("input")
        if isinstance(value, dict):  # a check across several fields of one entry
            raise UsageError(f"{source}: field {path}: {msg}") from None
        shown = json.dumps(value, default=str)
        raise UsageError(f"{source}: field {path} = {shown[:80]}: {msg}") from None


def load_plan(path: str | Path) -> Plan:
    """Read and validate a YAML or JSON plan file."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"plan file {str(path)!r} does not exist: write one with `infermux plan --example`")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"plan file {str(path)!r} is not valid YAML{where}: {exc}") from None
    return parse_plan(data, source=str(path))


#: A compiled replica compiles its largest buckets this many at least, and every bucket above
#: half its batch; smaller ones run its engine without compiling.
COMPILED_BUCKETS = 2


def options_for_bucket(options: dict[str, Any], buckets: Sequence[int], bucket: int
                       ) -> dict[str, Any]:
    """Engine options of one bucket's runner: `compile` only for the largest buckets.

    torch.compile builds every batch size on its own (about 11 s each for ResNet50 on an H100),
    so compiling every power-of-two bucket made a compiled plan take 101 s to start instead of
    18 s. The plan's batch and the next bucket down are compiled, and every bucket above half
    the batch (`fine` buckets: where batches land near the server peak); smaller, partial
    batches (light server load) run the same engine with CUDA graphs, where per-batch overhead
    is what matters, not kernel choice. Thread and process-hosted workers both build with these.
    """
    out = dict(options)
    ordered = sorted(buckets)
    compiled = bucket in ordered[-COMPILED_BUCKETS:] or 2 * bucket > ordered[-1]
    if out.get("compile") and not compiled:
        del out["compile"]
        out.pop("compile_cache_dir", None)
    return out


EXAMPLE_PLAN = f"""\
# An infermux plan: which models run on which units, how queries reach them, and the load.
# Validate it with `infermux plan --check plan.yaml`; run it with `infermux run plan.yaml`.
name: two-models
models:
  - name: cnn                      # the name queries and results use
    model: mobilenet_v3_small      # torchvision/timm name, timm:NAME, file.py:function, x.onnx
    # weights: cnn.pt              # state dict; without it the weights are random (timings hold)
    # input_shape: [3, 224, 224]   # one item, without the batch axis
    # seq_buckets: [32, 64, 128]   # a model with a sequence length: the lengths compiled
    latency_bound_ms: null         # SLO: keep queries off units that would break this bound
    share: 1.0                     # share of the queries (normalised over the models)
    replicas:
      - unit: cpu:0                # a core set: cpu:0-3, cpu:0-1+4-5; or cuda:0/fp16, ...
        engine: torch
        instances: 1               # one worker each; CPU instances split the core set
        batch: 8                   # the largest batch a worker takes
        batch_buckets: pow2        # 1, 2, 4, 8 (pow2), eighths above half (fine), `batch` (none), a list
        options: {{}}                # engine options, e.g. {{cuda_graph: true}}
  - name: resnet
    model: resnet18
    share: 1.0
    replicas:
      - {{unit: cpu:1, engine: torch, instances: 1, batch: 4}}
dispatcher:
  policy: pull                     # pull: free workers pull (work stealing); round_robin
  max_queue_delay_ms: {QUEUE_DELAY_MS:<13}# wait at most this long for a fuller batch (no bound)
  batching: queue_delay            # deadline: with a p99 bound, wait while it holds
  estimate_alpha: 0.2              # moving average of batch latency (SLO-aware placement)
  cpu_workers: process             # CPU workers as pinned processes (measured) or threads
  cpu_in_flight: 2                 # batches in a CPU worker's process: the next waits there
  max_retries: 2                   # a failed batch is retried elsewhere, then reported failed
  gpu_take: just_in_time           # GPU workers take their next batch as the running one ends
placement: static                  # dynamic: idle workers move to the model whose queue grows
placement_interval_s: 0.2
load:
  scenario: server                 # offline | server | single-stream | multi-stream
  rate_qps: 40                     # server: Poisson arrivals per second
  p99_bound_ms: 200                # server: valid only if p99 latency <= this
  find_peak: false                 # server: search the highest rate that holds p99_bound_ms
  min_duration_s: 10               # validity: at least this long ...
  min_queries: 256                 # ... and at least this many queries
  max_duration_s: null             # hard stop (the run is invalid if the rule is not met)
  samples_per_query: 8             # multi-stream
  sample_pool: 256                 # distinct samples per model held in memory
  seed: 0                          # arrivals and model choice are reproducible
  data: host                       # host: copies timed; device: samples pre-staged
  # lengths: uniform:16-256        # query lengths of models with a sequence length
  # mix:                           # shift the load between models mid-run
  #   - {{at_s: 0, shares: {{cnn: 0.9, resnet: 0.1}}}}
  #   - {{at_s: 5, shares: {{cnn: 0.1, resnet: 0.9}}}}
"""
