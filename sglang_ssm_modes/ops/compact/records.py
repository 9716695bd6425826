"""Record buffers of the compact mode: the raw inputs of each draft token, per request slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CompactRecordBuffers:
    """Raw inputs of up to ``D`` draft tokens for ``R`` request slots (a batch position or a pool
    slot: the caller passes the record slot of each request).

    * ``k``: ``[R, D, HK, K]`` raw key before L2 norm, activation dtype, one per *key* head (shared
      by its GQA group of HV / HK value heads);
    * ``v``: ``[R, D, HV, V]`` raw value, activation dtype;
    * ``g``: ``[R, D, HV, Kg]`` float32 log-decay as the native kernel computes it (Kg = 1 for GDN,
      K for KDA);
    * ``beta``: ``[R, D, HV]`` float32 ``sigmoid(b)`` as the native kernel computes it.
    """

    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @staticmethod
    def allocate(slots: int, draft_tokens: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, is_kda: bool, activation_dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> "CompactRecordBuffers":
        """Zero-filled buffers; their addresses stay fixed for CUDA-graph capture."""
        kg = head_k_dim if is_kda else 1
        return CompactRecordBuffers(
            k=torch.zeros(slots, draft_tokens, num_k_heads, head_k_dim, dtype=activation_dtype, device=device),
            v=torch.zeros(slots, draft_tokens, num_v_heads, head_v_dim, dtype=activation_dtype, device=device),
            g=torch.zeros(slots, draft_tokens, num_v_heads, kg, dtype=torch.float32, device=device),
            beta=torch.zeros(slots, draft_tokens, num_v_heads, dtype=torch.float32, device=device))

    @property
    def draft_tokens(self) -> int:
        return self.k.shape[-3]

    @property
    def stacked(self) -> bool:
        """Whether these are a pool's buffers stacked over its layers (``k`` ``[layers, R, D, HK, K]``), which the
        commit serves for every layer in one launch, rather than one layer's (``[R, D, HK, K]``)."""
        return self.k.dim() == 5

    @property
    def layers_and_slots(self) -> tuple[int, int]:
        """``(layers, R)``; one layer's buffers: ``(1, R)``."""
        return tuple(self.k.shape[:2]) if self.stacked else (1, self.k.shape[0])
