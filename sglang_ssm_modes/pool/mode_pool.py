"""``ModeMambaPool``: SGLang 0.5.14's ``MambaPool`` whose per-request state resources follow the
SSM state mode, keeping SGLang's interface (``mamba2_layer_cache``, ``clear_slots``, ``copy_from``,
``get_cpu_copy`` / ``load_cpu_copy``, ``get_contiguous_buf_infos``) so the scheduler, radix cache,
HiCache and PD code keep working unchanged.

* ``native``: SGLang's pool as it is (state, conv window, and the ``intermediate_ssm`` /
  ``intermediate_conv_window`` scratch when speculating).
* ``compact``: state and conv window per slot; no per-step scratch; raw-input records of D draft
  tokens per running request (``[layers, spec_state_size + 1, D, ...]``, indexed like SGLang's
  ``intermediate_ssm``: by the request's position in the verify batch).
* ``replay``: the state slot holds the *checkpoint*; each slot also owns a ring of 2·L records and a
  cursor (the history belongs to the request across rounds, so it lives with its slot).

Everything that hands pool contents to someone else (``copy_from`` for radix-cache checkpoints,
``get_cpu_copy`` for offload, ``prepare_for_transfer`` for PD) sees the canonical committed state:
replay materialises it first (into the destination slot, or by folding in place), and whatever
receives a state (``copy_from``'s destination, ``load_cpu_copy``, ``clear_slots``) starts with an
empty history. The conv window keeps SGLang's layout in every mode for now.

This module imports SGLang (it is glue); the kernels it drives live in :mod:`sglang_ssm_modes.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.configs.mamba_utils import BaseLinearStateParams, KimiLinearStateShape
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MambaPool

from ..config import SSMModeConfig
from ..ops.compact import CompactRecordBuffers
from ..ops.replay import ReplayRing, after_fold, replay_fold

GB = 1 << 30


@dataclass(frozen=True)
class LinearHeads:
    """Per-TP-rank head layout of the linear layers, read from SGLang's cache params."""

    family: str  # "gdn" | "kda"
    num_v_heads: int
    num_k_heads: int
    head_k_dim: int
    head_v_dim: int

    @staticmethod
    def from_cache_params(cache_params: BaseLinearStateParams) -> "LinearHeads":
        shape = cache_params.shape
        hv, vdim, kdim = shape.temporal
        if isinstance(shape, KimiLinearStateShape):
            return LinearHeads("kda", hv, hv, kdim, vdim)
        # Mamba2StateShape (GDN): conv_dim = HV*V + 2 * HK * K (q and k share the key heads)
        conv_dim = shape.conv[0][0]
        return LinearHeads("gdn", hv, (conv_dim - hv * vdim) // (2 * kdim), kdim, vdim)


def _layers_of(buffers, layer: int):
    """The buffers of one layer (views) from buffers with a leading layer dimension."""
    return type(buffers)(*(t[layer] for t in buffers.__dict__.values()))


def _per_layer(template, layers: int, device):
    """Zeroed buffers shaped like ``template`` (allocated on the meta device) with a leading
    ``layers`` dimension, on ``device``."""
    return type(template)(*(torch.zeros(layers, *t.shape, dtype=t.dtype, device=device)
                            for t in template.__dict__.values()))


class ModeMambaPool(MambaPool):
    """A ``MambaPool`` in the mode of ``mode_config``; other arguments are ``MambaPool``'s."""

    def __init__(self, *, mode_config: SSMModeConfig, **kwargs):
        if mode_config.mode != "native":  # SGLang's state and conv window, none of its per-step scratch
            kwargs = {**kwargs, "speculative_num_draft_tokens": None}
        super().__init__(**kwargs)
        self._add_mode_buffers(mode_config, kwargs["cache_params"], kwargs["spec_state_size"])

    @classmethod
    def adopt(cls, pool: MambaPool, mode_config: SSMModeConfig, cache_params: BaseLinearStateParams,
              spec_state_size: int) -> "ModeMambaPool":
        """Take over a ``MambaPool`` SGLang has just built (without speculative scratch for compact /
        replay) and add the mode's buffers: no state tensor is allocated twice."""
        if mode_config.mode != "native" and isinstance(pool.mamba_cache, MambaPool.SpeculativeState):
            raise ValueError(f"--ssm-state-mode {mode_config.mode}: build the MambaPool without "
                             "speculative_num_draft_tokens (its per-step scratch is what this mode removes)")
        mode_pool = cls.__new__(cls)
        mode_pool.__dict__.update(pool.__dict__)
        mode_pool._add_mode_buffers(mode_config, cache_params, spec_state_size)
        return mode_pool

    def _add_mode_buffers(self, mode_config: SSMModeConfig, cache_params: BaseLinearStateParams,
                          spec_state_size: int) -> None:
        self.mode_config = mode_config
        self.heads = h = LinearHeads.from_cache_params(cache_params)
        self.compact_records = self.replay_rings = None
        act, is_kda = cache_params.dtype.conv, h.family == "kda"
        if mode_config.mode == "compact" and mode_config.draft_tokens > 1:  # decode alone commits at once
            self.compact_records = _per_layer(CompactRecordBuffers.allocate(
                spec_state_size + 1, mode_config.draft_tokens, h.num_k_heads, h.num_v_heads, h.head_k_dim,
                h.head_v_dim, is_kda, act, "meta"), self.num_mamba_layers, self.device)
            self.mem_usage += sum(t.nbytes for t in self.compact_records.__dict__.values()) / GB
        elif mode_config.mode == "replay":
            self.replay_rings = _per_layer(ReplayRing.allocate(
                self.size + 1, mode_config.replay_history, h.num_k_heads, h.num_v_heads, h.head_k_dim, h.head_v_dim,
                is_kda, act, "meta"), self.num_mamba_layers, self.device)
            self.mem_usage += sum(t.nbytes for t in self.replay_rings.buffers().values()) / GB

    # ---- per-layer views for the kernels ---------------------------------------------------
    def layer_records(self, layer: int) -> CompactRecordBuffers:
        """Compact records of one linear layer (pool-local layer index)."""
        return _layers_of(self.compact_records, layer)

    def layer_ring(self, layer: int) -> ReplayRing:
        """Replay ring of one linear layer (pool-local layer index)."""
        return _layers_of(self.replay_rings, layer)

    # ---- SGLang's interface, mode-aware ----------------------------------------------------
    def clear_slots(self, indices: torch.Tensor):
        super().clear_slots(indices)
        self._clear_history(indices)

    def copy_from(self, src_indices: torch.Tensor, dst_indices: torch.Tensor):
        """Radix-cache checkpoint / copy-on-write: the destination receives the canonical committed
        state (replay: materialised straight into the destination slot, no whole-batch temporary)
        and an empty history."""
        if self.replay_rings is None:
            super().copy_from(src_indices, dst_indices)
            self._clear_history(dst_indices)
            return
        for i in range(len(self.mamba_cache.conv)):
            self.mamba_cache.conv[i][:, dst_indices] = self.mamba_cache.conv[i][:, src_indices]
        src, dst = _as_index(src_indices, self.device), _as_index(dst_indices, self.device)
        everything = torch.ones_like(src, dtype=torch.bool)
        for layer in range(self.num_mamba_layers):
            temporal = self.mamba_cache.temporal[layer]
            replay_fold(temporal, src, self.layer_ring(layer), src, everything, is_kda=self.heads.family == "kda",
                        dst=temporal, dst_indices=dst)
        self._clear_history(dst_indices)

    def materialise_in_place(self, indices: torch.Tensor) -> None:
        """Fold the histories of ``indices`` into their checkpoints (replay; no-op otherwise), so the
        raw state buffers hold the canonical committed state — before any transfer starts."""
        if self.replay_rings is None:
            return
        idx = _as_index(indices, self.device)
        everything = torch.ones_like(idx, dtype=torch.bool)
        for layer in range(self.num_mamba_layers):
            ring = self.layer_ring(layer)
            replay_fold(self.mamba_cache.temporal[layer], idx, ring, idx, everything,
                        is_kda=self.heads.family == "kda")
            after_fold(ring, idx, everything)

    prepare_for_transfer = materialise_in_place  # PD export: call before the transfer is started

    def get_cpu_copy(self, indices):
        self.materialise_in_place(indices)
        return super().get_cpu_copy(indices)

    def load_cpu_copy(self, mamba_cache_cpu, indices):
        super().load_cpu_copy(mamba_cache_cpu, indices)
        self._clear_history(indices)

    def _clear_history(self, indices) -> None:
        if self.replay_rings is not None:
            idx = _as_index(indices, self.device).long()
            self.replay_rings.count[:, idx] = 0
            self.replay_rings.phase[:, idx] = 0


def _as_index(indices, device) -> torch.Tensor:
    return torch.as_tensor(indices, device=device).to(torch.int32).flatten()


class ModeHybridReqToTokenPool(HybridReqToTokenPool):
    """SGLang's ``HybridReqToTokenPool`` whose mamba pool is a :class:`ModeMambaPool` in ``mode_config``'s
    mode; everything else (allocator, index mappings, extra-buffer tracking, int8 checkpoint pool) is
    SGLang's own ``_init_mamba_pool``."""

    def __init__(self, *, mode_config: SSMModeConfig, **kwargs):
        self.mode_config = mode_config
        super().__init__(**kwargs)

    def _init_mamba_pool(self, *, mamba_size, mamba_spec_state_size, cache_params, mamba_layer_ids, device,
                         enable_mamba_extra_buffer, speculative_num_draft_tokens=None, speculative_eagle_topk=None):
        native = self.mode_config.mode == "native"
        super()._init_mamba_pool(
            mamba_size=mamba_size, mamba_spec_state_size=mamba_spec_state_size, cache_params=cache_params,
            mamba_layer_ids=mamba_layer_ids, device=device, enable_mamba_extra_buffer=enable_mamba_extra_buffer,
            speculative_num_draft_tokens=speculative_num_draft_tokens if native else None,
            speculative_eagle_topk=speculative_eagle_topk)
        self.mamba_pool = ModeMambaPool.adopt(self.mamba_pool, self.mode_config, cache_params, mamba_spec_state_size)
