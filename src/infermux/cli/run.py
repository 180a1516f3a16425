"""`infermux run PLAN` and `infermux plan`: run a plan under a load scenario, write plans."""

from __future__ import annotations

import shlex
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from infermux.cli._app import DbOpt, JsonOpt, _print_json, _progress, app, err, out
from infermux.cli.render import (
    num,
    run_headline,
    run_models_table,
    stages_table,
    timeline_text,
    workers_table,
)
from infermux.errors import UsageError

if TYPE_CHECKING:
    from infermux.runtime.trial import TrialSummary

__all__ = ["plan_command", "run_command"]

_SCENARIOS = ("offline", "server", "single-stream", "multi-stream")


@app.command("run")
def run_command(
    plan_file: Annotated[str, typer.Argument(help="Plan file (YAML or JSON); see `infermux plan --example`.")],
    scenario: Annotated[str | None, typer.Option("--scenario", help="offline, server, single-stream or multi-stream.")] = None,
    qps: Annotated[float | None, typer.Option("--qps", help="Server: Poisson arrival rate, queries/s.")] = None,
    p99: Annotated[str | None, typer.Option("--p99", help="Server: p99 latency bound, e.g. 15ms (a bare number is ms).")] = None,
    find_peak: Annotated[bool, typer.Option("--find-peak", help="Server: search the highest rate within --p99.")] = False,
    duration: Annotated[str | None, typer.Option("--duration", help="Minimum duration, e.g. 10s.")] = None,
    confirm_duration: Annotated[str | None, typer.Option("--confirm-duration", help="Find-peak: how long the runs that confirm the edge last, e.g. 40s (default: four times --duration).")] = None,
    stall_retries: Annotated[int | None, typer.Option("--stall-retries", help="Find-peak: run a trial that failed while the host or its device stopped again, at most this many times (default 2; 0: count every trial as it came).")] = None,
    peak_resolution: Annotated[float | None, typer.Option("--peak-resolution", help="Find-peak: how finely the edge is placed, as a share of the offline throughput (default 0.01; each halving is one more trial).")] = None,
    min_queries: Annotated[int | None, typer.Option("--min-queries", help="Minimum queries (samples offline).")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of arrivals and sample choice.")] = None,
    lengths: Annotated[str | None, typer.Option("--lengths", help="Query lengths of models with a sequence length: 128, uniform:16-256 or 32,64,128 (load.lengths).")] = None,
    db: DbOpt = "infermux.db",
    no_store: Annotated[bool, typer.Option("--no-store", help="Do not write the results database.")] = False,
    cluster: Annotated[str | None, typer.Option("--cluster", help="Run on a Ray cluster: ray://HOST:PORT, HOST:PORT, auto, or local:N (N local nodes to try it). PLAN is a cluster plan, or a local plan run on every node.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run a plan: workers on its units, its load scenario, metrics stored as a run."""
    from infermux._parse import parse_duration_s, parse_latency_ms
    from infermux.runtime import load_plan, run_plan, with_load
    from infermux.store import open_store

    if scenario is not None and scenario not in _SCENARIOS:
        raise UsageError(f"--scenario {scenario!r} unknown: use offline, server, single-stream "
                         "or multi-stream")
    if find_peak and scenario is None:
        scenario = "server"
    if cluster is not None:
        _run_cluster(plan_file, cluster, dict(
            scenario=scenario, rate_qps=qps,
            p99_bound_ms=parse_latency_ms(p99) if p99 is not None else None,
            find_peak=find_peak or None,
            min_duration_s=parse_duration_s(duration, name="--duration") if duration else None,
            min_queries=min_queries, seed=seed), None if no_store else db, as_json)
        return
    plan = load_plan(plan_file)
    plan = with_load(
        plan, scenario=scenario, rate_qps=qps, p99_bound_ms=parse_latency_ms(p99) if p99 is not None else None, find_peak=find_peak or None,
        min_duration_s=parse_duration_s(duration, name="--duration") if duration else None,
        confirm_duration_s=(parse_duration_s(confirm_duration, name="--confirm-duration")
                            if confirm_duration else None),
        stall_retries=stall_retries, peak_resolution=peak_resolution, min_queries=min_queries,
        seed=seed, lengths=lengths,
    )
    store = None if no_store else open_store(db)
    command = "infermux " + shlex.join(sys.argv[1:])
    with _progress() as progress:
        task = progress.add_task("starting", total=1.0)

        seen: set[str] = set()

        def on_progress(label: str, fraction: float) -> None:
            if label in _SCENARIOS and label not in seen:
                # A line in the log (the bar is transient): when each trial's load began.
                seen.add(label)
                progress.console.print(f"[dim]workers ready; running the {label} scenario[/]")
            progress.update(task, description=label, completed=fraction)

        report = run_plan(plan, store=store, progress=on_progress, command=command)
    if as_json:
        _print_json(report.to_dict())
    else:
        record = report.final
        if report.peak is not None:
            _print_peak(report.peak)
        if record is not None:
            out.print(run_headline(record))
            out.print(run_models_table(record))
            out.print(workers_table(record))
            stages = stages_table(record)
            if stages is not None:
                out.print(stages)
            timeline = timeline_text(record)
            if timeline:
                out.print(timeline)
        if report.run_id is not None:
            out.print(f"[dim]stored as run {report.run_id} in {db}[/]")
    if report.status == "interrupted":
        err.print("interrupted: what was measured so far is kept")
        raise typer.Exit(130)


@app.command("plan")
def plan_command(
    example: Annotated[bool, typer.Option("--example", help="Print an annotated example plan.")] = False,
    check: Annotated[str | None, typer.Option("--check", help="Validate a plan file.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write an example plan, or check one (every bad field is named with what is allowed)."""
    from infermux.runtime import EXAMPLE_PLAN, load_plan, parse_plan

    if example == (check is not None):
        raise UsageError("pass one of --example (print a plan) or --check FILE (validate one)")
    if example:
        if as_json:
            import yaml

            _print_json(parse_plan(yaml.safe_load(EXAMPLE_PLAN)).to_dict())
        else:
            sys.stdout.write(EXAMPLE_PLAN)
        return
    plan = load_plan(check or "")
    if as_json:
        _print_json({"valid": True, "plan": plan.to_dict()})
        return
    workers = sum(r.instances for m in plan.models for r in m.replicas)
    pipelines = sum(1 for m in plan.models if m.stages)
    piped = f", {pipelines} pipeline(s)" if pipelines else ""
    out.print(f"[green]valid[/]: {check} — {len(plan.models)} model(s), {workers} worker(s){piped}, "
              f"scenario {plan.load.scenario}, placement {plan.placement}")


def _print_peak(peak: dict[str, Any]) -> None:
    frac = peak.get("peak_fraction_of_offline")
    out.print(f"[bold]peak[/] {num(peak.get('peak_qps'))} qps within p99 ≤ "
              f"{peak['p99_bound_ms']:g} ms; offline {num(peak.get('offline_items_per_s'))}"
              f" samples/s" + (f", {num(after)} after the search" if (
                  after := peak.get("offline_after_items_per_s")) else "")
              + (f" ({frac:.0%} of offline)" if frac else ""))
    for t in peak["trials"]:
        out.print(f"  {t['rate_qps']:.1f} qps: p99 {num(t['p99_ms'], 2)} ms "
                  f"{'valid' if t['valid'] else 'invalid'}"
                  + (" (repeat)" if t.get("repeat") else "")
                  + (" (load generator lagged)" if t.get("load_generator_lag") else "")
                  + (f" (the host stopped {t['host_stall']['longest_ms']:.0f} ms"
                     + ("; run again)" if t.get("disturbed") else ")")
                     if t.get("host_stall") else ""))
    if peak.get("edge_confirmed") is not None:
        spread = peak.get("p99_spread_ms")
        out.print(f"  edge {'confirmed' if peak['edge_confirmed'] else 'not confirmed'} by "
                  "repeats" + (f"; p99 spread {spread:.2f} ms" if spread is not None else ""))
    host = peak.get("host") or {}
    if host:
        from infermux.runtime.host_probe import describe_probes

        out.print(f"  host hand-overs (before / after the search): {describe_probes(host)}")
    for note in peak.get("notes") or []:
        out.print(f"[yellow]note[/]: {escape(note)}", highlight=False)
    if peak.get("reason"):
        out.print(f"[yellow]no peak[/]: {escape(peak['reason'])}", highlight=False)


def _run_cluster(plan_file: str, address: str, overrides: dict[str, object], db: str | None,
                 as_json: bool) -> None:
    """`infermux run PLAN --cluster ADDRESS`: a runtime per Ray node, one load on them all."""
    from pathlib import Path

    from infermux.cluster import open_cluster, parse_address
    from infermux.cluster.driver import run_cluster
    from infermux.cluster.plan import cluster_plan_from_file
    from infermux.store import open_store

    parse_address(address)  # a bad address fails before anything starts
    path = Path(plan_file)
    plan = cluster_plan_from_file(plan_file, overrides)
    store = None if db is None else open_store(db)
    command = "infermux " + shlex.join(sys.argv[1:])
    with _progress() as progress:
        task = progress.add_task(f"connecting to {address}", total=1.0)

        def on_progress(label: str, fraction: float) -> None:
            progress.update(task, description=label, completed=fraction)

        with open_cluster(address) as handle:
            progress.console.print(f"[dim]cluster {address}: {len(handle.nodes())} node(s) "
                                   f"alive ({handle.started_s:.1f} s)[/]")
            report = run_cluster(plan, handle, store=store, progress=on_progress,
                                 command=command, base=path.parent)
    if as_json:
        _print_json(report.to_dict())
    else:
        record = report.record
        if report.peak is not None:
            _print_peak(report.peak)
        if record is not None:
            out.print(run_headline(record))
            out.print(_nodes_table(record))
            out.print(run_models_table(record))
            out.print(workers_table(record))
            for e in record.cluster.cluster_events if record.cluster is not None else []:
                if e["event"] == "node_lost":
                    out.print(f"[yellow]node {escape(str(e['node']))} lost[/] at {e['t_s']:.2f} "
                              f"s ({escape(str(e.get('reason')))}): {e['held_items']} items "
                              f"held, {e['rerouted_items']} retried on other nodes, "
                              f"{e['failed_items']} failed", highlight=False)
                elif e["event"] == "node_joined":
                    rates = ", ".join(f"{m} {r:.0f}/s" for m, r in e["rate_at_start"].items())
                    out.print(f"node {escape(str(e['node']))} joined at {e['t_s']:.2f} s, used "
                              f"after its start ({e['start_s']:.1f} s; measured {rates})",
                              highlight=False)
                elif e["event"] == "node_join_late":
                    out.print(f"[yellow]node {escape(str(e['node']))} did not join[/]: the run "
                              f"ended while it started ({e['start_s']:.1f} s in)",
                              highlight=False)
                elif e["event"] == "node_join_failed":
                    out.print(f"[yellow]node {escape(str(e['node']))} did not join[/] at "
                              f"{e['t_s']:.2f} s: {escape(str(e['error']))}", highlight=False)
        if report.run_id is not None:
            out.print(f"[dim]stored as run {report.run_id} in {db}[/]")
    if report.status == "interrupted":
        err.print("interrupted: what was measured so far is kept")
        raise typer.Exit(130)


def _nodes_table(record: TrialSummary) -> Table:
    table = Table(title="Nodes")
    for col in ("node", "address", "status", "samples", "share", "items/s", "joined at s",
                "lost at s", "retried"):
        table.add_column(col)
    for n in record.cluster.nodes if record.cluster is not None else []:
        table.add_row(escape(str(n["node"])), str(n["address"]), str(n["status"]),
                      str(n["completed_items"]), f"{n['share']:.0%}", num(n["items_per_s"]),
                      num(n.get("joined_at_s"), 2), num(n["lost_at_s"], 2),
                      str(n["rerouted_items"]))
    return table
