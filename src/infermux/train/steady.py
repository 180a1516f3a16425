"""A training pass's steady state, and a profiled configuration's own epoch estimate.

A pass (`profile`) is read as start-up, a ramp of one minibatch per loader worker, and steady
minibatches (`steady`); a profiled configuration's first and later epoch are its own start-up,
ramp, steady time and tail scaled to a whole epoch (`profile_estimate`, the first of the
predictor's layers: `predict`'s docstring describes them all).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

__all__ = [
    "EPOCH_OF",
    "MIN_STEADY_STEPS",
    "PASSES",
    "by_config",
    "epoch_body",
    "epoch_steps",
    "profile_estimate",
    "steady",
    "warmup_steps",
]


PASSES = ("cold", "warm")
EPOCH_OF = {"cold": "first", "warm": "later"}
#: The steady part of a profile's cold and warm halves: at least this many minibatches after the
#: ramp each, where the profile share of an epoch allows it (a shorter one is flagged).
MIN_STEADY_STEPS = 8


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
    # A compute probe (or a drift probe of its kind) follows its batch size's warm-up and has
    # no loader workers: no ramp.
    continued = (bool(data.get("split")) and data["pass"] == "warm") or \
        data.get("kind") == "compute" or str(data.get("kind", "")).startswith("drift:")
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


def epoch_steps(items: int, batch: int) -> tuple[int, float]:
    """(minibatches in an epoch, share of a full batch that the last one holds)."""
    n = math.ceil(items / batch)
    last = items - (n - 1) * batch
    return n, last / batch


def epoch_body(items: int, batch: int, ramp: int) -> float:
    """Steady minibatches of an epoch after `ramp`, the last, partial one in proportion."""
    n, last = epoch_steps(items, batch)
    return max(0, n - ramp - 1) + (last if n > ramp else 0.0)


def _epoch_time(step: float, overhead: float, ramp: int, ramp_s: float, items: int, batch: int
                ) -> float:
    n, _ = epoch_steps(items, batch)
    share = min(ramp, n) / ramp if ramp else 0.0
    return overhead + ramp_s * share + epoch_body(items, batch, ramp) * step


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
            body = epoch_body(items, batch, int(cold["ramp"]))
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
            band = 1.96 * fig["se"] * epoch_body(items, batch, int(fig["ramp"]))
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


def by_config(passes: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """The passes that ran, by the index of their configuration in the grid."""
    by: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for p in passes:
        if p.get("status", "ok") == "ok":
            by[p["config"]].append(p)
    return by
