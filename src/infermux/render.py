"""Rich tables for results and units; rendering never changes the data it is given."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.table import Table

__all__ = ["bench_table", "compare_rows", "compare_table", "runs_table", "units_table"]


def _num(value: Any, digits: int = 1) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def units_table(units: Iterable[dict[str, Any]]) -> Table:
    """One row per unit: id, name, contention domain, availability and key facts."""
    table = Table(title="Execution units")
    for col in ("unit", "name", "contention domain", "available", "details"):
        table.add_column(col)
    for unit in units:
        d = unit.get("details", {})
        facts = []
        if "memory_bytes" in d:
            facts.append(f"{d['memory_bytes'] / 2**30:.0f} GiB, {d['sm_count']} SMs, "
                         f"cc {d['compute_capability']}")
        if unit.get("kind") == "cpu":
            facts.append(f"{len(unit['cores'])} cores, {' '.join(d.get('isa', [])) or 'no ISA flags'}")
        table.add_row(unit["id"], unit["name"], unit["contention_domain"],
                      "yes" if unit["available"] else f"no: {unit['reason']}", "; ".join(facts))
    return table


def bench_table(results: Iterable[dict[str, Any]], title: str = "Offline benchmark") -> Table:
    """One row per measured point: throughput, latency percentiles and where the time went.

    p90/p95 are left to `--json` and `results show --json` so the table fits 100 columns.
    """
    table = Table(title=title)
    for col, justify in (("unit", "left"), ("engine", "left"), ("batch", "right"),
                         ("inst", "right"), ("items/s", "right"), ("p50 ms", "right"),
                         ("p99 ms", "right"), ("max ms", "right"),
                         ("h2d/comp/d2h ms", "right"), ("agree", "left"), ("valid", "left")):
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    results = list(results)
    energy = any(r.get("energy_per_item_j") is not None for r in results)
    if energy:
        table.add_column("J/item", justify="right")
        table.add_column("W mean/peak", justify="right")
    for r in results:
        extra = [_num(r.get("energy_per_item_j"), 4),
                 f"{_num(r.get('mean_power_w'))}/{_num(r.get('peak_power_w'))}"] if energy else []
        if r["status"] != "ok":
            table.add_row(r["unit"], r["engine"], str(r["batch"]), str(r["instances"]),
                          r["status"].upper(), "", "", "", "", "", (r.get("error") or "")[:80],
                          *(["", ""] if energy else []))
            continue
        phases = "/".join(_num(r.get(f"{p}_ms"), 2) for p in ("h2d", "compute", "d2h"))
        if not r.get("h2d_ms") and not r.get("d2h_ms"):
            phases = f"–/{_num(r.get('compute_ms'), 2)}/–"  # host units: no copies
        table.add_row(
            r["unit"], r["engine"], str(r["batch"]), str(r["instances"]),
            _num(r.get("throughput_items_per_s")), _num(r.get("p50_ms"), 2),
            _num(r.get("p99_ms"), 2), _num(r.get("max_ms"), 2), phases,
            _agreement(r.get("agreement")),
            "yes" if r["valid"] else f"no: {r.get('validity_note', '')}", *extra,
        )
    return table


def _agreement(entry: dict[str, Any] | None) -> str:
    """`ok 3e-06` / `FAIL 0.4` / `skipped`: the agreement check in a few characters."""
    if not entry:
        return "–"
    if entry.get("status") == "skipped":
        return "skipped"
    err = entry.get("rel_err")
    figure = f" {err:.0e}" if isinstance(err, float) else ""
    if entry.get("status") == "fail":
        return f"[bold red]FAIL{figure}[/]"
    return f"ok{figure} {entry.get('precision', '')}".rstrip()


def runs_table(runs: Iterable[dict[str, Any]]) -> Table:
    """One row per stored run."""
    table = Table(title="Runs")
    for col in ("id", "kind", "status", "started (UTC)", "model", "results", "command"):
        table.add_column(col)
    for run in runs:
        table.add_row(str(run["id"]), run["kind"], run["status"], run["started_at"],
                      str(run.get("model") or ""), str(run.get("results", "")),
                      (run.get("command") or "")[:60])
    return table


def compare_table(a: dict[str, Any], b: dict[str, Any]) -> Table:
    """Points of two runs matched by (model, unit, engine, batch, instances, data), with ratios."""
    table = Table(title=f"Run {a['id']} vs run {b['id']}")
    for col in ("model", "unit", "engine", "batch", "inst", f"items/s #{a['id']}",
                f"items/s #{b['id']}", "ratio", f"p99 ms #{a['id']}", f"p99 ms #{b['id']}"):
        table.add_column(col)
    for row in compare_rows(a, b):
        table.add_row(row["model"], row["unit"], row["engine"], str(row["batch"]),
                      str(row["instances"]), _num(row["a_items_per_s"]),
                      _num(row["b_items_per_s"]), _num(row["ratio"], 3),
                      _num(row["a_p99_ms"], 2), _num(row["b_p99_ms"], 2))
    return table


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Matched points of two runs; `ratio` is b's throughput over a's."""
    def key(r: dict[str, Any]) -> tuple:
        return (r["model"], r["unit"], r["engine"], r["batch"], r["instances"], r["data"])

    left = {key(r): r for r in a["results"]}
    right = {key(r): r for r in b["results"]}
    rows = []
    for k in sorted(set(left) | set(right), key=lambda t: tuple(str(x) for x in t)):
        ra, rb = left.get(k, {}), right.get(k, {})
        ta, tb = ra.get("throughput_items_per_s"), rb.get("throughput_items_per_s")
        rows.append({
            "model": k[0], "unit": k[1], "engine": k[2], "batch": k[3], "instances": k[4],
            "data": k[5], "a_items_per_s": ta, "b_items_per_s": tb,
            "ratio": (tb / ta) if ta and tb else None,
            "a_p99_ms": ra.get("p99_ms"), "b_p99_ms": rb.get("p99_ms"),
        })
    return rows
