"""`infermux monitor`: live readings of every telemetry source; optionally recorded to the store."""

from __future__ import annotations

import shlex
import sys
import time
from typing import Annotated

import typer
from rich.live import Live

from infermux.cli._app import DbOpt, JsonOpt, _print_json, app, err, out
from infermux.cli.render import readings_table

__all__ = ["monitor", "readings_table"]


@app.command()
def monitor(
    duration: Annotated[str | None, typer.Option("--duration", "-d", help="How long, e.g. 30s; default until Ctrl-C (2s with --json).")] = None,
    interval: Annotated[str, typer.Option("--interval", "-i", help="Sampling period, e.g. 100ms.")] = "100ms",
    units: Annotated[str | None, typer.Option("--units", "-u", help="Only the sources for these units, e.g. cuda:0/fp16.")] = None,
    record: Annotated[bool, typer.Option("--record", help="Store the window's time series and summary in the database.")] = False,
    db: DbOpt = "infermux.db",
    as_json: JsonOpt = False,
) -> None:
    """Live power, energy, utilisation, clocks and throttling of every source."""
    from infermux._parse import parse_duration_s
    from infermux.errors import UsageError
    from infermux.telemetry import Sampler
    from infermux.telemetry.monitor import record_window, window_report

    interval_s = parse_duration_s(interval, name="--interval")
    duration_s = parse_duration_s(duration, name="--duration") if duration else (
        2.0 if as_json else None)
    if duration_s is not None and duration_s <= 0:
        raise UsageError(f"--duration {duration!r} must be more than 0, e.g. --duration 10s")
    if units:
        from infermux.units import discover, select_units

        sampler = Sampler.for_units(select_units(units, discover(with_runtimes=False)),
                                    interval_s=interval_s)
    else:
        sampler = Sampler(interval_s=interval_s)
    interrupted = False
    with sampler:
        t0 = time.perf_counter_ns()
        try:
            if as_json:
                time.sleep(duration_s or 0)
            else:
                with Live(readings_table(sampler.latest()), console=out, auto_refresh=False,
                          transient=False) as live:
                    end = None if duration_s is None else time.monotonic() + duration_s
                    while end is None or time.monotonic() < end:
                        step = interval_s if end is None else min(interval_s, end - time.monotonic())
                        time.sleep(max(0.0, step))
                        live.update(readings_table(sampler.latest(), title="Telemetry (Ctrl-C to stop)"),
                                    refresh=True)
        except KeyboardInterrupt:
            interrupted = True
        t1 = time.perf_counter_ns()
        window = sampler.window(t0, t1)
    result = window_report(sampler, window, interval_s)
    if record:
        from infermux.store import open_store

        with open_store(db) as store:
            result["run_id"] = record_window(
                store, window, result, interrupted=interrupted,
                config={"interval_s": interval_s, "units": units, "duration_s": duration_s},
                command="infermux " + shlex.join(sys.argv[1:]))
    if as_json:
        _print_json(result)
        return
    for note in result["notes"]:
        out.print(f"[dim]{note}[/]")
    cost = window.cost
    out.print(f"[dim]{len(window.ticks)} ticks over {result['duration_s']:.1f}s; sampler cost "
              f"{cost.cpu_per_tick_us:.0f} µs CPU per tick ({cost.cpu_share_pct:.2f}% of a core)[/]")
    for flag in result["flags"]:
        err.print(f"flag: {flag}")
    if record:
        out.print(f"[dim]stored as run {result['run_id']} in {db}[/]")
