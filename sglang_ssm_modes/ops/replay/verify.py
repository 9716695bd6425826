"""Replay-mode output-only decode / verify: the outputs of a window of T tokens from the checkpoint S0
and the request's history records, never materialising the state (DESIGN §2, "Replay algebra"), and
the window's records appended after the cursor.

Per value head, with ``G`` the cumulative log-decay since the checkpoint (a K-vector; GDN's scalar
gate broadcast) and normalised ``k``, scaled ``q``::

    u_t = beta_t [v_t - S0 (e^{G_t} * k_t) - sum_{j<t} u_j ((k_j * e^{G_t - G_j}) . k_t)]
    o_t = S0 (e^{G_t} * q_t) + sum_{j<=t} u_j ((k_j * e^{G_t - G_j}) . q_t)

Two launches split the work by the axis it runs over (a small GDN window runs in one, below):

* :func:`replay_window_kernel` (one program per request and value head; served for GDN per request and key
  head, :func:`~.served.served_window_key_heads`) does everything that runs
  over K: the window's gates, normalised keys and queries, the decayed projections ``e^{G_t} * k_t``,
  ``e^{G_t} * q_t``, and the scalar coefficients ``(k_j * e^{G_t - G_j}) . k_t`` (and ``. q_t``) of
  every history record and earlier window token — reading the history's keys once per head — and
  appends the window's key-side records (normalised and raw k, g, beta);
* :func:`replay_output_kernel` (one program per ``BV`` value columns, as SGLang's native decode) reads
  its checkpoint columns in a pipelined loop over K and its columns of the history's ``u``, solves the
  window's ``u`` and outputs with those coefficients, and appends the value-side records (``u``, raw v). A
  request whose window would overflow is folded here, tile by tile, in the same launch — first, when the
  batch is large enough: one more program of the window launch (:func:`fold_order_program`) orders the
  requests so that folding ones come first.

:func:`replay_step_kernel` does both in one launch, every output program computing the window's K-side work
for itself tile by tile: no launch gap and no scratch, but the history's keys read once per column tile and
programs twice the registers — served where launches, not bytes, bound the time and the history is short
(:data:`~.served.ONE_LAUNCH_MAX_TOKENS`, :data:`~.served.ONE_LAUNCH_MAX_HISTORY`).

In two launches the checkpoint, by far the largest read, is read once, by programs no larger than native's, without the
history's ``[L, K]`` key block beside it in registers. Outputs agree with native to float32 rounding
(another summation order).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..delta_rule_step import (apply_records, beta_gate, decay_gate, gate_vector, l2normalize, l2normalize_rows,
                               packed_beta, store_key_record, token_gate)
from .ring import ReplayRing, flag_nonfinite, window_overflows
from .served import (FOLD_FIRST_MIN_REQUESTS, SERVED_PDL, output_tiling, served_fold_block_v, served_launches,
                     served_window_history_rows, served_window_key_heads, served_window_raw_keys, served_window_warps)


@triton.jit
def window_cursor(h0_indices, rec_indices, r_count, r_phase, i_n, T, L: tl.constexpr, FUSED_FOLD: tl.constexpr):
    """``(idx, r, valid, count, phase, fold)`` of request ``i_n`` as both launches see them: checkpoint
    slot, record slot, whether the row is real (both non-negative), the history's length and half, after a
    fused fold of an overflowing window (``count + T > L``: ``count = 0``, ``phase ^= 1``; the cursor in
    memory is settled later by :func:`~.ring.advance`)."""
    idx = tl.load(h0_indices + i_n).to(tl.int64)
    r = tl.load(rec_indices + i_n).to(tl.int64)
    valid = (idx >= 0) & (r >= 0)
    r_safe = tl.maximum(r, 0)
    c = tl.where(valid, tl.load(r_count + r_safe), 0)
    phase = tl.load(r_phase + r_safe)
    if FUSED_FOLD:
        fold = valid & window_overflows(c, T, L)
    else:
        fold = valid & False
    c = tl.where(fold, 0, c)
    phase = tl.where(fold, 1 - phase, phase)
    return idx, r_safe, valid, c, phase, fold


@triton.jit
def output_program(h0_source, h0_indices, r_kraw, r_vraw, r_g, r_beta, r_count, r_phase, r_faults, rec_indices, order,
                   T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                   FBV: tl.constexpr, L: tl.constexpr, IS_KDA: tl.constexpr, FUSED_FOLD: tl.constexpr,
                   FOLD_FIRST: tl.constexpr):
    """How a program of either output launch (grid ``(cdiv(V, BV), N * HV)``) starts: its request (the
    ``order[i]``-th with ``FOLD_FIRST``), value and key head, value columns and cursor, its checkpoint
    columns folded first (:func:`fold_columns`) when the request's window overflows the history. Returns
    ``(i_v, bos, i_hv, i_h, o_v, mask_v, idx, valid, count, p_h0, rec0)``: ``bos`` the request's first token,
    ``p_h0`` the head's checkpoint, ``rec0`` the ring position of the history's first record."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    if FOLD_FIRST:
        i_n = tl.load(order + i_n)
    i_h = i_hv // (HV // H)
    bos = i_n * T
    o_v = i_v * BV + tl.arange(0, BV)
    idx, r, valid, c, phase, fold = window_cursor(h0_indices, rec_indices, r_count, r_phase, i_n, T, L, FUSED_FOLD)
    p_h0 = h0_source + tl.maximum(idx, 0) * HV * K * V + i_hv * K * V
    rec0 = r * 2 * L + phase.to(tl.int64) * L
    if fold:  # the full history sits in the other half
        fold_columns(p_h0, r_kraw, r_vraw, r_g, r_beta, r_count, r_faults, r, r * 2 * L + (1 - phase).to(tl.int64) * L,
                     i_h, i_hv, i_v, H, HV, K, V, BV, FBV, IS_KDA)
        tl.debug_barrier()  # the caller's loop reads the folded columns other threads stored
    return i_v, bos, i_hv, i_h, o_v, o_v < V, idx, valid, c, p_h0, rec0


@triton.jit(do_not_specialize=["N", "T"])
def replay_window_kernel(
    A_log, a, dt_bias, q, k, b, proj, h0_indices,
    r_kn, r_g, r_beta, r_kraw, r_count, r_phase, rec_indices, order,
    softplus_beta, softplus_threshold, scale, N, T,
    stride_a, stride_q, stride_k, stride_b,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, L: tl.constexpr, TP: tl.constexpr, W: tl.constexpr,
    IS_KDA: tl.constexpr, BETA_ACTIVATED: tl.constexpr, ROUND_BETA: tl.constexpr, FUSED_FOLD: tl.constexpr,
    FOLD_FIRST: tl.constexpr, KEY_HEADS: tl.constexpr, GP: tl.constexpr, PDL: tl.constexpr, RAW_KEYS: tl.constexpr,
    HR: tl.constexpr,
):
    """Grid ``(N * HV + FOLD_FIRST,)``: the K-side of a window of T tokens per request (``q, k``
    ``[1, N*T, H, K]``, ``a`` ``[N*T, HV]`` or ``[N*T, HV*K]``, ``b`` ``[1, N*T, HV]``), one program per request
    and value head (:func:`window_program`); with ``FOLD_FIRST`` one more program writes the output launch's
    fold-first ``order`` (:func:`fold_order_program`) — no launch of its own. ``PDL``: every program first lets
    the output launch start (``griddepcontrol.launch_dependents``; it waits for this launch before reading
    anything written here). ``KEY_HEADS`` (GDN): one program per request and key head instead
    (:func:`window_key_head_program`; grid ``(N * H + FOLD_FIRST,)``, ``GP`` the next power of two of
    ``HV // H``). ``RAW_KEYS``: the history's keys renormalised from the raw records (:func:`history_keys`). ``HR``:
    a value-head program's history records a step (0: held whole; :func:`window_program`)."""
    i_nh = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if KEY_HEADS:
        if FOLD_FIRST and i_nh == N * H:
            fold_order_program(h0_indices, rec_indices, r_count, order, N, T, L, 256)
        else:
            window_key_head_program(i_nh, A_log, a, dt_bias, q, k, b, proj, h0_indices, r_kn, r_g, r_beta, r_kraw,
                                    r_count, r_phase, rec_indices, softplus_beta, softplus_threshold, scale, T,
                                    stride_a, stride_q, stride_k, stride_b, H, HV, K, L, TP, W, GP, BETA_ACTIVATED,
                                    ROUND_BETA, FUSED_FOLD, RAW_KEYS)
    elif FOLD_FIRST:
        if i_nh == N * HV:
            fold_order_program(h0_indices, rec_indices, r_count, order, N, T, L, 256)
        else:
            window_program(i_nh, A_log, a, dt_bias, q, k, b, proj, h0_indices, r_kn, r_g, r_beta, r_kraw, r_count,
                           r_phase, rec_indices, softplus_beta, softplus_threshold, scale, T, stride_a, stride_q,
                           stride_k, stride_b, H, HV, K, L, TP, W, IS_KDA, BETA_ACTIVATED, ROUND_BETA, FUSED_FOLD,
                           RAW_KEYS, HR)
    else:
        window_program(i_nh, A_log, a, dt_bias, q, k, b, proj, h0_indices, r_kn, r_g, r_beta, r_kraw, r_count,
                       r_phase, rec_indices, softplus_beta, softplus_threshold, scale, T, stride_a, stride_q,
                       stride_k, stride_b, H, HV, K, L, TP, W, IS_KDA, BETA_ACTIVATED, ROUND_BETA, FUSED_FOLD,
                       RAW_KEYS, HR)


@triton.jit
def window_program(i_nh, A_log, a, dt_bias, q, k, b, proj, h0_indices, r_kn, r_g, r_beta, r_kraw, r_count, r_phase,
                   rec_indices, softplus_beta, softplus_threshold, scale, T, stride_a, stride_q, stride_k, stride_b,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, L: tl.constexpr, TP: tl.constexpr,
                   W: tl.constexpr, IS_KDA: tl.constexpr, BETA_ACTIVATED: tl.constexpr, ROUND_BETA: tl.constexpr,
                   FUSED_FOLD: tl.constexpr, RAW_KEYS: tl.constexpr, HR: tl.constexpr):
    """Window program ``i_nh`` (request ``i_nh // HV``, value head ``i_nh % HV``). Writes one row of ``proj``
    ``[N*T, HV, W]`` float32 (``W = 2K + 2L + 2TP + 1``) per token and value head: ``e^{G_t} * k_t`` (K),
    ``e^{G_t} * q_t`` (K, ``q`` scaled), the history coefficients ``(k_j * e^{G_t - G_j}) . k_t`` and
    ``. q_t`` (L each, records ``j < count``), the window coefficients for tokens ``j < t`` of ``. k_t``
    and ``j <= t`` of ``. q_t`` (TP each, ``TP = next_power_of_2(T)``) and beta. Appends normalised and raw
    k (once per key head), g and beta at ring position ``phase * L + count + t`` of real rows. ``K`` a
    power of two; ring and cursors as :class:`ReplayRing` at ``rec_indices`` ``[N]``. ``HR == 0``: the history's
    decayed keys ``[L, K]`` held while the tokens are worked on; else read ``HR`` records a step after them
    (:func:`window_history`; fewer registers, the ``count`` records present only). The history's total log-decay
    is summed first either way; coefficients agree to float32 rounding."""
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = i_n * T
    o_k = tl.arange(0, K)
    o_l = tl.arange(0, L)
    o_t = tl.arange(0, TP)
    p_A_log = A_log + i_hv
    if IS_KDA:
        p_dt_bias = dt_bias + i_hv * K + o_k
        p_a0 = a + bos * stride_a + i_hv * K + o_k
    else:
        p_dt_bias = dt_bias + i_hv
        p_a0 = a + bos * stride_a + i_hv
    p_b0 = b + bos * stride_b + i_hv
    _, r, valid, c, phase, _ = window_cursor(h0_indices, rec_indices, r_count, r_phase, i_n, T, L, FUSED_FOLD)
    rec0 = r * 2 * L + phase.to(tl.int64) * L

    m_l = o_l < c
    p_rec = rec0 + o_l
    if HR == 0:  # the history's keys, decayed to the end of the history, and its total log-decay Gc
        if IS_KDA:
            b_gh = tl.load(r_g + (p_rec[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_l[:, None], other=0)
            b_Gc = tl.sum(b_gh, 0)
            b_dec = tl.exp(b_Gc[None, :] - tl.cumsum(b_gh, 0))
        else:
            b_gh = tl.load(r_g + p_rec * HV + i_hv, mask=m_l, other=0)
            b_gsum = tl.sum(b_gh, 0)
            b_Gc = tl.zeros([K], dtype=tl.float32) + b_gsum
            b_dec = tl.exp(b_gsum - tl.cumsum(b_gh, 0))[:, None]
        b_kh = history_keys(r_kn, r_kraw, p_rec, m_l, i_h, o_k, H, K, RAW_KEYS)
        b_kh = tl.where(m_l[:, None], b_kh * b_dec, 0)
    else:  # the total log-decay alone: the history is read HR records at a time after the window
        b_Gc = tl.zeros([K], dtype=tl.float32)
        o_r = tl.arange(0, HR)
        for j0 in range(0, c, HR):  # a block's gates at a time, as window_history reads them again
            b_Gc += tl.sum(history_gates(r_g, rec0 + j0, o_r, c - j0, i_hv, o_k, HV, K, HR, IS_KDA), 0)
        b_kh = tl.zeros([TP, K], dtype=tl.float32)  # unused

    b_Gt = b_Gc
    b_Gw = tl.zeros([K], dtype=tl.float32)  # log-decay of the window so far
    b_kw = tl.zeros([TP, K], dtype=tl.float32)  # the window's normalised keys ...
    b_Gws = tl.zeros([TP, K], dtype=tl.float32)  # ... and log-decays, row j = token j
    b_qw = tl.zeros([TP, K], dtype=tl.float32)  # ... and scaled normalised queries (HR > 0)
    writes_k = i_hv % (HV // H) == 0
    for t in tl.static_range(TP):  # unrolled: every token's loads are issued up front
        b_Gt, b_Gw, b_kw, b_Gws, b_qw = window_token(
            t, t < T, b_Gt, b_Gw, b_kw, b_Gws, b_qw, b_kh, p_A_log, p_a0, p_dt_bias, p_b0, q, k, b, proj, r_kn,
            r_g, r_beta, r_kraw, bos, i_h, i_hv, rec0 + c, valid, writes_k, softplus_beta, softplus_threshold, scale,
            stride_a, stride_q, stride_k, stride_b, o_k, o_l, o_t, H, HV, K, L, TP, W, IS_KDA, BETA_ACTIVATED,
            ROUND_BETA, HR)
    if HR > 0:
        b_ew = tl.exp(b_Gws)
        window_history(b_ew * b_kw, b_ew * b_qw, b_Gc, proj, r_kn, r_kraw, r_g, rec0, c, bos, i_h, i_hv, T, o_k, o_l,
                       o_t, H, HV, K, L, TP, W, IS_KDA, RAW_KEYS, HR)


@triton.jit
def window_history(b_ek, b_eq, b_Gc, proj, r_kn, r_kraw, r_g, rec0, c, bos, i_h, i_hv, T, o_k, o_l, o_t,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, L: tl.constexpr, TP: tl.constexpr,
                   W: tl.constexpr, IS_KDA: tl.constexpr, RAW_KEYS: tl.constexpr, HR: tl.constexpr):
    """The history coefficients ``(k_j * e^{G_t - G_j}) . k_t`` and ``. q_t`` of a window program (``proj``
    columns ``2K + j`` and ``2K + L + j`` of each token's row; 0 for ``j >= c``), reading the ``c`` records from
    ring position ``rec0`` ``HR`` at a time (a loop of ``cdiv(c, HR)`` steps): only a ``[HR, K]`` block of keys
    and gates in registers beside the window's ``b_ek = e^{Gw_t} k_t``, ``b_eq = e^{Gw_t} q_t`` ``[TP, K]``
    (``Gw`` the window's log-decay; ``b_Gc`` ``[K]`` the history's total)."""
    m_t = o_t < T
    p_rows = proj + ((bos + o_t) * HV + i_hv) * W + 2 * K  # [TP]
    m_none = (o_l >= c)[:, None] & m_t[None, :]
    zero = tl.zeros([L, TP], dtype=tl.float32)
    tl.store(p_rows[None, :] + o_l[:, None], zero, mask=m_none)
    tl.store(p_rows[None, :] + L + o_l[:, None], zero, mask=m_none)
    o_r = tl.arange(0, HR)
    b_P = tl.zeros([K], dtype=tl.float32)  # log-decay of the records before the block
    for j0 in range(0, c, HR):
        b_g, b_kd = history_block(r_kn, r_kraw, r_g, rec0 + j0, o_r, c - j0, i_h, i_hv, o_k, H, HV, K, HR, IS_KDA,
                                  RAW_KEYS)
        o_j = j0 + o_r
        m_j = o_j < c
        b_G = b_P[None, :] + tl.cumsum(b_g, 0)  # G_j, from the checkpoint
        b_P += tl.sum(b_g, 0)
        b_kd = b_kd.to(tl.float32)
        if RAW_KEYS:
            b_kd = l2normalize_rows(b_kd)
        b_kd = tl.where(m_j[:, None], b_kd * tl.exp(b_Gc[None, :] - b_G), 0)
        for t in tl.static_range(TP):
            m_out = m_j & (t < T)
            b_e = tl.sum(tl.where(o_t[:, None] == t, b_ek, 0), 0)
            tl.store(proj + ((bos + t) * HV + i_hv) * W + 2 * K + o_j, tl.sum(b_kd * b_e[None, :], 1), mask=m_out)
            b_e = tl.sum(tl.where(o_t[:, None] == t, b_eq, 0), 0)
            tl.store(proj + ((bos + t) * HV + i_hv) * W + 2 * K + L + o_j, tl.sum(b_kd * b_e[None, :], 1),
                     mask=m_out)


@triton.jit
def history_block(r_kn, r_kraw, r_g, pos0, o_r, left, i_h, i_hv, o_k, H: tl.constexpr, HV: tl.constexpr,
                  K: tl.constexpr, HR: tl.constexpr, IS_KDA: tl.constexpr, RAW_KEYS: tl.constexpr):
    """The gates ``[HR, K]`` float32 (GDN's scalar broadcast) and keys ``[HR, K]`` of the ``HR`` records from ring
    position ``pos0`` (rows from ``left`` on: 0), as loaded: raw (``r_kraw``'s dtype) with ``RAW_KEYS``, else the
    stored normalised ones (float32)."""
    m_r = o_r < left
    p_k = ((pos0 + o_r)[:, None] * H + i_h) * K + o_k[None, :]
    if RAW_KEYS:
        b_k = tl.load(r_kraw + p_k, mask=m_r[:, None], other=0)
    else:
        b_k = tl.load(r_kn + p_k, mask=m_r[:, None], other=0)
    return history_gates(r_g, pos0, o_r, left, i_hv, o_k, HV, K, HR, IS_KDA), b_k


@triton.jit
def history_gates(r_g, pos0, o_r, left, i_hv, o_k, HV: tl.constexpr, K: tl.constexpr, HR: tl.constexpr,
                  IS_KDA: tl.constexpr):
    """The log-decays ``[HR, K]`` float32 of value head ``i_hv`` of the ``HR`` records from ring position ``pos0``
    (KDA's per channel, GDN's scalar broadcast; rows from ``left`` on: 0)."""
    m_r = o_r < left
    p_r = pos0 + o_r
    if IS_KDA:
        b_g = tl.load(r_g + (p_r[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_r[:, None], other=0)
    else:
        b_g = tl.zeros([HR, K], dtype=tl.float32) + tl.load(r_g + p_r * HV + i_hv, mask=m_r, other=0)[:, None]
    return b_g


@triton.jit
def window_key_head_program(i_nh, A_log, a, dt_bias, q, k, b, proj, h0_indices, r_kn, r_g, r_beta, r_kraw, r_count,
                            r_phase, rec_indices, softplus_beta, softplus_threshold, scale, T, stride_a, stride_q,
                            stride_k, stride_b, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, L: tl.constexpr,
                            TP: tl.constexpr, W: tl.constexpr, GP: tl.constexpr, BETA_ACTIVATED: tl.constexpr,
                            ROUND_BETA: tl.constexpr, FUSED_FOLD: tl.constexpr, RAW_KEYS: tl.constexpr):
    """GDN window program ``i_nh`` for request ``i_nh // H`` and key head ``i_nh % H``: what
    :func:`window_program` writes for each of the key head's ``G = HV // H`` value heads (``proj`` rows,
    g and beta records; normalised and raw k once), with the history's keys read once. GDN's gate is one
    scalar per value head, so every coefficient is a decay times a dot product of normalised keys (and
    queries) that all ``G`` value heads share: ``(k_j * e^{G_t - G_j}) . k_t = e^{G_t - G_j} (k_j . k_t)``,
    the dot products taken once per key head. ``GP`` the next power of two of ``G``. Records are
    :func:`window_program`'s bits; ``proj`` agrees to float32 rounding (another product order)."""
    G: tl.constexpr = HV // H
    i_n, i_h = i_nh // H, i_nh % H
    bos = i_n * T
    o_k = tl.arange(0, K)
    o_l = tl.arange(0, L)
    o_t = tl.arange(0, TP)
    o_g = tl.arange(0, GP)
    m_g = o_g < G
    i_hvs = i_h * G + tl.minimum(o_g, G - 1)  # the key head's value heads (a padding lane repeats the last)
    _, r, valid, c, phase, _ = window_cursor(h0_indices, rec_indices, r_count, r_phase, i_n, T, L, FUSED_FOLD)
    rec0 = r * 2 * L + phase.to(tl.int64) * L

    # the history's keys (once), each value head's decays to the end of the history and total log-decay
    m_l = o_l < c
    p_rec = rec0 + o_l
    b_kh = history_keys(r_kn, r_kraw, p_rec, m_l, i_h, o_k, H, K, RAW_KEYS)
    b_gh = tl.load(r_g + p_rec[None, :] * HV + i_hvs[:, None], mask=m_l[None, :], other=0)  # [GP, L]
    b_Gt = tl.sum(b_gh, 1)
    b_dec = tl.exp(b_Gt[:, None] - tl.cumsum(b_gh, 1))

    b_Gw = tl.zeros([GP], dtype=tl.float32)  # log-decay of the window so far, per value head
    b_kw = tl.zeros([TP, K], dtype=tl.float32)  # the window's normalised keys, row j = token j
    b_Gws = tl.zeros([GP, TP], dtype=tl.float32)  # ... and each value head's log-decays there
    writes = m_g & valid
    for t in tl.static_range(TP):  # unrolled: every token's loads are issued up front
        live = t < T
        t_in = tl.where(live, t, 0)  # a token past the window (unrolled to TP) reads token 0's inputs, stores nothing
        row = bos + t_in
        b_g = decay_gate(A_log + i_hvs, a + row * stride_a + i_hvs, dt_bias + i_hvs, m_g, softplus_beta,
                         softplus_threshold, False)
        b_beta = packed_beta(beta_gate(b + row * stride_b + i_hvs, BETA_ACTIVATED), b, ROUND_BETA)
        b_k_raw = tl.load(k + row * stride_k + i_h * K + o_k)
        b_k = l2normalize(b_k_raw.to(tl.float32))
        b_q = l2normalize(tl.load(q + row * stride_q + i_h * K + o_k).to(tl.float32)) * scale
        b_Gt += b_g
        b_Gw += b_g
        b_e = tl.exp(b_Gt)
        b_ew = tl.exp(b_Gw)
        b_wd = tl.exp(b_Gw[:, None] - b_Gws)  # [GP, TP] decays of the earlier window tokens
        p_rows = proj + ((bos + t) * HV + i_hvs) * W  # [GP]
        m_row = m_g & live
        tl.store(p_rows[:, None] + o_k[None, :], b_e[:, None] * b_k[None, :], mask=m_row[:, None])
        tl.store(p_rows[:, None] + K + o_k[None, :], b_e[:, None] * b_q[None, :], mask=m_row[:, None])
        b_hk = tl.sum(b_kh * b_k[None, :], 1)  # [L] history keys . k_t, shared by the value heads
        b_hq = tl.sum(b_kh * b_q[None, :], 1)
        tl.store(p_rows[:, None] + 2 * K + o_l[None, :], b_dec * b_ew[:, None] * b_hk[None, :], mask=m_row[:, None])
        tl.store(p_rows[:, None] + 2 * K + L + o_l[None, :], b_dec * b_ew[:, None] * b_hq[None, :],
                 mask=m_row[:, None])
        b_wk = tl.sum(b_kw * b_k[None, :], 1)  # [TP] window keys . k_t
        b_wq = tl.sum(b_kw * b_q[None, :], 1)
        earlier = (o_t < t)[None, :]
        tl.store(p_rows[:, None] + 2 * K + 2 * L + o_t[None, :], tl.where(earlier, b_wd * b_wk[None, :], 0),
                 mask=m_row[:, None])
        tl.store(p_rows[:, None] + 2 * K + 2 * L + TP + o_t[None, :],
                 tl.where(earlier, b_wd * b_wq[None, :], tl.where((o_t == t)[None, :], tl.sum(b_k * b_q), 0)),
                 mask=m_row[:, None])
        tl.store(p_rows + 2 * K + 2 * L + 2 * TP, b_beta, mask=m_row)
        pos = rec0 + c + t
        rec = live & valid
        tl.store(r_kn + (pos * H + i_h) * K + o_k, b_k, mask=(o_k < K) & rec)
        tl.store(r_kraw + (pos * H + i_h) * K + o_k, b_k_raw, mask=(o_k < K) & rec)
        tl.store(r_g + pos * HV + i_hvs, b_g, mask=writes & live)
        tl.store(r_beta + pos * HV + i_hvs, b_beta, mask=writes & live)
        b_kw = tl.where(o_t[:, None] == t, b_k[None, :], b_kw)
        b_Gws = tl.where(o_t[None, :] == t, b_Gw[:, None], b_Gws)


@triton.jit
def history_keys(r_kn, r_kraw, p_rec, m_l, i_h, o_k, H: tl.constexpr, K: tl.constexpr, RAW_KEYS: tl.constexpr):
    """The history's normalised keys ``[L, K]`` float32 of key head ``i_h`` at ring positions ``p_rec`` ``[L]``
    (rows where ``m_l`` is false: 0): as stored (``r_kn``, float32) or, with ``RAW_KEYS``, renormalised from the raw
    keys (``r_kraw``, activation dtype: half the bytes read for 2-byte activations;
    :func:`~..delta_rule_step.l2normalize_rows`) as :func:`~..delta_rule_step.l2normalize` normalised them when the
    record was written (the same values up to the order of the sum: float32 rounding)."""
    p_k = (p_rec[:, None] * H + i_h) * K + o_k[None, :]
    if RAW_KEYS:
        return l2normalize_rows(tl.load(r_kraw + p_k, mask=m_l[:, None], other=0).to(tl.float32))
    return tl.load(r_kn + p_k, mask=m_l[:, None], other=0)


@triton.jit
def window_token(t, live, b_Gt, b_Gw, b_kw, b_Gws, b_qw, b_kh, p_A_log, p_a0, p_dt_bias, p_b0, q, k, b, proj,
                 r_kn, r_g, r_beta, r_kraw, bos, i_h, i_hv, pos0, valid, writes_k, softplus_beta, softplus_threshold,
                 scale, stride_a, stride_q, stride_k, stride_b, o_k, o_l, o_t, H: tl.constexpr, HV: tl.constexpr,
                 K: tl.constexpr, L: tl.constexpr, TP: tl.constexpr, W: tl.constexpr, IS_KDA: tl.constexpr,
                 BETA_ACTIVATED: tl.constexpr, ROUND_BETA: tl.constexpr, HR: tl.constexpr):
    """Token t of the window launch (``live``: t < T): its gate, normalised key and query, projection row
    and key-side records; returns the running ``(G_t, Gw_t, window keys, window log-decays, window queries)``
    (``[TP, K]`` blocks, row t set; the queries only with ``HR > 0``, for :func:`window_history`). With ``HR == 0``
    the row's history coefficients come from the decayed history keys ``b_kh`` ``[L, K]``."""
    mask_k = (o_k < K) & live
    t_in = tl.where(live, t, 0)  # a token past the window (unrolled to TP) reads token 0's gate, stores nothing
    b_g, b_gv, b_beta = gate_vector(p_A_log, p_a0 + t_in * stride_a, p_dt_bias, p_b0 + t_in * stride_b, mask_k,
                                    softplus_beta, softplus_threshold, K, IS_KDA, BETA_ACTIVATED)
    b_beta = packed_beta(b_beta, b, ROUND_BETA)
    b_k_raw = tl.load(k + (bos + t) * stride_k + i_h * K + o_k, mask=mask_k, other=0)
    b_k = l2normalize(b_k_raw.to(tl.float32))
    b_q = l2normalize(tl.load(q + (bos + t) * stride_q + i_h * K + o_k, mask=mask_k, other=0).to(tl.float32)) * scale
    b_Gt += b_gv
    b_Gw += b_gv
    b_e = tl.exp(b_Gt)
    b_ew = tl.exp(b_Gw)
    b_kd = b_kw * tl.exp(b_Gw[None, :] - b_Gws)
    p_row = proj + ((bos + t) * HV + i_hv) * W
    tl.store(p_row + o_k, b_e * b_k, mask=mask_k)
    tl.store(p_row + K + o_k, b_e * b_q, mask=mask_k)
    if HR == 0:
        tl.store(p_row + 2 * K + o_l, tl.sum(b_kh * (b_ew * b_k)[None, :], 1), mask=live)
        tl.store(p_row + 2 * K + L + o_l, tl.sum(b_kh * (b_ew * b_q)[None, :], 1), mask=live)
    else:
        b_qw = tl.where(o_t[:, None] == t, b_q[None, :], b_qw)
    tl.store(p_row + 2 * K + 2 * L + o_t, tl.where(o_t < t, tl.sum(b_kd * b_k[None, :], 1), 0), mask=live)
    tl.store(p_row + 2 * K + 2 * L + TP + o_t,
             tl.where(o_t < t, tl.sum(b_kd * b_q[None, :], 1), tl.where(o_t == t, tl.sum(b_k * b_q), 0)), mask=live)
    tl.store(p_row + 2 * K + 2 * L + 2 * TP, b_beta, mask=live)
    pos = pos0 + t
    rec = live & valid
    tl.store(r_kn + (pos * H + i_h) * K + o_k, b_k, mask=mask_k & rec & writes_k)
    store_key_record(r_kraw, r_g, r_beta, pos, i_h, i_hv, rec & writes_k, rec, o_k, mask_k, b_k_raw, b_g, b_beta, H, HV,
                     K, IS_KDA)
    return (b_Gt, b_Gw, tl.where(o_t[:, None] == t, b_k[None, :], b_kw),
            tl.where(o_t[:, None] == t, b_Gw[None, :], b_Gws), b_qw)


@triton.jit(do_not_specialize=["N", "T"])
def fold_order_kernel(h0_indices, rec_indices, r_count, order, N, T, L: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(1,)``: :func:`fold_order_program` as a launch of its own (before a one-launch verify; the
    two-launch verify runs it inside its window launch)."""
    fold_order_program(h0_indices, rec_indices, r_count, order, N, T, L, BLOCK)


@triton.jit
def fold_order_program(h0_indices, rec_indices, r_count, order, N, T, L: tl.constexpr, BLOCK: tl.constexpr):
    """``order`` ``[N]`` int32, a permutation of the requests with those whose window would
    overflow their history (``count + T > L``, as :func:`window_cursor` decides a fused fold) first, in
    request order, and the others after them, from the back. The output launch then starts its longest
    programs — those that fold — in its first wave instead of leaving them as its tail. Deterministic
    (scans, no atomics); one program walks the batch ``BLOCK`` requests at a time."""
    folds_before = 0
    rest_before = 0
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < N
        idx = tl.load(h0_indices + offs, mask=m, other=-1)
        r = tl.load(rec_indices + offs, mask=m, other=-1)
        valid = m & (idx >= 0) & (r >= 0)
        c = tl.load(r_count + tl.maximum(r, 0).to(tl.int64), mask=valid, other=0)
        f = (valid & window_overflows(c, T, L)).to(tl.int32)
        rest = m.to(tl.int32) - f
        tl.store(order + folds_before + tl.cumsum(f, 0) - f, offs, mask=f > 0)
        tl.store(order + N - 1 - (rest_before + tl.cumsum(rest, 0) - rest), offs, mask=rest > 0)
        folds_before += tl.sum(f, 0)
        rest_before += tl.sum(rest, 0)


@triton.jit(do_not_specialize=["T"])
def replay_output_kernel(
    v, o, proj, h0_source, h0_indices,
    r_u, r_g, r_beta, r_kraw, r_vraw, r_count, r_phase, r_faults, rec_indices, order, T, stride_v,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    FBV: tl.constexpr, L: tl.constexpr, TP: tl.constexpr, W: tl.constexpr, NP: tl.constexpr, IS_KDA: tl.constexpr,
    FUSED_FOLD: tl.constexpr, DOT: tl.constexpr, FOLD_FIRST: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``, after :func:`replay_window_kernel` filled ``proj``: the V-side of
    the window (``v`` ``[1, N*T, HV, V]``, ``o`` like v). ``h0_source`` ``[slots, HV, V, K]``: checkpoints at
    ``h0_indices`` ``[N]``; a program reads its ``[K, BV]`` columns once, ``[BK, BV]`` at a time in a loop
    the compiler pipelines (``num_stages``), projecting each K tile onto the window's ``e^{G_t} k_t`` and
    ``e^{G_t} q_t`` (tensor cores with ``DOT``). A row with a negative slot or record index (padding) reads
    no history and writes nothing but its outputs.

    ``FUSED_FOLD``: a request whose window would overflow (``count + T > L``) first has its history
    replayed into its checkpoint columns, ``FBV`` at a time (:func:`fold_columns`), stored, and read back
    by the loop (``FBV``: ``replay_verify``'s ``fold_block_v``, :func:`~.served.served_fold_block_v`); it continues
    with an empty history in the ring's other half. Per token t:
    ``u_t = beta_t (v_t - S0 . (e^{G_t} k_t) - sum_j c^k_{tj} u_j)``, ``o_t = S0 . (e^{G_t} q_t) +
    sum_{j<=t} c^q_{tj} u_j``; ``u_t`` and raw ``v_t`` go to ring position ``phase * L + count + t``.
    ``FOLD_FIRST``: the programs of request ``order[i]`` come i-th (the window launch's order program).

    ``PDL`` (launched as a programmatic dependent of the window launch): the program starts while the window
    launch still runs and waits for it (``griddepcontrol.wait``) before the first read of anything that launch
    writes — ``proj`` and, with ``FOLD_FIRST``, ``order``; without ``FOLD_FIRST`` its cursor, fused fold and
    history ``u`` (none of them written by the window launch) come before the wait."""
    o_bk = tl.arange(0, BK)
    o_l = tl.arange(0, L)
    o_t = tl.arange(0, TP)
    if PDL and FOLD_FIRST:
        tl.extra.cuda.gdc_wait()
    i_v, bos, i_hv, i_h, o_v, mask_v, idx, valid, c, p_h0, rec0 = output_program(
        h0_source, h0_indices, r_kraw, r_vraw, r_g, r_beta, r_count, r_phase, r_faults, rec_indices, order, T, H, HV,
        K, V, BV, FBV, L, IS_KDA, FUSED_FOLD, FOLD_FIRST)

    b_uh = tl.load(r_u + ((rec0 + o_l[:, None]) * HV + i_hv) * V + o_v[None, :],
                   mask=(o_l < c)[:, None] & mask_v[None, :], other=0)
    if PDL and not FOLD_FIRST:
        tl.extra.cuda.gdc_wait()
    # the checkpoint's projections: [BV, NP] (DOT; columns ke_0.., qe_0..) or [TP, BV] rows per token
    o_p = tl.arange(0, NP)
    tok = tl.where(o_p < TP, o_p, o_p - TP)
    m_p = (o_p < 2 * TP) & (tok < T)
    p_prow = proj + ((bos + tok)[:, None] * HV + i_hv) * W + tl.where(o_p < TP, 0, K)[:, None]
    b_sp = tl.zeros([BV, NP], dtype=tl.float32)
    b_sk = tl.zeros([TP, BV], dtype=tl.float32)
    b_sq = tl.zeros([TP, BV], dtype=tl.float32)
    m_h = mask_v[None, :] & (idx >= 0)
    for kk in range(0, K // BK):
        o_k = kk * BK + o_bk
        b_s0 = tl.load(p_h0 + o_v[None, :] * K + o_k[:, None], mask=m_h, other=0).to(tl.float32)
        if DOT:  # [BV, BK] x [BK, NP] on tensor cores
            b_p = tl.load(p_prow + o_k[None, :], mask=m_p[:, None], other=0)
            b_sp = tl.dot(tl.trans(b_s0), tl.trans(b_p), acc=b_sp, input_precision="tf32x3")
        else:
            for t in tl.static_range(TP):
                p_row = proj + ((bos + t) * HV + i_hv) * W
                b_ke = tl.load(p_row + o_k, mask=t < T, other=0)
                b_qe = tl.load(p_row + K + o_k, mask=t < T, other=0)
                b_sk = tl.where(o_t[:, None] == t, b_sk + tl.sum(b_s0 * b_ke[:, None], 0)[None, :], b_sk)
                b_sq = tl.where(o_t[:, None] == t, b_sq + tl.sum(b_s0 * b_qe[:, None], 0)[None, :], b_sq)
    b_uw = tl.zeros([TP, BV], dtype=tl.float32)  # the window's u so far, row j = token j
    for t in tl.static_range(TP):  # unrolled: every token's loads are issued up front
        if DOT:
            s0k = tl.sum(tl.where(o_p[None, :] == t, b_sp, 0), 1)
            s0q = tl.sum(tl.where(o_p[None, :] == TP + t, b_sp, 0), 1)
        else:
            s0k = tl.sum(tl.where(o_t[:, None] == t, b_sk, 0), 0)
            s0q = tl.sum(tl.where(o_t[:, None] == t, b_sq, 0), 0)
        live = t < T
        p_row = proj + ((bos + t) * HV + i_hv) * W  # the window launch's coefficients of token t
        b_uw = output_token(t, live, s0k, s0q, tl.load(p_row + 2 * K + o_l, mask=live, other=0),
                            tl.load(p_row + 2 * K + L + o_l, mask=live, other=0),
                            tl.load(p_row + 2 * K + 2 * L + o_t, mask=live, other=0),
                            tl.load(p_row + 2 * K + 2 * L + TP + o_t, mask=live, other=0),
                            tl.load(p_row + 2 * K + 2 * L + TP + t, mask=live, other=0),
                            tl.load(p_row + 2 * K + 2 * L + 2 * TP, mask=live, other=0), b_uh, b_uw, v, o, r_u, r_vraw,
                            bos, i_hv, rec0 + c, valid, stride_v, o_v, o_t, mask_v, HV, V)


@triton.jit(do_not_specialize=["T"])
def replay_step_kernel(
    A_log, a, dt_bias, q, k, v, b, o, h0_source, h0_indices,
    r_u, r_kn, r_g, r_beta, r_kraw, r_vraw, r_count, r_phase, r_faults, rec_indices, order,
    softplus_beta, softplus_threshold, scale, T, stride_a, stride_q, stride_k, stride_v, stride_b,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    FBV: tl.constexpr, L: tl.constexpr, TP: tl.constexpr, NP: tl.constexpr, IS_KDA: tl.constexpr,
    BETA_ACTIVATED: tl.constexpr, ROUND_BETA: tl.constexpr, FUSED_FOLD: tl.constexpr, DOT: tl.constexpr,
    FOLD_FIRST: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``: the whole window in one launch — :func:`replay_window_kernel`'s K-side
    work done by every output program for itself, tile by tile inside its checkpoint loop, so no ``proj``
    scratch and no second launch. Inputs as the two launches (``q, k`` ``[1, N*T, H, K]``, ``v``, ``o``
    ``[1, N*T, HV, V]``, ``a`` ``[N*T, HV(*K)]``, ``b`` ``[1, N*T, HV]``; checkpoints ``[slots, HV, V, K]`` at
    ``h0_indices``; ring at ``rec_indices``), same fused fold and fold-first order. Per ``[BK]`` K tile a
    program reads its checkpoint rows ``[BK, BV]``, the history's normalised keys ``[L, BK]`` (KDA: and gates)
    and the window's raw q, k, and accumulates the checkpoint projections (``DOT``: one ``tl.dot`` per tile)
    and the history and window coefficients (``[TP, L]``, ``[TP, TP]``); the program of the first column tile
    appends the window's key-side records (normalised and raw k once per key head, g, beta). The history's
    keys are read once per column tile (``V / BV`` times per head) instead of once per head."""
    i_v, bos, i_hv, i_h, o_v, mask_v, idx, valid, c, p_h0, rec0 = output_program(
        h0_source, h0_indices, r_kraw, r_vraw, r_g, r_beta, r_count, r_phase, r_faults, rec_indices, order, T, H, HV,
        K, V, BV, FBV, L, IS_KDA, FUSED_FOLD, FOLD_FIRST)
    o_bk = tl.arange(0, BK)
    o_K = tl.arange(0, K)
    o_l = tl.arange(0, L)
    o_t = tl.arange(0, TP)

    # per window token: the L2 norms of q and k (over the whole K), beta and (GDN) the gate
    p_A_log = A_log + i_hv
    b_kden = tl.zeros([TP], dtype=tl.float32) + 1.0
    b_qden = tl.zeros([TP], dtype=tl.float32) + 1.0
    b_gw = tl.zeros([TP], dtype=tl.float32)
    b_betaw = tl.zeros([TP], dtype=tl.float32)
    for t in tl.static_range(TP):
        live = t < T
        t_in = tl.where(live, t, 0)  # a token past the window (unrolled to TP) reads token 0's inputs
        b_kr = tl.load(k + (bos + t_in) * stride_k + i_h * K + o_K).to(tl.float32)
        b_qr = tl.load(q + (bos + t_in) * stride_q + i_h * K + o_K).to(tl.float32)
        b_kden = tl.where(o_t == t, tl.sqrt(tl.sum(b_kr * b_kr) + 1e-6), b_kden)
        b_qden = tl.where(o_t == t, tl.sqrt(tl.sum(b_qr * b_qr) + 1e-6), b_qden)
        if not IS_KDA:
            b_gw = tl.where(o_t == t, token_gate(p_A_log, a + (bos + t_in) * stride_a, dt_bias, i_hv, o_bk,
                                                 softplus_beta, softplus_threshold, K, IS_KDA), b_gw)
        b_beta = packed_beta(beta_gate(b + (bos + t_in) * stride_b + i_hv, BETA_ACTIVATED), b, ROUND_BETA)
        b_betaw = tl.where(o_t == t, b_beta, b_betaw)
    # the history's gates: GDN's decays to the end of the history (KDA's are per K row: in the loop)
    m_l = o_l < c
    p_rec = rec0 + o_l
    b_gsum = 0.0
    b_dec = tl.zeros([L], dtype=tl.float32)
    if not IS_KDA:
        b_gh = tl.load(r_g + p_rec * HV + i_hv, mask=m_l, other=0)
        b_gsum = tl.sum(b_gh, 0)
        b_dec = tl.exp(b_gsum - tl.cumsum(b_gh, 0))
    b_uh = tl.load(r_u + ((rec0 + o_l[:, None]) * HV + i_hv) * V + o_v[None, :],
                   mask=m_l[:, None] & mask_v[None, :], other=0)

    o_p = tl.arange(0, NP)
    b_sp = tl.zeros([BV, NP], dtype=tl.float32)
    b_sk = tl.zeros([TP, BV], dtype=tl.float32)
    b_sq = tl.zeros([TP, BV], dtype=tl.float32)
    b_chk = tl.zeros([TP, L], dtype=tl.float32)  # history coefficients, row t = token t
    b_chq = tl.zeros([TP, L], dtype=tl.float32)
    b_cwk = tl.zeros([TP, TP], dtype=tl.float32)  # window coefficients, row t = token t, column j = token j
    b_cwq = tl.zeros([TP, TP], dtype=tl.float32)
    m_h = mask_v[None, :] & (idx >= 0)
    writes_gate = valid & (i_v == 0)
    writes_k = writes_gate & (i_hv % (HV // H) == 0)
    pos0 = rec0 + c
    for kk in range(0, K // BK):
        o_k = kk * BK + o_bk
        b_s0 = tl.load(p_h0 + o_v[None, :] * K + o_k[:, None], mask=m_h, other=0).to(tl.float32)
        b_kh = tl.load(r_kn + (p_rec[:, None] * H + i_h) * K + o_k[None, :], mask=m_l[:, None], other=0)
        if IS_KDA:
            b_gh = tl.load(r_g + (p_rec[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_l[:, None], other=0)
            b_Gt = tl.sum(b_gh, 0)
            b_kh = tl.where(m_l[:, None], b_kh * tl.exp(b_Gt[None, :] - tl.cumsum(b_gh, 0)), 0)
        else:
            b_Gt = tl.zeros([BK], dtype=tl.float32) + b_gsum
            b_kh = tl.where(m_l[:, None], b_kh * b_dec[:, None], 0)
        b_Gw = tl.zeros([BK], dtype=tl.float32)  # log-decay of the window so far
        b_kw = tl.zeros([TP, BK], dtype=tl.float32)  # the window's normalised keys ...
        b_Gws = tl.zeros([TP, BK], dtype=tl.float32)  # ... and log-decays, row j = token j
        b_p = tl.zeros([NP, BK], dtype=tl.float32)
        for t in tl.static_range(TP):  # unrolled: every token's loads are issued up front
            live = t < T
            t_in = tl.where(live, t, 0)
            b_k_raw = tl.load(k + (bos + t_in) * stride_k + i_h * K + o_k)
            b_kn = b_k_raw.to(tl.float32) / tl.sum(tl.where(o_t == t, b_kden, 0))
            b_qn = tl.load(q + (bos + t_in) * stride_q + i_h * K + o_k).to(tl.float32) \
                / tl.sum(tl.where(o_t == t, b_qden, 0)) * scale
            if IS_KDA:
                b_gv = token_gate(p_A_log, a + (bos + t_in) * stride_a, dt_bias, i_hv, o_k, softplus_beta,
                                  softplus_threshold, K, IS_KDA)
            else:
                b_gv = tl.sum(tl.where(o_t == t, b_gw, 0))
            b_Gt += b_gv
            b_Gw += b_gv
            b_e = tl.exp(b_Gt)
            b_ew = tl.exp(b_Gw)
            if DOT:
                b_p = tl.where(o_p[:, None] == t, (b_e * b_kn)[None, :],
                               tl.where(o_p[:, None] == TP + t, (b_e * b_qn)[None, :], b_p))
            else:
                b_sk = tl.where(o_t[:, None] == t, b_sk + tl.sum(b_s0 * (b_e * b_kn)[:, None], 0)[None, :], b_sk)
                b_sq = tl.where(o_t[:, None] == t, b_sq + tl.sum(b_s0 * (b_e * b_qn)[:, None], 0)[None, :], b_sq)
            row = o_t[:, None] == t
            b_chk += tl.where(row, tl.sum(b_kh * (b_ew * b_kn)[None, :], 1)[None, :], 0)
            b_chq += tl.where(row, tl.sum(b_kh * (b_ew * b_qn)[None, :], 1)[None, :], 0)
            b_kd = b_kw * tl.exp(b_Gw[None, :] - b_Gws)
            b_cwk += tl.where(row & (o_t[None, :] < t), tl.sum(b_kd * b_kn[None, :], 1)[None, :], 0)
            b_cwq += tl.where(row, tl.where(o_t < t, tl.sum(b_kd * b_qn[None, :], 1),
                                            tl.where(o_t == t, tl.sum(b_kn * b_qn), 0))[None, :], 0)
            b_kw = tl.where(row, b_kn[None, :], b_kw)
            b_Gws = tl.where(row, b_Gw[None, :], b_Gws)
            pos = pos0 + t
            rec_k = (pos * H + i_h) * K + o_k
            tl.store(r_kn + rec_k, b_kn, mask=writes_k & live)
            tl.store(r_kraw + rec_k, b_k_raw, mask=writes_k & live)
            if IS_KDA:
                tl.store(r_g + (pos * HV + i_hv) * K + o_k, b_gv, mask=writes_gate & live)
        if DOT:  # [BV, BK] x [BK, NP] on tensor cores
            b_sp = tl.dot(tl.trans(b_s0), tl.trans(b_p), acc=b_sp, input_precision="tf32x3")

    b_uw = tl.zeros([TP, BV], dtype=tl.float32)  # the window's u so far, row j = token j
    for t in tl.static_range(TP):
        live = t < T
        row = o_t[:, None] == t
        if DOT:
            s0k = tl.sum(tl.where(o_p[None, :] == t, b_sp, 0), 1)
            s0q = tl.sum(tl.where(o_p[None, :] == TP + t, b_sp, 0), 1)
        else:
            s0k = tl.sum(tl.where(row, b_sk, 0), 0)
            s0q = tl.sum(tl.where(row, b_sq, 0), 0)
        b_beta = tl.sum(tl.where(o_t == t, b_betaw, 0))
        pos = pos0 + t
        if not IS_KDA:
            tl.store(r_g + pos * HV + i_hv, tl.sum(tl.where(o_t == t, b_gw, 0)), mask=writes_gate & live)
        tl.store(r_beta + pos * HV + i_hv, b_beta, mask=writes_gate & live)
        b_kq = tl.sum(tl.sum(tl.where(row & (o_t[None, :] == t), b_cwq, 0), 1), 0)
        b_uw = output_token(t, live, s0k, s0q, tl.sum(tl.where(row, b_chk, 0), 0), tl.sum(tl.where(row, b_chq, 0), 0),
                            tl.sum(tl.where(row, b_cwk, 0), 0), tl.sum(tl.where(row, b_cwq, 0), 0), b_kq, b_beta,
                            b_uh, b_uw, v, o, r_u, r_vraw, bos, i_hv, pos0, valid, stride_v, o_v, o_t, mask_v, HV, V)


@triton.jit
def fold_columns(p_h0, r_kraw, r_vraw, r_g, r_beta, r_count, r_faults, r, pos0, i_h, i_hv, i_v, H: tl.constexpr,
                 HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, FBV: tl.constexpr,
                 IS_KDA: tl.constexpr):
    """The fused fold of one output program: its ``BV`` checkpoint columns at ``p_h0`` (``[V, K]``, one
    request and value head) advanced over the ``count`` records of ring slot ``r`` from ``pos0``, ``FBV``
    full-K columns at a time (value columns evolve independently; a ``[K, FBV]`` float32 tile is what the
    registers hold), each rounded once, stored, and checked (:func:`~.ring.flag_nonfinite`)."""
    o_k = tl.arange(0, K)
    mask_k = o_k < K
    n_rec = tl.load(r_count + r)
    for j in range(0, BV // FBV):
        o_vf = i_v * BV + j * FBV + tl.arange(0, FBV)
        mask_vf = o_vf < V
        p_tile = p_h0 + o_vf[None, :] * K + o_k[:, None]
        m_tile = mask_k[:, None] & mask_vf[None, :]
        b_h = tl.load(p_tile, mask=m_tile, other=0).to(tl.float32)
        b_h = apply_records(b_h, r_kraw, r_vraw, r_g, r_beta, pos0, n_rec, i_h, i_hv, o_k, o_vf, mask_k, mask_vf,
                            H, HV, K, V, IS_KDA)
        b_out = b_h.to(p_tile.dtype.element_ty)
        tl.store(p_tile, b_out, mask=m_tile)
        flag_nonfinite(r_faults, r, b_out.to(tl.float32))


@triton.jit
def output_token(t, live, s0k, s0q, b_chk, b_chq, b_cwk, b_cwq, b_kq, b_beta, b_uh, b_uw, v, o, r_u, r_vraw, bos, i_hv,
                 pos0, valid, stride_v, o_v, o_t, mask_v, HV: tl.constexpr, V: tl.constexpr):
    """Token t of the window's value side (``live``: t < T): its ``u`` and output from the checkpoint's
    projections ``s0k = S0 . (e^{G_t} k_t)``, ``s0q = S0 . (e^{G_t} q_t)`` (``[BV]``), its coefficients on the
    history (``b_chk``, ``b_chq`` ``[L]``) and on the window (``b_cwk``, ``b_cwq`` ``[TP]``; ``b_kq = k_t . q_t``),
    the history's ``b_uh`` and the window's ``b_uw``; stores the output and (real rows) the ``u`` and raw ``v``
    records; returns ``b_uw`` with row t set."""
    b_v_raw = tl.load(v + (bos + t) * stride_v + i_hv * V + o_v, mask=mask_v & live, other=0)
    acc_k = tl.sum(b_uh * b_chk[:, None], 0) + tl.sum(b_uw * b_cwk[:, None], 0)
    acc_q = tl.sum(b_uh * b_chq[:, None], 0) + tl.sum(b_uw * b_cwq[:, None], 0)  # row t of b_uw is still 0
    b_u = b_beta * (b_v_raw.to(tl.float32) - s0k - acc_k)
    b_o = s0q + acc_q + b_u * b_kq
    tl.store(o + ((bos + t) * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v & live)
    pos = pos0 + t
    tl.store(r_u + (pos * HV + i_hv) * V + o_v, b_u, mask=mask_v & live & valid)
    tl.store(r_vraw + (pos * HV + i_hv) * V + o_v, b_v_raw, mask=mask_v & live & valid)
    return tl.where(o_t[:, None] == t, b_u[None, :], b_uw)


def pdl_available(device: torch.device | str) -> bool:
    """Whether launches on ``device`` can overlap by programmatic dependent launch (CUDA, compute capability
    9.0 or newer, not the Triton interpreter)."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def replay_verify(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, b: torch.Tensor, checkpoints: torch.Tensor, state_indices: torch.Tensor,
                  ring: ReplayRing, record_indices: torch.Tensor, *, is_kda: bool, beta_activated: bool = False,
                  scale: float | None = None, round_beta: bool = False, fused_fold: bool = True,
                  fold_first: bool | None = None, block_v: int | None = None, num_warps: int | None = None,
                  block_k: int | None = None, num_stages: int | None = None, window_warps: int | None = None,
                  dot: bool | None = None, launches: int | None = None, pdl: bool | None = None,
                  window_key_heads: bool | None = None, window_raw_keys: bool | None = None,
                  fold_block_v: int | None = None, window_history_rows: int | None = None) -> torch.Tensor:
    """Output-only decode (T = 1) or chain verify (T = D) of ``N = len(state_indices)`` requests with
    ``T_all / N`` tokens each; inputs as SGLang's ``fused_sigmoid_gating_delta_rule_update``. ``launches`` 2:
    :func:`replay_window_kernel`, then :func:`replay_output_kernel`, and one float32 scratch tensor of
    ``T_all * HV * (2K + 2L + 2TP + 1)`` floats; 1: :func:`replay_step_kernel` alone (default:
    :func:`~.served.served_launches`).

    ``fused_fold`` (default): requests whose window would overflow the history (``count + T > L``)
    are folded inside the output launch; the caller then settles the cursor with
    ``advance(ring, record_indices, accepted, window=T)`` — whatever the batch's fold pattern. Otherwise
    the caller folds first (:func:`~.ring.fold_needed`, :func:`~.fold.fold_into_checkpoints`).
    ``fold_first`` (with ``fused_fold``; default: from :data:`~.served.FOLD_FIRST_MIN_REQUESTS` requests on): the
    output launch runs the folding requests' programs first (in two launches the window launch's
    :func:`fold_order_program`; in one, :func:`fold_order_kernel` before it). ``pdl`` (two launches, where
    :func:`pdl_available`; default :data:`~.served.SERVED_PDL`): the output launch is a programmatic dependent of the
    window launch and starts while it runs (:func:`replay_output_kernel`).
    ``round_beta`` rounds sigmoid(b) to b's dtype, as SGLang 0.5.14's GDN packed decode kernel does (so a
    replay decode, once folded, is what that kernel leaves). ``block_v`` (a power of two: V columns per
    program) and ``num_warps`` tile the output launch, ``block_k`` (a power of two dividing K: checkpoint rows
    per loop step) and ``num_stages`` pipeline its checkpoint reads (each left None:
    :func:`~.served.output_tiling`'s choice for the launch; a history the bounds were not measured at needs all
    four), ``window_warps`` tiles the window launch (default: :func:`~.served.served_window_warps`); ``dot``
    projects the checkpoint tile on tensor cores (tf32x3; default for T > 1, needs ``block_v >= 16`` and
    ``block_k >= 16``) or on CUDA cores. ``window_key_heads`` (GDN, two launches): one window program per request
    and key head (:func:`window_key_head_program`: the history's keys read and dotted once for the key head's value
    heads) or one per value head (default: :func:`~.served.served_window_key_heads`). ``window_raw_keys`` (two
    launches): the window launch renormalises the history's raw keys instead of reading the stored normalised ones
    (:func:`history_keys`; the ring's raw keys in ``k``'s dtype or float32; default
    :func:`~.served.served_window_raw_keys` where the ring holds them so, else the normalised keys).
    ``fold_block_v`` (a power of two from ``num_warps`` to the output tile's columns): the value columns a fused fold
    advances at a time (default :func:`~.served.served_fold_block_v`). ``window_history_rows`` (two launches, a
    window program per value head; 0 or a power of two up to L): the history records a window program reads a step
    after the window's tokens (:func:`window_history`), or 0, the whole history held beside them (default
    :func:`~.served.served_window_history_rows`).
    Checkpoints and every record but ``u`` are the same bits for every choice of one warp (``num_warps`` 1, as
    served; several warps: within a unit in the last place, :data:`~.served.FOLD_WARP_COLUMNS`); outputs and ``u``
    agree to float32 rounding. A padding row is negative in ``state_indices`` and in ``record_indices`` (serving
    passes one tensor for both): the kernels skip a row negative in either, the cursor functions
    (:func:`~.ring.advance`, :func:`~.ring.fold_needed`) see record slots only. Returns ``o`` ``[1, T_all, HV, V]``.
    """
    _, t_all, hk, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    n = state_indices.shape[0]
    if n == 0 or t_all % n:
        raise ValueError(f"{t_all} tokens do not split evenly over {n} requests")
    T = t_all // n
    if T > ring.history:
        raise ValueError(f"a window of {T} tokens does not fit a replay history of {ring.history}: L >= D needed")
    tiling = (block_v, num_warps, block_k, num_stages)
    served = output_tiling(n, T, is_kda, ring.history, checkpoints.dtype) if None in tiling else tiling
    bv = served[0] if block_v is None else block_v
    warps = served[1] if num_warps is None else num_warps
    stages = served[3] if num_stages is None else num_stages
    if bv < 1 or bv & (bv - 1):
        raise ValueError(f"block_v {bv} must be a power of two")
    if warps not in (1, 2, 4, 8) or stages < 1:
        raise ValueError(f"num_warps {warps} must be 1, 2, 4 or 8 and num_stages {stages} at least 1")
    if triton.next_power_of_2(kdim) != kdim:
        raise ValueError(f"head_k_dim {kdim} must be a power of two")
    BV = min(triton.next_power_of_2(vdim), bv)
    BK = min(served[2] or kdim, kdim) if block_k is None else block_k  # the default fits any K
    if BK < 1 or BK & (BK - 1) or BK > kdim:
        raise ValueError(f"block_k {BK} must be a power of two no larger than head_k_dim {kdim}")
    dot = T > 1 if dot is None else dot
    if dot and BV < 16:
        raise ValueError(f"block_v {BV}: the tensor-core projections need at least 16 columns per program; "
                         "pass block_v >= 16 or dot=False")
    if dot and BK < 16:
        raise ValueError(f"block_k {BK}: the tensor-core projections need at least 16 rows per loop step; "
                         + ("pass dot=False (head_k_dim < 16)" if kdim < 16 else "pass block_k >= 16 or dot=False"))
    launches = served_launches(t_all, is_kda, ring.history) if launches is None else launches
    if launches not in (1, 2):
        raise ValueError(f"launches {launches} must be 1 (one launch) or 2 (window, then output)")
    L, TP = ring.history, triton.next_power_of_2(T)
    scale = kdim ** -0.5 if scale is None else scale
    fold_first = fused_fold and (n >= FOLD_FIRST_MIN_REQUESTS if fold_first is None else fold_first)
    pdl = SERVED_PDL if pdl is None else pdl
    if pdl and not pdl_available(q.device):
        raise ValueError("pdl: programmatic dependent launch needs a CUDA device of compute capability 9.0 or "
                         "newer (and no TRITON_INTERPRET); pass pdl=False or leave it None")
    window_key_heads = served_window_key_heads(is_kda, launches) if window_key_heads is None else window_key_heads
    if window_key_heads and (is_kda or launches != 2):
        raise ValueError("window_key_heads: one window program per key head serves GDN's two launches only (KDA's "
                         "gates are per channel and value head); pass window_key_heads=False")
    exact_raw_keys = ring.k_raw.dtype in (k.dtype, torch.float32)  # the ring holds the window's keys unrounded
    if window_raw_keys is None:
        window_raw_keys = served_window_raw_keys(launches, is_kda, L, T) and exact_raw_keys
    if window_raw_keys and launches != 2:
        raise ValueError("window_raw_keys: the window launch of two reads the history's raw keys; the one-launch "
                         "kernel reads the stored normalised ones (pass launches=2 or window_raw_keys=False)")
    if window_raw_keys and not exact_raw_keys:
        raise ValueError(f"window_raw_keys: keys of {k.dtype} rounded into a ring of {ring.k_raw.dtype} would not "
                         "renormalise to the keys the window used; allocate the ring in the activation dtype or "
                         "float32, or pass window_raw_keys=False")
    history_rows = (served_window_history_rows(launches, is_kda, L, T) if window_history_rows is None
                    else window_history_rows)
    if history_rows < 0 or history_rows & (history_rows - 1) or history_rows > L:
        raise ValueError(f"window_history_rows {history_rows} must be 0 (the history held whole) or a power of two "
                         f"no larger than the history's {L} records")
    if history_rows and (launches != 2 or window_key_heads):
        raise ValueError("window_history_rows: a window program per value head of two launches reads the history a "
                         "block at a time (the key-head and one-launch programs hold it whole); pass "
                         "window_history_rows=0")
    window_warps = served_window_warps(L, T, history_rows) if window_warps is None else window_warps
    if window_warps not in (1, 2, 4, 8):
        raise ValueError(f"window_warps {window_warps} must be 1, 2, 4 or 8")
    order = torch.empty(n, dtype=torch.int32, device=q.device) if fold_first else None
    o = q.new_empty(1, t_all, hv, vdim)
    fbv = (served_fold_block_v(BV, warps, T, is_kda, L, checkpoints.dtype) if fold_block_v is None
           else fold_block_v)
    if fold_block_v is not None and (fbv < warps or fbv & (fbv - 1) or fbv > BV):
        raise ValueError(f"fold_block_v {fbv} must be a power of two from num_warps ({warps}) to the output tile's "
                         f"{BV} columns")
    if launches == 1:
        if fold_first:
            fold_order_kernel[(1,)](state_indices, record_indices, ring.count, order, n, T, L=L, BLOCK=256)
        replay_step_kernel[(triton.cdiv(vdim, BV), n * hv)](
            A_log, a, dt_bias, q, k, v, b, o, checkpoints, state_indices,
            ring.u, ring.k_norm, ring.g, ring.beta, ring.k_raw, ring.v_raw, ring.count, ring.phase, ring.faults,
            record_indices, order, 1.0, 20.0, scale, T, a.stride()[-2], q.stride()[1], k.stride()[1], v.stride()[1],
            b.stride()[-2],
            H=hk, HV=hv, K=kdim, V=vdim, BV=BV, BK=BK, FBV=fbv, L=L, TP=TP, NP=max(16, 2 * TP), IS_KDA=is_kda,
            BETA_ACTIVATED=beta_activated, ROUND_BETA=round_beta, FUSED_FOLD=fused_fold, DOT=dot,
            FOLD_FIRST=fold_first, num_warps=warps, num_stages=stages)
        return o
    W = 2 * kdim + 2 * L + 2 * TP + 1
    proj = torch.empty(t_all, hv, W, dtype=torch.float32, device=q.device)
    replay_window_kernel[(n * (hk if window_key_heads else hv) + fold_first,)](
        A_log, a, dt_bias, q, k, b, proj, state_indices,
        ring.k_norm, ring.g, ring.beta, ring.k_raw, ring.count, ring.phase, record_indices, order,
        1.0, 20.0, scale, n, T, a.stride()[-2], q.stride()[1], k.stride()[1], b.stride()[-2],
        H=hk, HV=hv, K=kdim, L=L, TP=TP, W=W, IS_KDA=is_kda, BETA_ACTIVATED=beta_activated, ROUND_BETA=round_beta,
        FUSED_FOLD=fused_fold, FOLD_FIRST=fold_first, KEY_HEADS=window_key_heads,
        GP=triton.next_power_of_2(hv // hk), PDL=pdl, RAW_KEYS=window_raw_keys, HR=history_rows, num_warps=window_warps,
        num_stages=1)
    replay_output_kernel[(triton.cdiv(vdim, BV), n * hv)](
        v, o, proj, checkpoints, state_indices,
        ring.u, ring.g, ring.beta, ring.k_raw, ring.v_raw, ring.count, ring.phase, ring.faults, record_indices, order,
        T, v.stride()[1],
        H=hk, HV=hv, K=kdim, V=vdim, BV=BV, BK=BK, FBV=fbv, L=L, TP=TP, W=W,
        NP=max(16, 2 * TP),
        IS_KDA=is_kda, FUSED_FOLD=fused_fold, DOT=dot, FOLD_FIRST=fold_first, PDL=pdl,
        num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return o
