"""Reference (plain torch) of the causal-conv window: SGLang 0.5.14's native update, and the ring
with rollback by index move that ``compact`` and ``replay`` use.

Native (``causal_conv1d_update`` in ``layers/attention/mamba/causal_conv1d_triton.py``)
---------------------------------------------------------------------------------------
Per request and layer SGLang keeps the last ``K - 1`` pre-conv inputs (``K`` = conv kernel width, 4
for Qwen3-Next and Kimi-Linear). The pool tensor ``MambaPool.conv[0]`` is
``[layers, slots + 1, conv_dim, K - 1]`` for GDN (column index contiguous) and
``[layers, slots + 1, K - 1, conv_dim]`` for KDA (``KimiLinearStateShape`` swaps the two; the KDA
backend hands SGLang's kernels ``conv_states.transpose(-1, -2)``, a ``[conv_dim, K - 1]`` view with
channels contiguous). Column ``K - 2`` is the newest input. A token's output is::

    acc = bias (float32) or 0
    for j in 0 .. K-1:  acc += x_{t-K+1+j} * w[:, j]   # product in the operands' promoted dtype
    out = acc / (1 + exp(-acc))  (SiLU; skipped without activation), stored in x's dtype

where ``x_{t-K+1+j}`` comes from the state while the index is negative. Target verify of a window of
``T`` tokens stores the window after every token (``intermediate_conv_window[step]`` = the last
``K - 1`` inputs after consuming token ``step``) and acceptance copies step ``n - 1`` back.

Ring (``compact`` / ``replay``)
-------------------------------
The slot keeps ``W = K - 1 + D`` columns (``D`` = verify width, base token included) and an int32
offset per slot: the committed state is columns ``(off + j) mod W``, ``j = 0 .. K - 2`` (oldest
first). Ring tensors are ``[slots, conv_dim, W]`` (GDN layout) or ``[slots, W, conv_dim]``
(``transposed=True``, KDA layout); offsets ``[slots]`` int32; requests address slots through
``slots [N]`` (``< 0``: padding row, touched nowhere).

* verify of ``T <= D`` tokens: outputs as native; token ``t``'s raw input goes to column
  ``(off + K - 1 + t) mod W`` (never one of the committed columns);
* commit of accepted length ``n`` (base token included): ``off = (off + n) mod W``; ``n = 0`` or a
  padding row changes nothing;
* materialise: the canonical ``[conv_dim, K - 1]`` (or transposed) state into destination slots;
* load: a canonical state into the ring at offset 0.

Every function here works on copies and returns new tensors; any dtype (the float32 accumulation
and the product's dtype follow the Triton kernels so that they agree bit for bit).
"""

from __future__ import annotations

import torch


def _as_channel_major(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """View ``[..., cols, conv_dim]`` (transposed) as ``[..., conv_dim, cols]``; identity otherwise."""
    return t.transpose(-1, -2) if transposed else t


def conv_token(acc_init: torch.Tensor, taps: list[torch.Tensor], weight: torch.Tensor,
               activation: bool, exp=torch.exp) -> torch.Tensor:
    """One output column, in the kernels' op order: ``acc = acc_init``; ``acc += (tap_j * w[:, j])``
    with the product rounded as Triton's ``a * b`` rounds (:func:`tap_product`), then widened to float32;
    SiLU as ``acc / (1 + exp(-acc))``. ``taps`` K tensors ``[N, conv_dim]`` (oldest first),
    ``weight`` ``[conv_dim, K]``. Returns float32 ``[N, conv_dim]``. ``exp`` replaces ``torch.exp``
    (float32 ``exp`` is not correctly rounded and differs between libraries by an ulp: pass the
    kernel backend's own to compare bit for bit, e.g. numpy's for the Triton CPU interpreter)."""
    acc = acc_init
    for j, tap in enumerate(taps):
        acc = acc + tap_product(tap, weight[:, j])
    if activation:
        acc = acc / (1 + exp(-acc))
    return acc


def tap_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b`` as float32, rounded as Triton's ``a * b`` rounds: in the operands' dtype when they share one,
    in float32 when either is float32, and in float16 for a bfloat16 x float16 product (torch would promote
    that pair to float32) — the exact float32 product (8 + 11 significant bits fit in 24) rounded once."""
    narrow = {torch.bfloat16, torch.float16}
    if a.dtype != b.dtype and a.dtype in narrow and b.dtype in narrow:
        return (a.to(torch.float32) * b.to(torch.float32)).to(torch.float16).to(torch.float32)
    return (a * b).to(torch.float32)


def _acc_init(n: int, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None:
        return torch.zeros(n, weight.shape[0], dtype=torch.float32, device=weight.device)
    return bias.to(torch.float32).expand(n, -1)


def native_conv_update(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, activation: bool = True, exp=torch.exp
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's native conv update of a window of T tokens (decode: T = 1).

    ``state`` ``[N, conv_dim, K - 1]`` (conv dtype; newest column last), ``x`` ``[N, conv_dim, T]``
    (activation dtype), ``weight`` ``[conv_dim, K]``, ``bias`` ``[conv_dim]`` or None; ``exp`` as
    :func:`conv_token`.
    Returns ``(out [N, conv_dim, T] in x.dtype, windows [N, T, conv_dim, K - 1] in state.dtype)``
    where ``windows[:, t]`` is the state after consuming token t (SGLang's
    ``intermediate_conv_window``; ``windows[:, T - 1]`` is what plain decode stores).
    """
    n, _, t_len = x.shape
    k = weight.shape[1]
    seq = [state[:, :, j] for j in range(k - 1)] + [x[:, :, t] for t in range(t_len)]
    acc0 = _acc_init(n, weight, bias)
    outs, windows = [], []
    for t in range(t_len):
        outs.append(conv_token(acc0, seq[t:t + k], weight, activation, exp).to(x.dtype))
        windows.append(torch.stack([c.to(state.dtype) for c in seq[t + 1:t + k]], -1))
    return torch.stack(outs, -1), torch.stack(windows, 1)


def native_accept(state: torch.Tensor, windows: torch.Tensor, accepted_len: torch.Tensor) -> torch.Tensor:
    """SGLang's acceptance (``fused_conv_window_scatter_with_mask``): row i takes
    ``windows[i, n_i - 1]`` where ``n_i >= 1``, else keeps ``state[i]``. Returns the new
    ``[N, conv_dim, K - 1]`` states."""
    new = state.clone()
    for i in range(state.shape[0]):
        if int(accepted_len[i]) > 0:
            new[i] = windows[i, int(accepted_len[i]) - 1]
    return new


def ring_width(kernel_width: int, draft_tokens: int) -> int:
    """Columns per slot: ``K - 1`` committed plus ``D`` written by a verify of width ``D``."""
    return kernel_width - 1 + draft_tokens


def ring_canonical(ring: torch.Tensor, offsets: torch.Tensor, slot: int, kernel_width: int,
                   transposed: bool = False, advance: int = 0) -> torch.Tensor:
    """The committed state of one slot, canonical ``[conv_dim, K - 1]`` (channel-major, whatever the
    ring layout): columns ``(off + advance + j) mod W``."""
    r = _as_channel_major(ring[slot], transposed)
    w = r.shape[-1]
    cols = [(int(offsets[slot]) + advance + j) % w for j in range(kernel_width - 1)]
    return r[:, cols]


def ring_verify(ring: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None = None, activation: bool = True,
                transposed: bool = False, exp=torch.exp) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a window of ``T`` tokens per request against the ring.

    ``ring`` ``[slots, conv_dim, W]`` (``transposed``: ``[slots, W, conv_dim]``), ``offsets``
    ``[slots]``, ``slots`` ``[N]`` (``< 0``: padding), ``x`` ``[N, conv_dim, T]``. Returns
    ``(out [N, conv_dim, T] in x.dtype — zeros on padding rows, new ring)``; the new ring holds
    token t at column ``(off + K - 1 + t) mod W``, every other column unchanged.
    """
    n, conv_dim, t_len = x.shape
    k = weight.shape[1]
    ring = ring.clone()
    rv = _as_channel_major(ring, transposed)
    w = rv.shape[-1]
    if k - 1 + t_len > w:
        raise ValueError(f"a window of {t_len} tokens needs {k - 1 + t_len} ring columns, the ring has {w}")
    out = torch.zeros_like(x)
    for i in range(n):
        s = int(slots[i])
        if s < 0:
            continue
        off = int(offsets[s])
        state = rv[s][:, [(off + j) % w for j in range(k - 1)]]
        o, _ = native_conv_update(state[None], x[i:i + 1], weight, bias, activation, exp)
        out[i] = o[0]
        for t in range(t_len):
            rv[s][:, (off + k - 1 + t) % w] = x[i, :, t].to(ring.dtype)
    return out, ring


def ring_commit(offsets: torch.Tensor, slots: torch.Tensor, accepted_len: torch.Tensor, width: int) -> torch.Tensor:
    """``off[slot] = (off[slot] + n) mod W`` for rows with ``slot >= 0`` and ``n > 0``; returns new
    offsets (any leading layer dims: ``offsets [..., slots]``)."""
    offsets = offsets.clone()
    for i in range(slots.shape[0]):
        s, a = int(slots[i]), int(accepted_len[i])
        if s >= 0 and a > 0:
            offsets[..., s] = (offsets[..., s] + a) % width
    return offsets


def ring_materialise(ring: torch.Tensor, offsets: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor,
                     dst_slots: torch.Tensor, kernel_width: int, transposed: bool = False,
                     advance: torch.Tensor | None = None) -> torch.Tensor:
    """Write the canonical state of ``src_slots[i]`` into ``dst[dst_slots[i]]`` (``dst``
    ``[slots', conv_dim, K - 1]``, ``transposed``: ``[slots', K - 1, conv_dim]``); rows with a
    negative source or destination are skipped. ``advance [N]`` (optional) reads the state ``advance``
    tokens past the committed one (e.g. a tracked step before its commit). Returns the new ``dst``."""
    dst = dst.clone()
    dv = _as_channel_major(dst, transposed)
    for i in range(src_slots.shape[0]):
        s, d = int(src_slots[i]), int(dst_slots[i])
        if s < 0 or d < 0:
            continue
        adv = 0 if advance is None else int(advance[i])
        dv[d] = ring_canonical(ring, offsets, s, kernel_width, transposed, adv).to(dst.dtype)
    return dst


def ring_load(ring: torch.Tensor, offsets: torch.Tensor, src: torch.Tensor, src_slots: torch.Tensor,
              dst_slots: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Write canonical states ``src[src_slots[i]]`` (``[slots', conv_dim, K - 1]``, transposed for
    KDA) into ring slot ``dst_slots[i]`` at columns ``0 .. K - 2`` and set its offset to 0; other
    columns are left as they are. Returns ``(new ring, new offsets)``."""
    ring, offsets = ring.clone(), offsets.clone()
    rv = _as_channel_major(ring, transposed)
    sv = _as_channel_major(src, transposed)
    km1 = sv.shape[-1]
    for i in range(src_slots.shape[0]):
        s, d = int(src_slots[i]), int(dst_slots[i])
        if s < 0 or d < 0:
            continue
        rv[d][:, :km1] = sv[s].to(ring.dtype)
        offsets[d] = 0
    return ring, offsets
