"""Startup validation of the state mode against the model and the rest of the server arguments, before
any weights load. The model family comes from SGLang 0.5.14's own detection (``ModelRunner``'s
``hybrid_gdn_config`` / ``kimi_linear_config`` properties on the model's config class), never from a
list of names kept here. Every refusal is one :class:`SSMModeConfigError` naming the flag and the fix.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch

from ..config import FLAG_DRAFT, FLAG_MODE, SSMModeConfig, SSMModeConfigError

OWN_KERNEL_CONFIGS = ("JetNemotronConfig", "JetVLMConfig")
"""Config classes SGLang 0.5.14 counts as Gated DeltaNet hybrids (``ModelRunner.hybrid_gdn_config``) whose
linear layers never call the GDN backend the modes hook: ``models/jet_nemotron.py``'s ``JetBlock`` runs its
own recurrent kernel on the pool's state and conv tensors, so a mode's checkpoint and history would be
bypassed (replay: a wrong state)."""
HICACHE_MAMBA_LAYOUT = "page_first_direct"
"""The one ``--hicache-mem-layout`` SGLang 0.5.14's host mamba pool takes (``MambaPoolHost``)."""


class LinearModel(NamedTuple):
    """What the modes need to know of the model, from SGLang's own reading of its config."""

    family: str | None  # "gdn", "kda" or None (not a GDN / KDA hybrid)
    config_name: str
    activation_dtype: torch.dtype  # what SGLang runs the model in (--dtype, else the config's)
    state_dtype: torch.dtype  # what SGLang's mamba pool stores (--mamba-ssm-dtype, else the config's)


def linear_family(server_args) -> LinearModel:
    """The model's :class:`LinearModel`, read through SGLang's own ``ModelConfig``, ``ModelRunner``
    properties and ``mamba2_state_dtype``."""
    from sglang.srt.configs.mamba_utils import mamba2_state_dtype
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner

    model_config = ModelConfig.from_server_args(server_args)
    runner = SimpleNamespace(model_config=model_config)
    name = type(model_config.hf_config).__name__
    family = ("gdn" if ModelRunner.hybrid_gdn_config.fget(runner) is not None
              else "kda" if ModelRunner.kimi_linear_config.fget(runner) is not None else None)
    return LinearModel(family, name, model_config.dtype, mamba2_state_dtype(model_config.hf_config).temporal)


def validate_mode(cfg: SSMModeConfig, server_args, family: str | None, config_name: str) -> None:
    """Refuse, with the flag and the fix, what the mode cannot serve with these arguments."""
    if cfg.mode == "native":
        return
    flag = f"{FLAG_MODE} {cfg.mode}"
    if family is None:
        raise SSMModeConfigError(
            f"{flag} stores the recurrent state of Gated DeltaNet / Kimi Delta Attention layers, and this model "
            f"({config_name}) has none: drop {FLAG_MODE} (or pass {FLAG_MODE} native)")
    if config_name in OWN_KERNEL_CONFIGS:
        raise SSMModeConfigError(
            f"{flag}: this model's ({config_name}) linear layers run their own recurrent kernel on the state in "
            f"SGLang 0.5.14, not the Gated DeltaNet backend the modes serve through, so the mode would be bypassed: "
            f"drop {FLAG_MODE} (or pass {FLAG_MODE} native)")
    if getattr(server_args, "speculative_adaptive", False):
        raise SSMModeConfigError(
            f"--speculative-adaptive changes the verify width (--speculative-num-draft-tokens) from one round to "
            f"the next, and {flag} serves the one width its records and history were built for: drop "
            f"--speculative-adaptive, or pass {FLAG_MODE} native")
    if getattr(server_args, "use_ray", False):
        raise SSMModeConfigError(
            f"--use-ray: SGLang 0.5.14's Ray actors rebuild the server arguments (dataclasses.replace), which drops "
            f"{flag}, so the scheduler would serve the native path: drop --use-ray, or pass {FLAG_MODE} native")
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm and cfg.draft_tokens < 2:
        fix = ("pass --speculative-num-steps 1 or more (with --speculative-eagle-topk 1 SGLang sets "
               f"{FLAG_DRAFT} to steps + 1)" if (getattr(server_args, "speculative_eagle_topk", None) or 1) == 1
               else f"pass {FLAG_DRAFT} 2 or more")
        raise SSMModeConfigError(
            f"speculative decoding ({algorithm}, as SGLang resolved --speculative-algorithm) with a verify width of "
            f"{cfg.draft_tokens} ({FLAG_DRAFT}, the base token included) verifies no draft token: {fix}, or drop "
            "--speculative-algorithm")
    layout = getattr(server_args, "hicache_mem_layout", HICACHE_MAMBA_LAYOUT)
    if getattr(server_args, "enable_hierarchical_cache", False) and layout != HICACHE_MAMBA_LAYOUT:
        raise SSMModeConfigError(
            f"--enable-hierarchical-cache with --hicache-mem-layout {layout}: SGLang 0.5.14's host pool for the "
            f"linear-attention state takes only {HICACHE_MAMBA_LAYOUT} (it would fail once the cache is built): "
            f"pass --hicache-mem-layout {HICACHE_MAMBA_LAYOUT}")
