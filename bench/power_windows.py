"""How far a short window's power read can be trusted: the energy counter against the sampled power.

Every pass of a stored `train-predict` run (profiles, compute and drift probes, epochs) keeps
its telemetry rows. For each pass on a GPU this compares two means over the same rows: the
energy counter's difference over the window, and the sampled (instant) power integrated over it
(`telemetry.energy`, trapezoids). Their ratio, grouped by the window's length, says how long a
read must be before the two agree; beside it, the mean power of the compute probes and of the
epochs of the same run at each batch and precision, which a probe's read is meant to stand for.

    python bench/power_windows.py gpu-nets/train-nets.db
    python bench/power_windows.py gpu-nets/train-nets.db --split-s 1.0 --json windows.json
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from collections import defaultdict
from pathlib import Path
from typing import Any

from infermux.telemetry.energy import counter_energy_j, integrate_power_j


def passes(db: Path) -> list[dict[str, Any]]:
    """Each GPU pass with its window (s), counter and sampled mean power (W), batch, precision."""
    con = sqlite3.connect(db)
    out = []
    for run, rid, kind, batch, precision, wall_s in con.execute(
            "SELECT run_id, result_id, kind, batch, precision, wall_s FROM train_passes"):
        rows = con.execute("SELECT t_ns, power_w, energy_j FROM telemetry WHERE result_id = ? "
                           "AND device LIKE 'cuda%' AND power_w IS NOT NULL AND energy_j IS NOT "
                           "NULL ORDER BY t_ns", (rid,)).fetchall()
        if len(rows) < 3:
            continue
        t = [r[0] for r in rows]
        counter_j, span_s = counter_energy_j(t, [r[2] for r in rows], t[0], t[-1])
        sampled_j, _ = integrate_power_j(t, [r[1] for r in rows], t[0], t[-1])
        if span_s <= 0 or sampled_j <= 0:
            continue
        out.append({"run": run, "kind": kind.split(":")[0], "batch": batch, "precision": precision,
                    "window_s": span_s, "wall_s": wall_s, "counter_w": counter_j / span_s,
                    "sampled_w": sampled_j / span_s, "ratio": counter_j / sampled_j})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("db", help="a results database holding train-predict runs")
    p.add_argument("--split-s", type=float, default=1.0, help="windows shorter / longer than this")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args()
    rows = passes(Path(a.db))
    short = [r["ratio"] for r in rows if r["window_s"] < a.split_s]
    long = [r["ratio"] for r in rows if r["window_s"] >= a.split_s]
    for name, ratios in ((f"under {a.split_s:g} s", short), (f"{a.split_s:g} s or more", long)):
        if ratios:
            print(f"windows {name}: {len(ratios)} passes, counter / sampled power "
                  f"{min(ratios):.2f}-{max(ratios):.2f}")
    # Per run, batch and precision: the compute probes' power beside the epochs'.
    power: dict[tuple[int, int, str], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list))
    for r in rows:
        if r["kind"] in ("compute", "epoch"):
            power[r["run"], r["batch"], r["precision"]][r["kind"]].append(r["counter_w"])
    for (run, batch, precision), kinds in sorted(power.items()):
        if len(kinds) == 2:
            print(f"run {run} b{batch} {precision}: " + ", ".join(
                f"{kind} {min(w):.0f}-{max(w):.0f} W" for kind, w in sorted(kinds.items())))
    if a.json_path:
        Path(a.json_path).write_text(json.dumps({"db": a.db, "passes": rows}, indent=1))


if __name__ == "__main__":
    main()
