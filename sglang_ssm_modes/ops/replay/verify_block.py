"""Replay-mode output-only decode / verify, *block* path: the same outputs and records as the inline
path (:mod:`.verify`), with the history read once per program as whole tiles instead of record by
record for every token.

Per program (one value block of one head of one request): the history's normalised keys ``[L, K]``,
updates ``[L, BV]`` and gates (``[L, K]`` KDA, ``[L]`` GDN) are loaded once, masked by the cursor;
their cumulative log-decay comes from one ``tl.cumsum``. The window's own tokens are kept in register
tiles (``[TP, K]`` keys and decays, ``[TP, BV]`` updates) as they are produced, so nothing this program
wrote is read back from memory (no barrier). For token t, with ``G`` the cumulative decay::

    w_j   = (k_j * exp(G_t - G_j)) . k_t          (a [L] vector: one reduction over K)
    acc_k = sum_j w_j u_j                          (one reduction over L)

All decays ``exp(G_t - G_j)`` have non-positive exponents (gates are log-decays <= 0), so nothing
overflows; masked rows hold zero keys and contribute 0. Outputs agree with the inline path and with
native to float32 rounding (another summation order); records are the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..delta_rule_step import gate_vector, l2normalize, store_raw_record


@triton.jit(do_not_specialize=["T"])
def replay_verify_block_kernel(
    A_log, a, dt_bias, q, k, v, b, o,
    h0_source, h0_indices,
    r_u, r_kn, r_g, r_beta, r_kraw, r_vraw, r_count, r_phase, rec_indices,
    softplus_beta, softplus_threshold, scale, T,
    stride_a, stride_q, stride_k, stride_v, stride_b,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L: tl.constexpr, TP: tl.constexpr, IS_KDA: tl.constexpr, BETA_ACTIVATED: tl.constexpr,
    ROUND_BETA: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``; arguments as ``replay_verify_kernel`` (T tokens per request,
    ``T <= TP``, a power of two; L a power of two). Checkpoints ``[slots, HV, V, K]`` are read once;
    records of token t go to ring position ``phase * L + count + t``; the cursor is not moved."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = i_n * T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    p_A_log = A_log + i_hv
    if IS_KDA:
        p_dt_bias = dt_bias + i_hv * K + o_k
        p_a0 = a + bos * stride_a + i_hv * K + o_k
    else:
        p_dt_bias = dt_bias + i_hv
        p_a0 = a + bos * stride_a + i_hv
    p_b0 = b + bos * stride_b + i_hv

    idx = tl.load(h0_indices + i_n).to(tl.int64)
    r = tl.load(rec_indices + i_n).to(tl.int64)
    valid = (idx >= 0) & (r >= 0)
    b_s0 = tl.zeros([BK, BV], dtype=tl.float32)
    if idx >= 0:
        p_h0 = h0_source + idx * HV * K * V + i_hv * K * V + o_v[None, :] * K + o_k[:, None]
        b_s0 += tl.load(p_h0, mask=mask_h, other=0).to(tl.float32)
    r_safe = tl.maximum(r, 0)
    c = tl.where(valid, tl.load(r_count + r_safe), 0)
    rec0 = r_safe * 2 * L + tl.load(r_phase + r_safe).to(tl.int64) * L

    # the committed history, once: keys, updates, gates and their cumulative decay
    o_l = tl.arange(0, L)
    mask_l = o_l < c
    rows = rec0 + o_l
    b_kh = tl.load(r_kn + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mask_l[:, None] & mask_k[None, :],
                   other=0)
    b_uh = tl.load(r_u + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mask_l[:, None] & mask_v[None, :],
                   other=0)
    if IS_KDA:
        b_gh = tl.load(r_g + (rows[:, None] * HV + i_hv) * K + o_k[None, :], mask=mask_l[:, None] & mask_k[None, :],
                       other=0)
    else:
        b_gh = tl.load(r_g + rows * HV + i_hv, mask=mask_l, other=0)
    b_Gh = tl.cumsum(b_gh, axis=0)  # inclusive: decay up to and including record j
    b_G = tl.sum(b_gh, axis=0)  # after the whole history ([BK] KDA, scalar GDN)

    # the window's own tokens, appended to register tiles as they are produced
    o_w = tl.arange(0, TP)
    b_kw = tl.zeros([TP, BK], dtype=tl.float32)
    b_uw = tl.zeros([TP, BV], dtype=tl.float32)
    if IS_KDA:
        b_Gw = tl.zeros([TP, BK], dtype=tl.float32)
    else:
        b_Gw = tl.zeros([TP], dtype=tl.float32)
    writes_k = (i_v == 0) & (i_hv % (HV // H) == 0)
    for t in range(0, T):
        b_g, _, b_beta = gate_vector(p_A_log, p_a0 + t * stride_a, p_dt_bias, p_b0 + t * stride_b, mask_k,
                                      softplus_beta, softplus_threshold, BK, IS_KDA, BETA_ACTIVATED)
        if ROUND_BETA:  # as SGLang's GDN packed decode: sigmoid(b) rounded to b's dtype
            b_beta = b_beta.to(b.dtype.element_ty).to(tl.float32)
        b_k_raw = tl.load(k + (bos + t) * stride_k + i_h * K + o_k, mask=mask_k, other=0)
        b_v_raw = tl.load(v + (bos + t) * stride_v + i_hv * V + o_v, mask=mask_v, other=0)
        b_k = l2normalize(b_k_raw.to(tl.float32))
        b_q = l2normalize(tl.load(q + (bos + t) * stride_q + i_h * K + o_k, mask=mask_k, other=0).to(tl.float32))
        b_q = b_q * scale
        b_G += b_g
        if IS_KDA:
            b_e = tl.exp(b_G)
            s0k = tl.sum(b_s0 * (b_e * b_k)[:, None], 0)
            s0q = tl.sum(b_s0 * (b_e * b_q)[:, None], 0)
            b_dh = b_kh * tl.exp(b_G[None, :] - b_Gh)
            b_dw = b_kw * tl.exp(b_G[None, :] - b_Gw)
            wk_h, wq_h = tl.sum(b_dh * b_k[None, :], 1), tl.sum(b_dh * b_q[None, :], 1)
            wk_w, wq_w = tl.sum(b_dw * b_k[None, :], 1), tl.sum(b_dw * b_q[None, :], 1)
        else:
            b_e = tl.exp(b_G)
            s0k = tl.sum(b_s0 * b_k[:, None], 0) * b_e
            s0q = tl.sum(b_s0 * b_q[:, None], 0) * b_e
            d_h, d_w = tl.exp(b_G - b_Gh), tl.exp(b_G - b_Gw)
            wk_h, wq_h = tl.sum(b_kh * b_k[None, :], 1) * d_h, tl.sum(b_kh * b_q[None, :], 1) * d_h
            wk_w, wq_w = tl.sum(b_kw * b_k[None, :], 1) * d_w, tl.sum(b_kw * b_q[None, :], 1) * d_w
        acc_k = tl.sum(b_uh * wk_h[:, None], 0) + tl.sum(b_uw * wk_w[:, None], 0)
        acc_q = tl.sum(b_uh * wq_h[:, None], 0) + tl.sum(b_uw * wq_w[:, None], 0)
        b_u = b_beta * (b_v_raw.to(tl.float32) - s0k - acc_k)
        b_o = s0q + acc_q + b_u * tl.sum(b_k * b_q)
        tl.store(o + ((bos + t) * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
        here = o_w == t
        b_kw = tl.where(here[:, None], b_k[None, :], b_kw)
        b_uw = tl.where(here[:, None], b_u[None, :], b_uw)
        if IS_KDA:
            b_Gw = tl.where(here[:, None], b_G[None, :], b_Gw)
        else:
            b_Gw = tl.where(here, b_G, b_Gw)
        if valid:
            pos = rec0 + c + t
            tl.store(r_u + (pos * HV + i_hv) * V + o_v, b_u, mask=mask_v)
            if writes_k:
                tl.store(r_kn + (pos * H + i_h) * K + o_k, b_k, mask=mask_k)
            store_raw_record(r_kraw, r_vraw, r_g, r_beta, pos, i_h, i_hv, i_v == 0, writes_k, o_k, o_v, mask_k,
                             mask_v, b_k_raw, b_v_raw, b_g, b_beta, H, HV, K, V, IS_KDA)
