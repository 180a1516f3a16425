"""`run_tune`: from "these models on this machine" to a stored, runnable, explained plan."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infermux.errors import UsageError
from infermux.models import LoadedModel, ModelSpec
from infermux.progress import ProgressFn
from infermux.store import Store, recording
from infermux.tune.evaluate import (
    QUEUE_DELAY_MS,
    Constraints,
    LiveEvaluator,
    Trial,
    TrialSettings,
    model_name,
)
from infermux.tune.hosting import HOSTINGS, HostingPeak, choose_hosting, hosting_word
from infermux.tune.pipelines import PipelineTrial, pipeline_units, tune_pipelines
from infermux.tune.search import OBJECTIVES, Tuner, TuneResult, TuneSettings, speed_note
from infermux.tune.served import (
    SERVED_BUDGET_SHARE,
    ServedSettings,
    front_room,
    serve_candidates,
    served_requests,
    served_words,
)
from infermux.tune.space import (
    COMPILE_MODES,
    DEFAULT_COMPILE_MODES,
    SLOW_BUILDS,
    Space,
    UnitSpace,
    option_variants,
    overlapping_units,
    seq_bucket_sets,
)
from infermux.units import Unit

__all__ = ["TuneReport", "TuneRequest", "build_space", "predicted_query_ms", "prepare", "run_tune",
           "seq_sets", "server_order"]

SCENARIOS = ("offline", "server")
#: A model that cannot be padded compiles every length its queries carry; past this many
#: runners per batch a range of lengths is refused (give a list).
_MAX_EXACT_LENGTHS = 16


@dataclass
class TuneRequest:
    """Everything `infermux tune` was asked."""

    models: list[ModelSpec]
    units: str = "auto"
    engines: str = "auto"
    scenario: str = "offline"
    objective: str = "throughput"
    constraints: Constraints = field(default_factory=Constraints)
    budget_s: float = 600.0
    batches: list[int] | None = None
    max_instances: int = 4
    #: torch.compile modes tried on GPU units (none on CPUs); empty for none.
    compile_modes: tuple[str, ...] = DEFAULT_COMPILE_MODES
    trial: TrialSettings = field(default_factory=TrialSettings)
    fresh: bool = False
    seed: int = 0
    fine_tune: bool = True
    #: With two or more CPU core sets or GPUs and one torch model: measure the partitioner's
    #: best predicted pipelines through the runtime beside the replica plans.
    pipelines: bool = True
    #: Sequence lengths to compile for models with one (`--seq`); None: candidates derived
    #: from the query lengths (`trial.lengths`) are searched.
    seq_buckets: list[int] | None = None
    #: Check the chosen plan through the runtime when it was measured in-process (`--no-verify`
    #: skips it: the plan written is then the search's own figure).
    verify: bool = True
    #: Server scenario: the floor of each find-peak rate's trial (`--peak-trial-duration`,
    #: `--peak-trial-queries`). A rate's p99 is judged on its tail, so the default is seconds and
    #: hundreds of queries; each trial still runs at least 3× the search's duration.
    peak_min_duration_s: float = 2.0
    peak_min_queries: int = 256
    #: Server scenario: serve the plans with the best runtime peaks with `infermux serve` and
    #: write the one clients get the most from within the bound (`tune.served`); None: the
    #: runtime's peak decides.
    served: ServedSettings | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise UsageError("no model given: pass --model NAME (e.g. --model mobilenet_v3_small)")
        if self.scenario not in SCENARIOS:
            raise UsageError(f"--scenario {self.scenario!r} unknown: tune for offline or server")
        if self.objective not in OBJECTIVES:
            raise UsageError(f"--objective {self.objective!r} unknown: use "
                             f"{', '.join(OBJECTIVES)}")
        if self.scenario == "server" and self.constraints.p99_bound_ms is None:
            raise UsageError("--scenario server needs a latency bound: pass --p99, e.g. --p99 15ms")
        if self.budget_s <= 0:
            raise UsageError(f"--budget {self.budget_s:g}s must be positive, e.g. --budget 10m")
        if self.max_instances < 1:
            raise UsageError(f"--max-instances {self.max_instances} must be at least 1")
        if self.peak_min_duration_s < 0:
            raise UsageError(f"--peak-trial-duration {self.peak_min_duration_s:g}s must not be "
                             "negative, e.g. --peak-trial-duration 2s")
        if self.peak_min_queries < 1:
            raise UsageError(f"--peak-trial-queries {self.peak_min_queries} must be at least 1, "
                             "e.g. --peak-trial-queries 256")
        self.compile_modes = tuple(self.compile_modes)
        unknown = [m for m in self.compile_modes if m not in COMPILE_MODES]
        if unknown:
            raise UsageError(f"--compile {unknown[0]!r} is not a torch.compile mode: use "
                             f"{', '.join(COMPILE_MODES)}, a comma list of them, or none")
        if self.seq_buckets is not None:
            if not self.seq_buckets or any(n < 1 for n in self.seq_buckets):
                raise UsageError(f"--seq {self.seq_buckets}: sequence lengths must all be at "
                                 "least 1, e.g. --seq 32,64,128")
            self.seq_buckets = sorted(set(self.seq_buckets))
        names = [model_name(m.ref) for m in self.models]
        if len(set(names)) != len(names):
            raise UsageError(f"models {names} repeat a name: tune each model once")
        if self.served is not None and self.scenario != "server":
            raise UsageError("--served ranks plans by their served peak within --p99: add "
                             "--scenario server --p99 BOUND")
        if self.served is not None and len(self.models) > 1:
            raise UsageError(f"--served drives one model's requests, and {len(names)} were "
                             "given: tune one model, or leave --served out")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (stored with the run)."""
        return {
            "models": [{"ref": m.ref, "weights": m.weights,
                        "input_shape": list(m.input_shape or ())} for m in self.models],
            "units": self.units, "engines": self.engines, "scenario": self.scenario,
            "objective": self.objective, "constraints": self.constraints.to_dict(),
            "budget_s": self.budget_s, "batches": self.batches,
            "max_instances": self.max_instances, "compile_modes": list(self.compile_modes),
            "trial": self.trial.to_dict(), "fresh": self.fresh, "seed": self.seed,
            "fine_tune": self.fine_tune, "pipelines": self.pipelines,
            "seq_buckets": self.seq_buckets, "verify": self.verify,
            "peak_min_duration_s": self.peak_min_duration_s,
            "peak_min_queries": self.peak_min_queries,
            "served": self.served.to_dict() if self.served is not None else None,
        }


@dataclass
class TuneReport:
    """What `run_tune` returns."""

    run_id: int | None
    request: TuneRequest
    result: TuneResult
    plan: dict[str, Any] | None
    plan_path: str | None
    server_peak: dict[str, Any] | None = None
    #: Server scenario: each plan whose peak was measured, the chosen one first.
    server_peaks: list[dict[str, Any]] = field(default_factory=list)
    #: Pipeline candidates measured beside the replica plans (see `tune.pipelines`).
    pipelines: list[PipelineTrial] = field(default_factory=list)
    #: Why no pipeline was measured, or which plan won and by how much.
    pipelines_note: str | None = None
    #: The best replica plan's runtime figure the pipelines were compared with (items/s).
    replica_items_per_s: float | None = None
    #: Server scenario, a plan of lock-releasing CPU engines: how its CPU workers' hosting was
    #: chosen (`tune.hosting.HostingChoice.to_dict`); None where it was not compared.
    hosting: dict[str, Any] | None = None
    #: Server scenario: the chosen plan's peak under each batching rule and the rule written
    #: (`_choose_batching`); None where the rules were not compared.
    batching: dict[str, Any] | None = None
    #: Server scenario, ONNX Runtime CPU replicas with intra-op pools: the chosen plan's peak
    #: with the pool's threads spinning and not (`_choose_spinning`); None where not compared.
    spinning: dict[str, Any] | None = None
    #: `--served`: how the plans were served and driven, which row was written and why
    #: (`_choose_by_served_peak`); each served row of `server_peaks` has its served figures.
    served: dict[str, Any] | None = None
    #: Each `server_peaks` row's plan and runtime peak record, in its order (not reported).
    peak_runs: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {"run_id": self.run_id, "request": self.request.to_dict(),
                "plan": self.plan, "plan_path": self.plan_path,
                "server_peak": self.server_peak, "server_peaks": self.server_peaks,
                "hosting": self.hosting, "batching": self.batching,
                "spinning": self.spinning, "served": self.served,
                "pipelines": [p.to_dict() for p in self.pipelines],
                "pipelines_note": self.pipelines_note,
                "replica_items_per_s": self.replica_items_per_s, **self.result.to_dict()}


def _ladder(top: int) -> list[int]:
    out, b = [], 1
    while b <= top:
        out.append(b)
        b *= 2
    return out


def seq_sets(request: TuneRequest, loaded: dict[str, LoadedModel]
             ) -> dict[str, list[tuple[int, ...]]]:
    """Per model with a sequence length, its candidate `seq_buckets` (the default first).

    `--seq` is the one set; else candidates derived from the query lengths (`--lengths`), and
    without those the model's own default length alone.
    """
    from infermux.load.samples import parse_lengths

    spread = parse_lengths(request.trial.lengths) if request.trial.lengths is not None else None
    out: dict[str, list[tuple[int, ...]]] = {}
    for name, model in loaded.items():
        io = model.spec_io
        if not io.dynamic_dims:
            continue
        if spread is not None and not io.pads_exactly:
            # No mask to pad under: every length sent must be compiled (`IOSpec.pads_exactly`).
            drawn = spread.drawn
            if request.seq_buckets is not None:
                off = [n for n in drawn if n not in request.seq_buckets]
                if off:
                    raise UsageError(f"--lengths {spread.text}: model {name} has no mask input, "
                                     "so it runs only at lengths it compiles, and --seq "
                                     f"{','.join(map(str, request.seq_buckets))} leaves out "
                                     f"{', '.join(map(str, off[:4]))}: add them to --seq")
            elif len(drawn) > _MAX_EXACT_LENGTHS:
                raise UsageError(f"--lengths {spread.text}: model {name} has no mask input, so "
                                 "each length it is sent must be one it compiles, and that is "
                                 f"{len(drawn)} lengths: give --lengths as a list of at most "
                                 f"{_MAX_EXACT_LENGTHS} (e.g. 64,128)")
            else:
                out[name] = [tuple(drawn)]
                continue
        if request.seq_buckets is not None:
            if spread is not None and spread.high > request.seq_buckets[-1]:
                raise UsageError(f"--lengths {spread.text} go past the longest of --seq "
                                 f"{','.join(map(str, request.seq_buckets))}: add a length of "
                                 f"at least {spread.high} or shorten --lengths")
            out[name] = [tuple(request.seq_buckets)]
        elif spread is not None:
            out[name] = seq_bucket_sets(spread)
        else:
            try:
                dims = io.dims_for(None)
            except UsageError:
                raise UsageError(f"model {name}: its {', '.join(io.dynamic_dims)} has no default "
                                 "size: pass --lengths (e.g. --lengths 128) or --seq") from None
            out[name] = [(max(dims.values()),)]
    if request.seq_buckets is not None and not out:
        raise UsageError(f"--seq {','.join(map(str, request.seq_buckets))}: no model here has a "
                         "sequence length to compile; drop --seq")
    if request.trial.lengths is not None and not out:
        raise UsageError(f"--lengths {request.trial.lengths}: no model here has a sequence "
                         "length; drop --lengths")
    return out


def build_space(request: TuneRequest, units: list[Unit], engines: dict[str, list[str]],
                host_cores: tuple[int, ...] = (),
                seq: dict[str, list[tuple[int, ...]]] | None = None,
                fp8: bool = False) -> Space:
    """The space for `units` with the engines usable on each (`engines[unit_id]`).

    `host_cores` are the cores `cpu` and OpenVINO's CPU device run on: units sharing them are
    alternatives in the space, never combined. `seq` holds the candidate sequence-bucket sets
    of the models that have a sequence length (`seq_sets`).
    """
    spaces = []
    for unit in units:
        names = sorted(engines.get(unit.id, []), key=lambda e: (e in SLOW_BUILDS, e))
        if not names:
            continue
        if request.batches:
            batches = sorted(set(request.batches))
        else:
            batches = _ladder(256 if unit.kind in ("cuda", "dla") else 64)
        if unit.kind == "cpu":
            instances = [n for n in (1, 2, 4, 8, 16) if n <= min(len(unit.cores) or 1,
                                                                  request.max_instances)]
        else:
            instances = [n for n in (1, 2, 4) if n <= request.max_instances]
        spaces.append(UnitSpace(unit, names, batches, instances or [1], {
            e: option_variants(e, unit, compile_modes=request.compile_modes, fp8=fp8)
            for e in names},
            dict(seq or {})))
    if not spaces:
        raise UsageError(f"no engine installed here runs the units {request.units!r}: "
                         "check `infermux units`")
    kept = [s.unit for s in spaces]
    mixed: set[str] = set()
    if request.trial.lengths is not None:
        from infermux.load.samples import parse_lengths

        spread = parse_lengths(request.trial.lengths)
        mixed = set(seq or {}) if spread.low != spread.high else set()
    return Space([model_name(m.ref) for m in request.models], spaces,
                 overlapping_units(kept, host_cores), mixed)


def _tune_units(spec: str) -> tuple[list[Unit], tuple[int, ...]]:
    """The selected units and the host's usable cores.

    Units that share cores (`cpu` and `openvino:CPU`, which runs OpenVINO at the device's own
    precision, bf16 where the CPU has it; overlapping core sets) are all kept: each is weighed
    alone, and the space never combines them.
    """
    from infermux.units import discover, select_units

    found = discover()
    units = select_units(spec, found)
    return units, tuple(found.cpu.get("usable_cores", ()))


def prepare(request: TuneRequest) -> tuple[list[Unit], dict[str, LoadedModel], Space]:
    """The request's units, its models loaded (by plan name) and the space to search."""
    from infermux.engines.select import engines_for
    from infermux.models import load_model

    units, host_cores = _tune_units(request.units)
    loaded = {model_name(m.ref): load_model(m) for m in request.models}
    engines: dict[str, list[str]] = {}
    for unit in units:
        names: set[str] = set()
        for model in loaded.values():
            names.update(n for _, n in engines_for(request.engines, [unit], model))
        engines[unit.id] = sorted(names)
    return units, loaded, build_space(request, units, engines, host_cores,
                                      seq_sets(request, loaded), fp8=_fp8_worth(loaded))


def _fp8_worth(loaded: dict[str, LoadedModel]) -> bool:
    """Whether FP8 products are worth a trial: a torch network whose Linears hold most weights."""
    from infermux.engines.fp8 import WORTH_SHARE, linear_share

    return any(m.module is not None and linear_share(m.module) >= WORTH_SHARE
               for m in loaded.values())


def run_tune(
    request: TuneRequest,
    *,
    store: Store | None = None,
    out_path: str | Path | None = None,
    progress: Callable[[str, dict[str, Any]], None] | None = None,
    measure_progress: ProgressFn | None = None,
    command: str = "",
) -> TuneReport:
    """Search, verify and write the best plan; every trial goes to the store as it ends."""
    started = time.monotonic()
    units, loaded, space = prepare(request)
    specs = {model_name(m.ref): m for m in request.models}
    with recording(store, "tune", request.to_dict() | {"space": space.describe()},
                   command) as rec:
        run_id = rec.run_id
        seq_defaults = {m: sets[0] for m, sets in space.units[0].seq_sets.items()}
        evaluator = LiveEvaluator(specs, units, request.trial, store=store, run_id=run_id,
                                  fresh=request.fresh, progress=measure_progress, loaded=loaded,
                                  seq_buckets=seq_defaults)
        if request.constraints.max_power_w is not None and not evaluator.power_devices:
            evaluator.close()
            raise UsageError(f"--max-power {request.constraints.max_power_w:g} W cannot be checked: "
                             "no power reading here (NVML, RAPL or Jetson rails); drop --max-power")
        if request.objective == "energy" and not evaluator.power_devices:
            evaluator.close()
            raise UsageError("--objective energy needs power readings (NVML, RAPL or Jetson rails) "
                             "and this machine has none: use --objective throughput or latency")
        setup_s = time.monotonic() - started
        piped = _pipelines_wanted(request, units, loaded)
        # Pipelines get a quarter of the budget: profiling pieces on every (unit, engine), then a
        # runtime trial per predicted plan.
        share = PIPELINE_BUDGET_SHARE if piped is None else 0.0
        if request.scenario == "server":
            # Server plans are chosen by their measured peak, each a find-peak through the runtime.
            share += SERVER_BUDGET_SHARE
        # `--served`: the budget's last share serves the best plans (`_choose_by_served_peak`).
        served_share = SERVED_BUDGET_SHARE if request.served is not None else 0.0
        share += served_share
        settings = TuneSettings(objective=request.objective,
                                budget_s=max(1.0, (request.budget_s - setup_s) * (1 - share)),
                                seed=request.seed, fine_tune=request.fine_tune,
                                verify=request.verify)
        status = "complete"
        report = TuneReport(run_id, request, TuneResult(None, [], [], {}, [], None, {}, 0.0, False),
                            None, None)
        try:
            tuner = Tuner(space, evaluator, request.constraints, settings, progress=progress)
            result = tuner.run()
            result.elapsed_s += setup_s
            report.result = result
            if result.best is not None:
                report.plan = _final_plan(evaluator, result, request)
                if piped is None:
                    evaluator.release()
                    _search_pipelines(report, request, units, loaded, space, evaluator,
                                      deadline=started + request.budget_s,
                                      progress=measure_progress)
                else:
                    report.pipelines_note = piped
                if request.scenario == "server":
                    _choose_by_server_peak(report, evaluator, request,
                                           deadline=started + request.budget_s * (1 - served_share),
                                           progress=measure_progress)
                if request.served is not None and report.server_peaks:
                    _choose_by_served_peak(report, evaluator, request, loaded,
                                           deadline=started + request.budget_s,
                                           progress=measure_progress)
                if out_path is not None:
                    text = _plan_header(result, request, report.pipelines_note,
                                        report.server_peaks, report.hosting,
                                        report.served) + yaml.safe_dump(
                        report.plan, sort_keys=False, width=100)
                    try:
                        Path(out_path).write_text(text)
                    except OSError as exc:
                        raise UsageError(f"cannot write the plan to {str(out_path)!r}: "
                                         f"{exc.strerror}") from exc
                    report.plan_path = str(out_path)
        except KeyboardInterrupt:
            status = "interrupted"
        finally:
            evaluator.close()
            best = report.result.best
            rec.status, rec.summary = status, {
                "measured": report.result.measured,
                "best": best.candidate.label() if best else None,
                "best_items_per_s": best.items_per_s if best else None,
                "plan_path": report.plan_path,
                # Both hostings' find-peaks, their trials and the decision, kept with the run.
                "server_peaks": report.server_peaks or None, "hosting": report.hosting,
                "batching": report.batching, "spinning": report.spinning,
                "served": report.served}
    if status == "interrupted":
        raise KeyboardInterrupt
    return report


#: Share of the budget kept for pipeline candidates when they apply.
PIPELINE_BUDGET_SHARE = 0.25
#: The share of a server tune's budget for find-peak runs of the best candidates.
SERVER_BUDGET_SHARE = 0.3
#: At most this many plans get a find-peak run besides the one the search chose.
SERVER_ALTERNATIVES = 3
#: Server candidates within this share of the best offline throughput are near enough to it
#: to be measured (and written) first, in `server_order`'s order, not by throughput. On H200
#: hosts ResNet50 fp16 b32 ×4 ran 0.87-0.92 of b64 ×4's offline figure and peaked at 0.81-0.98
#: of its own (six hosts, the current search), where b64 ×2 and ×1 peaked at 0.2-0.83 of
#: theirs: with a tenth, one host's tune left b32 ×4 (0.875 of the best) behind b64 ×2, whose
#: peak then failed the bound.
SERVER_TIE_SHARE = 0.15


def _pipelines_wanted(request: TuneRequest, units: list[Unit],
                      loaded: dict[str, LoadedModel]) -> str | None:
    """None when pipelines are searched, else why not."""
    if not request.pipelines:
        return "pipelines not searched (--no-pipelines)"
    if len(loaded) != 1:
        return "pipelines are searched for one model at a time"
    if len(pipeline_units(units)) < 2:
        return "pipelines need two or more CPU core sets or GPUs among the units"
    if next(iter(loaded.values())).module is None:
        return "pipelines cut torch models, not ONNX files"
    if not next(iter(loaded.values())).spec_io.simple:
        return "pipelines cut networks of one float input of a fixed shape"
    return None


def _search_pipelines(report: TuneReport, request: TuneRequest, units: list[Unit],
                      loaded: dict[str, LoadedModel], space: Space, evaluator: LiveEvaluator,
                      *, deadline: float,
                      progress: ProgressFn | None) -> None:
    """Measure the partitioner's best pipelines; take one if it beats the replica plan."""
    result = report.result
    assert result.best is not None and report.plan is not None
    name, model = next(iter(loaded.items()))
    spec = next(m for m in request.models if model_name(m.ref) == name)
    usable = pipeline_units(units)
    engines = sorted({e for u in usable for e in space.unit(u.id).engines})
    batch = max(c.batch for c in result.best.candidate.configs)
    replica = result.verified if result.verified is not None and result.verified.ok \
        else result.best
    report.replica_items_per_s = replica.items_per_s
    budget = max(deadline - time.monotonic(), 0.1 * request.budget_s)
    trials, why = tune_pipelines(name=name, spec=spec, model=model, units=usable,
                                 engines=engines, batch=batch, settings=request.trial,
                                 budget_s=budget, progress=progress)
    report.pipelines = trials
    if why is not None:
        report.pipelines_note = why
        return
    good = [t for t in trials if not t.violations(request.constraints)]
    if not good:
        report.pipelines_note = "no pipeline measured valid within the constraints"
        return
    best = max(good, key=lambda t: t.items_per_s or 0.0)
    assert best.items_per_s is not None
    ratio = best.items_per_s / replica.items_per_s if replica.items_per_s else float("inf")
    if request.objective != "throughput":
        report.pipelines_note = (f"best pipeline {ratio:.2f}× the replica plan; the objective "
                                 f"{request.objective} keeps the replica plan")
        return
    if ratio <= 1.0:
        report.pipelines_note = f"the replica plan wins: the best pipeline gives {ratio:.2f}× it"
        return
    report.pipelines_note = (f"a pipeline wins: {ratio:.2f}× the best replica plan "
                             f"({best.items_per_s:,.1f} vs {replica.items_per_s:,.1f} items/s)")
    entry = best.plan.model_copy(update={"name": name}).model_dump(mode="json", exclude_none=True)
    if spec.weights:
        entry["weights"] = spec.weights
    report.plan = {**report.plan, "name": f"tuned-{name}-pipeline", "models": [entry]}
    from infermux.runtime.plan import parse_plan

    parse_plan(report.plan, source="tuned plan")


def _final_plan(evaluator: LiveEvaluator, result: TuneResult, request: TuneRequest
                ) -> dict[str, Any]:
    assert result.best is not None
    return _plan_for(evaluator, result.best, request)


def _plan_for(evaluator: LiveEvaluator, trial: Trial, request: TuneRequest) -> dict[str, Any]:
    if request.scenario == "server":
        load: dict[str, Any] = {"scenario": "server", "find_peak": True,
                                "p99_bound_ms": request.constraints.p99_bound_ms,
                                "min_duration_s": 10.0, "min_queries": 1024}
    else:
        load = {"scenario": "offline", "min_duration_s": 10.0, "min_queries": 1024}
    load["data"] = request.trial.data
    # Every written plan may be served at any load: a batch of a few queries runs in the
    # smallest power-of-two bucket that holds it, not padded to the plan's batch.
    plan = evaluator.plan_dict(trial.candidate, load=load, buckets="pow2")
    plan["name"] = "tuned-" + "-".join(sorted({c.model for c in trial.candidate.configs}))
    from infermux.runtime.plan import parse_plan

    parse_plan(plan, source="tuned plan")  # what is written must be runnable
    return plan


def predicted_query_ms(trial: Trial) -> float | None:
    """A query's latency near the peak, from a trial's batch p99 and its workers.

    Near its peak every worker of a plan is busy nearly all the time (its batches grow with the
    load), so a query waits for a worker to free up and then for its own batch. With n workers
    of batch latency L taking turns, one frees up about every L/n: the query takes about
    L·(1 + 1/n). On an H200, ResNet50 b64 ×2 and b32 ×4 ran the same offline (22.6k images/s)
    with the same batch p99 (5.7 and 6.0 ms), and their queueing p99 was 5.5 against 2.4 ms:
    the four workers peaked at 0.94–0.97 of offline, the two at 0.50–0.66.
    """
    if trial.p99_ms is None:
        return None
    return trial.p99_ms * (1.0 + 1.0 / max(1, _workers(trial)))


def _workers(trial: Trial) -> int:
    """The workers a candidate runs: every config's instances."""
    return sum(c.instances for c in trial.candidate.configs)


def server_order(trials: Sequence[Trial], constraints: Constraints) -> list[Trial]:
    """Valid trials in the order a server tune measures their peaks.

    Those within `SERVER_TIE_SHARE` of the best offline throughput come first, the most
    workers first and, among as many workers, the shortest predicted query latency
    (`predicted_query_ms`): offline throughput alone does not rank peaks. The others follow by
    offline throughput. One trial per candidate.

    Why the workers first: the prediction has a query wait for one of n workers, not for the
    queue that forms when few workers run near their capacity under Poisson arrivals. On H200
    hosts ResNet50 fp16 b64 ×1 ran a batch in about half the time of b32 ×4's (which share the
    device four ways), so it predicted the shorter query, and peaked at 0.55-0.80 of its offline
    figure against b32 ×4's 0.81-0.98; b64 ×2 peaked at 0.50-0.83.
    """
    seen: set[str] = set()
    valid: list[Trial] = []
    for trial in sorted(trials, key=lambda t: -(t.items_per_s or 0.0)):
        key = trial.candidate.key()
        if key in seen or not trial.ok or trial.violations(constraints):
            continue
        seen.add(key)
        valid.append(trial)
    if not valid:
        return []
    top = valid[0].items_per_s or 0.0
    near = [t for t in valid if (t.items_per_s or 0.0) >= (1.0 - SERVER_TIE_SHARE) * top]
    near.sort(key=lambda t: (-_workers(t), predicted_query_ms(t) or float("inf"),
                             -(t.items_per_s or 0.0)))
    return near + valid[len(near):]


def _choose_by_server_peak(report: TuneReport, evaluator: LiveEvaluator, request: TuneRequest,
                           *, deadline: float,
                           progress: ProgressFn | None) -> None:
    """Measure the peak of the chosen plan and of the next best candidates; keep the highest.

    The search ranks server candidates by offline throughput with each batch within half the
    bound, which does not rank their peaks: on an H100, ResNet50 b64 ×2 gave 20.9k images/s
    offline and 11.7k queries/s within p99 15 ms, b32 ×3 20.3k and 19.1k. So the candidates
    near the best offline figure are measured shortest predicted query latency first
    (`server_order`), the first of them in place of the search's choice (a budget that allows
    one find-peak measures that one). A candidate whose offline throughput is below the best
    peak so far cannot beat it and is not run. Each plan
    carries the bound; its dispatcher waits `max_queue_delay_ms` for a fuller batch unless the
    plan asks for deadline batching. A chosen plan whose CPU workers run engines that release
    the interpreter lock is measured hosted both ways, as processes and as threads
    (`_thread_hosted`), alternated and repeated while the budget allows
    (`_choose_hosting_of`): the hosting `choose_hosting` picks from the median peaks is written.
    """
    result = report.result
    assert report.plan is not None and result.best is not None
    chosen = report.plan
    chosen_items = (result.verified.items_per_s if result.verified is not None
                    and result.verified.ok else result.best.items_per_s)
    order = server_order(result.trials, request.constraints)
    first = result.best
    if "stages" not in chosen["models"][0] and order and (
            order[0].candidate.key() != result.best.candidate.key()):
        # A replica plan near the best offline figure that predicts shorter queries goes first.
        first = order[0]
        chosen = report.plan = _plan_for(evaluator, first, request)
        chosen_items = first.items_per_s
    others = [t for t in order if t.candidate.key() != first.candidate.key()]
    label = ("the chosen pipeline" if "stages" in chosen["models"][0]
             else first.candidate.label())
    threaded = _thread_hosted(chosen)
    best: tuple[float, int, dict[str, Any]] | None = None  # (peak, row, peak record)
    evaluator.release()

    def measure(plan: dict[str, Any], label: str, offline: float | None,
                **extra: Any) -> tuple[dict[str, Any], int]:
        peak = _server_peak(evaluator, plan, request, progress) or {}
        report.server_peaks.append({"plan": label, "offline_items_per_s": offline,
                                    "batching": _batching(plan), "peak_qps": peak.get("peak_qps"),
                                    "reason": peak.get("reason"), "chosen": False,
                                    "cpu_workers": _cpu_workers(plan), **extra,
                                    **_peak_figures(peak)})
        report.peak_runs.append((plan, peak))
        return peak, len(report.server_peaks) - 1

    if threaded is None:
        peak, row = measure(chosen, label, chosen_items)
        report.server_peak = peak or None
        if peak.get("peak_qps") is not None:
            best = (peak["peak_qps"], row, peak)
    else:
        best = _choose_hosting_of(report, chosen, threaded, label, chosen_items, measure,
                                  deadline)
    best = _choose_spinning(report, best, label, chosen_items, evaluator.units, measure,
                            deadline)
    if report.spinning is not None and not report.spinning["allow_spinning"]:
        label = f"{label} {SPIN_FREE}"
    best = _choose_batching(report, best, label, chosen_items, measure, deadline)
    for trial in others[:SERVER_ALTERNATIVES]:
        if time.monotonic() >= deadline:
            break
        if best is not None and trial.items_per_s is not None and trial.items_per_s <= best[0]:
            continue
        # An alternative is measured, and written, in the hosting and under the batching
        # rule the comparisons chose.
        plan = _batched_as(_hosted_as(_plan_for(evaluator, trial, request), report.hosting),
                           report.batching)
        if report.spinning is not None and not report.spinning["allow_spinning"]:
            plan = _spin_free(plan, evaluator.units) or plan
        peak, row = measure(plan, trial.candidate.label(), trial.items_per_s)
        peak_qps = peak.get("peak_qps")
        if peak_qps is not None and (best is None or peak_qps > best[0]):
            best = (peak_qps, row, peak)
            report.plan = plan
    if report.hosting is not None:
        # Whether the plan written is hosted as the comparison chose (an alternative without
        # lock-releasing CPU replicas keeps its own hosting).
        report.hosting["written_cpu_workers"] = _cpu_workers(report.plan)
    row = best[1] if best is not None else 0
    report.server_peaks[row]["chosen"] = True
    if best is not None:
        report.server_peak = best[2]


def _choose_by_served_peak(report: TuneReport, evaluator: LiveEvaluator, request: TuneRequest,
                           loaded: dict[str, LoadedModel], *, deadline: float,
                           progress: ProgressFn | None) -> None:
    """Serve the plans of the highest runtime peaks (`serve_candidates`); write the best.

    The search's runners are released first: each plan is served by a process of its own.
    `report.served` says how they were served and which row was written; a plan another than
    the runtime's choice is written with its own peak record and hosting.
    """
    served = request.served
    bound = request.constraints.p99_bound_ms
    assert served is not None and bound is not None and report.plan is not None
    evaluator.release()
    entry = report.plan["models"][0]
    name = entry["name"]
    requests = served_requests(loaded[name].spec_io, name, entry, request.trial.lengths)
    rows = report.server_peaks
    runtime_row = next((i for i, row in enumerate(rows) if row["chosen"]), None)
    # A plan on every core serves with its fronts on them too: served beside it, the same
    # replicas with cores left to the fronts (`front_room`).
    roomy = front_room(report.plan, served, sorted(os.sched_getaffinity(0)))
    if roomy is not None:
        plan, unit = roomy
        label = rows[runtime_row]["plan"] if runtime_row is not None else "the chosen plan"
        rows.append({"plan": f"{label} on {unit}, the other cores left to the fronts",
                     "offline_items_per_s": None, "batching": _batching(plan),
                     "peak_qps": None, "reason": "derived for serving, not measured by the runtime",
                     "chosen": False, "cpu_workers": _cpu_workers(plan), "derived": "front_room"})
        report.peak_runs.append((plan, {}))
    choice = serve_candidates(rows, [plan for plan, _ in report.peak_runs], runtime_row,
                              requests, bound, served, deadline=deadline, progress=progress)
    report.served = {**served.to_dict(), "client": ("perf_analyzer" if served.perf_analyzer
                                                     else "infermux"), **choice}
    i = choice["written_row"]
    if i is None:
        return
    if i != runtime_row:
        for row in rows:
            row["chosen"] = False
        rows[i]["chosen"] = True
        report.plan, report.server_peak = report.peak_runs[i][0], report.peak_runs[i][1] or None
        if report.hosting is not None:
            report.hosting["written_cpu_workers"] = _cpu_workers(report.plan)
    # `infermux serve PLAN` then serves it through the front it was measured through.
    report.plan = {**report.plan, "serve": {k: v for k, v in (
        ("front", rows[i]["served_front"]), ("fronts", served.fronts))
        if v is not None}}


def _choose_batching(report: TuneReport, best: tuple[float, int, dict[str, Any]] | None,
                     label: str, offline: float | None,
                     measure: Callable[..., tuple[dict[str, Any], int]], deadline: float,
                     ) -> tuple[float, int, dict[str, Any]] | None:
    """Measure the chosen plan under deadline batching too; the rule of the higher peak wins.

    The plan so far waits `max_queue_delay_ms` for a fuller batch (the runtime's default);
    the deadline rule lets a partial batch wait while its oldest query can still finish within
    the bound. Which peaks higher moves by host: on H200 hosts, alternated on one built
    ResNet50 plan, each rule won on some hosts (docs/architecture-runtime.md), so the host
    decides, by one find-peak of each. Measured where the budget leaves time, the plan has a
    bound and queue-delay batching, and no pipeline (a stage's batches are not sized by the
    bound). `report.batching` holds both peaks and the rule written; returns the best as
    `_choose_by_server_peak` keeps it.
    """
    plan = report.plan
    if (plan is None or time.monotonic() >= deadline
            or not plan.get("load", {}).get("p99_bound_ms")
            or plan.get("dispatcher", {}).get("batching", "queue_delay") != "queue_delay"
            or any(m.get("stages") for m in plan["models"])):
        return best
    timed = {**plan, "dispatcher": {**plan.get("dispatcher", {}), "batching": "deadline"}}
    best, before, after, won = _measure_variant(report, best, timed, label, offline, measure)
    report.batching = {"queue_delay_peak_qps": before, "deadline_peak_qps": after,
                       "batching": "deadline" if won else "queue_delay"}
    return best


def _measure_variant(report: TuneReport, best: tuple[float, int, dict[str, Any]] | None,
                     variant: dict[str, Any], label: str, offline: float | None,
                     measure: Callable[..., tuple[dict[str, Any], int]],
                     ) -> tuple[tuple[float, int, dict[str, Any]] | None, float | None,
                                float | None, bool]:
    """One find-peak of `variant` of the chosen plan; it is written if it peaks higher.

    Returns the best as `_choose_by_server_peak` keeps it, the peak before and the variant's,
    and whether the variant won (then `report.plan` and `report.server_peak` are its).
    """
    peak, row = measure(variant, label, offline)
    before = best[0] if best is not None else None
    after = peak.get("peak_qps")
    if after is None or (before is not None and after <= before):
        return best, before, after, False
    report.plan = variant
    report.server_peak = peak
    return (after, row, peak), before, after, True


#: How a row of `server_peaks` names the chosen plan with its intra-op pools not spinning.
SPIN_FREE = "(intra-op threads not spinning)"


def _spin_free(plan: dict[str, Any], units: dict[str, Unit]) -> dict[str, Any] | None:
    """`plan` with ONNX Runtime's intra-op threads not spinning, where that changes anything.

    An ONNX Runtime CPU instance given more than one core runs a pool of intra-op threads that
    spin between runs (`allow_spinning`, on by default): faster back to back, but under a
    server load the worker idles between batches while its pool burns the cores the runtime's
    own threads (the load generator, the dispatcher, completions) need. On the 2-core machine
    mobilenet_v3_small b8 ×1 peaked at 358 queries/s within p99 50 ms spinning and 1,127 not
    (offline 1,433 and 1,145 items/s). None where no replica has such a pool (one core per
    instance) or spinning is off already.
    """
    changed = False
    models = []
    for m in plan["models"]:
        replicas = []
        for r in m.get("replicas") or []:
            unit = units.get(str(r["unit"]))
            opts = dict(r.get("options") or {})
            threads = opts.get("intra_op_threads") or (
                -(-len(unit.cores) // max(1, int(r.get("instances", 1))))
                if unit is not None and unit.kind == "cpu" else 1)
            if (r.get("engine") == "onnxruntime" and unit is not None and unit.kind == "cpu"
                    and threads > 1 and opts.get("allow_spinning", True)):
                r = {**r, "options": {**opts, "allow_spinning": False}}
                changed = True
            replicas.append(r)
        models.append({**m, "replicas": replicas} if m.get("replicas") else m)
    return {**plan, "models": models} if changed else None


def _choose_spinning(report: TuneReport, best: tuple[float, int, dict[str, Any]] | None,
                     label: str, offline: float | None, units: dict[str, Unit],
                     measure: Callable[..., tuple[dict[str, Any], int]], deadline: float,
                     ) -> tuple[float, int, dict[str, Any]] | None:
    """Measure the chosen plan with ONNX Runtime's intra-op threads not spinning (`_spin_free`).

    The search ranks server candidates by offline throughput, where spinning wins; under a
    Poisson load it may lose several times over, so the peak decides. `report.spinning` holds
    both peaks and what was written.
    """
    plan = report.plan
    still = _spin_free(plan, units) if plan is not None else None
    if still is None or time.monotonic() >= deadline:
        return best
    best, before, after, won = _measure_variant(
        report, best, still, f"{label} {SPIN_FREE}", offline, measure)
    report.spinning = {"spinning_peak_qps": before, "not_spinning_peak_qps": after,
                       "allow_spinning": not won}
    return best


def _batched_as(plan: dict[str, Any], batching: dict[str, Any] | None) -> dict[str, Any]:
    """`plan` under the batching rule `_choose_batching` wrote; unchanged without a choice."""
    if batching is None or batching["batching"] != "deadline" or not plan.get(
            "load", {}).get("p99_bound_ms") or any(m.get("stages") for m in plan["models"]):
        return plan
    return {**plan, "dispatcher": {**plan.get("dispatcher", {}), "batching": "deadline"}}


#: Find-peak runs of each hosting when the budget allows (alternated: process, thread, ...).
HOSTING_ROUNDS = 2


def _choose_hosting_of(report: TuneReport, chosen: dict[str, Any], threaded: dict[str, Any],
                       label: str, offline: float | None,
                       measure: Callable[..., tuple[dict[str, Any], int]], deadline: float,
                       ) -> tuple[float, int, dict[str, Any]] | None:
    """Measure the chosen plan hosted both ways, alternated; the chosen hosting's is written.

    `report.plan` becomes the plan of the hosting `choose_hosting` picks. Returns (its median
    peak, the row standing for it, that row's peak). A second round runs only where the first
    one's duration still fits before `deadline`; the rows carry `hosting_round`, and
    `report.hosting` the decision and its figures.
    """
    plans = {"process": chosen, "thread": threaded}
    runs: list[HostingPeak] = []
    rows: dict[str, list[tuple[int, dict[str, Any]]]] = {h: [] for h in HOSTINGS}
    round_s = 0.0
    for k in range(HOSTING_ROUNDS):
        started = time.monotonic()
        if k and started + round_s > deadline:
            break
        for hosting in HOSTINGS:
            peak, row = measure(plans[hosting], label, offline, hosting_round=k + 1)
            rows[hosting].append((row, peak))
            figures = report.server_peaks[row]
            runs.append(HostingPeak(hosting, peak.get("peak_qps"), figures.get("peak_p99_ms"),
                                    peak.get("edge_confirmed")))
        round_s = time.monotonic() - started
    choice = choose_hosting(runs)
    report.hosting = choice.to_dict()
    report.plan = plans[choice.cpu_workers]
    median = choice.median_peak_qps[choice.cpu_workers]
    # The row that stands for the hosting: its run whose peak is nearest the median.
    row, peak = min(rows[choice.cpu_workers],
                    key=lambda rp: abs((rp[1].get("peak_qps") or 0.0) - median))
    report.server_peak = peak or None
    return (median, row, peak) if median > 0 else None


def _peak_figures(peak: dict[str, Any]) -> dict[str, Any]:
    """A find-peak's figures for its `server_peaks` row.

    The p99 at the peak, its offline trials and fraction, the edge's confirmation and spread,
    and every trial's rate, p99 and validity.
    """
    rate = peak.get("peak_qps")
    at_peak = [t.get("p99_ms") for t in peak.get("trials") or []
               if rate is not None and t.get("rate_qps") == rate and t.get("valid")
               and t.get("p99_ms") is not None]
    return {"peak_p99_ms": max(at_peak) if at_peak else None,
            # The find-peak's own offline trials, before and after it, and the fraction of the
            # higher (`load.scenarios.PeakResult.record`): the search's figure may be minutes old.
            "search_offline_items_per_s": peak.get("offline_items_per_s"),
            "offline_after_items_per_s": peak.get("offline_after_items_per_s"),
            "peak_fraction_of_offline": peak.get("peak_fraction_of_offline"),
            "edge_confirmed": peak.get("edge_confirmed"),
            "p99_spread_ms": peak.get("p99_spread_ms"),
            "trials": [{"rate_qps": t.get("rate_qps"), "p99_ms": t.get("p99_ms"),
                        "valid": t.get("valid"), "repeat": bool(t.get("repeat"))}
                       for t in peak.get("trials") or []]}


#: Engines whose runners compute outside the interpreter lock (ONNX Runtime's `run`,
#: OpenVINO's `infer`, LiteRT's `invoke` release it): thread-hosted CPU workers of theirs
#: hold the lock only to take a batch and hand it back, so a thread may serve as well as a
#: process; the server search measures both.
_LOCK_FREE_ENGINES = frozenset({"onnxruntime", "openvino", "litert"})


def _thread_hosted(plan: dict[str, Any]) -> dict[str, Any] | None:
    """`plan` with its CPU workers as threads, where that is worth a peak search; else None.

    Worth it where the plan has CPU replicas, hosts them as processes (the runtime's
    default), and every one of them runs an engine that releases the interpreter lock
    (`_LOCK_FREE_ENGINES`): under a latency bound a thread saves each batch the pipe to its
    process and the process's wake-up, up to 5–20 ms at the p99 of a 50 ms bound on a 2-core
    host (docs/architecture-runtime.md, "Hosting CPU workers under a latency bound"). Torch's
    eager CPU runners hold the lock between kernels, so two such threads lose to processes.
    """
    replicas = [r for m in plan["models"] for r in m.get("replicas") or []]
    cpu = [r for r in replicas if str(r["unit"]).startswith("cpu")]
    if (not cpu or any(r["engine"] not in _LOCK_FREE_ENGINES for r in cpu)
            or any(m.get("stages") for m in plan["models"])
            or plan.get("dispatcher", {}).get("cpu_workers", "process") != "process"):
        return None
    return {**plan, "dispatcher": {**plan.get("dispatcher", {}), "cpu_workers": "thread"}}


def _hosted_as(plan: dict[str, Any], hosting: dict[str, Any] | None) -> dict[str, Any]:
    """`plan` with its CPU workers hosted as `hosting` (a `HostingChoice.to_dict`) chose.

    Unchanged without a choice, when processes were chosen (the runtime's default), or where
    `plan` cannot be thread-hosted (`_thread_hosted`).
    """
    if hosting is None or hosting.get("cpu_workers") != "thread":
        return plan
    return _thread_hosted(plan) or plan


def _cpu_workers(plan: dict[str, Any]) -> str | None:
    """How the plan hosts its CPU workers (`process` or `thread`); None without CPU replicas."""
    if not any(str(r["unit"]).startswith("cpu") for m in plan["models"]
               for r in m.get("replicas") or []):
        return None
    return str(plan.get("dispatcher", {}).get("cpu_workers", "process"))


def _batching(plan: dict[str, Any]) -> str:
    """How the plan's dispatcher sizes partial batches, in words for the header and rows."""
    d = plan.get("dispatcher", {})
    if d.get("batching", "queue_delay") == "deadline" and plan.get("load", {}).get("p99_bound_ms"):
        return "deadline"
    return f"queue delay {float(d.get('max_queue_delay_ms', QUEUE_DELAY_MS)):g} ms"


def _server_peak(evaluator: LiveEvaluator, plan: dict[str, Any], request: TuneRequest,
                 progress: ProgressFn | None) -> dict[str, Any] | None:
    """The chosen plan's highest Poisson rate within the p99 bound, measured (short trials)."""
    from infermux.runtime import run_plan
    from infermux.runtime.plan import parse_plan

    s = evaluator.settings
    # Each rate is one trial, and its p99 is judged on few queries' tails: a trial needs
    # seconds and hundreds of queries, not the search's short trials, or one host stall sinks it.
    trial_s = max(request.peak_min_duration_s, 3 * s.min_duration_s)
    # The edge's repeats are as long as a trial here, not `runtime.peak.CONFIRM_SCALE` times:
    # the tune compares plans under one rule, within the user's budget, and a long run near a
    # small plan's capacity on a loaded host fails at half its offline rate (2-core CPU, one
    # core busy: p99 1.3-2.9 s at 128-176 queries/s, every repeat down to half of offline).
    data = {**plan, "load": {**plan["load"], "min_duration_s": trial_s,
                             "confirm_duration_s": trial_s,
                             "min_queries": max(request.peak_min_queries, s.min_queries)}}
    report = run_plan(parse_plan(data, source="tuned plan"), progress=progress)
    return report.peak


def _plan_header(result: TuneResult, request: TuneRequest, pipelines: str | None = None,
                 server_peaks: list[dict[str, Any]] | None = None,
                 hosting_choice: dict[str, Any] | None = None,
                 served: dict[str, Any] | None = None) -> str:
    best = result.best
    assert best is not None
    lines = [
        "# Written by `infermux tune`; run it with `infermux run FILE`.",
        f"# objective {request.objective}, scenario {request.scenario}; "
        f"{result.measured} candidates measured of {result.space.get('plans')} plans "
        f"in {result.elapsed_s:.0f}s.",
        f"# best: {best.candidate.label()}: {best.items_per_s:.1f} items/s "
        f"({best.method} measurement)",
    ]
    if result.verified is not None and result.verified is not best and result.verified.ok:
        lines.append(f"# through the runtime: {result.verified.items_per_s:.1f} items/s")
    moved = speed_note(result)
    if moved:
        lines.append(f"# note: {moved}")
    if pipelines:
        lines.append(f"# pipelines: {pipelines}")
    for row in server_peaks or []:
        peak = row["peak_qps"]
        hosted = (f", CPU workers as {hosting_word(row['cpu_workers'])}"
                  if row.get("cpu_workers") else "")
        lines.append(f"# server peak within p99 {request.constraints.p99_bound_ms:g} ms: "
                     f"{row['plan']}{hosted}, {row['batching']} batching: "
                     + (f"{peak:.1f} queries/s" if peak is not None else
                                          f"none ({row['reason']})")
                     + (f" (round {row['hosting_round']})" if row.get("hosting_round") else "")
                     + (" (chosen)" if row["chosen"] else ""))
        words = served_words(row)
        if served is not None and words is not None:
            lines.append(f"#   served over {served['protocol']}, closed loop: {words}")
    if served is not None and served.get("reason"):
        lines.append(f"# served: {served['reason']}")
    if hosting_choice is not None:
        lines.append(f"# CPU workers as {hosting_word(hosting_choice['cpu_workers'])}: "
                     f"{hosting_choice['reason']}")
        written = hosting_choice.get("written_cpu_workers", hosting_choice["cpu_workers"])
        if written != hosting_choice["cpu_workers"]:
            lines.append("# the plan written is another candidate's, which keeps "
                         + (f"its CPU workers as {hosting_word(written)}" if written
                            else "no CPU workers"))
    return "\n".join(lines) + "\n"
