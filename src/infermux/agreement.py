"""Numerical agreement: checks that an engine computes what the PyTorch fp32 model computes.

Every benchmark point is checked on the same few inputs against one reference (PyTorch fp32 on
the CPU; ONNX Runtime's CPU provider for a model given as an ONNX file), within the tolerance of
the precision the runner really computes in. A runner that fails is a wrong result, whatever its
speed: the point is marked invalid and says why.

`check_stages` does the same for a pipeline: a chain of stage runners, each a segment of the
network on its own unit and engine, checked stage by stage and end to end.

Two figures, both reported:
- `rel_err`: max |engine − reference| / max |reference| over each output (relative to the output's
  scale, so near-zero logits do not blow it up); it must be within the precision's tolerance;
- `top1`: the share of items whose arg-max agrees. A disagreement is forgiven only as a near tie:
  the engine's pick scores, in the reference, within the tolerance of the reference's best.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from infermux.engines.base import Engine, Runner
from infermux.errors import InfermuxError, UsageError
from infermux.models import LoadedModel
from infermux.units import Unit

if TYPE_CHECKING:
    from infermux.models.graph import ModelGraph

__all__ = [
    "AGREEMENT_ITEMS", "TOLERANCES", "Agreement", "ChainAgreement", "ChainStage", "Reference",
    "StageAgreement", "check", "check_stages", "reference_for", "skipped",
]

#: Items in the reference batch: enough to see a wrong engine, cheap on a CPU (ResNet50: ~0.5 s).
AGREEMENT_ITEMS = 8
#: Largest relative error (of the output's scale) accepted per computing precision.
TOLERANCES: dict[str, float] = {
    "fp32": 1e-3,  # reordered sums and fused kernels only
    "tf32": 1e-2,  # 10-bit mantissa inputs to matrix products
    "fp16": 2e-2,
    "bf16": 5e-2,  # 7-bit mantissa
    "int8": 1.5e-1,
    "fp8": 1.5e-1,  # e4m3 products (3-bit mantissa), per-tensor static scales
}
_DEFAULT_TOLERANCE = 5e-2


@dataclass(frozen=True)
class Reference:
    """Fixed inputs and the reference's outputs for them."""

    inputs: np.ndarray  # (AGREEMENT_ITEMS, *input_shape), float32
    outputs: list[np.ndarray]
    source: str  # "torch-fp32-cpu" | "onnxruntime-fp32-cpu"
    #: Every input, in the model's order, for a model of several or integer inputs (the first
    #: is `inputs`); empty for one float input.
    all_inputs: tuple[np.ndarray, ...] = ()


@dataclass(frozen=True)
class Agreement:
    """One runner's agreement with the reference, as stored in a result's `agreement` entry."""

    status: str  # pass | fail | skipped
    precision: str
    tolerance: float
    rel_err: float | None
    top1: float | None
    near_ties: int
    items: int
    reference: str
    message: str = ""

    @property
    def passed(self) -> bool:
        """True unless the engine's results are wrong (a skipped check is not a failure)."""
        return self.status != "fail"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; NaN errors become None."""
        data = asdict(self)
        if data["rel_err"] is not None and not math.isfinite(data["rel_err"]):
            data["rel_err"] = None
        return data


def reference_for(model: LoadedModel, items: int = AGREEMENT_ITEMS, seed: int = 0,
                  length: int | None = None) -> Reference:
    """Seeded inputs and the fp32 reference outputs for them (computed once per model).

    A model of several inputs gets runnable ones (`IOSpec.generate`) at sequence `length`.
    """
    io = model.spec_io
    if not io.simple:
        return _reference_io(model, io.generate(items, io.dims_for(length), seed))
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal((items, *model.input_shape)).astype(np.float32)
    if model.module is not None:
        import torch
        from torch.utils._pytree import tree_flatten

        # One item at a time: the reference must not fail (or run out of memory) at a batch
        # size the benchmark itself never asked for.
        per_item: list[list[np.ndarray]] = []
        with torch.inference_mode():
            for i in range(items):
                leaves, _ = tree_flatten(model.module(torch.from_numpy(inputs[i : i + 1])))
                per_item.append([t.float().numpy() for t in leaves if isinstance(t, torch.Tensor)])
        outputs = [np.concatenate(parts) for parts in zip(*per_item, strict=True)]
        return Reference(inputs, outputs, "torch-fp32-cpu")
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(str(model.onnx_path), sess_options=so,
                                   providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    outputs = [np.asarray(y, dtype=np.float32) for y in session.run(None, {name: inputs})]
    return Reference(inputs, outputs, "onnxruntime-fp32-cpu")


def _reference_io(model: LoadedModel, inputs: list[np.ndarray]) -> Reference:
    """The fp32 reference of a model of several inputs, one item at a time on the CPU."""
    items = len(inputs[0])
    if model.module is not None:
        import torch
        from torch.utils._pytree import tree_flatten

        per_item: list[list[np.ndarray]] = []
        with torch.inference_mode():
            for i in range(items):
                xs = [torch.from_numpy(np.ascontiguousarray(a[i : i + 1])) for a in inputs]
                leaves, _ = tree_flatten(model.module(*xs))
                per_item.append([t.float().numpy() for t in leaves if isinstance(t, torch.Tensor)])
        outputs = [np.concatenate(parts) for parts in zip(*per_item, strict=True)]
        return Reference(inputs[0], outputs, "torch-fp32-cpu", tuple(inputs))
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(str(model.onnx_path), sess_options=so,
                                   providers=["CPUExecutionProvider"])
    feed = {meta.name: a for meta, a in zip(session.get_inputs(), inputs, strict=True)}
    outputs = [np.asarray(y, dtype=np.float32) for y in session.run(None, feed)]
    return Reference(inputs[0], outputs, "onnxruntime-fp32-cpu", tuple(inputs))


@dataclass(frozen=True)
class _Comparison:
    """Outputs against reference outputs: errors, top-1 figures and what is wrong."""

    rel_err: float
    max_abs_err: float
    top1: float | None
    near_ties: int
    problems: list[str]


def _compare(outputs: Sequence[np.ndarray], references: Sequence[np.ndarray], items: int,
             tol: float, precision: str) -> _Comparison | str:
    """Compare the first `items` rows of each output; a string says why they cannot be."""
    if len(outputs) != len(references):
        return f"{len(outputs)} outputs, the reference has {len(references)}"
    rel_err = max_abs = 0.0
    top1: float | None = None
    near_ties = wrong_picks = 0
    for i, (got, ref) in enumerate(zip(outputs, references, strict=True)):
        got, ref = got[:items], ref[:items]
        if got.shape != ref.shape:
            return f"output {i} has shape {got.shape}, the reference {ref.shape}"
        scale = float(np.max(np.abs(ref))) or 1.0
        diff = float(np.max(np.abs(got.astype(np.float64) - ref)))
        max_abs = max(max_abs, diff if math.isfinite(diff) else math.inf)
        err = diff / scale
        rel_err = max(rel_err, err if math.isfinite(err) else math.inf)
        if i == 0 and ref.ndim == 2 and ref.shape[1] > 1:
            picked, best = got.argmax(axis=1), ref.argmax(axis=1)
            agree = picked == best
            top1 = float(agree.mean())
            rows = np.arange(items)
            gap = ref[rows, best] - ref[rows, picked]
            near_ties = int(np.sum(~agree & (gap <= tol * scale)))
            wrong_picks = int(np.sum(~agree)) - near_ties
    problems = []
    if not rel_err <= tol:
        problems.append(f"relative error {rel_err:.3g} > {tol:g} allowed for {precision}")
    if top1 is not None and wrong_picks:
        problems.append(f"top-1 disagrees on {wrong_picks} of {items} items beyond near ties")
    return _Comparison(rel_err, max_abs, top1, near_ties, problems)


def check(runner: Runner, reference: Reference) -> Agreement:
    """Run the reference inputs through `runner` (tiled to its batch) and compare outputs."""
    precision = str(runner.options.get("precision") or runner.unit.mode)
    tol = TOLERANCES.get(precision, _DEFAULT_TOLERANCE)
    n_ref = reference.inputs.shape[0]
    reps = -(-runner.batch // n_ref)
    if reference.all_inputs:
        outputs = runner.infer_inputs([np.concatenate([a] * reps)[: runner.batch]
                                       for a in reference.all_inputs])
    else:
        batch = np.concatenate([reference.inputs] * reps)[: runner.batch]
        outputs = runner.infer(batch)
    items = min(runner.batch, n_ref)
    found = _compare(outputs, reference.outputs, items, tol, precision)
    if isinstance(found, str):
        return Agreement("fail", precision, tol, None, None, 0, items, reference.source, found)
    status = "fail" if found.problems else "pass"
    message = "; ".join(found.problems) or (
        f"within {tol:g} of the {reference.source} reference"
        + (f" ({found.near_ties} near ties)" if found.near_ties else ""))
    return Agreement(status, precision, tol, found.rel_err, found.top1, found.near_ties, items,
                     reference.source, message)


def skipped(runner: Runner, why: str) -> Agreement:
    """An agreement entry saying the check could not run, and why."""
    precision = str(runner.options.get("precision") or runner.unit.mode)
    return Agreement("skipped", precision, TOLERANCES.get(precision, _DEFAULT_TOLERANCE), None,
                     None, 0, 0, "", why)


# -- pipelines: a chain of stage runners against the whole model --------------------------------


class ChainStage(NamedTuple):
    """One pipeline stage to check: the segment `start` → `end`, its unit, engine and options."""

    start: str
    end: str
    unit: Unit | str
    engine: str = "torch"
    options: dict[str, Any] | None = None


@dataclass(frozen=True)
class StageAgreement:
    """One stage's output against the fp32 torch reference of its segment, on the same input.

    `status` is pass, fail, or not-run (an earlier stage failed so this one had no input).
    Errors are None when the stage did not produce comparable outputs.
    """

    index: int
    start: str
    end: str
    unit: str
    engine: str
    status: str
    precision: str
    tolerance: float
    max_abs_err: float | None
    rel_err: float | None
    message: str

    @property
    def passed(self) -> bool:
        """True when the stage ran and agreed."""
        return self.status == "pass"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; non-finite errors become None."""
        return _finite_errors(asdict(self))


@dataclass(frozen=True)
class ChainAgreement:
    """A chain of stages: each stage's agreement, and the final output against the model's.

    The final output is held to the loosest tolerance among the stages' precisions. `problems`
    lists what is wrong with the chain itself (it does not start at the input, a stage does not
    start where the previous one ends, ...), found before anything runs.
    """

    status: str  # pass | fail
    stages: list[StageAgreement]
    tolerance: float
    max_abs_err: float | None
    rel_err: float | None
    top1: float | None
    items: int
    problems: list[str]
    message: str

    @property
    def passed(self) -> bool:
        """True when the chain is well formed, every stage agrees, and so does its output."""
        return self.status == "pass"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        data = _finite_errors(asdict(self))
        data["stages"] = [s.to_dict() for s in self.stages]
        return data


def _finite_errors(data: dict[str, Any]) -> dict[str, Any]:
    """Non-finite error figures become None (JSON has no inf or nan)."""
    for key in ("max_abs_err", "rel_err"):
        if data[key] is not None and not math.isfinite(data[key]):
            data[key] = None
    return data


def _chain_problems(graph: ModelGraph, stages: Sequence[ChainStage]) -> list[str]:
    """What makes `stages` not a chain from the network's input to its output, in order."""
    if not stages:
        return ["no stages given"]
    problems = []
    known = set(graph.boundaries)
    for i, stage in enumerate(stages):
        for name in (stage.start, stage.end):
            if name not in known:
                problems.append(f"stage {i}: {name!r} is not a cut point of this network")
    if stages[0].start != "input":
        problems.append(f"stage 0 starts at {stages[0].start!r}, not at the network's input")
    if stages[-1].end != "output":
        problems.append(f"the last stage ends at {stages[-1].end!r}, not at the network's output")
    for i in range(1, len(stages)):
        if stages[i].start != stages[i - 1].end:
            problems.append(f"stage {i} starts at {stages[i].start!r} but stage {i - 1} ends at "
                            f"{stages[i - 1].end!r}")
    return problems


def _stage_result(index: int, stage: ChainStage, unit: Unit, status: str, message: str,
                  precision: str = "", max_abs_err: float | None = None,
                  rel_err: float | None = None) -> StageAgreement:
    precision = precision or unit.mode
    return StageAgreement(index, stage.start, stage.end, unit.id, stage.engine, status, precision,
                          TOLERANCES.get(precision, _DEFAULT_TOLERANCE), max_abs_err, rel_err,
                          message)


def _torch_outputs(module: Any, x: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_flatten

    with torch.inference_mode():
        leaves, _ = tree_flatten(module(x))
    return [t.float() for t in leaves if isinstance(t, torch.Tensor)]


def check_stages(
    model: LoadedModel,
    graph: ModelGraph,
    stages: Sequence[ChainStage | tuple[Any, ...]],
    *,
    batch: int = 2,
    seed: int = 0,
    engines: dict[str, Engine] | None = None,
) -> ChainAgreement:
    """Run seeded inputs through a chain of stage runners and check every hand-off.

    Each stage `(start, end, unit, engine, options)` is built as its own runner (segment
    `start` → `end` of `graph`, at `batch`) and run with `Runner.compute` on the previous
    stage's output, moved to its unit's memory. Its output is compared with the fp32 torch
    reference of its segment given the same input (so a stage's own error shows, not the
    errors before it), and the last output with the whole model's fp32 reference (so a wrong
    chain shows even when every stage computes its own segment right). Tolerances are those of
    `check`: the precision each runner reports; the final output gets the loosest of them.

    A chain that is not one (out of order, gaps, unknown cut points) fails and says why; the
    stages still run as far as their shapes allow. Engines are created (and released after) as
    needed, unless given in `engines` (then the caller owns them).
    """
    import torch

    from infermux.engines.base import compute_device, create_engine
    from infermux.models.segments import segment_between

    chain = [s if isinstance(s, ChainStage) else ChainStage(*s) for s in stages]
    problems = _chain_problems(graph, chain)
    own: dict[str, Engine] = {}
    pool = dict(engines or {})
    found: Any = None
    rng = np.random.default_rng(seed)
    x0 = torch.from_numpy(rng.standard_normal((batch, *graph.input.shape)).astype(np.float32))
    x = x0
    results: list[StageAgreement] = []
    tolerances: list[float] = []
    outputs: list[Any] | None = None
    try:
        for i, stage in enumerate(chain):
            unit = stage.unit
            if isinstance(unit, str):
                from infermux.units import discover, select_units

                found = found or discover(with_runtimes=not unit.startswith(("cpu", "cuda")))
                unit = select_units([unit], found)[0]

            if outputs is None and i > 0:
                results.append(_stage_result(i, stage, unit, "not-run", "an earlier stage failed"))
                continue
            try:
                seg = segment_between(model, graph, stage.start, stage.end, i)
                if tuple(x.shape[1:]) != seg.input_shape:
                    raise UsageError(f"its input is a {tuple(x.shape[1:])} tensor per item; the "
                                     f"segment {stage.start} → {stage.end} takes {seg.input_shape}")
                engine = pool.get(stage.engine)
                if engine is None:
                    engine = pool[stage.engine] = own[stage.engine] = create_engine(stage.engine)
                runner = engine.build(seg, unit, batch, stage.options or {})
                got = runner.compute(x.to(compute_device(unit)))
                got = [t.detach().float().cpu().clone() for t in got]
            except Exception as exc:  # noqa: BLE001 - a stage that cannot run fails the check
                why = str(exc) if isinstance(exc, InfermuxError) else f"{type(exc).__name__}: {exc}"
                results.append(_stage_result(i, stage, unit, "fail", why))
                outputs = None
                continue
            precision = str(runner.options.get("precision") or unit.mode)
            tol = TOLERANCES.get(precision, _DEFAULT_TOLERANCE)
            tolerances.append(tol)
            ref = _torch_outputs(seg.module, x)
            cmp = _compare([g.numpy() for g in got], [r.numpy() for r in ref], batch, tol,
                           precision)
            if isinstance(cmp, str):
                results.append(_stage_result(i, stage, unit, "fail", cmp, precision))
            else:
                results.append(_stage_result(
                    i, stage, unit, "fail" if cmp.problems else "pass",
                    "; ".join(cmp.problems) or f"within {tol:g} of its segment's torch fp32 output",
                    precision, cmp.max_abs_err, cmp.rel_err))
            outputs = got
            x = got[0]
    finally:
        for engine in own.values():
            engine.release()
    tol = max(tolerances, default=_DEFAULT_TOLERANCE)
    final: _Comparison | str = "the chain produced no output"
    if outputs is not None:
        reference = _torch_outputs(model.module, x0)
        final = _compare([g.numpy() for g in outputs], [r.numpy() for r in reference], batch,
                         tol, "the chain")
    failed = [r for r in results if not r.passed]
    messages = list(problems)
    messages += [f"stage {r.index} ({r.start} → {r.end} on {r.unit}, {r.engine}): {r.message}"
                 for r in failed]
    if isinstance(final, str):
        messages.append(f"final output: {final}")
        return ChainAgreement("fail", results, tol, None, None, None, batch, problems,
                              "; ".join(messages))
    messages += [f"final output against the whole model: {p}" for p in final.problems]
    status = "fail" if messages else "pass"
    message = "; ".join(messages) or (
        f"{len(results)} stages, each within its tolerance; the output within {tol:g} of the "
        "whole model's torch fp32 output")
    return ChainAgreement(status, results, tol, final.max_abs_err, final.rel_err, final.top1,
                          batch, problems, message)
