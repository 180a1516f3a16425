"""Capture a network's dataflow graph and find its valid pipeline cut points.

A *cut point* is a place in the graph's topological order where exactly one tensor is live: every
path from the input to the output passes through the node that produced it (it dominates the
output), so the network splits there into two parts joined by that one tensor. Inside a residual
or skip connection two values are live (the block's input and the branch), so no cut is ever
placed there. After dead code is removed, single-live positions of one topological order are
exactly the dominators of the output, so the order chosen does not hide any cut.

Capture tries `torch.fx.symbolic_trace` first (readable node names, module calls kept whole) and
falls back to `torch.export` (ATen-level graph) for networks fx cannot trace, such as Python
control flow on tensor shapes. Shapes, dtypes and bytes come from running the graph once on an
example batch (shape propagation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infermux.errors import RunError, UsageError

__all__ = ["CutPoint", "ModelGraph", "TensorInfo", "capture_graph"]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor per item: shape without the batch axis, dtype name, bytes per item."""

    shape: tuple[int, ...]
    dtype: str
    bytes_per_item: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {"shape": list(self.shape), "dtype": self.dtype,
                "bytes_per_item": self.bytes_per_item}


@dataclass(frozen=True)
class CutPoint:
    """A valid cut: after node `node` (position `position` in the node order) one tensor crosses."""

    position: int
    node: str
    tensor: TensorInfo

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {"position": self.position, "node": self.node, **self.tensor.to_dict()}


@dataclass
class ModelGraph:
    """A captured graph: the GraphModule, its nodes in order, cut points, input and outputs.

    `boundaries` are the places a segment may start or end: `"input"`, each cut point's node name,
    then `"output"`. Segment `i` runs from boundary `i` to boundary `i + 1` of the chosen list.
    """

    module: Any  # torch.fx.GraphModule
    method: str  # fx | export
    nodes: list[Any]  # every node in topological order, output last
    cuts: list[CutPoint]
    input: TensorInfo
    outputs: list[TensorInfo]
    example_batch: int = 2
    notes: list[str] = field(default_factory=list)

    @property
    def boundaries(self) -> list[str]:
        """`["input", cut nodes..., "output"]`."""
        return ["input", *(c.node for c in self.cuts), "output"]

    def cut(self, name: str) -> CutPoint:
        """The cut point after node `name`; a UsageError listing the valid ones otherwise."""
        for cut in self.cuts:
            if cut.node == name:
                return cut
        valid = ", ".join(c.node for c in self.cuts[:20])
        raise UsageError(
            f"{name!r} is not a valid cut point of this network (only places where one tensor "
            f"crosses are); valid: {valid}{' ...' if len(self.cuts) > 20 else ''}"
        )

    def position(self, boundary: str) -> int:
        """Node position of a boundary (`input` → 0, `output` → position of the output node)."""
        if boundary == "input":
            return next(i for i, n in enumerate(self.nodes) if n.op == "placeholder")
        if boundary == "output":
            return len(self.nodes) - 1
        return self.cut(boundary).position


def _tensor_info(meta: Any, batch: int) -> TensorInfo | None:
    shape = getattr(meta, "shape", None)
    dtype = getattr(meta, "dtype", None)
    if shape is None or dtype is None or len(shape) == 0 or int(shape[0]) != batch:
        return None
    per_item = tuple(int(s) for s in shape[1:])
    numel = 1
    for s in per_item:
        numel *= s
    itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else 4
    return TensorInfo(per_item, str(dtype).replace("torch.", ""), numel * int(itemsize))


def _trace(module: Any, example: Any) -> tuple[Any, str, list[str]]:
    import torch
    from torch import fx

    notes: list[str] = []
    try:
        return fx.symbolic_trace(module), "fx", notes
    except Exception as exc:  # noqa: BLE001 - any tracing failure sends us to torch.export
        notes.append(f"torch.fx could not trace it ({type(exc).__name__}: "
                     f"{str(exc).splitlines()[0][:120] if str(exc) else ''}); used torch.export")
    try:
        try:  # a symbolic batch axis keeps batch sizes out of the graph (views, reshapes)
            batch = torch.export.Dim("batch", min=1, max=1 << 16)
            exported = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
        except Exception:  # noqa: BLE001 - retried with static shapes, noted below
            exported = torch.export.export(module, (example,))
            notes.append("torch.export specialised the batch size: segments may need batch "
                         f"{example.shape[0]}")
    except Exception as exc:
        raise RunError(
            f"cannot capture the graph of {type(module).__name__}: torch.fx and torch.export both "
            f"failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}); "
            "a network needs a traceable forward() to be partitioned"
        ) from exc
    graph_module = exported.module()
    # The unlifted module wraps inputs and outputs in pytree code; plain fx codegen is what the
    # segment builder reuses, and the graph itself is already flat.
    graph_module.graph._codegen = fx.graph.CodeGen()
    for node in list(graph_module.graph.nodes):
        # Input guards check the example's shapes; segments run at other batch sizes.
        if node.op == "call_module" and node.target == "_guards_fn":
            graph_module.graph.erase_node(node)
    graph_module.recompile()
    return graph_module, "export", notes


def _input_dependent(nodes: list[Any]) -> set[Any]:
    dependent: set[Any] = set()
    for node in nodes:
        if node.op == "placeholder" or any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def capture_graph(module: Any, input_shape: tuple[int, ...], *, example_batch: int = 2) -> ModelGraph:
    """Trace `module` (eval mode, CPU), propagate shapes at `example_batch`, find cut points.

    Positions where the only live value is not a batch-major tensor (a shape, a list) are not
    cuts. Values that do not depend on the input (parameters fetched in the graph, constants) are
    not live: every segment that needs them gets its own copy.
    """
    import torch
    from torch.fx.passes.shape_prop import ShapeProp

    example = torch.randn(example_batch, *input_shape)
    graph_module, method, notes = _trace(module, example)
    if method == "fx":  # an exported module is already in inference form and refuses eval()
        graph_module.eval()
    graph = graph_module.graph
    graph.eliminate_dead_code()
    graph_module.recompile()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise UsageError(
            f"{type(module).__name__}.forward takes {len(placeholders)} inputs after tracing; "
            "partitioning handles networks with one input tensor"
        )
    try:
        with torch.inference_mode(False), torch.no_grad():
            ShapeProp(graph_module).propagate(example)
    except Exception as exc:
        raise RunError(
            f"running the captured graph of {type(module).__name__} on a "
            f"{tuple(example.shape)} batch failed: {type(exc).__name__}: {exc}"
        ) from exc
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    dependent = _input_dependent(nodes)
    last_use = {n: max((order[u] for u in n.users), default=order[n]) for n in nodes}
    output_node = nodes[-1]
    outputs = [
        info for n in output_node.all_input_nodes
        if (info := _tensor_info(n.meta.get("tensor_meta"), example_batch)) is not None
    ]
    if len(outputs) != len(output_node.all_input_nodes):
        notes.append("some outputs are not batch-major tensors: the pipeline passes them as they are")
    cuts: list[CutPoint] = []
    live: set[Any] = set()
    for i, node in enumerate(nodes[:-1]):
        if node in dependent and last_use[node] > i:
            live.add(node)
        live = {n for n in live if last_use[n] > i}
        if i == 0 or order[nodes[i + 1]] == len(nodes) - 1 or len(live) != 1:
            continue  # before the input is consumed, right before the output, or >1 live
        (crossing,) = live
        info = _tensor_info(crossing.meta.get("tensor_meta"), example_batch)
        if info is not None and crossing.op != "placeholder" and not (
                cuts and cuts[-1].node == crossing.name):
            cuts.append(CutPoint(i, crossing.name, info))
    input_info = _tensor_info(placeholders[0].meta.get("tensor_meta"), example_batch)
    if input_info is None:  # pragma: no cover - the example is batch-major by construction
        raise RunError("the captured graph lost the input's shape")
    return ModelGraph(graph_module, method, nodes, cuts, input_info, outputs, example_batch, notes)
