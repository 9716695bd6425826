"""The replay mode's per-request history: a ring of 2·L records with a cursor, double-buffered.

Records since the checkpoint live in one half of the ring (``phase`` selects it: positions
``phase * L .. phase * L + count``); a fold replays them into the checkpoint, sets ``count`` to 0 and
flips ``phase``, so records a concurrently running fold still reads are never overwritten by the
next window. With a fold before every window that would overflow (``count + D > L``) a window's
records always fit in the current half.

Each slot also keeps two int32 words for observability: ``folds``, how many times its history has
been folded (cumulative: the served pool's fold counter), and ``faults``, bit flags the kernels set
instead of failing mid-forward — :data:`FAULT_NONFINITE` (a fold produced a non-finite state: it is
written, as native would propagate it, and reported) and :data:`FAULT_OVERFLOW` (a cursor past L,
impossible by construction: the cheap check of that invariant). Both are read asynchronously by the
integration's metrics (``sglang_ssm_modes.integration.metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

FAULT_NONFINITE = 1
"""``faults`` bit: a fold of this slot's history produced a non-finite value."""
FAULT_OVERFLOW = 2
"""``faults`` bit: an acceptance moved this slot's cursor past L (the ring's invariant broken)."""
_NONFINITE = tl.constexpr(FAULT_NONFINITE)  # the bits as the kernels see them
_OVERFLOW = tl.constexpr(FAULT_OVERFLOW)


@dataclass(frozen=True)
class ReplayRing:
    """Ring buffers for ``R`` record slots, history ``L`` (2·L records each).

    * ``u`` ``[R, 2L, HV, V]`` float32: the delta-rule update ``beta (v - S k)`` of each token;
    * ``k_norm`` ``[R, 2L, HK, K]`` float32: the L2-normalised key, per key head (GQA-shared);
    * ``g`` ``[R, 2L, HV, Kg]`` float32: log-decay (Kg = 1 GDN, K KDA); ``beta`` ``[R, 2L, HV]`` float32;
    * ``k_raw`` ``[R, 2L, HK, K]``, ``v_raw`` ``[R, 2L, HV, V]``: raw inputs, activation dtype (the fold
      re-runs the native recurrence from these, never from ``u``);
    * ``count`` ``[R]`` int32: committed records since the checkpoint; ``phase`` ``[R]`` int32 (0 or 1):
      the half holding them (the cursor);
    * ``folds`` ``[R]`` int32: folds of the slot so far; ``faults`` ``[R]`` int32: :data:`FAULT_NONFINITE` /
      :data:`FAULT_OVERFLOW` bits;
    * ``tickets`` ``[R]`` int32: how many programs of a write-through that folds this slot have read its cursor,
      modulo their number (:func:`~.write_through.replay_write_through_kernel`: the last one empties the cursor). 0
      between launches whose record slots are distinct, as a served batch's are; a batch repeating a slot
      (CUDA-graph capture runs every row on SGLang's dummy slot, which no request is given) can leave it
      nonzero there, and a nonzero count would make the slot's next write-through empty its cursor too early —
      :meth:`cleared_words` resets it, as every slot SGLang hands to a request is cleared first. With the cursor,
      20 bytes per request and layer.
    """

    u: torch.Tensor
    k_norm: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    k_raw: torch.Tensor
    v_raw: torch.Tensor
    count: torch.Tensor
    phase: torch.Tensor
    folds: torch.Tensor
    faults: torch.Tensor
    tickets: torch.Tensor

    @staticmethod
    def allocate(slots: int, history: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 is_kda: bool, activation_dtype: torch.dtype, device: torch.device | str = "cpu") -> "ReplayRing":
        """Zero-filled ring (empty histories); addresses stay fixed for CUDA-graph capture."""
        n, kg = 2 * history, head_k_dim if is_kda else 1
        f32 = dict(dtype=torch.float32, device=device)
        return ReplayRing(
            u=torch.zeros(slots, n, num_v_heads, head_v_dim, **f32),
            k_norm=torch.zeros(slots, n, num_k_heads, head_k_dim, **f32),
            g=torch.zeros(slots, n, num_v_heads, kg, **f32),
            beta=torch.zeros(slots, n, num_v_heads, **f32),
            k_raw=torch.zeros(slots, n, num_k_heads, head_k_dim, dtype=activation_dtype, device=device),
            v_raw=torch.zeros(slots, n, num_v_heads, head_v_dim, dtype=activation_dtype, device=device),
            count=torch.zeros(slots, dtype=torch.int32, device=device),
            phase=torch.zeros(slots, dtype=torch.int32, device=device),
            folds=torch.zeros(slots, dtype=torch.int32, device=device),
            faults=torch.zeros(slots, dtype=torch.int32, device=device),
            tickets=torch.zeros(slots, dtype=torch.int32, device=device))

    @property
    def history(self) -> int:
        """L: records a half holds."""
        return self.u.shape[-3] // 2

    @property
    def stacked(self) -> bool:
        """Whether these are a pool's rings stacked over its layers (words ``[layers, R]``), which the cursor, clear
        and fold kernels serve for every layer in one launch, rather than one layer's (words ``[R]``)."""
        return self.count.dim() == 2

    @property
    def layers_and_slots(self) -> tuple[int, int]:
        """``(layers, R)``; one layer's ring: ``(1, R)``."""
        return tuple(self.count.shape) if self.stacked else (1, self.count.shape[0])

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor by name (for full-state comparisons and memory accounting)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def cleared_words(self) -> tuple[torch.Tensor, ...]:
        """The per-slot words an emptied history resets to 0: cursor (``count``, ``phase``), ``faults`` and
        ``tickets`` (they belong to the history; ``folds`` is cumulative and stays). Slot axis last."""
        return self.count, self.phase, self.faults, self.tickets


@triton.jit
def window_overflows(count, window, L: tl.constexpr):
    """Whether a window of ``window`` tokens after ``count`` committed records overflows a history of L
    (``count + window > L``): the fold decision the window, output and order launches and the cursor update
    must all take alike (:func:`fold_needed` is its host-side form)."""
    return count + window > L


@triton.jit(do_not_specialize=["N", "R", "accepted_all", "accepted_offset", "window"])
def advance_kernel(count, phase, folds, faults, rec_indices, accepted, accepted_all, accepted_offset, N, R, window,
                   L: tl.constexpr, PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK), layers)``: per row with a non-negative record slot ``r``, in ring slot
    ``layer * R + r``: settle a fused fold of a ``window``-token verify (``count + window > L``: ``count = 0``,
    ``phase ^= 1``, ``folds += 1``), then ``count += max(n, 0)`` with ``n = accepted[row] + accepted_offset``
    (``PER_ROW``, any integer dtype) or ``accepted_all``; a count past L sets :data:`FAULT_OVERFLOW`.
    ``count``, ``phase``, ``folds``, ``faults`` ``[layers * R]`` int32; ``rec_indices``, ``accepted`` ``[N]``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    r = tl.load(rec_indices + offs, mask=m, other=-1).to(tl.int64)
    ok = m & (r >= 0)
    slot = tl.maximum(r, 0) + tl.program_id(1).to(tl.int64) * R
    c = tl.load(count + slot, mask=ok, other=0)
    ph = tl.load(phase + slot, mask=ok, other=0)
    folded = (window > 0) & window_overflows(c, window, L)
    if PER_ROW:
        n = tl.load(accepted + offs, mask=m, other=0).to(tl.int32) + accepted_offset
    else:
        n = tl.zeros([BLOCK], dtype=tl.int32) + accepted_all
    new = tl.where(folded, 0, c) + tl.maximum(n, 0)
    tl.store(count + slot, new, mask=ok)
    tl.store(phase + slot, tl.where(folded, 1 - ph, ph), mask=ok)
    tl.store(folds + slot, tl.load(folds + slot, mask=ok, other=0) + folded.to(tl.int32), mask=ok)
    tl.atomic_or(faults + slot, tl.full([BLOCK], _OVERFLOW, tl.int32), mask=ok & (new > L))


@triton.jit(do_not_specialize=["N", "R"])
def clear_kernel(count, phase, faults, tickets, rec_indices, selected, N, R, SELECTED: tl.constexpr,
                 BLOCK: tl.constexpr):  # the words in the order of ReplayRing.cleared_words
    """Grid ``(cdiv(N, BLOCK), layers)``: zero the :meth:`ReplayRing.cleared_words` of ring slot
    ``layer * R + rec_indices[row]`` for each row with a non-negative slot (and ``selected[row]``, bool ``[N]``,
    where ``SELECTED``); a slot listed twice gets the same zeros. Words ``[layers * R]`` int32."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    r = tl.load(rec_indices + offs, mask=m, other=-1).to(tl.int64)
    ok = m & (r >= 0)
    if SELECTED:
        ok = ok & (tl.load(selected + offs, mask=m, other=0) != 0)
    slot = tl.maximum(r, 0) + tl.program_id(1).to(tl.int64) * R
    zero = tl.zeros([BLOCK], dtype=tl.int32)
    tl.store(count + slot, zero, mask=ok)
    tl.store(phase + slot, zero, mask=ok)
    tl.store(faults + slot, zero, mask=ok)
    tl.store(tickets + slot, zero, mask=ok)


@triton.jit
def flag_nonfinite(faults, r, b_h):
    """Set :data:`FAULT_NONFINITE` in ``faults[r]`` when the float32 tile ``b_h`` (a folded state, as
    rounded for its destination) holds a NaN or an infinity: then the tile's sum is one too (a finite
    state would have to sum past 3.4e38 to look like one). A sum rather than a per-element test: the
    fold kernel's tile already fills the registers, and the element-wise flags made it spill."""
    total = tl.sum(tl.sum(b_h, 1), 0)
    if (total != total) | (tl.abs(total) > 3.4028234663852886e38):
        tl.atomic_or(faults + r, _NONFINITE)


def advance(ring: ReplayRing, record_indices: torch.Tensor, accepted: torch.Tensor | int,
            window: int = 0, *, accepted_offset: int = 0) -> None:
    """Acceptance: ``count += n`` for each request's record slot (``accepted``: ``[N]`` accepted lengths with
    the base token, any integer dtype, each plus ``accepted_offset`` — 1 turns SGLang's last accepted
    index into a length — or one int for every row; 0, a negative n or a negative slot: nothing added).
    ``window`` = the T of a :func:`~.verify.replay_verify` whose fused fold just ran: the requests it
    folded (``count + T > L``) first get an empty history in the other half. ``ring``: one layer's, or the
    pool's stacked rings (:attr:`ReplayRing.stacked`: the same slots in every layer). One launch, no host sync,
    no allocation; records past the cursor are simply overwritten by the next window. Record slots
    must be distinct."""
    n = record_indices.shape[0]
    if not n:
        return
    per_row = isinstance(accepted, torch.Tensor)
    if per_row and accepted.dtype.is_floating_point:
        raise TypeError(f"accepted lengths must be integers, not {accepted.dtype}")
    layers, slots = ring.layers_and_slots
    advance_kernel[(triton.cdiv(n, 256), layers)](
        ring.count, ring.phase, ring.folds, ring.faults, record_indices, accepted if per_row else record_indices,
        0 if per_row else int(accepted) + accepted_offset, accepted_offset, n, slots, window, L=ring.history,
        PER_ROW=per_row, BLOCK=256)


def fold_needed(ring: ReplayRing, record_indices: torch.Tensor, window: int) -> torch.Tensor:
    """``[N]`` bool: the request's history must be folded before a window of ``window`` tokens
    (``count + window > L``, as :func:`window_overflows` in the kernels). Padding rows (negative slot)
    never fold. ``ring``: one layer's."""
    slots = record_indices.clamp_min(0).long()
    return (record_indices >= 0) & (ring.count[slots] + window > ring.history)


def _slot_mask(ring: ReplayRing, record_indices: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``[R]`` bool over ring slots: selected rows with a non-negative slot. Built with ``index_add_``
    of 0/1 so padding rows (which share index 0) cannot overwrite a real row's entry."""
    rows = record_indices.clamp_min(0).long()
    hits = torch.zeros(ring.count.shape[-1], dtype=ring.count.dtype, device=ring.count.device)
    return hits.index_add_(0, rows, (selected & (record_indices >= 0)).to(ring.count.dtype)) > 0


def after_fold(ring: ReplayRing, record_indices: torch.Tensor, folded: torch.Tensor) -> None:
    """Cursor update once a fold of ``folded`` ``[N]`` requests has completed: empty history, other half,
    one more fold counted (``ring``: one layer's or the pool's stacked rings, slot axis last)."""
    hit = _slot_mask(ring, record_indices, folded)
    ring.count.copy_(torch.where(hit, torch.zeros_like(ring.count), ring.count))
    ring.phase.copy_(torch.where(hit, 1 - ring.phase, ring.phase))
    ring.folds.add_(hit.to(ring.folds.dtype))


def clear_history(ring: ReplayRing, record_indices: torch.Tensor, selected: torch.Tensor | None = None) -> None:
    """Empty the histories of the slots ``record_indices`` ``[N]`` (where ``selected``, bool ``[N]``; negative
    slots skipped) — slots that just received a materialised state: their faults go with them. ``ring``: one
    layer's or the pool's stacked rings (:attr:`ReplayRing.stacked`). One launch."""
    n = record_indices.shape[0]
    if not n:
        return
    layers, slots = ring.layers_and_slots
    clear_kernel[(triton.cdiv(n, 256), layers)](
        *ring.cleared_words(), record_indices, record_indices if selected is None else selected, n, slots,
        SELECTED=selected is not None, BLOCK=256)
