"""FP8 matrix products for PyTorch modules on Hopper and Ada GPUs: the torch engine's `precision: fp8`.

Every `nn.Linear` whose dimensions allow it computes in FP8 e4m3 through `torch._scaled_mm`,
the rest of the network staying in the unit's fp16 or bf16: the weights quantized once per
tensor, the activations with one scale per Linear calibrated once on a sample batch (static
scales: the cast, saturated at e4m3's range, fuses into the kernel that writes the activation,
where a per-call amax would add a reduction before every product). This is the post-training
recipe of inference stacks (TensorRT's FP8 PTQ): weights and activations per tensor, products
accumulated in the tensor cores' own precision, outputs in fp16/bf16.

Measured on H100s (docs/benchmarks.md, "FP8 products with calibrated scales"): BERT-base at
batch 128 ran +21% over the same compiled fp16 build with static scales against +5% with
per-call ones, within fp8's agreement tolerance; ViT-B/16's outputs were not (its points are
refused by the agreement check). A network of convolutions gains nothing: its few Linears are
not where its time goes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["E4M3_MAX", "FP8_CAPABILITY", "WORTH_SHARE", "calibrate", "capability", "convertible",
           "linear_share", "to_fp8", "unit_reason", "unsupported_reason"]

#: e4m3's largest finite value: a calibrated amax maps to it.
E4M3_MAX = 448.0
#: FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards.
FP8_CAPABILITY = (8, 9)
#: `torch._scaled_mm` wants every dimension a multiple of 16.
_ALIGN = 16
#: The share of a network's parameters in convertible Linears from which the tuner tries FP8:
#: where the products FP8 speeds up hold most of the weights (BERT-base 0.78, ViT-B 0.99;
#: ResNet50 0, its classifier's 1,000 outputs not a multiple of 16).
WORTH_SHARE = 0.5


def convertible(linear: Any) -> bool:
    """True when `linear`'s weight has both dimensions a multiple of 16 (an FP8 product's)."""
    return linear.in_features % _ALIGN == 0 and linear.out_features % _ALIGN == 0


def _linears(module: Any) -> list[tuple[str, Any]]:
    import torch

    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and convertible(m)]


def linear_share(module: Any) -> float:
    """The share of `module`'s parameters in the weights of its convertible Linears."""
    total = sum(p.numel() for p in module.parameters())
    return sum(m.weight.numel() for _, m in _linears(module)) / total if total else 0.0


def capability(unit: Any) -> tuple[int, int] | None:
    """A CUDA unit's compute capability from its discovery details (None when not recorded)."""
    text = str(unit.details.get("compute_capability") or "")
    major, _, minor = text.partition(".")
    return (int(major), int(minor or 0)) if major.isdigit() else None


def unit_reason(unit: Any) -> str:
    """Why `precision: fp8` cannot run on `unit` ("" when it can, as far as the unit says)."""
    if unit.kind != "cuda":
        return f"it needs a CUDA unit with FP8 tensor cores, not {unit.id!r}"
    return unsupported_reason(unit.mode, capability(unit))


def unsupported_reason(unit_mode: str, capability: tuple[int, int] | None,
                       module: Any = None) -> str:
    """Why `precision: fp8` cannot run here ("" when it can)."""
    if unit_mode not in ("fp16", "bf16"):
        return (f"precision fp8 keeps the rest of the network in fp16 or bf16: use a "
                f"cuda:N/fp16 or cuda:N/bf16 unit, not {unit_mode}")
    if capability is not None and capability < FP8_CAPABILITY:
        return (f"precision fp8 needs FP8 tensor cores (compute capability "
                f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later), this GPU has "
                f"{capability[0]}.{capability[1]}")
    if module is not None and not _linears(module):
        return ("precision fp8 computes nn.Linear layers in FP8 and this network has none with "
                "dimensions a multiple of 16")
    return ""


def _fp8_linear_class() -> type:
    import torch
    import torch.nn.functional as fn

    class _FP8Linear(torch.nn.Module):
        """An `nn.Linear` computing in FP8 e4m3 with per-tensor static scales.

        Rows in a number not a multiple of 16 (a pooler's batch-1 row) run the fp16/bf16
        product of the same weight.
        """

        w8: torch.Tensor
        w_scale: torch.Tensor
        x_scale: torch.Tensor
        x_inv: torch.Tensor

        def __init__(self, linear: Any, x_amax: float, fast_accum: bool) -> None:
            super().__init__()
            w = linear.weight.data.float()
            w_scale = w.abs().amax().clamp(min=1e-12) / E4M3_MAX
            self.register_buffer("w8", (w / w_scale).to(torch.float8_e4m3fn).t())
            self.register_buffer("w_scale", w_scale.reshape(()))
            x_scale = torch.tensor(max(x_amax, 1e-12) / E4M3_MAX, dtype=torch.float32,
                                   device=w.device)
            self.register_buffer("x_scale", x_scale)
            # Its inverse kept, not computed in the product's prologue: a compiled build
            # fuses `1 / scale` into the kernel before, where it is a division per element.
            self.register_buffer("x_inv", 1.0 / x_scale)
            self.weight, self.bias = linear.weight, linear.bias
            self.fast_accum = fast_accum

        def extra_repr(self) -> str:
            return (f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
                    f"e4m3, fast_accum={self.fast_accum}")

        def forward(self, x: Any) -> Any:
            rows = x.reshape(-1, x.shape[-1])
            if rows.shape[0] % _ALIGN:
                return fn.linear(x, self.weight, self.bias)
            # Saturate what the calibration batch did not reach rather than overflow to NaN.
            x8 = (rows.float() * self.x_inv).clamp(
                -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(x8, self.w8, scale_a=self.x_scale, scale_b=self.w_scale,
                                 bias=self.bias, out_dtype=x.dtype,
                                 use_fast_accum=self.fast_accum)
            return y.reshape(*x.shape[:-1], y.shape[-1])

    return _FP8Linear


def calibrate(module: Any, inputs: Sequence[Any]) -> dict[str, float]:
    """Input amax of the convertible `nn.Linear`s on the most rows, over one `module(*inputs)`.

    Linears run on fewer rows than that (a pooler or a classification head, one row per item
    where the others run one per token) are left out, so `to_fp8` keeps them in the unit's
    precision: their products cost next to nothing, and their error would land straight on
    the outputs (BERT-base's pooled output: relative error 0.115 with its pooler kept, 0.143
    with the pooler in FP8, emulated on a CPU by bench/fp8_cpu_error.py).
    """
    import torch

    amax: dict[str, float] = {}
    rows: dict[str, int] = {}
    hooks = []

    def hook_for(name: str) -> Callable[..., None]:
        def hook(_module: Any, args: Any) -> None:
            x = args[0].detach()
            amax[name] = max(amax.get(name, 0.0), float(x.abs().amax()))
            rows[name] = max(rows.get(name, 0), x.numel() // max(1, x.shape[-1]))
        return hook

    for name, linear in _linears(module):
        hooks.append(linear.register_forward_pre_hook(hook_for(name)))
    try:
        with torch.inference_mode():
            module(*inputs)
    finally:
        for h in hooks:
            h.remove()
    most = max(rows.values(), default=0)
    return {name: value for name, value in amax.items() if rows[name] == most}


def to_fp8(module: Any, amax: dict[str, float], fast_accum: bool = True) -> int:
    """Swap every calibrated `nn.Linear` in `module` for an FP8 one, in place; how many."""
    cls = _fp8_linear_class()
    swapped = 0
    for name, linear in _linears(module):
        if name not in amax:  # not reached by the calibration pass: left as it is
            continue
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, cls(linear, amax[name], fast_accum))
        swapped += 1
    return swapped
