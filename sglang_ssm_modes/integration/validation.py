"""Startup validation of the state mode against the model and the rest of the server arguments, before
any weights load. The model family comes from SGLang 0.5.14's own detection (``ModelRunner``'s
``hybrid_gdn_config`` / ``kimi_linear_config`` properties on the model's config class), never from a
list of names kept here. Every refusal is one :class:`SSMModeConfigError` naming the flag and the fix.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch  # noqa: F401  (annotations)

from ..config import FLAG_MODE, SSMModeConfig, SSMModeConfigError


def linear_family(server_args) -> tuple[str | None, str, "torch.dtype"]:
    """``(family, config class name, activation dtype)``: ``"gdn"``, ``"kda"`` or None (not a GDN / KDA
    hybrid), read from the model's config through SGLang's own ``ModelConfig`` and ``ModelRunner``
    properties; the dtype is the one SGLang will run the model in (``--dtype``, else the config's)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner

    model_config = ModelConfig.from_server_args(server_args)
    runner = SimpleNamespace(model_config=model_config)
    name = type(model_config.hf_config).__name__
    dtype = model_config.dtype
    if ModelRunner.hybrid_gdn_config.fget(runner) is not None:
        return "gdn", name, dtype
    if ModelRunner.kimi_linear_config.fget(runner) is not None:
        return "kda", name, dtype
    return None, name, dtype


def validate_mode(cfg: SSMModeConfig, server_args, family: str | None, config_name: str) -> None:
    """Refuse, with the flag and the fix, what the mode cannot serve with these arguments."""
    if cfg.mode == "native":
        return
    flag = f"{FLAG_MODE} {cfg.mode}"
    if family is None:
        raise SSMModeConfigError(
            f"{flag} stores the recurrent state of Gated DeltaNet / Kimi Delta Attention layers, and this model "
            f"({config_name}) has none: drop {FLAG_MODE} (or pass {FLAG_MODE} native)")
    if getattr(server_args, "speculative_adaptive", False):
        raise SSMModeConfigError(
            f"--speculative-adaptive changes the verify width (--speculative-num-draft-tokens) from one round to "
            f"the next, and {flag} serves the one width its records and history were built for: drop "
            f"--speculative-adaptive, or pass {FLAG_MODE} native")
