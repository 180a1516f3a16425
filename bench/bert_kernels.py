r"""Where a BERT-base step's GPU time goes: kernels by kind, for eager, compiled fp16 and FP8.

BERT-base (random weights from `BertConfig`'s defaults, nothing downloaded), one batch shape,
fp16 on one GPU, built several ways side by side in one process:
- `eager`: plain PyTorch eager fp16 (the baseline of the BERT target);
- `compiled`: `torch.compile` (`--mode`) of the same network;
- `fp8`: compiled with every convertible `nn.Linear` in FP8 (the torch engine's
  `precision: fp8`: static scales, fast accumulation);
- `fp8-nomask`: the FP8 build called without the attention mask (every item full length, the
  same outputs), as the torch engine runs batches without padding (`dense_attention`):
  transformers drops an all-ones mask in eager mode, not under compile, so this shows what
  carrying the mask costs the compiled builds;
- `fp8-frozen`: the FP8 build compiled with inductor's `freezing` (weights folded as constants);
- `fp8-nomask-full`: `fp8-nomask` with its products accumulated in full fp32 (no fast mode);
- `fp8-nomask-tuned`: `fp8-nomask` with inductor's pointwise kernels autotuned
  (`max_autotune_pointwise`, `coordinate_descent_tuning`).
For each: items/s over `--seconds` after warm-up (device-synchronized, inputs already on the
device) and, from `torch.profiler`, the GPU time per step by kernel kind (matrix products,
attention, inductor's fused kernels, the rest) and the largest kernels.

    python bench/bert_kernels.py --batch 256 --json kernels.json
    python bench/bert_kernels.py --batch 256 --builds eager,fp8,fp8-nomask --json k.json

Needs a GPU (FP8 builds: compute capability 8.9 or later) and `transformers`.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import time
from pathlib import Path
from typing import Any

from infermux.engines.fp8 import calibrate, to_fp8

BUILDS = ("eager", "compiled", "fp8", "fp8-nomask", "fp8-frozen", "fp8-nomask-full",
          "fp8-nomask-tuned")


def kind(name: str) -> str:
    """A kernel's kind from its name."""
    low = name.lower()
    # Attention first: cuDNN's and CUTLASS's attention kernels carry GEMM-like names too.
    if any(k in low for k in ("fmha", "flash", "attention", "attn", "softmax", "sdpa")):
        return "attention"
    if any(k in low for k in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90_", "sm89_")):
        return "matmul"
    if low.startswith("triton") or "triton_" in low:
        return "inductor fused"
    if any(k in low for k in ("layer_norm", "layernorm")):
        return "layer norm"
    if any(k in low for k in ("elementwise", "vectorized", "reduce", "gelu", "unrolled")):
        return "eager elementwise"
    if "memcpy" in low or "memset" in low:
        return "copy"
    return "other"


def _step(model: Any, ids: Any, mask: Any) -> Any:
    return model(input_ids=ids, attention_mask=mask)


def _rate(model: Any, ids: Any, mask: Any, seconds: float) -> float:
    import torch

    for _ in range(5):
        _step(model, ids, mask)
    torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        _step(model, ids, mask)
        n += 1
    torch.cuda.synchronize()
    return n * ids.shape[0] / (time.perf_counter() - start)


def _profile(model: Any, ids: Any, mask: Any, steps: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        _step(model, ids, mask)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _step(model, ids, mask)
        torch.cuda.synchronize()
    by_kind: collections.Counter[str] = collections.Counter()
    by_name: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
        by_kind[kind(ev.name)] += us
        by_name[ev.name] += us
        calls[ev.name] += 1
    total = sum(by_kind.values()) or 1.0
    return {"gpu_ms_per_step": total / steps / 1e3,
            "by_kind_ms": {k: v / steps / 1e3 for k, v in by_kind.most_common()},
            "by_kind_share": {k: v / total for k, v in by_kind.most_common()},
            "top": [{"kernel": n[:140], "kind": kind(n), "ms_per_step": v / steps / 1e3,
                     "calls_per_step": calls[n] / steps}
                    for n, v in by_name.most_common(16)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=10, help="profiled steps per build")
    p.add_argument("--builds", default=",".join(BUILDS))
    p.add_argument("--mode", default="default", help="torch.compile mode of the compiled builds")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    import torch

    from infermux import hf

    builds = a.builds.split(",")
    unknown = sorted(set(builds) - set(BUILDS))
    if unknown:
        raise SystemExit(f"--builds {','.join(unknown)}: not one of {', '.join(BUILDS)}")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    # BertConfig's defaults, seeded random weights, attention under infermux's SDPA name
    # (a None mask is no mask: the engine's batches without padding).
    base = hf.build("bert-base").model
    ids = torch.randint(0, 30522, (a.batch, a.seq), device="cuda")
    mask = torch.ones_like(ids)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "batch": a.batch,
                              "seq": a.seq, "mode": a.mode, "torch": torch.__version__,
                              "builds": {}}
    amax: dict[str, float] | None = None
    with torch.inference_mode():
        fp16 = copy.deepcopy(base).half().cuda()
        ref = fp16(input_ids=ids, attention_mask=mask).pooler_output.float()
        for build in builds:
            torch._dynamo.reset()
            model = copy.deepcopy(base).half().cuda()
            given = mask
            if build.startswith("fp8"):
                if amax is None:
                    calib = torch.randint(0, 30522, (32, a.seq), device="cuda")
                    amax = calibrate(fp16, [calib, torch.ones_like(calib)])
                to_fp8(model, amax, fast_accum=build != "fp8-nomask-full")
            if build.startswith("fp8-nomask"):
                given = None
            if build != "eager":
                import torch._inductor
                import torch._inductor.config as inductor

                inductor.freezing = build == "fp8-frozen"
                if build == "fp8-nomask-tuned":
                    options = {**torch._inductor.list_mode_options(a.mode),
                               "max_autotune_pointwise": True, "coordinate_descent_tuning": True}
                    model = torch.compile(model, options=options)
                else:
                    model = torch.compile(model, mode=a.mode)
            t0 = time.perf_counter()
            out = _step(model, ids, given).pooler_output.float()
            row: dict[str, Any] = {"first_call_s": time.perf_counter() - t0,
                                   "max_abs_vs_eager": float((out - ref).abs().max()),
                                   "rel_vs_eager": float((out - ref).abs().max()
                                                         / ref.abs().max())}
            row["items_per_s"] = _rate(model, ids, given, a.seconds)
            row["profile"] = _profile(model, ids, given, a.steps)
            report["builds"][build] = row
            Path(a.json).write_text(json.dumps(report, indent=1))
            shares = ", ".join(f"{k} {v:.2f} ms" for k, v in row["profile"]["by_kind_ms"].items())
            print(f"{build:16s} {row['items_per_s']:9,.0f} items/s  rel {row['rel_vs_eager']:.3f}  GPU "
                  f"{row['profile']['gpu_ms_per_step']:.2f} ms/step: {shares}", flush=True)
            for t in row["profile"]["top"][:8]:
                print(f"    {t['ms_per_step']:6.3f} ms x{t['calls_per_step']:<4.0f} {t['kind']:16s} "
                      f"{t['kernel'][:90]}", flush=True)
    eager = report["builds"].get("eager", {}).get("items_per_s")
    if eager:
        report["vs_eager"] = {b: r["items_per_s"] / eager for b, r in report["builds"].items()}
        print("vs eager: " + ", ".join(f"{b} {v:.2f}x" for b, v in report["vs_eager"].items()))
    Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
