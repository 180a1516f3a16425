"""Contiguous segments of a captured graph as runnable modules, with FLOPs and parameters.

A segment runs from one boundary (`input` or a cut point) to a later one (a cut point or
`output`). It is built as its own `torch.fx.GraphModule` that takes the crossing tensor and
returns the next crossing tensor (or the network's outputs), so any engine that runs a torch
module runs a segment. Parameters are shared with the captured module, not copied.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from infermux.errors import UsageError
from infermux.models import LoadedModel
from infermux.models.graph import ModelGraph, TensorInfo

__all__ = ["Segment", "build_segment", "count_flops", "segment_between", "segment_model", "split"]


@dataclass
class Segment:
    """Boundaries `start` → `end`, the module, and its cost facts (per item)."""

    start: str
    end: str
    module: Any  # torch.fx.GraphModule
    input: TensorInfo
    outputs: list[TensorInfo]
    flops_per_item: int
    parameters: int

    @property
    def name(self) -> str:
        """`input→layer2_1_relu_1`."""
        return f"{self.start}→{self.end}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "start": self.start, "end": self.end, "input": self.input.to_dict(),
            "outputs": [o.to_dict() for o in self.outputs],
            "flops_per_item": self.flops_per_item, "parameters": self.parameters,
        }


def build_segment(graph: ModelGraph, start: str, end: str) -> Any:
    """A GraphModule computing `graph` from boundary `start` to boundary `end`."""
    from torch import fx

    lo, hi = graph.position(start), graph.position(end)
    if hi <= lo:
        raise UsageError(f"segment {start!r} → {end!r} is empty or reversed: the end must come later")
    nodes = graph.nodes
    source = nodes[lo] if start == "input" else next(n for n in nodes if n.name == start)
    new = fx.Graph()
    env: dict[Any, Any] = {source: new.placeholder("x")}

    def copy(node: Any) -> Any:
        if node not in env:
            # Values before the segment that it may read are constants (parameters, shapes of
            # nothing): the single-live rule guarantees every input-dependent one is `source`.
            for arg in node.all_input_nodes:
                copy(arg)
            env[node] = new.node_copy(node, lambda n: env[n])
        return env[node]

    for node in nodes[lo + 1: hi + 1]:
        if node.op == "output":
            new.output(fx.node.map_arg(node.args[0], copy))
        else:
            copy(node)
    if end != "output":
        new.output(env[next(n for n in nodes if n.name == end)])
    module = fx.GraphModule(graph.module, new, class_name="Segment")
    module.graph.eliminate_dead_code()
    module.recompile()
    module.eval()
    return module


def count_flops(module: Any, input_shape: tuple[int, ...]) -> int:
    """FLOPs of one item through `module` (torch's flop counter; matmul/conv-type ops only)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        module(torch.zeros(1, *input_shape))
    return int(counter.get_total_flops())


def _parameters(module: Any) -> int:
    return int(sum(p.numel() for p in module.parameters()))  # parameters() skips shared ones


def split(graph: ModelGraph, boundaries: list[str] | None = None) -> list[Segment]:
    """Segments between consecutive `boundaries` (default: every cut point of the graph)."""
    names = boundaries or graph.boundaries
    if names[0] != "input" or names[-1] != "output":
        raise UsageError(f"boundaries {names} must start with 'input' and end with 'output'")
    infos = {c.node: c.tensor for c in graph.cuts}
    segments = []
    for start, end in itertools.pairwise(names):
        module = build_segment(graph, start, end)
        seg_in = graph.input if start == "input" else infos[start]
        outs = graph.outputs if end == "output" else [infos[end]]
        segments.append(Segment(start, end, module, seg_in, outs,
                                count_flops(module, seg_in.shape), _parameters(module)))
    return segments


def segment_model(model: LoadedModel, segment: Segment, index: int) -> LoadedModel:
    """A LoadedModel wrapping one segment, ready for `Engine.build` like any model."""
    return LoadedModel.from_module(
        segment.module,
        name=f"{model.name}[{index}:{segment.name}]",
        input_shape=segment.input.shape,
        dtype=model.dtype,
        weights_note=model.weights_note,
    )


def segment_between(model: LoadedModel, graph: ModelGraph, start: str, end: str,
                    index: int = 0) -> LoadedModel:
    """The segment of `graph` from boundary `start` to `end` as a LoadedModel, for any engine.

    Its input shape is the crossing tensor's at `start` (the network's input at `input`); the
    ONNX engines export it with that input (batch axis dynamic) like any model.
    """
    module = build_segment(graph, start, end)
    seg_in = graph.input if start == "input" else graph.cut(start).tensor
    return LoadedModel.from_module(
        module,
        name=f"{model.name}[{index}:{start}→{end}]",
        input_shape=seg_in.shape,
        dtype=model.dtype,
        weights_note=model.weights_note,
    )
