"""Memory model of the three state modes: shapes of the released models, bytes per value head,
layer and request, and the request capacity SGLang derives from them. Does not import SGLang
(except lazily, to load a user's ``config.json``)."""

from .bytes import (
    SLOT_WORDS_BYTES,
    ModeBytes,
    layer_bytes,
    lightllm_native_value_head_bytes,
    record_bytes,
    request_bytes,
    value_head_bytes,
)
from .capacity import PoolFit, fit_pool, mamba_ratio, sglang_native_charge
from .shapes import (
    BUILTIN_SHAPES,
    LinearAttnShape,
    LocalShape,
    ResolvedModel,
    ShapeError,
    load_config_json,
    local_shape,
    resolve_model,
)

__all__ = [
    "BUILTIN_SHAPES",
    "SLOT_WORDS_BYTES",
    "LinearAttnShape",
    "LocalShape",
    "ModeBytes",
    "PoolFit",
    "ResolvedModel",
    "ShapeError",
    "fit_pool",
    "layer_bytes",
    "lightllm_native_value_head_bytes",
    "load_config_json",
    "local_shape",
    "mamba_ratio",
    "record_bytes",
    "request_bytes",
    "resolve_model",
    "sglang_native_charge",
    "value_head_bytes",
]
