"""`infermux bench`: the offline benchmark."""

from __future__ import annotations

from typing import Annotated

import typer

from infermux.cli._app import (
    DbOpt,
    JsonOpt,
    _print_json,
    _run_with_progress,
    _sampler_period_s,
    app,
    err,
    out,
    parse_options,
)
from infermux.errors import UsageError


@app.command()
def bench(
    model: Annotated[str, typer.Option("--model", "-m", help="resnet50, timm:NAME, file.py:fn, x.onnx")],
    units: Annotated[str, typer.Option("--units", "-u", help="Units or globs, comma-separated.")] = "cpu",
    batch: Annotated[str, typer.Option("--batch", "-b", help="Batch sizes, e.g. 1,8,64.")] = "1,8,64",
    engine: Annotated[str, typer.Option("--engine", help="torch, onnxruntime, openvino, tensorrt, a comma list, or auto (every engine usable on each unit, side by side).")] = "torch",
    instances: Annotated[int, typer.Option("--instances", help="Instances per unit.")] = 1,
    data: Annotated[str, typer.Option("--data", help="host: copies timed; device: pre-staged.")] = "host",
    min_duration: Annotated[str, typer.Option("--min-duration", help="e.g. 10s")] = "10s",
    min_queries: Annotated[int, typer.Option("--min-queries", help="Minimum items measured.")] = 1024,
    max_duration: Annotated[str | None, typer.Option("--max-duration", help="Stop a point after this (invalid).")] = None,
    warmup: Annotated[str, typer.Option("--warmup", help="Warm-up per point, excluded.")] = "1s",
    weights: Annotated[str | None, typer.Option("--weights", help="State dict or checkpoint file.")] = None,
    input_shape: Annotated[str | None, typer.Option("--input-shape", help="One item, e.g. 3x224x224.")] = None,
    seq: Annotated[str | None, typer.Option("--seq", help="Sequence lengths (the model's dynamic dims), e.g. 32,64,128.")] = None,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="Engine option KEY=VALUE or ENGINE.KEY=VALUE (repeatable).")] = None,
    db: DbOpt = "infermux.db",
    no_store: Annotated[bool, typer.Option("--no-store", help="Do not write the results database.")] = False,
    telemetry: Annotated[str, typer.Option("--telemetry", help="Sampler period (e.g. 100ms) or off.")] = "100ms",
    as_json: JsonOpt = False,
) -> None:
    """Offline benchmark: throughput and latency per (unit, batch), stored in the database."""
    from infermux._parse import parse_batches, parse_duration_s, parse_shape
    from infermux.bench import BenchConfig, run_bench
    from infermux.cli.render import bench_table
    from infermux.models import ModelSpec

    config = BenchConfig(
        model=ModelSpec(model, weights, parse_shape(input_shape) if input_shape else None),
        units=units,
        batches=parse_batches(batch),
        engine=engine,
        instances=instances,
        data=data,
        min_duration_s=parse_duration_s(min_duration, name="--min-duration"),
        min_queries=min_queries,
        max_duration_s=parse_duration_s(max_duration, name="--max-duration") if max_duration else None,
        warmup_s=parse_duration_s(warmup, name="--warmup"),
        options=parse_options(option or []),
        telemetry_interval_s=None if telemetry.strip().lower() == "off" else _sampler_period_s(telemetry),
        seq_buckets=_lengths(seq) if seq else None,
    )
    report = _run_with_progress(run_bench, config, db=db, no_store=no_store)
    if as_json:
        _print_json(report.to_dict())
    else:
        out.print(bench_table(report.to_dict()["results"],
                              title=f"{report.model.name} — offline benchmark"))
        out.print(f"[dim]model: {report.model.weights_note}[/]")
        if report.run_id is not None:
            out.print(f"[dim]stored as run {report.run_id} in {db}[/]")
    if report.status == "interrupted":
        err.print("interrupted: the points measured so far are kept")
        raise typer.Exit(130)
    if report.all_failed:
        first = report.measurements[0]
        why = first.error or (first.agreement or {}).get("message") or first.status
        err.print(f"every point failed ({len(report.measurements)} of "
                  f"{len(report.measurements)}); the first: {first.unit} {first.engine} "
                  f"b{first.batch}: {why}")
        raise typer.Exit(1)


def _lengths(text: str) -> list[int]:
    """`"32,64,128"` → `[32, 64, 128]`, or one line naming the bad entry."""
    lengths = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        if not item.isdigit() or int(item) < 1:
            raise UsageError(f"--seq {text!r}: {item!r} is not a length ≥ 1; pass e.g. --seq 32,128")
        lengths.append(int(item))
    if not lengths:
        raise UsageError(f"--seq {text!r} names no length; pass e.g. --seq 128")
    return lengths
