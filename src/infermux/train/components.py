"""The simple model: components of the profiled configurations, fitted and recombined.

Compute per minibatch per (cores, precision), the training's CPU seconds, the loader's per-item
CPU, wall and read time, start-up and tail per worker, the loader's cycle κ_L and the energy
line, each fitted on the profiled passes (`fit_components`); `Components.predict` puts them
together into any configuration's epoch (the second layer of `predict`'s docstring).
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
from infermux.train.steady import epoch_body, epoch_steps, steady, warmup_steps

__all__ = ["ENERGY_MIN_S", "PROBE_POWER_MIN_S", "Components", "fit_components", "fit_kappa",
           "served_step"]

#: A compute probe's power (`profile.measure_compute`) is used only where read over this long
#: (two sampler intervals, between reads of its own).
PROBE_POWER_MIN_S = 0.2


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
    #: (cores, precision, batch) → (mean power W, compute per minibatch s) of a compute probe
    #: at that batch (`profile.measure_compute`): the device's power at its own batch cell,
    #: where no profile measured it (a batch-128 epoch drew 184–292 W on an H200 host where
    #: the batch-32 profiles saw 145–173 W).
    probe_power: dict[tuple[int, str, int], tuple[float, float]] = field(default_factory=dict)

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
        return self.energy["static_w"] * seconds + steps * max(0.0, a + b * knobs.batch)

    def _probe_at(self, knobs: Knobs) -> tuple[float, float] | None:
        n = _ncores(knobs.to_dict(), self.all_cores)
        return self.probe_power.get((n, knobs.precision, knobs.batch))

    def energy_at(self, knobs: Knobs, pass_name: str, seconds: float, steps: float,
                  fig: dict[str, float] | None = None) -> tuple[float | None, str]:
        """Energy of an epoch of `steps` minibatches over `seconds`, and where its power came from.

        Where a compute probe measured the power at this configuration's batch (and precision,
        cores), that power sets the dynamic energy of its minibatches: with a static + dynamic
        line, (P_probe − P0) × the probe's compute per minibatch (the probe's device is busy
        all along, so its power over the static is the dynamic part), in place of the line's
        value extrapolated from other batch sizes; without one, the probe's mean power over the
        epoch. Elsewhere the line, or the mean power of the profiled passes most alike.
        """
        probe = self._probe_at(knobs)
        at = f"b{knobs.batch} {knobs.precision}"
        if self.energy is not None:
            static = self.energy["static_w"]
            if probe is not None and probe[0] > static:
                return (static * seconds + steps * (probe[0] - static) * probe[1],
                        f"compute probe at {at} ({probe[0]:.0f} W): its dynamic energy per "
                        f"minibatch over the static {static:.0f} W")
            batches = (self.energy.get("batches") or {}).get(knobs.precision) or []
            source = (f"energy line ({self.energy['line']}) fitted on profiles at batch "
                      + ",".join(str(b) for b in batches))
            if knobs.batch not in batches:
                source += f", extrapolated to batch {knobs.batch}"
            if probe is not None:
                source += (f" (the compute probe's {probe[0]:.0f} W at {at} is under the static "
                           "power: not used)")
            return self.energy_for(knobs, seconds, steps), source
        n = _ncores(knobs.to_dict(), self.all_cores)
        own = (knobs.batch, n, knobs.precision, knobs.workers > 0, pass_name) in self.power
        if probe is not None and not own:
            return probe[0] * seconds, f"compute probe at {at}: its mean power ({probe[0]:.1f} W)"
        power = self.power_for(knobs, pass_name, fig)
        if power is None:
            return None, "none"
        if (n, knobs.precision) in self.power_line and fig is not None:
            return power * seconds, "power line in the busy share of the profiled passes"
        return power * seconds, ("mean power of the profiled passes at its batch" if own else
                                 "mean power of profiled passes at other batch sizes "
                                 "(extrapolated)")

    def predict(self, knobs: Knobs, pass_name: str, items: int) -> dict[str, Any]:
        """Epoch time (and energy, where power is known) of one configuration and pass."""
        fig = self.figures(knobs, pass_name)
        start = self.start_for(knobs, pass_name, fig)
        n, _ = epoch_steps(items, knobs.batch)
        ramp = min(int(start["ramp"]), n)
        t = (start["startup"] + start["first"]
             + start["ramp_rest"] * (max(0, ramp - 1) / max(1, start["ramp"] - 1))
             + epoch_body(items, knobs.batch, ramp) * fig["T"] + start["tail"])
        power = self.power_for(knobs, pass_name, fig)
        terms = {f"term_{k}": v for k, v in fig.items() if k != "T"}
        start_s = t - epoch_body(items, knobs.batch, ramp) * fig["T"]
        energy, source = self.energy_at(knobs, pass_name, t, epoch_body(items, knobs.batch, 0),
                                        fig)
        if energy is not None:
            power = energy / t if t else power
        return {"epoch_s": t, "T": fig["T"], "power": power, "power_source": source,
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
    probe_power: dict[tuple[int, str, int], list[tuple[float, float]]] = defaultdict(list)
    for data in probes or ():
        fig = steady(data)
        if fig is None:
            continue
        k = data["knobs"]
        g = (_ncores(k, all_cores), k["precision"])
        # A counter read over too short a window (the share allowed few minibatches) is
        # noise; a modelled power (CPU seconds × watts) is the probe's CPU time, whatever long.
        modelled = str(data.get("energy_source", "")).startswith("modelled")
        if data.get("power_w") and (modelled
                                    or (data.get("power_s") or 0.0) >= PROBE_POWER_MIN_S):
            probe_power[(g[0], g[1], k["batch"])].append((data["power_w"], fig["compute"]))
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
        probe_power={g: (statistics.fmean(p for p, _ in v), statistics.fmean(c for _, c in v))
                     for g, v in probe_power.items()},
    )
    # Receiving a batch from a worker: what the steady minibatch takes beyond the model's
    # bottleneck, per item (the median over passes with workers).
    for data in passes:
        fig = steady(data)
        if fig is not None and data["knobs"]["workers"] > 0:
            knobs = Knobs.from_dict(data["knobs"])
            ipc.append(max(0.0, fig["T"] - comps.figures(knobs, data["pass"])["T"]) / knobs.batch)
    comps.ipc = statistics.median(ipc) if ipc else 0.0
    comps.kappa = fit_kappa(passes, all_cores) or 1.0
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


def fit_kappa(passes: list[dict[str, Any]], all_cores: int) -> float | None:
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
    batches = {p: sorted({r[2] for r in rows if r[3] == p}) for p in precisions}
    return {"static_w": static, "dynamic": dynamic, "dynamic_any": any_line, "rows": len(rows),
            "batches": batches,
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
    # A minibatch of more items never costs less dynamic energy: a falling line is noise (an
    # H200 run's two batch sizes gave a per-minibatch line that went negative at batch 128,
    # an epoch predicted at 107 W against a 137 W static power), as is a negative one.
    if static < 0 or any(a + b * 8 < 0 or b < 0 or (per_item and b <= 0)
                         for a, b in dynamic.values()):
        return None
    return static, dynamic


def served_step(data: dict[str, Any], fig: dict[str, float], kappa: float) -> float:
    """A pass's steady minibatch, at its loader's rate where it was served from the queue."""
    k = data["knobs"]
    w = k["workers"]
    if w == 0 or fig["steady_steps"] >= 2 * w * k["prefetch_factor"]:
        return fig["T"]
    return max(fig["T"], kappa * k["batch"] * (fig["load_cpu"] + fig["read"]) / w)
