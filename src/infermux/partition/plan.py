"""`PipelinePlan`: a pipelined way to run one model, written and read as YAML.

It is the `stages:` section that a model entry of the runtime Plan holds (see
`docs/architecture-partition.md`): a model entry with `stages:` runs as a pipeline, one without
runs as data-parallel replicas. `model_entry()` and `from_model_entry()` convert to and from it.

```yaml
model: resnet18
pipeline_replicas: 1
stages:
  - {start: input, end: layer2_1_relu_1, units: [cpu:0], instances: 1, batch: 8, buffers: 2}
  - {start: layer2_1_relu_1, end: output, units: [cpu:1], instances: 1, batch: 8, buffers: 2}
```
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from infermux.errors import UsageError

__all__ = ["PipelinePlan", "StageSpec"]


class StageSpec(BaseModel):
    """One stage: the segment between two boundaries, where it runs, and how it is fed.

    `start`/`end` are `input`, a cut point's node name (see `infermux partition --show`) or
    `output`. A stage on several `units`, or with `instances` > 1 per unit, is duplicated: each
    copy takes whole batches from the same inbound link. `buffers` is how many batches each copy
    may have written and not yet consumed downstream: it bounds the link's memory.
    """

    model_config = ConfigDict(extra="forbid")

    start: str = "input"
    end: str = "output"
    units: list[str] = Field(min_length=1)
    instances: int = Field(default=1, ge=1)
    batch: int = Field(default=1, ge=1)
    buffers: int = Field(default=2, ge=1)
    predicted_time_s: float | None = None


class PipelinePlan(BaseModel):
    """A model cut into contiguous stages; `pipeline_replicas` whole copies share input and output."""

    model_config = ConfigDict(extra="forbid")

    model: str
    weights: str | None = None
    input_shape: list[int] | None = None
    engine: str = "torch"
    options: dict[str, Any] = Field(default_factory=dict)
    pipeline_replicas: int = Field(default=1, ge=1)
    stages: list[StageSpec] = Field(min_length=1)
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
        if self.engine != "torch":
            raise ValueError(f"engine {self.engine!r}: pipeline stages run on the torch engine")
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
            parts.append(f"{s.start}→{s.end} @{units}")
        text = " | ".join(parts)
        return text if self.pipeline_replicas == 1 else f"{self.pipeline_replicas}× [{text}]"

    # -- the runtime Plan's model entry ---------------------------------------------------------

    def model_entry(self) -> dict[str, Any]:
        """The plan as a model entry of the runtime Plan (`stages:` instead of `replicas:`)."""
        return self.model_dump(exclude_none=True)

    @classmethod
    def from_model_entry(cls, entry: dict[str, Any]) -> PipelinePlan:
        """Read a model entry that has a `stages:` section."""
        if "stages" not in entry:
            raise UsageError(f"model entry for {entry.get('model')!r} has no stages: section")
        try:
            return cls(**entry)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "plan"
            raise UsageError(f"pipeline plan {where}: {err['msg']} (got {err.get('input')!r})") from None

    # -- files ----------------------------------------------------------------------------------

    def to_yaml(self) -> str:
        """YAML text, stages in flow style one per line."""
        return yaml.safe_dump(self.model_entry(), sort_keys=False, width=120)

    def save(self, path: str | Path) -> None:
        """Write the plan as YAML."""
        try:
            Path(path).write_text(self.to_yaml())
        except OSError as exc:
            raise UsageError(f"cannot write plan to {str(path)!r}: {exc.strerror}") from exc

    @classmethod
    def load(cls, path: str | Path) -> PipelinePlan:
        """Read a plan written by `save` (or by hand)."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise UsageError(f"cannot read plan {str(path)!r}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise UsageError(f"plan {str(path)!r} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise UsageError(f"plan {str(path)!r} is not a mapping with model: and stages:")
        return cls.from_model_entry(data)
