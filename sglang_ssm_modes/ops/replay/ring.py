"""The replay mode's per-request history: a ring of 2·L records with a cursor, double-buffered.

Records since the checkpoint live in one half of the ring (``phase`` selects it: positions
``phase * L .. phase * L + count``); a fold replays them into the checkpoint, sets ``count`` to 0 and
flips ``phase``, so records a concurrently running fold still reads are never overwritten by the
next window. With a fold before every window that would overflow (``count + D > L``) a window's
records always fit in the current half.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class ReplayRing:
    """Ring buffers for ``R`` record slots, history ``L`` (2·L records each).

    * ``u`` ``[R, 2L, HV, V]`` float32: the delta-rule update ``beta (v - S k)`` of each token;
    * ``k_norm`` ``[R, 2L, HK, K]`` float32: the L2-normalised key, per key head (GQA-shared);
    * ``g`` ``[R, 2L, HV, Kg]`` float32: log-decay (Kg = 1 GDN, K KDA); ``beta`` ``[R, 2L, HV]`` float32;
    * ``k_raw`` ``[R, 2L, HK, K]``, ``v_raw`` ``[R, 2L, HV, V]``: raw inputs, activation dtype (the fold
      re-runs the native recurrence from these, never from ``u``);
    * ``count`` ``[R]`` int32: committed records since the checkpoint; ``phase`` ``[R]`` int32 (0 or 1):
      the half holding them. Together the 8 bytes of cursor per request and layer.
    """

    u: torch.Tensor
    k_norm: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    k_raw: torch.Tensor
    v_raw: torch.Tensor
    count: torch.Tensor
    phase: torch.Tensor

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
            phase=torch.zeros(slots, dtype=torch.int32, device=device))

    @property
    def history(self) -> int:
        """L: records a half holds."""
        return self.u.shape[1] // 2

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor by name (for full-state comparisons and memory accounting)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def advance(ring: ReplayRing, record_indices: torch.Tensor, accepted: torch.Tensor) -> None:
    """Acceptance: ``count += n`` for each request's record slot (``accepted`` ``[N]`` = accepted
    length with the base token; 0 or a negative slot: unchanged). Device ops only, no host sync;
    records past the cursor are simply overwritten by the next window."""
    valid = (record_indices >= 0) & (accepted > 0)
    slots = torch.where(valid, record_indices, torch.zeros_like(record_indices)).long()
    ring.count.index_add_(0, slots, torch.where(valid, accepted, torch.zeros_like(accepted)).to(torch.int32))


def fold_needed(ring: ReplayRing, record_indices: torch.Tensor, window: int) -> torch.Tensor:
    """``[N]`` bool: the request's history must be folded before a window of ``window`` tokens
    (``count + window > L``). Padding rows (negative slot) never fold."""
    slots = record_indices.clamp_min(0).long()
    return (record_indices >= 0) & (ring.count[slots] + window > ring.history)


def _slot_mask(ring: ReplayRing, record_indices: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``[R]`` bool over ring slots: selected rows with a non-negative slot. Built with ``index_add_``
    of 0/1 so padding rows (which share index 0) cannot overwrite a real row's entry."""
    rows = record_indices.clamp_min(0).long()
    return torch.zeros_like(ring.count).index_add_(0, rows, (selected & (record_indices >= 0)).to(ring.count.dtype)) > 0


def after_fold(ring: ReplayRing, record_indices: torch.Tensor, folded: torch.Tensor) -> None:
    """Cursor update once a fold of ``folded`` ``[N]`` requests has completed: empty history, other half."""
    hit = _slot_mask(ring, record_indices, folded)
    ring.count.copy_(torch.where(hit, torch.zeros_like(ring.count), ring.count))
    ring.phase.copy_(torch.where(hit, 1 - ring.phase, ring.phase))


def clear_history(ring: ReplayRing, record_indices: torch.Tensor, selected: torch.Tensor) -> None:
    """Empty the histories of the selected slots (a slot that just received a materialised state)."""
    hit = _slot_mask(ring, record_indices, selected)
    ring.count.copy_(torch.where(hit, torch.zeros_like(ring.count), ring.count))
    ring.phase.copy_(torch.where(hit, torch.zeros_like(ring.phase), ring.phase))
