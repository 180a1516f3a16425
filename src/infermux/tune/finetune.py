"""The tuner's last phase: Optuna around the best plan, every trial a measurement.

TPE (NSGA-II for the Pareto objective) over batch, instances, engine and options of every
config of the best plan, seeded with what the ladders already measured near it, until the
budget, repeated suggestions or `patience` trials without a gain end it.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from infermux.tune.budget import BudgetSpentError, SkippedError
from infermux.tune.evaluate import Trial
from infermux.tune.space import Candidate, Space

__all__ = ["Searcher", "fine_tune"]


class Searcher(Protocol):
    """What the fine-tuning drives of the search (`tune.search.Tuner`)."""

    space: Space
    settings: Any
    trials: list[Trial]
    phase: str

    def measure(self, candidate: Candidate, method: str = "auto") -> Trial:
        """Measure (or recall) a candidate; raises when the budget is spent."""
        ...

    def feasible(self, trial: Trial) -> bool:
        """Measured and within every constraint."""
        ...

    def score(self, trial: Trial) -> float:
        """Higher is better; infeasible trials score -inf."""
        ...

    def better(self, new: Trial, old: Trial | None) -> bool:
        """`new` beats `old` by at least the search's minimum gain."""
        ...

    def effective(self) -> list[Trial]:
        """One trial per candidate: its runtime measurement where there is one."""
        ...


def fine_tune(tuner: Searcher, best: Candidate) -> Candidate:
    """Optuna around `best`: every trial a measurement, until the budget or repeats end it.

    Returns the best feasible candidate measured (`best` when none is).
    """
    import optuna

    tuner.phase = "fine-tune"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pareto = tuner.settings.objective == "pareto"
    sampler: Any = (optuna.samplers.NSGAIISampler(seed=tuner.settings.seed, population_size=8)
                    if pareto else optuna.samplers.TPESampler(seed=tuner.settings.seed,
                                                              n_startup_trials=4))
    directions: list[Any] = ["maximize", "minimize"] if pareto else ["maximize"]
    study = optuna.create_study(directions=directions, sampler=sampler)
    choices: list[dict[str, list[Any]]] = []
    for cfg in best.configs:
        us = tuner.space.unit(cfg.unit)
        engines = [e for e in us.engines if any(
            t.candidate.configs[0].engine == e and tuner.score(t) > -math.inf
            for t in tuner.trials if t.candidate.solo and t.candidate.configs[0].unit == cfg.unit
            and t.candidate.configs[0].model == cfg.model)] or [cfg.engine]
        i = us.batches.index(cfg.batch) if cfg.batch in us.batches else 0
        batches = us.batches[max(0, i - 2): i + 3]
        variants = {e: us.variants(e, cfg.model) for e in engines}
        choices.append({"engine": engines, "batch": batches, "instances": us.instances,
                        "variants": [variants[e] for e in engines]})

    def build(params: dict[str, Any]) -> Candidate:
        configs = []
        for k, (cfg, ch) in enumerate(zip(best.configs, choices, strict=True)):
            engine = params[f"engine{k}"]
            variants = ch["variants"][ch["engine"].index(engine)]
            variant = variants[params[f"options{k}"] % len(variants)]
            configs.append(cfg.with_(engine=engine, batch=params[f"batch{k}"],
                                     instances=params[f"instances{k}"], options=variant))
        return Candidate.of(*configs)

    distributions: dict[str, Any] = {}
    for k, ch in enumerate(choices):
        distributions |= {
            f"engine{k}": optuna.distributions.CategoricalDistribution(ch["engine"]),
            f"batch{k}": optuna.distributions.CategoricalDistribution(ch["batch"]),
            f"instances{k}": optuna.distributions.CategoricalDistribution(ch["instances"]),
            f"options{k}": optuna.distributions.IntDistribution(
                0, max(len(v) for v in ch["variants"]) - 1)}

    def params_of(candidate: Candidate) -> dict[str, Any] | None:
        """The study's parameters of a measured candidate, if it lies in the neighbourhood."""
        if [(c.model, c.unit) for c in candidate.configs] != [
                (c.model, c.unit) for c in best.configs]:
            return None
        params: dict[str, Any] = {}
        for k, (cfg, ch) in enumerate(zip(candidate.configs, choices, strict=True)):
            if (cfg.engine not in ch["engine"] or cfg.batch not in ch["batch"]
                    or cfg.instances not in ch["instances"]):
                return None
            variants = ch["variants"][ch["engine"].index(cfg.engine)]
            if cfg.options_dict not in variants:
                return None
            params |= {f"engine{k}": cfg.engine, f"batch{k}": cfg.batch,
                       f"instances{k}": cfg.instances,
                       f"options{k}": variants.index(cfg.options_dict)}
        return params

    def values(result: Trial) -> list[float]:
        if pareto:
            ok = tuner.feasible(result)
            return [result.items_per_s or 0.0 if ok else 0.0,
                    result.p99_ms if ok and result.p99_ms else 1e9]
        s = tuner.score(result)
        return [s if s > -math.inf else -1e18]

    # What the ladders already measured around the best plan is told to the sampler first,
    # so it starts informed instead of spending its first trials on random points.
    tried: set[str] = set()
    for known in tuner.effective():
        params = params_of(known.candidate)
        if params is not None and known.candidate.key() not in tried:
            tried.add(known.candidate.key())
            study.add_trial(optuna.trial.create_trial(
                params=params, distributions=distributions, values=values(known)))
    size = 1
    for ch in choices:
        size *= len(ch["engine"]) * len(ch["batch"]) * len(ch["instances"]) * max(
            len(v) for v in ch["variants"])
    repeats = stale = 0
    incumbent = max((t for t in tuner.trials if tuner.feasible(t)), key=tuner.score,
                    default=None)
    while repeats < 8 and len(tried) < size and stale < tuner.settings.patience:
        trial = study.ask()
        params = {}
        for k, ch in enumerate(choices):
            params[f"engine{k}"] = trial.suggest_categorical(f"engine{k}", ch["engine"])
            params[f"batch{k}"] = trial.suggest_categorical(f"batch{k}", ch["batch"])
            params[f"instances{k}"] = trial.suggest_categorical(f"instances{k}",
                                                                ch["instances"])
            params[f"options{k}"] = trial.suggest_int(
                f"options{k}", 0, max(len(v) for v in ch["variants"]) - 1)
        candidate = build(params)
        key = candidate.key()
        repeats = repeats + 1 if key in tried else 0
        tried.add(key)
        try:
            result = tuner.measure(candidate)
            better = tuner.better(result, incumbent)
        except SkippedError:
            # A compile build that does not fit: not measured, and not a reason to stop.
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            if repeats == 0:
                stale += 1
            continue
        except BudgetSpentError:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        if better:
            incumbent, stale = result, 0
        elif repeats == 0:
            stale += 1
        study.tell(trial, values(result))
    scored = [t for t in tuner.trials if tuner.feasible(t)]
    return max(scored, key=tuner.score).candidate if scored else best
