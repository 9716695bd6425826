"""Triton kernels of the conv window with rollback by index move (``compact`` and ``replay`` modes).

A slot keeps a ring of ``W = K - 1 + D`` columns of pre-conv inputs (``K`` conv kernel width, ``D``
verify width, base token included) and an int32 offset; the committed conv state is columns
``(off + j) mod W``, ``j = 0 .. K - 2``, oldest first. Verify writes the window's raw inputs at
``(off + K - 1 + t) mod W`` (never a committed column), commit moves the offset by the accepted
length — no copy, no per-step windows, no scratch buffer.

Layouts (``transposed`` flag), one layer:

* GDN (``transposed=False``): ring ``[slots, conv_dim, W]`` (columns contiguous), canonical state
  ``[slots, conv_dim, K - 1]`` — SGLang's ``MambaPool.conv[0][layer]``;
* KDA (``transposed=True``): ring ``[slots, W, conv_dim]`` (channels contiguous), canonical state
  ``[slots, K - 1, conv_dim]`` — what ``KimiLinearStateShape`` allocates.

Kernels address everything through strides, so views (e.g. a slice of a bigger pool) work too.
Offsets are ``[slots]`` (one layer) or ``[layers, slots]``. Request rows address slots through
``slots [N]``; ``< 0`` is a padding row, which no kernel touches. The request count is the grid
(a runtime value), never a compile-time constant; ``T`` and ``N`` are not specialised either.

The arithmetic is SGLang 0.5.14's ``_causal_conv1d_update_kernel``, op for op: ``acc`` starts from
the float32 bias (or 0), adds ``x * w`` with the product in the operands' promoted dtype (bf16 x bf16
rounds to bf16 first, as there), in tap order oldest → newest, then ``acc / (1 + exp(-acc))``, stored
in the output's dtype. Inputs of the window's own tokens are read from ``x`` (not from the ring, whose
dtype may differ), as SGLang does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference.conv import ring_width


@triton.jit
def _round_to(p, DT: tl.constexpr):
    """float32 ``p`` rounded (to nearest even) to ``DT`` and widened back to float32. For bfloat16
    the rounding is done on the bits, so it is the GPU's conversion also under the CPU interpreter
    (whose float32 -> bfloat16 cast truncates); float16 uses the plain cast."""
    if DT == tl.bfloat16:
        bits = p.to(tl.uint32, bitcast=True)
        bits = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16) << 16
        p = bits.to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        p = p.to(tl.float16).to(tl.float32)
    return p


@triton.jit
def _cast(v, DT: tl.constexpr):
    """``v.to(DT)`` with round-to-nearest-even (see :func:`_round_to`)."""
    return _round_to(v.to(tl.float32), DT).to(DT)


@triton.jit
def _tap_product(a, b):
    """``a * b`` widened to float32, rounded as Triton's own ``a * b`` rounds: bf16 x bf16 (fp16 x
    fp16) is a bf16 (fp16) multiply. Computed as an exact float32 product (8 + 8 or 11 + 11 significant
    bits fit in 24) rounded once to the narrow type — the value a GPU's narrow multiply gives, and it
    also runs under the CPU interpreter, which cannot do bf16 arithmetic."""
    p = a.to(tl.float32) * b.to(tl.float32)
    if a.dtype == b.dtype:
        p = _round_to(p, a.dtype)
    elif a.dtype != tl.float32:
        if b.dtype != tl.float32:  # fp16 x bf16: Triton multiplies in fp16
            p = _round_to(p, tl.float16)
    return p


@triton.jit(do_not_specialize=["T"])
def conv_ring_verify_kernel(
    x, stride_x_seq, stride_x_dim, stride_x_tok,
    w, stride_w_dim, stride_w_tap,
    bias,
    ring, stride_r_slot, stride_r_dim, stride_r_col,
    offsets, slots,
    out, stride_o_seq, stride_o_dim, stride_o_tok,
    conv_dim, T, W,
    KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid ``(N, cdiv(conv_dim, BLOCK_N))``: one program per (request, channel block).

    ``x`` ``[N, conv_dim, T]`` (activation dtype, any strides); ``w`` ``[conv_dim, KW]``; ``bias``
    ``[conv_dim]`` or None; ``ring`` ``[slots, conv_dim, W]`` through its strides (KDA: pass the
    strides of the ``[slots, W, conv_dim]`` tensor's transposed view), float32 / bfloat16 / float16;
    ``offsets`` ``[slots]`` int32 (read only); ``slots`` ``[N]`` (``< 0``: padding row — nothing read,
    written or output); ``out`` ``[N, conv_dim, T]``. Writes token ``t``'s raw input (cast to the ring
    dtype) at column ``(off + KW - 1 + t) mod W``; needs ``KW - 1 + T <= W``.
    """
    i_n = tl.program_id(0)
    o_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = o_c < conv_dim
    slot = tl.load(slots + i_n).to(tl.int64)
    if slot >= 0:
        off = tl.load(offsets + slot).to(tl.int32)
        p_r = ring + slot * stride_r_slot + o_c * stride_r_dim
        p_x = x + i_n * stride_x_seq + o_c * stride_x_dim
        p_o = out + i_n * stride_o_seq + o_c * stride_o_dim
        if HAS_BIAS:
            acc0 = tl.load(bias + o_c, mask=mask, other=0.0).to(tl.float32)
        else:
            acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for t in range(0, T):
            acc = acc0
            for j in tl.static_range(KW):
                pos = t + j  # position in [committed state (KW - 1 columns), window tokens]
                in_state = pos < KW - 1
                b_w = tl.load(w + o_c * stride_w_dim + j * stride_w_tap, mask=mask, other=0.0)
                b_s = tl.load(p_r + ((off + pos) % W) * stride_r_col, mask=mask & in_state, other=0.0)
                b_x = tl.load(p_x + (pos - (KW - 1)) * stride_x_tok, mask=mask & (pos >= KW - 1), other=0.0)
                acc += tl.where(in_state, _tap_product(b_s, b_w), _tap_product(b_x, b_w))
            if SILU:
                acc = acc / (1 + tl.exp(-acc))
            tl.store(p_o + t * stride_o_tok, _cast(acc, out.dtype.element_ty), mask=mask)
            b_new = tl.load(p_x + t * stride_x_tok, mask=mask, other=0.0)
            tl.store(p_r + ((off + KW - 1 + t) % W) * stride_r_col, _cast(b_new, ring.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N"])
def conv_ring_commit_kernel(offsets, stride_off_layer, slots, accepted_len, N, W, BLOCK: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK), layers)``. ``offsets`` ``[layers, slots]`` int32 (row stride
    ``stride_off_layer``), ``slots`` / ``accepted_len`` ``[N]`` int: ``off = (off + n) mod W`` where
    ``slot >= 0`` and ``n > 0``; every other row (padding, nothing accepted) is left as it is."""
    o_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    layer = tl.program_id(1).to(tl.int64)
    mask = o_n < N
    slot = tl.load(slots + o_n, mask=mask, other=-1).to(tl.int64)
    n = tl.load(accepted_len + o_n, mask=mask, other=0).to(tl.int32)
    valid = mask & (slot >= 0) & (n > 0)
    p = offsets + layer * stride_off_layer + slot
    off = tl.load(p, mask=valid, other=0)
    tl.store(p, ((off + n) % W).to(off.dtype), mask=valid)


@triton.jit
def conv_ring_materialise_kernel(
    ring, stride_r_layer, stride_r_slot, stride_r_dim, stride_r_col,
    offsets, stride_off_layer, src_slots, advance,
    dst, stride_d_layer, stride_d_slot, stride_d_dim, stride_d_col, dst_slots,
    dst_offsets, stride_doff_layer,
    conv_dim, W,
    KW: tl.constexpr, NP2_KM1: tl.constexpr, HAS_ADVANCE: tl.constexpr, SET_DST_OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid ``(N, cdiv(conv_dim, BLOCK_N), layers)``. Copies columns ``(off + adv + j) mod W``,
    ``j < KW - 1``, of ring slot ``src_slots[i]`` to columns ``j`` of ``dst`` slot ``dst_slots[i]``
    (``[layers, slots', conv_dim, KW - 1]`` through strides, any float dtype: cast on store); rows with
    a negative source or destination are skipped. ``advance [N]`` (``HAS_ADVANCE``) reads the state that
    many tokens past the committed one. ``SET_DST_OFFSET``: ``dst`` is a view of a ring's first
    ``KW - 1`` columns and ``dst_offsets[layer, dst_slot]`` is set to 0 (source and destination slots
    of one ring must then differ)."""
    i_n = tl.program_id(0)
    i_c = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    src = tl.load(src_slots + i_n).to(tl.int64)
    dst_slot = tl.load(dst_slots + i_n).to(tl.int64)
    if (src >= 0) & (dst_slot >= 0):
        o_c = i_c * BLOCK_N + tl.arange(0, BLOCK_N)
        o_j = tl.arange(0, NP2_KM1)
        mask = (o_c < conv_dim)[:, None] & (o_j < KW - 1)[None, :]
        off = tl.load(offsets + layer * stride_off_layer + src).to(tl.int32)
        if HAS_ADVANCE:
            off += tl.load(advance + i_n).to(tl.int32)
        cols = (off + o_j) % W
        p_r = (ring + layer * stride_r_layer + src * stride_r_slot + o_c[:, None] * stride_r_dim
               + cols[None, :] * stride_r_col)
        b = tl.load(p_r, mask=mask, other=0.0)
        p_d = (dst + layer * stride_d_layer + dst_slot * stride_d_slot + o_c[:, None] * stride_d_dim
               + o_j[None, :] * stride_d_col)
        tl.store(p_d, _cast(b, dst.dtype.element_ty), mask=mask)
        if SET_DST_OFFSET:
            if i_c == 0:
                p_doff = dst_offsets + layer * stride_doff_layer + dst_slot
                tl.store(p_doff, tl.full([], 0, p_doff.dtype.element_ty))


@triton.jit
def conv_ring_load_kernel(
    src, stride_s_layer, stride_s_slot, stride_s_dim, stride_s_col, src_slots,
    ring, stride_r_layer, stride_r_slot, stride_r_dim, stride_r_col,
    offsets, stride_off_layer, dst_slots,
    conv_dim,
    KW: tl.constexpr, NP2_KM1: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid ``(N, cdiv(conv_dim, BLOCK_N), layers)``. Copies the canonical state ``src`` slot
    ``src_slots[i]`` (``[layers, slots', conv_dim, KW - 1]`` through strides) into columns
    ``0 .. KW - 2`` of ring slot ``dst_slots[i]`` (cast to the ring dtype) and sets its offset to 0;
    the ring's other columns are left as they are; rows with a negative index are skipped."""
    i_n = tl.program_id(0)
    i_c = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    s = tl.load(src_slots + i_n).to(tl.int64)
    d = tl.load(dst_slots + i_n).to(tl.int64)
    if (s >= 0) & (d >= 0):
        o_c = i_c * BLOCK_N + tl.arange(0, BLOCK_N)
        o_j = tl.arange(0, NP2_KM1)
        mask = (o_c < conv_dim)[:, None] & (o_j < KW - 1)[None, :]
        p_s = (src + layer * stride_s_layer + s * stride_s_slot + o_c[:, None] * stride_s_dim
               + o_j[None, :] * stride_s_col)
        b = tl.load(p_s, mask=mask, other=0.0)
        p_r = (ring + layer * stride_r_layer + d * stride_r_slot + o_c[:, None] * stride_r_dim
               + o_j[None, :] * stride_r_col)
        tl.store(p_r, _cast(b, ring.dtype.element_ty), mask=mask)
        if i_c == 0:
            p_off = offsets + layer * stride_off_layer + d
            tl.store(p_off, tl.full([], 0, p_off.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# Python wrappers

def _channel_major(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    return t.transpose(-1, -2) if transposed else t


def _with_layers(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Add a leading layer dim of 1 when ``t`` has ``ndim - 1`` dims."""
    if t.dim() == ndim - 1:
        return t.unsqueeze(0)
    if t.dim() != ndim:
        raise ValueError(f"expected {ndim - 1} or {ndim} dims, got shape {tuple(t.shape)}")
    return t


def conv_ring_verify(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ring: torch.Tensor,
                     offsets: torch.Tensor, slots: torch.Tensor, *, activation: str | bool | None = "silu",
                     transposed: bool = False, out: torch.Tensor | None = None, block_n: int = 256) -> torch.Tensor:
    """Conv outputs of a window of ``T`` tokens per request, writing the tokens' raw inputs into the
    ring's free columns (the committed state and the offsets are not changed).

    ``x`` ``[N, conv_dim, T]`` — SGLang's ``mixed_qkv.view(N, T, -1).transpose(1, 2)`` — or
    ``[N, conv_dim]`` (decode, T = 1), activation dtype; ``weight`` ``[conv_dim, K]``; ``bias``
    ``[conv_dim]`` or None; ``ring`` one layer, ``[slots, conv_dim, W]`` (``transposed``:
    ``[slots, W, conv_dim]``, KDA), float32 / bfloat16 / float16; ``offsets`` ``[slots]`` int32;
    ``slots`` ``[N]`` int (``< 0``: padding row — its output is left unwritten, as SGLang's kernel
    does). ``activation``: ``"silu"`` / ``"swish"`` / True, or None / False. Returns ``out``, shaped
    like ``x`` (``torch.empty_like(x)`` unless given).
    """
    if isinstance(activation, str) and activation not in ("silu", "swish"):
        raise ValueError(f"activation {activation!r}: only silu / swish / None")
    silu = activation is True or activation in ("silu", "swish")
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(-1) if squeeze else x
    n, conv_dim, t_len = x3.shape
    if out is None:
        out = torch.empty_like(x)
    o3 = out.unsqueeze(-1) if squeeze else out
    kw = weight.shape[1]
    r = _channel_major(ring, transposed)
    if r.dim() != 3 or r.shape[1] != conv_dim or weight.shape[0] != conv_dim:
        raise ValueError(f"ring {tuple(ring.shape)} (transposed={transposed}), weight {tuple(weight.shape)} "
                         f"do not fit x with {conv_dim} channels")
    width = r.shape[2]
    if kw - 1 + t_len > width:
        raise ValueError(f"a window of {t_len} tokens needs {kw - 1 + t_len} ring columns, the ring has {width}")
    if slots.shape != (n,) or offsets.dim() != 1:
        raise ValueError("slots must be [N] and offsets [slots] (one layer)")
    if n == 0:
        return out
    block = min(block_n, triton.next_power_of_2(conv_dim))
    grid = (n, triton.cdiv(conv_dim, block))
    conv_ring_verify_kernel[grid](
        x3, *x3.stride(), weight, *weight.stride(), bias,
        r, *r.stride(), offsets, slots, o3, *o3.stride(),
        conv_dim, t_len, width,
        KW=kw, HAS_BIAS=bias is not None, SILU=silu, BLOCK_N=block)
    return out


def conv_ring_commit(offsets: torch.Tensor, slots: torch.Tensor, accepted_len: torch.Tensor, width: int,
                     block: int = 128) -> None:
    """Commit accepted lengths in place: ``offsets[..., slot] = (off + n) mod W`` for rows with
    ``slot >= 0`` and ``n > 0`` (no data moves, no host sync). ``offsets`` ``[slots]`` or
    ``[layers, slots]`` int32 (all layers advance together); ``slots``, ``accepted_len`` ``[N]`` int
    (``n`` counts the base token: SGLang's ``last_correct_step_indices + 1``; ``n <= D``)."""
    off2 = _with_layers(offsets, 2)
    n = slots.shape[0]
    if n == 0:
        return
    grid = (triton.cdiv(n, block), off2.shape[0])
    conv_ring_commit_kernel[grid](off2, off2.stride(0), slots, accepted_len, n, width, BLOCK=block)


def conv_ring_materialise(ring: torch.Tensor, offsets: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor,
                          dst_slots: torch.Tensor, kernel_width: int, *, transposed: bool = False,
                          advance: torch.Tensor | None = None, dst_offsets: torch.Tensor | None = None,
                          block_n: int = 256) -> None:
    """Write the committed (canonical) conv state of ring slots ``src_slots [N]`` into ``dst`` slots
    ``dst_slots [N]``; the ring and its offsets are not changed (negative index: row skipped).

    ``ring`` ``[slots, conv_dim, W]`` or ``[layers, slots, conv_dim, W]`` (``transposed``:
    ``[..., W, conv_dim]``); ``offsets`` ``[slots]`` / ``[layers, slots]``; ``dst`` canonical
    ``[slots', conv_dim, K - 1]`` / ``[layers, slots', conv_dim, K - 1]`` (``transposed``:
    ``[..., K - 1, conv_dim]``) — SGLang's conv pool, a host pool, a PD buffer — any float dtype.
    ``advance [N]`` (optional) materialises the state that many window tokens past the committed one
    (a tracked step, before its commit). ``dst_offsets``: ``dst`` is the first ``K - 1`` columns of a
    ring (e.g. ``ring[..., :K-1]``) whose offsets are set to 0 for the written slots — a ring-to-ring
    copy with no temporary (source and destination slots must differ).
    """
    r = _with_layers(_channel_major(ring, transposed), 4)
    d = _with_layers(_channel_major(dst, transposed), 4)
    off2 = _with_layers(offsets, 2)
    n = src_slots.shape[0]
    layers, _, conv_dim, width = r.shape
    if d.shape[0] != layers or d.shape[2] != conv_dim or d.shape[3] != kernel_width - 1:
        raise ValueError(f"dst {tuple(dst.shape)} does not fit ring {tuple(ring.shape)} with K = {kernel_width}")
    if n == 0:
        return
    doff = _with_layers(dst_offsets, 2) if dst_offsets is not None else None
    block = min(block_n, triton.next_power_of_2(conv_dim))
    grid = (n, triton.cdiv(conv_dim, block), layers)
    conv_ring_materialise_kernel[grid](
        r, *r.stride(), off2, off2.stride(0), src_slots, advance,
        d, *d.stride(), dst_slots, doff, doff.stride(0) if doff is not None else 0,
        conv_dim, width,
        KW=kernel_width, NP2_KM1=triton.next_power_of_2(kernel_width - 1), HAS_ADVANCE=advance is not None,
        SET_DST_OFFSET=doff is not None, BLOCK_N=block)


def conv_ring_load(src: torch.Tensor, src_slots: torch.Tensor, ring: torch.Tensor, offsets: torch.Tensor,
                   dst_slots: torch.Tensor, *, transposed: bool = False, block_n: int = 256) -> None:
    """Load canonical conv states ``src`` slots ``src_slots [N]`` into ring slots ``dst_slots [N]`` at
    offset 0 (columns ``0 .. K - 2``; the other columns are left as they are) and set those offsets to
    0 — after prefill (SGLang's ``causal_conv1d_fn`` writes a canonical state) or a restore.

    ``src`` ``[slots', conv_dim, K - 1]`` / ``[layers, slots', conv_dim, K - 1]`` (``transposed``:
    ``[..., K - 1, conv_dim]``); ``ring`` / ``offsets`` as :func:`conv_ring_materialise`.
    """
    s = _with_layers(_channel_major(src, transposed), 4)
    r = _with_layers(_channel_major(ring, transposed), 4)
    off2 = _with_layers(offsets, 2)
    n = src_slots.shape[0]
    layers, _, conv_dim, _ = r.shape
    kernel_width = s.shape[3] + 1
    if s.shape[0] != layers or s.shape[2] != conv_dim or r.shape[3] < kernel_width - 1:
        raise ValueError(f"src {tuple(src.shape)} does not fit ring {tuple(ring.shape)}")
    if n == 0:
        return
    block = min(block_n, triton.next_power_of_2(conv_dim))
    grid = (n, triton.cdiv(conv_dim, block), layers)
    conv_ring_load_kernel[grid](
        s, *s.stride(), src_slots, r, *r.stride(), off2, off2.stride(0), dst_slots, conv_dim,
        KW=kernel_width, NP2_KM1=triton.next_power_of_2(kernel_width - 1), BLOCK_N=block)
