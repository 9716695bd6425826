"""The plugin's backend hooks on SGLang 0.5.14's real ``GDNAttnBackend`` / ``KDAAttnBackend`` /
``HybridLinearAttnBackend`` and ``HybridReqToTokenPool`` (built through the pool hook): target verify in
compact and replay against SGLang's own native forward, and (GPU: SGLang's conv scatter is CUDA-only)
rounds of verify + commit compared over the whole pool, padding rows and other slots included."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend
from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata
from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_ssm_modes.config import SSMModeConfig
from sglang_ssm_modes.integration import backend_hooks
from sglang_ssm_modes.ops.compact import FAST_VERIFY_TILE
from sglang_ssm_modes.ops.replay import replay_fold
from sglang_ssm_modes.ops.replay.served import serves_write_through, serves_write_through_verify
from sglang_ssm_modes.pool.mode_pool import init_mode_mamba_pool
from sglang_ssm_modes.reference.random_layer import random_gate_params
from interpreter_shims import sglang_fla_on_cpu
from kernel_cases import assert_same_outputs_but_tiling
from test_mode_pool import cuda_scratch_on_cpu, gdn_params, kda_params  # noqa: F401  (fixture)

HK, HV, KD, VD, LAYERS = 2, 4, 16, 32, 2  # as test_mode_pool's gdn_params / kda_params (KDA: K = V = KD)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
PARAMS = {"gdn": gdn_params, "kda": kda_params}


def tree_links(draft: int) -> tuple[list[int], list[int]]:
    """``(first child, next sibling)`` of a D-node tree: root -> {1, 2}, each odd node i -> {i + 2, i + 3}
    (D = 4: root -> {1, 2}, 1 -> 3)."""
    first = [1] + [i + 2 if i % 2 and i + 2 < draft else -1 for i in range(1, draft)]
    sibling = [-1] + [i + 1 if i % 2 and i + 1 < draft else -1 for i in range(1, draft)]
    return first, sibling


def heads(family):
    """``(HK, HV, K, V)`` per family."""
    return (HK, HV, KD, VD) if family == "gdn" else (HV, HV, KD, KD)


def make_pool(mode: str, draft: int, monkeypatch, family: str = "gdn", topk: int = 1,
              history: int = 8, compact_verify: str = "exact") -> HybridReqToTokenPool:
    cfg = SSMModeConfig(mode=mode, draft_tokens=draft, replay_history=history, compact_verify=compact_verify,
                        tree_verify=draft > 1 and topk > 1)
    original = HybridReqToTokenPool._init_mamba_pool
    monkeypatch.setattr(HybridReqToTokenPool, "_init_mamba_pool",
                        lambda self, **kw: init_mode_mamba_pool(original, self, cfg, **kw))
    return HybridReqToTokenPool(
        size=6, mamba_size=8, mamba_spec_state_size=6, max_context_len=16, device=DEV, enable_memory_saver=False,
        cache_params=PARAMS[family](), mamba_layer_ids=list(range(LAYERS)), enable_mamba_extra_buffer=False,
        speculative_num_draft_tokens=draft, speculative_eagle_topk=topk, enable_overlap_schedule=False)


def make_backend(pool, family: str = "gdn", topk: int = 1):
    runner = SimpleNamespace(device=DEV, server_args=SimpleNamespace(speculative_eagle_topk=topk),
                             is_draft_worker=False, req_to_token_pool=pool, token_to_kv_pool=None)
    return (GDNAttnBackend if family == "gdn" else KDAAttnBackend)(runner)


def make_layer(layer_id: int, gen: torch.Generator, family: str = "gdn") -> RadixLinearAttention:
    hk, hv, kd, vd = heads(family)
    conv_dim = 2 * hk * kd + hv * vd
    f32 = dict(dtype=torch.float32, generator=gen)
    params = random_gate_params(family, hv, kd, gen)
    return RadixLinearAttention(
        layer_id, hk, hk, hv, kd, kd, vd, conv_weights=(torch.randn(conv_dim, 4, **f32) * 0.5).to(DEV),
        bias=None, activation="silu", A_log=params.A_log.to(DEV), dt_bias=params.dt_bias.to(DEV))


def verify_inputs(n: int, draft: int, gen: torch.Generator, family: str = "gdn"):
    """``(mixed_qkv, a, b)`` as the models hand them to the backend in a target verify: GDN raw gate
    and beta logits ``[T, HV]``; Kimi-Linear ``[1, T, HV, K]`` raw gate and sigmoid(beta) ``[1, T, HV]``."""
    hk, hv, kd, vd = heads(family)
    t = n * draft
    mixed = torch.randn(t, 2 * hk * kd + hv * vd, generator=gen).to(torch.bfloat16).to(DEV)
    if family == "gdn":
        a = torch.randn(t, hv, generator=gen).to(torch.bfloat16).to(DEV)
        b = torch.randn(t, hv, generator=gen).to(torch.bfloat16).to(DEV)
    else:
        a = torch.randn(1, t, hv, kd, generator=gen).to(torch.bfloat16).to(DEV)
        b = torch.randn(1, t, hv, generator=gen).float().sigmoid().to(DEV)
    return mixed, a, b


def verify(backend, layer, slots: torch.Tensor, draft: int, inputs, tree: bool = False):
    n = slots.shape[0]
    extra = {}
    if tree:
        nxt, sib = (torch.tensor(x, dtype=torch.int32, device=DEV).repeat(n, 1) for x in tree_links(draft))
        # zeros, as the CUDA-graph runner's buffers (the only batches with padding rows): SGLang's conv kernel
        # skips a padding row, and its own verify kernel would follow whatever that row's parents hold
        extra = dict(retrieve_next_token=nxt, retrieve_next_sibling=sib, retrieve_parent_token=torch.zeros_like(nxt))
    backend.forward_metadata = ForwardMetadata(
        query_start_loc=torch.arange(0, n * draft + 1, draft, dtype=torch.int32, device=DEV),
        mamba_cache_indices=slots, is_target_verify=True, draft_token_num=draft, **extra)
    batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=SimpleNamespace(draft_token_num=draft),
                            batch_size=n, mamba_track_mask=None, extend_prefix_lens=None, extend_seq_lens_cpu=None)
    mixed, a, b = inputs
    original = type(backend).forward_extend
    return backend_hooks.forward_extend(original, backend, layer=layer, forward_batch=batch, mixed_qkv=mixed.clone(),
                                        a=a, b=b)


def seed_pools(pools, gen):
    """The same random committed state and conv window in every pool (all slots)."""
    temporal = torch.randn(pools[0].mamba_pool.mamba_cache.temporal.shape, generator=gen).to(DEV) * 0.1
    conv = torch.randn(pools[0].mamba_pool.mamba_cache.conv[0].shape, generator=gen).to(torch.bfloat16).to(DEV)
    for p in pools:
        p.mamba_pool.mamba_cache.temporal.copy_(temporal.to(p.mamba_pool.mamba_cache.temporal.dtype))
        p.mamba_pool.mamba_cache.conv[0].copy_(conv)


CASES = [("gdn", 2, False), ("gdn", 4, False), ("gdn", 4, True), ("kda", 3, False), ("kda", 4, True),
         ("gdn", 12, True)]  # a tree wider than replay's history (L = 8): compact's records, any L


@pytest.mark.parametrize("replay_path", ["output-only", "write-through"])
@pytest.mark.parametrize("family,draft,tree", CASES)
def test_verify_hooks_match_native(family, draft, tree, replay_path, monkeypatch, cuda_scratch_on_cpu):  # noqa: F811
    """One verify round of a layer through the real backend class: compact's outputs are native's bit
    for bit (GDN: SGLang's own forward; KDA: our native verify, SGLang 0.5.14 has none) and its conv
    window scratch is the same; replay's chain verify, served either way, agrees to float32 rounding
    (write-through: bit for bit on the GPU; on the CPU interpreter its ``[BV, K]`` tile sums in another
    order), a tree goes through compact's path, so bit for bit; no mode writes the state pool during verify
    (a fresh history: nothing for a write-through to fold)."""
    gen = torch.Generator().manual_seed(draft + 10 * tree)
    topk = 2 if tree else 1
    chosen = []
    monkeypatch.setattr(backend_hooks, "serves_write_through_verify",
                        lambda *args: chosen.append(args) or replay_path == "write-through")
    pools = {m: make_pool(m, draft, monkeypatch, family, topk) for m in ("native", "compact", "replay")}
    seed_pools(list(pools.values()), gen)
    before = pools["native"].mamba_pool.mamba_cache.temporal.clone()
    layer = make_layer(1, gen, family)
    slots = torch.tensor([3, -1, 0, 5, 2], dtype=torch.int32, device=DEV)  # odd batch, one padding row
    inputs = verify_inputs(slots.shape[0], draft, gen, family)
    out = {m: verify(make_backend(p, family, topk), layer, slots, draft, inputs, tree) for m, p in pools.items()}
    real = (slots >= 0).repeat_interleave(draft)
    assert torch.equal(out["compact"][0, real], out["native"][0, real])
    if tree or (replay_path == "write-through" and DEV == "cuda"):
        assert torch.equal(out["replay"][0, real], out["native"][0, real])
    else:
        torch.testing.assert_close(out["replay"][0, real].float(), out["native"][0, real].float(), rtol=2e-2,
                                   atol=2e-2)
    history = pools["replay"].mamba_pool.mode_config.replay_history
    assert chosen == ([] if tree else [(slots.shape[0], family == "kda", history, torch.float32)]), "the choice, once"
    for m, p in pools.items():
        assert torch.equal(p.mamba_pool.mamba_cache.temporal, before), f"{m} verify wrote the state"
    rows = torch.arange(slots.shape[0])[slots.cpu() >= 0]
    native_win = pools["native"].mamba_pool.mamba_cache.intermediate_conv_window[0][1, rows]
    for m in ("compact", "replay"):
        assert torch.equal(pools[m].mamba_pool.mamba_cache.intermediate_conv_window[0][1, rows], native_win)


@pytest.mark.parametrize("family,draft,tree", [("gdn", 4, False), ("gdn", 4, True), ("kda", 3, False)])
def test_fast_compact_verify_records_what_exact_records(family, draft, tree, monkeypatch,
                                                        cuda_scratch_on_cpu):  # noqa: F811
    """``--ssm-compact-verify fast`` through the real backend class: the verify runs at
    ``FAST_VERIFY_TILE`` (exact: native's tiling), its outputs agree with exact's to float32 rounding (bit for
    bit under the CPU interpreter, within a bfloat16 ulp on the GPU:
    :func:`kernel_cases.assert_same_outputs_but_tiling`), and its records — all a commit reads — are exact's bit
    for bit, so the committed state is too."""
    gen = torch.Generator().manual_seed(30 + draft + tree)
    topk = 2 if tree else 1
    pools = {v: make_pool("compact", draft, monkeypatch, family, topk, compact_verify=v) for v in ("exact", "fast")}
    seed_pools(list(pools.values()), gen)
    layer = make_layer(1, gen, family)
    slots = torch.tensor([3, -1, 0, 5, 2], dtype=torch.int32, device=DEV)
    inputs = verify_inputs(slots.shape[0], draft, gen, family)
    tiles = []
    real_verify = backend_hooks.compact_verify
    monkeypatch.setattr(backend_hooks, "compact_verify", lambda *a, tile, **kw: tiles.append(tile) or real_verify(
        *a, tile=tile, **kw))
    out = {v: verify(make_backend(p, family, topk), layer, slots, draft, inputs, tree) for v, p in pools.items()}
    assert tiles == [None, FAST_VERIFY_TILE]
    real = (slots >= 0).repeat_interleave(draft)
    assert_same_outputs_but_tiling(out["fast"][0, real], out["exact"][0, real])
    exact, fast = (vars(p.mamba_pool.layer_records(1)) for p in pools.values())
    assert exact.keys() == fast.keys()
    for name, t in exact.items():
        assert torch.equal(t, fast[name]), name


def commit(hybrid: HybridLinearAttnBackend, last_index: torch.Tensor):
    backend_hooks.update_mamba_state_after_mtp_verify(HybridLinearAttnBackend.update_mamba_state_after_mtp_verify,
                                                      hybrid, last_index, None, None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("replay_path", ["served", "output-only"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,tree,draft", [("gdn", False, 4), ("gdn", True, 4), ("kda", False, 4),
                                               ("kda", True, 4), ("gdn", True, 12)])  # 12: a tree wider than L = 8
def test_rounds_of_verify_and_commit_agree_with_native(family, tree, draft, state_dtype, replay_path, monkeypatch):
    """Rounds of verify (every layer) + commit through the hooks, last accepted node -1..D-1 (a chain's
    accepted length 0..D, or any node of a tree) and a padding row: compact's whole pool (state and conv
    window) is native's bit for bit after every round; replay's canonical state stays within float
    tolerance after folds — bit for bit, and its outputs too, where its chain verify is served written through
    (:func:`~sglang_ssm_modes.ops.replay.served.serves_write_through_verify` at 5 requests), and through
    compact's path for a tree; ``output-only`` forces replay's output-only chain verify instead."""
    rounds, topk = 12, 2 if tree else 1
    gen = torch.Generator().manual_seed(7)
    pools = {m: make_pool(m, draft, monkeypatch, family, topk) for m in ("native", "compact", "replay")}
    for p in pools.values():
        cache = p.mamba_pool.mamba_cache
        cache.temporal.data = cache.temporal.to(state_dtype)
        if hasattr(cache, "intermediate_ssm"):
            cache.intermediate_ssm.data = cache.intermediate_ssm.to(state_dtype)
    seed_pools(list(pools.values()), gen)
    layers = [make_layer(i, gen, family) for i in range(LAYERS)]
    backends = {m: make_backend(p, family, topk) for m, p in pools.items()}
    hybrids = {m: HybridLinearAttnBackend(SimpleNamespace(token_to_kv_pool=None, req_to_token_pool=p,
                                                          needs_cpu_seq_lens=False), backends[m], [])
               for m, p in pools.items()}
    slots = torch.tensor([3, 1, -1, 5, 2], dtype=torch.int32, device=DEV)
    real = (slots >= 0).repeat_interleave(draft)  # SGLang's kernel leaves padding rows' outputs unwritten
    native, compact, replay = (pools[m].mamba_pool for m in ("native", "compact", "replay"))
    if replay_path == "output-only":
        monkeypatch.setattr(backend_hooks, "serves_write_through_verify", lambda *args: False)
    exact = tree or (replay_path == "served" and serves_write_through_verify(
        slots.shape[0], family == "kda", replay.mode_config.replay_history, state_dtype))
    for r in range(rounds):
        inputs = [verify_inputs(slots.shape[0], draft, gen, family) for _ in layers]
        outs = {m: [verify(backends[m], layer, slots, draft, x, tree) for layer, x in zip(layers, inputs)]
                for m in pools}
        last = torch.randint(-1, draft, (slots.shape[0],), generator=gen).to(DEV)
        for m in pools:
            commit(hybrids[m], last)
        for a, b in zip(outs["compact"], outs["native"]):
            assert torch.equal(a[0, real], b[0, real]), f"round {r}: compact outputs differ from native"
        for a, b in zip(outs["replay"], outs["native"]):
            assert torch.equal(a[0, real], b[0, real]) or not exact, f"round {r}: replay outputs differ from native"
        assert torch.equal(compact.mamba_cache.temporal, native.mamba_cache.temporal), f"round {r}: state"
        assert torch.equal(compact.mamba_cache.conv[0], native.mamba_cache.conv[0]), f"round {r}: conv"
    replay.materialise_in_place(torch.arange(replay.size + 1, dtype=torch.int32, device=DEV))
    assert int(replay.replay_rings.phase.sum()) > 0 or tree, "replay folded"
    if exact:
        assert torch.equal(replay.mamba_cache.temporal, native.mamba_cache.temporal)
    else:
        # bfloat16: native rounds the state every token, replay once per fold: they differ by a few
        # bf16 roundings at the state's scale (on the H200: at most 0.0049 with states up to ~1)
        scale = native.mamba_cache.temporal.float().abs().max().item()
        torch.testing.assert_close(replay.mamba_cache.temporal.float(), native.mamba_cache.temporal.float(),
                                   rtol=1e-5 if state_dtype == torch.float32 else 2e-2,
                                   atol=1e-5 if state_dtype == torch.float32 else 2e-2 * scale)
    assert torch.equal(replay.mamba_cache.conv[0], native.mamba_cache.conv[0])


def decode(backend, layer, slots: torch.Tensor, inputs, family: str, track: torch.Tensor | None = None):
    """One plain-decode token per request through the backend's (hooked) ``forward_decode``; ``track``
    ``[N]``: extra_buffer track slots (< 0: not tracked this step)."""
    n = slots.shape[0]
    backend.forward_metadata = ForwardMetadata(query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEV),
                                               mamba_cache_indices=slots)
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=n, mamba_track_mask=None)
    if track is not None:
        batch.mamba_track_mask, batch.mamba_track_indices = track >= 0, track.clamp_min(0).to(torch.int64)
    mixed, a, b = inputs
    if family == "kda":  # Kimi-Linear's decode hands the raw gate [T, HV*K] and beta logits
        a, b = a.reshape(n, -1), torch.logit(b).to(torch.bfloat16)
    return backend_hooks.forward_decode(type(backend).forward_decode, backend, layer=layer, forward_batch=batch,
                                        mixed_qkv=mixed.clone(), a=a, b=b)


def prefill(backend, layer, slots: torch.Tensor, tokens: int, inputs):
    """A prefill chunk of ``tokens`` per request, continuing each slot's state (GDN)."""
    n = slots.shape[0]
    starts = torch.arange(0, n * tokens + 1, tokens, dtype=torch.int32, device=DEV)
    backend.forward_metadata = ForwardMetadata(query_start_loc=starts, mamba_cache_indices=slots)
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=n, mamba_track_mask=None,
                            extend_prefix_lens=torch.full((n,), 7, device=DEV),
                            extend_seq_lens_cpu=[tokens] * n)
    mixed, a, b = inputs
    return backend_hooks.forward_extend(GDNAttnBackend.forward_extend, backend, layer=layer, forward_batch=batch,
                                        mixed_qkv=mixed.clone(), a=a, b=b)


def native_and_replay_decoders(monkeypatch, family: str, seed: int):
    """``(pools, layers, backends, slots, gen)``: native and replay pools (no speculation, L = 8) seeded
    with the same state, their linear layers (a step decodes through each in turn), their backends, and
    three request slots."""
    gen = torch.Generator().manual_seed(seed)
    pools = {m: make_pool(m, 1, monkeypatch, family, history=8) for m in ("native", "replay")}
    seed_pools(list(pools.values()), gen)
    layers = [make_layer(i, gen, family) for i in range(LAYERS)]
    backends = {m: make_backend(p, family) for m, p in pools.items()}
    return pools, layers, backends, torch.tensor([2, 5, 1], dtype=torch.int32, device=DEV), gen


def choose_decode_path(monkeypatch, path: str) -> None:
    """Serve replay's plain decode ``"output-only"`` or ``"write-through"`` at every batch."""
    monkeypatch.setattr(backend_hooks, "serves_write_through", lambda *args: path == "write-through")


@pytest.mark.parametrize("path", ["output-only", "write-through"])
@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_replay_decode_and_prefill_through_the_backend(family, path, monkeypatch, cuda_scratch_on_cpu):  # noqa: F811
    with sglang_fla_on_cpu():
        _replay_decode_and_prefill(family, path, monkeypatch)


def _replay_decode_and_prefill(family, path, monkeypatch):
    """Plain decode in replay (output-only: one record per token, folds every L tokens; write-through: the
    checkpoint written each token) against SGLang's own decode, each step through every linear layer in
    turn, then (GDN) a prefill chunk on top of the history: replay folds first and continues with SGLang's
    chunked kernel. Output-only, a layer's cursor stays where the step found it until the last layer's
    decode settles every layer's at once. Outputs agree to float32 rounding, the materialised states within
    1e-5, and a prefill leaves no history behind."""
    pools, layers, backends, slots, gen = native_and_replay_decoders(monkeypatch, family, seed=3)
    state_dtype = pools["replay"].mamba_pool.mamba_cache.temporal.dtype
    assert serves_write_through(3, family == "kda", 8, state_dtype), "as served"
    choose_decode_path(monkeypatch, path)
    native, replay = pools["native"].mamba_pool, pools["replay"].mamba_pool
    cursors = replay.replay_rings.count
    for step in range(11):  # output-only folds at the 9th token (L = 8)
        before = cursors.clone()
        for layer in layers:
            x = verify_inputs(slots.shape[0], 1, gen, family)
            out = {m: decode(backends[m], layer, slots, x, family) for m in pools}
            torch.testing.assert_close(out["replay"].float(), out["native"].float(), rtol=2e-2, atol=2e-2)
            if layer is not layers[-1] and path == "output-only":
                assert torch.equal(cursors, before), "settled once a step, after the last layer"
    counts, phase = ([3, 3, 3], 1) if path == "output-only" else ([0, 0, 0], 0)
    for i in range(LAYERS):
        ring = replay.layer_ring(i)
        assert ring.count[slots.long()].tolist() == counts and (ring.phase[slots.long()] == phase).all(), i
        materialised = torch.zeros_like(replay.mamba_cache.temporal[i])
        replay_fold(replay.mamba_cache.temporal[i], slots, ring, slots, slots >= 0, is_kda=family == "kda",
                    dst=materialised, dst_indices=slots)
        # the fold re-runs the decode step with SGLang's gate and beta (GDN: beta rounded as its packed kernel
        # does; without that rounding this is ~2e-3 off); the packed kernel's own op order differs slightly
        got, want = materialised[slots.long()], native.mamba_cache.temporal[i, slots.long()]
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-6, i
    if family == "gdn":
        for layer in layers:
            x = verify_inputs(slots.shape[0], 5, gen, family)
            out = {m: prefill(backends[m], layer, slots, 5, x) for m in pools}
            torch.testing.assert_close(out["replay"].float(), out["native"].float(), rtol=2e-2, atol=2e-2)
        assert (cursors[:, slots.long()] == 0).all(), "a prefill leaves no history behind"
    canonical = replay.mamba_cache.temporal.clone()
    replay.materialise_in_place(slots)
    assert torch.equal(replay.mamba_cache.temporal, canonical) or family == "kda"
    for i in range(LAYERS):
        for s in slots.long().tolist():
            err = (replay.mamba_cache.temporal[i, s] - native.mamba_cache.temporal[i, s]).abs().max()
            assert err <= 1e-5 * native.mamba_cache.temporal[i, s].abs().max(), (i, s, float(err))
    untouched = [s for s in range(replay.size + 1) if s not in slots.tolist()]
    assert torch.equal(replay.mamba_cache.temporal[:, untouched], native.mamba_cache.temporal[:, untouched])


@pytest.mark.parametrize("path", ["output-only", "write-through"])
def test_replay_decode_tracking_for_the_radix_cache(path, monkeypatch, cuda_scratch_on_cpu):  # noqa: F811
    """extra_buffer tracking during decode (GDN: SGLang refuses extra_buffer for Kimi-Linear): SGLang's
    own copy of the conv window and state into the track slots (native), and for replay the same copy
    with the materialised state written over the raw checkpoint — the track slot holds the canonical
    state within 1e-6 and no history."""
    family = "gdn"
    choose_decode_path(monkeypatch, path)
    with sglang_fla_on_cpu():
        pools, layers, backends, slots, gen = native_and_replay_decoders(monkeypatch, family, seed=9)
        untracked = torch.full((3,), -1, dtype=torch.int32, device=DEV)
        tracked = torch.tensor([6, -1, 7], dtype=torch.int32, device=DEV)  # two requests tracked, one not
        cursors = pools["replay"].mamba_pool.replay_rings.count
        cursors[:, 6] = 3  # a track slot reused from a request that left a history behind
        for step in range(5):
            for layer in layers:
                x = verify_inputs(slots.shape[0], 1, gen, family)
                for m in pools:
                    decode(backends[m], layer, slots, x, family, tracked if step == 4 else untracked)
        native, replay = pools["native"].mamba_pool, pools["replay"].mamba_pool
        for i in range(LAYERS):  # SGLang's conv copy, then the materialised state; every layer's cursor settled
            assert torch.equal(replay.mamba_cache.conv[0][i, [6, 7]], native.mamba_cache.conv[0][i, [6, 7]])
            got, want = replay.mamba_cache.temporal[i, [6, 7]], native.mamba_cache.temporal[i, [6, 7]]
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-6, i
        pending = 5 if path == "output-only" else 0
        assert cursors[:, [6, 7]].eq(0).all() and cursors[:, slots.long()].eq(pending).all()
        untouched = [s for s in range(replay.size + 1) if s not in (1, 2, 5, 6, 7)]
        assert torch.equal(replay.mamba_cache.temporal[:, untouched], native.mamba_cache.temporal[:, untouched])



@pytest.mark.parametrize("layer_by_layer", [False, True])
def test_replay_prefill_folds_every_layer_before_sglangs_kernel(layer_by_layer, monkeypatch,
                                                                 cuda_scratch_on_cpu):  # noqa: F811
    """A replay prefill folds the batch's histories before SGLang's chunked kernel runs: every linear layer at
    the first one (one launch each over the pool's stacked buffers), or — where HiCache loads the states layer
    by layer (``layer_transfer_counter``) — each layer its own, after waiting for that layer's load. Either way
    the states are the per-layer folds bit for bit, padding rows and slots outside the batch untouched."""
    gen = torch.Generator().manual_seed(5)
    req = make_pool("replay", 1, monkeypatch, "gdn", history=8)
    pool, rings = req.mamba_pool, req.mamba_pool.replay_rings
    seed_pools([req], gen)
    rings.k_raw.copy_(torch.randn(rings.k_raw.shape, generator=gen))
    rings.v_raw.copy_(torch.randn(rings.v_raw.shape, generator=gen))
    rings.g.copy_(-torch.rand(rings.g.shape, generator=gen) * 0.5)
    rings.beta.copy_(torch.rand(rings.beta.shape, generator=gen))
    rings.count[:, [2, 4, 5]] = 3  # histories in every layer; slot 5 is not in the batch
    slots = torch.tensor([2, -1, 4], dtype=torch.int32, device=DEV)
    expected = pool.mamba_cache.temporal.clone()
    for layer in range(LAYERS):
        replay_fold(expected[layer], slots, pool.layer_ring(layer), slots, slots >= 0, is_kda=False)
    waited = []
    if layer_by_layer:
        req.register_layer_transfer_counter(SimpleNamespace(wait_until=waited.append))
    backend = make_backend(req)
    counts_seen = []

    def chunked_kernel(backend, *, layer, **kwargs):  # SGLang's kernel: here it only looks at the cursors
        counts_seen.append(rings.count[:, [2, 4]].tolist())

    for layer_id in range(LAYERS):
        backend.forward_metadata = ForwardMetadata(
            query_start_loc=torch.arange(0, 3 * 4 + 1, 4, dtype=torch.int32, device=DEV), mamba_cache_indices=slots)
        batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=3, mamba_track_mask=None)
        backend_hooks.forward_extend(chunked_kernel, backend, layer=SimpleNamespace(layer_id=layer_id),
                                     forward_batch=batch, mixed_qkv=None, a=None, b=None)
    folded, pending = [0, 0], [3, 3]
    assert counts_seen == ([[folded, pending], [folded, folded]] if layer_by_layer else [[folded, folded]] * 2)
    assert waited == ([0, 1] if layer_by_layer else [])
    assert torch.equal(pool.mamba_cache.temporal, expected)
    assert rings.count[:, 5].tolist() == [3] * LAYERS and rings.phase[:, [2, 4]].eq(1).all()
