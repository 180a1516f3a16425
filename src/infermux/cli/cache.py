"""`infermux cache`: what the cache folder holds, and pruning or clearing it."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from infermux.cli._app import JsonOpt, _print_json, app, err, out
from infermux.errors import UsageError

cache_app = typer.Typer(
    help="Show the cache folder (exports, compiled engines, data sets), prune it or clear it. "
         "Without a command: `info`.",
    invoke_without_command=True,
)
app.add_typer(cache_app, name="cache")

KindOpt = Annotated[list[str] | None, typer.Option(
    "--kind", help="Only this kind (a top-level folder, e.g. onnx, openvino); repeat or join "
                   "with commas. Default: every kind infermux writes.")]


def _kinds(values: list[str] | None) -> list[str] | None:
    """`--kind onnx --kind a,b` → ['onnx', 'a', 'b']; None when not given."""
    if not values:
        return None
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    if not names:
        raise UsageError("--kind is empty: name a kind, e.g. --kind onnx")
    return names


def _root() -> Any:
    from infermux.export import cache_dir

    return cache_dir()


def _bound() -> dict[str, Any]:
    from infermux.cache import MAX_SIZE_ENV, max_size_from_env

    return {"env": MAX_SIZE_ENV, "max_size_bytes": max_size_from_env()}


def _show_info(as_json: bool) -> None:
    from infermux.cache import scan
    from infermux.cli.render import cache_table, size_text

    bound = _bound()
    summary = scan(_root())
    if as_json:
        _print_json({**summary.to_dict(), "bound": bound})
        return
    if not summary.root.is_dir():
        out.print(f"cache {summary.root}: empty (the folder does not exist yet)", markup=False)
    else:
        out.print(cache_table(summary))
    limit = bound["max_size_bytes"]
    out.print(f"[dim]size bound: {bound['env']}="
              + (size_text(limit) if limit else "unset (no automatic pruning)")
              + "; move the cache with INFERMUX_CACHE_DIR[/]")


@cache_app.callback()
def cache_main(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Show the cache folder (exports, compiled engines, data sets), prune it or clear it."""
    if ctx.invoked_subcommand is None:
        _show_info(as_json)
    elif as_json:
        raise UsageError(f"--json goes after the command: infermux cache "
                         f"{ctx.invoked_subcommand} ... --json")


@cache_app.command("info")
def cache_info(as_json: JsonOpt = False) -> None:
    """The cache root and, per kind: entries, files, size, oldest and newest use."""
    _show_info(as_json)


@cache_app.command("list")
def cache_list(kind: KindOpt = None, as_json: JsonOpt = False) -> None:
    """Every entry (a file, or a folder counted whole), least recently used first."""
    from infermux.cache import scan, select_kinds
    from infermux.cli.render import cache_entries_table

    summary = scan(_root())
    names = _kinds(kind)
    kinds = summary.kinds if names is None else select_kinds(summary, names)
    entries = sorted((e for k in kinds for e in k.entries), key=lambda e: e.last_used_s)
    if as_json:
        _print_json({"root": str(summary.root), "entries": [e.to_dict() for e in entries]})
    else:
        out.print(cache_entries_table(summary, entries))


def _report(result: Any, as_json: bool) -> None:
    from infermux.cli.render import prune_line, prune_table

    if as_json:
        _print_json(result.to_dict())
    else:
        out.print(prune_line(result), markup=False, highlight=False)
        if result.removed:
            out.print(prune_table(result))
        if result.skipped_temporary:
            out.print(f"[dim]left {result.skipped_temporary} temporary file(s) a writer is "
                      "still making[/]")
    for path, why in result.failed[:5]:
        err.print(f"could not remove {path}: {why}", markup=False, highlight=False)
    if result.failed:
        raise typer.Exit(1)


@cache_app.command("prune")
def cache_prune(
    max_size: Annotated[str | None, typer.Option(
        "--max-size", help="Remove least recently used entries until the cache holds at most "
                           "this, e.g. 2GB, 500MiB.")] = None,
    older_than: Annotated[str | None, typer.Option(
        "--older-than", help="Remove entries unused for this long, e.g. 30d, 12h.")] = None,
    kind: KindOpt = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Say what would be removed; remove nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove least recently used entries: to a size (--max-size) and/or an age (--older-than)."""
    from infermux._parse import parse_bytes, parse_duration_s
    from infermux.cache import prune

    if max_size is None and older_than is None:
        raise UsageError("cache prune needs a bound: pass --max-size (e.g. 5GB), --older-than "
                         "(e.g. 30d), or both; `infermux cache clear --yes` removes everything")
    max_bytes = parse_bytes(max_size, name="--max-size") if max_size is not None else None
    older_than_s = (parse_duration_s(older_than, name="--older-than")
                    if older_than is not None else None)
    _report(prune(_root(), max_bytes=max_bytes, older_than_s=older_than_s, kinds=_kinds(kind),
                  dry_run=dry_run), as_json)


@cache_app.command("clear")
def cache_clear(
    kind: KindOpt = None,
    yes: Annotated[bool, typer.Option("--yes", help="Remove without asking (required).")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Say what would be removed; remove nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove every entry (of the kinds given, else of every kind infermux writes)."""
    from infermux.cache import clear
    from infermux.cli.render import size_text

    names = _kinds(kind)
    if not yes and not dry_run:
        preview = clear(_root(), names, dry_run=True)
        if not preview.removed:  # nothing to ask about
            _report(preview, as_json)
            return
        raise UsageError(f"cache clear would remove {len(preview.removed)} entries "
                         f"({size_text(preview.freed_bytes)}) under {preview.root}: pass --yes "
                         "to remove them, or --dry-run to list them")
    _report(clear(_root(), names, dry_run=dry_run), as_json)
