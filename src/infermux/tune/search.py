"""The search: solo ladders per unit, measured combinations, then Optuna fine-tuning.

1. **Screen** — every (model, unit, engine) at one middle batch size, default options.
2. **Ladder** — for the engines within reach of the best on each unit, a hill climb over the
   batch ladder: a step is taken only while the objective gains at least `min_gain`, and never
   across a broken constraint or an out-of-memory point. Then each engine option variant and
   more instances at the best batch, with the same rule; for a model with a sequence length,
   its candidate sequence-bucket sets on the best options.
3. **Combine** — units added in order of solo figure, each combination measured through the
   runtime (co-located units contend: a plan is never chosen from summed solo figures); a unit
   stays only if the measured plan gains. The contention factor of each unit in each measured
   combination (its items/s there ÷ alone, both through the runtime) is kept.
4. **Fine-tune** — Optuna (TPE; NSGA-II for the Pareto objective) over batch, instances,
   engine and options of every config of the best plan, seeded with it, every trial measured,
   until the budget or the space near the optimum is exhausted.

The budget is wall time (`tune.budget`): a trial starts only if its expected cost (the mean of
past trials of its kind) fits in what is left, keeping back the cost of the final runtime
check. Trials that build with torch.compile are a kind of their own (their build is most of
their cost); one that does not fit is skipped and the search goes on without it. The
fine-tuning lives in `tune.finetune`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infermux.tune.budget import Budget, BudgetSpentError, SkippedError
from infermux.tune.evaluate import Constraints, Evaluator, Trial
from infermux.tune.finetune import fine_tune
from infermux.tune.space import SEQ_KEY, Candidate, Config, Space

__all__ = ["OBJECTIVES", "SPEED_MOVED", "SPEED_SUSPECT", "TuneResult", "TuneSettings", "Tuner",
           "pareto_front", "speed_note"]

OBJECTIVES = ("throughput", "energy", "latency", "pareto")
#: The runtime's check of an in-process winner suspects the host's speed where it ran the
#: winner below this share of its in-process figure: on H200 hosts 0.71-0.98 for ResNet50
#: plans, and 0.43-0.47 on two hosts whose own speed halved within minutes.
SPEED_SUSPECT = 0.6
#: ... and says the host's speed moved where the winner, measured in-process again, ran below
#: this share of its first figure (the runtime was not what was slow).
SPEED_MOVED = 0.75


@dataclass(frozen=True)
class TuneSettings:
    """How the search runs."""

    objective: str = "throughput"
    budget_s: float = 600.0
    #: A step (bigger batch, another instance, another unit) must gain at least this.
    min_gain: float = 0.03
    #: Engines kept for the ladder on each unit: those within this fraction of the best.
    engine_reach: float = 0.25
    seed: int = 0
    fine_tune: bool = True
    #: Fine-tuning ends after this many trials in a row that do not beat the best by min_gain.
    patience: int = 3
    #: Check the chosen plan through the runtime when it was measured in-process.
    verify: bool = True

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {"objective": self.objective, "budget_s": self.budget_s,
                "min_gain": self.min_gain, "engine_reach": self.engine_reach,
                "seed": self.seed, "fine_tune": self.fine_tune, "patience": self.patience,
                "verify": self.verify}


@dataclass
class TuneResult:
    """The best plan, how it was found and what explains it."""

    best: Trial | None
    trials: list[Trial]
    pareto: list[Trial]
    solo_best: dict[str, Trial]
    contention: list[dict[str, Any]]
    verified: Trial | None
    space: dict[str, Any]
    elapsed_s: float
    stopped_by_budget: bool
    phases: dict[str, int] = field(default_factory=dict)
    #: Candidates not measured because their torch.compile build would not fit the budget.
    skipped: list[str] = field(default_factory=list)
    #: Where the host's speed moved during the search (`Tuner._check_speed`): the
    #: candidate, its first in-process figure, its runtime figure, its in-process figure again.
    speed_moved: list[dict[str, Any]] = field(default_factory=list)

    @property
    def measured(self) -> int:
        """Distinct candidates measured (reused ones included: they were measured once)."""
        return len({t.candidate.key() for t in self.trials})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "best": self.best.to_dict() if self.best else None,
            "verified": self.verified.to_dict() if self.verified else None,
            "solo_best": {u: t.to_dict() for u, t in self.solo_best.items()},
            "contention": self.contention,
            "pareto": [t.to_dict() for t in self.pareto],
            "trials": [t.to_dict() for t in self.trials],
            "measured": self.measured,
            "reused": sum(1 for t in self.trials if t.reused),
            "space": self.space,
            "elapsed_s": self.elapsed_s,
            "stopped_by_budget": self.stopped_by_budget,
            "phases": self.phases,
            "skipped": self.skipped,
            "speed_moved": self.speed_moved,
            "failed": [t.to_dict() for t in self.trials if t.status != "ok"],
        }


def speed_note(result: TuneResult) -> str | None:
    """A sentence where the host's speed moved during the search, else None."""
    if not result.speed_moved:
        return None
    m = result.speed_moved[0]
    return (f"the host's speed moved during the search: {m['plan']} ran "
            f"{m['in_process']:.0f} items/s in-process, then {m['runtime']:.0f} through the "
            f"runtime and {m['in_process_again']:.0f} in-process again, so this search ranked "
            "candidates measured at different speeds: tune again on a steadier host before "
            "trusting the choice")


def pareto_front(trials: list[Trial], *, with_energy: bool) -> list[Trial]:
    """Trials no other trial beats on every one of throughput ↑, p99 ↓ (and energy/item ↓)."""

    def vec(t: Trial) -> tuple[float, ...]:
        v = [-(t.items_per_s or 0.0), t.p99_ms if t.p99_ms is not None else math.inf]
        if with_energy:
            v.append(t.energy_per_item_j if t.energy_per_item_j is not None else math.inf)
        return tuple(v)

    seen: dict[str, Trial] = {}
    for t in trials:
        seen.setdefault(t.candidate.key(), t)
    pool = list(seen.values())
    front = []
    for t in pool:
        a = vec(t)
        dominated = any(
            all(x <= y for x, y in zip(vec(o), a, strict=True)) and vec(o) != a for o in pool)
        if not dominated:
            front.append(t)
    return sorted(front, key=lambda t: -(t.items_per_s or 0.0))


class Tuner:
    """Searches `space` through `evaluator` for the best plan under `constraints`.

    `clock` (seconds) is injectable so the budget logic is tested deterministically.
    """

    def __init__(
        self,
        space: Space,
        evaluator: Evaluator,
        constraints: Constraints | None = None,
        settings: TuneSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        progress: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.space = space
        self.evaluator = evaluator
        self.constraints = constraints or Constraints()
        self.settings = settings or TuneSettings()
        self.clock = clock
        self.progress = progress
        self.trials: list[Trial] = []
        self._cache: dict[str, Trial] = {}
        #: The wall-time budget over this search's trials (`tune.budget`).
        self.budget = Budget(self.settings.budget_s, self.trials, clock)
        self._stopped = False
        self.phase = "screen"
        self.phases: dict[str, int] = {}
        self.speed_moved: list[dict[str, Any]] = []
        #: Candidates left unmeasured because their torch.compile build would not fit.
        self.skipped: list[str] = []

    # -- bookkeeping -----------------------------------------------------------------------------

    def _reserve_s(self) -> float:
        """Room to measure the chosen plan through the runtime, and one runner-up after it.

        When the best plan so far was measured in-process with torch.compile, its check
        through the runtime compiles too, and is expected to cost that.
        """
        if not self.settings.verify:
            return 0.0
        best = max((t for t in self.trials if self.feasible(t)), key=self.score, default=None)
        engines = best.candidate.engines if best is not None else None
        eager = self.budget.expected_s("runtime", engines=engines)
        first = eager
        if best is not None and best.method != "runtime" and best.candidate.compiled:
            first = self.budget.expected_s("runtime", compiled=True, engines=engines)
        return first + eager

    def _method(self, candidate: Candidate) -> str:
        return "engine" if candidate.solo and self._engine_ok(candidate.configs[0]) else "runtime"

    def _engine_ok(self, config: Config) -> bool:
        try:
            unit = self.space.unit(config.unit).unit
        except KeyError:
            return False
        return (not (unit.kind == "cpu" and config.instances > 1)
                and config.model not in self.space.mixed_lengths)

    def measure(self, candidate: Candidate, method: str = "auto") -> Trial:
        """Measure (or recall) one candidate; raises BudgetSpentError when it would not fit.

        A torch.compile candidate that would not fit raises SkippedError instead: the search
        goes on with the trials that do.
        """
        used = self._method(candidate) if method == "auto" else method
        key = f"{used}|{candidate.key()}"
        if key in self._cache:
            return self._cache[key]
        reserve = 0.0 if self.phase == "verify" else self._reserve_s()
        compiled = candidate.compiled
        if (self.trials and self.budget.expected_s(used, compiled, candidate.engines)
                > self.budget.left_s() - reserve):
            if compiled and self.phase != "verify":
                self.skipped.append(candidate.label())
                raise SkippedError
            self._stopped = True
            raise BudgetSpentError
        trial = self.evaluator.evaluate(candidate, used)
        self._cache[key] = trial
        self.trials.append(trial)
        self.phases[self.phase] = self.phases.get(self.phase, 0) + 1
        if self.progress is not None:
            self.progress(self.phase, {"trial": trial, "left_s": max(0.0, self.budget.left_s()),
                                        "budget_s": self.settings.budget_s,
                                        "measured": len(self.trials)})
        return trial

    def feasible(self, trial: Trial) -> bool:
        """Measured and within every constraint."""
        return not trial.violations(self.constraints)

    def score(self, trial: Trial) -> float:
        """Higher is better; infeasible trials score -inf."""
        if not self.feasible(trial):
            return -math.inf
        objective = self.settings.objective
        if objective == "energy":
            e = trial.energy_per_item_j
            return -e if e is not None else -math.inf
        if objective == "latency":
            return -(trial.p99_ms if trial.p99_ms is not None else math.inf)
        return trial.items_per_s or 0.0

    def better(self, new: Trial, old: Trial | None) -> bool:
        """`new` beats `old` by at least min_gain (relative, in the objective's direction).

        Figures measured in different ways are not compared: the one measured in-process is
        measured again through the runtime first (in-process figures skip the dispatcher).
        """
        if old is None or self.score(old) == -math.inf:
            return self.score(new) > -math.inf
        if new.method != old.method and self.score(new) > -math.inf:
            new, old = self._through_runtime(new), self._through_runtime(old)
        a, b = self.score(new), self.score(old)
        if a == -math.inf:
            return False
        return a > b + self.settings.min_gain * abs(b)

    def _through_runtime(self, trial: Trial) -> Trial:
        return trial if trial.method == "runtime" else self.measure(trial.candidate, "runtime")

    def effective(self) -> list[Trial]:
        """One trial per candidate: its runtime measurement where there is one."""
        out: dict[str, Trial] = {}
        for t in self.trials:
            key = t.candidate.key()
            if key not in out or (t.method == "runtime" and out[key].method != "runtime"):
                out[key] = t
        return list(out.values())

    # -- the search ------------------------------------------------------------------------------

    def run(self) -> TuneResult:
        """Search within the budget and return the best plan found."""
        self.budget.begin()
        solo_best: dict[str, Trial] = {}
        best: Candidate | None = None
        contention: list[dict[str, Any]] = []
        try:
            solo_best = self._solo(solo_best)
            best = self._initial(solo_best)
            if best is not None:
                best, contention = self._combine(best, solo_best)
                if self.settings.fine_tune:
                    best = fine_tune(self, best)
        except (BudgetSpentError, SkippedError):
            # Units whose ladder the budget cut short: their best measured solo trial.
            for t in sorted(self.effective(), key=self.score, reverse=True):
                c = t.candidate.configs[0]
                if t.candidate.solo and self.feasible(t):
                    solo_best.setdefault(f"{c.model}@{c.unit}", t)
        self.phase = "verify"
        chosen = None
        for _ in range(4):
            feasible = [t for t in self.effective() if self.feasible(t)]
            chosen = max(feasible, key=self.score, default=None)
            if chosen is None or chosen.method == "runtime" or not self.settings.verify:
                break
            # The best was measured in-process: measure it as `infermux run` will run it, and
            # choose again (another plan may be better through the runtime).
            try:
                through = self.measure(chosen.candidate, "runtime")
            except BudgetSpentError:
                break
            self._check_speed(chosen, through)
        if chosen is not None and chosen.method != "runtime":
            # The budget ended before the runtime confirmed it: a plan measured as it will run
            # beats a figure the runtime has not confirmed.
            confirmed = [t for t in self.effective() if t.method == "runtime" and self.feasible(t)]
            if confirmed:
                chosen = max(confirmed, key=self.score)
        verified = None
        if chosen is not None:
            verified = next((t for t in self.trials if t.method == "runtime"
                             and t.candidate.key() == chosen.candidate.key()), None)
        feasible = [t for t in self.effective() if self.feasible(t)]
        with_energy = bool(feasible) and all(t.energy_per_item_j is not None for t in feasible)
        return TuneResult(
            best=chosen, trials=list(self.trials),
            pareto=pareto_front(feasible, with_energy=with_energy), solo_best=solo_best,
            contention=contention, verified=verified, space=self.space.describe(),
            elapsed_s=self.budget.elapsed_s(), stopped_by_budget=self._stopped,
            phases=dict(self.phases), skipped=list(dict.fromkeys(self.skipped)),
            speed_moved=list(self.speed_moved))

    def _on_gpu(self, config: Config) -> bool:
        try:
            return self.space.unit(config.unit).unit.kind == "cuda"
        except KeyError:
            return False

    def _check_speed(self, first: Trial, through: Trial) -> None:
        """Measure an in-process winner in-process again where the runtime ran it far slower.

        Two hosts' tunes measured their winners at 0.43-0.47 of their in-process figures
        through the runtime, where good hosts measure 0.71-0.98; the offline figures of the
        same plans then moved by half between runs. Measured again in-process, a winner that
        is as slow says the host slowed, not the runtime (`speed_moved`, `speed_note`); one
        that is as fast leaves the runtime's figure to choose, as it does anyway. GPU
        candidates only: on the 2-core machine the runtime runs small CPU plans below 0.6 of
        their in-process figures as a matter of course (its dispatch is much of a small
        batch's time), so there the share says nothing of the host. The second measurement is
        fresh (not a stored trial) and is not stored for reuse: it is a check.
        """
        if self.speed_moved or not (first.ok and through.ok and first.items_per_s
                                    and through.items_per_s):
            return  # one witness is enough
        if through.items_per_s >= SPEED_SUSPECT * first.items_per_s:
            return
        candidate = first.candidate
        if not all(self._on_gpu(c) for c in candidate.configs):
            return
        if (self.budget.expected_s("engine", candidate.compiled, candidate.engines)
                > self.budget.left_s()):
            return
        again = self.evaluator.evaluate(candidate, "engine", fresh=True)
        self.trials.append(again)  # measured, so counted and kept; the first figure stands
        self.phases["speed check"] = self.phases.get("speed check", 0) + 1
        if self.progress is not None:
            self.progress("speed check", {"trial": again,
                                          "left_s": max(0.0, self.budget.left_s()),
                                          "budget_s": self.settings.budget_s,
                                          "measured": len(self.trials)})
        if again.ok and again.items_per_s and (
                again.items_per_s < SPEED_MOVED * first.items_per_s):
            self.speed_moved.append({"plan": candidate.label(),
                                     "in_process": first.items_per_s,
                                     "runtime": through.items_per_s,
                                     "in_process_again": again.items_per_s})

    def _solo(self, out: dict[str, Trial]) -> dict[str, Trial]:
        """Screen, ladder, options and instances per (model, unit); the best solo trial of each.

        Fills `out` as each (model, unit) ends, so a budget that runs out midway still leaves
        the units finished so far for the explanation.
        """
        self.phase = "screen"
        screened: dict[tuple[str, str], list[tuple[str, Trial]]] = {}
        for model in self.space.models:
            for us in self.space.units:
                mid = us.batches[min(len(us.batches) - 1, len(us.batches) // 2)]
                for engine in us.engines:
                    cfg = Config.make(model, us.unit.id, engine, mid, 1)
                    screened.setdefault((model, us.unit.id), []).append(
                        (engine, self.measure(Candidate.of(cfg))))
        self.phase = "ladder"
        # The most promising units first: when the budget runs short, it is the weakest units'
        # ladders that go unclimbed (their screen figure stands for them).
        order = sorted(screened.items(), key=lambda kv: max(self.score(t) for _, t in kv[1]),
                       reverse=True)
        for (model, unit_id), rows in order:
            us = self.space.unit(unit_id)
            scores = {e: self.score(t) for e, t in rows}
            top = max(scores.values())
            if top == -math.inf:
                # Nothing fits at the middle batch: the ladder starts from the smallest.
                keep = [e for e, t in rows if t.status in ("ok", "invalid")] or [rows[0][0]]
            else:
                reach = self.settings.engine_reach
                keep = sorted((e for e in scores if scores[e] >= top - reach * abs(top)),
                              key=lambda e: -scores[e])[:2]
            best_trial: Trial | None = None
            for engine in keep:
                trial = self._climb(Config.make(model, unit_id, engine,
                                                us.batches[min(len(us.batches) - 1,
                                                               len(us.batches) // 2)]),
                                    dict(rows)[engine], us.batches)
                if best_trial is None or self.score(trial) > self.score(best_trial):
                    best_trial = trial
            assert best_trial is not None
            self.phase = "options"
            best_trial = self._options_and_instances(best_trial)
            self.phase = "ladder"
            if self.score(best_trial) > -math.inf:
                out[f"{model}@{unit_id}"] = best_trial
        return out

    def _climb(self, start: Config, start_trial: Trial, batches: list[int]) -> Trial:
        """Hill-climb the batch ladder from `start` while each step gains at least min_gain.

        Throughput and energy climb upward first; latency only looks down. Downward steps are
        taken for throughput only when the start breaks a bound (or ran out of memory), and
        then past every smaller batch that still breaks it, down to the first that holds it. After a
        step that gained four times min_gain the next one skips a rung (batch curves saturate,
        so a steep one has room); if the skip does not gain, the rung between is measured.
        """
        objective = self.settings.objective
        feasible = self.score(start_trial) > -math.inf
        directions = []
        if objective != "latency" or not feasible:
            directions.append(+1)
        if objective in ("latency", "energy") or not feasible:
            directions.append(-1)
        best = start_trial
        index = batches.index(start.batch)
        for step in directions:
            i, moved, steep = index, False, False
            while 0 <= i + step < len(batches):
                stride = 2 if steep and 0 <= i + 2 * step < len(batches) else 1
                trial = self.measure(Candidate.of(start.with_(batch=batches[i + stride * step])))
                if not self.better(trial, best) and stride == 2:
                    stride = 1
                    trial = self.measure(Candidate.of(start.with_(batch=batches[i + step])))
                if not self.better(trial, best):
                    if (step < 0 and self.score(best) == -math.inf
                            and self.score(trial) == -math.inf
                            and trial.status in ("ok", "invalid", "oom")):
                        # Still past a bound going down: a smaller batch may hold it (a tight
                        # p99 bound can leave only the smallest batches).
                        i += stride * step
                        continue
                    break
                old = self.score(best)
                steep = old > -math.inf and (
                    self.score(trial) - old >= 4 * self.settings.min_gain * abs(old))
                best, i, moved = trial, i + stride * step, True
            if moved:
                break
        return best

    def _options_and_instances(self, trial: Trial) -> Trial:
        """Each option variant at the best batch, then more instances, while they gain.

        torch.compile's `reduce-overhead`, when asked for, is tried only where its `default`
        mode measured faster than what the unit had: both run the same compiled kernels in the
        runner's CUDA graph, so where compiling does not pay, neither does. A compile
        build that would not fit in the budget is skipped, not the end of the search.
        """
        cfg = trial.candidate.configs[0]
        us = self.space.unit(cfg.unit)
        best, best_cfg = trial, cfg
        variants = us.options.get(cfg.engine, [{}])
        gated = {"compile": "default"} in variants
        compile_gained = False
        for variant in variants:
            if variant == cfg.options_dict:
                continue
            if variant.get("compile") == "reduce-overhead" and gated and not compile_gained:
                continue
            try:
                t = self.measure(Candidate.of(cfg.with_(options=variant)))
                better = self.better(t, best)
            except SkippedError:
                continue
            if variant == {"compile": "default"}:
                compile_gained = better
            if better:
                best, best_cfg = t, t.candidate.configs[0]
        # The sequence buckets last, on the best engine options: one knob at a time.
        for seq in us.seq_sets.get(cfg.model, [])[1:]:
            try:
                t = self.measure(Candidate.of(best_cfg.with_(
                    options=best_cfg.options_dict | {SEQ_KEY: seq})))
            except SkippedError:
                continue
            if self.better(t, best):
                best, best_cfg = t, t.candidate.configs[0]
        try:
            for n in us.instances:
                if n <= best_cfg.instances:
                    continue
                t = self.measure(Candidate.of(best_cfg.with_(instances=n)))
                if not self.better(t, best):
                    # More workers often want smaller batches each: one step down first.
                    lower = [b for b in us.batches if b < best_cfg.batch]
                    if not lower:
                        break
                    t = self.measure(Candidate.of(best_cfg.with_(instances=n, batch=lower[-1])))
                    if not self.better(t, best):
                        break
                best, best_cfg = t, t.candidate.configs[0]
        except SkippedError:
            pass
        return best

    def _initial(self, solo_best: dict[str, Trial]) -> Candidate | None:
        """Every model on its best unit, units distinct (a model takes its next best if taken)."""
        configs: list[Config] = []
        taken: set[str] = set()
        for model in self.space.models:
            options = sorted((t for k, t in solo_best.items() if k.startswith(model + "@")),
                             key=self.score, reverse=True)
            free = [t for t in options
                    if self.space.compatible(t.candidate.configs[0].unit, taken)]
            if not free:
                return None
            configs.append(free[0].candidate.configs[0])
            taken.add(configs[-1].unit)
        return Candidate.of(*configs)

    def _combine(self, current: Candidate, solo_best: dict[str, Trial]
                 ) -> tuple[Candidate, list[dict[str, Any]]]:
        """Add units while the measured plan gains; record contention per unit pair.

        Units that share cores with one in the plan are alternatives, not additions: they
        were weighed alone. A combination that fails is recorded as failed, with its error.
        """
        self.phase = "combine"
        contention: list[dict[str, Any]] = []
        rest = sorted((t for t in solo_best.values()
                       if self.space.compatible(t.candidate.configs[0].unit, current.units)),
                      key=self.score, reverse=True)
        if not rest:
            return current, contention
        runtime_solo: dict[str, Trial] = {}

        def alone(cfg: Config) -> Trial:
            key = cfg.key()
            if key not in runtime_solo:
                runtime_solo[key] = self.measure(Candidate.of(cfg), "runtime")
            return runtime_solo[key]

        try:
            current_trial = (self.measure(current, "runtime") if not current.solo
                             else alone(current.configs[0]))
        except SkippedError:
            return current, contention
        for extra in rest:
            cfg = extra.candidate.configs[0]
            if not self.space.compatible(cfg.unit, current.units):
                continue
            candidate = current.add(cfg)
            try:
                trial_alone = alone(cfg)
                trial = self.measure(candidate, "runtime")
            except SkippedError:
                continue
            summed = (current_trial.items_per_s or 0.0) + (trial_alone.items_per_s or 0.0)
            if not trial.ok:
                contention.append({"plan": candidate.label(), "unit": "all",
                                   "with": list(candidate.units), "status": trial.status,
                                   "error": trial.error, "summed_solo_items_per_s": summed,
                                   "measured_items_per_s": None, "factor": None})
                continue
            for c in candidate.configs:
                solo_rt = alone(c)
                inside = trial.per_unit.get(c.unit)
                if solo_rt.items_per_s and inside is not None:
                    contention.append({
                        "plan": candidate.label(), "unit": c.unit, "with": [
                            u for u in candidate.units if u != c.unit], "status": "ok",
                        "alone_items_per_s": solo_rt.items_per_s, "inside_items_per_s": inside,
                        "factor": inside / solo_rt.items_per_s})
            contention.append({"plan": candidate.label(), "unit": "all",
                               "with": list(candidate.units), "status": "ok", "error": None,
                               "summed_solo_items_per_s": summed,
                               "measured_items_per_s": trial.items_per_s,
                               "factor": (trial.items_per_s or 0.0) / summed if summed else None})
            if self.better(trial, current_trial):
                current, current_trial = candidate, trial
        return current, contention
