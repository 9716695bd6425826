"""Compact-mode commit (chain): re-run each request's accepted prefix from its committed state over
the raw-input records, in float32 with the native kernel's op order and tiling, and write the state
once — SGLang's stored verify copy ``round(S_n)``, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .records import CompactRecordBuffers


@triton.jit
def compact_commit_kernel(
    h0_source, h0_indices, rec_k, rec_v, rec_g, rec_beta, rec_indices, last_index,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, D: tl.constexpr, IS_KDA: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``. ``h0_source`` ``[slots, HV, V, K]`` is updated in place at
    ``h0_indices`` ``[N]`` for requests whose ``last_index`` ``[N]`` (accepted length - 1, base token
    included) is >= 0 and whose slot and record slot ``rec_indices`` ``[N]`` are >= 0; every other
    row (padding, nothing accepted) is left untouched. Records as :class:`CompactRecordBuffers`.
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    idx = tl.load(h0_indices + i_n).to(tl.int64)
    r = tl.load(rec_indices + i_n).to(tl.int64)
    last = tl.load(last_index + i_n).to(tl.int32)
    if (idx >= 0) & (r >= 0) & (last >= 0):
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        mask_k = o_k < K
        mask_v = o_v < V
        mask_h = mask_k[:, None] & mask_v[None, :]
        p_h0 = h0_source + idx * HV * K * V + i_hv * K * V + o_v[None, :] * K + o_k[:, None]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        b_h += tl.load(p_h0, mask=mask_h, other=0).to(tl.float32)
        for t in range(0, last + 1):
            rec_t = r * D + t
            b_k = tl.load(rec_k + (rec_t * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
            b_v = tl.load(rec_v + (rec_t * HV + i_hv) * V + o_v, mask=mask_v, other=0).to(tl.float32)
            b_beta = tl.load(rec_beta + rec_t * HV + i_hv)
            b_k = b_k / (tl.sqrt(tl.sum(b_k * b_k) + 1e-6))
            if IS_KDA:
                b_g = tl.load(rec_g + (rec_t * HV + i_hv) * K + o_k, mask=mask_k, other=0)
                b_h *= tl.exp(b_g[:, None])
            else:
                b_g = tl.load(rec_g + rec_t * HV + i_hv)
                b_h *= tl.exp(b_g)
            b_v -= tl.sum(b_h * b_k[:, None], 0)
            b_v *= b_beta
            b_h += b_k[:, None] * b_v[None, :]
        tl.store(p_h0, b_h.to(p_h0.dtype.element_ty), mask=mask_h)


def compact_commit(ssm_states: torch.Tensor, state_indices: torch.Tensor, records: CompactRecordBuffers,
                   record_indices: torch.Tensor, last_index: torch.Tensor, *, is_kda: bool) -> None:
    """Commit accepted prefixes into the state pool ``ssm_states`` ``[slots, HV, V, K]`` in place.

    ``last_index`` ``[N]`` is SGLang's ``last_correct_step_indices`` (accepted length - 1; -1 keeps
    the state). ``state_indices`` / ``record_indices`` ``[N]``: pool slot / record slot per request
    (< 0: padding). Request count is a runtime value (the grid), never a compile-time constant.
    """
    n = state_indices.shape[0]
    hv, vdim, kdim = ssm_states.shape[1:]
    hk = records.k.shape[2]
    BK, BV = triton.next_power_of_2(kdim), min(triton.next_power_of_2(vdim), 32)
    grid = (triton.cdiv(vdim, BV), n * hv)
    compact_commit_kernel[grid](
        ssm_states, state_indices, records.k, records.v, records.g, records.beta, record_indices, last_index,
        H=hk, HV=hv, K=kdim, V=vdim, BK=BK, BV=BV, D=records.draft_tokens, IS_KDA=is_kda,
        num_warps=1, num_stages=3)
