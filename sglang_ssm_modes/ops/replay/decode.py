"""Replay-mode plain decode (one token per request), served one of two ways:

* **output-only** (:func:`~.verify.replay_verify` with T = 1, then :func:`~.ring.advance`): the token's output
  from checkpoint + history, its record appended, the checkpoint only read — replay's point, paying where
  the state's bytes bound the step (many requests);
* **write-through** (:func:`~.write_through.replay_write_through`): the request's pending history folded and
  the token applied to the checkpoint in one launch, as SGLang's decode kernels apply it, the checkpoint
  written back and the history left empty — native's bytes and native's one launch, for batches where
  launches and latency, not bytes, bound the step and output-only was measured no faster than the write-through
  (:func:`~.served.write_through_max_requests`).

Both leave the same committed state (with a float32 state the write-through's is SGLang's decode bit for bit,
generic and packed kernel alike on the GPU; the output-only path's once folded, too), so a server may
switch between them from one step to the next (the batch crossing the bound): a request arriving at a
write-through with records folds them first.
"""

from __future__ import annotations

import torch

from .ring import ReplayRing, advance
from .served import serves_write_through
from .verify import replay_verify
from .write_through import replay_write_through


def replay_decode(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, b: torch.Tensor, checkpoints: torch.Tensor, state_indices: torch.Tensor,
                  ring: ReplayRing, record_indices: torch.Tensor, *, is_kda: bool, beta_activated: bool = False,
                  scale: float | None = None, round_beta: bool = False, write_through: bool | None = None,
                  settle: bool = True, **verify_options) -> torch.Tensor:
    """Plain decode of one token per request: :func:`replay_write_through` where ``write_through`` (default
    :func:`~.served.serves_write_through` for this batch; the cursor left empty), else :func:`~.verify.replay_verify`
    (``verify_options``: its keywords; the fold fused unless ``fused_fold=False``, when the caller folds first),
    then, with ``settle``, ``advance(ring, record_indices, 1, window=1)`` (``window=0`` without the fused fold).
    ``settle=False`` leaves an output-only step's cursor to the caller: that same advance, which on a pool's
    stacked rings settles every layer in one launch (a server's step: once, after its last linear layer).
    Returns ``o`` ``[1, N, HV, V]``."""
    n = state_indices.shape[0]
    if write_through is None:
        write_through = serves_write_through(n, is_kda, ring.history, checkpoints.dtype)
    common = dict(is_kda=is_kda, beta_activated=beta_activated, scale=scale, round_beta=round_beta)
    if write_through:
        if verify_options:
            raise ValueError(f"{sorted(verify_options)}: options of the output-only path, not of a write-through")
        return replay_write_through(A_log, a, dt_bias, q, k, v, b, checkpoints, state_indices, ring, record_indices,
                                    **common)
    o = replay_verify(A_log, a, dt_bias, q, k, v, b, checkpoints, state_indices, ring, record_indices, **common,
                      **verify_options)
    if settle:
        advance(ring, record_indices, 1, window=1 if verify_options.get("fused_fold", True) else 0)
    return o
