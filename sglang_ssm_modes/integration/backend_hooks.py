"""Hooks on SGLang 0.5.14's linear-attention backends: the forward paths and the commit after a
speculative verify, in the pool's state mode.

Routing, per linear layer (``GDNAttnBackend`` / ``KDAAttnBackend``):

=============  =====================  ==========================  =============================
mode           decode (one token)      extend (prefill)            target verify (D tokens)
=============  =====================  ==========================  =============================
native         SGLang                  SGLang                      SGLang (GDN); ours (KDA, which
                                                                   SGLang 0.5.14 cannot verify)
compact        SGLang                  SGLang                      output-only + records
replay         output-only + record    fold history, then SGLang   chain: output-only + records;
               (small batches:                                     tree: compact's path
               write-through)
=============  =====================  ==========================  =============================

The conv window is SGLang's everywhere (its ``causal_conv1d_update`` / ``causal_conv1d_fn`` and,
when verifying, its per-step conv-window scratch), so only the recurrent state changes hands.
``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`` (called by
``commit_mamba_states_after_verify`` and directly by other workers) commits through
:class:`~sglang_ssm_modes.acceptance.StateAcceptance` plus SGLang's conv-window scatter.

Every hook leaves a backend whose pool is not a :class:`ModeMambaPool` to SGLang, and none of them
synchronises with the host or allocates persistent memory, so CUDA-graph capture sees fixed buffers.
"""

from __future__ import annotations

import torch

from ..acceptance import StateAcceptance
from ..ops.compact import FAST_VERIFY_TILE, compact_verify
from ..ops.native import native_verify
from ..ops.replay import (advance, clear_history, fold_into_checkpoints, replay_decode, replay_fold, replay_verify,
                          replay_write_through_verify)
from ..ops.replay.served import serves_write_through, serves_write_through_verify
from ..pool import ModeMambaPool


def _mode_pool(backend) -> ModeMambaPool | None:
    pool = getattr(backend.req_to_token_pool, "mamba_pool", None)
    return pool if isinstance(pool, ModeMambaPool) else None


def _is_kda(backend) -> bool:
    from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend

    return isinstance(backend, KDAAttnBackend)


def _conv_update(backend, layer, x, conv_states, kda: bool, **kwargs):
    """SGLang's ``causal_conv1d_update`` as the backend module binds it (platform overrides
    included), with the backend's activation."""
    if kda:
        from sglang.srt.layers.attention.linear import kda_backend as module

        return module.causal_conv1d_update(x, conv_states, layer.conv_weights, layer.bias, activation="silu", **kwargs)
    from sglang.srt.layers.attention.linear import gdn_backend as module

    return module.causal_conv1d_update(x, conv_states, layer.conv_weights, layer.bias, layer.activation, **kwargs)


def _split_heads(layer, mixed: torch.Tensor):
    """``q, k`` ``[1, T, H, K]`` and ``v`` ``[1, T, HV, V]`` from conv outputs ``[T, q + k + v]``."""
    q, k, v = mixed.split([layer.q_dim, layer.k_dim, layer.v_dim], dim=-1)
    return (q.unflatten(-1, (-1, layer.head_q_dim)).unsqueeze(0), k.unflatten(-1, (-1, layer.head_k_dim)).unsqueeze(0),
            v.unflatten(-1, (-1, layer.head_v_dim)).unsqueeze(0))


def _gates(a: torch.Tensor, b: torch.Tensor, tokens: int):
    """The gate inputs in the layout the mode kernels take: ``a`` ``[T, HV]`` (GDN) or ``[T, HV * K]``
    (KDA), ``b`` ``[T, HV]``."""
    return a.reshape(tokens, -1), b.reshape(tokens, -1)


def _verify(backend, pool: ModeMambaPool, layer, forward_batch, mixed_qkv, a, b, kda: bool) -> torch.Tensor:
    """Target verify of one linear layer in the pool's mode: SGLang's conv update (with its per-step
    conv-window scratch and tree parents), then the mode's output-only (or native per-step) kernel."""
    md = backend.forward_metadata
    draft = forward_batch.spec_info.draft_token_num
    tokens = mixed_qkv.shape[0]
    bs = tokens // draft
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    local = backend.req_to_token_pool.mamba_map[layer.layer_id]
    conv_states, window = cache.conv[0], cache.intermediate_conv_window[0]
    if kda:  # KimiLinearStateShape keeps [K - 1, conv_dim]; SGLang's kernels take the transposed view
        conv_states, window = conv_states.transpose(-1, -2), window.transpose(-1, -2)
    rows = pool.record_rows[:bs]
    tree = md.retrieve_next_token is not None
    x = _conv_update(backend, layer, mixed_qkv.view(bs, draft, -1).transpose(1, 2), conv_states, kda,
                     conv_state_indices=md.mamba_cache_indices[:bs], intermediate_conv_window=window,
                     intermediate_state_indices=rows, retrieve_next_token=md.retrieve_next_token,
                     retrieve_next_sibling=md.retrieve_next_sibling, retrieve_parent_token=md.retrieve_parent_token)
    q, k, v = _split_heads(layer, x.transpose(1, 2).reshape(tokens, -1))
    a, b = _gates(a, b, tokens)
    ssm, indices = cache.temporal, md.mamba_cache_indices[:bs]
    parents = md.retrieve_parent_token if tree else None
    common = dict(is_kda=kda, beta_activated=kda, scale=layer.head_k_dim ** -0.5)
    if pool.verify_path == "native":  # KDA only: SGLang 0.5.14 has no KDA verify
        return native_verify(layer.A_log, a, layer.dt_bias, q, k, v, b, ssm, indices, cache.intermediate_ssm, rows,
                             retrieve_parent_token=parents, **common)
    if pool.mode == "replay":
        ring = pool.layer_ring(local)
        if pool.verify_path == "replay":
            if draft != pool.mode_config.draft_tokens:  # the window StateAcceptance settles folds with
                raise RuntimeError(f"replay verify of {draft} draft tokens on a pool built for "
                                   f"{pool.mode_config.draft_tokens}")
            if serves_write_through_verify(bs, kda, ring.history, ssm.dtype):  # native's outputs and bytes
                return replay_write_through_verify(layer.A_log, a, layer.dt_bias, q, k, v, b, ssm, indices, ring,
                                                   indices, **common)
            # folds where the window would overflow, in the same launch; StateAcceptance settles the cursor
            return replay_verify(layer.A_log, a, layer.dt_bias, q, k, v, b, ssm, indices, ring, indices, **common)
        fold_into_checkpoints(ssm, indices, ring, indices, indices >= 0, is_kda=kda)  # tree: compact's path
    tile = FAST_VERIFY_TILE if pool.mode_config.compact_verify == "fast" else None  # --ssm-compact-verify
    return compact_verify(layer.A_log, a, layer.dt_bias, q, k, v, b, ssm, indices, pool.layer_records(local), rows,
                          retrieve_parent_token=parents, tile=tile, **common)


def _replay_decode(backend, pool: ModeMambaPool, layer, forward_batch, mixed_qkv, a, b, kda: bool) -> torch.Tensor:
    """Plain decode in replay mode: SGLang's conv update, then :func:`~..ops.replay.replay_decode` — the
    output of one token from checkpoint + history, its record appended and the cursor moved by one, or (small
    batches) the token written through to the checkpoint as SGLang's decode writes it; extra_buffer tracking
    materialises the tracked requests' states into their track slots.

    Output-only, the cursors move once a step: after the last linear layer, every layer's in one launch on the
    pool's stacked rings (no layer reads another's ring, and nothing reads a layer's between its decode and the
    step's end) — except under extra_buffer tracking, whose materialisation right after the layer's decode
    reads the settled cursor, so each layer settles its own there."""
    md = backend.forward_metadata
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    local = backend.req_to_token_pool.mamba_map[layer.layer_id]
    ring = pool.layer_ring(local)
    conv_states = cache.conv[0].transpose(-1, -2) if kda else cache.conv[0]
    indices = md.mamba_cache_indices
    x = _conv_update(backend, layer, mixed_qkv, conv_states, kda, conv_state_indices=indices)
    tokens = x.shape[0]
    q, k, v = _split_heads(layer, x)
    a, b = _gates(a, b, tokens)
    ssm = cache.temporal
    # the decode SGLang would run: its GDN packed kernel rounds beta to b's dtype (the others do not)
    packed = getattr(backend.kernel_dispatcher, "supports_packed_decode", False)
    through = serves_write_through(indices.shape[0], kda, ring.history, ssm.dtype)
    tracking = forward_batch.mamba_track_mask is not None
    o = replay_decode(layer.A_log, a, layer.dt_bias, q, k, v, b, ssm, indices, ring, indices, is_kda=kda,
                      scale=layer.head_k_dim ** -0.5, round_beta=packed and not kda, write_through=through,
                      settle=tracking)
    if tracking:
        _track_decode(backend, cache, ring, indices, forward_batch, kda)
    elif not through and local == pool.replay_rings.layers_and_slots[0] - 1:  # the step's last linear layer
        advance(pool.replay_rings, indices, 1, window=1)
    return o


def _track_decode(backend, cache, ring, indices, forward_batch, kda: bool) -> None:
    """extra_buffer radix strategy after a replay decode: SGLang's own decode tracking (the conv window
    and the raw checkpoint copied into the tracked requests' track slots), then the materialised state
    written over the copied checkpoint; the track slots start without history."""
    backend._track_mamba_state_decode(forward_batch, cache.conv[0], cache.temporal, indices)
    bs = forward_batch.batch_size
    src = indices[:bs]
    mask = forward_batch.mamba_track_mask[:bs] & (src >= 0)
    track = torch.where(mask, forward_batch.mamba_track_indices[:bs].to(src.dtype), -1)
    replay_fold(cache.temporal, src, ring, src, mask, is_kda=kda, dst=cache.temporal, dst_indices=track)
    clear_history(ring, track, mask)


def _replay_extend(backend, pool: ModeMambaPool, layer, forward_batch) -> None:
    """Before a replay-mode prefill: fold the batch's histories (decode requests riding in a mixed batch, or
    none) so SGLang's chunked kernel continues from the canonical state; with extra_buffer, empty the histories
    of the track slots SGLang's extend tracking is about to write a raw (canonical) state into — a reused slot
    may still hold a previous owner's records. On the forward stream, like SGLang's own deferred clears.

    At the first linear layer, for every linear layer in one launch each (the pool's stacked buffers; no
    layer's forward touches another's state). Where HiCache loads the states layer by layer
    (``layer_transfer_counter``), a layer's state may still be arriving on the load stream until its own
    ``mamba2_layer_cache`` waits for it: then each layer folds its own, after that wait."""
    to_token = backend.req_to_token_pool
    local = to_token.mamba_map[layer.layer_id]
    if to_token.layer_transfer_counter is not None:
        temporal, ring = to_token.mamba2_layer_cache(layer.layer_id).temporal, pool.layer_ring(local)
    elif local == 0:
        temporal, ring = pool.mamba_cache.temporal, pool.replay_rings
    else:
        return
    indices = backend.forward_metadata.mamba_cache_indices
    fold_into_checkpoints(temporal, indices, ring, indices, indices >= 0, is_kda=_is_kda(backend))
    if forward_batch.mamba_track_mask is not None:
        bs = forward_batch.batch_size
        clear_history(ring, forward_batch.mamba_track_indices[:bs], forward_batch.mamba_track_mask[:bs])


# ---- hooks (AROUND: fn(original, self, ...)) ---------------------------------------------------
# SGLang's HybridLinearAttnBackend calls the linear backend with keywords only (KDA's forward_decode has
# no forward_batch parameter), so the originals are called the same way.

def forward_decode(original, self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    """``GDNAttnBackend.forward_decode`` / ``KDAAttnBackend.forward_decode``."""
    pool = _mode_pool(self)
    if pool is None or pool.decode_path != "replay":
        return original(self, layer=layer, forward_batch=forward_batch, mixed_qkv=mixed_qkv, a=a, b=b, **kwargs)
    return _replay_decode(self, pool, layer, forward_batch, mixed_qkv, a, b, _is_kda(self))


def forward_extend(original, self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    """``GDNAttnBackend.forward_extend`` / ``KDAAttnBackend.forward_extend``."""
    pool = _mode_pool(self)
    kda = _is_kda(self)
    if pool is not None and forward_batch.forward_mode.is_target_verify():
        if pool.verify_path != "native" or kda:
            return _verify(self, pool, layer, forward_batch, mixed_qkv, a, b, kda)
    elif pool is not None and pool.mode == "replay":
        _replay_extend(self, pool, layer, forward_batch)
    return original(self, layer=layer, forward_batch=forward_batch, mixed_qkv=mixed_qkv, a=a, b=b, **kwargs)


def update_mamba_state_after_mtp_verify(original, self, last_correct_step_indices, mamba_track_indices,
                                        mamba_steps_to_track, model):
    """``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify``: compact and replay commit the
    state through :class:`StateAcceptance`, the conv window through SGLang's scatter."""
    linear = self.linear_attn_backend
    pool = _mode_pool(linear)
    if pool is None or pool.mode == "native":
        return original(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model)
    from sglang.srt.layers.attention.mamba.mamba_state_scatter_triton import fused_conv_window_scatter_with_mask

    n = last_correct_step_indices.shape[0]
    md = linear.forward_metadata
    state_indices = md.mamba_cache_indices[:n]
    tree = md.retrieve_parent_token if pool.tree_verify else None
    conv_states, window = pool.mamba_cache.conv[0], pool.mamba_cache.intermediate_conv_window[0]
    if mamba_track_indices is not None:
        fused_conv_window_scatter_with_mask(conv_states, window, mamba_track_indices, mamba_steps_to_track)
    fused_conv_window_scatter_with_mask(conv_states, window, state_indices, last_correct_step_indices)
    StateAcceptance(pool).commit(state_indices, last_correct_step_indices, track_indices=mamba_track_indices,
                                 steps_to_track=mamba_steps_to_track,
                                 retrieve_parent_token=tree[:n] if tree is not None else None,
                                 record_indices=pool.record_rows[:n])
