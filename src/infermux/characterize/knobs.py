"""Knobs that may remove a variance, and the process settings a build applies before it starts.

A variance found (outputs that differ between builds, between two runs of one build, or with the
batch an item is in) is measured again with one knob pinned at a time; the report says which
knob removes which variance and what it costs in throughput. A knob is engine options (given to
`Engine.build`), process settings (applied by the build's process before anything is built), or
a shared cache folder across the builds of its study.

Process settings, also accepted as options (`-o cudnn_benchmark=true`) for the baseline:
- `cudnn_benchmark` (bool): `torch.backends.cudnn.benchmark`: cuDNN times its algorithms at the
  first run of each shape and keeps the fastest, which may differ from build to build;
- `deterministic` (bool): `torch.use_deterministic_algorithms(True)`, cuDNN deterministic mode,
  benchmark off and `CUBLAS_WORKSPACE_CONFIG=:4096:8`;
- `inductor_autotune` (bool): torch.compile's autotuning (Triton configuration benchmarks,
  max-autotune's GEMM choices, coordinate descent); False pins the first configuration;
- `mkldnn` (bool): `torch.backends.mkldnn.enabled`: False runs PyTorch's own CPU kernels instead
  of oneDNN's, whose choice of kernel (and so of summation order) may follow the batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infermux.errors import UsageError

__all__ = [
    "KNOBS", "SETTINGS", "Knob", "applicable_knobs", "apply_settings", "environment_for",
    "split_settings",
]

#: Process settings a build applies itself (not engine options), with their types.
SETTINGS: dict[str, type] = {"cudnn_benchmark": bool, "deterministic": bool,
                             "inductor_autotune": bool, "mkldnn": bool}


@dataclass(frozen=True)
class Knob:
    """One thing to pin: engine options, process settings or a shared cache, for some engines."""

    name: str
    title: str
    engines: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    shared_cache: bool = False
    #: Whether the knob changes anything for (unit kind, engine options, settings) of a variant.
    when: Callable[[str, dict[str, Any], dict[str, Any]], bool] = lambda _k, _o, _s: True

    def applies(self, engine: str, unit_kind: str, options: dict[str, Any],
                settings: dict[str, Any], share_cache: bool) -> bool:
        """Whether pinning this knob changes the variant's build."""
        if engine not in self.engines or (self.shared_cache and share_cache):
            return False
        if self.options and all(options.get(k) == v for k, v in self.options.items()):
            return False  # already pinned in the baseline
        if self.settings and all(settings.get(k) == v for k, v in self.settings.items()):
            return False
        return self.when(unit_kind, options, settings)

    def pin(self, options: dict[str, Any], settings: dict[str, Any]
            ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The variant's (engine options, settings) with this knob pinned."""
        options = {**options, **self.options}
        if self.settings.get("inductor_autotune") is False:
            # A max-autotune mode turns autotuning on in torch.compile's own call: the same
            # mode without it is reduce-overhead (CUDA graphs) or default.
            mode = str(options.get("compile"))
            lighter = {"max-autotune": "reduce-overhead", "max-autotune-no-cudagraphs": "default"}
            if mode in lighter:
                options["compile"] = lighter[mode]
        pinned = {**settings, **self.settings}
        if pinned.get("deterministic"):
            pinned["cudnn_benchmark"] = False  # what deterministic mode sets: say it in the key
        return options, pinned


def _compiled(_kind: str, options: dict[str, Any], _settings: dict[str, Any]) -> bool:
    return bool(options.get("compile"))


def _benchmark_on(kind: str, _options: dict[str, Any], settings: dict[str, Any]) -> bool:
    return kind == "cuda" and bool(settings.get("cudnn_benchmark"))


def _openvino_device(kind: str, _options: dict[str, Any], _settings: dict[str, Any]) -> bool:
    return kind == "openvino"  # a `cpu` unit is pinned to f32 already


def _cpu(kind: str, _options: dict[str, Any], _settings: dict[str, Any]) -> bool:
    return kind == "cpu"


#: Every knob, in the order they are tried.
KNOBS: tuple[Knob, ...] = (
    Knob("cudnn_benchmark_off", "cudnn.benchmark off", ("torch",),
         settings={"cudnn_benchmark": False}, when=_benchmark_on),
    Knob("deterministic", "torch.use_deterministic_algorithms(True)", ("torch",),
         settings={"deterministic": True}),
    Knob("no_autotune", "torch.compile autotuning off", ("torch",),
         settings={"inductor_autotune": False}, when=_compiled),
    Knob("shared_cache", "one cache shared by the builds (compiled kernels, timing caches)",
         ("torch",), shared_cache=True, when=_compiled),
    Knob("shared_cache", "one cache shared by the builds (engines, timing caches)",
         ("tensorrt",), shared_cache=True),
    Knob("graph_optimization_off", "ONNX Runtime graph optimizations off", ("onnxruntime",),
         options={"graph_optimization": "disable"}),
    Knob("precision_f32", "OpenVINO inference precision hint fixed to f32", ("openvino",),
         options={"precision": "f32"}, when=_openvino_device),
    Knob("latency_hint", "OpenVINO latency hint (one stream, whole batches)", ("openvino",),
         options={"hint": "latency", "split_batch": False}),
    Knob("mkldnn_off", "oneDNN off (PyTorch's own CPU kernels)", ("torch",),
         settings={"mkldnn": False}, when=_cpu),
    Knob("one_thread", "one intra-op thread", ("torch",), options={"threads": 1}, when=_cpu),
    Knob("one_thread", "one intra-op thread", ("onnxruntime",), options={"intra_op_threads": 1},
         when=_cpu),
    Knob("one_thread", "one inference thread", ("openvino",), options={"threads": 1}),
)


def applicable_knobs(engine: str, unit_kind: str, options: dict[str, Any],
                     settings: dict[str, Any], share_cache: bool) -> list[Knob]:
    """The knobs worth pinning for a variant, in order."""
    return [k for k in KNOBS if k.applies(engine, unit_kind, options, settings, share_cache)]


def split_settings(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine options, process settings): settings keys are taken out of `options`."""
    engine_options = {k: v for k, v in options.items() if k not in SETTINGS}
    settings: dict[str, Any] = {}
    for key in SETTINGS:
        if key in options:
            value = options[key]
            if not isinstance(value, bool):
                raise UsageError(f"option {key}={value!r} must be true or false, e.g. "
                                 f"-o {key}=true")
            settings[key] = value
    return engine_options, settings


def environment_for(settings: dict[str, Any]) -> dict[str, str]:
    """Environment variables a build's process needs for `settings` (set before CUDA starts)."""
    if settings.get("deterministic"):
        return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    return {}


def apply_settings(settings: dict[str, Any]) -> None:
    """Apply process settings in this (fresh) process, before any engine builds."""
    if not settings:
        return
    import torch

    if "cudnn_benchmark" in settings:
        torch.backends.cudnn.benchmark = bool(settings["cudnn_benchmark"])
    if "mkldnn" in settings:
        torch.backends.mkldnn.enabled = bool(settings["mkldnn"])  # type: ignore[assignment]
    if settings.get("deterministic"):
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    if settings.get("inductor_autotune") is False:
        from torch._inductor import config as inductor

        for name, value in (("max_autotune", False), ("max_autotune_gemm", False),
                            ("max_autotune_pointwise", False),
                            ("coordinate_descent_tuning", False)):
            if hasattr(inductor, name):
                setattr(inductor, name, value)
        if hasattr(inductor, "triton") and hasattr(inductor.triton, "autotune_pointwise"):
            inductor.triton.autotune_pointwise = False
