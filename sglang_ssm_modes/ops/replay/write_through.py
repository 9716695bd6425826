"""Replay-mode write-through: a request's pending history folded into its checkpoint in the same launch that
runs its new tokens, in SGLang's own op order (its generic ``fused_sigmoid_gating_delta_rule_update``, the tile
held ``[BV, K]`` as its packed CUDA kernels hold it, on one warp; 16 value columns a program where SGLang takes
32, 8 for a KDA float32 decode, :func:`~.served.write_through_block_v`), the checkpoint written back and the
history emptied — native's bytes and native's one launch, for batches where launches and latency, not bytes,
bound the step (when: :mod:`.served`):

* **decode** (:func:`replay_write_through`): the token applied to the checkpoint too, as SGLang's decode applies
  it (with a float32 state its bits on the GPU, generic and packed kernel alike);
* **verify** (:func:`replay_write_through_verify`): a chain of D draft tokens run from the folded checkpoint as
  SGLang's target verify runs them (outputs its bits), their records appended to the emptied history; the
  acceptance then moves the cursor by the accepted length (:func:`~.ring.advance`) and the next verify folds
  exactly the accepted records — SGLang's verify + scatter, the committed state native's bit for bit with a
  float32 state, deferred by one round and without the D per-step states.

Either leaves the same committed state as the output-only path once that folds, so a server may switch
between them from one step to the next (the batch crossing a bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..delta_rule_step import (apply_records, delta_rule_update, delta_rule_update_u, l2normalize, store_key_record,
                               token_inputs)
from .ring import ReplayRing, flag_nonfinite
from .served import WRITE_THROUGH_V_MAJOR, WRITE_THROUGH_VERIFY_PREFETCH, write_through_block_v
from .verify import window_cursor


@triton.jit
def replay_write_through_kernel(
    A_log, a, dt_bias, q, k, v, b, o, h0_source, h0_indices,
    r_u, r_kn, r_g, r_beta, r_kraw, r_vraw, r_count, r_phase, r_folds, r_faults, r_tickets, rec_indices,
    softplus_beta, softplus_threshold, scale, T, stride_a, stride_q, stride_k, stride_v, stride_b,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, L: tl.constexpr,
    IS_KDA: tl.constexpr, BETA_ACTIVATED: tl.constexpr, ROUND_BETA: tl.constexpr, V_MAJOR: tl.constexpr,
    DRAFT: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``, one program per ``BV`` value columns of a request's value head, as
    SGLang's decode: its tile loaded and stored as ``[BV, K]``, K the fast axis, as SGLang's packed kernels hold
    it (``V_MAJOR``; transposed in registers to the ``[K, BV]`` of the shared arithmetic, which ``tl.trans``
    does without moving data) or as its generic kernel holds it (``V_MAJOR`` false). Inputs: ``q, k``
    ``[1, N*T, H, K]``, ``v`` ``[1, N*T, HV, V]``, ``a`` ``[N*T, HV]`` (GDN) or ``[N*T, HV*K]`` (KDA), ``b``
    ``[1, N*T, HV]`` (activation dtype), T tokens a request; ``o`` ``[1, N*T, HV, V]``; checkpoints
    ``h0_source`` ``[slots, HV, V, K]`` (any float dtype) at ``h0_indices`` ``[N]``; ring buffers and cursor
    words as :class:`~.ring.ReplayRing` at ``rec_indices`` ``[N]`` (distinct). ``K`` a power of two.

    A real row (both indices non-negative) loads its checkpoint tile in float32 and replays the ``count``
    records of its history (:func:`~..delta_rule_step.apply_records`, the fold's op order). Then

    * decode (``DRAFT`` false, T = 1): applies the token (:func:`~..delta_rule_step.delta_rule_update`), stores
      the output ``h . q`` and the tile rounded to the checkpoint's dtype;
    * verify (``DRAFT``): stores the folded tile rounded (where there were records) and goes on from the rounded
      values, as the next native verify reads the state its scatter wrote; runs the T draft tokens in float32,
      storing each output, and appends each token's records (``u``, normalised and raw k, g, beta, raw v) at
      positions ``0 .. T-1`` of the half the emptied history uses — never the half other programs of the
      request are still folding from. The checkpoint keeps no draft token. With ``PREFETCH`` each draft
      token's inputs are loaded one step ahead — the first before the fold — the same arithmetic, the same bits.

    A request that had records (``count > 0``) is a fold: the result is checked (:func:`~.ring.flag_nonfinite`)
    and its cursor emptied with no launch of its own — each of its ``P = HV * cdiv(V, BV)`` programs, once it
    has read the cursor, draws a ticket (an acquire-release atomic add on the slot's ``tickets``); the one that
    draws ticket ``P - 1`` (mod P), when every program has read it, takes the P tickets back (an atomic
    subtraction: the word is 0 again), writes ``count = 0``, flips ``phase`` and counts the fold. Where a batch
    repeats a slot (CUDA-graph capture runs every row on SGLang's dummy slot) the rows race on it, as SGLang's
    own decode does, but its cursor words only ever hold values a cursor can hold (no later launch reads past
    the ring) and ``tickets`` may stay nonzero until the slot is cleared (:class:`~.ring.ReplayRing`). Padding
    rows write nothing (their outputs: from a zero state)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    idx, r_safe, valid, c, phase, _ = window_cursor(h0_indices, rec_indices, r_count, r_phase, i_n, 1, L, False)

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    p_head = h0_source + tl.maximum(idx, 0) * HV * K * V + i_hv * K * V
    if V_MAJOR:
        mask_h = mask_v[:, None] & mask_k[None, :] & valid
        p_h0 = p_head + o_v[:, None] * K + o_k[None, :]
        b_h = tl.trans(tl.load(p_h0, mask=mask_h, other=0).to(tl.float32))
    else:
        mask_h = mask_k[:, None] & mask_v[None, :] & valid
        p_h0 = p_head + o_v[None, :] * K + o_k[:, None]
        b_h = tl.zeros([K, BV], dtype=tl.float32)
        b_h += tl.load(p_h0, mask=mask_h, other=0).to(tl.float32)
    if DRAFT:
        if PREFETCH:  # the first draft token's inputs, loaded while the fold runs
            n_q, n_k, n_v, n_g, n_beta = token_inputs(
                A_log, a, dt_bias, q, k, v, b, i_n * T, i_h, i_hv, o_k, o_v, mask_v, softplus_beta,
                softplus_threshold, stride_a, stride_q, stride_k, stride_v, stride_b, K, V, IS_KDA, BETA_ACTIVATED,
                ROUND_BETA)
    b_h = apply_records(b_h, r_kraw, r_vraw, r_g, r_beta, r_safe * 2 * L + phase.to(tl.int64) * L, c, i_h, i_hv,
                        o_k, o_v, mask_k, mask_v, H, HV, K, V, IS_KDA)

    if DRAFT:
        b_out = b_h.to(p_h0.dtype.element_ty)
        if V_MAJOR:
            tl.store(p_h0, tl.trans(b_out), mask=mask_h & (c > 0))
        else:
            tl.store(p_h0, b_out, mask=mask_h & (c > 0))
        b_h = b_out.to(tl.float32)
        pos0 = r_safe * 2 * L + tl.where(c > 0, 1 - phase, phase).to(tl.int64) * L
        writes_k = valid & (i_v == 0) & (i_hv % (HV // H) == 0)
        for t in range(0, T):
            row = i_n * T + t
            if PREFETCH:  # token t + 1's inputs loaded during token t's step (the last re-reads token T - 1)
                b_q, b_k_raw, b_v_raw, b_g, b_beta = n_q, n_k, n_v, n_g, n_beta
                n_q, n_k, n_v, n_g, n_beta = token_inputs(
                    A_log, a, dt_bias, q, k, v, b, i_n * T + tl.minimum(t + 1, T - 1), i_h, i_hv, o_k, o_v, mask_v,
                    softplus_beta, softplus_threshold, stride_a, stride_q, stride_k, stride_v, stride_b, K, V, IS_KDA,
                    BETA_ACTIVATED, ROUND_BETA)
            else:
                b_q, b_k_raw, b_v_raw, b_g, b_beta = token_inputs(
                    A_log, a, dt_bias, q, k, v, b, row, i_h, i_hv, o_k, o_v, mask_v, softplus_beta,
                    softplus_threshold, stride_a, stride_q, stride_k, stride_v, stride_b, K, V, IS_KDA,
                    BETA_ACTIVATED, ROUND_BETA)
            b_k = l2normalize(b_k_raw.to(tl.float32))
            b_h, b_u = delta_rule_update_u(b_h, b_k, b_v_raw.to(tl.float32), b_g, b_beta, IS_KDA)
            b_o = tl.sum(b_h * (l2normalize(b_q) * scale)[:, None], 0)
            tl.store(o + (row * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
            pos = pos0 + t
            tl.store(r_u + (pos * HV + i_hv) * V + o_v, b_u, mask=mask_v & valid)
            tl.store(r_vraw + (pos * HV + i_hv) * V + o_v, b_v_raw, mask=mask_v & valid)
            tl.store(r_kn + (pos * H + i_h) * K + o_k, b_k, mask=mask_k & writes_k)
            store_key_record(r_kraw, r_g, r_beta, pos, i_h, i_hv, writes_k, valid & (i_v == 0), o_k, mask_k,
                             b_k_raw, b_g, b_beta, H, HV, K, IS_KDA)
    else:
        b_q, b_k_raw, b_v_raw, b_g, b_beta = token_inputs(
            A_log, a, dt_bias, q, k, v, b, i_n, i_h, i_hv, o_k, o_v, mask_v, softplus_beta, softplus_threshold,
            stride_a, stride_q, stride_k, stride_v, stride_b, K, V, IS_KDA, BETA_ACTIVATED, ROUND_BETA)
        b_q = l2normalize(b_q) * scale
        b_h = delta_rule_update(b_h, l2normalize(b_k_raw.to(tl.float32)), b_v_raw.to(tl.float32), b_g, b_beta, IS_KDA)
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(o + (i_n * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
        b_out = b_h.to(p_h0.dtype.element_ty)
        if V_MAJOR:
            tl.store(p_h0, tl.trans(b_out), mask=mask_h)
        else:
            tl.store(p_h0, b_out, mask=mask_h)

    if c > 0:  # a fold: check it, and the last program of the request to read the cursor empties the history
        flag_nonfinite(r_faults, r_safe, b_out.to(tl.float32))
        programs = HV * ((V + BV - 1) // BV)
        if tl.atomic_add(r_tickets + r_safe, 1, sem="acq_rel") % programs == programs - 1:
            tl.atomic_add(r_tickets + r_safe, -programs, sem="relaxed")
            tl.store(r_count + r_safe, 0)
            tl.store(r_phase + r_safe, 1 - phase)
            tl.store(r_folds + r_safe, tl.load(r_folds + r_safe) + 1)


def _launch(A_log, a, dt_bias, q, k, v, b, checkpoints, state_indices, ring, record_indices, draft, is_kda,
            beta_activated, scale, round_beta, v_major, block_v, num_warps, num_stages, prefetch=False) -> torch.Tensor:
    """One :func:`replay_write_through_kernel` launch (``draft``: a verify window, else a decode), the tile as
    served where not given. Returns ``o``."""
    _, t_all, hk, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    n = state_indices.shape[0]
    if triton.next_power_of_2(kdim) != kdim:
        raise ValueError(f"head_k_dim {kdim} must be a power of two")
    BV = min(triton.next_power_of_2(vdim), block_v or write_through_block_v(is_kda, checkpoints.dtype, draft))
    o = q.new_empty(1, t_all, hv, vdim)
    replay_write_through_kernel[(triton.cdiv(vdim, BV), n * hv)](
        A_log, a, dt_bias, q, k, v, b, o, checkpoints, state_indices,
        ring.u, ring.k_norm, ring.g, ring.beta, ring.k_raw, ring.v_raw, ring.count, ring.phase, ring.folds,
        ring.faults, ring.tickets, record_indices,
        1.0, 20.0, kdim ** -0.5 if scale is None else scale, t_all // n if n else 1,
        a.stride()[-2], q.stride()[1], k.stride()[1], v.stride()[1], b.stride()[-2],
        H=hk, HV=hv, K=kdim, V=vdim, BV=BV, L=ring.history, IS_KDA=is_kda, BETA_ACTIVATED=beta_activated,
        ROUND_BETA=round_beta, V_MAJOR=WRITE_THROUGH_V_MAJOR if v_major is None else v_major, DRAFT=draft,
        PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages)
    return o


def replay_write_through(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, checkpoints: torch.Tensor,
                         state_indices: torch.Tensor, ring: ReplayRing, record_indices: torch.Tensor, *,
                         is_kda: bool, beta_activated: bool = False, scale: float | None = None,
                         round_beta: bool = False, v_major: bool | None = None, block_v: int | None = None,
                         num_warps: int = 1, num_stages: int = 3) -> torch.Tensor:
    """Write-through decode of ``N = len(state_indices)`` requests, one token each (inputs as
    :func:`~.verify.replay_verify` with T = 1): each real request's history folded, its token applied to its
    checkpoint, the checkpoint written and the cursor emptied (where it was not already) — one launch, no
    host sync, no allocation but ``o``. The tile, as served unless given: ``v_major``
    (:data:`~.served.WRITE_THROUGH_V_MAJOR`), ``block_v`` value columns
    (:func:`~.served.write_through_block_v`), ``num_warps``, ``num_stages`` (SGLang's decode launch's). Returns
    ``o`` ``[1, N, HV, V]``."""
    t_all, n = k.shape[1], state_indices.shape[0]
    if t_all != n:
        raise ValueError(f"a write-through decode takes one token per request: {t_all} tokens for {n} requests")
    return _launch(A_log, a, dt_bias, q, k, v, b, checkpoints, state_indices, ring, record_indices, False, is_kda,
                   beta_activated, scale, round_beta, v_major, block_v, num_warps, num_stages)


def replay_write_through_verify(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor,
                                k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, checkpoints: torch.Tensor,
                                state_indices: torch.Tensor, ring: ReplayRing, record_indices: torch.Tensor, *,
                                is_kda: bool, beta_activated: bool = False, scale: float | None = None,
                                v_major: bool | None = None, block_v: int | None = None, num_warps: int = 1,
                                num_stages: int = 3, prefetch: bool | None = None) -> torch.Tensor:
    """Write-through chain verify of ``N = len(state_indices)`` requests, ``T = T_all / N`` draft tokens each
    (inputs as :func:`~.verify.replay_verify`, ``T <= L``): each real request's history folded into its
    checkpoint (written, cursor emptied, where it had records), its window's outputs computed from there in
    SGLang's verify order and the window's records appended to the emptied history — one launch, no host
    sync, no allocation but ``o``. The acceptance that follows is replay's:
    ``advance(ring, record_indices, accepted, window=T)`` (the cursor is empty, no fold to settle). Tile
    keywords as :func:`replay_write_through`; ``prefetch``: each draft token's inputs loaded one step ahead (the
    kernel's ``PREFETCH``; the same bits), None as served (:data:`~.served.WRITE_THROUGH_VERIFY_PREFETCH`).
    Returns ``o`` ``[1, T_all, HV, V]``."""
    if prefetch is None:
        prefetch = WRITE_THROUGH_VERIFY_PREFETCH["kda" if is_kda else "gdn"]
    t_all, n = k.shape[1], state_indices.shape[0]
    if n == 0 or t_all % n:
        raise ValueError(f"{t_all} tokens do not split evenly over {n} requests")
    if t_all // n > ring.history:
        raise ValueError(f"a window of {t_all // n} tokens does not fit a replay history of {ring.history}: "
                         "L >= D needed")
    return _launch(A_log, a, dt_bias, q, k, v, b, checkpoints, state_indices, ring, record_indices, True, is_kda,
                   beta_activated, scale, False, v_major, block_v, num_warps, num_stages, prefetch)
