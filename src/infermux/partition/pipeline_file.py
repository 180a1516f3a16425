"""Writing and reading a pipeline plan file: a runtime model entry with `stages:` (no type of its own).

A pipeline is a `ModelEntry` of the runtime Plan (`infermux.runtime.plan`) whose `stages:`
cut the network into contiguous segments across units: what `infermux partition --out` writes,
what `infermux run` executes (beside or instead of data-parallel replicas) and what the
partitioner measures its top candidates as, through `run_plan`.

```yaml
name: resnet18-pipeline
models:
  - name: resnet18
    model: resnet18
    pipeline_replicas: 1
    stages:
      - {start: input, end: layer2_1_relu_1, units: [cpu:0], engine: openvino, batch: 8, buffers: 2}
      - {start: layer2_1_relu_1, end: output, units: [cpu:1], engine: torch, batch: 8, buffers: 2}
load: {scenario: offline}
```
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from infermux.errors import UsageError
from infermux.runtime.plan import ModelEntry, Plan, parse_plan

__all__ = ["entry_name", "load_pipeline", "pipeline_plan", "plan_yaml", "save_pipeline"]


def entry_name(ref: str) -> str:
    """A plan model name from a model reference (`path/net.py:build` → `net.py-build`)."""
    base = ref.replace("\\", "/").rsplit("/", 1)[-1]
    return (re.sub(r"[^A-Za-z0-9_.\-]+", "-", base).strip("-") or "model")[:64]


def pipeline_plan(entry: ModelEntry, name: str | None = None,
                  load: dict[str, Any] | None = None,
                  dispatcher: dict[str, Any] | None = None) -> Plan:
    """A runtime Plan that runs the pipelined `entry` alone under `load` (offline by default)."""
    data: dict[str, Any] = {"name": name or f"{entry.name}-pipeline",
                            "models": [entry.model_dump(mode="json", exclude_none=True)],
                            "load": load or {"scenario": "offline"}}
    if dispatcher:
        data["dispatcher"] = dispatcher
    return parse_plan(data, source="pipeline plan")


def plan_yaml(entry: ModelEntry) -> str:
    """The runtime Plan that runs `entry`, as YAML text."""
    plan = pipeline_plan(entry)
    data = plan.model_dump(mode="json", exclude_defaults=True)
    data["load"] = {"scenario": plan.load.scenario, **data.get("load", {})}
    return yaml.safe_dump(data, sort_keys=False, width=120)


def save_pipeline(entry: ModelEntry, path: str | Path) -> None:
    """Write the runtime Plan that runs `entry` (`infermux run` takes it)."""
    try:
        Path(path).write_text(plan_yaml(entry))
    except OSError as exc:
        raise UsageError(f"cannot write plan to {str(path)!r}: {exc.strerror}") from exc


def load_pipeline(path: str | Path) -> ModelEntry:
    """The first model entry with `stages:` of a runtime Plan file."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read plan {str(path)!r}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise UsageError(f"plan {str(path)!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict) or "models" not in data:
        raise UsageError(f"plan {str(path)!r} is not a runtime plan (a mapping with models:)")
    for entry in parse_plan(data, source=str(path)).models:
        if entry.stages:
            return entry
    raise UsageError(f"plan {str(path)!r} has no model with stages:")
