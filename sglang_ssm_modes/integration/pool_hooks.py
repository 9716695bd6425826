"""Hooks that build the mode's pool inside SGLang 0.5.14 and size it: ``HybridReqToTokenPool._init_mamba_pool``
(the pool) and ``ModelRunnerKVCacheMixin.handle_max_mamba_cache`` (how many pool slots fit, so memory a
mode saves becomes more running requests or more radix cache); and the int8 radix-cache checkpoints
(``MambaCheckpointPool``), which read and write the pool's raw state: they store the canonical state and
the slot that receives one starts with an empty history. PD disaggregation is the same contract across
servers: the prefill server's slot holds the canonical state when its transfer starts (a replay prefill
folds the history first and leaves none behind), and the decode server's slot that received it starts
with an empty history (``ScheduleBatch.prepare_for_prebuilt``). HiCache likewise (for hybrid SSM models SGLang 0.5.14
serves it through ``UnifiedRadixCache`` and its ``MambaComponent``): a tree slot is folded in place before
its device-to-host backup starts (``build_hicache_transfers``), and the slots a host-to-device load fills
start with an empty history (``build_hicache_transfers`` for a request's own new slot,
``commit_hicache_transfer`` for every slot loaded).

The mode comes from the server arguments (``ServerArgs.ssm_mode_config``, set at startup by the plugin);
without one every hook is SGLang's own behaviour.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..config import SSMModeConfig
from ..ops.compact import CompactRecordBuffers
from ..ops.replay import ReplayRing
from ..pool import LinearHeads, ModeMambaPool, init_mode_mamba_pool
from ..pool.mode_pool import conv_window_dedup, conv_window_scratch
from .hook_targets import unapplied_hooks
from .replay_tradeoffs import replay_tradeoffs

logger = logging.getLogger(__name__)
GB = 1 << 30


def server_mode_config() -> SSMModeConfig | None:
    """The mode chosen at startup, from SGLang's global server arguments (None before they are set
    or when the plugin did not configure them)."""
    from sglang.srt.server_args import get_global_server_args

    try:
        settings = getattr(get_global_server_args(), "ssm_mode_config", None)
    except ValueError:  # "Global server args is not set yet!"
        return None
    return None if settings is None else SSMModeConfig(**settings)


def init_mamba_pool(original, self, **kwargs):
    """AROUND ``HybridReqToTokenPool._init_mamba_pool``: the mode's :class:`ModeMambaPool`."""
    cfg = server_mode_config()
    if cfg is None:
        return original(self, **kwargs)
    missing = unapplied_hooks()
    if cfg.mode != "native" and missing:
        raise RuntimeError(f"--ssm-state-mode {cfg.mode}: SGLang did not apply these hooks of sglang-ssm-modes "
                           f"(see its log for why): {', '.join(missing)}. Is the installed SGLang 0.5.14?")
    # the pool's verify width is SGLang's final one; without a speculative algorithm SGLang still passes the
    # raw --speculative-num-draft-tokens here, which no verify will use
    draft = (kwargs.get("speculative_num_draft_tokens") or 1) if cfg.speculative else 1
    if draft != cfg.draft_tokens:
        cfg = dataclasses.replace(cfg, draft_tokens=draft)
    init_mode_mamba_pool(original, self, cfg, **kwargs)
    pool = self.mamba_pool
    logger.info("sglang-ssm-modes: mamba pool allocated: mode=%s slots=%d bytes=%d", cfg.mode, pool.size,
                round(pool.mem_usage * GB))
    if cfg.mode != "native" and cfg.draft_tokens > 1:
        shape = "tree" if pool.tree_verify else "chain"
        routed = " (replay serves trees through compact's records and commit)" if cfg.mode != pool.verify_path else ""
        if cfg.compact_verify == "fast":  # --ssm-compact-verify fast
            routed += " at the fast tiling (outputs equal to native's to float32 rounding, commits bit for bit)"
        logger.info("sglang-ssm-modes: speculative verify of %d draft tokens (%s): %s kernels%s; plain decode: %s",
                    cfg.draft_tokens, shape, pool.verify_path, routed,
                    "replay kernels" if pool.decode_path == "replay" else "SGLang's decode kernel")
    if cfg.mode == "replay":  # where replay's kernels are not a win, measured
        for level, line in replay_tradeoffs(cfg, pool.heads.family, pool.mamba_cache.temporal.dtype, pool.tree_verify):
            logger.log(level, "sglang-ssm-modes: %s", line)


def mode_bytes_per_request(cfg: SSMModeConfig, cache_params, eagle_topk: int | None) -> tuple[int, int]:
    """``(slot, running)`` bytes over all linear layers on this rank: what every pool slot holds (SGLang's
    ``mamba_cache_per_req`` plus, for replay, its ring and cursors) and what only a running request adds
    when speculating (compact's records, the conv-window scratch). Measured from the buffers the pool
    allocates (on the meta device), so sizing and pool cannot disagree."""
    heads = LinearHeads.from_cache_params(cache_params)
    layers, act, conv_dtype = len(cache_params.layers), cfg.activation_dtype, cache_params.dtype.conv
    is_kda = heads.family == "kda"
    dims = (heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim)
    slot = cache_params.mamba_cache_per_req
    running = 0
    if cfg.mode == "replay":
        ring = ReplayRing.allocate(1, cfg.replay_history, *dims, is_kda, act, "meta")
        slot += layers * sum(t.nbytes for t in ring.buffers().values())
    if cfg.speculative:
        _, scratch = conv_window_scratch([tuple(c) for c in cache_params.shape.conv], layers, 0, cfg.draft_tokens,
                                         conv_dtype, "meta", dedup=conv_window_dedup(is_kda, eagle_topk))
        running += sum(t.nbytes for t in scratch)
        if cfg.mode == "compact" or (cfg.mode == "replay" and (eagle_topk or 1) > 1):
            rec = CompactRecordBuffers.allocate(1, cfg.draft_tokens, *dims, is_kda, act, "meta")
            running += layers * sum(t.nbytes for t in dataclasses.astuple(rec))
    return slot, running


def handle_max_mamba_cache(original, self, total_rest_memory):
    """AROUND ``ModelRunnerKVCacheMixin.handle_max_mamba_cache``: native is SGLang's; compact and replay
    fit the pool with their own per-slot and per-running-request bytes, along SGLang's three branches
    (explicit ``--max-mamba-cache-size``; no radix cache with ``--max-running-requests``; the memory
    ratio split), and log the result."""
    cfg = server_mode_config()
    if cfg is None or cfg.mode == "native":
        return original(self, total_rest_memory)
    sa = self.server_args
    dp = self.dp_size if sa.enable_dp_attention else 1
    slot, running = mode_bytes_per_request(cfg, self.mambaish_config.mamba2_cache_params, sa.speculative_eagle_topk)
    spec = not self.spec_algorithm.is_none()
    slots_per_request = self._calculate_mamba_ratio()
    ratio = slots_per_request if spec else 1  # SGLang's joint solve uses it only when speculating
    if sa.max_mamba_cache_size is not None:
        sa.max_mamba_cache_size //= dp
        fixes = [f"pass a --max-mamba-cache-size of at least {dp}"]
    elif sa.disable_radix_cache and sa.max_running_requests is not None:
        sa.max_mamba_cache_size = sa.max_running_requests // dp
        fixes = [f"pass a --max-running-requests of at least {dp}"]
    else:
        fixes = ["raise --mamba-full-memory-ratio or --mem-fraction-static"]
        if cfg.mode == "replay":
            fixes.append("pass a smaller --ssm-replay-history")
        if spec:
            fixes.append("pass a smaller --speculative-num-draft-tokens")
        budget = total_rest_memory * sa.mamba_full_memory_ratio / (1 + sa.mamba_full_memory_ratio) * GB
        per_slot = slot + (running / ratio if spec else 0)
        sa.max_mamba_cache_size = int(budget // per_slot)
    running_reqs = 0
    if spec:
        running_reqs = min(sa.max_running_requests // dp, sa.max_mamba_cache_size // ratio)
    reserved = (running * running_reqs + slot * sa.max_mamba_cache_size) / GB
    if sa.max_mamba_cache_size <= 0:
        raise RuntimeError(
            f"Not enough GPU memory for the linear-attention state in --ssm-state-mode {cfg.mode}: "
            f"max_mamba_cache_size={sa.max_mamba_cache_size} ({slot / (1 << 20):.2f} MiB per slot): "
            + ", or ".join(fixes) + ".")
    logger.info("sglang-ssm-modes: %s: %.2f MiB per pool slot + %.2f MiB per running request when speculating; "
                "%d pool slots (%.2f GiB) -> up to %d running requests (%d slots each with the radix cache's ratio)",
                cfg, slot / (1 << 20), running / (1 << 20), sa.max_mamba_cache_size, reserved,
                sa.max_mamba_cache_size // slots_per_request, slots_per_request)
    return total_rest_memory - reserved


def int8_store_from_active(original, self, active_mamba_pool, active_slots, ckpt_slots):
    """AROUND ``MambaCheckpointPool.store_from_active``: quantize the canonical state (replay: checkpoint +
    history, materialised into a temporary of the stored slots only; the active slot is only read)."""
    if not isinstance(active_mamba_pool, ModeMambaPool) or active_mamba_pool.replay_rings is None:
        return original(self, active_mamba_pool, active_slots, ckpt_slots)
    self.temporal.store(ckpt_slots, active_mamba_pool.canonical_states(active_slots))
    for i, conv in enumerate(self.conv):  # the conv window as SGLang copies it
        conv[:, ckpt_slots] = active_mamba_pool.mamba_cache.conv[i][:, active_slots]


def int8_load_to_active(original, self, active_mamba_pool, ckpt_slots, active_slots):
    """AROUND ``MambaCheckpointPool.load_to_active``: SGLang's dequantizing copy, then the receiving
    slots' histories are emptied (on the forward stream, where SGLang runs this copy-on-write)."""
    original(self, active_mamba_pool, ckpt_slots, active_slots)
    if isinstance(active_mamba_pool, ModeMambaPool):
        active_mamba_pool.clear_history(active_slots)


def _replay_pool(cache) -> ModeMambaPool | None:
    """The replay-mode pool behind a radix cache or a batch, or None (another mode, or SGLang's own pool)."""
    pool = getattr(getattr(cache, "req_to_token_pool", None), "mamba_pool", None)
    return pool if isinstance(pool, ModeMambaPool) and pool.replay_rings is not None else None


def pd_prepare_for_prebuilt(original, self):
    """AROUND ``ScheduleBatch.prepare_for_prebuilt`` (PD decode server): the requests' states have just
    arrived by transfer into their pool slots — raw canonical states; in replay, empty those slots'
    histories (a reused slot may still hold a previous owner's records) before ``process_prebuilt``
    caches the requests in the radix tree and before their first decode."""
    result = original(self)
    pool = _replay_pool(self)
    if pool is not None and self.reqs:
        slots = [req.mamba_pool_idx for req in self.reqs if req.mamba_pool_idx is not None]
        if slots:
            pool.clear_history(torch.stack([torch.as_tensor(s).reshape(()) for s in slots]))
    return result


def hicache_build_transfers(original, self, node, phase, **kwargs):
    """AROUND ``MambaComponent.build_hicache_transfers`` (SGLang 0.5.14 serves HiCache for hybrid SSM models
    through ``UnifiedRadixCache``; its mamba component describes each host transfer of a tree node's state):

    * device-to-host backup: in replay, fold the node's slot in place first, so the raw buffers the backup
      copies (on HiCache's write stream, ordered after this launch) hold the canonical state and the slot
      keeps no history. The tree owns the slot (a finished request may donate its own), so folding it changes
      no one's committed state;
    * host-to-device load: the request's own slot, when SGLang allocates it here (straight from the
      allocator, so no deferred clear follows), starts with an empty history — a previous owner's records
      would otherwise be folded into the restored state, whether or not the load goes ahead."""
    from sglang.srt.mem_cache.unified_cache_components.tree_component import CacheTransferPhase

    pool = _replay_pool(self.cache)
    req = kwargs.get("req")
    had_slot = req is None or req.mamba_pool_idx is not None
    if pool is not None and phase == CacheTransferPhase.BACKUP_HOST:
        value = node.component_data[self.component_type].value
        if value is not None:
            pool.materialise_in_place(value)
    result = original(self, node, phase, **kwargs)
    if pool is not None and phase == CacheTransferPhase.LOAD_BACK and not had_slot and req.mamba_pool_idx is not None:
        pool.clear_history(torch.as_tensor(req.mamba_pool_idx).reshape(1))
    return result


def hicache_commit_transfer(original, self, node, phase, transfers=(), **kwargs):
    """AROUND ``MambaComponent.commit_hicache_transfer``: after a host-to-device load, in replay, the device
    slots the host's canonical states went to — the tree node's (allocated by HiCache's controller) and a
    request's own — start with an empty history (a reused slot may still hold a previous owner's records).
    The load writes only the state and conv buffers, never the rings, so the order against it is free."""
    from sglang.srt.mem_cache.unified_cache_components.tree_component import CacheTransferPhase

    result = original(self, node, phase, transfers, **kwargs)
    pool = _replay_pool(self.cache)
    if pool is not None and phase == CacheTransferPhase.LOAD_BACK and transfers:
        slots = [t.device_indices.reshape(-1) for t in transfers if t.device_indices is not None]
        if slots:
            pool.clear_history(torch.cat(slots))
    return result
