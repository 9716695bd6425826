"""Triton building blocks shared by the modes' kernels: SGLang 0.5.14's gate and delta-rule step,
op for op as ``fused_sigmoid_gating_delta_rule_update_kernel`` computes them (float32), so that every
kernel built from them rounds and reduces exactly like the native one. Inlined by Triton."""

import triton
import triton.language as tl


@triton.jit
def decay_gate(p_A_log, p_a, p_dt_bias, mask_k, softplus_beta, softplus_threshold, IS_KDA: tl.constexpr):
    """``g = -exp(A_log) * softplus(a + dt_bias)`` float32 (scalar for GDN, ``[BK]`` at ``mask_k`` for KDA)
    from one token's pointers."""
    b_A_log = tl.load(p_A_log).to(tl.float32)
    if IS_KDA:
        b_a = tl.load(p_a, mask=mask_k, other=0).to(tl.float32)
        b_dt_bias = tl.load(p_dt_bias, mask=mask_k, other=0).to(tl.float32)
    else:
        b_a = tl.load(p_a).to(tl.float32)
        b_dt_bias = tl.load(p_dt_bias).to(tl.float32)
    x = b_a + b_dt_bias
    beta_x = softplus_beta * x
    softplus_x = tl.where(beta_x <= softplus_threshold, (1.0 / softplus_beta) * tl.log(1.0 + tl.exp(beta_x)), x)
    return -tl.exp(b_A_log) * softplus_x


@triton.jit
def beta_gate(p_b, BETA_ACTIVATED: tl.constexpr):
    """``beta = 1 / (1 + exp(-b))`` float32 (or ``b`` itself when ``BETA_ACTIVATED``) of one token."""
    if BETA_ACTIVATED:
        b_beta = tl.load(p_b).to(tl.float32)
    else:
        b_beta = 1.0 / (1.0 + tl.exp(-tl.load(p_b).to(tl.float32)))
    return b_beta


@triton.jit
def packed_beta(b_beta, b, ROUND_BETA: tl.constexpr):
    """``beta`` as SGLang 0.5.14's GDN packed decode kernel uses it when ``ROUND_BETA``: sigmoid(b) rounded
    to the dtype of ``b`` (the gate's input pointer) and back to float32; else ``beta`` unchanged."""
    if ROUND_BETA:
        b_beta = b_beta.to(b.dtype.element_ty).to(tl.float32)
    return b_beta


@triton.jit
def gate_and_beta(p_A_log, p_a, p_dt_bias, p_b, mask_k, softplus_beta, softplus_threshold,
                  IS_KDA: tl.constexpr, BETA_ACTIVATED: tl.constexpr):
    """:func:`decay_gate` and :func:`beta_gate` of one token: ``(g, beta)``."""
    return (decay_gate(p_A_log, p_a, p_dt_bias, mask_k, softplus_beta, softplus_threshold, IS_KDA),
            beta_gate(p_b, BETA_ACTIVATED))


@triton.jit
def l2normalize(b_x):
    """``x / sqrt(sum(x * x) + 1e-6)`` (SGLang's in-kernel L2 norm)."""
    return b_x / (tl.sqrt(tl.sum(b_x * b_x) + 1e-6))


@triton.jit
def l2normalize_rows(b_x):
    """Each row of ``b_x`` ``[R, K]`` normalised as :func:`l2normalize` normalises a vector."""
    return b_x / tl.sqrt(tl.sum(b_x * b_x, 1) + 1e-6)[:, None]


@triton.jit
def delta_rule_update_u(b_h, b_k, b_v, b_g, b_beta, IS_KDA: tl.constexpr):
    """One token of the gated delta rule on a ``[BK, BV]`` float32 state tile ``b_h`` (``h[k, v]``)
    with normalised ``b_k`` ``[BK]``, ``b_v`` ``[BV]``: ``h *= exp(g); v -= sum_k h k; v *= beta;
    h += k v^T``. Returns the new tile and the token's update ``u = beta (v - h k)`` ``[BV]`` (the
    ``u`` a replay ring records)."""
    if IS_KDA:
        b_h *= tl.exp(b_g[:, None])
    else:
        b_h *= tl.exp(b_g)
    b_v -= tl.sum(b_h * b_k[:, None], 0)
    b_v *= b_beta
    b_h += b_k[:, None] * b_v[None, :]
    return b_h, b_v


@triton.jit
def delta_rule_update(b_h, b_k, b_v, b_g, b_beta, IS_KDA: tl.constexpr):
    """:func:`delta_rule_update_u`'s new tile alone."""
    b_h, _ = delta_rule_update_u(b_h, b_k, b_v, b_g, b_beta, IS_KDA)
    return b_h


@triton.jit
def load_record(rec_k, rec_v, rec_g, rec_beta, pos, live, i_h, i_hv, o_k, o_v, mask_k, mask_v, H: tl.constexpr,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, IS_KDA: tl.constexpr):
    """The stored inputs of one token at record position ``pos`` of ``[*, H, K]`` raw keys, ``[*, HV, V]``
    raw values, ``[*, HV(, K)]`` gates and ``[*, HV]`` betas (compact records and replay rings share this
    layout): ``(raw k, raw v, g, beta)``, zeros where ``live`` is false (a prefetch past the end)."""
    b_k = tl.load(rec_k + (pos * H + i_h) * K + o_k, mask=mask_k & live, other=0)
    b_v = tl.load(rec_v + (pos * HV + i_hv) * V + o_v, mask=mask_v & live, other=0)
    b_beta = tl.load(rec_beta + pos * HV + i_hv, mask=live, other=0)
    if IS_KDA:
        b_g = tl.load(rec_g + (pos * HV + i_hv) * K + o_k, mask=mask_k & live, other=0)
    else:
        b_g = tl.load(rec_g + pos * HV + i_hv, mask=live, other=0)
    return b_k, b_v, b_g, b_beta


@triton.jit
def apply_record(b_h, rec_k, rec_v, rec_g, rec_beta, pos, i_h, i_hv, o_k, o_v, mask_k, mask_v, H: tl.constexpr,
                 HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, IS_KDA: tl.constexpr):
    """One token of the native recurrence from a stored record at position ``pos`` (:func:`load_record`;
    the raw key re-normalised here). Returns the new float32 tile."""
    b_k, b_v, b_g, b_beta = load_record(rec_k, rec_v, rec_g, rec_beta, pos, True, i_h, i_hv, o_k, o_v, mask_k,
                                        mask_v, H, HV, K, V, IS_KDA)
    return delta_rule_update(b_h, l2normalize(b_k.to(tl.float32)), b_v.to(tl.float32), b_g, b_beta, IS_KDA)


@triton.jit
def apply_records(b_h, rec_k, rec_v, rec_g, rec_beta, pos0, n_rec, i_h, i_hv, o_k, o_v, mask_k, mask_v,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, IS_KDA: tl.constexpr):
    """The native recurrence over the consecutive records ``pos0 .. pos0 + n_rec`` on a float32 ``[BK, BV]``
    tile, each record's loads issued one step ahead (the recurrence is sequential; its inputs are not), so
    a step waits on arithmetic, not on memory. Same ops, same result as :func:`apply_record` in a loop."""
    n_k, n_v, n_g, n_beta = load_record(rec_k, rec_v, rec_g, rec_beta, pos0, n_rec > 0, i_h, i_hv, o_k, o_v, mask_k,
                                        mask_v, H, HV, K, V, IS_KDA)
    for j in range(0, n_rec):
        b_k, b_v, b_g, b_beta = n_k, n_v, n_g, n_beta
        n_k, n_v, n_g, n_beta = load_record(rec_k, rec_v, rec_g, rec_beta, pos0 + j + 1, j + 1 < n_rec, i_h, i_hv,
                                            o_k, o_v, mask_k, mask_v, H, HV, K, V, IS_KDA)
        b_h = delta_rule_update(b_h, l2normalize(b_k.to(tl.float32)), b_v.to(tl.float32), b_g, b_beta, IS_KDA)
    return b_h


@triton.jit
def tree_ancestors(p_parents, stride_tok, node, max_depth, NP2_D: tl.constexpr):
    """Walk a draft tree up from ``node`` to the root (node 0) through one request's
    ``retrieve_parent_token`` row (``p_parents``, element stride ``stride_tok``). Returns
    ``(anc, depth)``: ``anc[j]`` the j-th ancestor (``anc[0] = node``, ``anc[depth] = 0``), ``[NP2_D]``
    int32, looking at most ``max_depth`` links up. A parent always precedes its child in SGLang's
    draft order, so each link is clamped into ``[0, cur - 1]``: a row whose parents were never
    written (a padding row: SGLang's conv kernel skips it, leaving ``torch.empty`` contents) still
    walks in bounds to the root, and a real tree is unchanged."""
    o_d = tl.arange(0, NP2_D)
    anc = tl.zeros([NP2_D], dtype=tl.int32)
    cur = tl.cast(node, tl.int32)
    depth = 0
    for j in range(0, max_depth):
        anc = tl.where(o_d == j, cur, anc)
        if cur != 0:
            parent = tl.load(p_parents + cur * stride_tok).to(tl.int32)
            cur = tl.minimum(tl.maximum(parent, 0), cur - 1)
            depth += 1
    return anc, depth


@triton.jit
def store_key_record(rec_k, rec_g, rec_beta, pos, i_h, i_hv, writes_k, writes_gate, o_k, mask_k, b_k_raw, b_g,
                     b_beta, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, IS_KDA: tl.constexpr):
    """Store one token's key-side raw inputs at record position ``pos`` of ``[*, H, K]`` / ``[*, HV, Kg]`` /
    ``[*, HV]`` buffers: raw k where ``writes_k`` (once per key head), g and beta where ``writes_gate``."""
    tl.store(rec_k + (pos * H + i_h) * K + o_k, b_k_raw, mask=mask_k & writes_k)
    if IS_KDA:
        tl.store(rec_g + (pos * HV + i_hv) * K + o_k, b_g, mask=mask_k & writes_gate)
    else:
        tl.store(rec_g + pos * HV + i_hv, b_g, mask=writes_gate)
    tl.store(rec_beta + pos * HV + i_hv, b_beta, mask=writes_gate)


@triton.jit
def store_raw_record(rec_k, rec_v, rec_g, rec_beta, pos, i_h, i_hv, first_v_block, writes_k, o_k, o_v, mask_k, mask_v,
                     b_k_raw, b_v_raw, b_g, b_beta, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, IS_KDA: tl.constexpr):
    """Store one token's raw inputs at record position ``pos``: the key side (:func:`store_key_record`;
    g and beta from the first value block) and this program's block of raw v in ``[*, HV, V]``."""
    store_key_record(rec_k, rec_g, rec_beta, pos, i_h, i_hv, writes_k, first_v_block, o_k, mask_k, b_k_raw, b_g,
                     b_beta, H, HV, K, IS_KDA)
    tl.store(rec_v + (pos * HV + i_hv) * V + o_v, b_v_raw, mask=mask_v)


@triton.jit
def gate_vector(p_A_log, p_a, p_dt_bias, p_b, mask_k, softplus_beta, softplus_threshold, BK: tl.constexpr,
                IS_KDA: tl.constexpr, BETA_ACTIVATED: tl.constexpr):
    """``(g, g as a [BK] vector, beta)`` of one token: KDA's per-channel gate, or GDN's scalar and
    its broadcast (:func:`gate_and_beta`)."""
    b_g, b_beta = gate_and_beta(p_A_log, p_a, p_dt_bias, p_b, mask_k, softplus_beta, softplus_threshold, IS_KDA,
                                BETA_ACTIVATED)
    if IS_KDA:
        b_gv = b_g
    else:
        b_gv = tl.zeros([BK], dtype=tl.float32) + b_g
    return b_g, b_gv, b_beta


@triton.jit
def token_gate(p_A_log, p_a, dt_bias, i_hv, o_k, softplus_beta, softplus_threshold, K: tl.constexpr,
               IS_KDA: tl.constexpr):
    """One token's log-decay ``g`` for value head ``i_hv`` from its row ``p_a`` of ``a``
    (:func:`decay_gate`): KDA's at the K rows ``o_k``, GDN's scalar."""
    if IS_KDA:
        return decay_gate(p_A_log, p_a + i_hv * K + o_k, dt_bias + i_hv * K + o_k, o_k < K, softplus_beta,
                          softplus_threshold, IS_KDA)
    else:
        return decay_gate(p_A_log, p_a + i_hv, dt_bias + i_hv, o_k < K, softplus_beta, softplus_threshold, IS_KDA)


@triton.jit
def token_inputs(A_log, a, dt_bias, q, k, v, b, row, i_h, i_hv, o_k, o_v, mask_v, softplus_beta, softplus_threshold,
                 stride_a, stride_q, stride_k, stride_v, stride_b, K: tl.constexpr, V: tl.constexpr,
                 IS_KDA: tl.constexpr, BETA_ACTIVATED: tl.constexpr, ROUND_BETA: tl.constexpr):
    """The inputs of the token at flat row ``row`` for value head ``i_hv`` (key head ``i_h``) and this program's
    value columns ``o_v``: ``(q float32, raw k, raw v, g, beta)`` — q and k not yet normalised, g as
    :func:`token_gate`, beta as SGLang's decode (``ROUND_BETA``: its packed kernel's rounding)."""
    b_q = tl.load(q + row * stride_q + i_h * K + o_k).to(tl.float32)
    b_k_raw = tl.load(k + row * stride_k + i_h * K + o_k)
    b_v_raw = tl.load(v + row * stride_v + i_hv * V + o_v, mask=mask_v, other=0)
    b_g = token_gate(A_log + i_hv, a + row * stride_a, dt_bias, i_hv, o_k, softplus_beta, softplus_threshold, K,
                     IS_KDA)
    b_beta = packed_beta(beta_gate(b + row * stride_b + i_hv, BETA_ACTIVATED), b, ROUND_BETA)
    return b_q, b_k_raw, b_v_raw, b_g, b_beta
