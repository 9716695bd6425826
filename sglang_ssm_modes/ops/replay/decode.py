"""Replay-mode plain decode (one token per request), served one of two ways:

* **output-only** (:func:`~.verify.replay_verify` with T = 1, then :func:`~.ring.advance`): the token's output
  from checkpoint + history, its record appended, the checkpoint only read — replay's point, paying where
  the state's bytes bound the step (many requests);
* **write-through** (:func:`replay_write_through_kernel`): the request's pending history folded and the token
  applied to the checkpoint in one launch, as SGLang's decode kernels apply it (op order of its generic
  ``fused_sigmoid_gating_delta_rule_update``, the tile held ``[BV, K]`` as its packed CUDA kernels hold it, on
  one warp; 16 value columns a program where SGLang takes 32, :data:`WRITE_THROUGH_BLOCK_V`), the checkpoint
  written back and the history left empty — native's bytes and native's one launch, for
  batches where launches and latency, not bytes, bound the step and output-only was measured slower than
  native (:func:`write_through_max_requests`).

Both leave the same committed state (with a float32 state the write-through's is SGLang's decode bit for bit,
generic and packed kernel alike on the GPU; the output-only path's once folded, too), so a server may
switch between them from one step to the next (the batch crossing the bound): a request arriving at a
write-through with records folds them first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..delta_rule_step import apply_records, beta_gate, delta_rule_update, l2normalize, packed_beta
from .ring import ReplayRing, advance, flag_nonfinite
from .verify import replay_verify, token_gate, window_cursor


@triton.jit
def replay_write_through_kernel(
    A_log, a, dt_bias, q, k, v, b, o, h0_source, h0_indices,
    r_g, r_beta, r_kraw, r_vraw, r_count, r_phase, r_folds, r_faults, r_tickets, rec_indices,
    softplus_beta, softplus_threshold, scale, stride_a, stride_q, stride_k, stride_v, stride_b,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, L: tl.constexpr,
    IS_KDA: tl.constexpr, BETA_ACTIVATED: tl.constexpr, ROUND_BETA: tl.constexpr, V_MAJOR: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * HV)``, one program per ``BV`` value columns of a request's value head, as
    SGLang's decode: its tile loaded and stored as ``[BV, K]``, K the fast axis, as SGLang's packed kernels hold
    it (``V_MAJOR``; transposed in registers to the ``[K, BV]`` of the shared arithmetic, which ``tl.trans``
    does without moving data) or as its generic kernel holds it (``V_MAJOR`` false). Inputs: ``q, k``
    ``[1, N, H, K]``, ``v`` ``[1, N, HV, V]``, ``a`` ``[N, HV]`` (GDN) or ``[N, HV*K]`` (KDA), ``b``
    ``[1, N, HV]`` (activation dtype); ``o`` ``[1, N, HV, V]``; checkpoints ``h0_source`` ``[slots, HV, V, K]``
    (any float dtype) at ``h0_indices`` ``[N]``; ring buffers and cursor words as
    :class:`~.ring.ReplayRing` at ``rec_indices`` ``[N]`` (distinct). ``K`` a power of two.

    A real row (both indices non-negative) loads its checkpoint tile in float32, replays the ``count``
    records of its history (:func:`~..delta_rule_step.apply_records`, the fold's op order), applies the token
    (:func:`~..delta_rule_step.delta_rule_update`), stores the output ``h . q`` and the tile rounded to the
    checkpoint's dtype. A request that had records (``count > 0``) is a fold: the result is checked
    (:func:`~.ring.flag_nonfinite`) and its cursor emptied with no launch of its own — each of its
    ``P = HV * cdiv(V, BV)`` programs, once it has read the cursor, draws a ticket (an acquire-release atomic
    add on the slot's ``tickets``); the one that draws ticket ``P - 1`` (mod P), when every program has read it,
    takes the P tickets back (an atomic subtraction: the word is 0 again), writes ``count = 0``, flips
    ``phase`` and counts the fold. Where a batch repeats a slot (CUDA-graph capture runs every row on SGLang's
    dummy slot) the rows race on it, as SGLang's own decode does, but its cursor words only ever hold values a
    cursor can hold (no later launch reads past the ring) and ``tickets`` may stay nonzero until the slot is
    cleared (:class:`~.ring.ReplayRing`). Padding rows write nothing (their output: from a zero state)."""
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
    b_h = apply_records(b_h, r_kraw, r_vraw, r_g, r_beta, r_safe * 2 * L + phase.to(tl.int64) * L, c, i_h, i_hv,
                        o_k, o_v, mask_k, mask_v, H, HV, K, V, IS_KDA)

    b_q = tl.load(q + i_n * stride_q + i_h * K + o_k).to(tl.float32)
    b_k = tl.load(k + i_n * stride_k + i_h * K + o_k).to(tl.float32)
    b_v = tl.load(v + i_n * stride_v + i_hv * V + o_v, mask=mask_v, other=0).to(tl.float32)
    b_g = token_gate(A_log + i_hv, a + i_n * stride_a, dt_bias, i_hv, o_k, softplus_beta, softplus_threshold, K,
                     IS_KDA)
    b_beta = packed_beta(beta_gate(b + i_n * stride_b + i_hv, BETA_ACTIVATED), b, ROUND_BETA)
    b_q = l2normalize(b_q) * scale
    b_h = delta_rule_update(b_h, l2normalize(b_k), b_v, b_g, b_beta, IS_KDA)
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


WRITE_THROUGH_BLOCK_V = 16
"""Value columns per write-through program, on one warp and three stages as SGLang 0.5.14's decode, which takes
32: a 32-column program holds 168-254 registers a thread with the fold's loop beside the token (SGLang's
packed decode, without one, fewer), too few warps a multiprocessor to cover the state's loads; 16 columns hold
106-128. Side by side on an H100 (bench/results/replay/writethrough_tile_20261205, commit bd811dc, speedup
over SGLang's packed decode at batch 1 / 8 / 32 / 64 / 128 / 256, L = 16, empty histories): bfloat16 state
GDN 1.01 / 0.99 / 0.92 / 0.88 / 0.87 / 0.88x against 32 columns' 0.87 / 0.93 / 0.86 / 0.83 / 0.82 / 0.84x,
KDA 1.02 / 0.99 / 0.92 / 0.89 / 0.87 / 0.86x against 0.86 / 0.93 / 0.82 / 0.78 / 0.74 / 0.73x; float32
GDN 1.19 / 0.96 / 0.99 / 1.00 / 1.00 / 1.00x against 0.79 / 0.83 / 0.95 / 0.98 / 0.99 / 0.99x, KDA 0.96-1.11x
either way. The committed state is the same bits whatever the columns (each column's sums over K are
unchanged; tested on the GPU)."""

WRITE_THROUGH_V_MAJOR = True
"""Whether a served write-through holds its tile ``[BV, K]`` (SGLang's packed decode) or ``[K, BV]`` (its
generic decode): the bits are the same on the GPU (float32 state equal to both kernels', tested); ``[BV, K]``
was as fast or faster in the same H100 runs (bfloat16 KDA at 128 requests 0.87x native against 0.83x, 16
columns; 0.76x against 0.75x, 32 columns, commit 713c0de)."""


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
    (:data:`WRITE_THROUGH_V_MAJOR`), ``block_v`` value columns (:data:`WRITE_THROUGH_BLOCK_V`), ``num_warps``,
    ``num_stages`` (SGLang's decode launch's). Returns ``o`` ``[1, N, HV, V]``."""
    _, t_all, hk, kdim = k.shape
    hv, vdim = v.shape[2], v.shape[3]
    n = state_indices.shape[0]
    if t_all != n:
        raise ValueError(f"a write-through decode takes one token per request: {t_all} tokens for {n} requests")
    if triton.next_power_of_2(kdim) != kdim:
        raise ValueError(f"head_k_dim {kdim} must be a power of two")
    BV = min(triton.next_power_of_2(vdim), block_v or WRITE_THROUGH_BLOCK_V)
    if v_major is None:
        v_major = WRITE_THROUGH_V_MAJOR
    o = q.new_empty(1, n, hv, vdim)
    replay_write_through_kernel[(triton.cdiv(vdim, BV), n * hv)](
        A_log, a, dt_bias, q, k, v, b, o, checkpoints, state_indices,
        ring.g, ring.beta, ring.k_raw, ring.v_raw, ring.count, ring.phase, ring.folds, ring.faults, ring.tickets,
        record_indices,
        1.0, 20.0, kdim ** -0.5 if scale is None else scale,
        a.stride()[-2], q.stride()[1], k.stride()[1], v.stride()[1], b.stride()[-2],
        H=hk, HV=hv, K=kdim, V=vdim, BV=BV, L=ring.history, IS_KDA=is_kda, BETA_ACTIVATED=beta_activated,
        ROUND_BETA=round_beta, V_MAJOR=v_major, num_warps=num_warps, num_stages=num_stages)
    return o


WRITE_THROUGH_BELOW = {
    ("gdn", 16, 4): 64, ("kda", 16, 4): 64, ("gdn", 32, 4): 128, ("kda", 32, 4): None,
    ("gdn", 64, 4): None, ("kda", 64, 4): None,
    ("gdn", 16, 2): 128, ("kda", 16, 2): 128, ("gdn", 32, 2): None, ("kda", 32, 2): None,
    ("gdn", 64, 2): None, ("kda", 64, 2): None,
}
"""Per ``(family, history, state bytes)``: the request count from which output-only decode serves (None:
never — write-through at every batch). Measured side by side on the H200 (bench/results/replay/
writethrough_20261205, commit a6a4a2a; ratios against SGLang's decode, write-through / output-only):
float32 GDN L = 16 0.90-0.92 / 0.94-0.95x at 32 requests (a tie), 0.94-0.96 / 1.17-1.21x at 64; KDA L = 16
0.94-0.96 / 0.89-0.90x at 32, 0.96 / 1.13-1.15x at 64; GDN L = 32 0.97 / 0.87x at 64, 0.97 / 1.12x at
128; KDA L = 32 and both at L = 64: output-only slower at every batch (0.43-0.86x against 0.84-1.22x).
bfloat16 at L = 16: GDN 0.77-0.78 / 0.69x at 64, 0.74-0.75 / 0.91x at 128; KDA 0.73-0.74 / 0.70x at 64,
0.69 / 0.76x at 128; at L = 64 output-only 0.26-0.54x (at L = 32, from commit 34d5527: output-only 0.74x
GDN at 128 requests against write-through's 0.74-0.75x, KDA slower than at L = 16). A history of L < 16 takes
L = 16's bound; a state of 2-byte elements (bfloat16, float16) the bfloat16 row."""


def state_bytes(state_dtype: torch.dtype) -> int:
    """The state-bytes column of :data:`WRITE_THROUGH_BELOW` a pool of ``state_dtype`` is measured under: 4
    (float32) or 2 (bfloat16, float16)."""
    return 4 if state_dtype.itemsize >= 4 else 2


def write_through_max_requests(is_kda: bool, history: int, state_dtype: torch.dtype) -> int | None:
    """The most requests a served plain decode writes through (:data:`WRITE_THROUGH_BELOW`), None for every
    batch."""
    below = WRITE_THROUGH_BELOW[("kda" if is_kda else "gdn", max(history, 16), state_bytes(state_dtype))]
    return None if below is None else below - 1


def serves_write_through(requests: int, is_kda: bool, history: int, state_dtype: torch.dtype) -> bool:
    """Whether a served plain decode of ``requests`` requests writes through
    (:func:`write_through_max_requests`)."""
    most = write_through_max_requests(is_kda, history, state_dtype)
    return most is None or requests <= most


def replay_decode(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, b: torch.Tensor, checkpoints: torch.Tensor, state_indices: torch.Tensor,
                  ring: ReplayRing, record_indices: torch.Tensor, *, is_kda: bool, beta_activated: bool = False,
                  scale: float | None = None, round_beta: bool = False, write_through: bool | None = None,
                  **verify_options) -> torch.Tensor:
    """Plain decode of one token per request, cursor settled: :func:`replay_write_through` where
    ``write_through`` (default :func:`serves_write_through` for this batch), else :func:`~.verify.replay_verify`
    (``verify_options``: its keywords; the fold fused unless ``fused_fold=False``, when the caller folds first),
    then ``advance(ring, record_indices, 1, window=1)`` (``window=0`` without the fused fold). Returns ``o``
    ``[1, N, HV, V]``."""
    n = state_indices.shape[0]
    if write_through is None:
        write_through = serves_write_through(n, is_kda, ring.history, checkpoints.dtype)
    common = dict(is_kda=is_kda, beta_activated=beta_activated, scale=scale, round_beta=round_beta)
    if write_through:
        if verify_options:
            raise ValueError(f"{sorted(verify_options)}: options of the output-only path, not of a write-through")
        return replay_write_through(A_log, a, dt_bias, q, k, v, b, checkpoints, state_indices, ring, record_indices,
                                    **common)
    o = replay_verify(A_log, a, dt_bias, q, k, v, b, checkpoints, state_indices, ring, record_indices, **common,
                      **verify_options)
    advance(ring, record_indices, 1, window=1 if verify_options.get("fused_fold", True) else 0)
    return o
