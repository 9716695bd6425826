"""Compact-mode verify: output-only (the state is read, never written), recording each draft
token's raw inputs for the commit; no per-step state scratch."""

from __future__ import annotations

import torch

from ..verify_window import verify_window
from .records import CompactRecordBuffers


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
