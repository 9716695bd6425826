"""SGLang plugin entry point (group ``sglang.srt.plugins``): SGLang 0.5.14 runs ``register`` in every
process it starts (``launch_server``, ``sglang serve``, engine, scheduler) before it parses arguments,
then applies the registered hooks.

Hooks:

* ``ServerArgs.add_cli_args`` / ``ServerArgs.__post_init__`` / ``ServerArgs.from_cli_args``: the flags
  (and the environment, also for ``sglang.Engine``), resolved and validated once SGLang's own argument
  handling is done — before any weights load; the result is attached to the
  ``ServerArgs`` as ``ssm_mode_config`` (a dict of plain values: it travels with them to every scheduler
  process, and SGLang can serialise them);
* ``HybridReqToTokenPool._init_mamba_pool`` and ``ModelRunnerKVCacheMixin.handle_max_mamba_cache``: the
  mode's pool and its sizing; ``MambaCheckpointPool.store_from_active`` / ``load_to_active``: int8
  radix-cache checkpoints of the canonical state; ``ScheduleBatch.prepare_for_prebuilt`` (PD decode): the
  slots a transfer has just filled start with an empty history; ``MambaComponent.build_hicache_transfers``
  / ``commit_hicache_transfer`` (HiCache, which ``UnifiedRadixCache`` serves for these models): a tree slot
  holds the canonical state when its backup to the host starts, and a slot the host restored starts with an
  empty history (:mod:`.pool_hooks`);
* ``GDNAttnBackend`` / ``KDAAttnBackend`` ``forward_decode`` / ``forward_extend`` and
  ``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify``: the mode's kernels and commit
  (:mod:`.backend_hooks`);
* ``SchedulerMetricsReporter.report_decode_stats``: every decode log interval, the pool's fault reports
  and, with ``--enable-metrics``, its Prometheus counters (:mod:`.metrics`).

SGLang logs and skips a hook it fails to apply; the pool hook checks that every hook of this plugin
was applied and refuses to start otherwise, so a mode is never silently served by the native path.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import logging

from . import backend_hooks, hook_targets as targets, metrics, pool_hooks
from .cli_args import add_ssm_mode_args, resolve_ssm_mode
from .validation import linear_family, validate_mode

logger = logging.getLogger(__name__)

HOOKS = {  # target -> AROUND hook
    targets.POOL: pool_hooks.init_mamba_pool,
    targets.SIZING: pool_hooks.handle_max_mamba_cache,
    targets.GDN_DECODE: backend_hooks.forward_decode,
    targets.GDN_EXTEND: backend_hooks.forward_extend,
    targets.KDA_DECODE: backend_hooks.forward_decode,
    targets.KDA_EXTEND: backend_hooks.forward_extend,
    targets.COMMIT: backend_hooks.update_mamba_state_after_mtp_verify,
    targets.INT8_STORE: pool_hooks.int8_store_from_active,
    targets.INT8_LOAD: pool_hooks.int8_load_to_active,
    targets.PD_PREBUILT: pool_hooks.pd_prepare_for_prebuilt,
    targets.HICACHE_BUILD: pool_hooks.hicache_build_transfers,
    targets.HICACHE_COMMIT: pool_hooks.hicache_commit_transfer,
    targets.DECODE_STATS: metrics.report_decode_stats,
}
"""Every AROUND hook of the plugin, by SGLang target."""


def _after_add_cli_args(result, parser, *args, **kwargs):
    add_ssm_mode_args(parser)
    return result


_PARSING_FLAGS = contextvars.ContextVar("sglang_ssm_modes_parsing_flags", default=False)
"""Set while ``ServerArgs.from_cli_args`` builds its ``ServerArgs``: the mode then waits for the flags (an
environment value the flags override must not be validated, nor refused, on its own)."""


def _configure(server_args, args: argparse.Namespace) -> None:
    """Resolve (flags over environment), validate and attach the mode to ``server_args``."""
    speculating = bool(server_args.speculative_algorithm)
    draft = server_args.speculative_num_draft_tokens if speculating else None
    tree = speculating and (server_args.speculative_eagle_topk or 1) > 1
    cfg = resolve_ssm_mode(args, draft_tokens=draft, state_dtype=getattr(server_args, "mamba_ssm_dtype", None),
                           tree_verify=tree)
    if cfg.mode != "native":
        model = linear_family(server_args)
        validate_mode(cfg, server_args, model.family, model.config_name)
        # records hold raw k / v as the model computes them: in the dtype SGLang runs the model in; the state
        # dtype is the one SGLang's pool will allocate (--mamba-ssm-dtype, else the model's config)
        cfg = dataclasses.replace(cfg, activation_dtype=model.activation_dtype, state_dtype=model.state_dtype)
    server_args.ssm_mode_config = cfg.to_dict()  # plain values: SGLang serialises its server args
    logger.info("sglang-ssm-modes: %s", cfg)


def _after_post_init(result, server_args, *args, **kwargs):
    """Every ``ServerArgs`` (also ``sglang.Engine(**kwargs)``, which never parses flags): the mode
    from the environment — unless ``from_cli_args`` is building it, which resolves the flags over it."""
    if not _PARSING_FLAGS.get():
        _configure(server_args, argparse.Namespace())
    return result


def _around_from_cli_args(original, cls, args, *rest, **kwargs):
    token = _PARSING_FLAGS.set(True)
    try:
        server_args = original(cls, args, *rest, **kwargs)
    finally:
        _PARSING_FLAGS.reset(token)
    _configure(server_args, args)
    return server_args


def register() -> None:
    """Register the hooks with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.__post_init__", _after_post_init, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", _around_from_cli_args, HookType.AROUND)
    for target, hook in HOOKS.items():
        HookRegistry.register(target, hook, HookType.AROUND)
