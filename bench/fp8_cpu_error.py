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

    python bench/fp8_cpu_error.py --model hf:bert-base --batch 16
"""

from __future__ import annotations

import argparse
import copy
import json

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="hf:bert-base")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="rows the agreement inputs are tiled to")
    p.add_argument("--json", help="also write the errors here")
    a = p.parse_args()
    import torch

    from infermux import agreement
    from infermux.engines import fp8
    from infermux.engines.pytorch import _FP8_CALIBRATION_ITEMS
    from infermux.models import load_model

    model = load_model(a.model)
    io = model.spec_io
    ref = agreement.reference_for(model, length=a.seq)
    calib = [torch.from_numpy(x) for x in
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
    inputs = [torch.from_numpy(np.concatenate([x] * reps)[:a.batch]) for x in ref.all_inputs]
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
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
