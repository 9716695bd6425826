"""Compact-mode verify: output-only (the state is read, never written), recording each draft
token's raw inputs for the commit; no per-step state scratch."""

from __future__ import annotations

import torch

from ..verify_window import verify_window
from .records import CompactRecordBuffers


FAST_VERIFY_TILE = (16, 1)
"""``(BV, num_warps)`` of the ``fast`` compact verify (``--ssm-compact-verify fast``): 16 value columns on one
warp, more and smaller programs than native's tiling. On the H200 (bench/results/replay/split_20261203/
run4_1e9c712/compact, one run, D = 4, verify + commit against native's) the round is 1.48x / 1.61x native at
batch 64 / 256 for GDN and 1.53x / 1.57x for KDA with a float32 state, 1.20-1.25x with bfloat16 — against
1.26-1.39x (GDN) and 1.28-1.33x (KDA) with native's tiling in another run (bench/results/compact_h200.md).
Outputs then agree with native's to float32 rounding (another summation order), not bit for bit; records,
and so committed states, stay exact."""


def compact_verify(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, b: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                   records: CompactRecordBuffers, record_indices: torch.Tensor, *, is_kda: bool,
                   cu_seqlens: torch.Tensor | None = None, retrieve_parent_token: torch.Tensor | None = None,
                   beta_activated: bool = False, scale: float | None = None,
                   tile: tuple[int, int] | None = None) -> torch.Tensor:
    """Output-only verify of a chain (or a tree with ``retrieve_parent_token`` ``[N, D]``): inputs as
    SGLang's ``fused_sigmoid_gating_delta_rule_update``, plus the record buffers and each request's
    record slot. Returns ``o`` ``[1, T_all, HV, V]``: native's bit for bit with the default (native)
    tiling; ``tile = (BV, num_warps)`` trades that for speed (outputs then agree to float32 rounding;
    records, and so the committed state, are exact either way)."""
    return verify_window(A_log, a, dt_bias, q, k, v, b, ssm_states, state_indices, is_kda=is_kda, records=records,
                         record_indices=record_indices, cu_seqlens=cu_seqlens,
                         retrieve_parent_token=retrieve_parent_token, beta_activated=beta_activated, scale=scale,
                         tile=tile)
