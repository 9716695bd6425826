"""Every linear layer in one launch: the pool keeps each buffer stacked ``[layers, slots, ...]`` (contiguous), and
the kernels of the eager commit step (compact commit, replay fold, cursor and clear) take the stacked buffers, put
layers on their grid's last axis and add ``layer * slots`` to each slot index — one layer's buffers are the
same call with one layer."""

from __future__ import annotations

import torch


def check_layer_stack(states: torch.Tensor, dst: torch.Tensor, buffers, name: str) -> tuple[int, int]:
    """``buffers.layers_and_slots`` (a :class:`~.compact.CompactRecordBuffers` or :class:`~.replay.ReplayRing`,
    called ``name``) after refusing ``states`` / ``dst`` that do not go with them: one layer's ``[slots, HV, V,
    K]`` with one layer's buffers, the stacked ``[layers, slots, HV, V, K]`` (both) with buffers stacked over as
    many layers."""
    layers, slots = buffers.layers_and_slots
    if states.dim() != 4 + buffers.stacked or dst.dim() != states.dim() or (
            buffers.stacked and not states.shape[0] == dst.shape[0] == layers):
        raise ValueError(f"states {tuple(states.shape)} / {tuple(dst.shape)} and {name} of {layers} layer(s), "
                         f"{'stacked' if buffers.stacked else 'one layer'}: stacked states go with stacked {name}, "
                         "layer for layer")
    return layers, slots
