r"""FP8 products' error on a network's outputs, emulated on the CPU: which Linears to keep.

torch's `_scaled_mm` has a CPU kernel, so the torch engine's FP8 arithmetic (`precision: fp8`,
infermux.engines.fp8: per-tensor e4m3 weights, activation scales calibrated on 32 seeded items)
runs here without a GPU. The network is built in fp16 as on an fp16 unit, calibrated as the
engine calibrates, and run on the agreement check's seeded inputs, tiled to `--batch` rows
(a Linear computes in FP8 only when its rows are a multiple of 16: at the check's 8 items a
pooler's product is fp16 whatever the rule). Each output's error is the agreement check's
(largest absolute difference over the largest reference magnitude), against the fp32
reference, for:
- `rule`: the engine's conversion (Linears on fewer rows than the most, poolers and heads,
  left in the unit's precision);
- `every`: every convertible Linear in FP8, the rule's left-out ones included.
The tensor cores' fast accumulation has no CPU counterpart: a GPU's error is larger.

`--recipes` adds other FP8 recipes, emulated in fp32 (each product's inputs rounded to e4m3
at their scale and back, the product in fp32): `tensor` (the engine's: one weight scale, one
calibrated activation scale per Linear), `channel` (a weight scale per output channel),
`token` (an activation scale per row, taken at each call), `channel+token`; and
`keep:PATTERN` (the engine's recipe with the Linears whose names contain PATTERN, `+`-joined
for several, left in fp32): whether finer scales or a few Linears kept out would bring a
network's outputs within the tolerance.

    python bench/fp8_cpu_error.py --model hf:bert-base --batch 16
    python bench/fp8_cpu_error.py --model hf:vit-base --batch 16 \
        --recipes tensor,channel,token,channel+token,keep:layers.0.,keep:fc1,keep:fc2
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="hf:bert-base")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="rows the agreement inputs are tiled to")
    p.add_argument("--json", help="also write the errors here")
    p.add_argument("--recipes", default="", help="emulated recipes (see above), comma list")
    a = p.parse_args()
    import torch

    from infermux import agreement
    from infermux.engines import fp8
    from infermux.engines.pytorch import _FP8_CALIBRATION_ITEMS
    from infermux.models import load_model

    model = load_model(a.model)
    io = model.spec_io
    ref = agreement.reference_for(model, length=a.seq)
    def as_unit(x: np.ndarray) -> torch.Tensor:  # float inputs in the unit's fp16
        t = torch.from_numpy(x)
        return t.to(torch.float16) if t.is_floating_point() else t

    calib = [as_unit(x) for x in
             io.generate(_FP8_CALIBRATION_ITEMS, io.dims_for(a.seq), seed=1)]
    half = copy.deepcopy(model.module).eval().to(torch.float16)
    rule = fp8.calibrate(half, calib)
    # Every convertible Linear's input amax, the left-out ones too (their own pass).
    every = dict(rule)
    hooks = [m.register_forward_pre_hook(
                 lambda _m, args, n=n: every.__setitem__(
                     n, max(every.get(n, 0.0), float(args[0].abs().amax()))))
             for n, m in half.named_modules()
             if isinstance(m, torch.nn.Linear) and fp8.convertible(m) and n not in rule]
    with torch.inference_mode():
        half(*calib)
    for h in hooks:
        h.remove()
    items = len(ref.inputs)
    reps = -(-a.batch // items)
    inputs = [as_unit(np.concatenate([x] * reps)[:a.batch])
              for x in ref.all_inputs or (ref.inputs,)]
    names = [t.name for t in io.outputs]
    report = {"model": a.model, "batch": a.batch, "seq": a.seq, "errors": {}}
    for label, amax in (("rule", rule), ("every", every)):
        net = copy.deepcopy(model.module).eval().to(torch.float16)
        converted = fp8.to_fp8(net, amax)
        with torch.inference_mode():
            outs = [o.float().numpy()[:items] for o in net(*inputs)]
        errors = {n: float(np.abs(o - r).max() / np.abs(r).max())
                  for n, o, r in zip(names, outs, ref.outputs, strict=True)}
        report["errors"][label] = {"linears_in_fp8": converted, **errors}
        print(f"{label:6s} {converted:3d} Linears in FP8: "
              + ", ".join(f"{n} {e:.3f}" for n, e in errors.items()), flush=True)
    if a.recipes:
        base = copy.deepcopy(model.module).eval().float()
        amax = fp8.calibrate(base, [x.float() if x.is_floating_point() else x for x in calib])
        fp32_inputs = [x.float() if x.is_floating_point() else x for x in inputs]
        for recipe in a.recipes.split(","):
            net, converted = _emulated(base, amax, recipe)
            with torch.inference_mode():
                outs = [o.float().numpy()[:items] for o in net(*fp32_inputs)]
            errors = {n: float(np.abs(o - r).max() / np.abs(r).max())
                      for n, o, r in zip(names, outs, ref.outputs, strict=True)}
            report["errors"][f"emulated {recipe}"] = {"linears_in_fp8": converted, **errors}
            print(f"emulated {recipe:20s} {converted:3d} Linears in FP8: "
                  + ", ".join(f"{n} {e:.3f}" for n, e in errors.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


def _emulated(base: Any, amax: dict[str, float], recipe: str) -> tuple[Any, int]:
    """A copy of the fp32 `base` whose calibrated Linears compute as `recipe` emulates."""
    import torch

    from infermux.engines import fp8

    keep = recipe.removeprefix("keep:").split("+") if recipe.startswith("keep:") else []
    scales = "tensor" if keep else recipe
    if scales not in ("tensor", "channel", "token", "channel+token"):
        raise SystemExit(f"--recipes: {recipe!r} is not tensor, channel, token, channel+token "
                         "or keep:PATTERN")

    def rounded(x: Any, scale: Any) -> Any:  # x through e4m3 at `scale`, back in fp32
        return (x / scale).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(
            torch.float8_e4m3fn).float() * scale

    class Emulated(torch.nn.Module):
        def __init__(self, linear: Any, x_amax: float) -> None:
            super().__init__()
            w = linear.weight.data.float()
            w_amax = (w.abs().amax(dim=1, keepdim=True) if "channel" in scales
                      else w.abs().amax())
            self.w = rounded(w, w_amax.clamp(min=1e-12) / fp8.E4M3_MAX)
            self.bias = linear.bias
            self.x_scale = max(x_amax, 1e-12) / fp8.E4M3_MAX

        def forward(self, x: Any) -> Any:
            scale = (x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / fp8.E4M3_MAX
                     if "token" in scales else self.x_scale)
            return torch.nn.functional.linear(rounded(x.float(), scale), self.w, self.bias)

    net = copy.deepcopy(base)
    converted = 0
    for name, linear in fp8._linears(net):
        if name not in amax or any(k in name for k in keep):
            continue
        parent, _, child = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, child,
                Emulated(linear, amax[name]))
        converted += 1
    return net, converted


if __name__ == "__main__":
    main()
