"""`infermux characterize`: accuracy, determinism and rebuild variance of every engine and precision."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from infermux.cli import DbOpt, JsonOpt, _print_json, _run_with_progress, app, out, parse_options

__all__ = ["accuracy_table", "causes_table", "characterize", "determinism_table"]


def _pct(entry: dict[str, Any] | None) -> str:
    if not entry or entry.get("value") is None:
        return "–"
    return f"{entry['value']:.1%} [{entry['low']:.1%}, {entry['high']:.1%}]"


def _g(value: float | None) -> str:
    if value is None:
        return "–"
    return "0" if value == 0 else f"{value:.2g}"


def _precision(v: dict[str, Any]) -> str:
    computed = v.get("computed_precision")
    if computed and computed != v["precision"]:
        return f"{v['precision']} ({computed})"
    return v["precision"]


def _label(v: dict[str, Any]) -> list[str]:
    engine = v["engine"] if v["config"] == "default" else f"{v['engine']} [{v['config']}]"
    return [v["unit"], engine, _precision(v)]


def accuracy_table(report: dict[str, Any]) -> Table:
    """One row per variant: accuracy against labels and the fp32 reference, logit errors."""
    table = Table(title=f"{report['model']['name']} — accuracy on {report['data']['items']} items "
                        f"of {report['data']['name']} (95% intervals)")
    failed = any(not v.get("accuracy") for v in report["variants"])
    for col, justify in (("unit", "left"), ("engine", "left"), ("precision", "left"),
                         ("top-1", "right"), ("top-5", "right"), ("agrees with fp32", "right"),
                         ("max |err|", "right"), ("mean |err|", "right"), ("rel err", "right"),
                         *((("error", "left"),) if failed else ())):
        table.add_column(col, justify=justify)
    for v in report["variants"]:
        acc = v.get("accuracy")
        if not acc:
            table.add_row(*_label(v), "–", "–", "–", "–", "–", "–", str(v.get("error")))
            continue
        mean = acc["mean_abs_err"]
        table.add_row(*_label(v), _pct(acc.get("top1")), _pct(acc.get("top5")),
                      _pct(acc.get("agree_top1")), _g(acc.get("max_abs_err")),
                      f"{_g(mean['value'])} ±{_g((mean['high'] or 0) - (mean['value'] or 0))}"
                      if mean.get("value") is not None else "–",
                      _g(acc.get("rel_err")), *(("",) if failed else ()))
    return table


def _within(det: dict[str, Any]) -> tuple[str, str]:
    r2r = det.get("run_to_run")
    if r2r is None:
        run_to_run = "–"
    elif r2r["builds_varying"]:
        run_to_run = f"differs ({_g(r2r['max_abs_diff'])}, {r2r['top1_flips']} flips)"
    else:
        run_to_run = "identical"
    sizes = det.get("batch_dependence") or []
    varying = [e for e in sizes if e["builds_varying"]]
    if not sizes:
        batch = "–"
    elif varying:
        batch = ", ".join(f"b{e['batch']}: {_g(e['max_abs_diff'])}"
                          + (f" ({e['top1_flips']} flips)" if e["top1_flips"] else "")
                          for e in varying)
    else:
        batch = "identical at " + ",".join(str(e["batch"]) for e in sizes)
    return run_to_run, batch


def determinism_table(report: dict[str, Any]) -> Table:
    """One row per variant: variance across builds, within a build, and latency across builds."""
    table = Table(title="Determinism — builds in fresh processes; within a build: the same inputs "
                        "twice, items alone vs in batches")
    for col, justify in (("unit", "left"), ("engine", "left"), ("precision", "left"),
                         ("builds", "right"), ("distinct", "right"), ("max diff", "right"),
                         ("top-1 flips", "right"), ("run-to-run", "left"),
                         ("batch-size dependence", "left"), ("latency ms (min–max)", "right"),
                         ("spread", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for v in report["variants"]:
        det = v["determinism"]
        rebuild = det.get("rebuild") or {}
        lat = det.get("latency")
        run_to_run, batch = _within(det)
        builds = f"{det['builds_ok']}/{det['builds']}"
        table.add_row(
            *_label(v), builds, str(rebuild.get("distinct", "–")), _g(rebuild.get("max_abs_diff")),
            str(rebuild.get("top1_flips", "–")), run_to_run, batch,
            f"{lat['median_ms']:.3g} ({lat['min_ms']:.3g}–{lat['max_ms']:.3g})" if lat else "–",
            f"{lat['spread']:.0%}" if lat and lat.get("spread") is not None else "–")
    return table


def causes_table(report: dict[str, Any]) -> Table | None:
    """One row per knob pinned against a variance: what it removed and its throughput cost."""
    rows = [(v, c) for v in report["variants"] for c in v["causes"]]
    if not rows:
        return None
    table = Table(title="Causes — each variance measured again with one knob pinned")
    for col, justify in (("variant", "left"), ("variance", "left"), ("knob pinned", "left"),
                         ("builds", "right"), ("removes", "left"), ("left (max diff)", "left"),
                         ("items/s vs baseline", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for v, c in rows:
        removes = ", ".join(f"{k}: {'yes' if ok else 'no' if ok is False else '?'}"
                            for k, ok in c["removes"].items())
        det = c["determinism"]
        left = []
        if "rebuild" in c["variance_left"] and det.get("rebuild"):
            left.append(f"rebuild {_g(det['rebuild']['max_abs_diff'])}")
        if "run-to-run" in c["variance_left"] and det.get("run_to_run"):
            left.append(f"run-to-run {_g(det['run_to_run']['max_abs_diff'])}")
        sizes = [e for e in det.get("batch_dependence") or [] if e["builds_varying"]]
        if sizes:
            left.append("batch " + ", ".join(f"b{e['batch']} {_g(e['max_abs_diff'])}" for e in sizes))
        ratio = c.get("throughput_ratio")
        table.add_row(" ".join(_label(v)), ", ".join(v["determinism"]["variance"]), c["title"],
                      str(c["builds"]), removes,
                      "; ".join(left) or ("none" if not c["errors"] else f"error: {c['errors'][0]}"),
                      f"{ratio:.2f}×" if ratio else "–")
    return table


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
