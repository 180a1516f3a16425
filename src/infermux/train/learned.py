"""The learned model: a correction of the simple model's log error, learned across configurations.

Its features are the knobs and the simple model's bottleneck ratios; a random forest or a ridge
regression, whichever has the lower leave-one-configuration-out error (`fit_learned`). A model
fitted on a reference network's profiles is recalibrated on a new network's few (`recalibrate`):
the third layer of `predict`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infermux.errors import UsageError
from infermux.train.components import fit_components, served_step
from infermux.train.knobs import Knobs
from infermux.train.steady import by_config, steady

__all__ = [
    "LearnedModel",
    "Rows",
    "features",
    "fit_learned",
    "held_out_rows",
    "recalibrate",
    "training_rows",
]


def features(knobs: Knobs, pass_name: str, simple: dict[str, float], fs_tmpfs: bool
              ) -> list[float]:
    """The learned correction's inputs: the knobs and the simple model's bottleneck ratios."""
    step = simple["T"]
    return [
        math.log2(knobs.batch), float(knobs.workers), math.log2(knobs.workers + 1),
        float(simple["term_n"]), float(fs_tmpfs), float(pass_name == "cold"),
        float(knobs.precision != "fp32"), float(knobs.persistent_workers), float(knobs.pin_memory),
        float(knobs.prefetch_factor if knobs.workers else 0),
        math.log(simple["term_loader"] / step + 1e-9), math.log(simple["term_cores"] / step + 1e-9),
        math.log(simple["term_compute"] / step + 1e-9),
    ]


@dataclass
class LearnedModel:
    """A correction of the simple model's log error (time, and power), learned across configs."""

    kind: str  # forest | ridge
    time_model: Any
    power_model: Any | None
    loo_time: float  # mean |log error| leave-one-configuration-out
    rows: int
    #: Transfer: a ridge regression mapping the reference correction to the new network's.
    recalibration: dict[str, Any] = field(default_factory=dict)

    def correction(self, x: list[float]) -> tuple[float, float]:
        """(log factor on time, log factor on power)."""
        t = float(self.time_model.predict([x])[0])
        p = float(self.power_model.predict([x])[0]) if self.power_model is not None else 0.0
        if "time" in self.recalibration:
            a, b = self.recalibration["time"]
            t = a + b * t
            if "power" in self.recalibration:
                a, b = self.recalibration["power"]
                p = a + b * p
        return t, p


def _regressor(kind: str) -> Any:
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if kind == "forest":
        return RandomForestRegressor(n_estimators=200, min_samples_leaf=2, random_state=0)
    return make_pipeline(StandardScaler(), Ridge(alpha=3.0))


#: The rows a learned correction is fitted on with one configuration left out, built from
#: the passes without it (`held_out_rows`): (features, log time error, log power error, groups).
Rows = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]


def held_out_rows(passes: list[dict[str, Any]], all_cores: int, tmpfs: dict[str, bool]
                  ) -> Callable[[Any], Rows]:
    """`training_rows` of `passes` less one configuration's, cached per configuration.

    A training row's target is its configuration's error under the simple model fitted on the
    *other* configurations; with a configuration held out, those other fits must not hold it
    either, or its passes reach the correction through every other row's components.
    """
    cache: dict[Any, Rows] = {}

    def rows(group: Any) -> Rows:
        if group not in cache:
            cache[group] = training_rows([p for p in passes if p.get("config") != group],
                                          all_cores, tmpfs)
        return cache[group]
    return rows


def _loo(kind: str, xs: np.ndarray, y: np.ndarray, groups: np.ndarray,
         rows_without: Callable[[Any], Rows] | None = None) -> float:
    """Mean |log error| of `kind` on each configuration, fitted without it.

    `rows_without`: the training rows rebuilt from the passes without the held-out
    configuration (true leave-one-out); without it, the rows of the others as they are.
    """
    errors = []
    for g in np.unique(groups):
        test = groups == g
        if rows_without is None:
            train_x, train_y = xs[~test], y[~test]
        else:
            train_x, train_y, _, _ = rows_without(g)
        if len(train_y) < 2:
            return math.inf
        model = _regressor(kind).fit(train_x, train_y)
        errors += list(np.abs(model.predict(xs[test]) - y[test]))
    return float(np.mean(errors)) if errors else math.inf


def fit_learned(xs: np.ndarray, y_time: np.ndarray, y_power: np.ndarray | None,
                groups: np.ndarray, rows_without: Callable[[Any], Rows] | None = None
                ) -> LearnedModel:
    """Pick forest or ridge by leave-one-configuration-out error and fit it on every row."""
    try:
        import sklearn  # noqa: F401
    except ImportError as exc:
        raise UsageError("the learned model needs scikit-learn: pip install 'infermux[train]' "
                         "(or pass --method simple)") from exc
    scores = {kind: _loo(kind, xs, y_time, groups, rows_without) for kind in ("ridge", "forest")}
    kind = min(scores, key=lambda k: scores[k])
    time_model = _regressor(kind).fit(xs, y_time)
    power_model = _regressor(kind).fit(xs, y_power) if y_power is not None else None
    return LearnedModel(kind, time_model, power_model, scores[kind], len(y_time))


def training_rows(passes: list[dict[str, Any]], all_cores: int, tmpfs: dict[str, bool]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """Features and targets (log measured/simple) of every profiled pass.

    Each configuration's simple prediction is made without its own passes, so the errors
    learned are the errors the model makes on configurations it has not seen.
    """
    by = by_config(passes)
    xs, yt, yp, groups = [], [], [], []
    powered = all(steady(p) and steady(p)["power"] for p in passes  # type: ignore[index]
                  if p.get("status", "ok") == "ok")
    for cfg, own in by.items():
        others = [p for c, ps in by.items() if c != cfg for p in ps]
        if not others:
            continue
        comps = fit_components(others, all_cores)
        for data in own:
            fig = steady(data)
            if fig is None:
                continue
            knobs = Knobs.from_dict(data["knobs"])
            simple = comps.figures(knobs, data["pass"])
            simple_terms = {f"term_{k}": v for k, v in simple.items() if k != "T"}
            xs.append(features(knobs, data["pass"], {"T": simple["T"], **simple_terms},
                               tmpfs.get(knobs.storage, False)))
            yt.append(math.log(served_step(data, fig, comps.kappa) / simple["T"]))
            power = comps.power_for(knobs, data["pass"], simple)
            yp.append(math.log(fig["power"] / power) if powered and power and fig["power"]
                      else 0.0)
            groups.append(cfg)
    return (np.asarray(xs, float), np.asarray(yt, float),
            np.asarray(yp, float) if powered else None, np.asarray(groups))


def _recal_line(ref: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(a, b) of y = a + b·ref, b in [0, 1]; an offset alone (b = 1) below four rows."""
    if len(y) == 0:
        return 0.0, 1.0
    if len(y) < 4 or np.ptp(ref) < 1e-9:
        return float(np.mean(y - ref)), 1.0
    b = float(np.clip(np.polyfit(ref, y, 1)[0], 0.0, 1.0))  # shrink, never amplify
    return float(np.mean(y - b * ref)), b


def recalibrate(model: LearnedModel, xs: np.ndarray, yt: np.ndarray, yp: np.ndarray | None,
                 groups: np.ndarray | None = None,
                 rows_without: Callable[[Any], Rows] | None = None) -> LearnedModel:
    """Fit new = a + b·reference on the new network's rows, b in [0, 1] (1 with < 4 rows).

    `error` (mean |log error|) is leave-one-configuration-out: each configuration's rows are
    scored by a line fitted without them, on rows rebuilt without its passes
    (`rows_without`); `in_sample_error` is the line's error on the rows it was fitted on, kept
    for comparison only (it flatters the transfer: it chose a and b on those rows).
    """
    if len(yt) == 0:
        model.recalibration = {"time": (0.0, 1.0)}
        return model
    ref_t = model.time_model.predict(xs)
    model.recalibration = {"time": _recal_line(ref_t, yt)}
    a, b = model.recalibration["time"]
    model.recalibration["in_sample_error"] = float(np.mean(np.abs(a + b * ref_t - yt)))
    errors: list[float] = []
    for g in np.unique(groups) if groups is not None else []:
        test = groups == g
        if rows_without is not None:
            train_x, train_y, _, _ = rows_without(g)
            train_ref = model.time_model.predict(train_x) if len(train_y) else np.zeros(0)
        else:
            train_ref, train_y = ref_t[~test], yt[~test]
        ga, gb = _recal_line(train_ref, train_y)
        errors += list(np.abs(ga + gb * ref_t[test] - yt[test]))
    model.recalibration["error"] = float(np.mean(errors)) if errors else math.inf
    model.recalibration["error_kind"] = "leave-one-configuration-out"
    if yp is not None and model.power_model is not None:
        model.recalibration["power"] = _recal_line(model.power_model.predict(xs), yp)
    return model
