"""The machine's drift beside validated epochs, with its own noise.

Beside each validated configuration, what it was predicted from at its own batch is measured
again (`run._validate`): the compute probe of its batch, precision and cores (kind `drift:N`,
its compute per minibatch against the probe's at profile time), else a profiled configuration
of its batch re-profiled (kind `probe:N`), else the run's reference configuration (the first
profiled); the probe's steady per-minibatch time over the figure's is the machine's speed, at
that batch, at that moment. A GPU's launch-bound small-batch step and its compute-bound large
one move differently: the batch-32 reference's drift did not describe batch-128 epochs on an
H200 host (correlation −0.49 with their errors). A probe and a profile each hold a handful of steady
minibatches (3–5 a half on the 2-core CPU and on short GPU epochs), and single minibatches
spread (a coefficient of variation of 0.1–0.25 on the quiet 2-core CPU, 0.15–0.6 with other
processes on it), so the ratio has a noise of its own: two disjoint draws of that many
minibatches from one validated epoch, where the machine cannot have moved between them, differ
by up to 0.86–1.17× (5th–95th percentile) on the quiet CPU, 0.61–1.57× on the loaded one. A
ratio is therefore given with its standard error, and an epoch's prediction is corrected for it
only where it stands out of that noise (`DRIFT_Z` standard errors): corrections by noise made
the corrected MAPE worse than the measured one on the loaded runs.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from infermux.train.steady import steady

__all__ = ["DRIFT_Z", "applied_drift", "compute_drift_scale", "drift_of", "epoch_drift"]

#: A drift is corrected for only where its logarithm is this many standard errors from zero.
DRIFT_Z = 2.0


def _side(passes: list[dict[str, Any]], measure: str = "wall"
          ) -> tuple[float, list[int], list[float]] | None:
    """Mean steady per-minibatch time (s), steady minibatches per pass, their deviations.

    The deviations are each minibatch's from its own pass's mean, relative. The passes' own
    means are averaged (a profile's cold and warm halves count alike, as the predictor reads
    them). `measure`: `wall` (the whole minibatch) or `compute` (the minibatch less its fetch:
    a compute probe's first minibatch holds its batch's loading, the others none).
    """
    means, counts, devs = [], [], []
    for p in passes:
        f = steady(p)
        if not f:
            continue
        body = [(s.get("wall_ns") or (s["fetch_ns"] + s["h2d_ns"] + s["forward_ns"]
                                      + s["backward_ns"] + s["optimizer_ns"]))
                - (s["fetch_ns"] if measure == "compute" else 0)
                for s in p["steps"][int(f["ramp"]):]]
        if not body or min(body) <= 0:
            continue
        means.append(statistics.fmean(body) / 1e9)
        counts.append(len(body))
        mean_ns = statistics.fmean(body)
        devs += [w / mean_ns - 1.0 for w in body]
    if not means:
        return None
    return statistics.fmean(means), counts, devs


def drift_of(label: str, before: list[dict[str, Any]], after: list[dict[str, Any]],
             measure: str = "wall") -> dict[str, Any] | None:
    """Steady per-minibatch time of a profile and of its probe, their ratio and its noise.

    `before`, `after`: the passes' data. The spread of single minibatches is pooled over the
    profile and the probe (the same configuration; three to five minibatches a pass give no
    spread of their own worth the name): `cv`, their coefficient of variation about their own
    pass's mean. Each side's mean has a relative standard error of `cv` over its minibatches
    (`before_rel_se`, `after_rel_se`); `se_log`, that of the ratio's logarithm, is both
    together.
    """
    b, a = _side(before, measure), _side(after, measure)
    if b is None or a is None or len(b[1]) != len(a[1]):
        return None
    devs = b[2] + a[2]
    dof = len(devs) - len(b[1]) - len(a[1])  # one mean fitted per pass
    ratio = a[0] / b[0] if b[0] else None
    if dof <= 0:
        # One minibatch a pass (a compute probe where the epoch allowed no more): no spread to
        # measure the noise by, so the ratio is never taken as resolved (`epoch_drift`).
        return {"label": label, "measure": measure, "before_ms": b[0] * 1e3,
                "after_ms": a[0] * 1e3, "ratio": ratio, "cv": None, "se_log": None,
                "before_rel_se": None, "after_rel_se": None, "before_steps": sum(b[1]),
                "after_steps": sum(a[1])}
    cv = math.sqrt(sum(d * d for d in devs) / dof)

    def rel_se(counts: list[int]) -> float:
        return cv * math.sqrt(sum(1 / n for n in counts if n)) / len(counts)

    rel_b, rel_a = rel_se(b[1]), rel_se(a[1])
    return {"label": label, "measure": measure, "before_ms": b[0] * 1e3, "after_ms": a[0] * 1e3,
            "ratio": ratio, "cv": cv,
            "se_log": math.hypot(rel_b, rel_a), "before_rel_se": rel_b, "after_rel_se": rel_a,
            "before_steps": sum(b[1]), "after_steps": sum(a[1])}


def epoch_drift(around: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One validated epoch's drift from the probes around it (`drift_of`'s results).

    The geometric mean of their ratios; its standard error counts the profile's once (every
    probe is divided by the same profile) and the probes' own over their number. `resolved`:
    the drift stands `DRIFT_Z` standard errors out of its noise, and only then is the epoch's
    prediction scaled by it (`applied_drift`).
    """
    good = [g for g in around if g and g.get("ratio")]
    if not good:
        return None
    k = len(good)
    log_r = statistics.fmean(math.log(g["ratio"]) for g in good)
    if any(g.get("se_log") is None for g in good):
        # Its noise could not be measured: reported, never corrected for.
        return {"drift": math.exp(log_r), "drift_se": None, "drift_resolved": False}
    se = math.sqrt(good[0]["before_rel_se"] ** 2
                   + sum(g["after_rel_se"] ** 2 for g in good) / k ** 2)
    return {"drift": math.exp(log_r), "drift_se": se,
            "drift_resolved": abs(log_r) > DRIFT_Z * se}


def applied_drift(measured: dict[str, Any]) -> float | None:
    """The factor an epoch's prediction is scaled by for drift.

    Its drift where resolved (or stored before the noise was), 1 where within its noise, None
    where none was measured. Where the drift moves the compute term alone (`drift_epoch`,
    `compute_drift_scale`), the epoch moves by that term's share of it, not by all of it.
    """
    drift = measured.get("drift")
    if not drift:
        return None
    if not measured.get("drift_resolved", True):
        return 1.0
    return float(measured.get("drift_epoch") or drift)


def compute_drift_scale(model: dict[str, Any], drift: float, workers: int) -> float:
    """How much an epoch moves when its compute term alone moves by `drift`.

    `model`: the simple model's prediction of the epoch (`Components.predict`: `epoch_s`,
    `start_s`, the steady minibatch `T` and its terms). On a GPU a compute probe times the
    device's step (its minibatches less their fetch), while the loader and the training
    process's CPU run on the host: a device that slowed by 30% does not slow an epoch its
    loader bounds. With loader workers the steady minibatch is the largest of its terms
    (`Components.figures`), so it becomes max(compute × drift, loader, cores); without them
    the terms take turns and the compute adds. The start-up's own first minibatch is left
    as predicted.
    """
    t, start, step = model["epoch_s"], model["start_s"], model["T"]
    compute = model.get("term_compute")
    if not t or t <= 0 or not step or step <= 0 or compute is None:
        return drift
    if workers > 0:
        others = [model.get(f"term_{k}") or 0.0 for k in ("loader", "cores")]
        moved = max([compute * drift, *others])
    else:
        moved = step + compute * (drift - 1.0)
    body = (t - start) / step
    return (start + body * moved) / t
