"""The state-storage mode chosen at server start, and its validation.

``SSMModeConfig`` is the one place the mode's parameters are checked. Every rule fails with an
``SSMModeConfigError`` that names the command-line flag to change and how (DESIGN §5: validate
every flag combination at startup with one clear message). This module does not import SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("native", "compact", "replay")
"""The three storage modes for the recurrent state (DESIGN §2)."""

REPLAY_HISTORIES = (8, 16, 32, 64)
"""History lengths L the replay kernels are built for (the ring holds 2·L records)."""

COMPACT_VERIFIES = ("exact", "fast")
"""Compact verify tilings: ``exact`` (native's: outputs bit-identical to native) or ``fast`` (outputs to float32
rounding, committed state still bit-identical; ``ops.compact.FAST_VERIFY_TILE``)."""

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Allowed state / activation dtypes by name (the choices of SGLang's ``--mamba-ssm-dtype``)."""

FLAG_MODE = "--ssm-state-mode"
FLAG_HISTORY = "--ssm-replay-history"
FLAG_COMPACT_VERIFY = "--ssm-compact-verify"
FLAG_DRAFT = "--speculative-num-draft-tokens"
FLAG_STATE_DTYPE = "--mamba-ssm-dtype"
FLAG_ACTIVATION_DTYPE = "--dtype"


class SSMModeConfigError(ValueError):
    """An invalid mode configuration; the message names the flag and the fix."""


def dtype_name(dtype: torch.dtype) -> str:
    """The name of an allowed dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise KeyError(dtype)


def _as_dtype(value, flag: str, what: str) -> torch.dtype:
    if isinstance(value, str):
        key = value.removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
    elif isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    choices = ", ".join(DTYPES)
    raise SSMModeConfigError(
        f"{flag} {value!r} is not a supported {what} dtype; pass {flag} with one of: {choices}"
    )


@dataclass(frozen=True)
class SSMModeConfig:
    """How the recurrent state of the linear-attention layers is stored (immutable).

    * ``mode``: ``"native"`` (SGLang as is), ``"compact"`` (state + D raw-input records) or
      ``"replay"`` (checkpoint + a ring of 2·L records + cursor).
    * ``replay_history``: L, the history a replay window may hold before it is folded; one of
      ``REPLAY_HISTORIES``. Only used by ``replay``; it must be at least ``draft_tokens`` for a chain verify
      (a tree verify folds the history and runs on compact's records: any L).
    * ``draft_tokens``: D = ``--speculative-num-draft-tokens``, the verify width with the base
      token included; 1 means no speculative decoding.
    * ``state_dtype``: dtype of the stored state S (``--mamba-ssm-dtype``).
    * ``activation_dtype``: dtype of the raw k / v recorded by compact and replay (the model dtype).
    * ``compact_verify``: compact's verify tiling, one of ``COMPACT_VERIFIES``; ``"fast"`` only with
      ``compact``.
    * ``tree_verify``: the verify is a tree (EAGLE top-k > 1, NGRAM breadth > 1), not a chain.

    Dtypes may be given as ``torch.dtype`` or by name (``"bfloat16"``); they are stored as
    ``torch.dtype``.
    """

    mode: str = "native"
    replay_history: int = 16
    draft_tokens: int = 1
    state_dtype: torch.dtype = torch.float32
    activation_dtype: torch.dtype = torch.bfloat16
    compact_verify: str = "exact"
    tree_verify: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SSMModeConfigError(
                f"{FLAG_MODE} {self.mode!r} is not a state mode; pass {FLAG_MODE} with one of: "
                + ", ".join(MODES)
            )
        d = self.draft_tokens
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise SSMModeConfigError(
                f"{FLAG_DRAFT} {d!r} is not a verify width: pass {FLAG_DRAFT} as an integer >= 1 "
                "(the base token included; 1 = no speculative decoding)"
            )
        length = self.replay_history
        if isinstance(length, bool) or not isinstance(length, int) or length not in REPLAY_HISTORIES:
            raise SSMModeConfigError(
                f"{FLAG_HISTORY} {length!r} is not a supported history length; pass "
                f"{FLAG_HISTORY} with one of: " + ", ".join(str(x) for x in REPLAY_HISTORIES)
            )
        if self.mode == "replay" and length < d and not self.tree_verify:
            fits = [x for x in REPLAY_HISTORIES if x >= d]
            fix = (
                f"pass {FLAG_HISTORY} {fits[0]} or larger"
                if fits
                else f"reduce {FLAG_DRAFT} to {REPLAY_HISTORIES[-1]} or less (EAGLE / NEXTN chains: "
                f"--speculative-num-steps to {REPLAY_HISTORIES[-1] - 1} or less, D being steps + 1)"
            )
            raise SSMModeConfigError(
                f"{FLAG_HISTORY} {length} is smaller than {FLAG_DRAFT} {d}: replay needs L >= D; "
                + fix
            )
        if self.compact_verify not in COMPACT_VERIFIES:
            raise SSMModeConfigError(
                f"{FLAG_COMPACT_VERIFY} {self.compact_verify!r} is not a compact verify; pass "
                f"{FLAG_COMPACT_VERIFY} with one of: " + ", ".join(COMPACT_VERIFIES)
            )
        if self.compact_verify != "exact" and self.mode != "compact":
            raise SSMModeConfigError(
                f"{FLAG_COMPACT_VERIFY} {self.compact_verify} applies to {FLAG_MODE} compact only, not "
                f"{self.mode}: pass {FLAG_MODE} compact or drop {FLAG_COMPACT_VERIFY}"
            )
        object.__setattr__(self, "state_dtype", _as_dtype(self.state_dtype, FLAG_STATE_DTYPE, "state"))
        object.__setattr__(
            self,
            "activation_dtype",
            _as_dtype(self.activation_dtype, FLAG_ACTIVATION_DTYPE, "activation"),
        )

    def to_dict(self) -> dict:
        """Plain values only (dtypes by name): what travels on SGLang's ``ServerArgs`` and shows in
        its ``/server_info``; ``SSMModeConfig(**d)`` restores the configuration."""
        return {"mode": self.mode, "replay_history": self.replay_history, "draft_tokens": self.draft_tokens,
                "state_dtype": dtype_name(self.state_dtype), "activation_dtype": dtype_name(self.activation_dtype),
                "compact_verify": self.compact_verify, "tree_verify": self.tree_verify}

    @property
    def ring_records(self) -> int:
        """Records kept per request, layer and head: 2·L for replay, D for compact, 0 for native."""
        if self.mode == "replay":
            return 2 * self.replay_history
        if self.mode == "compact":
            return self.draft_tokens
        return 0

    @property
    def speculative(self) -> bool:
        """Whether speculative decoding is on (D > 1)."""
        return self.draft_tokens > 1
