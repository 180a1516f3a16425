"""ONNX Runtime's transformer fusions: an exported encoder rewritten into ORT's fused operators.

ONNX Runtime's session optimisations (`graph_optimization=all`) fuse what is local — GELU with
its bias, LayerNorm, MatMul with a scale — but not a whole attention block: that is the
`onnxruntime.transformers` optimizer's work (`optimize_model`, model type `bert`). It turns the
exported graph into ORT's own operators: `Attention` (the Q, K and V projections as one GEMM,
the mask, softmax and context in one kernel), `EmbedLayerNormalization` (word + position
embeddings and their LayerNorm), `SkipLayerNormalization` (residual add + LayerNorm) and
`BiasGelu`. The fused file runs on ONNX Runtime only (CPU provider here; the operators live in
the `com.microsoft` domain).

The optimizer needs the attention's head count and hidden size (its own detection from the
graph fails on PyTorch's exports): the transformers models give them from their config; an
ONNX file given as is leaves them to the detection, and the record says what was fused. The
export writes the attention as matmul–softmax–matmul (`HFModule.export_form`): the
`scaled_dot_product_attention` form (with its NaN guards) is not a pattern the optimizer knows.

The optimizer takes tens of seconds on a 2-core CPU for DistilBERT; the fused file is cached by
(source digest, heads, hidden size, ONNX Runtime release, recipe), like the exports.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from infermux.cache import bound_after_write, touch
from infermux.errors import RunError, UsageError, first_line
from infermux.export import ExportedModel, atomic_file, cache_dir, file_digest

__all__ = ["FUSED_OPERATORS", "fuse_transformer", "fused_operators"]

#: ONNX Runtime's fused transformer operators, counted in a fused file's record.
FUSED_OPERATORS = ("Attention", "MultiHeadAttention", "EmbedLayerNormalization",
                   "SkipLayerNormalization", "BiasGelu", "FastGelu", "Gelu",
                   "QAttention", "DynamicQuantizeMatMul", "MatMulIntegerToFloat")
#: Bumped when the fusion settings change what is written.
_RECIPE = 1
_MEMO: dict[tuple[Any, ...], tuple[ExportedModel, dict[str, int]]] = {}


def fused_operators(path: Path) -> dict[str, int]:
    """How many of each fused ONNX Runtime operator an ONNX file holds (those present only)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    counts = Counter(n.op_type for n in proto.graph.node if n.op_type in FUSED_OPERATORS)
    return dict(sorted(counts.items()))


def fuse_transformer(source: ExportedModel, attention: tuple[int, int] | None,
                     root: Path | None = None) -> tuple[ExportedModel, dict[str, int]]:
    """`source` rewritten by ONNX Runtime's transformer optimizer, and the operators it fused.

    `attention` is (heads, hidden size); None lets the optimizer detect them. Cached on disk.
    """
    try:
        import onnxruntime
        from onnxruntime.transformers.optimizer import optimize_model
    except ImportError as exc:
        raise UsageError(f"option transformer_fusion=true needs onnxruntime's transformers "
                         f"tools ({exc}): pip install 'infermux[onnx]'") from None
    heads, hidden = attention or (0, 0)
    key_text = f"{source.digest}|{heads}|{hidden}|{onnxruntime.__version__}|{_RECIPE}"
    memo_key = (key_text,)
    if memo_key in _MEMO and _MEMO[memo_key][0].path.is_file():
        return _MEMO[memo_key]
    key = hashlib.sha256(key_text.encode()).hexdigest()[:20]
    base = root or cache_dir()
    target = base / "onnx-fused" / f"{source.path.stem[:40]}-fused-{key}.onnx"
    if target.is_file() and target.stat().st_size > 0:
        touch(target)
    else:
        # The optimizer logs a line per pattern it misses; the record counts what it fused.
        logger = logging.getLogger("onnxruntime.transformers")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            # opt_level 0: only the optimizer's own fusions are written; the session applies
            # its hardware-specific ones when it loads the file (a file fit for any CPU).
            optimized = optimize_model(str(source.path), model_type="bert", num_heads=heads,
                                       hidden_size=hidden, opt_level=0, use_gpu=False)
        except Exception as exc:  # the optimizer raises whatever its graph walk hits
            raise RunError(f"ONNX Runtime's transformer optimizer failed on "
                           f"{source.path.name}: {first_line(exc)}; run without "
                           "transformer_fusion") from exc
        finally:
            logger.setLevel(level)
        with atomic_file(target) as tmp:
            optimized.save_model_to_file(str(tmp))
        bound_after_write(base, target)
    result = ExportedModel(target, file_digest(target), source.opset, exported=False)
    _MEMO[memo_key] = (result, fused_operators(target))
    return _MEMO[memo_key]
