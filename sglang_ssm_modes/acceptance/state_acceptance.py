"""``StateAcceptance``: the one commit step after a speculative verify, for every mode.

It stands behind both of SGLang 0.5.14's commit points — ``spec_utils.commit_mamba_states_after_verify``
(EAGLE v2 / NEXTN, NGRAM) and ``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`` (called
by the former, and directly by e.g. DFLASH) — and takes what they carry: per request, in the forward's
order, the window index of the last accepted node (``last_correct_step_indices``: accepted length - 1
with the base token counted; -1 = nothing), plus the radix cache's tracked snapshots
(``mamba_track_indices``, ``mamba_steps_to_track``, extra_buffer strategy).

* native: SGLang's copies of stored per-step states (``fused_mamba_state_scatter_with_mask``);
* compact: re-run of the accepted prefix from the records, one state write, bit-identical to native;
  tracked snapshots are written from the same records into their slots *before* the commit;
* replay: the cursor moves (``count += n``, after settling the folds the verify kernel fused in);
  tracked snapshots are materialised from checkpoint + records into their slots.

Each model (target, draft) has its own pool and so its own ``StateAcceptance``: their commit records
never mix. Only device ops: no host synchronisation; compact and replay commit every linear layer in the same
launches (the pool's stacked per-layer buffers seen as one set of slots), so a step's commit costs a handful of
launches whatever the model's depth — it runs eagerly after the verify, outside CUDA graphs. The conv window is
committed beside it, in every mode, by SGLang's own scatter of its per-step conv scratch (the backend's commit
hook).
"""

from __future__ import annotations

import torch

from ..ops.compact import compact_commit
from ..ops.replay import advance, clear_history, replay_fold
from ..pool import ModeMambaPool


class StateAcceptance:
    """Commit accepted drafts into ``pool``'s state, in its mode."""

    def __init__(self, pool: ModeMambaPool):
        self.pool = pool
        self.mode = pool.verify_path  # replay's tree verify commits through compact's records
        self.is_kda = pool.heads.family == "kda"

    def commit(self, state_indices: torch.Tensor, last_index: torch.Tensor, *,
               track_indices: torch.Tensor | None = None, steps_to_track: torch.Tensor | None = None,
               retrieve_parent_token: torch.Tensor | None = None,
               record_indices: torch.Tensor | None = None) -> None:
        """Commit every linear layer. ``state_indices`` ``[N]``: pool slots (< 0: padding);
        ``last_index`` ``[N]``; ``track_indices`` / ``steps_to_track`` ``[N]``: snapshot slot and window
        index to snapshot (< 0: none); ``retrieve_parent_token`` ``[N, D]`` for tree verify;
        ``record_indices``: compact record slots (default: batch positions 0..N-1, as SGLang indexes
        ``intermediate_ssm``); replay records live with the pool slot."""
        if (track_indices is None) != (steps_to_track is None):
            raise ValueError("mamba_track_indices and mamba_steps_to_track come together")
        n = state_indices.shape[0]
        if record_indices is None:
            record_indices = torch.arange(n, dtype=torch.int32, device=state_indices.device)
        temporal = self.pool.mamba_cache.temporal
        if self.mode == "native":
            for layer in range(self.pool.num_mamba_layers):
                inter = self.pool.mamba_cache.intermediate_ssm[layer]
                if track_indices is not None:
                    _scatter_steps(temporal[layer], inter, track_indices, steps_to_track)
                _scatter_steps(temporal[layer], inter, state_indices, last_index)
            return
        # compact and replay: every layer in the same launches, the stacked [layers, slots, ...] buffers seen as
        # one set of layers x slots (views), each request's row repeated per layer at its layer's offset
        layers, slots = temporal.shape[:2]
        states = temporal.view(layers * slots, *temporal.shape[2:])
        rows = _layer_rows(state_indices, layers, slots)
        tracked_rows = None if track_indices is None else _layer_rows(track_indices, layers, slots)
        groups = _launch_groups(layers, n, temporal.shape[2])
        if self.mode == "compact":
            rec = _all_layers(self.pool.compact_records)
            rec_rows = _layer_rows(record_indices, layers, self.pool.compact_records.k.shape[1])
            parents = None if retrieve_parent_token is None else retrieve_parent_token.repeat(layers, 1)
            if track_indices is not None:
                steps = steps_to_track.repeat(layers)
                for g in groups:
                    compact_commit(states, rows[g], rec, rec_rows[g], steps[g], is_kda=self.is_kda,
                                   retrieve_parent_token=None if parents is None else parents[g], dst_states=states,
                                   dst_indices=tracked_rows[g])
                if self.pool.replay_rings is not None:  # replay's tree path: the snapshot has no history
                    clear_history(self._all_rings(slots), tracked_rows, (steps >= 0) & (tracked_rows >= 0))
            last = last_index.repeat(layers)
            for g in groups:
                compact_commit(states, rows[g], rec, rec_rows[g], last[g], is_kda=self.is_kda,
                               retrieve_parent_token=None if parents is None else parents[g])
            return
        if retrieve_parent_token is not None:
            raise ValueError("replay's chain path commits chains only; a replay pool built for tree "
                             "verify (EAGLE topk > 1) commits through compact's path")
        ring = self._all_rings(slots)
        accepted = (last_index + 1).to(torch.int32).repeat(layers)  # the cursor advance, base token included
        window = self.pool.mode_config.draft_tokens
        if track_indices is None:  # the verify's fused folds settle with the accepted lengths
            advance(ring, rows, accepted, window=window)
            return
        advance(ring, rows, 0, window=window)  # settle the folds: the cursor the snapshots read
        steps = steps_to_track.to(ring.count.dtype).repeat(layers)
        tracked = (steps >= 0) & (tracked_rows >= 0)
        lengths = ring.count[rows.clamp_min(0).long()] + steps + 1
        for g in groups:
            replay_fold(states, rows[g], ring, rows[g], tracked[g], is_kda=self.is_kda, dst=states,
                        dst_indices=tracked_rows[g], lengths=lengths[g])
        clear_history(ring, tracked_rows, tracked)
        advance(ring, rows, accepted)

    def _all_rings(self, slots: int):
        """The pool's replay rings, every layer as one set of slots (:func:`_all_layers`). Ring slots are pool
        slots (records live with the pool slot), so a state row is also a ring row."""
        rings = self.pool.replay_rings
        if rings.count.shape[1] != slots:
            raise RuntimeError(f"replay rings hold {rings.count.shape[1]} slots a layer, the state pool {slots}")
        return _all_layers(rings)


GRID_Y = 65535
"""CUDA's limit on a grid's second axis, where the commit and fold kernels put requests x value heads."""


def _launch_groups(layers: int, requests: int, heads: int) -> list[slice]:
    """Slices of layer-major rows (:func:`_layer_rows`) taking as many whole layers a launch as :data:`GRID_Y`
    allows for ``requests`` x ``heads`` programs a layer: one launch for every layer unless the batch is large,
    and at least one layer a launch (a single layer past the limit, over 65535 / HV requests, was refused by
    CUDA before this too)."""
    per = max(1, GRID_Y // max(1, requests * heads))
    return [slice(first * requests, min(layers, first + per) * requests) for first in range(0, layers, per)]


def _all_layers(buffers):
    """Per-layer buffers stacked ``[layers, R, ...]`` (a :class:`~..ops.compact.CompactRecordBuffers` or
    :class:`~..ops.replay.ReplayRing`) as one set of ``layers * R`` slots: views, never copies."""
    return type(buffers)(*(t.view(t.shape[0] * t.shape[1], *t.shape[2:]) for t in buffers.__dict__.values()))


def _layer_rows(indices: torch.Tensor, layers: int, per_layer: int) -> torch.Tensor:
    """``[layers * N]`` int32: each of ``indices`` ``[N]`` in every layer of a ``layers * per_layer`` flattening
    (layer-major, as :func:`_all_layers`); a negative index (padding, nothing to track) stays -1."""
    idx = indices.to(torch.int64)[None, :]
    offsets = torch.arange(layers, dtype=torch.int64, device=indices.device)[:, None] * per_layer
    return torch.where(idx >= 0, idx + offsets, -1).flatten().to(torch.int32)


def _scatter_steps(states: torch.Tensor, intermediate: torch.Tensor, dst_indices: torch.Tensor,
                   steps: torch.Tensor) -> None:
    """``states[dst[i]] = intermediate[i, steps[i]]`` where both are >= 0: SGLang's
    ``fused_mamba_state_scatter_with_mask`` on CUDA; the same bit copy in torch elsewhere (the
    wrapper refuses CPU tensors)."""
    if states.is_cuda:
        from sglang.srt.layers.attention.mamba.mamba_state_scatter_triton import fused_mamba_state_scatter_with_mask

        fused_mamba_state_scatter_with_mask(states[None], intermediate[None], dst_indices, steps)
        return
    valid = (dst_indices >= 0) & (steps >= 0)
    rows = torch.arange(steps.shape[0], device=steps.device)[valid]
    states[dst_indices[valid].long()] = intermediate[rows, steps[valid].long()]
