"""Native verify with per-step state scratch, for GDN and KDA alike (SGLang 0.5.14 ships it for GDN
only: its KDA backend runs ``chunk_kda`` over the draft tokens and writes them into the state).

Layout and rounding are SGLang's: node t's state goes to ``intermediate_ssm[steps_index, t]``
(``[S, D, HV, V, K]``, state dtype; chain: the float32 chain's rounded copies; tree: each node from its
parent's rounded copy) and the state pool is not written; acceptance copies the last accepted node's
state (SGLang's ``fused_mamba_state_scatter_with_mask``, called by the acceptance step).
"""

from __future__ import annotations

import torch

from ..verify_window import verify_window


def native_verify(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, b: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                  intermediate_ssm: torch.Tensor, intermediate_indices: torch.Tensor, *, is_kda: bool,
                  cu_seqlens: torch.Tensor | None = None, retrieve_parent_token: torch.Tensor | None = None,
                  beta_activated: bool = False, scale: float | None = None) -> torch.Tensor:
    """Verify storing every node's state; inputs as SGLang's ``fused_sigmoid_gating_delta_rule_update``
    in target-verify mode. Returns ``o`` ``[1, T_all, HV, V]``."""
    return verify_window(A_log, a, dt_bias, q, k, v, b, ssm_states, state_indices, is_kda=is_kda,
                         steps=intermediate_ssm, steps_indices=intermediate_indices, cu_seqlens=cu_seqlens,
                         retrieve_parent_token=retrieve_parent_token, beta_activated=beta_activated, scale=scale)
