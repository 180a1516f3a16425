"""Transformer networks from the `transformers` package, built without downloading anything.

`hf:bert-base`, `hf:distilbert`, `hf:vit-base` and `hf:whisper-tiny-encoder` are the package's
own config classes at their defaults — the shapes of those published checkpoints — with random
weights. `hf:PATH` is a local folder as `save_pretrained` writes it: its `config.json` decides
the architecture (the first of its `architectures`, else the base model of its type), and its
weights are loaded when the folder holds them. Nothing is fetched from a hub: every load is
`local_files_only`, with `HF_HUB_OFFLINE` set.

The network is wrapped so that it takes its inputs positionally, in the order of its spec, and
returns a tuple of its outputs in the order of their names: what engines, the ONNX exporter and
CUDA graphs need. The wrapper carries its spec (`inputs`, `outputs`, `default_dims`), read by
`infermux.iospec.from_module` like any factory's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from infermux.errors import RunError, UsageError
from infermux.iospec import TensorSpec

__all__ = ["ARCHITECTURES", "DEFAULT_SEQ", "HFModule", "build", "names"]

#: name → (config class, model class, module that holds the model class if not the top level).
ARCHITECTURES: dict[str, tuple[str, str, str]] = {
    "bert-base": ("BertConfig", "BertModel", ""),
    "distilbert": ("DistilBertConfig", "DistilBertModel", ""),
    "vit-base": ("ViTConfig", "ViTModel", ""),
    "whisper-tiny-encoder": ("WhisperConfig", "WhisperEncoder",
                             "transformers.models.whisper.modeling_whisper"),
}
#: The sequence length of text models when none is asked for.
DEFAULT_SEQ = 128
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def names() -> list[str]:
    """The architecture names `hf:NAME` builds."""
    return sorted(ARCHITECTURES)


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub, whatever is asked
    try:
        import transformers
    except ImportError:
        raise UsageError("hf: models need the transformers package: "
                         "pip install 'infermux[hf]'") from None
    return transformers


def build(name: str) -> HFModule:
    """The wrapped network for `hf:NAME` or `hf:PATH`, in eval mode, with its spec attached."""
    import importlib

    transformers = _transformers()
    folder = Path(name).expanduser()
    weights_from: str | None = None
    if name in ARCHITECTURES:
        config_cls, model_cls, where = ARCHITECTURES[name]
        config = getattr(transformers, config_cls)()
        holder = importlib.import_module(where) if where else transformers
        with torch.random.fork_rng():
            torch.manual_seed(0)  # the same random weights in every process that builds it
            model = getattr(holder, model_cls)(config)
    elif (folder / "config.json").is_file():
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        arch = (getattr(config, "architectures", None) or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        cls = cls or transformers.AutoModel
        try:
            if any((folder / f).is_file() for f in _WEIGHT_FILES):
                model = cls.from_pretrained(str(folder), local_files_only=True)
                weights_from = str(folder)
            else:
                with torch.random.fork_rng():
                    torch.manual_seed(0)
                    model = (cls.from_config(config) if cls is transformers.AutoModel
                             else cls(config))
        except (OSError, ValueError) as exc:
            raise RunError(f"transformers cannot build {str(folder)!r}: {exc}") from exc
    else:
        hint = ("a folder with config.json" if folder.exists() else
                f"one of {', '.join(names())}, or a local folder with config.json")
        raise UsageError(f"model 'hf:{name}' unknown: use {hint}")
    model.eval()
    _use_own_sdpa(model)
    wrapper = _wrap(model, config)
    wrapper.weights_from = weights_from
    return wrapper


#: transformers' SDPA attention under a name of infermux's, whose mask builder leaves a
#: bidirectional mask out whenever the padding mask is None (see `_use_own_sdpa`).
OWN_SDPA = "infermux_sdpa"


_registered = False


def own_sdpa_mask(*args: Any, **kwargs: Any) -> Any:
    """`OWN_SDPA`'s mask builder (transformers passes its arguments by keyword).

    None for a bidirectional attention given no padding mask and no window shorter than the
    keys; else what transformers' `sdpa_mask` builds.
    """
    from transformers.masking_utils import sdpa_mask

    local = kwargs.get("local_size")
    if (kwargs.get("attention_mask") is None and kwargs.get("allow_is_bidirectional_skip")
            and (local is None or kwargs.get("kv_length", local) < local)):
        return None
    return sdpa_mask(*args, **kwargs)


def _register_own_sdpa() -> bool:
    """Register `OWN_SDPA` with transformers (once per process); False where it cannot."""
    global _registered
    if _registered:
        return True
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    AttentionInterface.register(OWN_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(OWN_SDPA, own_sdpa_mask)
    _registered = True
    return True


def _use_own_sdpa(model: Any) -> None:
    """Run `model`'s SDPA attention with no mask at all when its attention mask is None.

    transformers leaves an all-ones mask out itself only outside tracing, after reading it
    (a device sync); traced (torch.compile, CUDA graph capture) it keeps every mask, and with
    torch 2.11 under torch.compile it even built one when given None: an expanded mask that
    sent attention to PyTorch's unfused math kernels (BERT-base b256 on H100s: half the masked
    build's speed or less). Under this name a None mask means no mask on every torch, which
    the torch engine uses for batches without padding (`TorchOptions.dense_attention`); given
    masks, causal ones and sliding windows are built exactly as SDPA's.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not _register_own_sdpa():
        return
    model.set_attn_implementation(OWN_SDPA)


def _input_specs(model: Any, config: Any) -> tuple[list[TensorSpec], dict[str, int]]:
    """The inputs the network's forward takes, from its main input and its config."""
    import inspect

    main = getattr(model, "main_input_name", "input_ids")
    params = inspect.signature(model.forward).parameters
    if main == "input_ids":
        specs = [TensorSpec("input_ids", "int64", ("seq",), high=int(config.vocab_size))]
        if "attention_mask" in params:
            specs.append(TensorSpec("attention_mask", "int64", ("seq",), values="ones"))
        if "token_type_ids" in params and getattr(config, "type_vocab_size", None):
            specs.append(TensorSpec("token_type_ids", "int64", ("seq",),
                                    high=int(config.type_vocab_size)))
        return specs, {"seq": DEFAULT_SEQ}
    if main == "pixel_values":
        size = config.image_size
        hw = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        return [TensorSpec("pixel_values", "float32", (int(config.num_channels), *hw))], {}
    if main == "input_features":
        frames = 2 * int(config.max_source_positions)  # two convolutions, the second of stride 2
        return [TensorSpec("input_features", "float32", (int(config.num_mel_bins), frames))], {}
    raise UsageError(f"transformers model {type(model).__name__} takes {main!r}, which infermux "
                     "cannot generate inputs for (it runs input_ids, pixel_values, input_features)")


class HFModule(torch.nn.Module):
    """A transformers network taking its inputs in order and returning a tuple of outputs."""

    def __init__(self, inner: Any, input_names: list[str]) -> None:
        super().__init__()
        self.model = inner
        self.input_names = input_names
        self.output_names: list[str] = []
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []
        self.default_dims: dict[str, int] = {}
        self.weights_from: str | None = None
        self.hf_config: dict[str, Any] = {}
        #: The attention mask input, which transformers also takes as None (no padding): the
        #: torch engine runs batches without padding so (`TorchOptions.dense_attention`).
        self.mask_input = "attention_mask" if "attention_mask" in input_names else None

    @contextmanager
    def export_form(self) -> Iterator[None]:
        """The network with its attention written out (matmul, softmax, matmul) for export.

        PyTorch runs attention through `scaled_dot_product_attention`, whose ONNX form (with
        NaN guards for fully masked rows) ONNX Runtime's transformer optimizer does not
        recognise; the plain form is what it fuses into its Attention operator. Same outputs.
        """
        setter = getattr(self.model, "set_attn_implementation", None)
        before = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        if setter is None or before in (None, "eager"):
            yield
            return
        setter("eager")
        try:
            yield
        finally:
            setter(before)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy in another process (pickled to a worker) needs the attention it names.
        inner = state.get("_modules", {}).get("model")
        config = getattr(inner, "config", None)
        if getattr(config, "_attn_implementation", None) == OWN_SDPA:
            _register_own_sdpa()
        super().__setstate__(state)

    def attention_shape(self) -> tuple[int, int] | None:
        """(heads, hidden size) of the attention, from the config; None when it has neither."""
        config = self.hf_config
        heads = (config.get("num_attention_heads") or config.get("n_heads")
                 or config.get("encoder_attention_heads"))
        hidden = config.get("hidden_size") or config.get("dim") or config.get("d_model")
        return (int(heads), int(hidden)) if heads and hidden else None

    def forward(self, *args: Any) -> tuple[Any, ...]:
        """The network's outputs, named by `output_names`, for inputs in `input_names` order."""
        out = self.model(**dict(zip(self.input_names, args, strict=True)), return_dict=True)
        names = self.output_names or [k for k, v in out.items() if isinstance(v, torch.Tensor)]
        return tuple(out[k] for k in names)


def _wrap(model: Any, config: Any) -> HFModule:
    import numpy as np

    inputs, defaults = _input_specs(model, config)

    wrapper = HFModule(model, [t.name for t in inputs]).eval()
    # Output names and shapes from two small runs: a dim that follows the length is "seq".
    lengths = (7, 9) if defaults else (None,)
    seen: list[dict[str, tuple[int, ...]]] = []
    dtypes: dict[str, str] = {}
    for length in lengths:
        dims = {"seq": length} if length else {}
        xs = [torch.from_numpy(np.ascontiguousarray(a))
              for a in (t.generate(1, dims, np.random.default_rng(0)) for t in inputs)]
        with torch.inference_mode():
            out = model(**dict(zip(wrapper.input_names, xs, strict=True)), return_dict=True)
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        seen.append({k: tuple(v.shape[1:]) for k, v in tensors.items()})
        dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()}
    outputs = []
    for key, shape in seen[0].items():
        other = seen[-1].get(key, shape)
        dims_out = tuple("seq" if a != b else a for a, b in zip(shape, other, strict=True))
        outputs.append(TensorSpec(key, dtypes[key], dims_out))
    wrapper.output_names = [t.name for t in outputs]
    wrapper.inputs = inputs
    wrapper.outputs = outputs
    wrapper.default_dims = defaults
    wrapper.hf_config = config.to_dict()
    return wrapper
