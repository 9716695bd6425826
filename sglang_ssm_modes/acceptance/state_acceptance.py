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
never mix. Only device ops: no host synchronisation. It runs eagerly after the verify, outside CUDA graphs, so
its cost is launches: every kernel takes the pool's stacked per-layer buffers and serves every linear layer in
one launch (a grid axis), from the batch's own index tensors — a step's commit is one launch in compact and
replay whatever the model's depth, as native's scatter (with tracked snapshots: compact 2, replay 3, replay's
tree path through compact's records 3). The conv window is committed beside it, in every mode, by SGLang's own
scatter of its per-step conv scratch (the backend's commit hook).
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
        temporal = self.pool.mamba_cache.temporal  # [layers, slots, HV, V, K]: every layer in each launch
        if self.mode == "native":
            if track_indices is not None:
                _scatter_steps(temporal, self.pool.mamba_cache.intermediate_ssm, track_indices, steps_to_track)
            _scatter_steps(temporal, self.pool.mamba_cache.intermediate_ssm, state_indices, last_index)
            return
        if self.mode == "compact":
            rec = self.pool.compact_records
            if track_indices is not None:
                compact_commit(temporal, state_indices, rec, record_indices, steps_to_track, is_kda=self.is_kda,
                               retrieve_parent_token=retrieve_parent_token, dst_indices=track_indices)
                if self.pool.replay_rings is not None:  # replay's tree path: the snapshot has no history
                    clear_history(self.pool.replay_rings, track_indices, steps_to_track >= 0)
            compact_commit(temporal, state_indices, rec, record_indices, last_index, is_kda=self.is_kda,
                           retrieve_parent_token=retrieve_parent_token)
            return
        if retrieve_parent_token is not None:
            raise ValueError("replay's chain path commits chains only; a replay pool built for tree "
                             "verify (EAGLE topk > 1) commits through compact's path")
        ring = self.pool.replay_rings  # ring slots are pool slots: records live with the pool slot
        window = self.pool.mode_config.draft_tokens
        if track_indices is None:  # the verify's fused folds settle with the accepted lengths
            advance(ring, state_indices, last_index, window=window, accepted_offset=1)
            return
        # snapshots from the window just verified (the fold reads the cursor the advance will leave), their
        # slots without history, then the cursor moves as without them
        replay_fold(temporal, state_indices, ring, state_indices, None, is_kda=self.is_kda, dst=temporal,
                    dst_indices=track_indices, window_steps=steps_to_track, window=window)
        clear_history(ring, track_indices, steps_to_track >= 0)
        advance(ring, state_indices, last_index, window=window, accepted_offset=1)


def _scatter_steps(states: torch.Tensor, intermediate: torch.Tensor, dst_indices: torch.Tensor,
                   steps: torch.Tensor) -> None:
    """``states[:, dst[i]] = intermediate[:, i, steps[i]]`` where both are >= 0, every layer (stacked ``[layers,
    ...]``): SGLang's ``fused_mamba_state_scatter_with_mask`` on CUDA; the same bit copy in torch elsewhere
    (the wrapper refuses CPU tensors)."""
    if states.is_cuda:
        from sglang.srt.layers.attention.mamba.mamba_state_scatter_triton import fused_mamba_state_scatter_with_mask

        fused_mamba_state_scatter_with_mask(states, intermediate, dst_indices, steps)
        return
    valid = (dst_indices >= 0) & (steps >= 0)
    rows = torch.arange(steps.shape[0], device=steps.device)[valid]
    states[:, dst_indices[valid].long()] = intermediate[:, rows, steps[valid].long()]
