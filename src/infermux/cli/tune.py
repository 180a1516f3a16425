"""`infermux tune`: search the best plan for some models on this machine and write it."""

from __future__ import annotations

import shlex
import sys
from typing import Annotated, Any

import typer
from rich.markup import escape

from infermux.cli._app import DbOpt, JsonOpt, _print_json, _progress, app, err, out
from infermux.cli.render import explain_table, num, pareto_table, pipelines_table

__all__ = ["tune_command"]

def _compile_modes(text: str) -> tuple[str, ...]:
    """`--compile`: a comma list of torch.compile modes, or none."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    return () if modes in ((), ("none",)) else modes


@app.command("tune")
def tune_command(
    model: Annotated[list[str], typer.Option("--model", "-m", help="Model to tune (repeat for several): resnet50, timm:NAME, file.py:fn, x.onnx.")],
    units: Annotated[str, typer.Option("--units", "-u", help="Units or globs, comma-separated, or auto.")] = "auto",
    engine: Annotated[str, typer.Option("--engine", help="Engines to consider: auto or a comma list.")] = "auto",
    scenario: Annotated[str, typer.Option("--scenario", help="offline, or server (needs --p99).")] = "offline",
    p99: Annotated[str | None, typer.Option("--p99", help="Server: p99 latency bound, e.g. 15ms (a bare number is ms).")] = None,
    max_memory: Annotated[str | None, typer.Option("--max-memory", help="Device memory per config, e.g. 8GiB.")] = None,
    max_power: Annotated[float | None, typer.Option("--max-power", help="Mean power bound in W.")] = None,
    objective: Annotated[str, typer.Option("--objective", help="throughput, energy, latency or pareto.")] = "throughput",
    budget: Annotated[str, typer.Option("--budget", help="Wall-time budget, e.g. 10m.")] = "10m",
    batch: Annotated[str | None, typer.Option("--batch", "-b", help="Batch ladder, e.g. 1,2,4,8 (default powers of 2).")] = None,
    max_instances: Annotated[int, typer.Option("--max-instances", help="Most instances per unit.")] = 4,
    compile_modes: Annotated[str, typer.Option("--compile", help="torch.compile modes tried on GPUs: a comma list of default, reduce-overhead, max-autotune (minutes per batch size), max-autotune-no-cudagraphs; or none.")] = "default",
    trial_duration: Annotated[str, typer.Option("--trial-duration", help="Minimum duration of each trial.")] = "1s",
    trial_queries: Annotated[int, typer.Option("--trial-queries", help="Minimum items of each trial.")] = 64,
    input_shape: Annotated[str | None, typer.Option("--input-shape", help="One item's shape, e.g. 3x224x224.")] = None,
    seq: Annotated[str | None, typer.Option("--seq", help="Sequence lengths to compile (models with one), e.g. 32,64,128; default: candidates from --lengths.")] = None,
    lengths: Annotated[str | None, typer.Option("--lengths", help="Query lengths of models with a sequence length: 128, uniform:16-256 or 32,64,128 (load.lengths).")] = None,
    data: Annotated[str, typer.Option("--data", help="host: copies timed; device: pre-staged.")] = "host",
    out_file: Annotated[str | None, typer.Option("--out", "-o", help="Plan file to write (default tuned-MODEL.yaml).")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Measure everything again; ignore stored trials.")] = False,
    no_fine_tune: Annotated[bool, typer.Option("--no-fine-tune", help="Stop after the ladders and combinations.")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the fine-tuning sampler.")] = 0,
    pipelines: Annotated[bool, typer.Option("--pipelines/--no-pipelines", help="With 2+ CPU core sets or GPUs: measure the partitioner's best pipelines beside the replica plans.")] = True,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Measure the chosen plan through the runtime when the search measured it in-process.")] = True,
    peak_trial_duration: Annotated[str, typer.Option("--peak-trial-duration", help="Server scenario: minimum duration of each find-peak rate's trial (at least 3× --trial-duration).")] = "2s",
    peak_trial_queries: Annotated[int, typer.Option("--peak-trial-queries", help="Server scenario: minimum queries of each find-peak rate's trial.")] = 256,
    served: Annotated[str, typer.Option("--served", help="Server scenario: serve the plans of the best runtime peaks with `infermux serve` and write the one clients get the most from within --p99, driven over grpc or http (closed-loop concurrency sweep); none: the runtime's peak decides.")] = "none",
    served_front: Annotated[str, typer.Option("--served-front", help="With --served: serve's --front (own or triton), or own,triton: each candidate served through each front, the plan written with the front that served it most.")] = "own",
    served_fronts: Annotated[int | None, typer.Option("--served-fronts", help="With --served: serve's --fronts (default: serve's).")] = None,
    served_max_concurrency: Annotated[int, typer.Option("--served-max-concurrency", help="With --served: the highest concurrency the sweep may reach.")] = 512,
    served_seconds: Annotated[float, typer.Option("--served-seconds", help="With --served: measured seconds per concurrency level (after 1 s of warm-up).")] = 3.0,
    served_shared_memory: Annotated[str, typer.Option("--served-shared-memory", help="With --served and --perf-analyzer: perf_analyzer's --shared-memory (none, system or cuda).")] = "none",
    perf_analyzer: Annotated[str | None, typer.Option("--perf-analyzer", help="With --served: Triton's perf_analyzer (its path) as the client instead of the built-in one (a Python client may bound rates of tens of thousands of requests/s).")] = None,
    db: DbOpt = "infermux.db",
    as_json: JsonOpt = False,
) -> None:
    """Find the fastest plan across this machine's units under latency, memory and power bounds."""
    from infermux._parse import (
        parse_batches,
        parse_bytes,
        parse_duration_s,
        parse_latency_ms,
        parse_shape,
    )
    from infermux.cli.bench import _lengths
    from infermux.models import ModelSpec
    from infermux.store import open_store
    from infermux.tune import Constraints, TrialSettings, TuneRequest, model_name, run_tune
    from infermux.tune.hosting import hosting_word
    from infermux.tune.search import speed_note
    from infermux.tune.served import ServedSettings, served_words

    if served.strip().lower() == "none" and (perf_analyzer or served_fronts is not None
                                             or served_front != "own"
                                             or served_max_concurrency != 512
                                             or served_shared_memory != "none"):
        from infermux.errors import UsageError

        raise UsageError("--perf-analyzer and the --served-* options drive --served: add "
                         "--served grpc (or http)")
    shape = parse_shape(input_shape) if input_shape else None
    constraints = Constraints(
        p99_bound_ms=parse_latency_ms(p99) if p99 is not None else None,
        max_memory_bytes=parse_bytes(max_memory, name="--max-memory") if max_memory else None,
        max_power_w=max_power)
    request = TuneRequest(
        models=[ModelSpec(m, None, shape) for m in model], units=units, engines=engine,
        scenario=scenario, objective=objective, constraints=constraints,
        budget_s=parse_duration_s(budget, name="--budget"),
        batches=parse_batches(batch) if batch else None, max_instances=max_instances,
        compile_modes=_compile_modes(compile_modes),
        trial=TrialSettings(min_duration_s=parse_duration_s(trial_duration, name="--trial-duration"),
                            min_queries=trial_queries, data=data, lengths=lengths),
        fresh=fresh, seed=seed, fine_tune=not no_fine_tune, pipelines=pipelines,
        seq_buckets=_lengths(seq) if seq else None, verify=verify,
        peak_min_duration_s=parse_duration_s(peak_trial_duration, name="--peak-trial-duration"),
        peak_min_queries=peak_trial_queries,
        served=None if served.strip().lower() == "none" else ServedSettings(
            protocol=served.strip().lower(), front=served_front, fronts=served_fronts,
            seconds=served_seconds, max_concurrency=served_max_concurrency,
            perf_analyzer=perf_analyzer,
            shared_memory=served_shared_memory))
    path = out_file or f"tuned-{'-'.join(model_name(m) for m in model)}.yaml"
    store = open_store(db)
    command = "infermux " + shlex.join(sys.argv[1:])
    with _progress() as progress:
        task = progress.add_task("discovering units", total=request.budget_s)

        def on_trial(phase: str, info: dict[str, Any]) -> None:
            t = info["trial"]
            used = info["budget_s"] - info["left_s"]
            figure = (f"{t.items_per_s:,.1f} items/s" if t.ok
                      else f"[red]{t.status}[/]: {escape(t.error or 'no measurement')}")
            progress.console.print(
                f"[dim]{phase:>9}[/] {escape(t.candidate.label())}: {figure}"
                + (" [dim](stored)[/]" if t.reused else f" [dim]({t.method}, {t.cost_s:.1f}s)[/]"))
            progress.update(task, completed=used,
                            description=f"{phase} · {info['measured']} trials")

        def on_measure(label: str, fraction: float) -> None:
            progress.update(task, description=label[:60])

        report = run_tune(request, store=store, out_path=path, progress=on_trial,
                          measure_progress=on_measure, command=command)
    data_out = report.to_dict()
    if as_json:
        _print_json(data_out)
        return
    result = report.result
    out.print(explain_table(data_out))
    if result.pareto and (objective == "pareto" or len(result.pareto) > 1):
        out.print(pareto_table(data_out["pareto"]))
    if data_out["pipelines"]:
        out.print(pipelines_table(data_out))
    if data_out["pipelines_note"]:
        out.print(f"[bold]pipelines[/]: {escape(data_out['pipelines_note'])}")
    if report.server_peak is not None:
        peak = report.server_peak
        out.print(f"[bold]server[/]: peak {num(peak.get('peak_qps'))} qps within p99 ≤ "
                  f"{peak['p99_bound_ms']:g} ms")
    if len(report.server_peaks) > 1 or report.served is not None:
        for row in report.server_peaks:
            mark = "[bold]chosen[/]" if row["chosen"] else "      "
            hosted = (f", CPU workers as {hosting_word(row['cpu_workers'])}"
                      + (f" (round {row['hosting_round']})" if row.get("hosting_round") else "")
                      if row.get("cpu_workers") else "")
            frac = row.get("peak_fraction_of_offline")
            out.print(f"  {mark} {escape(row['plan'])}{hosted}, {row['batching']} batching: "
                      f"offline {num(row.get('search_offline_items_per_s') or row['offline_items_per_s'])}"
                      f" items/s, peak {num(row['peak_qps'])} qps"
                      + (f" ({frac:.0%} of offline)" if frac else "")
                      + (f" ({escape(str(row['reason']))})" if row["peak_qps"] is None and row["reason"] else ""))
            words = served_words(row)
            if report.served is not None and words is not None:
                out.print(f"         served over {report.served['protocol']}: {escape(words)}")
    if report.served is not None and report.served.get("reason"):
        out.print(f"[bold]served[/]: {escape(report.served['reason'])}")
    if report.hosting is not None:
        out.print(f"[bold]CPU workers[/]: {hosting_word(report.hosting['cpu_workers'])} written: "
                  f"{escape(report.hosting['reason'])}")
    failed = data_out["failed"]
    if failed:
        first = failed[0]
        out.print(f"[dim]{len(failed)} trial(s) failed or were invalid, e.g. {escape(first['plan'])}: "
                  f"{first['status']}: {escape(str(first['error']))} (all of them: --json, `failed`)[/]")
    moved = speed_note(result)
    if moved:
        out.print(f"[yellow]note: {escape(moved)}[/]")
    if result.skipped:
        out.print(f"[dim]not measured, their torch.compile build would not fit the budget: "
                  f"{', '.join(result.skipped[:4])}{' …' if len(result.skipped) > 4 else ''}[/]")
    out.print(f"{result.measured} candidates measured "
              f"({data_out['reused']} reused from the store) of {result.space['plans']} plans "
              f"in {result.elapsed_s:.0f}s" + (" — budget reached" if result.stopped_by_budget
                                                else ""))
    if report.plan_path:
        out.print(f"plan written to [bold]{report.plan_path}[/]: run it with "
                  f"`infermux run {report.plan_path}`")
    else:
        err.print("no plan meets the constraints: relax --p99, --max-memory or --max-power, "
                  "or raise --budget")
        raise typer.Exit(1)
    if report.run_id is not None:
        out.print(f"[dim]stored as run {report.run_id} in {db}[/]")
