"""Replay-mode output-only decode / verify: the outputs of a window of T tokens from the checkpoint S0
and the request's history records, never materialising the state (DESIGN §2, "Replay algebra"), and
the window's records appended after the cursor.

Per value head, with ``G`` the cumulative log-decay since the checkpoint (a K-vector; GDN's scalar
gate broadcast) and normalised ``k``, scaled ``q``::

    u_t = beta_t [v_t - S0 (e^{G_t} * k_t) - sum_{j<t} u_j ((k_j * e^{G_t - G_j}) . k_t)]
    o_t = S0 (e^{G_t} * q_t) + sum_{j<=t} u_j ((k_j * e^{G_t - G_j}) . q_t)

The checkpoint is read once per program; the history is read from the ring (records before the
cursor, as one block reduced in parallel) and, for the window's own earlier tokens, from this launch's
inputs (keys, gates) and this program's own ``u`` stores. A request whose window would overflow is
folded in the same launch. Outputs agree with native to float32 rounding (another summation order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..delta_rule_step import gate_vector, l2normalize, store_raw_record
from .fold import replay_records
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
    ROUND_BETA: tl.constexpr, FUSED_FOLD: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``; T tokens per request (``q, k`` ``[1, N*T, H, K]``, ``v``
    ``[1, N*T, HV, V]``, ``a`` ``[N*T, HV]`` or ``[N*T, HV*K]``, ``b`` ``[1, N*T, HV]``, ``o`` like v).
    ``h0_source`` ``[slots, HV, V, K]``: checkpoints at ``h0_indices`` ``[N]``; ring buffers
    (:class:`ReplayRing`, 2·L records per slot, L a power of two) at ``rec_indices`` ``[N]``. A row
    with a negative slot or record index (padding) reads no history and writes nothing.

    ``FUSED_FOLD``: a request whose window would overflow (``count + T > L``) first has its history
    replayed into its checkpoint tile by this program (the fold's exact recurrence, rounded once and
    stored), and continues with an empty history in the ring's other half; the cursor itself is
    settled by :func:`~.ring.advance` with ``window=T`` (every program of a request reads the same
    cursor here). Without it the caller has folded (``count + T <= L``).

    The committed history is loaded as one ``[L, BK]`` block of keys and ``[L, BV]`` block of ``u``
    and reduced in parallel; the window's own earlier tokens come from this launch's inputs and this
    program's own ``u`` stores. Records of token t go to ring position ``phase * L + count + t``.
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = i_n * T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_l = tl.arange(0, L)
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
    p_h0 = h0_source + tl.maximum(idx, 0) * HV * K * V + i_hv * K * V + o_v[None, :] * K + o_k[:, None]
    if idx >= 0:
        b_s0 += tl.load(p_h0, mask=mask_h, other=0).to(tl.float32)
    r_safe = tl.maximum(r, 0)
    c = tl.where(valid, tl.load(r_count + r_safe), 0)
    phase = tl.load(r_phase + r_safe)
    if FUSED_FOLD:
        if valid & (c + T > L):
            b_s0 = replay_records(b_s0, r_g, r_beta, r_kraw, r_vraw, r_safe * 2 * L + phase.to(tl.int64) * L, c,
                                  i_h, i_hv, o_k, o_v, mask_k, mask_v, H, HV, K, V, IS_KDA)
            tl.store(p_h0, b_s0.to(p_h0.dtype.element_ty), mask=mask_h)
            b_s0 = b_s0.to(p_h0.dtype.element_ty).to(tl.float32)
            c = c * 0
            phase = 1 - phase
    rec0 = r_safe * 2 * L + phase.to(tl.int64) * L

    # the committed history, at once: keys decayed to the end of the history, u, total log-decay Gc
    m_l = o_l < c
    p_rec = rec0 + o_l
    if IS_KDA:
        b_gh = tl.load(r_g + (p_rec[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_l[:, None] & mask_k[None, :],
                       other=0)
        b_Gc = tl.sum(b_gh, 0)
        b_dec = tl.exp(b_Gc[None, :] - tl.cumsum(b_gh, 0))
    else:
        b_gh = tl.load(r_g + p_rec * HV + i_hv, mask=m_l, other=0)
        b_gsum = tl.sum(b_gh, 0)
        b_Gc = tl.zeros([BK], dtype=tl.float32) + b_gsum
        b_dec = tl.exp(b_gsum - tl.cumsum(b_gh, 0))[:, None]
    b_kh = tl.load(r_kn + (p_rec[:, None] * H + i_h) * K + o_k[None, :], mask=m_l[:, None] & mask_k[None, :], other=0)
    b_kh = tl.where(m_l[:, None], b_kh * b_dec, 0)
    b_uh = tl.load(r_u + (p_rec[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_l[:, None] & mask_v[None, :],
                   other=0)

    b_Gt = b_Gc
    b_Gw = tl.zeros([BK], dtype=tl.float32)  # log-decay of the window so far
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
        b_Gw += b_gv
        b_e = tl.exp(b_Gt)
        s0k = tl.sum(b_s0 * (b_e * b_k)[:, None], 0)
        s0q = tl.sum(b_s0 * (b_e * b_q)[:, None], 0)
        b_ew = tl.exp(b_Gw)
        acc_k = tl.sum(b_uh * tl.sum(b_kh * (b_ew * b_k)[None, :], 1)[:, None], 0)
        acc_q = tl.sum(b_uh * tl.sum(b_kh * (b_ew * b_q)[None, :], 1)[:, None], 0)
        b_Gj = tl.zeros([BK], dtype=tl.float32)
        for j in range(0, tl.where(valid, t, 0)):  # the window's earlier tokens
            _, b_gj, _ = gate_vector(p_A_log, p_a0 + j * stride_a, p_dt_bias, p_b0 + j * stride_b, mask_k,
                                     softplus_beta, softplus_threshold, BK, IS_KDA, BETA_ACTIVATED)
            b_Gj += b_gj
            b_kd = l2normalize(tl.load(p_k0 + j * stride_k, mask=mask_k, other=0).to(tl.float32)) * tl.exp(b_Gw - b_Gj)
            b_uj = tl.load(r_u + ((rec0 + c + j) * HV + i_hv) * V + o_v, mask=mask_v, other=0)
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


def default_block_v(value_heads: int) -> int:
    """V columns per program for a launch over ``value_heads`` (requests × value heads): a whole
    128-column head per program once there are enough heads to fill the GPU (the history block is then
    loaded and reduced once per head), 32 columns below that (more programs for a small batch)."""
    return 128 if value_heads >= 128 else 32


def replay_verify(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, b: torch.Tensor, checkpoints: torch.Tensor, state_indices: torch.Tensor,
                  ring: ReplayRing, record_indices: torch.Tensor, *, is_kda: bool, beta_activated: bool = False,
                  scale: float | None = None, round_beta: bool = False, fused_fold: bool = True,
                  block_v: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Output-only decode (T = 1) or chain verify (T = D) of ``N = len(state_indices)`` requests with
    ``T_all / N`` tokens each; inputs as SGLang's ``fused_sigmoid_gating_delta_rule_update``.

    ``fused_fold`` (default): requests whose window would overflow the history (``count + T > L``)
    are folded inside this launch; the caller then settles the cursor with
    ``advance(ring, record_indices, accepted, window=T)`` — one launch for the outputs, one for the
    cursor, whatever the batch's fold pattern. Otherwise the caller folds first
    (:func:`~.ring.fold_needed`, :func:`~.fold.fold_into_checkpoints`). ``round_beta`` rounds
    sigmoid(b) to b's dtype, as SGLang 0.5.14's GDN packed decode kernel does (so a replay decode, once
    folded, is what that kernel leaves). ``block_v`` (a power of two: V columns per program) and
    ``num_warps`` tile the launch: outputs, checkpoints and raw records are the same bits for every
    tiling (the ``u`` records to float32 rounding). Default (:func:`default_block_v`): one program per
    value head when the batch has at least 128 value heads, else 32 columns per program — the fastest
    tilings measured on the H200 (``bench/results/replay/tilings_20261203`` and ``small_batch_20261203``).
    Returns ``o`` ``[1, T_all, HV, V]``.
    """
    _, t_all, hk, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    n = state_indices.shape[0]
    if t_all % n:
        raise ValueError(f"{t_all} tokens do not split evenly over {n} requests")
    if t_all // n > ring.history:
        raise ValueError(f"a window of {t_all // n} tokens does not fit a replay history of {ring.history}: L >= D needed")
    if block_v is None:
        block_v = default_block_v(n * hv)
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v {block_v} must be a power of two")
    BK, BV = triton.next_power_of_2(kdim), min(triton.next_power_of_2(vdim), block_v)
    if BK != kdim:
        raise ValueError(f"head_k_dim {kdim} must be a power of two")
    o = q.new_empty(1, t_all, hv, vdim)
    replay_verify_kernel[(triton.cdiv(vdim, BV), n * hv)](
        A_log, a, dt_bias, q, k, v, b, o, checkpoints, state_indices,
        ring.u, ring.k_norm, ring.g, ring.beta, ring.k_raw, ring.v_raw, ring.count, ring.phase, record_indices,
        1.0, 20.0, kdim ** -0.5 if scale is None else scale, t_all // n,
        a.stride()[-2], q.stride()[1], k.stride()[1], v.stride()[1], b.stride()[-2],
        H=hk, HV=hv, K=kdim, V=vdim, BK=BK, BV=BV, L=ring.history, IS_KDA=is_kda, BETA_ACTIVATED=beta_activated,
        ROUND_BETA=round_beta, FUSED_FOLD=fused_fold, num_warps=num_warps, num_stages=2)
    return o
