"""Predicting a configuration's epoch time and energy from short profiles of a few configurations.

Three layers, each used where the one before misses:

1. **Profile** (a configuration that was profiled): its own minibatches × the minibatches of an
   epoch. The first `r` minibatches of a pass (r = loader workers, at least 1) fill the loader's
   pipeline and are taken as measured; the rest give the steady minibatch time `T`, which already
   holds the fetch/compute overlap the loader achieved:
   epoch = startup + ramp + (N − r − 1)·T + T·(items of the last batch / B) + tail.
   The cold pass predicts the first epoch (data read from its medium), the warm pass later ones
   (page cache). Energy = the pass's mean power × the predicted time. Bounds: the steady time's
   95% interval (its standard error × the minibatches it multiplies).
2. **Simple** (any configuration, from components of the profiled ones): compute per minibatch
   C(B) = a + b·B per (cores, precision), its CPU seconds κ(B) likewise; the loader's CPU time ℓ
   and read time ρ per item per (storage, pass); the main process's cost of receiving a batch
   from a worker q per item. The steady minibatch is
   - no workers: T = B·(ℓ + ρ) + C(B) (loading and training take turns);
   - w workers: T = max(C(B) + q·B, B·(ℓ + ρ)/w, (κ(B) + B·ℓ)/n + q·B): the compute, the
     loader (w workers in parallel) or the n cores (training and decoding share them),
     whichever is the bottleneck. Startup, tail and ramp come from profiled passes with the same workers.
3. **Learned** (scikit-learn): the simple model's log error, learned across the profiled
   configurations from the knobs and the simple model's bottleneck ratios (a random forest or a
   ridge regression, whichever has the lower leave-one-out error), for time and for power. A
   model fitted on a reference network's profiles **transfers** to a new network: the new
   network's components feed the same features and a ridge regression on its few profiles
   recalibrates the reference's correction (after PowerTrain, which transfers a reference
   workload's learned time and power model to a new one from a few dozen profiled modes).

Which of simple and learned is used for the unprofiled configurations is decided by their
leave-one-configuration-out error over the profiled ones; bounds of those predictions are the
95% band of that error.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infermux.errors import UsageError
from infermux.train.knobs import Knobs

__all__ = [
    "Components",
    "LearnedModel",
    "Prediction",
    "choose_profiled",
    "fit_components",
    "mape",
    "predict_all",
    "profile_estimate",
    "steady",
]

PASSES = ("cold", "warm")
EPOCH_OF = {"cold": "first", "warm": "later"}


def _walls(steps: list[dict[str, Any]]) -> list[int]:
    return [s.get("wall_ns") or (s["fetch_ns"] + s["h2d_ns"] + s["forward_ns"]
                                  + s["backward_ns"] + s["optimizer_ns"]) for s in steps]


def steady(data: dict[str, Any]) -> dict[str, float] | None:
    """A pass's ramp and steady state: T, its standard error, fetch, loader figures (s, per item)."""
    steps = data.get("steps") or []
    if data.get("status", "ok") != "ok" or not steps:
        return None
    workers = data["knobs"]["workers"]
    ramp = min(len(steps) - 1, max(1, workers)) if len(steps) > 2 else min(1, len(steps) - 1)
    walls = _walls(steps)
    body = walls[ramp:] or walls
    mean = statistics.fmean(body) / 1e9
    se = (statistics.stdev(body) / math.sqrt(len(body)) / 1e9) if len(body) > 1 else mean * 0.1
    fetch = statistics.fmean(s["fetch_ns"] for s in steps[ramp:] or steps) / 1e9
    items = sum(s["items"] for s in steps)
    return {
        "T": mean, "se": se, "ramp": ramp, "ramp_s": sum(walls[:ramp]) / 1e9,
        "fetch": fetch, "compute": mean - fetch, "items": items, "steps": len(steps),
        "load_cpu": sum(s["load_cpu_ns"] for s in steps) / items / 1e9 if items else 0.0,
        "load_wall": sum(s["load_ns"] for s in steps) / items / 1e9 if items else 0.0,
        "read": sum(s["read_ns"] for s in steps) / items / 1e9 if items else 0.0,
        "cpu_per_step": (data.get("cpu_s") or 0.0) / len(steps),
        "overhead": (data.get("startup_ns", 0) + data.get("tail_ns", 0)) / 1e9,
        "power": (data["energy_j"] / (data["wall_ns"] / 1e9)
                  if data.get("energy_j") and data.get("wall_ns") else None),
    }


def _epoch_steps(items: int, batch: int) -> tuple[int, float]:
    """(minibatches in an epoch, share of a full batch that the last one holds)."""
    n = math.ceil(items / batch)
    last = items - (n - 1) * batch
    return n, last / batch


def _epoch_time(step: float, overhead: float, ramp: int, ramp_s: float, items: int, batch: int
                ) -> float:
    n, last = _epoch_steps(items, batch)
    ramp = min(ramp, n)
    body = max(0, n - ramp - 1) + (last if n > ramp else 0.0)
    return overhead + ramp_s * (min(ramp, n) / ramp if ramp else 0) + body * step


def profile_estimate(passes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Epoch time and energy of one profiled configuration from its own minibatches."""
    out: dict[str, Any] = {}
    for data in passes:
        fig = steady(data)
        if fig is None:
            continue
        items, batch = data["dataset_items"], data["knobs"]["batch"]
        if data.get("kind") == "epoch":
            t = data["wall_ns"] / 1e9
            band = 0.0
        else:
            t = _epoch_time(fig["T"], fig["overhead"], int(fig["ramp"]), fig["ramp_s"], items,
                            batch)
            n, _ = _epoch_steps(items, batch)
            band = 1.96 * fig["se"] * max(0, n - fig["ramp"])
        epoch = EPOCH_OF[data["pass"]]
        out[f"{epoch}_s"] = t
        out[f"{epoch}_low_s"], out[f"{epoch}_high_s"] = max(0.0, t - band), t + band
        if fig["power"] is not None:
            out[f"{epoch}_energy_j"] = fig["power"] * t
            rel = band / t if t else 0.0
            out[f"{epoch}_energy_low_j"] = fig["power"] * t * (1 - rel)
            out[f"{epoch}_energy_high_j"] = fig["power"] * t * (1 + rel)
            out["energy_source"] = data.get("energy_source")
    return out if "first_s" in out and "later_s" in out else None


# -- the simple model: components of the profiled configurations -------------------------------


def _ncores(knobs: dict[str, Any], all_cores: int) -> int:
    return len(knobs["cores"]) if knobs.get("cores") else all_cores


def _linfit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a + b·x by least squares; a line through the origin for one point."""
    if len(set(xs)) < 2:
        x = statistics.fmean(xs)
        return 0.0, statistics.fmean(ys) / x if x else 0.0
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    if a < 0:  # a negative intercept is noise: refit through the origin
        return 0.0, float(np.dot(xs, ys) / np.dot(xs, xs))
    return float(a), float(b)


@dataclass
class Components:
    """The simple model's parts, fitted on profiled passes (see the module docstring)."""

    compute: dict[tuple[int, str], tuple[float, float]]
    cpu: dict[tuple[int, str], tuple[float, float]]
    loader: dict[tuple[str, str], tuple[float, float]]  # (storage, pass) → (ℓ, ρ) per item
    ipc: float
    #: (workers, persistent, pass) → (startup + tail, ramp excess in minibatch times)
    overhead: dict[tuple[int, bool, str], tuple[float, float]]
    power: dict[tuple[Any, ...], float]
    all_cores: int

    def _group(self, table: dict[Any, Any], key: tuple[Any, ...]) -> Any:
        if key in table:
            return table[key]
        # Same precision, the nearest core count; then anything, scaled by cores.
        same = [k for k in table if k[1] == key[1]] or list(table)
        near = min(same, key=lambda k: abs(k[0] - key[0]))
        a, b = table[near]
        scale = near[0] / key[0] if isinstance(near[0], int) and key[0] else 1.0
        return (a * scale, b * scale) if table is self.compute else (a, b)

    def figures(self, knobs: Knobs, pass_name: str) -> dict[str, float]:
        """The steady minibatch time and its terms for one configuration and pass."""
        n = _ncores(knobs.to_dict(), self.all_cores)
        key = (n, knobs.precision)
        a, b = self._group(self.compute, key)
        compute = a + b * knobs.batch
        ca, cb = self._group(self.cpu, key)
        kappa = max(compute * 0.5, ca + cb * knobs.batch)
        loader = self.loader.get((knobs.storage, pass_name)) or self.loader.get(
            (knobs.storage, "warm")) or next(iter(self.loader.values()))
        ell, rho = loader
        batch, w = knobs.batch, knobs.workers
        if w == 0:
            step = batch * (ell + rho) + compute
            terms = {"compute": compute, "loader": batch * (ell + rho), "cores": step}
        else:
            terms = {"compute": compute + self.ipc * batch, "loader": batch * (ell + rho) / w,
                     "cores": (kappa + batch * ell) / n + self.ipc * batch}
            step = max(terms.values())
        return {"T": step, **terms, "kappa": kappa, "n": n}

    def overhead_for(self, knobs: Knobs, pass_name: str) -> tuple[float, float]:
        """(startup + tail, ramp excess in minibatch times) from the nearest profiled workers."""
        keys = [k for k in self.overhead if k[2] == pass_name] or list(self.overhead)
        persist = knobs.persistent_workers and knobs.workers > 0
        exact = [k for k in keys if k[0] == knobs.workers and k[1] == persist]
        near = exact or sorted(keys, key=lambda k: (abs(k[0] - knobs.workers), k[1] != persist))
        return self.overhead[near[0]]

    def power_for(self, knobs: Knobs, pass_name: str) -> float | None:
        """Mean power of the profiled passes most like this configuration."""
        n = _ncores(knobs.to_dict(), self.all_cores)
        for key in ((knobs.batch, n, knobs.precision, knobs.workers > 0, pass_name),
                    (n, knobs.precision, knobs.workers > 0), (n, knobs.precision), ()):
            if key in self.power:
                return self.power[key]
        return None

    def predict(self, knobs: Knobs, pass_name: str, items: int) -> dict[str, float]:
        """Epoch time (and energy, where power is known) of one configuration and pass."""
        fig = self.figures(knobs, pass_name)
        overhead, excess = self.overhead_for(knobs, pass_name)
        n, last = _epoch_steps(items, knobs.batch)
        t = overhead + fig["T"] * (max(0, n - 1) + last + excess)
        power = self.power_for(knobs, pass_name)
        terms = {f"term_{k}": v for k, v in fig.items() if k != "T"}
        return {"epoch_s": t, "T": fig["T"], "power": power, **terms}  # type: ignore[dict-item]


def fit_components(passes: list[dict[str, Any]], all_cores: int) -> Components:
    """The simple model's components from profiled passes (status ok)."""
    compute: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    cpu: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    loader: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    overhead: dict[tuple[int, bool, str], list[tuple[float, float]]] = defaultdict(list)
    power: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    ipc: list[float] = []
    for data in passes:
        fig = steady(data)
        if fig is None:
            continue
        k = data["knobs"]
        n, batch, w = _ncores(k, all_cores), k["batch"], k["workers"]
        # With workers, the compute phase holds the contention with them; it is what the
        # step costs beside the loader.
        compute[(n, k["precision"])].append((batch, max(1e-6, fig["compute"])))
        cpu[(n, k["precision"])].append(
            (batch, max(1e-6, fig["cpu_per_step"] - batch * fig["load_cpu"])))
        loader[(k["storage"], data["pass"])].append(
            (fig["load_cpu"], max(0.0, fig["read"] - 0.0)))
        excess = (fig["ramp_s"] / fig["T"] - fig["ramp"]) if fig["T"] else 0.0
        overhead[(w, bool(k.get("persistent_workers")) and w > 0, data["pass"])].append(
            (fig["overhead"], excess))
        if fig["power"] is not None:
            for key in ((batch, n, k["precision"], w > 0, data["pass"]), (n, k["precision"], w > 0),
                        (n, k["precision"]), ()):
                power[key].append(fig["power"])
    if not compute:
        raise UsageError("no profiled configuration measured any minibatch: nothing to predict "
                         "from; check the errors of the profile run")
    comps = Components(
        compute={g: _linfit([x for x, _ in v], [y for _, y in v]) for g, v in compute.items()},
        cpu={g: _linfit([x for x, _ in v], [y for _, y in v]) for g, v in cpu.items()},
        loader={g: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
                for g, v in loader.items()},
        ipc=0.0,
        overhead={g: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
                  for g, v in overhead.items()},
        power={g: statistics.fmean(v) for g, v in power.items()},
        all_cores=all_cores,
    )
    # Receiving a batch from a worker: what the steady minibatch takes beyond the model's
    # bottleneck, per item (the median over passes with workers).
    for data in passes:
        fig = steady(data)
        if fig is not None and data["knobs"]["workers"] > 0:
            knobs = Knobs.from_dict(data["knobs"])
            ipc.append(max(0.0, fig["T"] - comps.figures(knobs, data["pass"])["T"]) / knobs.batch)
    comps.ipc = statistics.median(ipc) if ipc else 0.0
    return comps


# -- the learned model ---------------------------------------------------------------------------


def _features(knobs: Knobs, pass_name: str, simple: dict[str, float], fs_tmpfs: bool
              ) -> list[float]:
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
        if self.recalibration:
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


def _loo(kind: str, xs: np.ndarray, y: np.ndarray, groups: np.ndarray) -> float:
    errors = []
    for g in np.unique(groups):
        train, test = groups != g, groups == g
        if train.sum() < 2:
            return math.inf
        model = _regressor(kind).fit(xs[train], y[train])
        errors += list(np.abs(model.predict(xs[test]) - y[test]))
    return float(np.mean(errors)) if errors else math.inf


def fit_learned(xs: np.ndarray, y_time: np.ndarray, y_power: np.ndarray | None,
                groups: np.ndarray) -> LearnedModel:
    """Pick forest or ridge by leave-one-configuration-out error and fit it on every row."""
    try:
        import sklearn  # noqa: F401
    except ImportError as exc:
        raise UsageError("the learned model needs scikit-learn: pip install 'infermux[train]' "
                         "(or pass --method simple)") from exc
    scores = {kind: _loo(kind, xs, y_time, groups) for kind in ("ridge", "forest")}
    kind = min(scores, key=lambda k: scores[k])
    time_model = _regressor(kind).fit(xs, y_time)
    power_model = _regressor(kind).fit(xs, y_power) if y_power is not None else None
    return LearnedModel(kind, time_model, power_model, scores[kind], len(y_time))


# -- choosing the configurations to profile ----------------------------------------------------


def _levels(knobs: Knobs) -> tuple[Any, ...]:
    return (knobs.batch, knobs.workers, knobs.prefetch_factor, knobs.pin_memory,
            knobs.persistent_workers, knobs.storage, knobs.cores, knobs.precision)


def choose_profiled(configs: list[Knobs], count: int) -> list[int]:
    """`count` configurations that cover every pair of knob levels as far as they can.

    Greedy pairwise coverage (a covering array, the usual design for few runs over many
    factors), ties broken by the distance to the configurations chosen so far, then grid order.
    """
    count = max(1, min(count, len(configs)))
    levels = [_levels(k) for k in configs]
    factors = range(len(levels[0]))
    ordinal = [sorted({lv[f] for lv in levels}, key=str) for f in factors]

    def pairs(lv: tuple[Any, ...]) -> set[tuple[int, Any, int, Any]]:
        return {(f, lv[f], g, lv[g]) for f in factors for g in factors if f < g}

    def distance(a: tuple[Any, ...], b: tuple[Any, ...]) -> float:
        return sum(abs(ordinal[f].index(a[f]) - ordinal[f].index(b[f])) / max(1, len(ordinal[f]) - 1)
                   for f in factors)

    chosen: list[int] = []
    covered: set[tuple[int, Any, int, Any]] = set()
    while len(chosen) < count:
        best, best_score = None, (-1.0, -1.0)
        for i, lv in enumerate(levels):
            if i in chosen:
                continue
            gain = len(pairs(lv) - covered)
            spread = min((distance(lv, levels[j]) for j in chosen), default=0.0)
            if (gain, spread) > best_score:
                best, best_score = i, (gain, spread)
        assert best is not None
        chosen.append(best)
        covered |= pairs(levels[best])
    return sorted(chosen)


# -- predicting every configuration -------------------------------------------------------------


@dataclass
class Prediction:
    """One configuration's predicted first and later epoch, and what was measured."""

    config: int
    knobs: Knobs
    profiled: bool
    method: str
    epochs: dict[str, dict[str, float | None]]  # first/later → predicted_s, low_s, high_s, ...
    measured: dict[str, dict[str, float | None]] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        """One row per epoch kind, for the store and JSON."""
        out = []
        for epoch, fig in self.epochs.items():
            meas = self.measured.get(epoch, {})
            out.append({"config": self.config, "label": self.knobs.label, "epoch": epoch,
                        "method": self.method, "profiled": self.profiled, **fig,
                        "measured_s": meas.get("s"), "measured_energy_j": meas.get("energy_j"),
                        "knobs": self.knobs.to_dict()})
        return out


def mape(pairs: list[tuple[float | None, float | None]]) -> float | None:
    """Mean absolute percentage error of (predicted, measured) pairs, %."""
    good = [(p, m) for p, m in pairs if p is not None and m]
    if not good:
        return None
    return 100.0 * statistics.fmean(abs(p - m) / m for p, m in good)


def _band(value: float | None, log_err: float) -> tuple[float | None, float | None]:
    if value is None:
        return None, None
    factor = math.exp(1.96 * log_err)
    return value / factor, value * factor


def _group(passes: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    by: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for p in passes:
        if p.get("status", "ok") == "ok":
            by[p["config"]].append(p)
    return by


def _training_rows(passes: list[dict[str, Any]], all_cores: int, tmpfs: dict[str, bool]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """Features and targets (log measured/simple) of every profiled pass.

    Each configuration's simple prediction is made without its own passes, so the errors
    learned are the errors the model makes on configurations it has not seen.
    """
    by = _group(passes)
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
            xs.append(_features(knobs, data["pass"], {"T": simple["T"], **simple_terms},
                               tmpfs.get(knobs.storage, False)))
            yt.append(math.log(fig["T"] / simple["T"]))
            power = comps.power_for(knobs, data["pass"])
            yp.append(math.log(fig["power"] / power) if powered and power and fig["power"]
                      else 0.0)
            groups.append(cfg)
    return (np.asarray(xs, float), np.asarray(yt, float),
            np.asarray(yp, float) if powered else None, np.asarray(groups))


def predict_all(configs: list[Knobs], passes: list[dict[str, Any]], *, items: int,
                all_cores: int, tmpfs: dict[str, bool], method: str = "auto",
                reference: list[dict[str, Any]] | None = None) -> tuple[list[Prediction],
                                                                         dict[str, Any]]:
    """Predict every configuration's epochs from the profiled passes; (predictions, model info).

    `method`: `auto` (learned where its leave-one-out error beats the simple model's), `simple`
    or `learned`. `reference`: passes of another network; the learned model is fitted on them
    and recalibrated on `passes` (transfer).
    """
    by = _group(passes)
    comps = fit_components(passes, all_cores)
    info: dict[str, Any] = {"profiled": sorted(by), "method": method}
    # Leave-one-configuration-out error of the simple model (log scale).
    xs, yt, yp, groups = _training_rows(passes, all_cores, tmpfs)
    simple_loo = float(np.mean(np.abs(yt))) if len(yt) else math.inf
    info["simple_loo_mape_pct"] = 100 * (math.exp(simple_loo) - 1) if len(yt) else None
    learned: LearnedModel | None = None
    if method != "simple" and reference:
        ref_x, ryt, ryp, rgroups = _training_rows(reference, all_cores, tmpfs)
        if len(ryt) >= 3:
            learned = fit_learned(ref_x, ryt, ryp, rgroups)
            learned = _recalibrate(learned, xs, yt, yp)
            info["transfer"] = {"reference_rows": len(ryt), "kind": learned.kind,
                                **learned.recalibration}
    elif method != "simple" and len(np.unique(groups)) >= 3:
        learned = fit_learned(xs, yt, yp, groups)
    use_learned = learned is not None and (method == "learned" or learned.loo_time < simple_loo
                                           or bool(reference))
    if learned is not None:
        info["learned"] = {"kind": learned.kind, "rows": learned.rows,
                           "loo_mape_pct": 100 * (math.exp(learned.loo_time) - 1)}
    err = learned.loo_time if use_learned and learned is not None else simple_loo
    err = err if math.isfinite(err) else 0.25
    info["chosen"] = ("transfer" if reference else "learned") if use_learned else "simple"
    predictions = []
    for i, knobs in enumerate(configs):
        own = by.get(i)
        estimate = profile_estimate(own) if own else None
        if estimate is not None:
            epochs = {e: {"predicted_s": estimate[f"{e}_s"], "low_s": estimate[f"{e}_low_s"],
                          "high_s": estimate[f"{e}_high_s"],
                          "predicted_energy_j": estimate.get(f"{e}_energy_j"),
                          "energy_low_j": estimate.get(f"{e}_energy_low_j"),
                          "energy_high_j": estimate.get(f"{e}_energy_high_j")}
                      for e in ("first", "later")}
            predictions.append(Prediction(i, knobs, True, "profile", epochs))
            continue
        epochs = {}
        for pass_name in PASSES:
            simple = comps.predict(knobs, pass_name, items)
            t, power = simple["epoch_s"], simple["power"]
            if use_learned and learned is not None:
                lt, lp = learned.correction(_features(knobs, pass_name, simple,
                                                      tmpfs.get(knobs.storage, False)))
                t *= math.exp(lt)
                power = power * math.exp(lp) if power is not None else None
            energy = power * t if power is not None else None
            low, high = _band(t, err)
            e_low, e_high = _band(energy, err)
            epochs[EPOCH_OF[pass_name]] = {"predicted_s": t, "low_s": low, "high_s": high,
                                           "predicted_energy_j": energy, "energy_low_j": e_low,
                                           "energy_high_j": e_high}
        predictions.append(Prediction(i, knobs, False, info["chosen"], epochs))
    return predictions, info


def _recalibrate(model: LearnedModel, xs: np.ndarray, yt: np.ndarray, yp: np.ndarray | None
                 ) -> LearnedModel:
    """Fit new = a + b·reference on the new network's rows (b = 1 with fewer than 4 rows)."""
    if len(yt) == 0:
        model.recalibration = {"time": (0.0, 1.0)}
        return model
    ref_t = model.time_model.predict(xs)

    def fit(ref: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        if len(y) < 4 or np.ptp(ref) < 1e-9:
            return float(np.mean(y - ref)), 1.0
        b, a = np.polyfit(ref, y, 1)
        return float(a), float(b)

    model.recalibration = {"time": fit(ref_t, yt)}
    if yp is not None and model.power_model is not None:
        model.recalibration["power"] = fit(model.power_model.predict(xs), yp)
    return model
