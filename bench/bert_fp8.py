r"""BERT-base on a Hopper GPU: eager fp16, compiled fp16, and compiled with FP8 matrix products.

BERT-base (random weights from `BertConfig`'s defaults, nothing downloaded), sequence 128, fp16,
side by side in one process at each batch: plain eager; `torch.compile` `reduce-overhead`
(its CUDA graphs, the compiled kernels); and the same compiled model with every `nn.Linear`
whose rows allow it computed in FP8 (e4m3) through `torch._scaled_mm`: the weights quantized
once per tensor, the activations either per call (`dynamic`: an amax reduction before every
product) or with scales calibrated once on another batch (`static`, the torch engine's
`precision: fp8`, infermux.engines.fp8: the saturating cast fuses into the kernel before),
with the tensor cores' fast accumulation (`static-fast`, the engine's) or without (`static`);
fp16 out.
Each figure is items/s over `--seconds` after warm-up, device-synchronized, inputs already on
the device (what is compared is the network's compute, not the copies). The FP8 model's pooled
output is compared with the fp16 model's (largest absolute difference, smallest cosine).

    python bench/bert_fp8.py --batches 128,256 --scales dynamic,static,static-fast --json bert_fp8.json

Needs a GPU with FP8 tensor cores (compute capability 8.9 or later) and `transformers`.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

from infermux.engines.fp8 import E4M3_MAX as _E4M3_MAX
from infermux.engines.fp8 import calibrate, to_fp8


def fp8_linear(linear: Any) -> Any:
    """An `nn.Linear` in FP8 e4m3, the activations' scale computed per call (fp16 where rows % 16)."""
    import torch
    import torch.nn.functional as fn

    class FP8Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = linear.weight.data.float()
            scale = w.abs().amax().clamp(min=1e-12) / _E4M3_MAX
            self.w8 = (w / scale).to(torch.float8_e4m3fn).contiguous()
            self.w_scale = scale.reshape(())
            self.weight, self.bias = linear.weight, linear.bias

        def forward(self, x: Any) -> Any:
            rows = x.reshape(-1, x.shape[-1])
            if rows.shape[0] % 16:  # _scaled_mm wants multiples of 16
                return fn.linear(x, self.weight, self.bias)
            scale = rows.abs().amax().float().clamp(min=1e-12) / _E4M3_MAX
            x8 = (rows.float() / scale).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(x8, self.w8.t(), scale_a=scale, scale_b=self.w_scale,
                                 bias=self.bias, out_dtype=x.dtype)
            return y.reshape(*x.shape[:-1], y.shape[-1])

    return FP8Linear()


def to_fp8_dynamic(module: Any) -> Any:
    """`module` with every `nn.Linear` replaced by `fp8_linear` (in place)."""
    import torch

    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, fp8_linear(child))
        else:
            to_fp8_dynamic(child)
    return module


def _rate(model: Any, ids: Any, mask: Any, seconds: float) -> float:
    import torch

    for _ in range(5):
        model(input_ids=ids, attention_mask=mask)
    torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        model(input_ids=ids, attention_mask=mask)
        n += 1
    torch.cuda.synchronize()
    return n * ids.shape[0] / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="128,256")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--scales", default="dynamic,static,static-fast",
                   help="FP8 variants: dynamic (per call), static, static-fast (calibrated scales, "
                        "without and with fast accumulation)")
    p.add_argument("--mode", default="reduce-overhead",
                   help="torch.compile mode of the compiled builds (max-autotune: minutes)")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    import torch
    import torch.nn.functional as fn
    from transformers import BertConfig, BertModel

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
    torch.manual_seed(0)
    base = BertModel(BertConfig()).eval()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "seq": a.seq,
                              "mode": a.mode, "rows": []}
    with torch.inference_mode():
        for batch in [int(b) for b in a.batches.split(",")]:
            ids = torch.randint(0, 30522, (batch, a.seq), device="cuda")
            mask = torch.ones_like(ids)
            fp16 = copy.deepcopy(base).half().cuda()
            ref = fp16(input_ids=ids, attention_mask=mask).pooler_output.float()
            row: dict[str, Any] = {"batch": batch, "items_per_s": {}}
            row["items_per_s"]["eager fp16"] = _rate(fp16, ids, mask, a.seconds)
            compiled = torch.compile(fp16, mode=a.mode)
            row["items_per_s"]["compiled fp16"] = _rate(compiled, ids, mask, a.seconds)
            calib_ids = torch.randint(0, 30522, (batch, a.seq), device="cuda")
            amax = calibrate(fp16, [calib_ids, torch.ones_like(calib_ids)])
            row["fp8_vs_fp16"] = {}
            for kind in a.scales.split(","):
                model = copy.deepcopy(base).half().cuda()
                if kind == "dynamic":
                    to_fp8_dynamic(model)
                else:
                    to_fp8(model, amax, fast_accum=kind == "static-fast")
                fp8 = torch.compile(model, mode=a.mode)
                name = f"compiled fp8 linears ({kind})"
                row["items_per_s"][name] = _rate(fp8, ids, mask, a.seconds)
                out = fp8(input_ids=ids, attention_mask=mask).pooler_output.float()
                row["fp8_vs_fp16"][kind] = {
                    "max_abs": float((out - ref).abs().max()),
                    "min_cosine": float(fn.cosine_similarity(out, ref).min())}
                torch._dynamo.reset()
            torch._dynamo.reset()
            eager = row["items_per_s"]["eager fp16"]
            row["vs_eager"] = {k: v / eager for k, v in row["items_per_s"].items()}
            report["rows"].append(row)
            Path(a.json).write_text(json.dumps(report, indent=1))
            print(f"b{batch}: " + ", ".join(f"{k} {v:,.0f} ({row['vs_eager'][k]:.2f}x)"
                                            for k, v in row["items_per_s"].items())
                  + "; pooled output vs fp16: " + ", ".join(
                      f"{k} max abs {v['max_abs']:.3f} min cosine {v['min_cosine']:.4f}"
                      for k, v in row["fp8_vs_fp16"].items()), flush=True)


if __name__ == "__main__":
    main()
