"""Characterization: accuracy, determinism and rebuild variance of every engine and precision.

`run_characterize(CharacterizeConfig(...))` builds each (unit, engine, precision) several times,
each build in a fresh process, runs the same labelled inputs through every build and reports
accuracy against labels and the fp32 reference, variance between builds, between runs and with
the batch size, and which knob removes each variance at what throughput cost
(docs/architecture-characterize.md).
"""

from infermux.characterize.data import DIGITS, Dataset, load_data
from infermux.characterize.knobs import KNOBS, Knob
from infermux.characterize.metrics import Proportion, Spread, accuracy_figures, spread, wilson
from infermux.characterize.run import (
    VARIANCE_KINDS,
    Cause,
    CharacterizeConfig,
    CharacterizeReport,
    Study,
    Variant,
    VariantResult,
    plan_variants,
    reference_outputs,
    run_characterize,
)

__all__ = [
    "DIGITS",
    "KNOBS",
    "VARIANCE_KINDS",
    "Cause",
    "CharacterizeConfig",
    "CharacterizeReport",
    "Dataset",
    "Knob",
    "Proportion",
    "Spread",
    "Study",
    "Variant",
    "VariantResult",
    "accuracy_figures",
    "load_data",
    "plan_variants",
    "reference_outputs",
    "run_characterize",
    "spread",
    "wilson",
]
