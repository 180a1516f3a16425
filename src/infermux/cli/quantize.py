"""`infermux quantize`: a model written with its precision set in the file (fp16, bf16, int8)."""

from __future__ import annotations

from typing import Annotated

import typer

from infermux.cli._app import DbOpt, JsonOpt, _print_json, _run_with_progress, app, out

__all__ = ["quantize"]


@app.command()
def quantize(
    model: Annotated[str, typer.Option("--model", "-m", help="resnet50, timm:NAME, file.py:fn, x.onnx, digits-cnn")],
    precision: Annotated[str, typer.Option("--precision", "-p", help="fp16 or bf16 (casts, fp32 islands) or int8 (Q/DQ).")] = "int8",
    calibration_data: Annotated[str | None, typer.Option("--calibration-data", help="int8: image folder, (N, *input) .npy file, or random (timing only; the default).")] = None,
    calibration_items: Annotated[int, typer.Option("--calibration-items", help="int8: items calibrated on.")] = 256,
    method: Annotated[str, typer.Option("--method", help="int8: minmax, entropy or percentile (calibrated), or dynamic (no calibration; ONNX Runtime).")] = "minmax",
    tool: Annotated[str, typer.Option("--tool", help="int8 by onnxruntime or modelopt (NVIDIA ModelOpt, if installed).")] = "onnxruntime",
    output: Annotated[str | None, typer.Option("--output", help="Copy the ONNX file here (it is cached either way).")] = None,
    weights: Annotated[str | None, typer.Option("--weights", help="State dict or checkpoint file.")] = None,
    input_shape: Annotated[str | None, typer.Option("--input-shape", help="One item, e.g. 3x224x224.")] = None,
    db: DbOpt = "infermux.db",
    no_store: Annotated[bool, typer.Option("--no-store", help="Do not write the results database.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write the model as ONNX with its precision in the file (fp16, bf16 or int8 by Q/DQ).

    It is the file TensorRT 11 builds and cpu/int8 units run: the engines make the same file
    themselves, cached; this command shows it and keeps a copy.
    """
    from infermux._parse import parse_shape
    from infermux.models import ModelSpec
    from infermux.quantize import PrecisionConfig, run_precision

    config = PrecisionConfig(
        model=ModelSpec(model, weights, parse_shape(input_shape) if input_shape else None),
        precision=precision, calibration_data=calibration_data,
        calibration_items=calibration_items, method=method, tool=tool, output=output)
    config.validate()
    result = _run_with_progress(run_precision, config, db=db, no_store=no_store)
    if as_json:
        _print_json(result)
        return
    types = ", ".join(f"{k} {v}" for k, v in sorted(result["tensor_types"].items()))
    out.print(f"{result['model']} in {result['precision']}: {result['onnx_file']}",
              markup=False, highlight=False)
    out.print(f"tensors: {types}; Q/DQ pairs: {result['quantize_nodes']}; casts: "
              f"{result['cast_nodes']}; {result['seconds']:.1f} s", markup=False, highlight=False)
    if result["precision"] == "int8" and result.get("calibration_data") == "random":
        out.print("calibrated on seeded noise: right for timing, not for accuracy "
                  "(pass --calibration-data)", style="dim")
    if result.get("run_id") is not None:
        out.print(f"[dim]stored as run {result['run_id']} in {db}[/]")
