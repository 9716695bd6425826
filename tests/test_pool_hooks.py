"""The pool and sizing hooks: the bytes the sizing charges are exactly what the pool allocates, and
SGLang's own ``handle_max_mamba_cache`` (native) and the hook (compact / replay) split the same memory —
the saved bytes become pool slots."""

import logging
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.model_executor.model_runner_kv_cache_mixin import ModelRunnerKVCacheMixin

from sglang_ssm_modes.config import SSMModeConfig
from sglang_ssm_modes.integration import pool_hooks
from sglang_ssm_modes.integration.replay_tradeoffs import replay_tradeoffs
from sglang_ssm_modes.sizing import LinearAttnShape, request_bytes
from test_mode_pool import (HV, KD, LAYERS, VD, _expected_fold, _fill_history, cuda_scratch_on_cpu,  # noqa: F401
                            gdn_params, kda_params, make_pool)

GB = 1 << 30


def hooked_pool(cfg: SSMModeConfig, params, monkeypatch, caplog, *, draft: int | None, topk: int | None,
                size: int = 9, spec_size: int = 5):
    """SGLang's ``HybridReqToTokenPool`` built through the pool hook with the server's mode ``cfg``, as
    SGLang hands it ``--speculative-num-draft-tokens`` ``draft`` and the top-k; its mamba pool."""
    original = HybridReqToTokenPool._init_mamba_pool
    monkeypatch.setattr(pool_hooks, "server_mode_config", lambda: cfg)
    monkeypatch.setattr(pool_hooks, "unapplied_hooks", lambda: [])
    monkeypatch.setattr(HybridReqToTokenPool, "_init_mamba_pool",
                        lambda self, **kw: pool_hooks.init_mamba_pool(original, self, **kw))
    caplog.set_level("INFO", logger=pool_hooks.logger.name)
    return HybridReqToTokenPool(
        size=spec_size, mamba_size=size, mamba_spec_state_size=spec_size, max_context_len=16, device="cpu",
        enable_memory_saver=False, cache_params=params(), mamba_layer_ids=list(range(len(params().layers))),
        enable_mamba_extra_buffer=False, speculative_num_draft_tokens=draft, speculative_eagle_topk=topk,
        enable_overlap_schedule=False).mamba_pool


@pytest.mark.parametrize("params", [gdn_params, kda_params], ids=["gdn", "kda"])
@pytest.mark.parametrize("mode,draft,topk", [("compact", 4, 1), ("replay", 4, 1), ("replay", 1, 1),
                                             ("replay", 4, 3), ("compact", 3, 2)])
def test_charged_bytes_are_the_allocated_bytes(params, mode, draft, topk, monkeypatch, caplog,
                                               cuda_scratch_on_cpu):  # noqa: F811
    cfg = SSMModeConfig(mode=mode, draft_tokens=draft, replay_history=8, tree_verify=draft > 1 and topk > 1)
    size, spec_size = 9, 5
    pool = hooked_pool(cfg, params, monkeypatch, caplog, draft=draft if draft > 1 else None, topk=topk, size=size,
                       spec_size=spec_size)
    slot, running = pool_hooks.mode_bytes_per_request(cfg, params(), topk)
    assert pool.mem_usage * GB == pytest.approx(slot * (size + 1) + running * (spec_size + 1), rel=1e-12)
    assert (running > 0) == (draft > 1)
    # the line scripts/e2e_servers.py reads the allocated pool from
    assert f"mamba pool allocated: mode={mode} slots={size} bytes={round(pool.mem_usage * GB)}" in caplog.text
    # the verify path, said at startup: replay's trees go through compact's records
    if draft > 1:
        path = "compact" if mode == "compact" or topk > 1 else "replay"
        shape_name = "tree" if topk > 1 else "chain"
        assert f"speculative verify of {draft} draft tokens ({shape_name}): {path} kernels" in caplog.text
        assert ("replay serves trees through compact's records" in caplog.text) == (mode == "replay" and topk > 1)
    else:
        assert "speculative verify" not in caplog.text
    # where replay's kernels are not a win, said at startup (L = 8 here: as at L = 16, where plain decode writes
    # through below 32 requests for GDN, 40 for KDA, and a chain verify below 32)
    bound = 32 if pool.heads.family == "gdn" else 40
    assert (f"plain decode writes through below {bound} requests per step" in caplog.text) == (mode == "replay")
    assert ("chain verify writes through below 32 requests per step" in caplog.text) == (
        mode == "replay" and draft > 1 and topk == 1)
    # the sizing model (`python -m sglang_ssm_modes memory`) charges the same bytes
    family = pool.heads.family
    shape = LinearAttnShape(family=family, num_linear_layers=len(params().layers), num_v_heads=pool.heads.num_v_heads,
                            num_k_heads=pool.heads.num_k_heads, head_k_dim=pool.heads.head_k_dim,
                            head_v_dim=pool.heads.head_v_dim, conv_kernel=4, hidden_size=64, source="test")
    model = request_bytes(shape, cfg, eagle_topk=topk)
    assert (model.slot_bytes, model.running_bytes) == (slot, running)


@pytest.mark.parametrize("mode", ["compact", "replay"])
def test_a_draft_width_without_speculation_builds_no_verify(mode, monkeypatch, caplog,
                                                            cuda_scratch_on_cpu):  # noqa: F811
    """Without ``--speculative-algorithm`` SGLang still hands the pool the raw ``--speculative-num-draft-tokens``;
    the mode's configuration says D = 1 (no verify), and the pool follows it: no records, no conv scratch —
    what the sizing charged."""
    cfg = SSMModeConfig(mode=mode, draft_tokens=1, replay_history=8)
    pool = hooked_pool(cfg, gdn_params, monkeypatch, caplog, draft=16, topk=None)
    slot, running = pool_hooks.mode_bytes_per_request(cfg, gdn_params(), None)
    assert running == 0 and pool.mem_usage * GB == pytest.approx(slot * 10, rel=1e-12)
    assert "speculative verify" not in caplog.text


def _runner(cache_params, *, draft: int | None, max_running: int = 64, radix: bool = True):
    server_args = SimpleNamespace(
        max_mamba_cache_size=None, disable_radix_cache=not radix, max_running_requests=max_running,
        speculative_num_draft_tokens=draft, speculative_eagle_topk=1 if draft else None,
        mamba_full_memory_ratio=0.9, enable_dp_attention=False, dp_size=1)
    return SimpleNamespace(
        mambaish_config=SimpleNamespace(mamba2_cache_params=cache_params), server_args=server_args, dp_size=1,
        spec_algorithm=SimpleNamespace(is_none=lambda: draft is None),
        _calculate_mamba_ratio=lambda: 1 if not radix else 3)


@pytest.mark.parametrize("draft", [None, 4])
def test_saved_memory_becomes_pool_slots(draft, monkeypatch):
    """Same memory, same arguments: SGLang's sizing for native, the hook for compact and replay. The
    hook never spends more than the budget, and compact fits more slots than native when speculating."""
    params = gdn_params()
    budget_gb = 2000 * params.mamba_cache_per_req / GB
    native = _runner(params, draft=draft)
    rest_native = ModelRunnerKVCacheMixin.handle_max_mamba_cache(native, budget_gb)
    slots = {"native": native.server_args.max_mamba_cache_size}
    for mode in ("compact", "replay"):
        cfg = SSMModeConfig(mode=mode, draft_tokens=draft or 1, replay_history=16)
        monkeypatch.setattr(pool_hooks, "server_mode_config", lambda cfg=cfg: cfg)
        runner = _runner(params, draft=draft)
        rest = pool_hooks.handle_max_mamba_cache(lambda *a: pytest.fail("native path"), runner, budget_gb)
        slots[mode] = runner.server_args.max_mamba_cache_size
        slot, running = pool_hooks.mode_bytes_per_request(cfg, params, 1)
        reqs = min(64, slots[mode] // 3) if draft else 0
        assert rest == pytest.approx(budget_gb - (slot * slots[mode] + running * reqs) / GB)
        assert rest >= budget_gb / 1.9 - 1e-9, "the mamba share of the budget is not exceeded"
    assert rest_native > 0
    if draft:
        assert slots["compact"] > slots["native"]
    else:
        assert slots["compact"] == slots["native"] and slots["replay"] < slots["native"]


def test_unapplied_hooks_refuse_to_start(monkeypatch):
    cfg = SSMModeConfig(mode="compact", draft_tokens=4)
    monkeypatch.setattr(pool_hooks, "server_mode_config", lambda: cfg)
    with pytest.raises(RuntimeError, match="did not apply these hooks"):
        pool_hooks.init_mamba_pool(lambda *a, **k: None, object())


def test_without_a_mode_the_hooks_are_sglangs(monkeypatch):
    monkeypatch.setattr(pool_hooks, "server_mode_config", lambda: None)
    assert pool_hooks.handle_max_mamba_cache(lambda self, m: ("sglang", m), "runner", 1.5) == ("sglang", 1.5)
    assert pool_hooks.init_mamba_pool(lambda self, **k: ("sglang", k), "pool", a=1) == ("sglang", {"a": 1})


def test_server_mode_config_reads_sglangs_global_server_args(monkeypatch):
    from sglang.srt import server_args as sa

    monkeypatch.setattr(sa, "_global_server_args", None)
    assert pool_hooks.server_mode_config() is None
    cfg = SSMModeConfig(mode="replay", draft_tokens=4, replay_history=32, state_dtype=torch.bfloat16)
    monkeypatch.setattr(sa, "_global_server_args", SimpleNamespace(ssm_mode_config=cfg.to_dict()))
    assert pool_hooks.server_mode_config() == cfg


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_int8_checkpoints_store_the_canonical_state(mode, cuda_scratch_on_cpu):  # noqa: F811
    """SGLang's ``MambaCheckpointPool`` through the hooks: a replay slot with history is stored as its
    canonical state (quantized exactly as SGLang quantizes that state), the active slot is only read,
    and the slot a checkpoint is loaded into starts with an empty history."""
    from sglang.srt.mem_cache.mamba_checkpoint_pool import MambaCheckpointPool

    pool = make_pool(mode, draft_tokens=1, size=6, history=8)
    gen = torch.Generator().manual_seed(5)
    pool.mamba_cache.temporal.copy_(torch.randn(pool.mamba_cache.temporal.shape, generator=gen) * 0.1)
    pool.mamba_cache.conv[0].copy_(torch.randn(pool.mamba_cache.conv[0].shape, generator=gen).to(torch.bfloat16))
    if mode == "replay":
        _fill_history(pool, [2, 4], 3, gen)
    canonical = torch.stack([torch.stack([_expected_fold(pool, layer, s) if mode == "replay"
                                          else pool.mamba_cache.temporal[layer, s] for s in (2, 4)])
                             for layer in range(LAYERS)])
    temporal, cursors = pool.mamba_cache.temporal.clone(), pool.replay_rings and pool.replay_rings.count.clone()
    ckpt = MambaCheckpointPool(num_layers=LAYERS, num_slots=4, num_heads=HV, head_v_dim=VD, head_k_dim=KD,
                               conv_shapes=[tuple(pool.mamba_cache.conv[0].shape[2:])], conv_dtype=torch.bfloat16,
                               device="cpu", temporal_dtype=torch.float32)
    src, dst = torch.tensor([2, 4]), torch.tensor([1, 3])
    pool_hooks.int8_store_from_active(MambaCheckpointPool.store_from_active, ckpt, pool, src, dst)
    assert torch.equal(pool.mamba_cache.temporal, temporal), "the active slots are only read"
    q, scale = ckpt.temporal.quantize(canonical)  # SGLang's own quantizer on the expected state
    # replay: the expected state is the plain-torch fold, the stored one the kernel's (float32 rounding apart)
    assert (ckpt.temporal.qdata[:, dst].int() - q.int()).abs().max() <= (0 if mode != "replay" else 1)
    torch.testing.assert_close(ckpt.temporal.scale[:, dst], scale, rtol=1e-5 if mode == "replay" else 0, atol=0)
    assert torch.equal(ckpt.conv[0][:, dst], pool.mamba_cache.conv[0][:, src])
    if mode == "replay":
        assert torch.equal(pool.replay_rings.count, cursors)
        pool.replay_rings.count[:, 5] = 2  # the receiving slot held someone's history
    pool_hooks.int8_load_to_active(MambaCheckpointPool.load_to_active, ckpt, pool, dst[:1], torch.tensor([5]))
    torch.testing.assert_close(pool.mamba_cache.temporal[:, 5], ckpt.temporal.load(dst[:1], torch.float32)[:, 0])
    if mode == "replay":
        assert (pool.replay_rings.count[:, 5] == 0).all() and torch.equal(pool.replay_rings.count[:, [2, 4]],
                                                                          cursors[:, [2, 4]])


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_pd_decode_slots_start_with_an_empty_history(mode, cuda_scratch_on_cpu):  # noqa: F811
    """PD decode: when SGLang prepares the prebuilt batch, the requests' states have arrived by transfer
    into their slots; the hook runs SGLang's own step first, then empties exactly those slots' histories
    (a reused slot may hold a previous owner's records), leaving the states and every other slot alone."""
    from sglang.srt.disaggregation.decode_schedule_batch_mixin import ScheduleBatchDisaggregationDecodeMixin

    pool = make_pool(mode, draft_tokens=1, size=6, history=8)
    gen = torch.Generator().manual_seed(9)
    pool.mamba_cache.temporal.copy_(torch.randn(pool.mamba_cache.temporal.shape, generator=gen))
    if mode == "replay":
        _fill_history(pool, [1, 2, 4], 3, gen)
        pool.replay_rings.phase[:, [2, 4]] = 1
    temporal = pool.mamba_cache.temporal.clone()
    rings = pool.replay_rings and (pool.replay_rings.count.clone(), pool.replay_rings.phase.clone())
    calls = []

    def sglang_step(batch):
        calls.append(pool.replay_rings.count.clone() if mode == "replay" else None)
        return "prepared"

    reqs = [SimpleNamespace(mamba_pool_idx=torch.tensor(s)) for s in (2, 4)] + [SimpleNamespace(mamba_pool_idx=None)]
    batch = SimpleNamespace(reqs=reqs, req_to_token_pool=SimpleNamespace(mamba_pool=pool))
    assert pool_hooks.pd_prepare_for_prebuilt(sglang_step, batch) == "prepared"
    assert len(calls) == 1 and callable(ScheduleBatchDisaggregationDecodeMixin.prepare_for_prebuilt)
    assert torch.equal(pool.mamba_cache.temporal, temporal), "the transferred states are untouched"
    if mode == "replay":
        assert torch.equal(calls[0], rings[0]), "SGLang's own step runs first"
        count, phase = rings
        count[:, [2, 4]] = 0
        phase[:, [2, 4]] = 0
        assert torch.equal(pool.replay_rings.count, count) and torch.equal(pool.replay_rings.phase, phase)
        assert (pool.replay_rings.count[:, 1] == 3).all(), "other slots keep their history"


def test_sglang_serves_hicache_of_hybrid_ssm_models_through_the_hooked_component(monkeypatch):
    """SGLang 0.5.14 builds ``UnifiedRadixCache`` (with a ``MambaComponent``) for a hybrid SSM model with
    ``--enable-hierarchical-cache``, never ``HiMambaRadixCache``: the HiCache hooks sit on that component."""
    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.unified_cache_components.mamba_component import MambaComponent
    from sglang_ssm_modes.integration import hook_targets

    monkeypatch.setattr(registry, "_create_unified_radix_cache", lambda ctx, server_args, params: "unified")
    ctx = SimpleNamespace(server_args=SimpleNamespace(enable_lmcache=False), params=None,
                          effective_chunked_prefill_size=8192, disable_radix_cache=False,
                          enable_hierarchical_cache=True, is_hybrid_ssm=True, is_hybrid_swa=False)
    assert registry.default_radix_cache_factory(ctx) == "unified"
    for target in (hook_targets.HICACHE_BUILD, hook_targets.HICACHE_COMMIT):
        assert target in hook_targets.MODE_TARGETS and callable(getattr(MambaComponent, target.rsplit(".", 1)[1]))


def _mamba_component(pool):
    """SGLang's ``MambaComponent`` over ``pool``, with the radix cache it talks to reduced to what its HiCache
    transfers touch (the allocator is SGLang's)."""
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
    from sglang.srt.mem_cache.unified_cache_components.mamba_component import MambaComponent
    from sglang.srt.mem_cache.unified_cache_components.tree_component import ComponentType

    lru = SimpleNamespace(in_list=lambda node: False, remove_node=lambda node: None, insert_mru=lambda node: None)
    cache = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(mamba_pool=pool, mamba_allocator=MambaSlotAllocator(pool.size, "cpu")),
        host_lru_lists={ComponentType.MAMBA: lru}, lru_lists={ComponentType.MAMBA: lru},
        component_evictable_size_={ComponentType.MAMBA: 0})
    component = MambaComponent.__new__(MambaComponent)
    component.cache = cache
    return component, ComponentType.MAMBA


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_hicache_backup_starts_from_the_canonical_state(mode, cuda_scratch_on_cpu):  # noqa: F811
    """HiCache device-to-host backup of a tree node (``UnifiedRadixCache.write_backup``): by the time SGLang's
    ``MambaComponent`` has described the transfer, the node's slot holds its committed state (replay: folded in
    place, history emptied) — what the host copies is what native would hold; other slots, other phases and
    the other modes are untouched."""
    from sglang.srt.mem_cache.unified_cache_components.mamba_component import MambaComponent
    from sglang.srt.mem_cache.unified_cache_components.tree_component import CacheTransferPhase

    pool = make_pool(mode, draft_tokens=1, size=6, history=8)
    gen = torch.Generator().manual_seed(10)
    pool.mamba_cache.temporal.copy_(torch.randn(pool.mamba_cache.temporal.shape, generator=gen))
    if mode == "replay":
        _fill_history(pool, [1, 3], 3, gen)
    want = pool.canonical_states(torch.tensor([3]))[:, 0]
    before = pool.mamba_cache.temporal.clone()
    rings = pool.replay_rings and pool.replay_rings.count.clone()
    component, ct = _mamba_component(pool)
    node = SimpleNamespace(component_data={ct: SimpleNamespace(value=torch.tensor([3]), host_value=torch.tensor([0]))},
                           hash_value=None)
    storage = pool_hooks.hicache_build_transfers(MambaComponent.build_hicache_transfers, component, node,
                                                 CacheTransferPhase.BACKUP_STORAGE)
    assert storage is None and torch.equal(pool.mamba_cache.temporal, before), "no device slot read: nothing folds"
    transfers = pool_hooks.hicache_build_transfers(MambaComponent.build_hicache_transfers, component, node,
                                                   CacheTransferPhase.BACKUP_HOST)
    assert [int(t.device_indices) for t in transfers] == [3]
    torch.testing.assert_close(pool.mamba_cache.temporal[:, 3], want, rtol=1e-6, atol=1e-6)  # what the host copies
    others = [s for s in range(6) if s != 3]
    assert torch.equal(pool.mamba_cache.temporal[:, others], before[:, others])
    if mode == "replay":
        assert not torch.allclose(before[:, 3], want, atol=1e-3), "the slot held a history for this to mean anything"
        assert (pool.replay_rings.count[:, 3] == 0).all() and torch.equal(pool.replay_rings.count[:, 1], rings[:, 1])
    else:
        assert torch.equal(pool.mamba_cache.temporal, before)
    empty = SimpleNamespace(component_data={ct: SimpleNamespace(value=None, host_value=None)})
    assert pool_hooks.hicache_build_transfers(MambaComponent.build_hicache_transfers, component, empty,
                                              CacheTransferPhase.BACKUP_HOST) is None


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_hicache_loaded_slots_start_with_an_empty_history(mode, cuda_scratch_on_cpu):  # noqa: F811
    """HiCache host-to-device load (``UnifiedRadixCache.load_back``): SGLang's ``MambaComponent`` takes the
    request's slot straight from the allocator (no deferred clear) and HiCache's controller allocates the
    node's; both may still hold a previous owner's records. Once the load is described (the request's slot)
    and committed (every slot loaded), they have none, so the restored state is the host's; other slots keep
    their history, states are untouched."""
    from sglang.srt.mem_cache.unified_cache_components.mamba_component import MambaComponent
    from sglang.srt.mem_cache.unified_cache_components.tree_component import CacheTransferPhase

    pool = make_pool(mode, draft_tokens=1, size=6, history=8)
    gen = torch.Generator().manual_seed(11)
    if mode == "replay":  # previous owners of slots 1 and 2 (the allocator's first free ones) finished with records
        _fill_history(pool, [1, 2, 4, 5], 2, gen)
    temporal = pool.mamba_cache.temporal.clone()
    count = pool.replay_rings and pool.replay_rings.count.clone()
    component, ct = _mamba_component(pool)
    node = SimpleNamespace(component_data={ct: SimpleNamespace(value=None, host_value=torch.tensor([5]))})
    req = SimpleNamespace(mamba_pool_idx=None)
    transfers = pool_hooks.hicache_build_transfers(MambaComponent.build_hicache_transfers, component, node,
                                                   CacheTransferPhase.LOAD_BACK, req=req)
    assert int(req.mamba_pool_idx) == 1 and [t.device_indices for t in transfers][0] is None
    if mode == "replay":
        count[:, 1] = 0
        assert torch.equal(pool.replay_rings.count, count), "the request's new slot is emptied at once"
    transfers[0].device_indices = component.cache.req_to_token_pool.mamba_allocator.alloc(1)  # HiCache's controller
    assert int(transfers[0].device_indices) == 2
    assert pool_hooks.hicache_commit_transfer(MambaComponent.commit_hicache_transfer, component, node,
                                              CacheTransferPhase.LOAD_BACK, transfers) is None
    assert int(node.component_data[ct].value) == 2, "SGLang's own commit ran"
    assert torch.equal(pool.mamba_cache.temporal, temporal)
    if mode == "replay":
        count[:, 2] = 0
        assert torch.equal(pool.replay_rings.count, count) and (pool.replay_rings.count[:, [4, 5]] == 2).all()
        backup = [SimpleNamespace(device_indices=torch.tensor([4]), host_indices=torch.tensor([0]))]
        pool_hooks.hicache_commit_transfer(MambaComponent.commit_hicache_transfer, component, node,
                                           CacheTransferPhase.BACKUP_HOST, backup)
        assert (pool.replay_rings.count[:, 4] == 2).all(), "only a load empties a history"


@pytest.mark.parametrize("family,history,state_dtype,draft,topk,level,says", [
    ("gdn", 16, torch.float32, 1, 1, "INFO", "writes through below 32 requests per step"),
    ("gdn", 16, torch.float32, 1, 1, "INFO", "output-only from 32: 1.06x native at 32 running requests, 1.36-1.38x"),
    ("kda", 16, torch.float32, 1, 1, "INFO", "output-only from 40: 1.03 / 1.05 / 1.08x native at 40 / 48 / 56"),
    ("kda", 16, torch.float32, 4, 1, "INFO", "chain verify writes through below 32 requests per step"),
    ("kda", 16, torch.float32, 4, 1, "INFO", "1.48-1.92x native at every batch measured; "
                                             "bench/results/replay/writethrough_verify_20261205, commits 08d2506 "
                                             "and 7f7be68, H100); output-only from 32: 1.90-2.17x"),
    ("kda", 32, torch.float32, 1, 1, "INFO", "output-only from 64: 1.00-1.04x native from 64 to 256"),
    ("kda", 32, torch.float32, 1, 1, "INFO", "raw keys, as served since, 1.07 / 1.06 / 1.04x at 64 / 128 / 256"),
    ("kda", 32, torch.float32, 2, 1, "INFO", "a D = 2 window reading the history's raw keys, as served since, "
                                             "1.71 / 2.01 / 2.12x"),
    ("gdn", 64, torch.float32, 4, 1, "INFO", "plain decode writes through below 112 requests per step"),
    ("kda", 64, torch.float32, 1, 1, "INFO", "1.00-1.34x native at every batch measured (8 value columns a program)"),
    ("gdn", 32, torch.float32, 1, 1, "INFO", "below 40 requests per step"),
    ("gdn", 32, torch.float32, 1, 1, "INFO", "1.27-1.33x at 64-96, 1.30-1.39x at 112-256 (bench/results/replay/"
                                             "decode_tiling_20261206, commit 7d73792, H100)"),
    ("kda", 16, torch.float32, 1, 1, "INFO", "thresholds_20261206, foldproj_20261206 and pdl_20261206, H100"),
    ("gdn", 64, torch.float32, 1, 1, "INFO", "output-only from 112: 1.08-1.19x"),
    ("gdn", 32, torch.bfloat16, 1, 1, "WARNING", "output-only from 112: 0.93-0.98x native"),
    ("gdn", 64, torch.bfloat16, 4, 1, "INFO", "chain verify writes through below 128 requests"),
    ("gdn", 64, torch.float32, 4, 1, "INFO", "chain verify writes through below 96 requests"),
    ("gdn", 32, torch.float32, 4, 1, "INFO", "output-only from 40: 1.85-1.92x native at 40 requests, 2.06"),
    ("kda", 32, torch.bfloat16, 4, 1, "INFO", "chain verify writes through below 96 requests"),
    ("kda", 32, torch.bfloat16, 4, 1, "INFO", "output-only from 96: 1.11-1.28x native from 96 to 256 requests"),
    ("kda", 16, torch.float32, 4, 1, "INFO", "verify_tiles_20261207, commits 9a21fe3, 07da41b and abfa856"),
    ("kda", 64, torch.float32, 4, 1, "INFO", "chain verify writes through at every batch"),
    ("kda", 16, torch.float16, 4, 1, "INFO", "0.85-0.99x from 8"),
    ("kda", 16, torch.bfloat16, 4, 1, "INFO", "a step ahead, 1.12 / 1.05 / 1.06x at 1 / 16 / 256 requests"),
    ("kda", 32, torch.float32, 4, 1, "INFO", "below 64 requests per step"),
    ("gdn", 32, torch.bfloat16, 4, 1, "INFO", "output-only from 32: 1.14-1.58x"),
    ("kda", 16, torch.float16, 1, 1, "WARNING", "writes through below 128 requests per step"),
    ("kda", 16, torch.float16, 1, 1, "INFO", "a float16 state rounds where native's does"),
    ("gdn", 64, torch.bfloat16, 1, 1, "WARNING", "0.87-0.92x from 32 to 256 (SGLang's packed decode"),
    ("gdn", 16, torch.bfloat16, 4, 1, "INFO", "output-only from 32: 1.44-2.04x"),
    ("gdn", 16, torch.bfloat16, 1, 1, "INFO", "output-only from 80: 0.95 / 1.01 / 1.07 / 1.13x native"),
    ("gdn", 8, torch.float32, 1, 1, "INFO", "1.36-1.38x from 64 to 256 (measured at L = 16)"),
    ("gdn", 8, torch.float32, 4, 1, "INFO", "2.16-2.90x native from 32 to 256 requests (D = 4) (measured at L = 16)"),
    ("gdn", 16, torch.float32, 4, 1, "INFO", "keyhead_bounds_20261206, commit 4a280d3, H100"),
    ("gdn", 16, torch.float32, 4, 3, "INFO", "tree verify runs compact's kernels"),
    ("kda", 32, torch.bfloat16, 1, 1, "WARNING", "for speed pass --mamba-ssm-dtype float32, for memory "
                                           "--ssm-state-mode compact"),
    ("gdn", 16, torch.float32, 1, 1, "INFO", "writethrough_tile_20261205, commit bd811dc, H100"),
    ("gdn", 16, torch.float32, 4, 1, "INFO", "writethrough_verify_20261205, commits 08d2506 and 7f7be68, H100"),
])
def test_replay_says_at_startup_where_it_is_slower_than_native(family, history, state_dtype, draft, topk, level, says):
    """The issue's rule: where replay is not a win, the server log says so (from the measured tables in
    ``integration.replay_tradeoffs``), as a warning where plain decode was never faster than native;
    plain decode and a chain verify say where they write through."""
    cfg = SSMModeConfig(mode="replay", replay_history=history, draft_tokens=draft)  # --mamba-ssm-dtype unset:
    lines = replay_tradeoffs(cfg, family, state_dtype, tree_verify=topk > 1)  # the pool's dtype is what counts
    assert any(logging.getLevelName(lv) == level and says in text for lv, text in lines), lines
    # a warning exactly where plain decode was never faster than native: a 2-byte state (level below 32
    # requests, 0.86-0.92x from 32: native's packed decode moves half the bytes) except GDN at L <= 16, whose
    # output-only decode is 1.01-1.16x native from 88 requests; the rest is information
    never_faster = state_dtype != torch.float32 and not (family == "gdn" and history <= 16)
    assert [lv for lv, _ in lines] == [logging.WARNING if never_faster else logging.INFO] + \
        [logging.INFO] * (len(lines) - 1)
    assert len(lines) == 1 + (draft > 1) + (state_dtype != torch.float32)  # decode, verify (or tree), rounding
    assert replay_tradeoffs(SSMModeConfig(mode="compact"), family, torch.float32, tree_verify=False) == []
