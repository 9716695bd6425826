"""``ModeMambaPool`` on SGLang 0.5.14's real ``MambaPool`` (CPU): buffers per mode, memory, the
canonical state for radix-cache copies, CPU offload and PD, history clearing, slot reuse."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.configs.mamba_utils import (
    KimiLinearCacheParams, KimiLinearStateShape, Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape,
)
from sglang.srt.mem_cache import memory_pool as sglang_memory_pool
from sglang.srt.mem_cache.memory_pool import MambaPool

from kernel_cases import flat_inputs, to_device
from sglang_ssm_modes.config import SSMModeConfig
from sglang_ssm_modes.ops.replay import advance, replay_verify
from sglang_ssm_modes.pool import LinearHeads, ModeMambaPool
from sglang_ssm_modes.pool import mode_pool
from sglang_ssm_modes.pool.mode_pool import ConvScratchState
from sglang_ssm_modes.reference import ReplayRecords, fold
from sglang_ssm_modes.reference.random_layer import random_gate_params, random_inputs

HK, HV, KD, VD, LAYERS = 2, 4, 16, 32, 2
DTYPES = Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)


def gdn_params():
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=HV * VD, n_groups=HK, num_heads=HV,
                                    head_dim=VD, state_size=KD, conv_kernel=4)
    return Mamba2CacheParams(shape=shape, layers=list(range(LAYERS)), dtype=DTYPES)


def kda_params():
    shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=HV, head_dim=KD, conv_kernel_size=4)
    return KimiLinearCacheParams(shape=shape, layers=list(range(LAYERS)), dtype=DTYPES)


@pytest.fixture
def cuda_scratch_on_cpu(monkeypatch):
    """SGLang's MambaPool allocates its speculative scratch with device="cuda"; on the CPU only that
    allocation moves (the class's logic is untouched). Nothing moves where CUDA exists."""
    if torch.cuda.is_available():
        return
    real = torch.zeros

    def zeros(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)


def make_pool(mode, params=None, draft_tokens=4, size=6, history=8, device="cpu"):
    cfg = SSMModeConfig(mode=mode, draft_tokens=draft_tokens, replay_history=history)
    return ModeMambaPool(mode_config=cfg, size=size, spec_state_size=size, cache_params=params or gdn_params(),
                         mamba_layer_ids=list(range(LAYERS)), device=device, speculative_num_draft_tokens=draft_tokens)


def test_heads_come_from_sglangs_cache_params():
    assert LinearHeads.from_cache_params(gdn_params()) == LinearHeads("gdn", HV, HK, KD, VD)
    assert LinearHeads.from_cache_params(kda_params()) == LinearHeads("kda", HV, HV, KD, KD)


def test_buffers_and_memory_per_mode(cuda_scratch_on_cpu):
    native, compact, replay = (make_pool(m) for m in ("native", "compact", "replay"))
    assert isinstance(native.mamba_cache, MambaPool.SpeculativeState)
    for pool in (compact, replay):
        assert type(pool.mamba_cache) is ConvScratchState, "no intermediate_ssm; SGLang's conv-window scratch"
        assert pool.mamba_cache.temporal.shape == native.mamba_cache.temporal.shape
        for mine, sglangs in zip(pool.mamba_cache.intermediate_conv_window,
                                 native.mamba_cache.intermediate_conv_window):
            assert mine.shape == sglangs.shape and mine.stride() == sglangs.stride()
    assert compact.compact_records.k.shape == (LAYERS, 7, 4, HK, KD) and compact.replay_rings is None
    assert replay.replay_rings.u.shape == (LAYERS, 7, 16, HV, VD) and replay.compact_records is None
    assert compact.mem_usage < replay.mem_usage < native.mem_usage
    assert (native.decode_path, compact.decode_path, replay.decode_path) == ("native", "native", "replay")
    assert compact.mem_usage < 0.3 * native.mem_usage
    # PD buffer descriptions: the same tensors, shapes and item sizes as native's
    for pool in (compact, replay):
        _, lens, items = pool.get_contiguous_buf_infos()
        _, nlens, nitems = native.get_contiguous_buf_infos()
        assert (lens, items) == (nlens, nitems)


def test_compact_without_speculation_keeps_no_records():
    pool = make_pool("compact", draft_tokens=1)
    assert pool.compact_records is None and type(pool.mamba_cache) is MambaPool.State


def _fill_history(pool, slots, tokens, gen):
    """Run replay verify + accept of ``tokens`` tokens on every layer for ``slots``; return the inputs."""
    params = random_gate_params("gdn", HV, KD, gen)
    xs = []
    idx = torch.tensor(slots, dtype=torch.int32)
    for layer in range(LAYERS):
        x = random_inputs("gdn", len(slots), tokens, HK, HV, KD, VD, gen, torch.bfloat16)
        inp = to_device(flat_inputs(x, "gdn", len(slots), tokens), "cpu")
        ring = pool.layer_ring(layer)
        replay_verify(params.A_log, inp["a"], params.dt_bias, inp["q"], inp["k"], inp["v"], inp["b"],
                      pool.mamba_cache.temporal[layer], idx, ring, idx, is_kda=False)
        advance(ring, idx, torch.full((len(slots),), tokens, dtype=torch.int32))
        xs.append(x)
    return xs


def _expected_fold(pool, layer, slot):
    ring = pool.layer_ring(layer)
    c, base = int(ring.count[slot]), int(ring.phase[slot]) * ring.history
    w = slice(base, base + c)
    rec = ReplayRecords(u=ring.u[slot:slot + 1, w], k_norm=ring.k_norm[slot:slot + 1, w], g=ring.g[slot:slot + 1, w],
                        beta=ring.beta[slot:slot + 1, w], k_raw=ring.k_raw[slot:slot + 1, w],
                        v_raw=ring.v_raw[slot:slot + 1, w])
    return fold(pool.mamba_cache.temporal[layer, slot:slot + 1], rec)[0]


def test_replay_copy_from_materialises_into_the_destination():
    pool = make_pool("replay")
    gen = torch.Generator().manual_seed(51)
    pool.mamba_cache.temporal.normal_(generator=gen)
    _fill_history(pool, [1, 3], 3, gen)
    want = [_expected_fold(pool, layer, 3) for layer in range(LAYERS)]
    snapshot = {k: v.clone() for k, v in pool.replay_rings.buffers().items()}
    src_state = pool.mamba_cache.temporal[:, 3].clone()
    pool.copy_from(torch.tensor([3]), torch.tensor([5]))
    for layer in range(LAYERS):
        # the plain-torch fold and the kernel agree to float32 rounding
        assert torch.allclose(pool.mamba_cache.temporal[layer, 5], want[layer], rtol=1e-5, atol=1e-6)
    assert torch.equal(pool.mamba_cache.temporal[:, 3], src_state), "the source checkpoint is untouched"
    for name, t in pool.replay_rings.buffers().items():
        if name in ("count", "phase"):
            assert (t[:, 5] == 0).all()
            assert torch.equal(t[:, [0, 1, 2, 3, 4, 6]], snapshot[name][:, [0, 1, 2, 3, 4, 6]])
        else:
            assert torch.equal(t, snapshot[name])
    assert torch.equal(pool.mamba_cache.conv[0][:, 5], pool.mamba_cache.conv[0][:, 3])


def test_replay_cpu_copy_is_canonical_and_restore_clears_history(monkeypatch):
    pool = make_pool("replay")
    gen = torch.Generator().manual_seed(52)
    pool.mamba_cache.temporal.normal_(generator=gen)
    _fill_history(pool, [2, 4], 2, gen)
    want = torch.stack([_expected_fold(pool, layer, 2) for layer in range(LAYERS)])
    events = []  # SGLang synchronizes first: a PD decode server offloads a retracted request's slot while the
    # previous batch (which may append to its history) is still in flight; the fold must come after that
    monkeypatch.setattr(sglang_memory_pool.current_platform, "synchronize", lambda *a, **k: events.append("sync"))
    fold = mode_pool.fold_into_checkpoints
    monkeypatch.setattr(mode_pool, "fold_into_checkpoints", lambda *a, **k: (events.append("fold"), fold(*a, **k))[1])
    conv_cpu, temporal_cpu = pool.get_cpu_copy(torch.tensor([2]))
    assert events[:2] == ["sync", "fold"], events
    assert torch.allclose(temporal_cpu[:, 0], want, rtol=1e-5, atol=1e-6)
    assert (pool.replay_rings.count[:, 2] == 0).all(), "folded before the copy"
    assert (pool.replay_rings.count[:, 4] == 2).all(), "other requests keep their history"
    pool.load_cpu_copy((conv_cpu, temporal_cpu), torch.tensor([4]))
    assert torch.equal(pool.mamba_cache.temporal[:, 4], temporal_cpu[:, 0])
    assert (pool.replay_rings.count[:, 4] == 0).all()


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_clear_slots_and_reuse(mode, cuda_scratch_on_cpu):
    pool = make_pool(mode)
    pool.mamba_cache.temporal.fill_(1.0)
    for conv in pool.mamba_cache.conv:
        conv.fill_(1.0)
    if pool.replay_rings is not None:
        pool.replay_rings.count.fill_(3)
        pool.replay_rings.phase.fill_(1)
    pool.clear_slots(torch.tensor([0, 2]))
    assert (pool.mamba_cache.temporal[:, [0, 2]] == 0).all() and (pool.mamba_cache.temporal[:, [1, 3]] == 1).all()
    if pool.replay_rings is not None:
        assert (pool.replay_rings.count[:, [0, 2]] == 0).all() and (pool.replay_rings.count[:, [1, 3]] == 3).all()
        assert (pool.replay_rings.phase[:, [0, 2]] == 0).all()


def test_kda_pool_allocates_per_channel_gates():
    pool = make_pool("replay", params=kda_params())
    assert pool.heads.family == "kda" and pool.replay_rings.g.shape[-1] == KD
    compact = make_pool("compact", params=kda_params())
    assert compact.compact_records.g.shape == (LAYERS, 7, 4, HV, KD)


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
def test_hybrid_req_to_token_pool_builds_the_mode_pool(mode, cuda_scratch_on_cpu, monkeypatch):
    """SGLang's own HybridReqToTokenPool (allocator, mappings) with the plugin's hook on its
    ``_init_mamba_pool``: the state tensors are allocated once, alloc/free cycles return every slot,
    and a slot that finished requests left behind starts empty for the next ones — through SGLang's own
    path: its ``alloc`` marks new slots ``mamba_needs_clear``, the batch collects them and the backend's
    deferred clear (``_execute_deferred_mamba_cow_and_clear``) empties them before the extend."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from sglang_ssm_modes.pool.mode_pool import init_mode_mamba_pool

    cfg = SSMModeConfig(mode=mode, draft_tokens=4, replay_history=8)
    original = HybridReqToTokenPool._init_mamba_pool
    monkeypatch.setattr(HybridReqToTokenPool, "_init_mamba_pool",
                        lambda self, **kw: init_mode_mamba_pool(original, self, cfg, **kw))
    pool = HybridReqToTokenPool(
        size=4, mamba_size=6, mamba_spec_state_size=4, max_context_len=16, device="cpu",
        enable_memory_saver=False, cache_params=gdn_params(), mamba_layer_ids=list(range(LAYERS)),
        enable_mamba_extra_buffer=False, speculative_num_draft_tokens=4, speculative_eagle_topk=1,
        enable_overlap_schedule=False)
    mp = pool.mamba_pool
    assert isinstance(mp, ModeMambaPool) and mp.mode_config == cfg
    assert isinstance(mp.mamba_cache, MambaPool.SpeculativeState) == (mode == "native")
    assert hasattr(mp.mamba_cache, "intermediate_conv_window"), "every speculative pool keeps SGLang's conv scratch"
    if mode == "replay":
        assert mp.replay_rings.count.shape == (LAYERS, 7)
    def requests(n):
        return [SimpleNamespace(req_pool_idx=None, mamba_pool_idx=None, mamba_needs_clear=False,
                                mamba_cow_src_index=None) for _ in range(n)]

    free_before = pool.mamba_allocator.available_size()
    first = requests(3)
    pool.alloc(first)
    assert pool.mamba_allocator.available_size() == free_before - 3
    for r in first:
        pool.free_mamba_cache(r)
        pool.free(r)
    assert pool.mamba_allocator.available_size() == free_before
    mp.mamba_cache.temporal.fill_(1.0)  # every slot holds a previous owner's state (and, in replay, history)
    if mp.replay_rings is not None:
        mp.replay_rings.count.fill_(5)
    second = requests(3)
    pool.alloc(second)
    again = torch.stack([r.mamba_pool_idx for r in second]).long()
    assert all(r.mamba_needs_clear for r in second)
    batch = SimpleNamespace()
    ScheduleBatch._collect_deferred_mamba_cow_and_clear(batch, second)
    backend = SimpleNamespace(req_to_token_pool=pool, is_draft_worker=False)
    forward_batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, mamba_clear_indices=batch.mamba_clear_indices,
                                    mamba_cow_src_indices=None, mamba_cow_dst_indices=None)
    MambaAttnBackendBase._execute_deferred_mamba_cow_and_clear(backend, forward_batch)  # GDN / KDA backends
    others = [slot for slot in range(mp.mamba_cache.temporal.shape[1]) if slot not in again.tolist()]
    assert (mp.mamba_cache.temporal[:, again] == 0).all() and (mp.mamba_cache.temporal[:, others] == 1).all()
    if mp.replay_rings is not None:
        assert (mp.replay_rings.count[:, again] == 0).all() and (mp.replay_rings.count[:, others] == 5).all()


def test_adopt_refuses_a_pool_with_speculative_scratch(cuda_scratch_on_cpu):
    plain = MambaPool(size=4, spec_state_size=4, cache_params=gdn_params(), mamba_layer_ids=list(range(LAYERS)),
                      device="cpu", speculative_num_draft_tokens=4)
    with pytest.raises(ValueError, match="without speculative_num_draft_tokens"):
        ModeMambaPool.adopt(plain, SSMModeConfig(mode="compact", draft_tokens=4), gdn_params(), 4)
