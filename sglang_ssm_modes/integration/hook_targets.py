"""Where the plugin hooks SGLang 0.5.14 (dotted targets for ``HookRegistry``), and which of them SGLang
actually applied: it logs and skips a hook it cannot apply, so the pool hook checks before serving a
mode through them."""

from __future__ import annotations

_ATTN = "sglang.srt.layers.attention"
POOL = "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool._init_mamba_pool"
SIZING = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin.handle_max_mamba_cache"
GDN_DECODE = f"{_ATTN}.linear.gdn_backend.GDNAttnBackend.forward_decode"
GDN_EXTEND = f"{_ATTN}.linear.gdn_backend.GDNAttnBackend.forward_extend"
KDA_DECODE = f"{_ATTN}.linear.kda_backend.KDAAttnBackend.forward_decode"
KDA_EXTEND = f"{_ATTN}.linear.kda_backend.KDAAttnBackend.forward_extend"
COMMIT = f"{_ATTN}.hybrid_linear_attn_backend.HybridLinearAttnBackend.update_mamba_state_after_mtp_verify"
INT8_STORE = "sglang.srt.mem_cache.mamba_checkpoint_pool.MambaCheckpointPool.store_from_active"
INT8_LOAD = "sglang.srt.mem_cache.mamba_checkpoint_pool.MambaCheckpointPool.load_to_active"
PD_PREBUILT = "sglang.srt.disaggregation.decode_schedule_batch_mixin.ScheduleBatchDisaggregationDecodeMixin" \
              ".prepare_for_prebuilt"
_MAMBA_COMPONENT = "sglang.srt.mem_cache.unified_cache_components.mamba_component.MambaComponent"
HICACHE_BUILD = f"{_MAMBA_COMPONENT}.build_hicache_transfers"  # HiCache of hybrid SSM models: UnifiedRadixCache
HICACHE_COMMIT = f"{_MAMBA_COMPONENT}.commit_hicache_transfer"
DECODE_STATS = "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter.report_decode_stats"
MODE_TARGETS = (POOL, SIZING, GDN_DECODE, GDN_EXTEND, KDA_DECODE, KDA_EXTEND, COMMIT, INT8_STORE, INT8_LOAD,
                PD_PREBUILT, HICACHE_BUILD, HICACHE_COMMIT, DECODE_STATS)
"""Every target a non-native mode is served through."""


def unapplied_hooks() -> list[str]:
    """Targets of :data:`MODE_TARGETS` that SGLang did not apply."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [target for target in MODE_TARGETS if target not in HookRegistry._patched]
