"""Compact-mode verify of a chain in the replay algebra (DESIGN §2): the window's outputs from the state S0
by projections, never stepping the state tile through the window.

Per value head, with ``G_t`` the window's cumulative log-decay up to token t (a K-vector; GDN's scalar gate
broadcast), normalised ``k``, scaled ``q``::

    u_t = beta_t [v_t - S0 (e^{G_t} * k_t) - sum_{j<t} u_j ((k_j * e^{G_t - G_j}) . k_t)]
    o_t = S0 (e^{G_t} * q_t) + sum_{j<=t} u_j ((k_j * e^{G_t - G_j}) . q_t)

— replay's verify with an empty history. Native's verify (and :func:`~..verify_window.verify_window`) runs
the delta rule token by token on the ``[K, BV]`` state tile: per token a decay of the tile, two reductions
over K and a rank-one update, sequential, so at D = 4 it is bound by latency, not by the state read. Here a
program projects its state columns onto all ``2T`` rows ``e^{G_t} k_t``, ``e^{G_t} q_t`` in one ``tl.dot``
(tensor cores, ``tf32x3``) and solves the window's ``u`` on ``[BV]`` vectors with ``[T, T]`` coefficients it
computes from the window's keys. The records are the same raw inputs, gates and betas
:func:`~..verify_window.verify_window` writes (same helpers, same bits), so the commit — which re-runs the
native recurrence from them — stays bit-identical to native; the outputs agree with native's to float32
rounding (another summation order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..delta_rule_step import gate_vector, l2normalize, store_raw_record
from .records import CompactRecordBuffers

PROJECTED_TILE = (32, 4)
"""``(BV, num_warps)`` of :func:`compact_projected_verify` unless told otherwise."""


@triton.jit(do_not_specialize=["T"])
def compact_projected_verify_kernel(
    A_log, a, dt_bias, q, k, v, b, o, h0_source, h0_indices,
    rec_k, rec_v, rec_g, rec_beta, rec_indices,
    softplus_beta, softplus_threshold, scale, T,
    stride_a, stride_q, stride_k, stride_v, stride_b,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    D: tl.constexpr, TP: tl.constexpr, NP: tl.constexpr, IS_KDA: tl.constexpr, BETA_ACTIVATED: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``; one program per (value block, request, value head), ``T`` tokens per
    request (``T <= D``, ``TP = next_power_of_2(D)``, ``NP = max(16, 2 * TP)``).

    ``q, k`` ``[1, N*T, H, K]``, ``v`` ``[1, N*T, HV, V]`` (activation dtype); ``a`` ``[N*T, HV]`` (GDN) or
    ``[N*T, HV*K]`` (KDA); ``b`` ``[1, N*T, HV]`` (beta logits, or beta with ``BETA_ACTIVATED``); ``o`` like
    ``v``; ``h0_source`` ``[slots, HV, V, K]`` (float32 / bfloat16 / float16) at ``h0_indices`` ``[N]``, read
    once per program (``[BV, K]``, contiguous along K), never written (``< 0``: a padding row, from zeros).
    Records (:class:`CompactRecordBuffers`, ``D`` tokens per slot) at ``rec_indices`` ``[N]``: token t at
    position ``r * D + t``; rows with a negative record or state index write none. ``K`` a power of two
    ``>= 16``; ``BV >= 16``."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = i_n * T
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, TP)
    o_p = tl.arange(0, NP)
    mask_k = o_k < K
    mask_v = o_v < V
    p_A_log = A_log + i_hv
    if IS_KDA:
        p_dt_bias = dt_bias + i_hv * K + o_k
        p_a0 = a + bos * stride_a + i_hv * K + o_k
    else:
        p_dt_bias = dt_bias + i_hv
        p_a0 = a + bos * stride_a + i_hv
    idx = tl.load(h0_indices + i_n).to(tl.int64)
    r = tl.load(rec_indices + i_n).to(tl.int64)
    records = (r >= 0) & (idx >= 0)
    writes_k = (i_v == 0) & (i_hv % (HV // H) == 0)

    # the state's columns, issued first: the window's K-side work below overlaps the load
    p_h0 = h0_source + tl.maximum(idx, 0) * HV * K * V + i_hv * K * V + o_v[:, None] * K + o_k[None, :]
    b_s0 = tl.load(p_h0, mask=mask_v[:, None] & (idx >= 0), other=0).to(tl.float32)

    # K side, token by token (unrolled): gates, normalised keys and queries, projection rows, coefficients
    b_G = tl.zeros([K], dtype=tl.float32)  # log-decay of the window up to token t
    b_kw = tl.zeros([TP, K], dtype=tl.float32)  # normalised keys, row j = token j ...
    b_Gw = tl.zeros([TP, K], dtype=tl.float32)  # ... and the log-decay up to it
    b_p = tl.zeros([NP, K], dtype=tl.float32)  # rows t: e^{G_t} k_t; rows TP + t: e^{G_t} q_t
    b_ck = tl.zeros([TP, TP], dtype=tl.float32)  # (k_j e^{G_t - G_j}) . k_t, row t, column j < t
    b_cq = tl.zeros([TP, TP], dtype=tl.float32)  # (k_j e^{G_t - G_j}) . q_t, column j <= t
    b_betaw = tl.zeros([TP], dtype=tl.float32)
    b_vw = tl.zeros([TP, BV], dtype=tl.float32)
    for t in tl.static_range(TP):
        live = t < T
        t_in = tl.where(live, t, 0)  # a token past the window reads token 0's inputs and stores nothing
        b_g, b_gv, b_beta = gate_vector(p_A_log, p_a0 + t_in * stride_a, p_dt_bias, b + (bos + t_in) * stride_b + i_hv,
                                        mask_k, softplus_beta, softplus_threshold, K, IS_KDA, BETA_ACTIVATED)
        b_k_raw = tl.load(k + (bos + t_in) * stride_k + i_h * K + o_k)
        b_v_raw = tl.load(v + (bos + t_in) * stride_v + i_hv * V + o_v, mask=mask_v, other=0)
        b_kn = l2normalize(b_k_raw.to(tl.float32))
        b_qn = l2normalize(tl.load(q + (bos + t_in) * stride_q + i_h * K + o_k).to(tl.float32)) * scale
        b_G += b_gv
        b_e = tl.exp(b_G)
        b_kd = b_kw * tl.exp(b_G[None, :] - b_Gw)  # earlier keys decayed to token t (rows j >= t are zero)
        row = o_t[:, None] == t
        b_ck = tl.where(row, tl.sum(b_kd * b_kn[None, :], 1)[None, :], b_ck)
        b_cq = tl.where(row, tl.where(o_t == t, tl.sum(b_kn * b_qn), tl.sum(b_kd * b_qn[None, :], 1))[None, :], b_cq)
        b_p = tl.where(o_p[:, None] == t, (b_e * b_kn)[None, :], b_p)
        b_p = tl.where(o_p[:, None] == TP + t, (b_e * b_qn)[None, :], b_p)
        b_kw = tl.where(row, b_kn[None, :], b_kw)
        b_Gw = tl.where(row, b_G[None, :], b_Gw)
        b_betaw = tl.where(o_t == t, b_beta, b_betaw)
        b_vw = tl.where(row, b_v_raw.to(tl.float32)[None, :], b_vw)
        if live:
            if records:
                store_raw_record(rec_k, rec_v, rec_g, rec_beta, r * D + t, i_h, i_hv, i_v == 0, writes_k, o_k, o_v,
                                 mask_k, mask_v, b_k_raw, b_v_raw, b_g, b_beta, H, HV, K, V, IS_KDA)

    # the state's projections [BV, NP], then the window's u and outputs on [BV] vectors
    b_sp = tl.dot(b_s0, tl.trans(b_p), input_precision="tf32x3")
    b_uw = tl.zeros([TP, BV], dtype=tl.float32)  # row j = u_j
    p_o = o + (bos * HV + i_hv) * V + o_v
    for t in tl.static_range(TP):
        row = o_t[:, None] == t
        b_s0k = tl.sum(tl.where(o_p[None, :] == t, b_sp, 0), 1)
        b_s0q = tl.sum(tl.where(o_p[None, :] == TP + t, b_sp, 0), 1)
        b_ckt = tl.sum(tl.where(row, b_ck, 0), 0)
        b_cqt = tl.sum(tl.where(row, b_cq, 0), 0)
        b_vt = tl.sum(tl.where(row, b_vw, 0), 0)
        b_betat = tl.sum(tl.where(o_t == t, b_betaw, 0))
        b_u = b_betat * (b_vt - b_s0k - tl.sum(b_ckt[:, None] * b_uw, 0))
        b_uw = tl.where(row, b_u[None, :], b_uw)
        b_o = b_s0q + tl.sum(b_cqt[:, None] * b_uw, 0)
        tl.store(p_o + t * HV * V, b_o.to(p_o.dtype.element_ty), mask=mask_v & (t < T))


def compact_projected_verify(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor,
                             k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, ssm_states: torch.Tensor,
                             state_indices: torch.Tensor, records: CompactRecordBuffers,
                             record_indices: torch.Tensor, *, is_kda: bool, beta_activated: bool = False,
                             scale: float | None = None, softplus_beta: float = 1.0, softplus_threshold: float = 20.0,
                             tile: tuple[int, int] = PROJECTED_TILE) -> torch.Tensor:
    """Output-only verify of a chain of ``T_all / N`` tokens per request in the replay algebra; arguments as
    :func:`~.verify.compact_verify` (one layer's records; no tree: a tree's nodes do not share one decay
    chain). ``tile = (BV, num_warps)``, ``BV`` a power of two ``>= 16``. Returns ``o`` ``[1, T_all, HV, V]``,
    native's to float32 rounding; writes the records :func:`~.verify.compact_verify` writes, bit for bit;
    ``ssm_states`` is never written."""
    _, t_all, hk, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    n = state_indices.shape[0]
    block_v, num_warps = tile
    if t_all % n:
        raise ValueError(f"{t_all} tokens do not split evenly over {n} requests")
    width, d = t_all // n, records.draft_tokens
    if d < width:
        raise ValueError(f"buffers hold {d} tokens per request, the window has {width}")
    if kdim < 16 or triton.next_power_of_2(kdim) != kdim:
        raise ValueError(f"head_k_dim {kdim} must be a power of two >= 16 (one tl.dot over the whole K)")
    if block_v < 16 or triton.next_power_of_2(block_v) != block_v:
        raise ValueError(f"tile BV {block_v} must be a power of two >= 16 (a tl.dot operand)")
    o = q.new_empty(1, t_all, hv, vdim)
    tp = triton.next_power_of_2(d)
    compact_projected_verify_kernel[(triton.cdiv(vdim, block_v), n * hv)](
        A_log, a, dt_bias, q, k, v, b, o, ssm_states, state_indices,
        records.k, records.v, records.g, records.beta, record_indices,
        softplus_beta, softplus_threshold, kdim ** -0.5 if scale is None else scale, width,
        a.stride()[-2], q.stride()[1], k.stride()[1], v.stride()[1], b.stride()[-2],
        H=hk, HV=hv, K=kdim, V=vdim, BV=block_v, D=d, TP=tp, NP=max(16, 2 * tp), IS_KDA=is_kda,
        BETA_ACTIVATED=beta_activated, num_warps=num_warps, num_stages=1)
    return o
