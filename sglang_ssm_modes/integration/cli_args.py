"""The server flags of the SSM state modes, added to SGLang's own parser, and their resolution into
an :class:`~sglang_ssm_modes.config.SSMModeConfig` once SGLang has finished its own argument handling.

Flags: ``--ssm-state-mode {native,compact,replay}`` (env ``SGLANG_SSM_STATE_MODE``), ``--ssm-replay-history L``
(env ``SGLANG_SSM_REPLAY_HISTORY``), ``--ssm-compact-verify {exact,fast}`` (env ``SGLANG_SSM_COMPACT_VERIFY``);
newer SGLang's spellings ``--enable-linear-replayssm`` (= replay) and ``--linear-replayssm-cache-len L``
(= history) are accepted as aliases; ``--enable-linear-replayssm-spec``
is refused with a pointer to ``--ssm-state-mode``.
"""

from __future__ import annotations

import argparse
import os

from ..config import COMPACT_VERIFIES, MODES, REPLAY_HISTORIES, SSMModeConfig, SSMModeConfigError

ENV_MODE = "SGLANG_SSM_STATE_MODE"
ENV_HISTORY = "SGLANG_SSM_REPLAY_HISTORY"
ENV_COMPACT_VERIFY = "SGLANG_SSM_COMPACT_VERIFY"
DEFAULT_HISTORY = 16


class _RefuseReplaySpec(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--enable-linear-replayssm-spec is newer SGLang's separate speculative ReplaySSM switch; "
                     "here one flag covers decode and speculative verify: use --ssm-state-mode replay "
                     "(or --ssm-state-mode compact)")


def _env_history() -> int | None:
    raw = os.environ.get(ENV_HISTORY)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise SSMModeConfigError(f"{ENV_HISTORY}={raw!r} is not an integer: set it to one of {REPLAY_HISTORIES}")


def _env_compact_verify(mode: str) -> str | None:
    """The environment's compact verify: checked always, applied to compact servers only (one environment can
    serve every mode; the flag, by contrast, is refused outside compact)."""
    raw = os.environ.get(ENV_COMPACT_VERIFY)
    if raw is not None and raw not in COMPACT_VERIFIES:
        raise SSMModeConfigError(f"{ENV_COMPACT_VERIFY}={raw!r} is not a compact verify: set it to one of "
                                 + ", ".join(COMPACT_VERIFIES))
    return raw if mode == "compact" else None


def add_ssm_mode_args(parser: argparse.ArgumentParser) -> None:
    """Add the SSM state-mode flags to SGLang's server argument parser."""
    group = parser.add_argument_group("SSM state modes (sglang-ssm-modes)")
    group.add_argument("--ssm-state-mode", choices=MODES, default=None,
                       help="Storage mode of the linear-attention recurrent state: native (SGLang's), compact "
                            "(no per-draft-step state scratch; bit-identical commits) or replay (checkpoint + "
                            f"history ring; output-only decode and verify). Env {ENV_MODE}. Default: native.")
    group.add_argument("--ssm-replay-history", type=int, default=None, metavar="L",
                       help=f"Replay history L (records per request and layer before a fold), one of "
                            f"{REPLAY_HISTORIES}; only with --ssm-state-mode replay; for a chain verify at least "
                            f"--speculative-num-draft-tokens. Env {ENV_HISTORY} (replay servers only). "
                            f"Default: {DEFAULT_HISTORY}.")
    group.add_argument("--ssm-compact-verify", choices=COMPACT_VERIFIES, default=None,
                       help="Compact mode's verify tiling: exact (native's; outputs bit-identical to native) or "
                            "fast (16 value columns per program: a faster speculative round, outputs equal to "
                            "native's to float32 rounding, committed state still bit-identical). Only with "
                            f"--ssm-state-mode compact. Env {ENV_COMPACT_VERIFY} (compact servers only). "
                            "Default: exact.")
    group.add_argument("--enable-linear-replayssm", action="store_true",
                       help="Alias of --ssm-state-mode replay (newer SGLang's spelling).")
    group.add_argument("--linear-replayssm-cache-len", type=int, default=None, metavar="L",
                       help="Alias of --ssm-replay-history (newer SGLang's spelling).")
    group.add_argument("--enable-linear-replayssm-spec", nargs=0, action=_RefuseReplaySpec,
                       help="Not supported: use --ssm-state-mode replay or compact.")


def resolve_ssm_mode(args: argparse.Namespace, *, draft_tokens: int | None, state_dtype: str | None,
                     tree_verify: bool = False) -> SSMModeConfig:
    """The mode configuration from parsed flags, aliases and environment (flags first), validated against
    the server's final verify width ``draft_tokens`` (``--speculative-num-draft-tokens``, None without
    speculation), its shape (``tree_verify``) and state dtype. Raises :class:`SSMModeConfigError` naming the
    flag — or the environment variable a value came from — and the fix."""
    mode = getattr(args, "ssm_state_mode", None)
    if getattr(args, "enable_linear_replayssm", False):
        if mode not in (None, "replay"):
            raise SSMModeConfigError(f"--enable-linear-replayssm means --ssm-state-mode replay, but --ssm-state-mode "
                                     f"{mode} was given: pass only one of them")
        mode = "replay"
    if mode is None and os.environ.get(ENV_MODE):  # set and not empty
        mode = os.environ[ENV_MODE]
        if mode not in MODES:
            raise SSMModeConfigError(f"{ENV_MODE}={mode!r} is not a state mode: set it to one of " + ", ".join(MODES)
                                     + " (or pass --ssm-state-mode, which overrides it)")
    mode = mode or "native"
    history = getattr(args, "ssm_replay_history", None)
    alias = getattr(args, "linear_replayssm_cache_len", None)
    if history is not None and alias is not None and history != alias:
        raise SSMModeConfigError(f"--ssm-replay-history {history} and --linear-replayssm-cache-len {alias} disagree: "
                                 "pass only --ssm-replay-history")
    flag_history = history if history is not None else alias
    if mode != "replay" and flag_history is not None:
        name = "--ssm-replay-history" if history is not None else "--linear-replayssm-cache-len"
        raise SSMModeConfigError(f"{name} {flag_history} sets replay's history, and the state mode is {mode}: pass "
                                 f"--ssm-state-mode replay, or drop {name}")
    # the environment's history: checked and applied to replay servers only (one environment can serve every mode)
    env_history = _env_history() if mode == "replay" and flag_history is None else None
    history = flag_history if flag_history is not None else env_history
    compact_verify = getattr(args, "ssm_compact_verify", None) or _env_compact_verify(mode) or "exact"
    try:
        return SSMModeConfig(mode=mode, replay_history=DEFAULT_HISTORY if history is None else history,
                             draft_tokens=draft_tokens or 1, state_dtype=state_dtype or "float32",
                             compact_verify=compact_verify, tree_verify=tree_verify)
    except SSMModeConfigError as e:
        if env_history is not None and "--ssm-replay-history" in str(e):
            raise SSMModeConfigError(f"{e} (L = {history} came from {ENV_HISTORY}: set it there, or pass "
                                     "--ssm-replay-history, which overrides it)") from None
        raise
