"""`characterize` runs: accuracy, determinism across builds and the knobs behind a variance.

One row per (unit, engine, precision) variant, each build's latency, and the knob studies.
"""

from __future__ import annotations

from typing import Any

from infermux.report.data import RunData
from infermux.report.figures import bar, figure, scatter
from infermux.report.kinds import Headline, register_kind
from infermux.report.kinds.common import status_cell
from infermux.report.page import Section, fmt

__all__ = ["render_characterize"]

_VARIANT_COLUMNS = ("variant", "unit", "engine", "precision", "config", "status", "builds_ok",
                    "top1", "agree_top1", "max_abs_err", "rel_err", "distinct_outputs",
                    "top1_flips", "latency_median_ms", "latency_spread", "variance")


def _variants(run: RunData) -> list[dict[str, Any]]:
    if not run.reader.has_table("characterize_variants"):
        return []
    cols = ", ".join(_VARIANT_COLUMNS)
    return [dict(r) for r in run.reader.query(
        f"SELECT {cols} FROM characterize_variants WHERE run_id = ? ORDER BY variant", (run.id,))]


def _label(v: dict[str, Any]) -> str:
    text = f"{v['unit']} {v['engine']} {v['precision']}"
    return text + (f" {v['config']}" if v.get("config") and v["config"] != "default" else "")


def _headline(run: RunData) -> Headline | None:
    variants = _variants(run)
    varied = [v for v in variants if v.get("variance")]
    if not variants:
        return None
    return ("variants with a variance", float(len(varied)), f"of {len(variants)}")


@register_kind("characterize", headline=_headline)
def render_characterize(run: RunData, section: Section) -> None:
    """Variants, their build-to-build latency, their errors, and the knob studies."""
    variants = _variants(run)
    if not variants:
        section.note("No variant was stored for this run.", "warn")
        return
    failed = [v for v in variants if v["status"] not in ("ok", "complete")]
    if failed:
        section.note(f"{len(failed)} variant(s) did not complete: "
                     + ", ".join(f"{_label(v)} ({v['status']})" for v in failed), "bad")
    section.heading("Variants")
    section.table(["#", "variant", "status", "builds ok", "top-1", "agree top-1", "max |err|",
                   "rel err", "distinct outputs", "top-1 flips", "median ms", "spread",
                   "variance"],
                  ([str(v["variant"]), _label(v), status_cell(str(v["status"])),
                    fmt(v["builds_ok"]), fmt(v["top1"], 3), fmt(v["agree_top1"], 3),
                    fmt(v["max_abs_err"], 4), fmt(v["rel_err"], 4), fmt(v["distinct_outputs"]),
                    fmt(v["top1_flips"]), fmt(v["latency_median_ms"], 2),
                    fmt(v["latency_spread"], 3), v["variance"] or "none"] for v in variants),
                  numeric=("builds ok", "top-1", "agree top-1", "max |err|", "rel err",
                           "distinct outputs", "top-1 flips", "median ms", "spread"))
    labels = {v["variant"]: _label(v) for v in variants}
    builds = run.reader.query(
        "SELECT variant, build, latency_median_ms FROM characterize_builds WHERE run_id = ? "
        "AND study = 'baseline' AND latency_median_ms IS NOT NULL ORDER BY variant, build",
        (run.id,)) if run.reader.has_table("characterize_builds") else []
    if builds:
        section.figure(figure(
            [scatter([labels.get(b[0], str(b[0])) for b in builds], [b[2] for b in builds],
                     "one build", text=[f"build {b[1]}" for b in builds], size=9)],
            title="Median batch latency of every build (a spread across builds is a result)",
            x="variant", y="ms per batch", x_category=True))
    errs = [v for v in variants if v.get("max_abs_err")]
    if errs:
        section.figure(figure(
            [bar([_label(v) for v in errs], [v["max_abs_err"] for v in errs],
                 "max |logit error| against fp32")],
            title="Largest output difference from the fp32 reference", x="variant",
            y="max absolute error", y_log=True, x_category=True, legend_below=False))
    causes = run.rows("characterize_causes")
    if causes:
        section.heading("Causes: each variance measured again with one knob pinned")
        section.table(["variant", "knob", "removes", "variance left", "items/s ratio"],
                      ([labels.get(c["variant"], str(c["variant"])), str(c["knob"]),
                        ", ".join(f"{k}: {'gone' if v else ('stays' if v is False else '–')}"
                                  for k, v in (c.get("removes") or {}).items()),
                        c.get("variance_left") or "none", fmt(c.get("throughput_ratio"), 2)]
                       for c in causes), numeric=("items/s ratio",))
