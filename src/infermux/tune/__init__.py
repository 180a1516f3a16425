"""The auto-tuner: the fastest runnable plan for some models on this machine's units.

`space` (what may run where), `evaluate` (real trials, stored and reused), `search` (solo
ladders, measured combinations, Optuna fine-tuning under constraints and a budget) and `run`
(`run_tune`: discovery to a written plan). See `docs/architecture-tune.md`.
"""

from infermux.tune.evaluate import (
    Constraints,
    Evaluator,
    LiveEvaluator,
    TableEvaluator,
    Trial,
    TrialSettings,
    model_name,
)
from infermux.tune.run import TuneReport, TuneRequest, build_space, prepare, run_tune
from infermux.tune.search import OBJECTIVES, Tuner, TuneResult, TuneSettings, pareto_front
from infermux.tune.space import Candidate, Config, Space, UnitSpace, option_variants

__all__ = [
    "OBJECTIVES",
    "Candidate",
    "Config",
    "Constraints",
    "Evaluator",
    "LiveEvaluator",
    "Space",
    "TableEvaluator",
    "Trial",
    "TrialSettings",
    "TuneReport",
    "TuneRequest",
    "TuneResult",
    "TuneSettings",
    "Tuner",
    "UnitSpace",
    "build_space",
    "model_name",
    "option_variants",
    "pareto_front",
    "prepare",
    "run_tune",
]
