"""Replay mode kernels (Triton): plain decode and chain verify, output-only against checkpoint + history or
(small batches) written through to the checkpoint, the exact fold (also the materialise of a committed
state), and the ring with its cursor. The plain-torch reference beside
them is :mod:`sglang_ssm_modes.reference.replay`."""

from .decode import replay_decode
from .fold import fold_into_checkpoints, replay_fold
from .ring import FAULT_NONFINITE, FAULT_OVERFLOW, ReplayRing, advance, after_fold, clear_history, fold_needed
from .verify import replay_verify
from .write_through import replay_write_through, replay_write_through_verify

__all__ = ["FAULT_NONFINITE", "FAULT_OVERFLOW", "ReplayRing", "advance", "after_fold", "clear_history",
           "fold_into_checkpoints", "fold_needed", "replay_decode", "replay_fold", "replay_verify",
           "replay_write_through", "replay_write_through_verify"]
