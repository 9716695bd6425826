"""Tensor parallelism without a second GPU (issue 8's CPU part). SGLang 0.5.14 shards a linear-attention
layer by heads: each TP rank holds ``HV / tp`` consecutive value heads with their key heads (key-head groups
fewer than ``tp`` are replicated, ``Mamba2StateShape.create``). Compact's records and replay's history must
shard exactly like the state, and a rank's canonical state (PD export, CPU offload, radix-cache copies) must
be the slice of the unsharded one. Checked here on SGLang's real shape classes and on the kernels: a rank
running its head shard gets exactly (bit for bit) the slice of the unsharded run — outputs, checkpoints,
records, cursors, materialised states. Multi-GPU servers (``--tp 2``, ``--dp 2``) need the two-GPU machine."""

import dataclasses

import pytest
import torch
from sglang.srt.configs.mamba_utils import (
    KimiLinearCacheParams, KimiLinearStateShape, Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape,
)

from kernel_cases import DEVICE, call_replay_verify, flat_inputs, make_case, to_device
from sglang_ssm_modes.config import SSMModeConfig
from sglang_ssm_modes.ops.compact import CompactRecordBuffers, compact_commit, compact_verify
from sglang_ssm_modes.ops.replay import ReplayRing, advance, replay_fold
from sglang_ssm_modes.pool import LinearHeads, ModeMambaPool
from sglang_ssm_modes.reference import LinearAttnInputs
from sglang_ssm_modes.reference.gating import GateParams
from sglang_ssm_modes.reference.random_layer import random_inputs

KD, VD, LAYERS = 16, 32, 2
DTYPES = Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)


def _cache_params(family, hk, hv, tp):
    if family == "gdn":
        shape = Mamba2StateShape.create(tp_world_size=tp, intermediate_size=hv * VD, n_groups=hk, num_heads=hv,
                                        head_dim=VD, state_size=KD, conv_kernel=4)
        return Mamba2CacheParams(shape=shape, layers=list(range(LAYERS)), dtype=DTYPES)
    shape = KimiLinearStateShape.create(tp_world_size=tp, num_heads=hv, head_dim=KD, conv_kernel_size=4)
    return KimiLinearCacheParams(shape=shape, layers=list(range(LAYERS)), dtype=DTYPES)


def _rank_heads(hk, hv, tp, rank):
    """``(value heads, key heads)`` of one rank, as global head indices: consecutive value heads, and the key
    head of each local GQA group (the same key head on several ranks when ``hk < tp``)."""
    per = hv // tp
    v_heads = list(range(rank * per, (rank + 1) * per))
    group = hv // hk
    k_heads = sorted({h // group for h in v_heads})
    return v_heads, k_heads


@pytest.mark.parametrize("family,hk,hv,tp", [("gdn", 2, 4, 2), ("gdn", 1, 4, 2), ("gdn", 2, 8, 4), ("kda", 4, 4, 2)])
@pytest.mark.parametrize("mode", ["compact", "replay"])
def test_records_and_history_take_sglangs_per_rank_heads(family, hk, hv, tp, mode):
    """A rank's pool (SGLang's own per-rank shape) holds its records and history for the rank's heads only:
    ``HV / tp`` value heads and the key heads SGLang gives the rank (replicated when ``hk < tp``)."""
    cfg = SSMModeConfig(mode=mode, draft_tokens=4, replay_history=8)
    full, rank = (ModeMambaPool(mode_config=cfg, size=6, spec_state_size=6,
                                cache_params=_cache_params(family, hk, hv, t), mamba_layer_ids=list(range(LAYERS)),
                                device="cpu", speculative_num_draft_tokens=4) for t in (1, tp))
    v_heads, k_heads = _rank_heads(hk, hv, tp, 0)
    assert LinearHeads.from_cache_params(_cache_params(family, hk, hv, tp)) == LinearHeads(
        family, len(v_heads), len(k_heads), KD, VD if family == "gdn" else KD)  # Kimi-Linear: V = K
    assert rank.mamba_cache.temporal.shape[2] == len(v_heads)
    records = (full.compact_records, rank.compact_records) if mode == "compact" else (full.replay_rings,
                                                                                      rank.replay_rings)
    for field in dataclasses.fields(records[0]):
        t_full, t_rank = (getattr(r, field.name) for r in records)
        if t_full.dim() == 2:  # [layers, slots]: cursors are per request, not per head
            assert t_rank.shape == t_full.shape, field.name
            continue
        heads = len(k_heads) if field.name in ("k", "k_norm", "k_raw") else len(v_heads)
        assert t_rank.shape == (*t_full.shape[:3], heads, *t_full.shape[4:]), field.name  # [layers, slots, T, H, ...]
    assert rank.mem_usage < full.mem_usage


def _shard(family, params, x, hk, hv, tp, rank):
    """The rank's gate parameters and inputs: SGLang's column-parallel projections hand each rank the
    q / k of its key heads and the v / a / b of its value heads."""
    v_heads, k_heads = _rank_heads(hk, hv, tp, rank)
    if family == "gdn":
        dt_bias = params.dt_bias[v_heads]
    else:
        dt_bias = params.dt_bias.view(hv, KD)[v_heads].reshape(-1)
    return (GateParams(family, params.A_log[v_heads], dt_bias),
            LinearAttnInputs(q=x.q[:, :, k_heads], k=x.k[:, :, k_heads], v=x.v[:, :, v_heads], a=x.a[:, :, v_heads],
                             b=x.b[:, :, v_heads]), v_heads, k_heads)


def _replay_rounds(family, params, xs, pool, state_idx, hk, hv, L, accepted):
    """Replay verify + acceptance over ``xs`` (one input set per round, folds fused into the verify
    launch), then every request materialised into a new pool. Returns outputs, pool, ring, materialised."""
    n, d = xs[0].v.shape[:2]
    ring = ReplayRing.allocate(n + 1, L, hk, hv, KD, VD, family == "kda", torch.bfloat16, DEVICE)
    rec_idx = torch.arange(1, n + 1, dtype=torch.int32, device=DEVICE)
    outs = []
    for x, acc in zip(xs, accepted):
        outs.append(call_replay_verify(params, x, family, n, d, pool, state_idx, ring, rec_idx))
        advance(ring, rec_idx, acc.to(DEVICE), window=d)
    mat = torch.zeros_like(pool)
    replay_fold(pool, state_idx.to(DEVICE), ring, rec_idx, torch.ones(n, dtype=torch.bool, device=DEVICE),
                is_kda=family == "kda", dst=mat, dst_indices=torch.arange(n, device=DEVICE))
    return outs, pool, ring, mat


@pytest.mark.parametrize("family,hk,hv,tp", [("gdn", 2, 4, 2), ("gdn", 1, 4, 2), ("kda", 2, 2, 2)])
def test_replay_on_a_head_shard_is_the_slice_of_the_unsharded_run(family, hk, hv, tp):
    """Every replay kernel computes per head: each rank's outputs, checkpoints (folds included), ring and
    materialised states are the unsharded run's slice, bit for bit; cursors are per request and equal."""
    n, d, L, rounds = 5, 2, 4, 5  # L = 4, up to 2 accepted per round: several folds
    params, _, pool, state_idx = make_case(family, n, d, hk, hv, KD, VD, torch.float32, seed=80)
    gen = torch.Generator().manual_seed(81)
    xs = [random_inputs(family, n, d, hk, hv, KD, VD, gen, torch.bfloat16) for _ in range(rounds)]
    accepted = [torch.randint(0, d + 1, (n,), generator=gen).to(torch.int32) * (state_idx >= 0) for _ in range(rounds)]
    outs, full_pool, ring, mat = _replay_rounds(family, params, xs, pool.to(DEVICE).clone(), state_idx, hk, hv, L,
                                                accepted)
    assert int(ring.folds.sum()) >= 2
    for rank in range(tp):
        shards = [_shard(family, params, x, hk, hv, tp, rank) for x in xs]
        p_rank, v_heads, k_heads = shards[0][0], shards[0][2], shards[0][3]
        r_outs, r_pool, r_ring, r_mat = _replay_rounds(
            family, p_rank, [s[1] for s in shards], pool[:, v_heads].to(DEVICE).clone(), state_idx, len(k_heads),
            len(v_heads), L, accepted)
        for o, r_o in zip(outs, r_outs):
            assert torch.equal(r_o, o[:, :, v_heads])
        assert torch.equal(r_pool, full_pool[:, v_heads])
        assert torch.equal(r_mat, mat[:, v_heads])
        for name, t in ring.buffers().items():
            if t.dim() == 1:
                assert torch.equal(r_ring.buffers()[name], t), name
            else:
                heads = k_heads if name in ("k_norm", "k_raw") else v_heads
                assert torch.equal(r_ring.buffers()[name], t[:, :, heads]), name


def _compact_round(family, params, x, pool, state_idx, last, hk, hv):
    n, d = x.v.shape[:2]
    inp = to_device(flat_inputs(x, family, n, d), DEVICE)
    rec = CompactRecordBuffers.allocate(n, d, hk, hv, KD, VD, family == "kda", torch.bfloat16, DEVICE)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    o = compact_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                       inp["b"], pool, state_idx.to(DEVICE), rec, rec_idx, is_kda=family == "kda")
    compact_commit(pool, state_idx.to(DEVICE), rec, rec_idx, last.to(DEVICE), is_kda=family == "kda")
    return o, pool, rec


@pytest.mark.parametrize("family,hk,hv,tp", [("gdn", 2, 4, 2), ("gdn", 1, 4, 2), ("kda", 2, 2, 2)])
def test_compact_on_a_head_shard_is_the_slice_of_the_unsharded_run(family, hk, hv, tp):
    """Compact verify + commit per rank: outputs, committed state and records are the unsharded slice."""
    n, d = 5, 3
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, KD, VD, torch.float32, seed=82)
    last = torch.tensor([2, -1, 0, 0, 1], dtype=torch.int64)  # row 2 is padding (its 0 must not commit)
    real = state_idx >= 0
    assert not real.all() and sorted(last[real].tolist()) == list(range(-1, d)), "every accepted length, real rows"
    o, full_pool, rec = _compact_round(family, params, x, pool.to(DEVICE).clone(), state_idx, last, hk, hv)
    for rank in range(tp):
        p_rank, x_rank, v_heads, k_heads = _shard(family, params, x, hk, hv, tp, rank)
        r_o, r_pool, r_rec = _compact_round(family, p_rank, x_rank, pool[:, v_heads].to(DEVICE).clone(), state_idx,
                                            last, len(k_heads), len(v_heads))
        assert torch.equal(r_o, o[:, :, v_heads])
        assert torch.equal(r_pool, full_pool[:, v_heads])
        assert torch.equal(r_rec.k, rec.k[:, :, k_heads])
        for name in ("v", "g", "beta"):
            assert torch.equal(getattr(r_rec, name), getattr(rec, name)[:, :, v_heads]), name
