"""`infermux characterize`: accuracy, determinism and rebuild variance of every engine and precision."""

from __future__ import annotations

from typing import Annotated

import typer

from infermux.cli._app import DbOpt, JsonOpt, _print_json, _run_with_progress, app, out, parse_options
from infermux.cli.render import accuracy_table, causes_table, determinism_table

__all__ = ["accuracy_table", "causes_table", "characterize", "determinism_table"]


@app.command()
def characterize(
    model: Annotated[str, typer.Option("--model", "-m", help="digits-cnn (built in), resnet50, timm:NAME, file.py:fn, x.onnx")],
    units: Annotated[str, typer.Option("--units", "-u", help="Units, comma-separated: cpu, cuda:0/fp32, cuda:0/fp16, openvino:CPU, ...")] = "cpu",
    engine: Annotated[str, typer.Option("--engine", help="torch, onnxruntime, openvino, tensorrt, a comma list, or auto.")] = "auto",
    builds: Annotated[int, typer.Option("--builds", help="Builds per variant, each in a fresh process.")] = 5,
    data: Annotated[str | None, typer.Option("--data", help="ImageFolder directory, .npz/.pt file with x and y, or digits (default).")] = None,
    items: Annotated[int | None, typer.Option("--items", help="Items evaluated (default: all; 1000 from a folder).")] = None,
    calibration_items: Annotated[int, typer.Option("--calibration-items", help="Held-out items for int8 calibration.")] = 128,
    batch: Annotated[int, typer.Option("--batch", "-b", help="Batch size of the evaluation and latency runs.")] = 32,
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="Batch sizes items are also run in, against alone.")] = "8",
    int8: Annotated[bool, typer.Option("--int8/--no-int8", help="Add int8 (ONNX Runtime static quantization) for ONNX Runtime and OpenVINO on CPUs.")] = True,
    causes: Annotated[bool, typer.Option("--causes/--no-causes", help="Measure each variance again with each knob pinned.")] = True,
    share_cache: Annotated[bool, typer.Option("--share-cache", help="Builds share the infermux cache (default: a fresh one per build).")] = False,
    weights: Annotated[str | None, typer.Option("--weights", help="State dict or checkpoint file.")] = None,
    input_shape: Annotated[str | None, typer.Option("--input-shape", help="One item, e.g. 3x224x224.")] = None,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="Engine option KEY=VALUE or ENGINE.KEY=VALUE; also cudnn_benchmark, deterministic, mkldnn, inductor_autotune.")] = None,
    latency_runs: Annotated[int, typer.Option("--latency-runs", help="Least batches timed per build (after warm-up).")] = 20,
    latency_time: Annotated[str, typer.Option("--latency-time", help="Least time of timed batches per build.")] = "0.5s",
    plugin: Annotated[list[str] | None, typer.Option("--plugin", help="Module or .py file every build imports first (engines it registers).")] = None,
    build_timeout: Annotated[str, typer.Option("--build-timeout", help="Longest time one build may take.")] = "30m",
    db: DbOpt = "infermux.db",
    no_store: Annotated[bool, typer.Option("--no-store", help="Do not write the results database.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Accuracy, determinism across builds and within a build, and what removes each variance."""
    from infermux._parse import parse_batches, parse_duration_s, parse_shape
    from infermux.characterize import CharacterizeConfig, run_characterize
    from infermux.models import ModelSpec

    config = CharacterizeConfig(
        model=ModelSpec(model, weights, parse_shape(input_shape) if input_shape else None),
        units=units, engine=engine, builds=builds, data=data, items=items,
        calibration_items=calibration_items, batch=batch,
        batch_sizes=tuple(parse_batches(batch_sizes)), int8=int8, causes=causes,
        share_cache=share_cache, options=parse_options(option or []),
        latency_runs=latency_runs, latency_s=parse_duration_s(latency_time, name="--latency-time"),
        imports=tuple(plugin or ()),
        build_timeout_s=parse_duration_s(build_timeout, name="--build-timeout"),
    )
    config.validate()
    report = _run_with_progress(run_characterize, config, db=db, no_store=no_store)
    data_out = report.to_dict()
    if as_json:
        _print_json(data_out)
    else:
        out.print(accuracy_table(data_out))
        out.print(determinism_table(data_out))
        table = causes_table(data_out)
        if table is not None:
            out.print(table)
        for note in data_out["notes"]:
            out.print(note, style="dim", markup=False, highlight=False)
        if report.run_id is not None:
            out.print(f"[dim]stored as run {report.run_id} in {db}[/]")
    if report.status != "complete":
        raise typer.Exit(1)
