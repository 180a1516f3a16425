"""A characterization variant as the rows of its tables (`infermux.store.characterize`)."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from infermux.store import Store

if TYPE_CHECKING:
    from infermux.characterize.run import VariantResult

__all__ = ["add_variant", "finite"]


def finite(value: Any) -> Any:
    """NaN and infinities become None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _value(entry: Any) -> float | None:
    return entry.get("value") if isinstance(entry, dict) else None


def add_variant(store: Store, run_id: int, index: int, result: VariantResult) -> None:
    """Store one variant: its row, its builds (every study) and its causes."""
    record = finite(result.to_dict())
    det = record["determinism"]
    acc = record.get("accuracy") or {}
    rebuild = det.get("rebuild") or {}
    lat = det.get("latency") or {}
    v = result.variant
    variant_row = (
        run_id, index, v.unit.id, v.engine, v.precision, v.config, record["status"],
        det["builds_ok"], _value(acc.get("top1")), _value(acc.get("top5")),
        _value(acc.get("agree_top1")), acc.get("max_abs_err"), _value(acc.get("mean_abs_err")),
        acc.get("rel_err"), rebuild.get("distinct"), rebuild.get("max_abs_diff"),
        rebuild.get("top1_flips"), lat.get("median_ms"), lat.get("spread"),
        ",".join(det["variance"]), json.dumps(record, default=str))
    studies = [("baseline", result.baseline)] + [(c.knob.name, c.study) for c in result.causes]
    build_rows = []
    for name, study in studies:
        for b, build in enumerate(study.builds):
            build_lat = build.get("latency") or {}
            build_rows.append((run_id, index, name, b, build.get("status", "error"),
                               build.get("build_s"), build_lat.get("median_ms"),
                               build_lat.get("items_per_s"), build.get("error"),
                               json.dumps(finite({k: val for k, val in build.items()
                                                   if k != "traceback"}), default=str)))
    cause_rows = [(run_id, index, c["knob"], json.dumps(c["removes"]), ",".join(c["variance_left"]),
                   c["throughput_ratio"], json.dumps(c, default=str)) for c in record["causes"]]
    store.add_characterize_variant(variant_row, build_rows, cause_rows)
