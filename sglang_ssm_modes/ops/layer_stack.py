"""Every linear layer in one launch: the pool keeps each buffer stacked ``[layers, slots, ...]`` (contiguous), and
the kernels of the eager commit step (compact commit, replay fold, cursor and clear) take the stacked buffers, put
layers on their grid's last axis and add ``layer * slots`` to each slot index — one layer's buffers are the
same call with one layer."""

from __future__ import annotations

import torch


def check_layer_stack(states: torch.Tensor, dst: torch.Tensor, layers: int, stacked: bool, buffers: str,
                      shape: torch.Size) -> None:
    """Refuse ``states`` / ``dst`` that do not go with the per-request ``buffers`` (their name, one of their
    ``shape``\\ s; ``stacked`` and ``layers`` as they hold them): one layer's ``[slots, HV, V, K]`` with one
    layer's buffers, the stacked ``[layers, slots, HV, V, K]`` (both) with buffers stacked over as many layers."""
    if states.dim() != 4 + stacked or dst.dim() != states.dim() or (
            stacked and not states.shape[0] == dst.shape[0] == layers):
        raise ValueError(f"states {tuple(states.shape)} / {tuple(dst.shape)} and {buffers} of shape {tuple(shape)}: "
                         f"stacked states go with stacked {buffers}, layer for layer")
