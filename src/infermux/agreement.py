"""Numerical agreement: checks that an engine computes what the PyTorch fp32 model computes.

Every benchmark point is checked on the same few inputs against one reference (PyTorch fp32 on
the CPU; ONNX Runtime's CPU provider for a model given as an ONNX file), within the tolerance of
the precision the runner really computes in. A runner that fails is a wrong result, whatever its
speed: the point is marked invalid and says why.

Two figures, both reported:
- `rel_err`: max |engine − reference| / max |reference| over each output (relative to the output's
  scale, so near-zero logits do not blow it up); it must be within the precision's tolerance;
- `top1`: the share of items whose arg-max agrees. A disagreement is forgiven only as a near tie:
  the engine's pick scores, in the reference, within the tolerance of the reference's best.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from infermux.engines.base import Runner
from infermux.models import LoadedModel

__all__ = [
    "AGREEMENT_ITEMS", "TOLERANCES", "Agreement", "Reference", "check", "reference_for", "skipped",
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
}
_DEFAULT_TOLERANCE = 5e-2


@dataclass(frozen=True)
class Reference:
    """Fixed inputs and the reference's outputs for them."""

    inputs: np.ndarray  # (AGREEMENT_ITEMS, *input_shape), float32
    outputs: list[np.ndarray]
    source: str  # "torch-fp32-cpu" | "onnxruntime-fp32-cpu"


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


def reference_for(model: LoadedModel, items: int = AGREEMENT_ITEMS, seed: int = 0) -> Reference:
    """Seeded inputs and the fp32 reference outputs for them (computed once per model)."""
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


def check(runner: Runner, reference: Reference) -> Agreement:
    """Run the reference inputs through `runner` (tiled to its batch) and compare outputs."""
    precision = str(runner.options.get("precision") or runner.unit.mode)
    tol = TOLERANCES.get(precision, _DEFAULT_TOLERANCE)
    n_ref = reference.inputs.shape[0]
    reps = -(-runner.batch // n_ref)
    batch = np.concatenate([reference.inputs] * reps)[: runner.batch]
    outputs = runner.infer(batch)
    items = min(runner.batch, n_ref)

    def broken(message: str) -> Agreement:
        return Agreement("fail", precision, tol, None, None, 0, items, reference.source, message)

    if len(outputs) != len(reference.outputs):
        return broken(f"{len(outputs)} outputs, the reference has {len(reference.outputs)}")
    rel_err = 0.0
    top1: float | None = None
    near_ties = wrong_picks = 0
    for i, (got, ref) in enumerate(zip(outputs, reference.outputs, strict=True)):
        got, ref = got[:items], ref[:items]
        if got.shape != ref.shape:
            return broken(f"output {i} has shape {got.shape}, the reference {ref.shape}")
        scale = float(np.max(np.abs(ref))) or 1.0
        err = float(np.max(np.abs(got.astype(np.float64) - ref))) / scale
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
    status = "fail" if problems else "pass"
    message = "; ".join(problems) or (
        f"within {tol:g} of the {reference.source} reference"
        + (f" ({near_ties} near ties)" if near_ties else ""))
    return Agreement(status, precision, tol, rel_err, top1, near_ties, items, reference.source,
                     message)


def skipped(runner: Runner, why: str) -> Agreement:
    """An agreement entry saying the check could not run, and why."""
    precision = str(runner.options.get("precision") or runner.unit.mode)
    return Agreement("skipped", precision, TOLERANCES.get(precision, _DEFAULT_TOLERANCE), None,
                     None, 0, 0, "", why)
