"""Replay-mode output-only decode / verify: the outputs of a window of T tokens from the checkpoint S0
and the request's history records, never materialising the state (DESIGN §2, "Replay algebra"), and
the window's records appended after the cursor.

Per value head, with ``G`` the cumulative log-decay since the checkpoint (a K-vector; GDN's scalar
gate broadcast) and normalised ``k``, scaled ``q``::

    u_t = beta_t [v_t - S0 (e^{G_t} * k_t) - sum_{j<t} u_j ((k_j * e^{G_t - G_j}) . k_t)]
    o_t = S0 (e^{G_t} * q_t) + sum_{j<=t} u_j ((k_j * e^{G_t - G_j}) . q_t)

The checkpoint is read once per program; the history is read from the ring (records before the
cursor) and, for the window's own earlier tokens, from this launch's inputs (keys, gates) and this
program's own ``u`` stores. Outputs agree with native to float32 rounding (another summation order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..delta_rule_step import gate_vector, l2normalize, store_raw_record
from .ring import ReplayRing


@triton.jit(do_not_specialize=["T"])
def replay_verify_kernel(
    A_log, a, dt_bias, q, k, v, b, o,
    h0_source, h0_indices,
    r_u, r_kn, r_g, r_beta, r_kraw, r_vraw, r_count, r_phase, rec_indices,
    softplus_beta, softplus_threshold, scale, T,
    stride_a, stride_q, stride_k, stride_v, stride_b,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L: tl.constexpr, IS_KDA: tl.constexpr, BETA_ACTIVATED: tl.constexpr,
    ROUND_BETA: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``; T tokens per request (``q, k`` ``[1, N*T, H, K]``, ``v``
    ``[1, N*T, HV, V]``, ``a`` ``[N*T, HV]`` or ``[N*T, HV*K]``, ``b`` ``[1, N*T, HV]``, ``o`` like v).
    ``h0_source`` ``[slots, HV, V, K]``: checkpoints, read only, at ``h0_indices`` ``[N]``; ring
    buffers (:class:`ReplayRing`, 2·L records per slot) at ``rec_indices`` ``[N]``. A row with a
    negative slot or record index (padding) reads no history and writes no record. Records of token t
    go to ring position ``phase * L + count + t``; the cursor is not moved (acceptance does that).
    """
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
    p_k0 = k + bos * stride_k + i_h * K + o_k
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

    # G after the committed history
    b_Gc = tl.zeros([BK], dtype=tl.float32)
    for j in range(0, c):
        if IS_KDA:
            b_Gc += tl.load(r_g + ((rec0 + j) * HV + i_hv) * K + o_k, mask=mask_k, other=0)
        else:
            b_Gc += tl.load(r_g + (rec0 + j) * HV + i_hv)
    b_Gt = b_Gc
    writes_k = (i_v == 0) & (i_hv % (HV // H) == 0)
    for t in range(0, T):
        b_g, b_gv, b_beta = gate_vector(p_A_log, p_a0 + t * stride_a, p_dt_bias, p_b0 + t * stride_b, mask_k,
                                         softplus_beta, softplus_threshold, BK, IS_KDA, BETA_ACTIVATED)
        if ROUND_BETA:  # as SGLang's GDN packed decode: sigmoid(b) rounded to b's dtype
            b_beta = b_beta.to(b.dtype.element_ty).to(tl.float32)
        b_k_raw = tl.load(p_k0 + t * stride_k, mask=mask_k, other=0)
        b_v_raw = tl.load(v + (bos + t) * stride_v + i_hv * V + o_v, mask=mask_v, other=0)
        b_k = l2normalize(b_k_raw.to(tl.float32))
        b_q = l2normalize(tl.load(q + (bos + t) * stride_q + i_h * K + o_k, mask=mask_k, other=0).to(tl.float32))
        b_q = b_q * scale
        b_Gt += b_gv
        b_e = tl.exp(b_Gt)
        s0k = tl.sum(b_s0 * (b_e * b_k)[:, None], 0)
        s0q = tl.sum(b_s0 * (b_e * b_q)[:, None], 0)
        acc_k = tl.zeros([BV], dtype=tl.float32)
        acc_q = tl.zeros([BV], dtype=tl.float32)
        b_Gj = tl.zeros([BK], dtype=tl.float32)
        n_hist = tl.where(valid, c + t, 0)
        for j in range(0, n_hist):
            pos = rec0 + j
            if j < c:
                if IS_KDA:
                    b_gj = tl.load(r_g + (pos * HV + i_hv) * K + o_k, mask=mask_k, other=0)
                else:
                    b_gj = tl.zeros([BK], dtype=tl.float32) + tl.load(r_g + pos * HV + i_hv)
                b_kj = tl.load(r_kn + (pos * H + i_h) * K + o_k, mask=mask_k, other=0)
            else:
                _, b_gj, _ = gate_vector(p_A_log, p_a0 + (j - c) * stride_a, p_dt_bias, p_b0 + (j - c) * stride_b,
                                          mask_k, softplus_beta, softplus_threshold, BK, IS_KDA, BETA_ACTIVATED)
                b_kj = l2normalize(tl.load(p_k0 + (j - c) * stride_k, mask=mask_k, other=0).to(tl.float32))
            b_Gj += b_gj
            b_kd = b_kj * tl.exp(b_Gt - b_Gj)
            b_uj = tl.load(r_u + (pos * HV + i_hv) * V + o_v, mask=mask_v, other=0)
            acc_k += b_uj * tl.sum(b_kd * b_k)
            acc_q += b_uj * tl.sum(b_kd * b_q)
        b_u = b_beta * (b_v_raw.to(tl.float32) - s0k - acc_k)
        b_o = s0q + acc_q + b_u * tl.sum(b_k * b_q)
        tl.store(o + ((bos + t) * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
        if valid:
            pos = rec0 + c + t
            tl.store(r_u + (pos * HV + i_hv) * V + o_v, b_u, mask=mask_v)
            if writes_k:
                tl.store(r_kn + (pos * H + i_h) * K + o_k, b_k, mask=mask_k)
            store_raw_record(r_kraw, r_vraw, r_g, r_beta, pos, i_h, i_hv, i_v == 0, writes_k, o_k, o_v, mask_k,
                             mask_v, b_k_raw, b_v_raw, b_g, b_beta, H, HV, K, V, IS_KDA)
        tl.debug_barrier()  # this program reads its own u stores back for the next token


def replay_verify(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, b: torch.Tensor, checkpoints: torch.Tensor, state_indices: torch.Tensor,
                  ring: ReplayRing, record_indices: torch.Tensor, *, is_kda: bool, beta_activated: bool = False,
                  scale: float | None = None, round_beta: bool = False) -> torch.Tensor:
    """Output-only decode (T = 1) or chain verify (T = D) of ``N = len(state_indices)`` requests with
    ``T_all / N`` tokens each; inputs as SGLang's ``fused_sigmoid_gating_delta_rule_update``. The caller
    folds first where ``count + T > L`` (:func:`~.ring.fold_needed`). ``round_beta`` rounds sigmoid(b) to
    b's dtype, as SGLang 0.5.14's GDN packed decode kernel does (so a replay decode, once folded, is what
    that kernel leaves). Returns ``o`` ``[1, T_all, HV, V]``.
    """
    _, t_all, hk, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    n = state_indices.shape[0]
    if t_all % n:
        raise ValueError(f"{t_all} tokens do not split evenly over {n} requests")
    if t_all // n > ring.history:
        raise ValueError(f"a window of {t_all // n} tokens does not fit a replay history of {ring.history}: L >= D needed")
    BK, BV = triton.next_power_of_2(kdim), min(triton.next_power_of_2(vdim), 32)
    if BK != kdim:
        raise ValueError(f"head_k_dim {kdim} must be a power of two")
    o = q.new_empty(1, t_all, hv, vdim)
    replay_verify_kernel[(triton.cdiv(vdim, BV), n * hv)](
        A_log, a, dt_bias, q, k, v, b, o, checkpoints, state_indices,
        ring.u, ring.k_norm, ring.g, ring.beta, ring.k_raw, ring.v_raw, ring.count, ring.phase, record_indices,
        1.0, 20.0, kdim ** -0.5 if scale is None else scale, t_all // n,
        a.stride()[-2], q.stride()[1], k.stride()[1], v.stride()[1], b.stride()[-2],
        H=hk, HV=hv, K=kdim, V=vdim, BK=BK, BV=BV, L=ring.history, IS_KDA=is_kda, BETA_ACTIVATED=beta_activated,
        ROUND_BETA=round_beta, num_warps=1, num_stages=3)
    return o
