"""Replay mode kernels (Triton): output-only decode / verify against checkpoint + history, plain decode
(output-only, or written through to the checkpoint for small batches), the exact fold (also the
materialise of a committed state), and the ring with its cursor. The plain-torch reference beside
them is :mod:`sglang_ssm_modes.reference.replay`."""

from .decode import replay_decode, replay_write_through
from .fold import fold_into_checkpoints, replay_fold
from .ring import FAULT_NONFINITE, FAULT_OVERFLOW, ReplayRing, advance, after_fold, clear_history, fold_needed
from .verify import replay_verify

__all__ = ["FAULT_NONFINITE", "FAULT_OVERFLOW", "ReplayRing", "advance", "after_fold", "clear_history",
           "fold_into_checkpoints", "fold_needed", "replay_decode", "replay_fold", "replay_verify",
           "replay_write_through"]
