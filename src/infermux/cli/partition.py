"""`infermux partition`: cut points of a network, and a balanced pipeline plan across units."""

from __future__ import annotations

from typing import Annotated

import typer

from infermux.cli._app import (
    DbOpt,
    JsonOpt,
    _print_json,
    _progress,
    _run_with_progress,
    app,
    err,
    out,
    parse_options,
)
from infermux.cli.render import candidates_table, num, partition_tables

__all__ = ["partition"]


def _engines(spec: str) -> tuple[str, ...]:
    from infermux.engines import engine_status, list_engines
    from infermux.errors import UsageError

    status = engine_status()
    if spec.strip() == "auto":
        return tuple(name for name, (ok, _) in status.items() if ok)
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    for name in names:
        if name not in status:
            raise UsageError(f"--engines {name!r} is not an engine; engines: {', '.join(list_engines())}, "
                             "or auto")
        if not status[name][0]:
            raise UsageError(f"--engines {name!r} is not usable here: {status[name][1]}")
    if not names:
        raise UsageError("--engines is empty: name at least one engine, e.g. torch, or auto")
    return names


@app.command()
def partition(
    model: Annotated[str, typer.Option("--model", "-m", help="resnet50, timm:NAME, file.py:fn")],
    show: Annotated[bool, typer.Option("--show", help="Only list cut points and segments.")] = False,
    units: Annotated[str, typer.Option("--units", "-u", help="Units for the stages, e.g. cpu:0,cpu:1.")] = "cpu:0,cpu:1",
    stages: Annotated[int | None, typer.Option("--stages", help="Most stages (default: one per unit).")] = None,
    batch: Annotated[int, typer.Option("--batch", "-b", help="Items per batch in every stage.")] = 8,
    duplicate: Annotated[int, typer.Option("--duplicate", help="Most units one stage may be duplicated on.")] = 1,
    measure_top: Annotated[int, typer.Option("--measure-top", help="Measure this many best predicted plans.")] = 3,
    max_pieces: Annotated[int, typer.Option("--max-pieces", help="Most pieces to profile (cut points kept).")] = 12,
    buffers: Annotated[int, typer.Option("--buffers", help="Buffered batches per stage copy.")] = 2,
    duration: Annotated[str, typer.Option("--duration", help="Measured window per candidate.")] = "3s",
    warmup: Annotated[str, typer.Option("--warmup", help="Warm-up per candidate, excluded.")] = "1s",
    out_path: Annotated[str | None, typer.Option("--out", "-o", help="Write the kept plan as YAML.")] = None,
    weights: Annotated[str | None, typer.Option("--weights", help="State dict or checkpoint file.")] = None,
    input_shape: Annotated[str | None, typer.Option("--input-shape", help="One item, e.g. 3x224x224.")] = None,
    option: Annotated[list[str] | None, typer.Option("--option", help="Torch engine option KEY=VALUE.")] = None,
    engines: Annotated[str, typer.Option("--engines", "-e", help="Engines a stage may use: torch, onnxruntime, openvino, tensorrt, litert, comma-separated, or auto (every installed one).")] = "torch",
    db: DbOpt = "infermux.db",
    no_store: Annotated[bool, typer.Option("--no-store", help="Do not write the results database.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Cut a network into pipeline stages across units: profile, balance (exact DP), measure."""
    from infermux._parse import parse_duration_s, parse_shape
    from infermux.models import ModelSpec, load_model
    from infermux.models.graph import capture_graph
    from infermux.models.segments import split
    from infermux.partition.search import (
        PartitionConfig,
        check_partitionable,
        describe_graph,
        run_partition,
    )

    spec = ModelSpec(model, weights, parse_shape(input_shape) if input_shape else None)
    if show:
        loaded = load_model(spec)
        check_partitionable(loaded)
        with _progress() as progress:
            progress.add_task("capturing the graph", total=None)
            graph = capture_graph(loaded.module, loaded.input_shape)
            shown = describe_graph(graph, split(graph))
        if as_json:
            _print_json({"model": loaded.describe(), **shown})
            return
        for table in partition_tables(shown, loaded.name):
            out.print(table)
        for note in shown["notes"]:
            out.print(f"[dim]{note}[/]")
        return
    config = PartitionConfig(
        model=spec, units=units, batch=batch, max_stages=stages, max_dup=duplicate,
        top_k=measure_top, max_pieces=max_pieces, buffers=buffers,
        measure_s=parse_duration_s(duration, name="--duration"),
        warmup_s=parse_duration_s(warmup, name="--warmup"),
        options=parse_options(option or []),
        engines=_engines(engines),
    )
    report = _run_with_progress(run_partition, config, db=db, no_store=no_store)
    if out_path and report.best is not None:
        from infermux.partition.pipeline_file import save_pipeline

        save_pipeline(report.best, out_path)
    data = report.to_dict()
    if as_json:
        _print_json(data)
        return
    out.print(candidates_table(data))
    for c in report.candidates:
        if c.agreement is not None:
            checked = ", ".join(f"{a.start}→{a.end} {a.status} ({a.max_abs_err:.2g})"
                               if a.max_abs_err is not None else f"{a.start}→{a.end} {a.status}"
                               for a in c.agreement.stages)
            out.print(f"[dim]#{c.rank} against fp32 references: {c.agreement.status}; {checked}[/]")
    single = ", ".join(f"{u} {num(v)}" for u, v in report.single_unit.items())
    out.print(f"[dim]predicted single unit, items/s: {single}[/]")
    out.print(f"[dim]model: {report.model.weights_note}[/]")
    if report.best is None:
        err.print("no candidate could be measured: see the errors above")
        raise typer.Exit(1)
    if out_path:
        out.print(f"plan written to {out_path}")
    if report.run_id is not None:
        out.print(f"[dim]stored as run {report.run_id} in {db}[/]")
