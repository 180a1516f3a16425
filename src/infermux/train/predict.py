"""Predicting a configuration's epoch time and energy from short profiles of a few configurations.

An epoch is modelled as **start-up + ramp + steady minibatches + tail**:

- start-up `S`: building the loader's iterator (starting its worker processes);
- ramp: the first `r` minibatches (r = loader workers, at least 1), whose first fetch is the time
  to the first minibatch `F` (one worker making a whole batch: B × the loader's time per item,
  plus the workers' own start) and whose others arrive from the workers' head start;
- steady: the other N − r minibatches at the steady minibatch time `T` (the mean of a profile's
  minibatches after the ramp; it holds the fetch/compute overlap the loader achieved), the last,
  partial one in proportion to its items;
- tail: the last fetch that finds the epoch over, and stopping the workers.

The first epoch reads data from its medium (a profile's **cold** part, after the data set's pages
were dropped from the page cache), later epochs from the page cache (its **warm** part).

Three layers, each used where the one before misses:

1. **Profile** (a configuration that was profiled): its own start-up, ramp, steady time and
   tail. A profile is one pass over a random subset twice over: the first half cold, the second
   (the same files again) warm, so the loader starts once and the later epoch's start-up is the
   first's less the files' read time. Energy = the part's mean power × the predicted time. Error
   bars: the steady time's 95% interval (from the spread of its minibatches, in blocks of `r` so
   the workers' rhythm is averaged) × the minibatches it multiplies, and the start-up's share.
2. **Simple** (any configuration, from components of the profiled ones): compute per minibatch
   C(B) = a + b·B per (cores, precision) (from passes without workers where workers would
   share the cores), the training's CPU seconds κ(B) likewise (fitted with a CPU cost per
   worker started, which no steady minibatch has); the loader's CPU time ℓ, wall time λ and
   read time ρ per item per (storage, part, with or without workers), from the steady
   minibatches; the main process's cost of receiving a batch from a worker q per item. The
   steady minibatch is
   - no workers: T = B·(ℓ + ρ) + C(B) (loading and training take turns);
   - w workers: T = max(C(B) + q·B, κ_L·B·(ℓ + ρ)/w, (κ(B) + B·ℓ)/n): the compute, the
     loader (w workers in parallel, each cycle κ_L times its items' decoding and reading:
     collating and handing the batch over; κ_L from the loader-bound profiles, or the
     reference network's) or the n cores (training and decoding share them), whichever is
     the bottleneck.
   Start-up and tail are lines in the workers (a + b·w: a process per worker to start and
   stop), the time to the first minibatch is B·λ + the workers' start (from the profiled
   configurations with the nearest workers), the rest of the ramp is in steady minibatches.
   Energy, where a counter measured it, is E = P0·t + N·(a_p + b_p·B): a static power over
   the wall time (the device waiting on start-up or its loader still draws it) and a dynamic
   energy per minibatch per precision, or per item (a_p = 0), whichever predicts the profiled
   passes better left one out (`_fit_energy`); else
   power is a line in the busy share, or the mean power of the profiled passes most like the
   configuration. A profiled configuration whose steady part was served from the loader's
   queue (fewer than two rounds of w × prefetch batches) takes the loader's rate where it is
   slower (`_queue_correction`).
3. **Learned** (scikit-learn): the simple model's log error, learned across the profiled
   configurations from the knobs and the simple model's bottleneck ratios (a random forest or a
   ridge regression, whichever has the lower leave-one-out error), for time and for power. A
   model fitted on a reference network's profiles **transfers** to a new network: the new
   network's components feed the same features and its few profiles recalibrate the reference's
   correction (after PowerTrain, which transfers a reference workload's learned time and power
   model to a new one from a few dozen profiled modes); the recalibration's slope is held in
   [0, 1], so a reference's correction is shrunk, never amplified.

Which of simple and learned is used for the unprofiled configurations is decided by their
leave-one-configuration-out error over the profiled ones (the learned model must beat the simple
one by a fifth); bounds of those predictions are the 95% band of that error.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infermux.errors import UsageError
from infermux.train.knobs import Knobs

__all__ = [
    "MIN_STEADY_STEPS",
    "Components",
    "LearnedModel",
    "Prediction",
    "choose_profiled",
    "covered",
    "covering_order",
    "fit_components",
    "mape",
    "predict_all",
    "profile_estimate",
    "steady",
    "warmup_steps",
]

PASSES = ("cold", "warm")
EPOCH_OF = {"cold": "first", "warm": "later"}
#: The steady part of a profile's cold and warm halves: at least this many minibatches after the
#: ramp each, where the profile share of an epoch allows it (a shorter one is flagged).
MIN_STEADY_STEPS = 8
#: The learned model replaces the simple one only if its leave-one-out error is this much smaller.
LEARNED_MARGIN = 0.8
#: ... and (with `auto`) only from this many profiled configurations: a correction of a dozen
#: features learned from fewer won its leave-one-out comparison by chance on the stored runs.
LEARNED_MIN_CONFIGS = 10


def warmup_steps(workers: int) -> int:
    """Minibatches of a pass's ramp: one per loader worker, at least one."""
    return max(1, workers)


#: Share of a profile's steady minibatches left out at each end of their compute times
#: (`_robust_compute`).
COMPUTE_TRIM = 0.1


def _robust_compute(walls: list[int], steps: list[dict[str, Any]]) -> float:
    """A steady minibatch's time beside its fetch (s): the mean of the middle 80%.

    A profile has a few dozen steady minibatches, and a host's rare stall (a collection, a
    page fault storm) lands in one of them as a step several times the others (a 91 ms step
    among 11–20 ms ones in a ResNet18 profile on an H100 host): in the mean of twenty it moves
    the compute line by a third, in an epoch of hundreds it is what it is, rare. The fetch
    stays a plain mean: a loader-bound minibatch's wait is skewed by its nature (every w-th
    one waits for the next round of workers), not by accident.
    """
    comp = sorted(w - s["fetch_ns"] for w, s in zip(walls, steps, strict=True))
    k = int(len(comp) * COMPUTE_TRIM)
    return statistics.fmean(comp[k:len(comp) - k] or comp) / 1e9


def _walls(steps: list[dict[str, Any]]) -> list[int]:
    return [s.get("wall_ns") or (s["fetch_ns"] + s["h2d_ns"] + s["forward_ns"]
                                  + s["backward_ns"] + s["optimizer_ns"]) for s in steps]


def _block_se(values: list[int] | list[float], block: int) -> float:
    """Standard error of the mean of `values`, from means of blocks of `block` (≥ 2 blocks)."""
    block = max(1, block)
    blocks = [statistics.fmean(values[i:i + block]) for i in range(0, len(values) - block + 1,
                                                                      block)]
    if len(blocks) >= 2:
        return statistics.stdev(blocks) / math.sqrt(len(blocks))
    if len(values) >= 2:
        return statistics.stdev(values) / math.sqrt(len(values))
    return abs(statistics.fmean(values)) * 0.1 if values else 0.0


def steady(data: dict[str, Any]) -> dict[str, float] | None:
    """A pass's start-up, ramp and steady state (s, per minibatch or per item).

    The warm half of a split profile continues the cold half's loader: it has no start-up and
    no ramp of its own (its first minibatches were prefetched during the cold half), so all its
    minibatches are steady.
    """
    steps = data.get("steps") or []
    if data.get("status", "ok") != "ok" or not steps:
        return None
    workers = data["knobs"]["workers"]
    # A compute probe follows its batch size's warm-up and has no loader workers: no ramp.
    continued = (bool(data.get("split")) and data["pass"] == "warm") or \
        data.get("kind") == "compute"
    ramp = 0 if continued else min(len(steps) - 1, warmup_steps(workers))
    walls = _walls(steps)
    body = walls[ramp:] or walls
    mean = statistics.fmean(body) / 1e9
    se = _block_se(body, warmup_steps(workers)) / 1e9
    fetch = statistics.fmean(s["fetch_ns"] for s in steps[ramp:] or steps) / 1e9
    items = sum(s["items"] for s in steps)
    batch = data["knobs"]["batch"]
    load_wall = sum(s["load_ns"] for s in steps) / items / 1e9 if items else 0.0
    # The loader's per-item costs from the steady minibatches: a fresh worker's first items
    # (imports, page faults, allocator) are slower than the epoch's.
    body_steps = steps[ramp:] or steps
    body_items = sum(s["items"] for s in body_steps) or 1
    first = steps[0]["fetch_ns"] / 1e9
    return {
        "T": mean, "se": se, "ramp": ramp, "ramp_s": sum(walls[:ramp]) / 1e9,
        "first_fetch": first, "first_extra": first - batch * load_wall,
        "first_compute": (walls[0] - steps[0]["fetch_ns"]) / 1e9,
        # The ramp's minibatches after the first, in steady minibatches (and per minibatch).
        "rest": (sum(walls[1:ramp]) / 1e9 / mean) if ramp > 1 and mean else 0.0,
        "rest_per": (sum(walls[1:ramp]) / 1e9 / mean / (ramp - 1)) if ramp > 1 and mean
        else 1.0,
        "fetch": fetch, "compute": _robust_compute(walls[ramp:] or walls, steps[ramp:] or steps),
        "items": items, "steps": len(steps),
        "steady_steps": len(body),
        "load_cpu": sum(s["load_cpu_ns"] for s in body_steps) / body_items / 1e9,
        "load_wall": load_wall,
        "load_wall_steady": sum(s["load_ns"] for s in body_steps) / body_items / 1e9,
        "read": sum(s["read_ns"] for s in body_steps) / body_items / 1e9,
        "wall": data.get("wall_ns", 0) / 1e9,
        "cpu_per_step": (data.get("cpu_s") or 0.0) / len(steps),
        # The steady minibatches' own CPU time (read at the ramp's end and the last minibatch's):
        # no worker start-up, ramp or tail in it. None for passes stored without it.
        "steady_cpu_per_step": (data["steady_cpu_s"] / len(body)
                                if data.get("steady_cpu_s") is not None and body else None),
        "startup": data.get("startup_ns", 0) / 1e9, "tail": data.get("tail_ns", 0) / 1e9,
        "overhead": (data.get("startup_ns", 0) + data.get("tail_ns", 0)) / 1e9,
        "power": (data["energy_j"] / (data["wall_ns"] / 1e9)
                  if data.get("energy_j") and data.get("wall_ns") else None),
    }


def _epoch_steps(items: int, batch: int) -> tuple[int, float]:
    """(minibatches in an epoch, share of a full batch that the last one holds)."""
    n = math.ceil(items / batch)
    last = items - (n - 1) * batch
    return n, last / batch


def _body(items: int, batch: int, ramp: int) -> float:
    """Steady minibatches of an epoch after `ramp`, the last, partial one in proportion."""
    n, last = _epoch_steps(items, batch)
    return max(0, n - ramp - 1) + (last if n > ramp else 0.0)


def _epoch_time(step: float, overhead: float, ramp: int, ramp_s: float, items: int, batch: int
                ) -> float:
    n, _ = _epoch_steps(items, batch)
    share = min(ramp, n) / ramp if ramp else 0.0
    return overhead + ramp_s * share + _body(items, batch, ramp) * step


def profile_estimate(passes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Epoch time and energy of one profiled configuration from its own minibatches."""
    out: dict[str, Any] = {}
    figs = {d["pass"]: (d, steady(d)) for d in passes if d.get("status", "ok") == "ok"}
    cold = figs.get("cold", (None, None))[1]
    for data, fig in figs.values():
        if fig is None:
            continue
        items, batch = data["dataset_items"], data["knobs"]["batch"]
        if data.get("kind") in ("epoch", "whole"):
            t, band = data["wall_ns"] / 1e9, 0.0
        elif data.get("split"):
            if cold is None:
                continue
            warm = figs.get("warm", (None, None))[1]
            tail = warm["tail"] if warm is not None else cold["tail"]
            ramp_s = cold["ramp_s"]
            if data["pass"] == "warm":
                # A later epoch starts its loader afresh, reading cached files: the first
                # epoch's first minibatch less the read time it spent, then its ramp at the
                # warm pace.
                first = max(0.0, cold["first_fetch"]
                            - batch * max(0.0, cold["load_wall"] - fig["load_wall"]))
                ramp_s = first + cold["first_compute"] + cold["rest"] * fig["T"]
            body = _body(items, batch, int(cold["ramp"]))
            step, se = fig["T"], fig["se"]
            warm = figs.get("warm", (None, None))[1]
            if warm is not None and figs["cold"][0].get("in_memory"):
                # Files in memory (a tmpfs): nothing was read from a medium, the two halves'
                # steady minibatches are alike and are pooled.
                n_c, n_w = cold["steady_steps"], warm["steady_steps"]
                step = (cold["T"] * n_c + warm["T"] * n_w) / (n_c + n_w)
                se = math.hypot(cold["se"] * n_c, warm["se"] * n_w) / (n_c + n_w)
            t = cold["startup"] + ramp_s + body * step + tail
            band = 1.96 * se * body
        else:
            t = _epoch_time(fig["T"], fig["overhead"], int(fig["ramp"]), fig["ramp_s"], items,
                            batch)
            band = 1.96 * fig["se"] * _body(items, batch, int(fig["ramp"]))
        epoch = EPOCH_OF[data["pass"]]
        out[f"{epoch}_s"] = t
        out[f"{epoch}_low_s"], out[f"{epoch}_high_s"] = max(0.0, t - band), t + band
        out[f"{epoch}_steady_steps"] = fig["steady_steps"]
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


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a + b·x, both ≥ 0; the mean for a single x."""
    if len(set(xs)) < 2:
        return max(0.0, statistics.fmean(ys)), 0.0
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    if b < 0:
        return max(0.0, statistics.fmean(ys)), 0.0
    if a < 0:
        return 0.0, float(np.dot(xs, ys) / np.dot(xs, xs))
    return float(a), float(b)


def _borrow_shape(lines: dict[tuple[int, str], tuple[float, float]],
                  points: dict[tuple[int, str], list[tuple[float, float]]]
                  ) -> dict[tuple[int, str], tuple[float, float]]:
    """Lines of groups profiled at one batch size take the shape of another precision's.

    One batch size gives a line through the origin (a minibatch's cost in proportion to its
    size), which over-predicts every larger batch where a step has a large fixed part (a GPU
    step of a small network is mostly launches and host work: ResNet18's took 11 ms at batch
    32 and 14-17 ms at 64). Where another precision on the same cores was profiled at two or
    more batch sizes, its line, scaled to this group's measured value at its batch, is used:
    precisions share how a step grows with the batch, not its level.
    """
    multi = {g for g, v in points.items() if len({x for x, _ in v}) >= 2
             and g in lines and lines[g][0] > 0}
    out = dict(lines)
    for g, v in points.items():
        xs = {x for x, _ in v}
        if len(xs) != 1 or g not in lines or lines[g][0] > 0:
            continue
        donors = sorted((d for d in multi if d[0] == g[0] and d != g), key=str)
        if not donors:
            continue
        a, b = lines[donors[0]]
        x = next(iter(xs))
        at = a + b * x
        if at <= 0:
            continue
        r = lines[g][1] * x / at
        out[g] = (a * r, b * r)
    return out


@dataclass
class Components:
    """The simple model's parts, fitted on profiled passes (see the module docstring)."""

    compute: dict[tuple[int, str], tuple[float, float]]
    cpu: dict[tuple[int, str], tuple[float, float]]
    #: (storage, pass) and (storage, pass, workers > 0) → (ℓ CPU, ρ read, λ wall) per item:
    #: one reader alone (no workers) reads a medium otherwise than several at once
    loader: dict[tuple[Any, ...], tuple[float, float, float]]
    ipc: float
    #: start-up and tail: a + b·workers, with and without workers
    startup: dict[bool, tuple[float, float]]
    tail: dict[bool, tuple[float, float]]
    #: workers → (time to the first minibatch beyond B·λ, each ramp minibatch after the first,
    #: in steady minibatches)
    ramp: dict[int, tuple[float, float]]
    power: dict[tuple[Any, ...], float]
    all_cores: int
    #: (cores, precision) → power = a + b·u, u the busy share of a steady minibatch (compute /
    #: T): a device waiting on the loader draws less. Only where a counter measured the energy.
    power_line: dict[tuple[int, str], tuple[float, float]] = field(default_factory=dict)
    #: A loader-bound minibatch takes κ × B × (ℓ + ρ) / w: a worker's cycle holds more than
    #: its items' decoding (collating, handing the batch over); κ from the loader-bound
    #: profiled passes, 1 where none was.
    kappa: float = 1.0
    #: Measured energy = P0 × wall time + minibatches × (e_a + e_b × B) per precision: a static
    #: power that accrues while the device waits (on start-up, on its loader) and a dynamic
    #: energy per minibatch of work (per item where `line` says so: e_a = 0). None where no
    #: counter measured the energy.
    energy: dict[str, Any] | None = None
    #: (cores, precision) → compute C(B) = a + b·B of passes without loader workers (no worker
    #: shares the cores), where two or more batch sizes were profiled so.
    compute0: dict[tuple[int, str], tuple[float, float]] = field(default_factory=dict)
    #: (cores, precision, with workers) → the training's CPU seconds per minibatch a + b·B of
    #: the passes with (or without) loader workers alone: beside workers on the same cores the
    #: training's threads take more CPU for the same minibatch (they wait, spin and refill
    #: caches), so the two are fitted apart where both were profiled.
    cpu_by_workers: dict[tuple[int, str, bool], tuple[float, float]] = field(
        default_factory=dict)

    def _group(self, table: dict[Any, Any], key: tuple[Any, ...]) -> Any:
        if key in table:
            return table[key]
        # Same precision, the nearest core count; then anything, scaled by cores.
        same = [k for k in table if k[1] == key[1]] or list(table)
        near = min(same, key=lambda k: abs(k[0] - key[0]))
        a, b = table[near]
        scale = near[0] / key[0] if isinstance(near[0], int) and key[0] else 1.0
        return (a * scale, b * scale) if table is self.compute else (a, b)

    def _loader(self, storage: str, pass_name: str, workers: int = 1
                ) -> tuple[float, float, float]:
        return (self.loader.get((storage, pass_name, workers > 0))
                or self.loader.get((storage, pass_name)) or self.loader.get((storage, "warm"))
                or self.loader.get((storage, "cold")) or next(iter(self.loader.values())))

    def figures(self, knobs: Knobs, pass_name: str) -> dict[str, float]:
        """The steady minibatch time and its terms for one configuration and pass."""
        n = _ncores(knobs.to_dict(), self.all_cores)
        key = (n, knobs.precision)
        a, b = self._group(self.compute, key)
        compute = a + b * knobs.batch
        batch, w = knobs.batch, knobs.workers
        ca, cb = self.cpu_by_workers.get((n, knobs.precision, w > 0)) or self._group(self.cpu, key)
        kappa = max(compute * 0.5, ca + cb * knobs.batch)
        ell, rho, _ = self._loader(knobs.storage, pass_name, knobs.workers)
        # Where the loader's workers share the training's cores (a CPU's core set), the
        # compute of passes with workers holds their contention, which the cores term counts:
        # the compute is that of passes without workers, or on one core its CPU time (one
        # thread alone on a core).
        if key in self.compute0:
            a0, b0 = self.compute0[key]
            compute = a0 + b0 * batch
        elif n == 1 and n < self.all_cores:
            compute = ca + cb * batch
        if w == 0:
            step = batch * (ell + rho) + compute
            terms = {"compute": compute, "loader": batch * (ell + rho), "cores": step}
        else:
            terms = {"compute": compute + self.ipc * batch,
                     "loader": self.kappa * batch * (ell + rho) / w,
                     # The main process's CPU for receiving batches is in its CPU time κ.
                     "cores": (kappa + batch * ell) / n}
            step = max(terms.values())
        return {"T": step, **terms, "kappa": kappa, "n": n}

    def _nearest(self, table: dict[int, Any], workers: int) -> Any:
        same_kind = [w for w in table if (w > 0) == (workers > 0)] or list(table)
        return table[min(same_kind, key=lambda w: (abs(w - workers), w))]

    def start_for(self, knobs: Knobs, pass_name: str, fig: dict[str, float]
                  ) -> dict[str, float]:
        """Start-up, ramp (first minibatch and the rest) and tail of one configuration (s)."""
        w = knobs.workers
        has = w > 0
        a, b = self.startup.get(has) or next(iter(self.startup.values()))
        ta, tb = self.tail.get(has) or next(iter(self.tail.values()))
        extra, rest = self._nearest(self.ramp, w)
        _, _, wall = self._loader(knobs.storage, pass_name, knobs.workers)
        first = max(0.0, knobs.batch * wall + extra) + fig["compute"]
        ramp = warmup_steps(w)
        return {"startup": a + b * w, "first": first, "ramp_rest": rest * (ramp - 1) * fig["T"],
                "ramp": warmup_steps(w), "tail": ta + tb * w}

    def power_for(self, knobs: Knobs, pass_name: str, fig: dict[str, float] | None = None
                  ) -> float | None:
        """Power of this configuration.

        From its busy share where a line is fitted, else the mean power of the profiled passes
        most like it.
        """
        n = _ncores(knobs.to_dict(), self.all_cores)
        line = self.power_line.get((n, knobs.precision))
        if line is not None and fig is not None and fig["T"] > 0:
            busy = min(1.0, max(0.0, fig["compute"] / fig["T"]))
            return max(1e-3, line[0] + line[1] * busy)
        for key in ((knobs.batch, n, knobs.precision, knobs.workers > 0, pass_name),
                    (n, knobs.precision, knobs.workers > 0), (n, knobs.precision), ()):
            if key in self.power:
                return self.power[key]
        return None

    def energy_for(self, knobs: Knobs, seconds: float, steps: float) -> float | None:
        """Energy of `steps` minibatches over `seconds` from the static + dynamic line."""
        if self.energy is None:
            return None
        a, b = self.energy["dynamic"].get(knobs.precision) or self.energy["dynamic_any"]
        return self.energy["static_w"] * seconds + steps * (a + b * knobs.batch)

    def predict(self, knobs: Knobs, pass_name: str, items: int) -> dict[str, float]:
        """Epoch time (and energy, where power is known) of one configuration and pass."""
        fig = self.figures(knobs, pass_name)
        start = self.start_for(knobs, pass_name, fig)
        n, _ = _epoch_steps(items, knobs.batch)
        ramp = min(int(start["ramp"]), n)
        t = (start["startup"] + start["first"]
             + start["ramp_rest"] * (max(0, ramp - 1) / max(1, start["ramp"] - 1))
             + _body(items, knobs.batch, ramp) * fig["T"] + start["tail"])
        power = self.power_for(knobs, pass_name, fig)
        terms = {f"term_{k}": v for k, v in fig.items() if k != "T"}
        start_s = t - _body(items, knobs.batch, ramp) * fig["T"]
        energy = self.energy_for(knobs, t, _body(items, knobs.batch, 0))
        if energy is not None:
            power = energy / t if t else power
        return {"epoch_s": t, "T": fig["T"], "power": power,  # type: ignore[dict-item]
                "start_s": start_s, **terms}


def fit_components(passes: list[dict[str, Any]], all_cores: int,
                   probes: list[dict[str, Any]] | None = None) -> Components:
    """The simple model's components from profiled passes (status ok).

    `probes`: compute probes (kind `compute`, `profile.measure_compute`): a few minibatches
    of a batch size no profile reached, without loader workers; they give the compute and
    the training's CPU lines a point at that batch size, and nothing else (no loader, start-up
    or energy term: they have no workers and last a fraction of a second).
    """
    compute: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    cpu: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    loader: dict[tuple[Any, ...], list[tuple[float, float, float]]] = defaultdict(list)
    startup: dict[bool, list[tuple[float, float]]] = defaultdict(list)
    tail: dict[bool, list[tuple[float, float]]] = defaultdict(list)
    ramp: dict[int, list[tuple[float, float]]] = defaultdict(list)
    power: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    busy: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    ipc: list[float] = []
    cpu_rows: dict[tuple[int, str], list[tuple[int, int, int, float]]] = defaultdict(list)
    steady_cpu: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    steady_cpu_w: dict[tuple[int, str, bool], list[tuple[float, float]]] = defaultdict(list)
    compute0: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
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
        # The training process's CPU time: the pass's, less its loader's, per minibatch and
        # per loader worker started (starting one costs CPU that no steady minibatch has; the
        # warm half of a split profile continues the cold half's workers).
        starts = not (data.get("split") and data["pass"] == "warm")
        row = (len(data["steps"]), batch, w if starts else 0,
               (data.get("cpu_s") or 0.0) - fig["items"] * fig["load_cpu"])
        cpu_rows[(n, k["precision"])].append(row)
        if fig["steady_cpu_per_step"] is not None:
            steady_cpu[(n, k["precision"])].append(
                (batch, max(1e-6, fig["steady_cpu_per_step"] - batch * fig["load_cpu"])))
            steady_cpu_w[(n, k["precision"], w > 0)].append(steady_cpu[(n, k["precision"])][-1])
        if w == 0:
            compute0[(n, k["precision"])].append((batch, max(1e-6, fig["compute"])))
        loader[(k["storage"], data["pass"], w > 0)].append(
            (fig["load_cpu"], fig["read"], fig["load_wall"]))
        loader[(k["storage"], data["pass"])].append(
            (fig["load_cpu"], fig["read"], fig["load_wall"]))
        split_warm = data.get("split") and data["pass"] == "warm"
        persistent_later = data["pass"] == "warm" and k.get("persistent_workers")
        if not split_warm and not persistent_later and fig["ramp"] >= 1:
            startup[w > 0].append((w, fig["startup"]))
            ramp[w].append((fig["first_extra"], fig["rest_per"]))
        if not (data.get("split") and data["pass"] == "cold"):
            tail[w > 0].append((w, fig["tail"]))
        if fig["power"] is not None:
            for key in ((batch, n, k["precision"], w > 0, data["pass"]), (n, k["precision"], w > 0),
                        (n, k["precision"]), ()):
                power[key].append(fig["power"])
            if not str(data.get("energy_source", "")).startswith("modelled") and fig["T"] > 0:
                busy[(n, k["precision"])].append((min(1.0, fig["compute"] / fig["T"]),
                                                  fig["power"]))
    for data in probes or ():
        fig = steady(data)
        if fig is None:
            continue
        k = data["knobs"]
        g = (_ncores(k, all_cores), k["precision"])
        compute[g].append((k["batch"], max(1e-6, fig["compute"])))
        compute0[g].append(compute[g][-1])
        if fig["steady_cpu_per_step"] is not None:
            point = (k["batch"], max(1e-6, fig["steady_cpu_per_step"]
                                     - k["batch"] * fig["load_cpu"]))
            cpu[g].append(point)
            steady_cpu[g].append(point)
            steady_cpu_w[(g[0], g[1], False)].append(point)
    if not compute:
        raise UsageError("no profiled configuration measured any minibatch: nothing to predict "
                         "from; check the errors of the profile run")
    comps = Components(
        compute=_borrow_shape({g: _linfit([x for x, _ in v], [y for _, y in v])
                               for g, v in compute.items()}, compute),
        # The steady minibatches' own CPU time where every pass of the group has it, else the
        # passes' CPU time with a start-up cost per worker (`_fit_cpu`).
        cpu=_borrow_shape({
            g: _linfit([x for x, _ in steady_cpu[g]], [y for _, y in steady_cpu[g]])
            if len(steady_cpu[g]) == len(v)
            else _fit_cpu(cpu_rows[g]) or _linfit([x for x, _ in v], [y for _, y in v])
            for g, v in cpu.items()}, cpu),
        compute0={g: _linfit([x for x, _ in v], [y for _, y in v]) for g, v in compute0.items()
                  if len({x for x, _ in v}) >= 2},
        cpu_by_workers={g: _linfit([x for x, _ in v], [y for _, y in v])
                        for g, v in steady_cpu_w.items() if len({x for x, _ in v}) >= 2
                        and len({x for x, _ in steady_cpu_w.get((g[0], g[1], not g[2]), [])})
                        >= 2},
        loader={g: (statistics.median(a for a, _, _ in v), statistics.median(b for _, b, _ in v),
                    statistics.median(c for _, _, c in v)) for g, v in loader.items()},
        ipc=0.0,
        startup={g: _line([x for x, _ in v], [y for _, y in v]) for g, v in startup.items()}
        or {False: (0.0, 0.0)},
        tail={g: _line([x for x, _ in v], [y for _, y in v]) for g, v in tail.items()}
        or {False: (0.0, 0.0)},
        ramp={g: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
              for g, v in ramp.items()} or {0: (0.0, 0.0)},
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
    comps.kappa = _fit_kappa(passes, all_cores) or 1.0
    comps.energy = _fit_energy(passes)
    for key, points in busy.items():
        us = [u for u, _ in points]
        if len(points) >= 3 and max(us) - min(us) > 0.1:
            b, a = np.polyfit(np.asarray(us, float), np.asarray([p for _, p in points], float), 1)
            comps.power_line[key] = (float(a), float(b))
    return comps


def _fit_cpu(rows: list[tuple[int, int, int, float]]) -> tuple[float, float] | None:
    """CPU seconds per minibatch a + b·B from passes' (minibatches, B, workers, CPU seconds).

    cpu = N·a + N·B·b + w·s: `s` a loader worker's start (outside the steady minibatches; w is
    0 for a pass that started none). None with too few rows (the per-step line of `_linfit` is used).
    """
    if len(rows) < 4 or len({b for _, b, _, _ in rows}) < 2:
        return None
    with_w = any(w for _, _, w, _ in rows)
    x = np.asarray([[n, n * b] + ([w] if with_w else []) for n, b, w, _ in rows], float)
    y = np.asarray([c for *_, c in rows], float)
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    if coef[0] < 0:  # a negative per-minibatch constant is noise: through the origin in B
        coef = np.linalg.lstsq(x[:, 1:], y, rcond=None)[0]
        coef = np.concatenate([[0.0], coef])
    if coef[1] <= 0:
        return None
    return float(coef[0]), float(coef[1])


def _fit_kappa(passes: list[dict[str, Any]], all_cores: int) -> float | None:
    """κ: a loader-bound steady minibatch over B × (ℓ + ρ) / w (median over such passes).

    A pass is loader-bound where its fetch stall is a quarter of its steady minibatch or more,
    over at least two rounds of its workers (fewer are served from the prefetched queue), and
    its cores were not the bottleneck (their CPU time per minibatch, spread over them, is well
    below the minibatch: a CPU-bound pass stalls on fetches too, for want of cores).
    """
    ratios = []
    for data in passes:
        fig = steady(data)
        w = data["knobs"]["workers"]
        if fig is None or w == 0 or fig["T"] <= 0:
            continue
        per_item = fig["load_cpu"] + fig["read"]
        cores_busy = (fig["steady_cpu_per_step"] or fig["cpu_per_step"]) / _ncores(
            data["knobs"], all_cores)
        if (fig["fetch"] >= 0.25 * fig["T"] and fig["steady_steps"] >= 2 * w and per_item > 0
                and cores_busy < 0.8 * fig["T"]):
            ratios.append(fig["T"] * w / (data["knobs"]["batch"] * per_item))
    return float(min(2.0, max(1.0, statistics.median(ratios)))) if ratios else None


#: Passes shorter than this are left out of the energy fit: a counter read over a fraction of a
#: second (and a sampler's interval at each end) is mostly noise.
ENERGY_MIN_S = 0.3


def _fit_energy(passes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Static power and dynamic energy, by least squares (`Components.energy`).

    Two lines, the one that predicts the profiles better left one out is kept:
    - per minibatch, E = P0·t + Σ_p N·(a_p + b_p·B)[precision p], b_p only where the precision
      was profiled at two or more batch sizes;
    - per item, E = P0·t + Σ_p N·B·e_p, one parameter per precision.
    A profile's energy counter is read over a second or less: on an H100 five parameters from
    eight such reads wandered (a negative static power, or a per-minibatch energy that did not
    grow with the batch), where a step's dynamic energy there grows about with its items
    (docs/benchmarks.md). Only measured (not modelled) energies; None when fewer rows than
    parameters + 2, or neither line is physical (a negative static power or dynamic energy).
    """
    raw: list[tuple[float, int, int, str, float, Any]] = []
    for data in passes:
        if not data.get("energy_j") or str(data.get("energy_source", "none")).startswith(
                ("modelled", "none")):
            continue
        k = data["knobs"]
        raw.append((data["wall_ns"] / 1e9, len(data.get("steps") or []), k["batch"],
                    k["precision"], data["energy_j"], data.get("config", ("pass", len(raw)))))
    long_rows = [r for r in raw if r[0] >= ENERGY_MIN_S]
    # The short passes only where too few long ones are left to fit.
    tagged = long_rows if len(long_rows) >= 3 + 2 * len({r[3] for r in raw}) else raw
    rows = [(t, n, b, p, e) for t, n, b, p, e, _ in tagged]
    groups = [g for *_, g in tagged]
    precisions = sorted({r[3] for r in rows})
    two_b = sorted({p for p in precisions if len({r[2] for r in rows if r[3] == p}) >= 2})
    fits = []
    for per_item in (False, True):
        fit = _energy_lstsq(rows, precisions, [] if per_item else two_b, per_item=per_item)
        if fit is not None:
            fits.append((_energy_loo(rows, groups, precisions, [] if per_item else two_b,
                                     per_item), per_item, fit))
    if not fits:
        return None
    loo, per_item, (static, dynamic) = min(fits, key=lambda f: f[0])
    # A precision profiled at one batch size takes the growth with the batch of one profiled
    # at two (as the compute lines do, `_borrow_shape`), kept equal at its own batch.
    donors = [p for p in two_b if dynamic[p][0] > 0 and dynamic[p][1] >= 0]
    for p in precisions:
        sizes = {r[2] for r in rows if r[3] == p}
        if p in two_b or not donors or len(sizes) != 1 or dynamic[p][0] <= 0:
            continue
        a_d, b_d = dynamic[donors[0]]
        a = dynamic[p][0] / (1 + b_d / a_d * next(iter(sizes)))
        dynamic[p] = (a, a * b_d / a_d)
    pred = [static * t + n * (dynamic[p][0] + dynamic[p][1] * b) for t, n, b, p, _ in rows]
    resid = [math.log(pv / r[4]) for pv, r in zip(pred, rows, strict=True) if pv > 0]
    any_line = (statistics.fmean(a for a, _ in dynamic.values()),
                statistics.fmean(b for _, b in dynamic.values()))
    return {"static_w": static, "dynamic": dynamic, "dynamic_any": any_line, "rows": len(rows),
            "line": "per item" if per_item else "per minibatch", "loo_error": loo,
            "log_error": float(np.sqrt(np.mean(np.square(resid)))) if resid else 0.0}


def _energy_loo(rows: list[tuple[float, int, int, str, float]], groups: list[Any],
                precisions: list[str], two_b: list[str], per_item: bool) -> float:
    """Mean |relative error| of each row predicted by `_energy_lstsq` without its configuration.

    Both of its passes are left out: the held-out configuration's other pass would carry its
    own level into the fit.

    A row whose fold cannot be fitted (too few rows, or not physical) counts as a miss of 1.
    """
    errors = []
    for g in dict.fromkeys(groups):
        train = [r for r, h in zip(rows, groups, strict=True) if h != g]
        # A fold may be exactly determined: with a configuration's two passes out, three
        # profiled configurations leave four rows for the per-minibatch line's four parameters.
        fit = _energy_lstsq(train, precisions, two_b, per_item=per_item, spare=0)
        for (t, n, b, p, e), h in zip(rows, groups, strict=True):
            if h != g:
                continue
            if fit is None:
                errors.append(1.0)
                continue
            a, slope = fit[1][p]
            errors.append(abs(fit[0] * t + n * (a + slope * b) - e) / e)
    return statistics.fmean(errors)


def _energy_lstsq(rows: list[tuple[float, int, int, str, float]], precisions: list[str],
                  two_b: list[str], *, per_item: bool, spare: int = 2
                  ) -> tuple[float, dict[str, tuple[float, float]]] | None:
    """(P0, {precision: (a, b)}) of `_fit_energy`'s line, or None where it is not physical.

    `per_item`: one parameter per precision, the energy per item (a = 0, b = e_p). At least
    `spare` rows more than parameters (one fewer in a leave-one-out fold).
    """
    cols = 1 + len(precisions) + len(two_b)
    if len(rows) < cols + spare:
        return None
    x, y = [], []
    for t, n, b, prec, e in rows:
        if per_item:
            row = [t] + [n * b * (prec == p) for p in precisions]
        else:
            row = [t] + [n * (prec == p) for p in precisions] + [n * b * (prec == p)
                                                                 for p in two_b]
        # Relative least squares: each pass weighs alike, whatever its length.
        x.append([v / e for v in row])
        y.append(1.0)
    coef = np.linalg.lstsq(np.asarray(x, float), np.asarray(y, float), rcond=None)[0]
    static = float(coef[0])
    dynamic: dict[str, tuple[float, float]] = {}
    for i, p in enumerate(precisions):
        if per_item:
            dynamic[p] = (0.0, float(coef[1 + i]))
            continue
        slope = float(coef[1 + len(precisions) + two_b.index(p)]) if p in two_b else 0.0
        dynamic[p] = (float(coef[1 + i]), slope)
    if static < 0 or any(a + b * 8 < 0 or (per_item and b <= 0) for a, b in dynamic.values()):
        return None
    return static, dynamic


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
#: the passes without it (`_rows_without`): (features, log time error, log power error, groups).
Rows = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]


def _rows_without(passes: list[dict[str, Any]], all_cores: int, tmpfs: dict[str, bool]
                  ) -> Callable[[Any], Rows]:
    """`_training_rows` of `passes` less one configuration's, cached per configuration.

    A training row's target is its configuration's error under the simple model fitted on the
    *other* configurations; with a configuration held out, those other fits must not hold it
    either, or its passes reach the correction through every other row's components.
    """
    cache: dict[Any, Rows] = {}

    def rows(group: Any) -> Rows:
        if group not in cache:
            cache[group] = _training_rows([p for p in passes if p.get("config") != group],
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


# -- choosing the configurations to profile ----------------------------------------------------


def _levels(knobs: Knobs) -> tuple[Any, ...]:
    return (knobs.batch, knobs.workers, knobs.prefetch_factor, knobs.pin_memory,
            knobs.persistent_workers, knobs.storage, knobs.cores, knobs.precision)


def choose_profiled(configs: list[Knobs], count: int) -> list[int]:
    """`count` configurations that cover every pair of knob levels as far as they can.

    Greedy pairwise coverage (a covering array, the usual design for few runs over many
    factors), ties broken by the distance to the configurations chosen so far, then grid order.
    Where `count` allows, every cell the simple model fits a line in the batch over (cores,
    precision, with or without loader workers) gets its smallest and its largest batch first:
    a line from a single batch size is a guess, and pairwise coverage alone leaves such cells.
    """
    count = max(1, min(count, len(configs)))
    return sorted(covering_order(configs, count, limit=count))


def model_cell(k: Knobs) -> tuple[Any, ...]:
    """The simple model's cell of a configuration: (cores, precision, with workers, batch)."""
    return (k.cores, k.precision, k.workers > 0, k.batch)


def _cells(configs: list[Knobs]) -> list[Any]:
    ends = (min(k.batch for k in configs), max(k.batch for k in configs))
    return [model_cell(k) if k.batch in ends else None for k in configs]


def covering_order(configs: list[Knobs], count: int, limit: int | None = None) -> list[int]:
    """The configurations in the order the covering design of `choose_profiled` adds them.

    The model's cells come first where there are no more of them than `count` (the number of
    configurations that will be taken from the front of the order); `limit`: only that many.
    """
    levels = [_levels(k) for k in configs]
    cell = _cells(configs)
    by_cell = len({c for c in cell if c is not None}) <= count
    factors = range(len(levels[0]))
    ordinal = [sorted({lv[f] for lv in levels}, key=str) for f in factors]

    def pairs(lv: tuple[Any, ...]) -> set[tuple[int, Any, int, Any]]:
        return {(f, lv[f], g, lv[g]) for f in factors for g in factors if f < g}

    def distance(a: tuple[Any, ...], b: tuple[Any, ...]) -> float:
        return sum(abs(ordinal[f].index(a[f]) - ordinal[f].index(b[f])) / max(1, len(ordinal[f]) - 1)
                   for f in factors)

    chosen: list[int] = []
    covered: set[tuple[int, Any, int, Any]] = set()
    cells_covered: set[Any] = set()
    stop = len(configs) if limit is None else min(limit, len(configs))
    while len(chosen) < stop:
        best, best_score = None, (-1.0, -1.0, -1.0)
        for i, lv in enumerate(levels):
            if i in chosen:
                continue
            new_cell = float(by_cell and cell[i] is not None and cell[i] not in cells_covered)
            gain = len(pairs(lv) - covered)
            spread = min((distance(lv, levels[j]) for j in chosen), default=0.0)
            if (new_cell, gain, spread) > best_score:
                best, best_score = i, (new_cell, gain, spread)
        assert best is not None
        chosen.append(best)
        covered |= pairs(levels[best])
        cells_covered.add(cell[best])
    return chosen


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
    #: Predicted from profiles of other model cells (`covered`), with the wider bound.
    extrapolated: bool = False

    def rows(self) -> list[dict[str, Any]]:
        """One row per epoch kind, for the store and JSON."""
        out = []
        for epoch, fig in self.epochs.items():
            meas = self.measured.get(epoch, {})
            out.append({"config": self.config, "label": self.knobs.label, "epoch": epoch,
                        "method": self.method, "profiled": self.profiled,
                        "extrapolated": self.extrapolated, **fig,
                        "measured_s": meas.get("s"), "measured_energy_j": meas.get("energy_j"),
                        # The machine's speed when the epoch was measured over its speed
                        # when profiled (a reference re-measured beside it); None unmeasured.
                        "drift": meas.get("drift"),
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
            yt.append(math.log(_served_step(data, fig, comps.kappa) / simple["T"]))
            power = comps.power_for(knobs, data["pass"], simple)
            yp.append(math.log(fig["power"] / power) if powered and power and fig["power"]
                      else 0.0)
            groups.append(cfg)
    return (np.asarray(xs, float), np.asarray(yt, float),
            np.asarray(yp, float) if powered else None, np.asarray(groups))


def predict_all(configs: list[Knobs], passes: list[dict[str, Any]], *, items: int,
                all_cores: int, tmpfs: dict[str, bool], method: str = "auto",
                reference: list[dict[str, Any]] | None = None,
                probes: list[dict[str, Any]] | None = None) -> tuple[list[Prediction],
                                                                      dict[str, Any]]:
    """Predict every configuration's epochs from the profiled passes; (predictions, model info).

    `method`: `auto` (learned where its leave-one-out error beats the simple model's), `simple`
    or `learned`. `reference`: passes of another network; the learned model is fitted on them
    and recalibrated on `passes` (transfer). `probes`: compute probes of batch sizes no
    profile reached (`fit_components`).
    """
    by = _group(passes)
    probes = [p for p in probes or () if p.get("status", "ok") == "ok" and p.get("steps")]
    comps = fit_components(passes, all_cores, probes)
    info: dict[str, Any] = {"profiled": sorted(by), "method": method}
    if reference and _fit_kappa(passes, all_cores) is None:
        # No loader-bound profile of this network: the loader's cycle is the machine's and the
        # data set's, not the network's, so the reference network's passes give it.
        comps.kappa = _fit_kappa(reference, all_cores) or 1.0
        info["kappa_from"] = "reference"
    info["kappa"] = comps.kappa
    if comps.energy is not None:
        info["energy_model"] = {k: v for k, v in comps.energy.items() if k != "dynamic_any"}
    # Leave-one-configuration-out error of the simple model (log scale).
    xs, yt, yp, groups = _training_rows(passes, all_cores, tmpfs)
    simple_loo = float(np.mean(np.abs(yt))) if len(yt) else math.inf
    info["simple_loo_mape_pct"] = 100 * (math.exp(simple_loo) - 1) if len(yt) else None
    learned: LearnedModel | None = None
    # Every leave-one-out error below leaves the configuration out of every fitted part: the
    # simple model's components, the correction's training rows, the transfer's line.
    without = _rows_without(passes, all_cores, tmpfs)
    if method != "simple" and reference:
        ref_x, ryt, ryp, rgroups = _training_rows(reference, all_cores, tmpfs)
        if len(ryt) >= 3:
            learned = fit_learned(ref_x, ryt, ryp, rgroups,
                                  _rows_without(reference, all_cores, tmpfs))
            learned = _recalibrate(learned, xs, yt, yp, groups, without)
            info["transfer"] = {"reference_rows": len(ryt), "kind": learned.kind,
                                **learned.recalibration}
    elif method != "simple" and len(np.unique(groups)) >= (3 if method == "learned"
                                                           else LEARNED_MIN_CONFIGS):
        learned = fit_learned(xs, yt, yp, groups, without)
    if reference and learned is not None:
        # The transferred correction is kept only where it beats the simple model on the new
        # network's own profiles, each scored by a line fitted without it.
        transfer_err = learned.recalibration.get("error", math.inf)
        in_sample = learned.recalibration.get("in_sample_error", math.inf)
        info["transfer"]["error_pct"] = 100 * (math.exp(transfer_err) - 1) \
            if math.isfinite(transfer_err) else None
        info["transfer"]["in_sample_error_pct"] = 100 * (math.exp(in_sample) - 1) \
            if math.isfinite(in_sample) else None
        learned.loo_time = transfer_err
    use_learned = learned is not None and (
        method == "learned" or learned.loo_time < LEARNED_MARGIN * simple_loo)
    if learned is not None:
        info["learned"] = {"kind": learned.kind, "rows": learned.rows,
                           "loo_mape_pct": 100 * (math.exp(learned.loo_time) - 1)
                           if math.isfinite(learned.loo_time) else None}
    info["loo"] = "leave-one-configuration-out"
    err = learned.loo_time if use_learned and learned is not None else simple_loo
    err = err if math.isfinite(err) else 0.25
    info["chosen"] = ("transfer" if reference else "learned") if use_learned else "simple"
    profiled_knobs = [configs[i] for i in by if 0 <= i < len(configs)]
    cell_err, cells = _cell_out_error(passes, all_cores)
    # A configuration of a cell no profile reached is predicted from other cells' lines: its
    # bound is that error as measured (each profiled cell predicted from the others), and at
    # least twice the interpolating one, or assumed where fewer than two cells were profiled.
    err_x = max(EXTRAPOLATION_WIDEN * err, cell_err or 0.0, EXTRAPOLATION_MIN_ERR)
    probed = [Knobs.from_dict(p["knobs"]) for p in probes]
    extrapolated = [k.label for i, k in enumerate(configs)
                    if i not in by and not covered(k, profiled_knobs, probed)]
    if probes:
        info["compute_probes"] = sorted({f"b{k.batch} {k.precision}" for k in probed})
    info["extrapolation"] = {
        "configurations": extrapolated, "cells_profiled": cells,
        "cells": len({model_cell(k) for k in configs}),
        "bound_pct": 100 * (math.exp(1.96 * err_x) - 1),
        "source": (f"leave-one-cell-out over {cells} profiled cells" if cell_err is not None
                   else f"assumed ({cells} cell profiled: nothing to measure it on)")}
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
            _queue_correction(epochs, own or [], comps, items)
            if comps.energy is not None:
                # Energy from the static + dynamic line fitted over every profiled pass: a
                # pass's own mean power over a second or less is mostly the counter's noise.
                steps = _body(items, knobs.batch, 0)
                for fig in epochs.values():
                    t = fig["predicted_s"] or 0.0
                    energy = comps.energy_for(knobs, t, steps)
                    rel = math.hypot(((fig["high_s"] or t) - t) / t if t else 0.0,
                                     1.96 * comps.energy["log_error"])
                    fig.update(predicted_energy_j=energy,
                               energy_low_j=(energy or 0.0) * max(0.0, 1 - rel),
                               energy_high_j=(energy or 0.0) * (1 + rel))
            predictions.append(Prediction(i, knobs, True, "profile", epochs))
            continue
        epochs = {}
        outside = knobs.label in extrapolated
        for pass_name in PASSES:
            simple = comps.predict(knobs, pass_name, items)
            t, power = simple["epoch_s"], simple["power"]
            if use_learned and learned is not None:
                lt, lp = learned.correction(_features(knobs, pass_name, simple,
                                                      tmpfs.get(knobs.storage, False)))
                # The correction is learned on the steady minibatch: start-up is measured.
                t = simple["start_s"] + (t - simple["start_s"]) * math.exp(lt)
                power = power * math.exp(lp) if power is not None else None
            energy = power * t if power is not None else None
            e = err_x if outside else err
            low, high = _band(t, e)
            e_low, e_high = _band(energy, math.hypot(e, comps.energy["log_error"])
                                  if comps.energy is not None else e)
            epochs[EPOCH_OF[pass_name]] = {"predicted_s": t, "low_s": low, "high_s": high,
                                           "predicted_energy_j": energy, "energy_low_j": e_low,
                                           "energy_high_j": e_high}
        predictions.append(Prediction(i, knobs, False, info["chosen"], epochs,
                                      extrapolated=outside))
    return predictions, info


#: An extrapolated prediction's bound is at least this many times the interpolating one's ...
EXTRAPOLATION_WIDEN = 2.0
#: ... and at least this log error (±25% before the 95% band's 1.96).
EXTRAPOLATION_MIN_ERR = math.log(1.25)


def covered(knobs: Knobs, profiled: list[Knobs], probed: list[Knobs] | tuple[()] = ()) -> bool:
    """Whether a configuration's model cell was profiled or lies inside profiled ones.

    The cell is (cores, precision, with or without workers, batch); a batch size between two
    profiled ones of the same (cores, precision, workers) group is interpolated by its lines.
    `probed`: compute probes (`profile.measure_compute`); a batch size whose compute was probed,
    in a (cores, precision, workers) group profiled at another batch size, is covered: its
    compute is measured, its loader's and start-up's terms are per item or per worker.
    """
    group = [p.batch for p in profiled if model_cell(p)[:3] == model_cell(knobs)[:3]]
    if knobs.batch in group or bool(group and min(group) < knobs.batch < max(group)):
        return True
    return bool(group) and any(
        (p.cores, p.precision, p.batch) == (knobs.cores, knobs.precision, knobs.batch)
        for p in probed)


def _cell_out_error(passes: list[dict[str, Any]], all_cores: int) -> tuple[float | None, int]:
    """(error of a prediction outside every profiled cell, number of profiled cells).

    The error is the mean |log error| of each profiled cell's steady minibatch predicted by the
    simple model fitted without any configuration of that cell; None with fewer than two cells.
    """
    cells: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for data in passes:
        if data.get("status", "ok") == "ok":
            cells[model_cell(Knobs.from_dict(data["knobs"]))].append(data)
    if len(cells) < 2:
        return None, len(cells)
    errors = []
    for cell, own in cells.items():
        others = [p for c, ps in cells.items() if c != cell for p in ps]
        try:
            comps = fit_components(others, all_cores)
        except UsageError:
            continue
        for data in own:
            fig = steady(data)
            if fig is None:
                continue
            t = comps.figures(Knobs.from_dict(data["knobs"]), data["pass"])["T"]
            if t > 0:
                errors.append(abs(math.log(_served_step(data, fig, comps.kappa) / t)))
    return (statistics.fmean(errors) if errors else None), len(cells)


def _served_step(data: dict[str, Any], fig: dict[str, float], kappa: float) -> float:
    """A pass's steady minibatch, at its loader's rate where it was served from the queue."""
    k = data["knobs"]
    w = k["workers"]
    if w == 0 or fig["steady_steps"] >= 2 * w * k["prefetch_factor"]:
        return fig["T"]
    return max(fig["T"], kappa * k["batch"] * (fig["load_cpu"] + fig["read"]) / w)


def _queue_correction(epochs: dict[str, dict[str, float | None]], own: list[dict[str, Any]],
                      comps: Components, items: int) -> None:
    """A profile too short to reach its loader's steady rate: the loader's rate instead.

    The workers' queue holds `w × prefetch` batches made during the ramp; a profile whose
    steady part is shorter than two such rounds is served from it, faster than the loader
    makes batches. Where the loader's rate (κ·B·(ℓ + ρ)/w, the pass's own ℓ and ρ) is slower
    than the minibatches measured, the epoch's steady minibatches take the loader's rate.
    """
    for data in own:
        fig = steady(data)
        if fig is None:
            continue
        k = data["knobs"]
        w = k["workers"]
        loader = _served_step(data, fig, comps.kappa)
        if loader <= fig["T"]:
            continue
        epoch = epochs[EPOCH_OF[data["pass"]]]
        extra = _body(items, k["batch"], warmup_steps(w)) * (loader - fig["T"])
        for key in ("predicted_s", "low_s", "high_s"):
            if epoch[key] is not None:
                epoch[key] = (epoch[key] or 0.0) + extra


def _recal_line(ref: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(a, b) of y = a + b·ref, b in [0, 1]; an offset alone (b = 1) below four rows."""
    if len(y) == 0:
        return 0.0, 1.0
    if len(y) < 4 or np.ptp(ref) < 1e-9:
        return float(np.mean(y - ref)), 1.0
    b = float(np.clip(np.polyfit(ref, y, 1)[0], 0.0, 1.0))  # shrink, never amplify
    return float(np.mean(y - b * ref)), b


def _recalibrate(model: LearnedModel, xs: np.ndarray, yt: np.ndarray, yp: np.ndarray | None,
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
