"""One verify kernel for every mode: the outputs of a window of draft tokens (a chain, or a tree
through ``retrieve_parent_token``) from a state that is read and never written, writing optionally

* raw-input records (``compact``: what the commit re-runs), and/or
* every node's state into a scratch buffer (``native``: the per-step states SGLang's GDN verify
  stores; SGLang 0.5.14 has no KDA verify, so this is ours for Kimi-Linear).

The arithmetic is SGLang 0.5.14's ``fused_sigmoid_gating_delta_rule_update_kernel``, op for op and
with its tiling (BK = K, BV = 32, one warp), so outputs and stored states are native's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from typing import TYPE_CHECKING

from .delta_rule_step import (delta_rule_update, gate_and_beta, l2normalize, store_raw_record, token_inputs,
                              tree_ancestors)

if TYPE_CHECKING:  # ops.compact imports this module: a runtime import would be circular
    from .compact.records import CompactRecordBuffers


@triton.jit(do_not_specialize=["T"])
def verify_window_kernel(
    A_log, a, dt_bias, q, k, v, b, o,
    h0_source, h0_indices, cu_seqlens,
    rec_k, rec_v, rec_g, rec_beta, rec_indices,
    steps, steps_indices,
    parents, stride_parents_seq, stride_parents_tok,
    softplus_beta, softplus_threshold, scale, T,
    stride_a, stride_q, stride_k, stride_v, stride_b,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, D: tl.constexpr, NP2_D: tl.constexpr,
    IS_KDA: tl.constexpr, IS_VARLEN: tl.constexpr, IS_TREE: tl.constexpr,
    BETA_ACTIVATED: tl.constexpr, WRITE_RECORDS: tl.constexpr, WRITE_STEPS: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``; one program per (value block, request, value head).

    ``q, k`` ``[1, T_all, H, K]``, ``v`` ``[1, T_all, HV, V]`` (activation dtype); ``a`` ``[T_all, HV]``
    (GDN) or ``[T_all, HV * K]`` (KDA); ``b`` ``[1, T_all, HV]``; ``o`` ``[1, T_all, HV, V]``;
    ``h0_source`` ``[slots, HV, V, K]`` (float32 / bfloat16 / float16), read only; ``h0_indices``
    ``[N]`` (``< 0``: padding row, starts from zeros); ``cu_seqlens`` ``[N + 1]`` (varlen) or fixed
    ``T`` per request; records (see :class:`CompactRecordBuffers`) at ``rec_indices`` ``[N]``, token t
    of a request at record position t (t < D); rows with a negative record or state index (padding)
    write no record. ``steps`` ``[S, D, HV, V, K]`` (state dtype): node t's state at
    ``steps[steps_indices[n], t]`` (``< 0``: not stored), as SGLang's ``intermediate_ssm``.
    ``b`` holds beta logits, or beta itself when ``BETA_ACTIVATED`` (Kimi-Linear's extend path
    applies the sigmoid before the backend).

    Chain (``IS_TREE`` False): the state tile stays in float32 across the window, like native chain
    verify. Tree: ``parents`` ``[N, T]`` (SGLang's ``retrieve_parent_token``) gives each node's
    parent; node t's output is computed from S0 along its path, rounding the tile to the state dtype
    after every step but the last — exactly the stored parent states native tree verify reloads.

    ``PREFETCH``: each token's inputs (q, k, v, gate, beta) are loaded one step ahead, during the previous
    token's step, instead of at the top of its own (served); the same arithmetic, the same bits.
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n * T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]

    p_q = q + bos * stride_q + i_h * K + o_k
    p_k = k + bos * stride_k + i_h * K + o_k
    p_v = v + bos * stride_v + i_hv * V + o_v
    p_b = b + bos * stride_b + i_hv
    p_o = o + (bos * HV + i_hv) * V + o_v
    p_A_log = A_log + i_hv
    if IS_KDA:
        p_a = a + bos * stride_a + i_hv * K + o_k
        p_dt_bias = dt_bias + i_hv * K + o_k
    else:
        p_a = a + bos * stride_a + i_hv
        p_dt_bias = dt_bias + i_hv

    b_h0 = tl.zeros([BK, BV], dtype=tl.float32)
    idx = tl.load(h0_indices + i_n)
    if idx >= 0:
        p_h0 = h0_source + idx * HV * K * V + i_hv * K * V + o_v[None, :] * K + o_k[:, None]
        b_h0 += tl.load(p_h0, mask=mask_h, other=0).to(tl.float32)
    b_h = b_h0

    r = -1
    if WRITE_RECORDS:
        r = tl.load(rec_indices + i_n).to(tl.int64)
    records = (r >= 0) & (idx >= 0)
    s_idx = -1
    if WRITE_STEPS:
        s_idx = tl.load(steps_indices + i_n).to(tl.int64)
    writes_k = (i_v == 0) & (i_hv % (HV // H) == 0)
    o_d = tl.arange(0, NP2_D)
    # with PREFETCH token t's inputs are loaded (and gated) during token t - 1's step — the recurrence is
    # sequential, its inputs are not; the last prefetch re-reads token T - 1, in bounds
    if PREFETCH:
        n_q, n_k, n_v, n_g, n_beta = token_inputs(
            A_log, a, dt_bias, q, k, v, b, bos, i_h, i_hv, o_k, o_v, mask_v, softplus_beta, softplus_threshold,
            stride_a, stride_q, stride_k, stride_v, stride_b, K, V, IS_KDA, BETA_ACTIVATED, False)
    for t in range(0, T):
        if PREFETCH:
            b_q_raw, b_k_raw, b_v_raw, b_g, b_beta = n_q, n_k, n_v, n_g, n_beta
            n_q, n_k, n_v, n_g, n_beta = token_inputs(
                A_log, a, dt_bias, q, k, v, b, bos + tl.minimum(t + 1, T - 1), i_h, i_hv, o_k, o_v, mask_v,
                softplus_beta, softplus_threshold, stride_a, stride_q, stride_k, stride_v, stride_b, K, V, IS_KDA,
                BETA_ACTIVATED, False)
        else:  # as served: q is loaded after the step (not held live through it)
            b_k_raw = tl.load(p_k + t * stride_k, mask=mask_k, other=0)
            b_v_raw = tl.load(p_v + t * stride_v, mask=mask_v, other=0)
            b_g, b_beta = gate_and_beta(p_A_log, p_a + t * stride_a, p_dt_bias, p_b + t * stride_b, mask_k,
                                        softplus_beta, softplus_threshold, IS_KDA, BETA_ACTIVATED)
        if WRITE_RECORDS:  # constexpr first: without buffers the branch must not be compiled
            if records:
                store_raw_record(rec_k, rec_v, rec_g, rec_beta, r * D + t, i_h, i_hv, i_v == 0, writes_k, o_k, o_v,
                                 mask_k, mask_v, b_k_raw, b_v_raw, b_g, b_beta, H, HV, K, V, IS_KDA)
        if IS_TREE:
            anc, depth = tree_ancestors(parents + i_n * stride_parents_seq, stride_parents_tok, t, T, NP2_D)
            b_h = b_h0
            for jj in range(0, depth + 1):
                node = tl.sum(tl.where(o_d == depth - jj, anc, 0))
                b_kn = tl.load(p_k + node * stride_k, mask=mask_k, other=0).to(tl.float32)
                b_vn = tl.load(p_v + node * stride_v, mask=mask_v, other=0).to(tl.float32)
                b_gn, b_betan = gate_and_beta(p_A_log, p_a + node * stride_a, p_dt_bias, p_b + node * stride_b,
                                              mask_k, softplus_beta, softplus_threshold, IS_KDA,
                                              BETA_ACTIVATED)
                b_h = delta_rule_update(b_h, l2normalize(b_kn), b_vn, b_gn, b_betan, IS_KDA)
                if jj < depth:
                    b_h = b_h.to(h0_source.dtype.element_ty).to(tl.float32)
        else:
            b_h = delta_rule_update(b_h, l2normalize(b_k_raw.to(tl.float32)), b_v_raw.to(tl.float32), b_g, b_beta,
                                    IS_KDA)
        if WRITE_STEPS:
            if s_idx >= 0:
                p_s = steps + ((s_idx * D + t) * HV + i_hv) * K * V + o_v[None, :] * K + o_k[:, None]
                tl.store(p_s, b_h.to(p_s.dtype.element_ty), mask=mask_h)
        if not PREFETCH:
            b_q_raw = tl.load(p_q + t * stride_q, mask=mask_k, other=0).to(tl.float32)
        b_q = l2normalize(b_q_raw) * scale
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(p_o + t * HV * V, b_o.to(p_o.dtype.element_ty), mask=mask_v)


def native_tile(vdim: int) -> tuple[int, int]:
    """``(BV, num_warps)`` of SGLang's verify tiling for ``vdim`` value columns: up to 32 columns a program, one
    warp."""
    return min(triton.next_power_of_2(vdim), 32), 1


def verify_window(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, b: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor, *,
                  is_kda: bool, records: CompactRecordBuffers | None = None,
                  record_indices: torch.Tensor | None = None, steps: torch.Tensor | None = None,
                  steps_indices: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                  retrieve_parent_token: torch.Tensor | None = None, beta_activated: bool = False,
                  scale: float | None = None, softplus_beta: float = 1.0,
                  softplus_threshold: float = 20.0, tile: tuple[int, int] | None = None,
                  prefetch: bool | None = None) -> torch.Tensor:
    """Verify a window; arguments as SGLang's ``fused_sigmoid_gating_delta_rule_update``
    (``q, k`` ``[1, T_all, HK, K]``, ``v`` ``[1, T_all, HV, V]``, ``a``, ``b``, the state pool
    ``[slots, HV, V, K]`` and per-request ``state_indices``). With ``cu_seqlens`` None every request
    has ``T_all / N`` tokens. ``retrieve_parent_token`` ``[N, D]`` (int) selects tree verify.
    ``records`` + ``record_indices``: write raw-input records (compact). ``steps`` ``[S, D, HV, V, K]``
    + ``steps_indices``: store every node's state (native). Returns ``o`` ``[1, T_all, HV, V]``;
    ``ssm_states`` is never written.

    ``tile`` = ``(BV, num_warps)`` overrides the native tiling (BV 32, one warp) when no states are
    stored: the records are exact copies of the inputs whatever the tiling, the outputs then differ
    from native's in the last bits (another reduction order). Stored states always use the native
    tiling, which their bit-identity needs. ``prefetch``: load each token's inputs during the previous token's
    step (the kernel's ``PREFETCH``) instead of at the top of its own — the same bits; None: as served
    (:func:`served_prefetch`).
    """
    _, t_all, hk, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    n = state_indices.shape[0]
    if cu_seqlens is None and t_all % n:
        raise ValueError(f"{t_all} tokens do not split evenly over {n} requests; pass cu_seqlens")
    if (records is None) != (record_indices is None) or (steps is None) != (steps_indices is None):
        raise ValueError("records need record_indices and steps need steps_indices")
    width = t_all // n if cu_seqlens is None else 1
    d = records.draft_tokens if records is not None else (steps.shape[1] if steps is not None else width)
    if d < width:
        raise ValueError(f"buffers hold {d} tokens per request, the window has {width}")
    BK = triton.next_power_of_2(kdim)
    BV, num_warps = native_tile(vdim)
    if tile is not None:
        if steps is not None:
            raise ValueError("stored states need the native tiling: pass tile=None with steps")
        BV, num_warps = tile
    if BK != kdim:
        raise ValueError(f"head_k_dim {kdim} must be a power of two (the native kernel's single K block)")
    o = q.new_empty(1, t_all, hv, vdim)
    parents = retrieve_parent_token
    tree = parents is not None
    if prefetch is None:
        prefetch = steps is None and not tree and served_prefetch(is_kda, (BV, num_warps), ssm_states.dtype)
    rec = records
    grid = (triton.cdiv(vdim, BV), n * hv)
    verify_window_kernel[grid](
        A_log, a, dt_bias, q, k, v, b, o, ssm_states, state_indices, cu_seqlens,
        rec.k if rec else None, rec.v if rec else None, rec.g if rec else None, rec.beta if rec else None,
        record_indices, steps, steps_indices,
        parents, parents.stride(0) if tree else 0, parents.stride(1) if tree else 0, softplus_beta,
        softplus_threshold, kdim ** -0.5 if scale is None else scale, t_all // n if cu_seqlens is None else t_all,
        a.stride()[-2], q.stride()[1], k.stride()[1], v.stride()[1], b.stride()[-2],
        H=hk, HV=hv, K=kdim, V=vdim, BK=BK, BV=BV, D=d, NP2_D=triton.next_power_of_2(d),
        IS_KDA=is_kda, IS_VARLEN=cu_seqlens is not None, IS_TREE=tree, BETA_ACTIVATED=beta_activated,
        WRITE_RECORDS=rec is not None, WRITE_STEPS=steps is not None, PREFETCH=prefetch, num_warps=num_warps,
        num_stages=3)
    return o


SERVED_PREFETCH = {("gdn", (32, 1), 4): True, ("gdn", (32, 1), 2): True, ("kda", (32, 1), 2): True,
                   ("gdn", (16, 1), 4): True}
"""Where a chain verify of records (compact's; ``(BV, num_warps)`` tiling, state bytes) loads each token's inputs
during the previous token's step: where that was faster in the one run that timed both side by side (H100,
bench/results/prefetch_20261206, commit 4798d3d, D = 4, verify alone at batch 1 / 64 / 256): native's tiling
GDN float32 1.15 / 1.10 / 1.05x, bfloat16 1.14 / 1.08 / 1.03x, KDA bfloat16 1.07 / 1.09 / 1.06x; 16 columns GDN
float32 1.08 / 1.12 / 1.08x. Not where it was slower: native's tiling KDA float32 1.00 / 0.97 / 0.88x; 16
columns GDN bfloat16 0.84-0.92x, KDA 0.87-1.13x. Compiled for sm_90a the loads ahead hold the next token's
inputs live through a step (chain, 1 warp, float32 state: GDN 209 registers a thread at BV 16 against 128, 254
at BV 32 against 168; ``scripts/kernel_registers.py --verify-window [--prefetch]``): fewer warps a multiprocessor
against less latency per step. Trees, stored states (native's KDA verify) and other tilings: not timed, off."""


def served_prefetch(is_kda: bool, tile: tuple[int, int], state_dtype: torch.dtype) -> bool:
    """Whether a served chain verify of records at this ``(BV, num_warps)`` tiling and state dtype loads each
    token's inputs one step ahead (:data:`SERVED_PREFETCH`)."""
    return SERVED_PREFETCH.get(("kda" if is_kda else "gdn", tuple(tile), state_dtype.itemsize), False)

