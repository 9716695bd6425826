"""SGLang plugin entry point (group ``sglang.srt.plugins``): SGLang 0.5.14 runs ``register`` in every
process it starts (``launch_server``, ``sglang serve``, engine, scheduler) before it parses arguments.

Registered now: the server flags (``ServerArgs.add_cli_args``) and their validation once SGLang's own
argument handling is done (``ServerArgs.from_cli_args``), so a bad combination fails at startup, before
any weights load. The mode's configuration is attached to the ``ServerArgs`` as ``ssm_mode_config``.
Modes whose server hooks are not wired yet are refused there with a message saying so — never
silently served by the native path.
"""

from __future__ import annotations

import logging

from ..config import SSMModeConfigError
from .cli_args import add_ssm_mode_args, resolve_ssm_mode

logger = logging.getLogger(__name__)

SERVED_MODES = ("native",)
"""Modes the server hooks serve in this release; the others are validated, then refused at startup."""


def _after_add_cli_args(result, parser, *args, **kwargs):
    add_ssm_mode_args(parser)
    return result


def _after_from_cli_args(server_args, cls, args, *rest, **kwargs):
    draft = server_args.speculative_num_draft_tokens if server_args.speculative_algorithm else None
    cfg = resolve_ssm_mode(args, draft_tokens=draft, state_dtype=getattr(server_args, "mamba_ssm_dtype", None))
    if cfg.mode not in SERVED_MODES:
        raise SSMModeConfigError(
            f"--ssm-state-mode {cfg.mode} (history {cfg.replay_history}, draft tokens {cfg.draft_tokens}) is valid, "
            "but this release does not serve it yet: its kernels, pool and acceptance are built and tested, the "
            "server hooks are not wired. Start with --ssm-state-mode native (the default).")
    server_args.ssm_mode_config = cfg
    logger.info("sglang-ssm-modes: %s", cfg)
    return server_args


def register() -> None:
    """Register the hooks with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", _after_from_cli_args, HookType.AFTER)
