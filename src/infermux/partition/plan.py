"""`PipelinePlan`: one model cut into pipeline stages, as the partitioner finds it.

It is the `stages:` part of a model entry of the runtime Plan (`infermux.runtime.plan`), which is
what `infermux partition --out` writes and `infermux run` executes: a model entry with `stages:`
runs as a pipeline inside the runtime, beside (or instead of) data-parallel replicas.
`to_runtime_plan()` and `from_entry()` convert to and from it.

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

import math
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from infermux.errors import UsageError
from infermux.runtime.plan import ModelEntry, Plan, Stage, parse_plan

__all__ = ["PipelinePlan", "StageSpec"]

#: The runtime Plan's stage type; the old name is kept for callers of the partition API.
StageSpec = Stage


class PipelinePlan(BaseModel):
    """A model cut into contiguous stages; `pipeline_replicas` whole copies share input and output."""

    model_config = ConfigDict(extra="forbid")

    model: str
    weights: str | None = None
    input_shape: list[int] | None = None
    pipeline_replicas: int = Field(default=1, ge=1)
    stages: list[Stage] = Field(min_length=1)
    predicted_items_per_s: float | None = None
    measured_items_per_s: float | None = None

    @model_validator(mode="after")
    def _contiguous(self) -> PipelinePlan:
        if self.stages[0].start != "input":
            raise ValueError(f"the first stage must start at 'input', not {self.stages[0].start!r}")
        if self.stages[-1].end != "output":
            raise ValueError(f"the last stage must end at 'output', not {self.stages[-1].end!r}")
        for a, b in zip(self.stages[:-1], self.stages[1:], strict=True):
            if a.end != b.start:
                raise ValueError(f"stages must be contiguous: one ends at {a.end!r}, the next "
                                 f"starts at {b.start!r}")
        return self

    @property
    def chunk(self) -> int:
        """Items per link slot: the gcd of the stage batches (every batch is a whole number)."""
        return math.gcd(*(s.batch for s in self.stages))

    @property
    def units(self) -> list[str]:
        """Every unit the plan uses, in stage order."""
        return [u for s in self.stages for u in s.units]

    def describe(self) -> str:
        """`input→layer2_1_relu_1 @cpu:0 | …→output @cpu:1` for tables."""
        parts = []
        for s in self.stages:
            units = "+".join(s.units) + (f"×{s.instances}" if s.instances > 1 else "")
            engine = "" if s.engine == "torch" else f" {s.engine}"
            parts.append(f"{s.start}→{s.end} @{units}{engine}")
        text = " | ".join(parts)
        return text if self.pipeline_replicas == 1 else f"{self.pipeline_replicas}× [{text}]"

    # -- the runtime Plan -----------------------------------------------------------------------

    def model_entry(self, name: str | None = None) -> dict[str, Any]:
        """The pipeline as a model entry of the runtime Plan (`stages:` instead of `replicas:`)."""
        entry = {"name": name or _entry_name(self.model), **self.model_dump(exclude_none=True)}
        entry["stages"] = [s.model_dump(exclude_none=True) for s in self.stages]
        return entry

    def to_runtime_plan(self, name: str | None = None, load: dict[str, Any] | None = None) -> Plan:
        """A runtime Plan that runs this pipeline under `load` (offline by default)."""
        entry = self.model_entry()
        data = {"name": name or f"{entry['name']}-pipeline", "models": [entry],
                "load": load or {"scenario": "offline"}}
        return parse_plan(data, source="pipeline plan")

    @classmethod
    def from_entry(cls, entry: ModelEntry) -> PipelinePlan:
        """The pipeline of a runtime model entry that has `stages:`."""
        if not entry.stages:
            raise UsageError(f"model {entry.name!r} of the plan has no stages: section")
        return cls(model=entry.model, weights=entry.weights, input_shape=entry.input_shape,
                   pipeline_replicas=entry.pipeline_replicas, stages=list(entry.stages),
                   predicted_items_per_s=entry.predicted_items_per_s,
                   measured_items_per_s=entry.measured_items_per_s)

    @classmethod
    def from_model_entry(cls, entry: dict[str, Any]) -> PipelinePlan:
        """Read a bare model entry (a mapping) that has a `stages:` section."""
        if "stages" not in entry:
            raise UsageError(f"model entry for {entry.get('model')!r} has no stages: section")
        fields = {k: v for k, v in entry.items() if k in cls.model_fields}
        try:
            return cls(**fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "plan"
            raise UsageError(f"pipeline plan {where}: {err['msg']} (got {err.get('input')!r})") from None

    # -- files ----------------------------------------------------------------------------------

    def to_yaml(self) -> str:
        """The runtime Plan as YAML text."""
        plan = self.to_runtime_plan()
        data = plan.model_dump(mode="json", exclude_defaults=True)
        data["load"] = {"scenario": plan.load.scenario, **data.get("load", {})}
        return yaml.safe_dump(data, sort_keys=False, width=120)

    def save(self, path: str | Path) -> None:
        """Write the runtime Plan that runs this pipeline (`infermux run` takes it)."""
        try:
            Path(path).write_text(self.to_yaml())
        except OSError as exc:
            raise UsageError(f"cannot write plan to {str(path)!r}: {exc.strerror}") from exc

    @classmethod
    def load(cls, path: str | Path) -> PipelinePlan:
        """Read the first pipelined model of a runtime Plan file (or a bare pipeline entry)."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise UsageError(f"cannot read plan {str(path)!r}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise UsageError(f"plan {str(path)!r} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise UsageError(f"plan {str(path)!r} is not a mapping with models: or stages:")
        if "models" in data:
            plan = parse_plan(data, source=str(path))
            for entry in plan.models:
                if entry.stages:
                    return cls.from_entry(entry)
            raise UsageError(f"plan {str(path)!r} has no model with stages:")
        return cls.from_model_entry(data)


def _entry_name(ref: str) -> str:
    """A plan model name from a model reference (`path/net.py:build` → `net.py-build`)."""
    base = ref.replace("\\", "/").rsplit("/", 1)[-1]
    return (re.sub(r"[^A-Za-z0-9_.\-]+", "-", base).strip("-") or "model")[:64]
