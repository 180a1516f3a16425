"""`infermux version`, `units` and `models`: what this machine and this install offer."""

from __future__ import annotations

from typing import Annotated

import typer

from infermux.cli._app import JsonOpt, _print_json, app, out


@app.command()
def version(as_json: JsonOpt = False) -> None:
    """Print infermux's version."""
    from infermux import __version__

    if as_json:
        _print_json({"version": __version__})
    else:
        out.print(f"infermux {__version__}")


@app.command()
def units(
    select: Annotated[str | None, typer.Argument(help="Glob or list, e.g. 'cuda:*/fp16'.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List this machine's execution units (CPU, GPUs per numeric mode, DLAs, OpenVINO)."""
    from infermux.cli.render import units_table
    from infermux.units import discover, select_units

    found = discover()
    chosen = select_units(select, found) if select else found.units
    if as_json:
        data = found.to_dict()
        data["units"] = [u.to_dict() for u in chosen]
        _print_json(data)
        return
    out.print(units_table(u.to_dict() for u in chosen))
    for name, info in found.runtimes.items():
        if info.get("available"):
            extra = info.get("providers") or info.get("devices") or ""
            out.print(f"[green]{name}[/] {info['version']} {extra}")
    for note in found.notes:
        out.print(f"[dim]{note}[/]")


@app.command()
def models(
    pattern: Annotated[str, typer.Argument(help="Glob over architecture names.")] = "*",
    model: Annotated[str | None, typer.Option("--model", "-m", help="Show one model's named inputs and outputs (resnet50, hf:bert-base, file.py:fn, x.onnx).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the architecture names infermux can build, or one model's inputs and outputs."""
    from infermux.models import list_models

    if model is not None:
        from infermux.models import load_model

        loaded = load_model(model)
        if as_json:
            _print_json(loaded.describe())
            return
        io = loaded.spec_io
        out.print(f"[bold]{loaded.name}[/] ({loaded.source}): {loaded.weights_note}")
        for title, specs in (("inputs", io.inputs), ("outputs", io.outputs)):
            out.print(f"{title}:")
            for spec in specs:  # an output's values are the network's: no filling to show
                out.print(f"  {spec.text(values=title == 'inputs')}", markup=False)
        if io.default_dims:
            out.print("default sizes: " + ", ".join(f"{k}={v}" for k, v in io.default_dims.items()))
        return
    found = list_models(pattern)
    if as_json:
        _print_json(found)
        return
    for source, names in found.items():
        out.print(f"[bold]{source}[/] ({len(names)}): " + ", ".join(names))
