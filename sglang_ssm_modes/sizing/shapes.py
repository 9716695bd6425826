"""Linear-attention shapes of the released hybrid models, their TP split, and ``config.json`` loading.

The built-in shapes are the *released* checkpoints (cited in ``source``), not the defaults of
SGLang's / transformers' config classes. Loading a user's ``config.json`` goes through SGLang's own
config classes and its own GDN / KDA decision; SGLang is imported lazily, only there.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

FAMILIES = ("gdn", "kda")


class ShapeError(ValueError):
    """A model shape that cannot be sized (bad config, non-hybrid model, TP that does not divide)."""


@dataclass(frozen=True)
class LinearAttnShape:
    """Per-layer linear-attention geometry of a hybrid model (whole model, before TP).

    ``family`` is ``"gdn"`` (Gated DeltaNet: scalar decay per value head, GQA key heads) or
    ``"kda"`` (Kimi Delta Attention: per-channel decay, as many key heads as value heads).
    ``num_v_heads`` HV, ``num_k_heads`` HK, ``head_k_dim`` K, ``head_v_dim`` V; the state of one
    value head is ``[V, K]``. ``linear_layer_ids`` (0-based) is given when known.
    """

    family: str
    num_linear_layers: int
    num_v_heads: int
    num_k_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    hidden_size: int
    source: str
    name: str = ""
    linear_layer_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ShapeError(f"family {self.family!r} is not one of {FAMILIES}")
        for attr in ("num_linear_layers", "num_v_heads", "num_k_heads", "head_k_dim",
                     "head_v_dim", "conv_kernel", "hidden_size"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ShapeError(f"{self.label}: {attr} must be a positive integer, got {value!r}")
        if self.conv_kernel < 2:
            raise ShapeError(f"{self.label}: conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.num_v_heads % self.num_k_heads:
            raise ShapeError(
                f"{self.label}: {self.num_v_heads} value heads are not a multiple of "
                f"{self.num_k_heads} key heads"
            )
        if self.family == "kda" and self.num_k_heads != self.num_v_heads:
            raise ShapeError(f"{self.label}: KDA has as many key heads as value heads")
        ids = tuple(self.linear_layer_ids)
        object.__setattr__(self, "linear_layer_ids", ids)
        if ids and len(ids) != self.num_linear_layers:
            raise ShapeError(
                f"{self.label}: {len(ids)} linear layer ids for {self.num_linear_layers} layers"
            )

    @property
    def label(self) -> str:
        """The name, or the family if unnamed."""
        return self.name or self.family

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv (q, k, v): 2·HK·K + HV·V."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def gate_width(self) -> int:
        """fp32 decay values per value head and token: 1 (GDN scalar) or K (KDA per channel)."""
        return 1 if self.family == "gdn" else self.head_k_dim


@dataclass(frozen=True)
class LocalShape:
    """What one TP rank holds per linear layer: heads, key heads and conv channels."""

    num_v_heads: int
    num_k_heads: int
    conv_dim: int


def _extra_groups_for_head_shards(ngroups: int, tp: int) -> int:
    # Mirrors sglang.srt.configs.mamba_utils.extra_groups_for_head_shards.
    if ngroups % tp == 0:
        return 0
    return tp - ngroups


def local_shape(shape: LinearAttnShape, tp: int = 1) -> LocalShape:
    """Split ``shape`` over ``tp`` ranks the way SGLang 0.5.14 does.

    GDN mirrors ``Mamba2StateShape.create``: key-head groups that do not divide by ``tp`` are
    replicated up to ``tp`` (``extra_groups_for_head_shards``), then value heads, key heads and the
    conv channels ``HV·V + 2·groups·K`` are divided by ``tp``. KDA mirrors
    ``KimiLinearStateShape.create``: ``HV·V`` and ``HK·K`` are divided by ``tp``. SGLang's
    ``divide`` asserts exact division; here that is a ``ShapeError`` naming ``--tp``.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ShapeError(f"--tp {tp!r} must be an integer >= 1")
    hv, hk = shape.num_v_heads, shape.num_k_heads
    if hv % tp:
        raise ShapeError(
            f"--tp {tp} does not divide the {hv} linear-attention value heads of {shape.label}: "
            f"SGLang splits heads evenly across TP ranks; use a --tp that divides {hv}"
        )
    if shape.family == "gdn":
        groups = hk + _extra_groups_for_head_shards(hk, tp)
        if groups % tp:
            raise ShapeError(
                f"--tp {tp} does not divide the {hk} key heads of {shape.label} (SGLang can only "
                f"replicate key-head groups up to tp when tp > groups); use a --tp that divides {hk}"
            )
        conv_dim = hv * shape.head_v_dim + 2 * groups * shape.head_k_dim
        return LocalShape(num_v_heads=hv // tp, num_k_heads=groups // tp, conv_dim=conv_dim // tp)
    if hk % tp:
        raise ShapeError(
            f"--tp {tp} does not divide the {hk} KDA key heads of {shape.label}; use a --tp that "
            f"divides {hk}"
        )
    return LocalShape(num_v_heads=hv // tp, num_k_heads=hk // tp, conv_dim=shape.conv_dim // tp)


def _interval_layers(num_layers: int, interval: int) -> tuple[int, ...]:
    # Qwen3NextConfig.layers_block_type: layer l is full attention iff (l + 1) % interval == 0.
    return tuple(i for i in range(num_layers) if (i + 1) % interval != 0)


_KIMI_48B_KDA_LAYERS_1BASED = (1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26)

BUILTIN_SHAPES: dict[str, LinearAttnShape] = {
    "qwen3-next-80b": LinearAttnShape(
        name="qwen3-next-80b",
        family="gdn",
        num_linear_layers=36,
        linear_layer_ids=_interval_layers(48, 4),
        num_v_heads=32,
        num_k_heads=16,
        head_k_dim=128,
        head_v_dim=128,
        conv_kernel=4,
        hidden_size=2048,
        source=(
            "Qwen3-Next-80B-A3B, HF Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, "
            "full_attention_interval 4 (36 GDN layers), linear_num_value_heads 32, "
            "linear_num_key_heads 16, linear_key/value_head_dim 128, linear_conv_kernel_dim 4, "
            "hidden_size 2048 (SGLang's Qwen3NextConfig() defaults match it)"
        ),
    ),
    "kimi-linear-48b": LinearAttnShape(
        name="kimi-linear-48b",
        family="kda",
        num_linear_layers=len(_KIMI_48B_KDA_LAYERS_1BASED),
        linear_layer_ids=tuple(i - 1 for i in _KIMI_48B_KDA_LAYERS_1BASED),
        num_v_heads=32,
        num_k_heads=32,
        head_k_dim=128,
        head_v_dim=128,
        conv_kernel=4,
        hidden_size=2304,
        source=(
            "Kimi-Linear-48B-A3B, HF moonshotai/Kimi-Linear-48B-A3B-Instruct config.json: "
            "27 layers, hidden_size 2304, linear_attn_config kda_layers "
            "[1-3, 5-7, 9-11, 13-15, 17-19, 21-23, 25, 26] (20 KDA layers, 1-based), "
            "full_attn_layers [4, 8, 12, 16, 20, 24, 27], num_heads 32, head_dim 128, "
            "short_conv_kernel_size 4 (verbatim copy: Firworks/Kimi-Linear-48B-A3B-Instruct-nvfp4 "
            "config.json; not KimiLinearConfig() defaults)"
        ),
    ),
    "qwen3.5-35b-a3b": LinearAttnShape(
        name="qwen3.5-35b-a3b",
        family="gdn",
        num_linear_layers=30,
        linear_layer_ids=_interval_layers(40, 4),
        num_v_heads=32,
        num_k_heads=16,
        head_k_dim=128,
        head_v_dim=128,
        conv_kernel=4,
        hidden_size=2048,
        source=(
            "Qwen3.5-35B-A3B, HF Qwen/Qwen3.5-35B-A3B config.json text_config "
            "(qwen3_5_moe_text): 40 layers, full_attention_interval 4 (30 GDN layers), "
            "linear_num_value_heads 32, linear_num_key_heads 16, linear_key/value_head_dim 128, "
            "linear_conv_kernel_dim 4, hidden_size 2048 (from public copies of that config; "
            "Qwen's card: 10 x (3 Gated DeltaNet + 1 Gated Attention), 32 V / 16 QK heads of 128)"
        ),
    ),
    "qwen3.5-397b-a17b": LinearAttnShape(
        name="qwen3.5-397b-a17b",
        family="gdn",
        num_linear_layers=45,
        linear_layer_ids=_interval_layers(60, 4),
        num_v_heads=64,
        num_k_heads=16,
        head_k_dim=128,
        head_v_dim=128,
        conv_kernel=4,
        hidden_size=4096,
        source=(
            "Qwen3.5-397B-A17B, HF Qwen/Qwen3.5-397B-A17B config.json text_config "
            "(qwen3_5_moe_text): 60 layers, full_attention_interval 4 (45 GDN layers), "
            "linear_num_value_heads 64, linear_num_key_heads 16, linear_key/value_head_dim 128, "
            "linear_conv_kernel_dim 4, hidden_size 4096 (from public copies of that config; "
            "mlx-community/Qwen3.5-397B-A17B-4bit card: 15 x (3 GDN + 1 full), 16 QK / 64 V heads)"
        ),
    ),
}
"""Released models, by the name the CLI's ``--model`` takes."""


@dataclass(frozen=True)
class ResolvedModel:
    """A shape plus the dtypes SGLang would pick for it when no flag overrides them.

    ``state_dtype`` / ``conv_dtype`` are names (``"float32"``). For a ``config.json`` they come from
    SGLang's own ``mamba2_cache_params.dtype`` (config ``mamba_ssm_dtype`` and the
    ``SGLANG_MAMBA_SSM_DTYPE`` / ``SGLANG_MAMBA_CONV_DTYPE`` environment variables); for built-ins
    they are SGLang's defaults, float32 and bfloat16.
    """

    shape: LinearAttnShape
    state_dtype: str = "float32"
    conv_dtype: str = "bfloat16"


def resolve_model(model: str) -> ResolvedModel:
    """A built-in name (``BUILTIN_SHAPES``) or a path to a ``config.json`` (or its directory)."""
    if model in BUILTIN_SHAPES:
        return ResolvedModel(BUILTIN_SHAPES[model])
    path = Path(model)
    if path.is_dir() or path.suffix == ".json" or path.exists():
        return load_config_json(path)
    raise ShapeError(
        f"--model {model!r} is neither a built-in model ({', '.join(BUILTIN_SHAPES)}) nor an "
        "existing config.json or model directory"
    )


def _hf_config_from_file(config_file: Path):
    """Build the HF config through SGLang's loader, so SGLang's own config classes are used."""
    import shutil
    import tempfile

    from sglang.srt.utils.hf_transformers.config import get_config

    if config_file.name == "config.json":
        return get_config(str(config_file.parent), trust_remote_code=False)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(config_file, Path(tmp) / "config.json")
        return get_config(tmp, trust_remote_code=False)


def _sglang_family(hf_config) -> tuple[str, object] | None:
    """SGLang's own GDN / KDA decision for ``hf_config``: (family, linear-attention config).

    Uses ``ModelRunner.hybrid_gdn_config`` / ``ModelRunner.kimi_linear_config`` (the isinstance
    checks SGLang 0.5.14 runs on the config classes it ships), then the external-model registry
    ``sglang.srt.configs.linear_attn_model_registry.get_linear_attn_config`` (a spec whose backend
    class is a GDN or KDA backend). No list of model names is kept here.
    """
    from types import SimpleNamespace

    from sglang.srt.configs.linear_attn_model_registry import get_linear_attn_config
    from sglang.srt.model_executor.model_runner import ModelRunner

    runner = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config), is_draft_worker=False)
    gdn = ModelRunner.hybrid_gdn_config.fget(runner)
    if gdn is not None:
        return "gdn", gdn
    kda = ModelRunner.kimi_linear_config.fget(runner)
    if kda is not None:
        return "kda", kda
    found = get_linear_attn_config(hf_config)
    if found is not None:
        spec, cfg = found
        backend = spec.backend_class_name.rsplit(".", 1)[-1]
        if backend.endswith("GDNAttnBackend"):
            return "gdn", cfg
        if backend.endswith("KDAAttnBackend"):
            return "kda", cfg
    return None


def load_config_json(path: str | Path) -> ResolvedModel:
    """Shape of the model described by ``path`` (a ``config.json`` or a directory holding one).

    The config is built with SGLang's loader (SGLang's config class for its ``model_type``), the
    family comes from SGLang's own decision (``_sglang_family``) and the per-layer shape and layer
    list from the config's own ``mamba2_cache_params`` evaluated at TP 1 — the same object SGLang
    sizes its ``MambaPool`` from. A model without GDN / KDA layers is a ``ShapeError``.
    """
    from unittest import mock

    from sglang.srt.configs.mamba_utils import KimiLinearStateShape, Mamba2StateShape

    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ShapeError(f"--model {str(path)!r}: no such config file {str(config_file)!r}")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ShapeError(f"{config_file}: cannot read it as JSON ({exc})") from exc
    with warnings.catch_warnings():  # SGLang warns about CUDA-only kernels on import
        warnings.simplefilter("ignore")
        try:
            hf_config = _hf_config_from_file(config_file)
        except Exception as exc:  # SGLang / transformers raise many kinds for bad configs
            raise ShapeError(f"{config_file}: SGLang cannot load this config ({exc})") from exc
        decided = _sglang_family(hf_config)
    model_type = raw.get("model_type", "?")
    if decided is None:
        raise ShapeError(
            f"{config_file}: model_type {model_type!r} ({type(hf_config).__name__}) has no GDN or "
            "KDA linear-attention layers: SGLang 0.5.14 treats it neither as a hybrid GDN model nor "
            "as Kimi-Linear (KDA), and no registered linear-attention spec matches it; "
            "sglang-ssm-modes only applies to GDN / KDA hybrid models"
        )
    family, cfg = decided
    try:
        with mock.patch("sglang.srt.layers.dp_attention.get_attention_tp_size", return_value=1):
            params = cfg.mamba2_cache_params
    except Exception as exc:
        raise ShapeError(f"{config_file}: cannot read its linear-attention shape ({exc})") from exc
    layers = tuple(int(i) for i in params.layers)
    if not layers:
        raise ShapeError(
            f"{config_file}: model_type {model_type!r} lists no GDN / KDA layers "
            "(its linear-attention layer list is empty)"
        )
    s = params.shape
    if isinstance(s, Mamba2StateShape):
        hv, v, k = s.num_heads, s.head_dim, s.state_size
        hk = (s.conv_dim - s.intermediate_size) // (2 * k)
        conv_kernel = s.conv_kernel
    elif isinstance(s, KimiLinearStateShape):
        hv, v, hk, k = s.num_heads, s.head_dim, s.num_k_heads, s.head_k_dim
        conv_kernel = s.conv_kernel
    else:
        raise ShapeError(f"{config_file}: unknown SGLang state shape {type(s).__name__}")
    hidden_size = getattr(cfg, "hidden_size", None)
    if not hidden_size:
        raise ShapeError(f"{config_file}: the linear-attention config has no hidden_size")
    shape = LinearAttnShape(
        name=str(config_file),
        family=family,
        num_linear_layers=len(layers),
        linear_layer_ids=layers,
        num_v_heads=int(hv),
        num_k_heads=int(hk),
        head_k_dim=int(k),
        head_v_dim=int(v),
        conv_kernel=int(conv_kernel),
        hidden_size=int(hidden_size),
        source=(
            f"{config_file} (model_type {model_type!r}, SGLang {type(cfg).__name__}."
            "mamba2_cache_params at TP 1)"
        ),
    )
    dt = params.dtype
    return ResolvedModel(
        shape=shape,
        state_dtype=str(dt.temporal).removeprefix("torch."),
        conv_dtype=str(dt.conv).removeprefix("torch."),
    )
