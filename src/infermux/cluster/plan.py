"""The cluster plan: which local plan runs on which node, and the load on the whole cluster.

A cluster plan names, per node entry, how to find the node (its Ray node id, an address, a
custom resource it offers, or labels) and what to run there: a local `Plan` (inline, or a path to
a plan file), or `tune: auto` so the node tunes the cluster's models on its own units and
reports the plan back. One load (a LoadGen scenario) drives the whole cluster; each node's
runtime takes its dispatcher settings from its own plan.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from infermux.errors import UsageError
from infermux.runtime.plan import LoadSettings, Plan, load_plan, parse_plan

__all__ = [
    "EXAMPLE_CLUSTER_PLAN",
    "ClusterModel",
    "ClusterPlan",
    "NodeEntry",
    "NodeSelector",
    "RouteSettings",
    "TuneSpec",
    "cluster_plan_from_file",
    "is_cluster_plan",
    "load_cluster_plan",
    "parse_cluster_plan",
    "with_cluster_load",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeSelector(_Strict):
    """How a node entry finds its Ray node(s); every field given must match."""

    #: A Ray node id (hex; a unique prefix is enough).
    id: str | None = None
    #: The node's IP address as Ray reports it (`NodeManagerAddress`).
    address: str | None = None
    #: A custom resource the node offers (`ray start --resources '{"gpu-box": 1}'`).
    resource: str | None = None
    #: Labels the node carries (`ray start --labels`), all of which must match.
    labels: dict[str, str] = Field(default_factory=dict)

    def describe(self) -> str:
        """`id=ab12, resource=gpu-box` for messages."""
        parts = [f"{k}={v}" for k, v in (("id", self.id), ("address", self.address),
                                         ("resource", self.resource)) if v]
        parts += [f"label {k}={v}" for k, v in self.labels.items()]
        return ", ".join(parts) or "any node"

    def matches(self, node: dict[str, Any]) -> bool:
        """Whether a `ray.nodes()` row matches."""
        if self.id and not str(node.get("NodeID", "")).startswith(self.id):
            return False
        if self.address and node.get("NodeManagerAddress") != self.address:
            return False
        if self.resource and not (node.get("Resources") or {}).get(self.resource):
            return False
        labels = node.get("Labels") or {}
        return all(labels.get(k) == v for k, v in self.labels.items())


class TuneSpec(_Strict):
    """`tune:` on a node: it tunes the cluster's models on its own units, within a budget."""

    units: str = "auto"
    engines: str = "auto"
    budget_s: float = Field(120.0, gt=0, le=86_400)
    batches: list[int] | None = None


class ClusterModel(_Strict):
    """A model of the cluster, for nodes that tune their own plan."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$", max_length=64)
    model: str
    weights: str | None = None
    input_shape: list[int] | None = None


class NodeEntry(_Strict):
    """One node (or `count` like nodes) and what runs there."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$", max_length=64)
    node: NodeSelector = Field(default_factory=lambda: NodeSelector.model_validate({}))
    #: How many matching nodes run this entry (`all`: every match); each gets `name-i`.
    count: int | Literal["all"] = 1
    #: The local plan: a mapping, or a path to a plan file (relative to the cluster plan).
    plan: dict[str, Any] | str | None = None
    #: `auto`, or a TuneSpec: the node tunes the cluster's `models` itself.
    tune: Literal["auto"] | TuneSpec | None = None

    @field_validator("count")
    @classmethod
    def _count(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"count {value} must be at least 1, or all")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> NodeEntry:
        if (self.plan is None) == (self.tune is None):
            raise ValueError(f"node {self.name!r} needs exactly one of plan: (a local plan or "
                             "its file) or tune: auto")
        return self

    def tune_spec(self) -> TuneSpec | None:
        """The node's tuning request, or None for a node with a plan."""
        if self.tune is None:
            return None
        return TuneSpec.model_validate({}) if self.tune == "auto" else self.tune


class RouteSettings(_Strict):
    """How the driver spreads queries over the nodes."""

    #: `capacity`: to the node that would finish the query first, by its measured rate and
    #: what it holds; `round_robin`: in turn (the blind baseline).
    policy: Literal["capacity", "round_robin"] = "capacity"
    #: Weight of the newest window in each node's moving-average rate.
    rate_alpha: float = Field(0.3, gt=0, le=1)
    #: A query's samples lost with a node (or failed there) go to another node this many times.
    max_retries: int = Field(2, ge=0, le=10)
    #: A node that answers no poll for this long is taken for dead (never hang on one).
    node_timeout_s: float = Field(20.0, gt=0, le=3600)
    #: The longest one poll waits on a node for completions (it returns at the first one, so
    #: this costs no latency; shorter only spends the nodes' and the driver's CPU on empty polls).
    poll_wait_s: float = Field(0.5, gt=0, le=5)
    #: Offline only: a node holds its poll answer back while it still has more than a batch
    #: queued beyond what its workers run, so one answer (and one refill) covers several
    #: batches; off, it answers at every completion. Other scenarios always answer at once.
    coalesce_answers: bool = True
    #: A node that joins the cluster while the plan runs or serves, and matches an entry with
    #: `count: all`, is started (its runtime built and measured, or tuned) and then routed to;
    #: the cluster's nodes are looked at this often (s). 0 switches joining off.
    join_check_s: float = Field(2.0, ge=0, le=600)


class ClusterPlan(_Strict):
    """Nodes with their local plans, how queries are routed, and the load on the cluster."""

    name: str = "cluster"
    nodes: list[NodeEntry] = Field(min_length=1)
    models: list[ClusterModel] = Field(default_factory=list)
    route: RouteSettings = Field(default_factory=lambda: RouteSettings.model_validate({}))
    load: LoadSettings = Field(default_factory=lambda: LoadSettings.model_validate({}))

    @model_validator(mode="after")
    def _whole(self) -> ClusterPlan:
        names = [n.name for n in self.nodes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"node names {dupes} appear twice: give every node entry its own name")
        if any(n.tune is not None for n in self.nodes) and not self.models:
            raise ValueError("a node with tune: auto tunes the cluster's models: list them under "
                             "models: [{name: cnn, model: mobilenet_v3_small}]")
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (what is stored with the run)."""
        return self.model_dump(mode="json")

    def local_plan(self, entry: NodeEntry, base: Path | None = None) -> Plan | None:
        """The node entry's local plan with the cluster's load, or None for a tuning node."""
        if entry.plan is None:
            return None
        if isinstance(entry.plan, str):
            path = Path(entry.plan)
            if base is not None and not path.is_absolute():
                path = base / path
            plan = load_plan(path)
        else:
            plan = parse_plan(entry.plan, source=f"nodes[{self.nodes.index(entry)}].plan")
        return with_cluster_load(plan, self.load)


def with_cluster_load(plan: Plan, load: LoadSettings) -> Plan:
    """`plan` with the cluster's load (a node's sample library must match the driver's)."""
    data = plan.to_dict()
    data["load"] = load.model_dump(mode="json")
    return parse_plan(data, source=f"plan {plan.name!r} with the cluster's load")


def _path(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else ("." if text else "") + str(part)
    return text or "cluster plan"


def parse_cluster_plan(data: Any, *, source: str = "cluster plan",
                       base: Path | None = None) -> ClusterPlan:
    """Validate a cluster plan given as a dict; errors are one line with the field path.

    Each node's local plan is validated too, so a bad local plan fails before any node starts.
    """
    if not isinstance(data, dict):
        raise UsageError(f"{source}: a cluster plan is a mapping with a `nodes` list, "
                         f"not {type(data).__name__}")
    if "models" in data and "nodes" not in data and isinstance(data.get("models"), list) and any(
            isinstance(m, dict) and ("replicas" in m or "stages" in m) for m in data["models"]):
        raise UsageError(f"{source}: this is a local plan (models with replicas), not a cluster "
                         "plan: wrap it as nodes: [{name: a, plan: {...}}], or give the cluster "
                         "with --cluster local:2 to run it on every node")
    try:
        plan = ClusterPlan.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            raise UsageError(f"{source}: field {_path(loc)} is not a cluster plan field") from None
        if err["type"] == "missing":
            raise UsageError(f"{source}: field {_path(loc)} is required but missing") from None
        value = err.get("input")
        shown = "" if isinstance(value, dict) or not loc else (
            " = " + json.dumps(value, default=str)[:80])
        raise UsageError(f"{source}: field {_path(loc)}{shown}: {msg}") from None
    for entry in plan.nodes:
        plan.local_plan(entry, base)
    return plan


def load_cluster_plan(path: str | Path) -> ClusterPlan:
    """Read and validate a YAML or JSON cluster plan file."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"cluster plan file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"cluster plan file {str(path)!r} is not valid YAML: {exc}") from None
    return parse_cluster_plan(data, source=str(path), base=file.parent)


def is_cluster_plan(data: Any) -> bool:
    """Whether a parsed YAML document is a cluster plan (it has `nodes:`) or a local plan."""
    return isinstance(data, dict) and "nodes" in data


def cluster_plan_from_file(plan_file: str, load: dict[str, Any] | None = None) -> ClusterPlan:
    """A cluster plan file, or a local plan file run on every node (`count: all`).

    `load` overrides fields of the plan's load (None values are ignored): what `--cluster`
    takes from `infermux run`'s options, or the server's small sample pool.
    """
    import yaml

    path = Path(plan_file)
    data = None
    if path.is_file():
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            data = None  # load_plan names the error below
    if not is_cluster_plan(data):
        local = load_plan(plan_file).to_dict()
        data = {"name": local["name"], "load": local.pop("load"),
                "nodes": [{"name": "node", "count": "all", "plan": local}]}
    assert isinstance(data, dict)
    data["load"] = {**(data.get("load") or {}),
                    **{k: v for k, v in (load or {}).items() if v is not None}}
    return parse_cluster_plan(data, source=plan_file, base=path.parent)


EXAMPLE_CLUSTER_PLAN = """\
# An infermux cluster plan: a local plan per node, one load on the whole cluster.
# Run it with `infermux run cluster.yaml --cluster ray://HEAD:10001` (or --cluster local:2).
name: two-boxes
nodes:
  - name: gpu-box
    node: {resource: gpu-box}      # or id: <ray node id>, address: 10.0.0.5, labels: {k: v}
    plan: gpu-plan.yaml            # a local plan file, or the plan inline as a mapping
  - name: cpu
    node: {labels: {kind: cpu}}
    count: all                     # every matching node runs this entry (cpu-0, cpu-1, ...)
    tune: auto                     # the node tunes `models` on its own units and reports back
models:
  - {name: cnn, model: mobilenet_v3_small}
route:
  policy: capacity                 # to the node that would finish first (measured rate, queue)
  max_retries: 2                   # samples lost with a node are retried on others, then failed
  node_timeout_s: 20               # a node silent this long is taken for dead
load:
  scenario: offline
  min_duration_s: 10
  min_queries: 1024
"""
