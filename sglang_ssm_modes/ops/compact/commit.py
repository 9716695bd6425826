"""Compact-mode commit: re-run each request's accepted prefix (a chain, or a path through a draft
tree) from its committed state over the raw-input records, in float32 with the native kernel's op
order and tiling, and write the state once — bit for bit the state native verify stored for the last
accepted node (chain: rounded once at the end; tree: rounded after every step, as native reloads
each parent's stored copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..delta_rule_step import apply_record, apply_records, tree_ancestors
from ..layer_stack import check_layer_stack
from .records import CompactRecordBuffers


@triton.jit(do_not_specialize=["src_slots", "dst_slots", "R"])
def compact_commit_kernel(
    h0_source, h0_indices, dst, dst_indices, rec_k, rec_v, rec_g, rec_beta, rec_indices, last_index,
    parents, stride_parents_seq, stride_parents_tok, src_slots, dst_slots, R,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, D: tl.constexpr, NP2_D: tl.constexpr,
    IS_KDA: tl.constexpr, IS_TREE: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV, layers)``. In every layer l, reads ``h0_source`` ``[layers * src_slots, HV,
    V, K]`` at ``l * src_slots + h0_indices[n]`` and writes ``dst`` (the same pool for a commit, another slot
    for a tracked snapshot) at ``l * dst_slots + dst_indices[n]``, from record slot ``l * R + rec_indices[n]``,
    for requests whose ``last_index`` ``[N]`` (window index of the last accepted node; accepted length - 1
    for a chain) is >= 0 and whose slots and record slot are >= 0; every other row (padding, nothing
    accepted) is left untouched. Records as :class:`CompactRecordBuffers`; ``parents`` ``[N, D]`` for a tree.
    """
    i_v, i_nh, i_l = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    idx = tl.load(h0_indices + i_n).to(tl.int64)
    di = tl.load(dst_indices + i_n).to(tl.int64)
    r = tl.load(rec_indices + i_n).to(tl.int64)
    last = tl.load(last_index + i_n).to(tl.int32)
    if (idx >= 0) & (di >= 0) & (r >= 0) & (last >= 0):
        idx, di, r = idx + i_l * src_slots, di + i_l * dst_slots, r + i_l * R
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        mask_k = o_k < K
        mask_v = o_v < V
        mask_h = mask_k[:, None] & mask_v[None, :]
        p_h0 = h0_source + idx * HV * K * V + i_hv * K * V + o_v[None, :] * K + o_k[:, None]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        b_h += tl.load(p_h0, mask=mask_h, other=0).to(tl.float32)
        if IS_TREE:  # the accepted path: ancestors of the last accepted node, rounded after every step
            o_d = tl.arange(0, NP2_D)
            anc, depth = tree_ancestors(parents + i_n * stride_parents_seq, stride_parents_tok, last, D, NP2_D)
            for jj in range(0, depth + 1):
                t = tl.sum(tl.where(o_d == depth - jj, anc, 0))
                b_h = apply_record(b_h, rec_k, rec_v, rec_g, rec_beta, r * D + t, i_h, i_hv, o_k, o_v, mask_k,
                                   mask_v, H, HV, K, V, IS_KDA)
                b_h = b_h.to(h0_source.dtype.element_ty).to(tl.float32)
        else:  # the accepted prefix, rounded once
            b_h = apply_records(b_h, rec_k, rec_v, rec_g, rec_beta, r * D, last + 1, i_h, i_hv, o_k, o_v, mask_k,
                                mask_v, H, HV, K, V, IS_KDA)
        p_dst = dst + di * HV * K * V + i_hv * K * V + o_v[None, :] * K + o_k[:, None]
        tl.store(p_dst, b_h.to(p_dst.dtype.element_ty), mask=mask_h)


def compact_commit(ssm_states: torch.Tensor, state_indices: torch.Tensor, records: CompactRecordBuffers,
                   record_indices: torch.Tensor, last_index: torch.Tensor, *, is_kda: bool,
                   retrieve_parent_token: torch.Tensor | None = None, dst_states: torch.Tensor | None = None,
                   dst_indices: torch.Tensor | None = None) -> None:
    """Commit accepted prefixes into the state pool ``ssm_states`` ``[slots, HV, V, K]`` in place, or
    (``dst_states`` / ``dst_indices``) write the state after node ``last_index`` into other slots — a
    tracked snapshot for the radix cache — leaving ``ssm_states`` as it is.

    ``last_index`` ``[N]`` is SGLang's ``last_correct_step_indices`` (window index of the last accepted
    node; -1 keeps the state). ``state_indices`` / ``record_indices`` ``[N]``: pool slot / record slot
    per request (< 0: padding). ``retrieve_parent_token`` ``[N, D]`` selects tree semantics. The
    request count is a runtime value (the grid), never a compile-time constant. Every layer in one launch:
    the pool's stacked ``[layers, slots, HV, V, K]`` states (``dst_states`` too) and records
    (:attr:`CompactRecordBuffers.stacked`), the same slots in every layer.
    """
    n = state_indices.shape[0]
    dst = ssm_states if dst_states is None else dst_states
    layers, rec_slots = check_layer_stack(ssm_states, dst, records, "records")
    hv, vdim, kdim = ssm_states.shape[-3:]
    hk = records.k.shape[-2]
    parents = retrieve_parent_token
    tree = parents is not None
    BK, BV = triton.next_power_of_2(kdim), min(triton.next_power_of_2(vdim), 32)
    grid = (triton.cdiv(vdim, BV), n * hv, layers)
    compact_commit_kernel[grid](
        ssm_states, state_indices, dst, state_indices if dst_indices is None else dst_indices, records.k, records.v,
        records.g, records.beta, record_indices, last_index,
        parents, parents.stride(0) if tree else 0, parents.stride(1) if tree else 0, ssm_states.shape[-4],
        dst.shape[-4], rec_slots,
        H=hk, HV=hv, K=kdim, V=vdim, BK=BK, BV=BV, D=records.draft_tokens,
        NP2_D=triton.next_power_of_2(records.draft_tokens), IS_KDA=is_kda, IS_TREE=tree, num_warps=1, num_stages=3)
