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
from ..layer_stack import check_layer_stack
from .ring import ReplayRing, after_fold, flag_nonfinite, window_overflows


@triton.jit(do_not_specialize=["src_slots", "dst_slots", "R", "window"])
def replay_fold_kernel(
    src, src_indices, dst, dst_indices, mask,
    r_g, r_beta, r_kraw, r_vraw, r_count, r_phase, r_faults, rec_indices, window_steps, src_slots, dst_slots, R,
    window, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, L: tl.constexpr, IS_KDA: tl.constexpr, HAS_MASK: tl.constexpr, WINDOW_STEPS: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV, layers)``. For each request n (with ``mask[n]`` where ``HAS_MASK``) and
    non-negative ``src_indices[n]``, ``dst_indices[n]``, ``rec_indices[n]``, in every layer l: ``dst[l * dst_slots +
    dst_indices[n]]`` (``[layers * dst_slots, HV, V, K]``, any float dtype) = ``src[l * src_slots + src_indices[n]]``
    advanced over the history of ring slot ``l * R + rec_indices[n]``: its first ``count`` records, or, where
    ``WINDOW_STEPS``, through step ``window_steps[n]`` of the ``window``-token verify that just ran (rows with a
    negative step skipped; where that verify's fused fold is not settled yet, ``count + window > L``, its records
    start the other half: ``count`` 0, ``phase`` flipped — the cursor ``advance(window=window)`` will leave).
    Every program owns one ``[K, BV]`` tile, so ``dst`` may be ``src``. A non-finite result is written and
    flagged in the ring slot's ``r_faults``."""
    i_v, i_nh, i_l = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    si = tl.load(src_indices + i_n).to(tl.int64)
    di = tl.load(dst_indices + i_n).to(tl.int64)
    r = tl.load(rec_indices + i_n).to(tl.int64)
    go = (si >= 0) & (di >= 0) & (r >= 0)
    if HAS_MASK:
        go = go & (tl.load(mask + i_n) != 0)
    if WINDOW_STEPS:
        step = tl.load(window_steps + i_n).to(tl.int32)
        go = go & (step >= 0)
    if go:
        si, di, r = si + i_l * src_slots, di + i_l * dst_slots, r + i_l * R
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        mask_k = o_k < K
        mask_v = o_v < V
        mask_h = mask_k[:, None] & mask_v[None, :]
        tile = i_hv * K * V + o_v[None, :] * K + o_k[:, None]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        b_h += tl.load(src + si * HV * K * V + tile, mask=mask_h, other=0).to(tl.float32)
        n_rec = tl.load(r_count + r)
        phase = tl.load(r_phase + r)
        if WINDOW_STEPS:
            settles = (window > 0) & window_overflows(n_rec, window, L)
            phase = tl.where(settles, 1 - phase, phase)
            n_rec = tl.where(settles, 0, n_rec) + step + 1
        rec0 = r * 2 * L + phase.to(tl.int64) * L
        b_h = apply_records(b_h, r_kraw, r_vraw, r_g, r_beta, rec0, n_rec, i_h, i_hv, o_k, o_v, mask_k, mask_v,
                            H, HV, K, V, IS_KDA)
        p_dst = dst + di * HV * K * V + tile
        b_out = b_h.to(p_dst.dtype.element_ty)
        tl.store(p_dst, b_out, mask=mask_h)
        flag_nonfinite(r_faults, r, b_out.to(tl.float32))


def replay_fold(checkpoints: torch.Tensor, state_indices: torch.Tensor, ring: ReplayRing,
                record_indices: torch.Tensor, mask: torch.Tensor | None, *, is_kda: bool,
                dst: torch.Tensor | None = None, dst_indices: torch.Tensor | None = None,
                window_steps: torch.Tensor | None = None, window: int = 0) -> None:
    """Fold (``dst`` None: in place into ``checkpoints``) or materialise (into ``dst`` at
    ``dst_indices``) the histories of the requests selected by ``mask`` ``[N]`` (bool; None: every row). The
    cursor is not changed: an in-place fold is :func:`fold_into_checkpoints`; a materialise leaves
    checkpoint and history as they were. ``window_steps`` ``[N]`` (any integer dtype; SGLang's
    ``mamba_steps_to_track``) materialises the state after that step of the ``window``-token chain verify that
    just ran (its records past the cursor; a negative step: nothing), before the acceptance's
    ``advance(window=window)`` — a tracked radix-cache snapshot.

    One layer (``checkpoints`` / ``dst`` ``[slots, HV, V, K]``, ``ring`` one layer's), or every layer in one
    launch: the pool's stacked ``[layers, slots, HV, V, K]`` states (``dst`` stacked too) and rings
    (:attr:`~.ring.ReplayRing.stacked`), the same slots in every layer."""
    n = state_indices.shape[0]
    dst = checkpoints if dst is None else dst
    layers, rec_slots = check_layer_stack(checkpoints, dst, ring, "rings")
    hv, vdim, kdim = checkpoints.shape[-3:]
    BK, BV = triton.next_power_of_2(kdim), min(triton.next_power_of_2(vdim), 32)
    replay_fold_kernel[(triton.cdiv(vdim, BV), n * hv, layers)](
        checkpoints, state_indices, dst, state_indices if dst_indices is None else dst_indices,
        state_indices if mask is None else mask, ring.g, ring.beta, ring.k_raw, ring.v_raw, ring.count, ring.phase,
        ring.faults, record_indices, state_indices if window_steps is None else window_steps, checkpoints.shape[-4],
        dst.shape[-4], rec_slots, window, H=ring.k_raw.shape[-2], HV=hv, K=kdim, V=vdim, BK=BK, BV=BV,
        L=ring.history, IS_KDA=is_kda, HAS_MASK=mask is not None, WINDOW_STEPS=window_steps is not None,
        num_warps=1, num_stages=3)


def fold_into_checkpoints(checkpoints: torch.Tensor, state_indices: torch.Tensor, ring: ReplayRing,
                          record_indices: torch.Tensor, selected: torch.Tensor, *, is_kda: bool) -> None:
    """Fold the histories of the ``selected`` ``[N]`` requests into their checkpoints in place and
    empty them (:func:`replay_fold` then :func:`~.ring.after_fold`; one layer or the pool's stacked buffers, every
    layer in the same launches); device ops only."""
    replay_fold(checkpoints, state_indices, ring, record_indices, selected, is_kda=is_kda)
    after_fold(ring, record_indices, selected)
