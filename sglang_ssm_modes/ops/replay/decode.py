"""Replay-mode plain decode (one token per request), served one of two ways:

* **output-only** (:func:`~.verify.replay_verify` with T = 1, then :func:`~.ring.advance`): the token's output
  from checkpoint + history, its record appended, the checkpoint only read — replay's point, paying where
  the state's bytes bound the step (many requests);
* **write-through** (:func:`~.write_through.replay_write_through`): the request's pending history folded and
  the token applied to the checkpoint in one launch, as SGLang's decode kernels apply it, the checkpoint
  written back and the history left empty — native's bytes and native's one launch, for batches where
  launches and latency, not bytes, bound the step and output-only was measured slower than native
  (:func:`write_through_max_requests`).

Both leave the same committed state (with a float32 state the write-through's is SGLang's decode bit for bit,
generic and packed kernel alike on the GPU; the output-only path's once folded, too), so a server may
switch between them from one step to the next (the batch crossing the bound): a request arriving at a
write-through with records folds them first.
"""

from __future__ import annotations

import torch

from .ring import ReplayRing, advance
from .verify import measured_key, replay_verify
from .write_through import replay_write_through


WRITE_THROUGH_BELOW = {
    ("gdn", 16, 4): 32, ("kda", 16, 4): 40, ("gdn", 32, 4): 40, ("kda", 32, 4): 64,
    ("gdn", 64, 4): 112, ("kda", 64, 4): None,
    ("gdn", 16, 2): 80, ("kda", 16, 2): 128, ("gdn", 32, 2): 112, ("kda", 32, 2): None,
    ("gdn", 64, 2): None, ("kda", 64, 2): None,
}
"""Per ``(family, history, state bytes)``: the request count from which output-only decode serves (None:
never — write-through at every batch). Since a decode's output launch keeps the narrow tile at long histories
(:data:`~.verify.WIDE_DECODE_FROM`), three bounds moved, both paths side by side on an H100 (bench/results/replay/
decode_tiling_20261206, commit 7d73792; ratios against SGLang's decode, write-through / output-only): float32 GDN
L = 64 1.01 / 0.92x at 80 requests, 1.00 / 1.01x at 96 (a tie), 1.00 / 1.08x at 112, output-only 1.16-1.18x at
128 where the wide tile gave 1.05-1.07x (was 128); KDA L = 32 0.99 / 1.04x at 64, 0.97-1.00 / 1.00-1.03x from 80 to
256 (one output-only step of 0.95x at 128 whose launches add up to 1.06x; was never; at 56 0.99 / 0.98x,
thresholds_20261206); bfloat16 GDN L = 32 (wide tile) 0.89 / 0.88x at 96,
0.88 / 0.96x at 112 (was 128). Since the cursors settle once a step (3bfe099), the bounds between the
earlier measured batches, both paths side by side on an H100 (bench/results/replay/thresholds_20261206; ratios
against SGLang's decode, write-through / output-only): float32 GDN L = 32 0.99 / 0.99x at 32 requests, 1.00 /
1.12x at 40, 1.01 / 1.24x at 48; KDA L = 16 1.00 / 1.01x at 32, 0.99 / 1.03x at 40, 0.99 / 1.05x at 48 (at L = 32
output-only 0.79-0.98x to 56: then still write-through); bfloat16 GDN L = 16 0.88 / 0.89x at 72, 0.89 / 0.95x at
80, 0.88 / 1.01x at 88, 0.89 / 1.07x at 96, 0.88 / 1.13x at 112 (at L = 32 0.89 / 0.88x at 96: then still 128; KDA
L = 16 0.87 / 0.83x at 96: still 128). Before that, GDN's rows since its window launch runs per key head
(:func:`~.verify.served_window_key_heads`), both paths side by side on an H100 (bench/results/replay/
keyhead_bounds_20261206, commit 4a280d3; ratios against SGLang's decode, write-through / output-only, batch 16 /
32 / 64 / 128 / 256): float32 L = 16 1.00 / 0.67, 1.06, 1.36, 1.36, 1.38x; L = 32 1.00 / 0.73, 0.96, 1.02,
1.34, 1.32x; L = 64 1.00 / 0.63, 0.70, 0.71, 1.04, 1.13x; bfloat16 (write-through 0.87-0.98x) L = 16 output-only
0.45, 0.75, 0.81, 1.11, 1.05x; L = 32 0.43, 0.51, 0.70, 0.97, 0.97x; L = 64 0.46-0.75x. KDA's rows (and GDN's
before) measured side by side on the H200 (bench/results/replay/writethrough_20261205, commit a6a4a2a):
float32 GDN L = 16 0.90-0.92 / 0.94-0.95x at 32 requests (a tie), 0.94-0.96 / 1.17-1.21x at 64; KDA L = 16
0.94-0.96 / 0.89-0.90x at 32, 0.96 / 1.13-1.15x at 64; GDN L = 32 0.97 / 0.87x at 64, 0.97 / 1.12x at
128; KDA L = 32 and both at L = 64: output-only slower at every batch (0.43-0.86x against 0.84-1.22x).
bfloat16 at L = 16: GDN 0.77-0.78 / 0.69x at 64, 0.74-0.75 / 0.91x at 128; KDA 0.73-0.74 / 0.70x at 64,
0.69 / 0.76x at 128; at L = 64 output-only 0.26-0.54x (at L = 32, from commit 34d5527: output-only 0.74x
GDN at 128 requests against write-through's 0.74-0.75x, KDA slower than at L = 16). A history of L < 16 takes
L = 16's bound; a state of 2-byte elements (bfloat16, float16) the bfloat16 row."""


def write_through_max_requests(is_kda: bool, history: int, state_dtype: torch.dtype) -> int | None:
    """The most requests a served plain decode writes through (:data:`WRITE_THROUGH_BELOW`), None for every
    batch."""
    below = WRITE_THROUGH_BELOW[measured_key(is_kda, history, state_dtype)]
    return None if below is None else below - 1


def serves_write_through(requests: int, is_kda: bool, history: int, state_dtype: torch.dtype) -> bool:
    """Whether a served plain decode of ``requests`` requests writes through
    (:func:`write_through_max_requests`)."""
    most = write_through_max_requests(is_kda, history, state_dtype)
    return most is None or requests <= most


def replay_decode(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, b: torch.Tensor, checkpoints: torch.Tensor, state_indices: torch.Tensor,
                  ring: ReplayRing, record_indices: torch.Tensor, *, is_kda: bool, beta_activated: bool = False,
                  scale: float | None = None, round_beta: bool = False, write_through: bool | None = None,
                  settle: bool = True, **verify_options) -> torch.Tensor:
    """Plain decode of one token per request: :func:`replay_write_through` where ``write_through`` (default
    :func:`serves_write_through` for this batch; the cursor left empty), else :func:`~.verify.replay_verify`
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
