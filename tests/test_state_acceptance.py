"""``StateAcceptance`` over random speculative rounds, in every mode, against the native pool: the
whole state tensor (committed slots, tracked snapshots, padding and untouched slots) compared —
compact bit for bit, replay after materialising within float32 rounding; GDN and KDA (Kimi-Linear's heads: the
per-key-channel gate in the stacked records and rings). On the GPU where there is one (the kernels for real,
SGLang's CUDA scatter for native), else on the CPU interpreter."""

import dataclasses

import pytest
import torch
from sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent import fused_sigmoid_gating_delta_rule_update

from kernel_cases import DEVICE, flat_inputs, to_device
from sglang_ssm_modes.acceptance import StateAcceptance, state_acceptance
from sglang_ssm_modes.ops.compact import compact_verify
from sglang_ssm_modes.ops.replay import after_fold, fold_needed, replay_fold, replay_verify
from sglang_ssm_modes.reference.random_layer import random_gate_params, random_inputs
from sglang_ssm_modes.config import SSMModeConfig
from sglang_ssm_modes.pool import ModeMambaPool
from test_mode_pool import HK, HV, KD, LAYERS, VD, cuda_scratch_on_cpu, gdn_params, kda_params, make_pool  # noqa: F401

N, D, SIZE = 5, 3, 9


def _verify(pool, layer, params, inp, state_idx):
    kda = pool.heads.family == "kda"
    temporal = pool.mamba_cache.temporal[layer]
    args = (params.A_log, inp["a"], params.dt_bias, inp["q"], inp["k"], inp["v"], inp["b"])
    batch = torch.arange(N, dtype=torch.int32, device=DEVICE)
    if pool.mode_config.mode == "native":
        fused_sigmoid_gating_delta_rule_update(
            A_log=params.A_log, dt_bias=params.dt_bias, softplus_beta=1.0, softplus_threshold=20.0,
            initial_state_source=temporal, initial_state_indices=state_idx, use_qk_l2norm_in_kernel=True,
            cu_seqlens=torch.arange(0, N * D + 1, D, dtype=torch.int32, device=DEVICE), disable_state_update=True,
            intermediate_states_buffer=pool.mamba_cache.intermediate_ssm[layer], intermediate_state_indices=batch,
            cache_steps=D, is_kda=kda, **inp)
    elif pool.mode_config.mode == "compact":
        compact_verify(*args, temporal, state_idx, pool.layer_records(layer), batch, is_kda=kda)
    else:
        ring = pool.layer_ring(layer)
        need = fold_needed(ring, state_idx, D)
        replay_fold(temporal, state_idx, ring, state_idx, need, is_kda=kda)
        after_fold(ring, state_idx, need)
        replay_verify(*args, temporal, state_idx, ring, state_idx, is_kda=kda)


def _materialised(pool):
    """Every slot's committed state (replay: checkpoint folded with its history, in a copy)."""
    out = pool.mamba_cache.temporal.clone()
    if pool.mode_config.mode == "replay":
        slots = torch.arange(SIZE + 1, dtype=torch.int32, device=DEVICE)
        for layer in range(LAYERS):  # a layer at a time: the stacked launch is what the commit under test uses
            replay_fold(pool.mamba_cache.temporal[layer], slots, pool.layer_ring(layer), slots,
                        torch.ones_like(slots, dtype=torch.bool), is_kda=pool.heads.family == "kda", dst=out[layer],
                        dst_indices=slots)
    return out


@pytest.mark.usefixtures("cuda_scratch_on_cpu")
@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_acceptance_rounds_agree_with_native_in_every_mode(monkeypatch, family):
    """Rounds of verify + commit (tracked snapshots included) in every mode against native. Compact and replay
    commit every layer in the same launches: per commit, compact 2 commit launches (snapshot, commit), replay 1
    snapshot fold, 1 history clear and 1 cursor launch, whatever the layer count."""
    calls = {"compact_commit": 0, "replay_fold": 0, "advance": 0, "clear_history": 0}
    for name in calls:
        real = getattr(state_acceptance, name)
        monkeypatch.setattr(state_acceptance, name,
                            lambda *a, _real=real, _name=name, **kw: calls.__setitem__(_name, calls[_name] + 1)
                            or _real(*a, **kw))
    cache_params = kda_params() if family == "kda" else gdn_params()
    pools = {m: make_pool(m, cache_params, draft_tokens=D, size=SIZE, history=8, device=DEVICE)
             for m in ("native", "compact", "replay")}
    heads = pools["compact"].heads
    assert heads.family == family
    hk, hv, kd, vd = heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim
    gen = torch.Generator().manual_seed(61 + (family == "kda"))
    init = (torch.randn(LAYERS, SIZE + 1, hv, vd, kd, generator=gen) * 0.3).to(DEVICE)
    for pool in pools.values():
        pool.mamba_cache.temporal.copy_(init)
    params = [random_gate_params(family, hv, kd, gen) for _ in range(LAYERS)]
    params = [dataclasses.replace(p, A_log=p.A_log.to(DEVICE), dt_bias=p.dt_bias.to(DEVICE)) for p in params]
    state_idx = torch.tensor([4, 1, -1, 0, 3], dtype=torch.int32, device=DEVICE)  # slot -1: a padding row
    for rnd in range(4):
        xs = [random_inputs(family, N, D, hk, hv, kd, vd, gen, torch.bfloat16) for _ in range(LAYERS)]
        for pool in pools.values():
            for layer in range(LAYERS):
                _verify(pool, layer, params[layer], to_device(flat_inputs(xs[layer], family, N, D), DEVICE), state_idx)
        last = torch.randint(-1, D, (N,), generator=gen)
        last[2] = D - 1  # the padding row claims a full acceptance: nothing may change
        last[0] = D - 1
        track = torch.tensor([6 + rnd % 2, -1, -1, 8, 5], dtype=torch.int32)  # snapshot slots 5..8 (none for padding)
        steps = torch.minimum(torch.randint(0, D, (N,), generator=gen), last.clamp_min(0))
        steps[1] = -1
        last, track, steps = last.to(DEVICE), track.to(DEVICE), steps.to(DEVICE)
        for pool in pools.values():
            before = dict(calls)
            StateAcceptance(pool).commit(state_idx, last, track_indices=track, steps_to_track=steps)
            launches = {name: calls[name] - before[name] for name in calls}
            mode = pool.mode_config.mode
            assert launches == {"compact_commit": 2 * (mode == "compact"), "replay_fold": mode == "replay",
                                "advance": mode == "replay", "clear_history": mode == "replay"}
        native = pools["native"].mamba_cache.temporal
        diff = (pools["compact"].mamba_cache.temporal != native).flatten(2).any(-1)
        assert not diff.any(), f"round {rnd}: slots differing per layer {diff.nonzero().tolist()}"
        replay = _materialised(pools["replay"])
        assert ((replay - native).abs().max() / native.abs().max()).item() < 1e-5, f"round {rnd}"
        for state in (native, replay):  # slots nobody owns (2, 9) never change
            assert torch.equal(state[:, [2, 9]], init[:, [2, 9]])
    # the replay pool folded at least once, and snapshot slots hold no history
    rings = pools["replay"].replay_rings
    assert int(rings.phase.sum()) > 0
    assert (rings.count[:, [5, 6, 7, 8]] == 0).all()


def test_replay_refuses_tree_commits():
    pool = make_pool("replay", draft_tokens=D, size=SIZE, history=8)
    with pytest.raises(ValueError, match="commits through compact.s path"):
        StateAcceptance(pool).commit(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                                     retrieve_parent_token=torch.zeros(1, D, dtype=torch.int64))


def test_track_arguments_come_together():
    pool = make_pool("compact", draft_tokens=D, size=SIZE)
    with pytest.raises(ValueError, match="come together"):
        StateAcceptance(pool).commit(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                                     track_indices=torch.zeros(1, dtype=torch.int32))


@pytest.mark.usefixtures("cuda_scratch_on_cpu")
def test_replay_tree_commit_leaves_snapshots_without_history():
    """A replay pool built for tree verify commits through compact's records: the tracked snapshot slot
    receives a canonical state, so whatever history it held from a previous owner is emptied; the
    committed slot's own (empty) history stays empty."""
    cfg = SSMModeConfig(mode="replay", draft_tokens=D, replay_history=8)
    pool = ModeMambaPool(mode_config=cfg, size=SIZE, spec_state_size=SIZE, cache_params=gdn_params(),
                         mamba_layer_ids=list(range(LAYERS)), device=DEVICE, speculative_num_draft_tokens=D,
                         speculative_eagle_topk=2)
    assert pool.verify_path == "compact" and pool.compact_records is not None
    pool.replay_rings.count[:, 6] = 3  # a stale history in the slot about to receive a snapshot
    pool.replay_rings.count[:, 7] = 2  # another slot, untouched
    state_idx = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    parents = torch.tensor([[0, 0, 1], [0, 0, 0]], dtype=torch.int32, device=DEVICE)
    StateAcceptance(pool).commit(state_idx, torch.tensor([2, 1], device=DEVICE),
                                 track_indices=torch.tensor([6, -1], device=DEVICE),
                                 steps_to_track=torch.tensor([1, 0], device=DEVICE), retrieve_parent_token=parents)
    assert pool.replay_rings.count[:, 6].tolist() == [0] * LAYERS
    assert pool.replay_rings.count[:, 7].tolist() == [2] * LAYERS
    assert (pool.replay_rings.count[:, [1, 2]] == 0).all()
