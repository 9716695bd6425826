"""``ModeMambaPool``: SGLang 0.5.14's ``MambaPool`` whose per-request state resources follow the
SSM state mode, keeping SGLang's interface (``mamba2_layer_cache``, ``clear_slots``, ``copy_from``,
``get_cpu_copy`` / ``load_cpu_copy``, ``get_contiguous_buf_infos``) so the scheduler, radix cache,
HiCache and PD code keep working unchanged.

* ``native``: SGLang's pool as it is (state, conv window, and the ``intermediate_ssm`` /
  ``intermediate_conv_window`` scratch when speculating).
* ``compact``: state and conv window per slot; no per-step state scratch; raw-input records of D
  draft tokens per running request (``[layers, spec_state_size + 1, D, ...]``, indexed like SGLang's
  ``intermediate_ssm``: by the request's position in the verify batch).
* ``replay``: the state slot holds the *checkpoint*; each slot also owns a ring of 2·L records and a
  cursor (the history belongs to the request across rounds, so it lives with its slot). Tree verify
  (EAGLE topk > 1) is routed through compact's records and commit (``verify_path``).

When speculating, compact and replay keep SGLang's per-step *conv* window scratch
(``intermediate_conv_window``, in SGLang's own deduplicated layout: D + K - 2 columns per request), so
the conv path, its commit and its tree handling stay SGLang's; it costs as much as the conv ring of
``ops.conv_window`` would (K - 1 + D columns) and leaves the pool's conv layout untouched for the
radix cache, HiCache and PD.

Everything that hands pool contents to someone else (``copy_from`` for radix-cache checkpoints,
``get_cpu_copy`` for offload, ``canonical_states`` for int8 checkpoints) sees the canonical committed
state: replay materialises it first (into the destination slot, a copy, or by folding in place), and
whatever receives a state (``copy_from``'s destination, ``load_cpu_copy``, ``clear_slots``,
``clear_history``) starts with an empty history. PD transfer and HiCache read and write the raw buffers:
the integration hooks fold a replay slot in place before a transfer starts (``materialise_in_place``) and
empty the history of a slot a transfer filled (``clear_history``).

This module imports SGLang (it is glue); the kernels it drives live in :mod:`sglang_ssm_modes.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from sglang.srt.configs.mamba_utils import BaseLinearStateParams, KimiLinearStateShape
from sglang.srt.mem_cache import memory_pool as sglang_memory_pool
from sglang.srt.mem_cache.memory_pool import (
    HybridReqToTokenPool, MambaPool, conv_window_dedup_enabled, get_tensor_size_bytes,
)

from ..config import SSMModeConfig
from ..ops.compact import CompactRecordBuffers
from ..ops.replay import ReplayRing, clear_history, fold_into_checkpoints, replay_fold

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


@dataclass(frozen=True, kw_only=True)
class ConvScratchState(MambaPool.State):
    """SGLang's state and conv window plus its per-step conv-window scratch, without the per-step
    SSM state scratch (``intermediate_ssm``) that compact and replay remove. ``at_layer_idx`` and the
    PD buffer description (which skips ``intermediate_conv_window`` by name) work unchanged."""

    intermediate_conv_window: List[torch.Tensor]


def conv_window_scratch(conv_shapes, layers: int, spec_state_size: int, draft_tokens: int, dtype: torch.dtype,
                        device, dedup: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(views, physical buffers)`` of SGLang 0.5.14's ``intermediate_conv_window`` scratch, in its own
    layout (``MambaPool.__init__``): with ``dedup`` one ``[layers, S + 1, conv_dim, D + K - 2]`` buffer per
    conv shape seen through an overlapping ``[layers, S + 1, D, conv_dim, K - 1]`` view (step t's window
    = columns t .. t + K - 2); otherwise dense ``[layers, S + 1, D, conv_dim, K - 1]`` (tree verify)."""
    views, phys = [], []
    for conv_dim, win in conv_shapes:
        if dedup:
            buf = torch.zeros(layers, spec_state_size + 1, conv_dim, draft_tokens + win - 1, dtype=dtype, device=device)
            s = buf.stride()
            views.append(buf.as_strided((layers, spec_state_size + 1, draft_tokens, conv_dim, win),
                                        (s[0], s[1], s[3], s[2], s[3])))
        else:
            buf = torch.zeros(layers, spec_state_size + 1, draft_tokens, conv_dim, win, dtype=dtype, device=device)
            views.append(buf)
        phys.append(buf)
    return views, phys


def conv_window_dedup(is_kda: bool, eagle_topk: int | None) -> bool:
    """SGLang's choice of the deduplicated conv-window layout, for GDN only: its dedup view reads
    ``conv_shape`` as ``(conv_dim, K - 1)``, while KDA's is ``(K - 1, conv_dim)`` — the overlapping view
    would alias channels there (SGLang 0.5.14 never verifies KDA, so never hit it)."""
    return not is_kda and conv_window_dedup_enabled(sglang_memory_pool._is_npu, sglang_memory_pool._is_cpu,
                                                    eagle_topk)


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
        self._add_mode_buffers(mode_config, kwargs["cache_params"], kwargs["spec_state_size"],
                               kwargs.get("speculative_eagle_topk"))

    @classmethod
    def adopt(cls, pool: MambaPool, mode_config: SSMModeConfig, cache_params: BaseLinearStateParams,
              spec_state_size: int, eagle_topk: int | None = None) -> "ModeMambaPool":
        """Take over a ``MambaPool`` SGLang has just built (without speculative scratch for compact /
        replay) and add the mode's buffers: no state tensor is allocated twice."""
        if mode_config.mode != "native" and isinstance(pool.mamba_cache, MambaPool.SpeculativeState):
            raise ValueError(f"--ssm-state-mode {mode_config.mode}: build the MambaPool without "
                             "speculative_num_draft_tokens (its per-step scratch is what this mode removes)")
        mode_pool = cls.__new__(cls)
        mode_pool.__dict__.update(pool.__dict__)
        mode_pool._add_mode_buffers(mode_config, cache_params, spec_state_size, eagle_topk)
        return mode_pool

    @property
    def mode(self) -> str:
        return self.mode_config.mode

    def _add_mode_buffers(self, mode_config: SSMModeConfig, cache_params: BaseLinearStateParams,
                          spec_state_size: int, eagle_topk: int | None) -> None:
        self.mode_config = mode_config
        self.heads = h = LinearHeads.from_cache_params(cache_params)
        self.tree_verify = (eagle_topk or 1) > 1
        self.compact_records = self.replay_rings = None
        self.materialised = 0  # requests whose replay state was materialised for a copy or transfer (metrics)
        is_kda = h.family == "kda"
        act = mode_config.activation_dtype  # raw k / v records: the model's activation dtype
        speculative = mode_config.draft_tokens > 1
        if mode_config.mode != "native" and speculative:
            views, phys = conv_window_scratch(
                [tuple(c) for c in cache_params.shape.conv], self.num_mamba_layers, spec_state_size,
                mode_config.draft_tokens, cache_params.dtype.conv, self.device,
                dedup=conv_window_dedup(is_kda, eagle_topk))
            self.mamba_cache = ConvScratchState(conv=self.mamba_cache.conv, temporal=self.mamba_cache.temporal,
                                                intermediate_conv_window=views)
            self._intermediate_conv_window_phys = phys
            self.mem_usage += get_tensor_size_bytes(phys) / GB
        if speculative:  # record slot of each verify row: its batch position (SGLang's intermediate indices)
            self.record_rows = torch.arange(spec_state_size + 1, dtype=torch.int32, device=self.device)
        if self.verify_path == "compact" and speculative:  # decode alone commits at once
            self.compact_records = _per_layer(CompactRecordBuffers.allocate(
                spec_state_size + 1, mode_config.draft_tokens, h.num_k_heads, h.num_v_heads, h.head_k_dim,
                h.head_v_dim, is_kda, act, "meta"), self.num_mamba_layers, self.device)
            self.mem_usage += sum(t.nbytes for t in self.compact_records.__dict__.values()) / GB
        if mode_config.mode == "replay":
            self.replay_rings = _per_layer(ReplayRing.allocate(
                self.size + 1, mode_config.replay_history, h.num_k_heads, h.num_v_heads, h.head_k_dim, h.head_v_dim,
                is_kda, act, "meta"), self.num_mamba_layers, self.device)
            self.mem_usage += sum(t.nbytes for t in self.replay_rings.buffers().values()) / GB

    @property
    def decode_path(self) -> str:
        """The kernels a plain decode of this pool runs: ``replay`` (:func:`~..ops.replay.replay_decode`: output-only
        against checkpoint + history, or written through for small batches) or ``native`` (SGLang's decode kernel:
        native and compact)."""
        return "replay" if self.mode == "replay" else "native"

    @property
    def verify_path(self) -> str:
        """The kernels a speculative verify of this pool runs: ``native`` (per-step states),
        ``compact`` (records; also replay's route for tree verify) or ``replay`` (chain)."""
        if self.mode == "replay" and self.tree_verify:
            return "compact"
        return self.mode

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
        self.clear_history(indices)

    def copy_from(self, src_indices: torch.Tensor, dst_indices: torch.Tensor):
        """Radix-cache checkpoint / copy-on-write: the destination receives the canonical committed
        state (replay: materialised straight into the destination slot, no whole-batch temporary)
        and an empty history."""
        if self.replay_rings is None:
            super().copy_from(src_indices, dst_indices)
            self.clear_history(dst_indices)
            return
        for i in range(len(self.mamba_cache.conv)):
            self.mamba_cache.conv[i][:, dst_indices] = self.mamba_cache.conv[i][:, src_indices]
        src, dst = _as_index(src_indices, self.device), _as_index(dst_indices, self.device)
        self.materialised += src.shape[0]
        temporal = self.mamba_cache.temporal  # every layer in one launch
        replay_fold(temporal, src, self.replay_rings, src, None, is_kda=self.heads.family == "kda", dst=temporal,
                    dst_indices=dst)
        self.clear_history(dst)

    def materialise_in_place(self, indices: torch.Tensor) -> None:
        """Fold the histories of ``indices`` into their checkpoints (replay; no-op otherwise), so the
        raw state buffers hold the canonical committed state — before any transfer starts."""
        if self.replay_rings is None:
            return
        idx = _as_index(indices, self.device)
        self.materialised += idx.shape[0]
        everything = torch.ones_like(idx, dtype=torch.bool)
        fold_into_checkpoints(self.mamba_cache.temporal, idx, self.replay_rings, idx, everything,
                              is_kda=self.heads.family == "kda")

    def canonical_states(self, indices: torch.Tensor) -> torch.Tensor:
        """``[layers, len(indices), HV, V, K]``: the committed states of ``indices`` in the state dtype
        (replay: checkpoint + history materialised into this new tensor; the pool is only read)."""
        idx = _as_index(indices, self.device)
        temporal = self.mamba_cache.temporal
        if self.replay_rings is None:
            return temporal[:, idx.long()]
        out = torch.empty((temporal.shape[0], idx.shape[0], *temporal.shape[2:]), dtype=temporal.dtype,
                          device=temporal.device)
        self.materialised += idx.shape[0]
        rows = torch.arange(idx.shape[0], dtype=torch.int32, device=idx.device)
        replay_fold(temporal, idx, self.replay_rings, idx, None, is_kda=self.heads.family == "kda", dst=out,
                    dst_indices=rows)
        return out

    def get_cpu_copy(self, indices):
        # SGLang synchronizes before copying: on a PD decode server a retracted request's slot is offloaded
        # while the previous batch, which may append to or write through its history, is still in flight
        sglang_memory_pool.current_platform.synchronize()
        self.materialise_in_place(indices)
        return super().get_cpu_copy(indices)

    def load_cpu_copy(self, mamba_cache_cpu, indices):
        super().load_cpu_copy(mamba_cache_cpu, indices)
        self.clear_history(indices)

    def clear_history(self, indices) -> None:
        """Empty the histories of pool slots ``indices`` (replay; no-op otherwise): a slot that has just
        received a canonical state from elsewhere."""
        if self.replay_rings is not None:
            clear_history(self.replay_rings, _as_index(indices, self.device))  # every layer, one launch


def _as_index(indices, device) -> torch.Tensor:
    return torch.as_tensor(indices, device=device).to(torch.int32).flatten()


def init_mode_mamba_pool(sglang_init_mamba_pool, req_to_token_pool: HybridReqToTokenPool, mode_config: SSMModeConfig,
                         **kwargs) -> None:
    """``HybridReqToTokenPool._init_mamba_pool`` in ``mode_config``'s mode: SGLang's own method
    (``sglang_init_mamba_pool``, called unbound with ``kwargs``: allocator, index mappings, extra-buffer
    tracking, int8 checkpoint pool), building its ``MambaPool`` without the per-step scratch in compact
    and replay, which :meth:`ModeMambaPool.adopt` then takes over."""
    native = mode_config.mode == "native"
    draft = kwargs.get("speculative_num_draft_tokens")
    topk = kwargs.get("speculative_eagle_topk")
    sglang_kwargs = {**kwargs, "speculative_num_draft_tokens": draft if native else None}
    if native and draft and isinstance(kwargs["cache_params"].shape, KimiLinearStateShape):
        # SGLang's MambaPool only reads topk to pick the conv-window layout; > 1 selects the dense
        # one, the only one right for KDA's transposed conv state (see conv_window_dedup)
        sglang_kwargs["speculative_eagle_topk"] = max(topk or 1, 2)
    sglang_init_mamba_pool(req_to_token_pool, **sglang_kwargs)
    req_to_token_pool.mamba_pool = ModeMambaPool.adopt(
        req_to_token_pool.mamba_pool, mode_config, kwargs["cache_params"], kwargs["mamba_spec_state_size"],
        kwargs.get("speculative_eagle_topk"))
