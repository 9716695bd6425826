"""Replay-mode fold and materialise: replay a request's history records (raw k re-normalised, raw
v, stored g and beta) through the native recurrence from its checkpoint, in float32 with the native
kernel's op order and tiling, and round once into a destination slot.

In place (destination = the checkpoint) it is the fold; into another pool or slot it materialises
the committed state for a radix-cache checkpoint, CPU offload or PD export, leaving checkpoint and
cursor untouched. With a float32 state a fold equals native decode of the same tokens bit for bit
(native rounds to float32 after every token, which changes nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..delta_rule_step import apply_records
from .ring import ReplayRing, after_fold, flag_nonfinite


@triton.jit
def replay_fold_kernel(
    src, src_indices, dst, dst_indices, mask,
    r_g, r_beta, r_kraw, r_vraw, r_count, r_phase, r_faults, rec_indices, lengths,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L: tl.constexpr, IS_KDA: tl.constexpr, HAS_LENGTHS: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``. For each request n with ``mask[n]`` and non-negative
    ``src_indices[n]``, ``dst_indices[n]``, ``rec_indices[n]``: ``dst[dst_indices[n]]`` (``[slots, HV, V,
    K]``, any float dtype) = ``src[src_indices[n]]`` advanced over the ring slot's first ``count``
    records (or ``lengths[n]``: e.g. into the window just verified, for a tracked snapshot). Every
    program owns one ``[K, BV]`` tile, so ``dst`` may be ``src``. A non-finite result is written and
    flagged in the ring slot's ``r_faults``."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    si = tl.load(src_indices + i_n).to(tl.int64)
    di = tl.load(dst_indices + i_n).to(tl.int64)
    r = tl.load(rec_indices + i_n).to(tl.int64)
    if (tl.load(mask + i_n) != 0) & (si >= 0) & (di >= 0) & (r >= 0):
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        mask_k = o_k < K
        mask_v = o_v < V
        mask_h = mask_k[:, None] & mask_v[None, :]
        tile = i_hv * K * V + o_v[None, :] * K + o_k[:, None]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        b_h += tl.load(src + si * HV * K * V + tile, mask=mask_h, other=0).to(tl.float32)
        rec0 = r * 2 * L + tl.load(r_phase + r).to(tl.int64) * L
        if HAS_LENGTHS:
            n_rec = tl.load(lengths + i_n)
        else:
            n_rec = tl.load(r_count + r)
        b_h = apply_records(b_h, r_kraw, r_vraw, r_g, r_beta, rec0, n_rec, i_h, i_hv, o_k, o_v, mask_k, mask_v,
                            H, HV, K, V, IS_KDA)
        p_dst = dst + di * HV * K * V + tile
        b_out = b_h.to(p_dst.dtype.element_ty)
        tl.store(p_dst, b_out, mask=mask_h)
        flag_nonfinite(r_faults, r, b_out.to(tl.float32))


def replay_fold(checkpoints: torch.Tensor, state_indices: torch.Tensor, ring: ReplayRing,
                record_indices: torch.Tensor, mask: torch.Tensor, *, is_kda: bool,
                dst: torch.Tensor | None = None, dst_indices: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None) -> None:
    """Fold (``dst`` None: in place into ``checkpoints``) or materialise (into ``dst`` at
    ``dst_indices``) the histories of the requests selected by ``mask`` ``[N]`` (bool). The cursor is
    not changed: an in-place fold is :func:`fold_into_checkpoints`; a materialise leaves
    checkpoint and history as they were. ``lengths`` ``[N]`` replays that many records instead of the
    cursor's count (records past the cursor: the window just verified)."""
    n = state_indices.shape[0]
    hv, vdim, kdim = checkpoints.shape[1:]
    BK, BV = triton.next_power_of_2(kdim), min(triton.next_power_of_2(vdim), 32)
    replay_fold_kernel[(triton.cdiv(vdim, BV), n * hv)](
        checkpoints, state_indices, checkpoints if dst is None else dst,
        state_indices if dst_indices is None else dst_indices, mask,
        ring.g, ring.beta, ring.k_raw, ring.v_raw, ring.count, ring.phase, ring.faults, record_indices, lengths,
        H=ring.k_raw.shape[2], HV=hv, K=kdim, V=vdim, BK=BK, BV=BV, L=ring.history, IS_KDA=is_kda,
        HAS_LENGTHS=lengths is not None,
        num_warps=1, num_stages=3)


def fold_into_checkpoints(checkpoints: torch.Tensor, state_indices: torch.Tensor, ring: ReplayRing,
                          record_indices: torch.Tensor, selected: torch.Tensor, *, is_kda: bool) -> None:
    """Fold the histories of the ``selected`` ``[N]`` requests into their checkpoints in place and
    empty them (:func:`replay_fold` then :func:`~.ring.after_fold`); device ops only."""
    replay_fold(checkpoints, state_indices, ring, record_indices, selected, is_kda=is_kda)
    after_fold(ring, record_indices, selected)
