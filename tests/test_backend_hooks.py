"""The plugin's backend hooks on SGLang 0.5.14's real ``GDNAttnBackend`` / ``KDAAttnBackend`` /
``HybridLinearAttnBackend`` and ``HybridReqToTokenPool`` (built through the pool hook): target verify in
compact and replay against SGLang's own native forward, and (GPU: SGLang's conv scatter is CUDA-only)
rounds of verify + commit compared over the whole pool, padding rows and other slots included."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata
from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_ssm_modes.config import SSMModeConfig
from sglang_ssm_modes.integration import backend_hooks
from sglang_ssm_modes.pool.mode_pool import init_mode_mamba_pool
from test_mode_pool import cuda_scratch_on_cpu, gdn_params  # noqa: F401  (fixture)

HK, HV, KD, VD, LAYERS = 2, 4, 16, 32, 2  # as test_mode_pool's gdn_params
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_pool(mode: str, draft: int, monkeypatch, history: int = 8) -> HybridReqToTokenPool:
    cfg = SSMModeConfig(mode=mode, draft_tokens=draft, replay_history=history)
    original = HybridReqToTokenPool._init_mamba_pool
    monkeypatch.setattr(HybridReqToTokenPool, "_init_mamba_pool",
                        lambda self, **kw: init_mode_mamba_pool(original, self, cfg, **kw))
    return HybridReqToTokenPool(
        size=6, mamba_size=8, mamba_spec_state_size=6, max_context_len=16, device=DEV, enable_memory_saver=False,
        cache_params=gdn_params(), mamba_layer_ids=list(range(LAYERS)), enable_mamba_extra_buffer=False,
        speculative_num_draft_tokens=draft, speculative_eagle_topk=1, enable_overlap_schedule=False)


def make_backend(pool) -> GDNAttnBackend:
    runner = SimpleNamespace(device=DEV, server_args=SimpleNamespace(speculative_eagle_topk=1), is_draft_worker=False,
                             req_to_token_pool=pool, token_to_kv_pool=None)
    return GDNAttnBackend(runner)


def make_layer(layer_id: int, gen: torch.Generator) -> RadixLinearAttention:
    conv_dim = 2 * HK * KD + HV * VD
    f32 = dict(dtype=torch.float32, generator=gen)
    return RadixLinearAttention(
        layer_id, HK, HK, HV, KD, KD, VD,
        conv_weights=(torch.randn(conv_dim, 4, **f32) * 0.5).to(DEV),
        bias=None, activation="silu",
        A_log=torch.log(torch.rand(HV, **f32) * 15 + 1).to(DEV), dt_bias=torch.randn(HV, **f32).to(DEV))


def verify_inputs(n: int, draft: int, gen: torch.Generator):
    conv_dim = 2 * HK * KD + HV * VD
    t = n * draft
    mixed = torch.randn(t, conv_dim, generator=gen).to(torch.bfloat16).to(DEV)
    a = torch.randn(t, HV, generator=gen).to(torch.bfloat16).to(DEV)
    b = torch.randn(t, HV, generator=gen).to(torch.bfloat16).to(DEV)
    return mixed, a, b


def verify(backend, layer, slots: torch.Tensor, draft: int, inputs):
    n = slots.shape[0]
    backend.forward_metadata = ForwardMetadata(
        query_start_loc=torch.arange(0, n * draft + 1, draft, dtype=torch.int32, device=DEV),
        mamba_cache_indices=slots, is_target_verify=True, draft_token_num=draft)
    batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=SimpleNamespace(draft_token_num=draft),
                            batch_size=n, mamba_track_mask=None)
    mixed, a, b = inputs
    return backend_hooks.forward_extend(GDNAttnBackend.forward_extend, backend, layer=layer, forward_batch=batch,
                                        mixed_qkv=mixed.clone(), a=a, b=b)


def seed_pools(pools, gen):
    """The same random committed state and conv window in every pool (all slots)."""
    temporal = torch.randn(pools[0].mamba_pool.mamba_cache.temporal.shape, generator=gen).to(DEV) * 0.1
    conv = torch.randn(pools[0].mamba_pool.mamba_cache.conv[0].shape, generator=gen).to(torch.bfloat16).to(DEV)
    for p in pools:
        p.mamba_pool.mamba_cache.temporal.copy_(temporal)
        p.mamba_pool.mamba_cache.conv[0].copy_(conv)


@pytest.mark.parametrize("draft", [2, 4])
def test_verify_hooks_match_sglangs_native_forward(draft, monkeypatch, cuda_scratch_on_cpu):  # noqa: F811
    """One verify round of a layer: compact's outputs are SGLang's native outputs bit for bit (same op
    order) and its conv-window scratch is the same; replay's outputs agree to float32 rounding; no mode
    writes the state pool during verify."""
    gen = torch.Generator().manual_seed(draft)
    pools = {m: make_pool(m, draft, monkeypatch) for m in ("native", "compact", "replay")}
    seed_pools(list(pools.values()), gen)
    before = pools["native"].mamba_pool.mamba_cache.temporal.clone()
    layer = make_layer(1, gen)
    slots = torch.tensor([3, -1, 0, 5, 2], dtype=torch.int32, device=DEV)  # odd batch, one padding row
    inputs = verify_inputs(slots.shape[0], draft, gen)
    out = {m: verify(make_backend(p), layer, slots, draft, inputs) for m, p in pools.items()}
    real = (slots >= 0).repeat_interleave(draft)
    assert torch.equal(out["compact"][0, real], out["native"][0, real])
    torch.testing.assert_close(out["replay"][0, real].float(), out["native"][0, real].float(), rtol=2e-2, atol=2e-2)
    for m, p in pools.items():
        assert torch.equal(p.mamba_pool.mamba_cache.temporal, before), f"{m} verify wrote the state"
    rows = torch.arange(slots.shape[0])[slots.cpu() >= 0]
    native_win = pools["native"].mamba_pool.mamba_cache.intermediate_conv_window[0][1, rows]
    assert torch.equal(pools["compact"].mamba_pool.mamba_cache.intermediate_conv_window[0][1, rows], native_win)


def commit(hybrid: HybridLinearAttnBackend, last_index: torch.Tensor):
    backend_hooks.update_mamba_state_after_mtp_verify(HybridLinearAttnBackend.update_mamba_state_after_mtp_verify,
                                                      hybrid, last_index, None, None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_rounds_of_verify_and_commit_agree_with_native(state_dtype, monkeypatch):
    """Rounds of verify (every layer) + commit through the hooks, accepted lengths 0..D and padding
    rows: compact's whole pool (state and conv window) is native's bit for bit; replay's canonical
    state stays within float tolerance after folds."""
    draft, rounds = 4, 12
    gen = torch.Generator().manual_seed(7)
    pools = {m: make_pool(m, draft, monkeypatch) for m in ("native", "compact", "replay")}
    for p in pools.values():
        p.mamba_pool.mamba_cache.temporal.data = p.mamba_pool.mamba_cache.temporal.to(state_dtype)
    seed_pools(list(pools.values()), gen)
    layers = [make_layer(i, gen) for i in range(LAYERS)]
    backends = {m: make_backend(p) for m, p in pools.items()}
    hybrids = {m: HybridLinearAttnBackend(SimpleNamespace(token_to_kv_pool=None, req_to_token_pool=p,
                                                          needs_cpu_seq_lens=False), backends[m], [])
               for m, p in pools.items()}
    slots = torch.tensor([3, 0, -1, 5, 2], dtype=torch.int32, device=DEV)
    for r in range(rounds):
        inputs = [verify_inputs(slots.shape[0], draft, gen) for _ in layers]
        outs = {m: [verify(backends[m], layer, slots, draft, x) for layer, x in zip(layers, inputs)] for m in pools}
        accepted = torch.randint(0, draft + 1, (slots.shape[0],), generator=gen).to(DEV)
        for m in pools:
            commit(hybrids[m], (accepted - 1).to(torch.int64))
        real = (slots >= 0).repeat_interleave(draft)  # SGLang's kernel leaves padding rows' outputs unwritten
        for a, b in zip(outs["compact"], outs["native"]):
            assert torch.equal(a[0, real], b[0, real]), f"round {r}: compact outputs differ from native"
        native, compact = pools["native"].mamba_pool, pools["compact"].mamba_pool
        assert torch.equal(compact.mamba_cache.temporal, native.mamba_cache.temporal), f"round {r}: state"
        assert torch.equal(compact.mamba_cache.conv[0], native.mamba_cache.conv[0]), f"round {r}: conv"
    assert torch.equal(compact.mamba_cache.temporal, native.mamba_cache.temporal)
    assert torch.equal(compact.mamba_cache.conv[0], native.mamba_cache.conv[0])
    replay = pools["replay"].mamba_pool
    assert int(replay.replay_rings.phase.sum()) > 0, "replay folded"
    replay.materialise_in_place(torch.arange(replay.size + 1, dtype=torch.int32, device=DEV))
    torch.testing.assert_close(replay.mamba_cache.temporal.float(), native.mamba_cache.temporal.float(),
                               rtol=1e-5 if state_dtype == torch.float32 else 2e-2, atol=1e-5)
    assert torch.equal(replay.mamba_cache.conv[0], native.mamba_cache.conv[0])
