"""Replay-mode Triton kernels: output-only verify against checkpoint + history, fold, materialise,
cursor acceptance — against the float64 reference over several folds, against SGLang 0.5.14's
decode kernel bit for bit (float32 state), with the whole ring, cursors and pool compared."""

import inspect

import pytest
import torch

from kernel_cases import (DEVICE, call_replay_verify, compiled_variants, flat_inputs, make_case, ring_snapshot,
                          sglang_decode, to_device)

from sglang_ssm_modes.ops.compact import CompactRecordBuffers, compact_verify
from sglang_ssm_modes.ops.replay import ReplayRing, advance, after_fold, fold_needed, replay_fold, replay_verify
from sglang_ssm_modes.ops.replay.write_through import replay_write_through_kernel
from sglang_ssm_modes.ops.replay.fold import replay_fold_kernel
from sglang_ssm_modes.ops.replay import served as served_module, verify as replay_verify_module
from sglang_ssm_modes.ops.replay.served import (FOLD_FIRST_MIN_REQUESTS, NARROW_TILING, ONE_LAUNCH_MAX_TOKENS,
                                                WIDE_DECODE_FROM, WIDE_TILING, WIDE_VERIFY_FROM, output_tiling,
                                                served_launches, served_window_key_heads)
from sglang_ssm_modes.ops.replay.verify import (fold_order_kernel, pdl_available, replay_output_kernel,
                                                replay_step_kernel, replay_window_kernel)
from sglang_ssm_modes.reference import LinearAttnInputs, chain_verify, decode
from sglang_ssm_modes.reference.random_layer import random_inputs

SHAPES = [("gdn", 2, 4, 16, 32), ("kda", 2, 2, 16, 32)]


@pytest.mark.parametrize("shape", SHAPES)
def test_replay_rounds_match_float64_native_over_several_folds(shape):
    """Rounds of fold + verify + acceptance + materialise against float64 native, with the whole pool, ring and
    cursors checked every round: a padding row (slot and record slot -1) that reports a full acceptance changes
    nothing, slots nobody owns (pool and ring) never change, cursors follow the folds and acceptances exactly."""
    family, hk, hv, kdim, vdim = shape
    n, d, L, rounds = 5, 3, 8, 7
    params, _, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, torch.float32, seed=41)
    gen = torch.Generator().manual_seed(42)
    pool = pool.to(DEVICE)
    pool_init = pool.clone()
    ring = ReplayRing.allocate(n + 2, L, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
    real = state_idx >= 0
    # record slot 0 and n + 1 belong to nobody (n + 1: the record slot a padding row would have had)
    rec_idx = torch.where(real, torch.arange(1, n + 1), torch.full((n,), -1)).to(torch.int32).to(DEVICE)
    nobody = [0, n + 1] + [i + 1 for i in range(n) if not real[i]]
    owned = [i + 1 for i in range(n) if real[i]]
    untouched = [s for s in range(pool.shape[0]) if s not in state_idx.tolist()]
    truth = pool[state_idx.clamp_min(0)].double().cpu()  # float64 committed state per request
    mat_pool = torch.zeros_like(pool)
    words = {name: torch.zeros(n + 2, dtype=torch.int32) for name in ("count", "phase", "folds")}  # the model
    folds = 0
    for _ in range(rounds):
        need = fold_needed(ring, rec_idx, d)
        assert not need[~real.to(DEVICE)].any()
        folds += int(need.sum())
        replay_fold(pool, state_idx.to(DEVICE), ring, rec_idx, need, is_kda=family == "kda")
        after_fold(ring, rec_idx, need)
        for i in range(n):
            if need[i]:
                r = int(rec_idx[i])
                words["count"][r] = 0
                words["phase"][r] = 1 - words["phase"][r]
                words["folds"][r] += 1
        assert int(ring.count.max()) + d <= L
        x = random_inputs(family, n, d, hk, hv, kdim, vdim, gen, torch.bfloat16)
        o = call_replay_verify(params, x, family, n, d, pool, state_idx, ring, rec_idx)
        o_ref, _ = chain_verify(truth, x, params, torch.float64)
        got = o.reshape(n, d, hv, vdim)[real.to(DEVICE)].double().cpu()
        assert torch.allclose(got, o_ref[real], rtol=2e-2, atol=2e-2)  # bf16 outputs
        accepted = torch.randint(1, d + 1, (n,), generator=gen)
        accepted[0] = 0  # a request that accepts nothing this round (HOLD)
        accepted[~real] = d  # padding rows report a full acceptance, passed to advance as is: nothing may change
        advance(ring, rec_idx, accepted.to(DEVICE).to(torch.int32))
        for i in range(n):
            if real[i]:
                words["count"][int(rec_idx[i])] += int(accepted[i])
        for name, want in words.items():
            assert torch.equal(getattr(ring, name).cpu(), want), name
        assert not ring.faults.any() and not ring.tickets.any()
        for i in range(n):
            if real[i] and accepted[i] > 0:
                row = LinearAttnInputs(*(t[i:i + 1, :int(accepted[i])] for t in (x.q, x.k, x.v, x.a, x.b)))
                _, s = decode(truth[i:i + 1], row, params, torch.float64)
                truth[i] = s[0]
        # materialise every request into another pool: checkpoint, ring and cursors untouched
        snap, pool_before = ring_snapshot(ring), pool.clone()
        replay_fold(pool, state_idx.to(DEVICE), ring, rec_idx, torch.ones(n, dtype=torch.bool, device=DEVICE),
                    is_kda=family == "kda", dst=mat_pool, dst_indices=torch.arange(n, device=DEVICE))
        assert torch.equal(pool, pool_before)
        assert all(torch.equal(snap[k], v) for k, v in ring.buffers().items())
        mat = mat_pool[:n][real.to(DEVICE)].double().cpu()
        assert ((mat - truth[real]).abs().max() / truth[real].abs().max()).item() < 1e-5
        assert (mat_pool[n:] == 0).all() and (mat_pool[:n][~real.to(DEVICE)] == 0).all()
        # slots nobody owns: the pool's as they were, the ring's never written
        assert torch.equal(pool[untouched], pool_init[untouched])
        for name, t in ring.buffers().items():
            assert (t[nobody] == 0).all(), f"ring {name} of a slot nobody owns (padding's included)"
    assert folds >= 3  # the three requests that accept >= 1 token a round each fold at least once
    assert all(int(ring.folds[r]) >= 1 for r in owned[1:])
    assert not torch.equal(pool[state_idx[real]], pool_init[state_idx[real]])  # the folds reached the checkpoints


@pytest.mark.parametrize("fused", [False, True], ids=["separate-fold", "fused-fold"])
@pytest.mark.parametrize("family,hk,hv", [("gdn", 2, 4), ("kda", 2, 2)])
def test_decode_and_fold_bit_identical_to_sglang_decode_float32(family, hk, hv, fused):
    """Replay decode (one record per token, folding every L tokens, in the decode launch or before
    it) leaves, once folded, the state SGLang's decode kernel leaves after the same tokens: bit for
    bit with a float32 state."""
    n, L, tokens, kdim, vdim = 3, 4, 9, 16, 32
    params, _, pool, state_idx = make_case(family, n, tokens, hk, hv, kdim, vdim, torch.float32, seed=43)
    state_idx = torch.tensor([2, 0, 5])
    gen = torch.Generator().manual_seed(44)
    x_all = random_inputs(family, n, tokens, hk, hv, kdim, vdim, gen, torch.bfloat16)
    native = pool.to(DEVICE).clone()
    ours = pool.to(DEVICE).clone()
    ring = ReplayRing.allocate(n, L, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    ones = torch.ones(n, dtype=torch.int32, device=DEVICE)
    for t in range(tokens):
        x = x_all.tokens(t, t + 1)
        sglang_decode(params, x, native, state_idx, family, n)
        if not fused:
            need = fold_needed(ring, rec_idx, 1)
            replay_fold(ours, state_idx.to(DEVICE), ring, rec_idx, need, is_kda=family == "kda")
            after_fold(ring, rec_idx, need)
        call_replay_verify(params, x, family, n, 1, ours, state_idx, ring, rec_idx, fused_fold=fused)
        advance(ring, rec_idx, ones, window=1 if fused else 0)
    all_ = torch.ones(n, dtype=torch.bool, device=DEVICE)
    replay_fold(ours, state_idx.to(DEVICE), ring, rec_idx, all_, is_kda=family == "kda")
    after_fold(ring, rec_idx, all_)
    assert torch.equal(ours, native)
    assert (ring.count == 0).all() and torch.equal(ring.phase, torch.full_like(ring.phase, (tokens // L + 1) % 2))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv,d,L", [("gdn", 2, 4, 3, 8), ("kda", 2, 2, 2, 4), ("gdn", 1, 1, 1, 4)])
def test_fused_fold_equals_fold_then_verify(family, hk, hv, d, L, state_dtype):
    """The verify kernel's fused fold + ``advance(window=T)``, with the output launch in fold-first order
    (default) and in request order (on an sm90 GPU overlapping the window launch: ``pdl``), against the separate
    fold kernel + cursor update + verify, on the same inputs round after round (accepted 0..D, padding rows, requests
    folding at different rounds): outputs, checkpoints, every ring buffer and the cursors bit for bit."""
    n, kdim, vdim = 5, 16, 32
    params, _, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, state_dtype, seed=48 + d)
    gen = torch.Generator().manual_seed(49)
    pools = [pool.to(DEVICE), pool.to(DEVICE).clone(), pool.to(DEVICE).clone()]
    rings = [ReplayRing.allocate(n + 2, L, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
             for _ in range(3)]
    real = (state_idx >= 0).to(DEVICE)
    rec_idx = torch.where(real, torch.tensor([3, 1, 6, 0, 4], device=DEVICE), -1).to(torch.int32)  # padding: -1
    folds = 0
    for _ in range(3 * L):
        x = random_inputs(family, n, d, hk, hv, kdim, vdim, gen, torch.bfloat16)
        accepted = torch.randint(0, d + 1, (n,), generator=gen).to(DEVICE).to(torch.int32)  # padding rows too
        need = fold_needed(rings[0], rec_idx, d)
        assert not need[~real].any()
        folds += int(need.sum())
        replay_fold(pools[0], state_idx.to(DEVICE), rings[0], rec_idx, need, is_kda=family == "kda")
        after_fold(rings[0], rec_idx, need)
        o_sep = call_replay_verify(params, x, family, n, d, pools[0], state_idx, rings[0], rec_idx, fused_fold=False)
        advance(rings[0], rec_idx, accepted)
        for i, fold_first in ((1, True), (2, False)):
            o_fused = call_replay_verify(params, x, family, n, d, pools[i], state_idx, rings[i], rec_idx,
                                   fold_first=fold_first, pdl=pdl_available(DEVICE) or None)
            advance(rings[i], rec_idx, accepted, window=d)
            assert torch.equal(o_sep[0].reshape(n, d, hv, vdim)[real], o_fused[0].reshape(n, d, hv, vdim)[real])
            assert torch.equal(pools[0], pools[i])
            for name, t in rings[0].buffers().items():
                assert torch.equal(t, rings[i].buffers()[name]), (name, fold_first)
    assert folds >= 2  # requests folded at different rounds


def _random_ring(n, L, hk, hv, kdim, vdim, family, count, seed):
    """A ring of ``n`` slots filled with seeded random records (drawn on the CPU: the same bits on any device),
    every cursor at ``count``; each normalised key is its raw key's L2 normalisation, as the kernels record them."""
    ring = ReplayRing.allocate(n, L, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
    ring.count.fill_(count)
    gen = torch.Generator().manual_seed(seed)
    for name, t in ring.buffers().items():
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    ring.beta.copy_(torch.rand(ring.beta.shape, generator=gen))
    ring.g.copy_(-torch.rand(ring.g.shape, generator=gen))
    _normalise_keys(ring)
    return ring


def _normalise_keys(ring):
    """Every normalised key of ``ring`` its raw key's L2 normalisation as SGLang's kernels compute it."""
    raw = ring.k_raw.float()
    ring.k_norm.copy_(raw / torch.sqrt((raw * raw).sum(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("kdim,vdim", [(16, 32), (32, 40)])  # K = 32: two K steps at block_k 16; V = 40: a part tile
@pytest.mark.parametrize("family,hk,hv", [("gdn", 2, 4), ("kda", 2, 2)])
def test_launch_tiling_changes_no_result(family, hk, hv, kdim, vdim):
    """``block_v`` / ``num_warps`` / ``block_k`` / ``num_stages`` / ``window_warps`` / ``dot`` / ``launches`` /
    ``window_key_heads`` / ``window_raw_keys`` / ``fold_block_v`` / ``window_history_rows`` (what the benchmark
    sweeps) tile the launches;
    checkpoints (a fused fold included) and every ring record but ``u`` are the same bits for every variant (here,
    where the interpreter has no warps; on a GPU for every tiling of one warp, ``FOLD_WARP_COLUMNS``). Outputs and
    ``u`` agree to float32 rounding: their reductions over K follow the launch layout (tensor-core or CUDA-core
    projections) — ``u`` only feeds outputs, never a fold (folds replay the raw records)."""
    n, d, L = 3, 2, 4
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, torch.float32, seed=50)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    results = []
    two = dict(launches=2)
    by_value_head = dict(launches=2, window_key_heads=False)
    for variant in (dict(block_v=16, num_warps=1, **two), dict(block_v=32, num_warps=4, window_warps=1, **two),
                    dict(block_v=8, num_warps=1, dot=False, window_warps=4, **two),
                    dict(block_v=16, num_warps=2, window_warps=2, dot=False, **two),
                    dict(block_v=32, num_warps=1, block_k=8, num_stages=3, dot=False, fold_block_v=16,
                         **two),  # 2 fold passes, K steps
                    dict(block_v=32, num_warps=2, block_k=16, num_stages=3, dot=True, **two),
                    dict(block_v=32, num_warps=1, block_k=16, num_stages=3, **two),  # the served wide tiling (KDA:
                    # one fold pass, served_fold_block_v)
                    dict(block_v=32, num_warps=1, block_k=16, num_stages=3, fold_block_v=32, **two),  # one fold pass
                    dict(block_v=32, num_warps=1, fold_block_v=8, launches=1),  # four fold passes, one launch
                    dict(block_v=16, num_warps=1, fold_first=True, pdl=False, **two),  # the window's order program
                    dict(block_v=16, num_warps=1, fold_first=True, pdl=pdl_available(DEVICE), **two),  # the output
                    dict(block_v=16, num_warps=1, fold_first=False, pdl=pdl_available(DEVICE), **two),  # overlapping
                    dict(block_v=16, num_warps=1, launches=1),  # the one-launch kernel ...
                    dict(block_v=32, num_warps=1, block_k=16, num_stages=3, dot=False, launches=1),
                    dict(block_v=32, num_warps=1, block_k=16, num_stages=3, launches=1),  # ... wide, two K steps
                    dict(block_v=16, num_warps=1, window_raw_keys=True, **two),  # the history's raw keys renormalised
                    dict(block_v=16, num_warps=1, window_raw_keys=False, **two),  # ... or the normalised ones read
                    dict(block_v=32, num_warps=1, block_k=16, num_stages=3, window_raw_keys=True, fold_first=True,
                         **two),
                    dict(block_v=16, num_warps=1, window_history_rows=2, **by_value_head),  # the history read 2
                    dict(block_v=32, num_warps=1, block_k=16, num_stages=3, window_history_rows=1,  # records a step
                         window_raw_keys=True, fold_first=True, **by_value_head),
                    dict(block_v=16, num_warps=1, window_history_rows=4, window_raw_keys=False, **by_value_head),
                    dict(block_v=16, num_warps=1, window_history_rows=0, **by_value_head),  # ... or held whole
                    *((dict(block_v=16, num_warps=1, window_key_heads=True, **two),  # GDN: a window program per key
                       dict(block_v=16, num_warps=1, window_key_heads=True, fold_first=True, **two),  # head
                       dict(block_v=16, num_warps=1, window_key_heads=True, window_raw_keys=True, **two))
                      if family == "gdn" else ())):
        ring = _random_ring(n, L, hk, hv, kdim, vdim, family, L - 1, seed=51)
        ring.count.copy_(torch.tensor([L - 1, 1, L - d], dtype=torch.int32))  # the first folds, the last reads 2
        # records (the middle row is make_case's padding row)
        p = pool.to(DEVICE).clone()
        inp = to_device(flat_inputs(x, family, n, d), DEVICE)
        o = replay_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                          inp["b"], p, state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda", **variant)
        results.append((o, p, ring.buffers()))
    for o, p, bufs in results[1:]:
        assert torch.equal(p, results[0][1])
        differ = {k: (t.float() - results[0][2][k].float()).abs().max().item() for k, t in bufs.items()
                  if k != "u" and not torch.equal(t, results[0][2][k])}
        assert not differ, f"ring buffers differ between tilings (max abs diff): {differ}"
        torch.testing.assert_close(bufs["u"], results[0][2]["u"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o.float(), results[0][0].float(), rtol=1e-2, atol=1e-2)  # bf16 outputs
    with pytest.raises(ValueError, match="power of two"):
        replay_verify(params.A_log, inp["a"], params.dt_bias, inp["q"], inp["k"], inp["v"], inp["b"], p,
                      state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda", block_v=24)
    for bad in (12, 64):  # not a power of two; wider than the output tile
        with pytest.raises(ValueError, match="fold_block_v"):
            replay_verify(params.A_log, inp["a"], params.dt_bias, inp["q"], inp["k"], inp["v"], inp["b"], p,
                          state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda", block_v=32, fold_block_v=bad)
    with pytest.raises(ValueError, match="at least 16 columns"):
        replay_verify(params.A_log, inp["a"], params.dt_bias, inp["q"], inp["k"], inp["v"], inp["b"], p,
                      state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda", block_v=8, dot=True)
    for bad in (12, 2 * kdim):  # not a power of two; more rows than K has
        with pytest.raises(ValueError, match="block_k"):
            replay_verify(params.A_log, inp["a"], params.dt_bias, inp["q"], inp["k"], inp["v"], inp["b"], p,
                          state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda", block_k=bad)
    with pytest.raises(ValueError, match="at least 16 rows"):
        replay_verify(params.A_log, inp["a"], params.dt_bias, inp["q"], inp["k"], inp["v"], inp["b"], p,
                      state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda", block_k=8, dot=True)
    with pytest.raises(ValueError, match="window_key_heads"):  # KDA's gates are per channel; one launch
        replay_verify(params.A_log, inp["a"], params.dt_bias, inp["q"], inp["k"], inp["v"], inp["b"], p,
                      state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda", window_key_heads=True,
                      launches=2 if family == "kda" else 1)
    with pytest.raises(ValueError, match="window_raw_keys"):  # the one-launch kernel reads the normalised keys
        replay_verify(params.A_log, inp["a"], params.dt_bias, inp["q"], inp["k"], inp["v"], inp["b"], p,
                      state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda", window_raw_keys=True, launches=1)
    with pytest.raises(ValueError, match="window_warps 3"):
        replay_verify(params.A_log, inp["a"], params.dt_bias, inp["q"], inp["k"], inp["v"], inp["b"], p,
                      state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda", window_warps=3)


def record_launches(monkeypatch, constant, *kernels):
    """Replace the :mod:`~sglang_ssm_modes.ops.replay.verify` kernels named ``kernels`` by launches that record the
    compile-time ``constant`` each is given instead of running; returns the list they append to."""
    seen = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs[constant])

    for name in kernels:
        monkeypatch.setattr(replay_verify_module, name, Launch())
    return seen


def skip_launches(monkeypatch, *kernels):
    """Replace the :mod:`~sglang_ssm_modes.ops.replay.verify` kernels named ``kernels`` by launches that do nothing."""
    class Skip:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for name in kernels:
        monkeypatch.setattr(replay_verify_module, name, Skip())


def test_fold_block_v_reaches_the_output_launch(monkeypatch):
    """``fold_block_v`` is the ``FBV`` the output launch (either kernel) compiles with; None (a GDN verify):
    ``FOLD_WARP_COLUMNS`` per warp, at most the tile. (The tiling test checks the folds' bits; this one that the
    option is not dropped.)"""
    seen = record_launches(monkeypatch, "FBV", "replay_output_kernel", "replay_step_kernel")
    n, d, kdim, vdim = 2, 2, 16, 64
    params, x, pool, state_idx = make_case("gdn", n, d, 1, 2, kdim, vdim, torch.float32, seed=54)
    inp = to_device(flat_inputs(x, "gdn", n, d), DEVICE)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    ring = ReplayRing.allocate(n, 4, 1, 2, kdim, vdim, False, torch.bfloat16, DEVICE)
    for kw, fbv in ((dict(block_v=64, num_warps=1), 16), (dict(block_v=64, num_warps=2), 32),
                    (dict(block_v=16, num_warps=2), 16), (dict(block_v=64, num_warps=1, fold_block_v=8), 8),
                    (dict(block_v=64, num_warps=4, fold_block_v=64), 64)):
        for launches in (1, 2):
            replay_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                          inp["b"], pool.to(DEVICE).clone(), state_idx.to(DEVICE), ring, rec_idx, is_kda=False,
                          launches=launches, **kw)
            assert seen.pop() == fbv, (kw, launches)
    with pytest.raises(ValueError, match="from num_warps"):  # fewer columns a pass than warps
        replay_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                      inp["b"], pool.to(DEVICE).clone(), state_idx.to(DEVICE), ring, rec_idx, is_kda=False,
                      block_v=64, num_warps=4, fold_block_v=2)


@pytest.mark.parametrize("family,hk,hv,key_heads,via", [("gdn", 2, 4, False, "argument"),
                                                         ("gdn", 2, 4, True, "served"),
                                                         ("kda", 2, 2, False, "argument"),
                                                         ("kda", 2, 2, False, "served")])
def test_window_raw_keys_read_the_raw_records_only(family, hk, hv, key_heads, via, monkeypatch):
    """``window_raw_keys`` (passed, or served: the family's row in :data:`~.served.SERVED_WINDOW_RAW_KEYS`): the
    window launch takes the history's keys from the raw records alone — with every stored normalised history key
    wiped, its outputs, checkpoints and records are those of the stored keys' launch on an intact ring (outputs and
    ``u`` to float32 rounding), while the stored keys' launch on the wiped ring goes wrong. No request folds (a fold
    replays the raw records either way): the window reads 5 history records, their raw keys of norm ~0.005 (where
    SGLang's epsilon inside the square root, not beside it, shows in ``u``) and one of them zero. A ring rounding the
    keys (bfloat16 for float32 keys) is refused when asked for, and served the normalised keys."""
    n, d, L, kdim, vdim = 3, 2, 8, 32, 16
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, torch.float32, seed=52)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    inp = to_device(flat_inputs(x, family, n, d), DEVICE)
    runs = {}
    if via == "served":
        monkeypatch.setattr(served_module, "SERVED_WINDOW_RAW_KEYS", frozenset({(family, 16, d)}))
    raw = True if via == "argument" else None

    def history():  # a history the window reads, its keys tiny, one of them zero
        ring = _random_ring(n, L, hk, hv, kdim, vdim, family, L - d - 1, seed=53)
        ring.k_raw.mul_(1e-3)
        ring.k_raw[:, 1].zero_()
        _normalise_keys(ring)
        return ring

    for name, raw_keys, wiped in (("stored", False, False), ("raw", raw, True), ("stored-wiped", False, True)):
        ring = history()
        if wiped:
            ring.k_norm.zero_()
        p = pool.to(DEVICE).clone()
        o = replay_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                          inp["b"], p, state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda", launches=2,
                          window_key_heads=key_heads, window_raw_keys=raw_keys)
        runs[name] = (o.float(), p, ring.buffers())
    (o0, p0, b0), (o1, p1, b1), (o2, _, _) = runs["stored"], runs["raw"], runs["stored-wiped"]
    assert torch.equal(p1, p0)
    for key in b0:
        if key == "u":
            torch.testing.assert_close(b1[key], b0[key], rtol=1e-5, atol=1e-6)
        elif key == "k_norm":  # the window's own keys written alike (once per key head); the history stays wiped
            written = b1[key].abs().sum(-1) > 0
            assert written.sum() == int((state_idx >= 0).sum()) * d * hk  # real rows; a padding row writes nothing
            assert torch.equal(b1[key][written], b0[key][written])
        else:
            assert torch.equal(b1[key], b0[key]), key
    torch.testing.assert_close(o1, o0, rtol=1e-2, atol=1e-2)  # bf16 outputs
    assert (o2 - o0).abs().max() > 10 * (o1 - o0).abs().max() + 1e-2
    if via == "served":  # the one-launch kernel, served where it is, reads the normalised keys: no refusal
        served_one = replay_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"],
                                   inp["v"], inp["b"], pool.to(DEVICE).clone(), state_idx.to(DEVICE),
                                   history(), rec_idx, is_kda=family == "kda", launches=1)
        torch.testing.assert_close(served_one.float(), o0, rtol=1e-2, atol=1e-2)
    wide = dict(q=inp["q"].float(), k=inp["k"].float())  # float32 keys, a bfloat16 ring
    with pytest.raises(ValueError, match="activation dtype or float32"):
        replay_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), wide["q"], wide["k"],
                      inp["v"], inp["b"], pool.to(DEVICE).clone(), state_idx.to(DEVICE), ring, rec_idx,
                      is_kda=family == "kda", launches=2, window_raw_keys=True)
    if via == "served":  # the served flag on: such a ring is served the normalised keys, no refusal
        o_wide = [replay_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), wide["q"], wide["k"],
                                inp["v"], inp["b"], pool.to(DEVICE).clone(), state_idx.to(DEVICE),
                                _random_ring(n, L, hk, hv, kdim, vdim, family, L - d - 1, seed=53), rec_idx,
                                is_kda=family == "kda", launches=2, window_key_heads=key_heads, window_raw_keys=raw)
                  for raw in (None, False)]
        assert torch.equal(o_wide[0], o_wide[1])


@pytest.mark.parametrize("hk,hv,d", [(1, 3, 1), (2, 4, 3), (2, 2, 2)])
def test_window_per_key_head_matches_per_value_head(hk, hv, d):
    """GDN's window launch with one program per key head (``window_key_heads``; 3 value heads per key head: a
    padded lane, 1: none shared) against one program per value head, round after round through fused folds, with
    a padding row and a request accepting nothing: checkpoints and every ring record but ``u`` bit for bit (the
    same gate, beta and normalisation code), outputs and ``u`` to float32 rounding (each coefficient a decay times
    a shared dot product instead of a dot product of decayed keys)."""
    n, kdim, vdim, L = 4, 16, 32, 4
    params, _, pool, state_idx = make_case("gdn", n, d, hk, hv, kdim, vdim, torch.float32, seed=80 + hv)
    state_idx[2] = -1
    rec_idx = torch.tensor([0, 2, -1, 3], dtype=torch.int32, device=DEVICE)
    real = (state_idx >= 0).to(DEVICE)
    pools = [pool.to(DEVICE).clone() for _ in range(2)]
    rings = [ReplayRing.allocate(n, L, hk, hv, kdim, vdim, False, torch.bfloat16, DEVICE) for _ in range(2)]
    gen = torch.Generator().manual_seed(81)
    folds = 0
    for _ in range(2 * L):
        x = random_inputs("gdn", n, d, hk, hv, kdim, vdim, gen, torch.bfloat16)
        accepted = torch.randint(1, d + 1, (n,), generator=gen).to(torch.int32)
        accepted[0] = 0  # a request that accepts nothing this round
        accepted = accepted.to(DEVICE)
        folds += int(fold_needed(rings[0], rec_idx, d).sum())
        outs = [call_replay_verify(params, x, "gdn", n, d, p, state_idx, ring, rec_idx, launches=2, window_key_heads=kh)
                for p, ring, kh in zip(pools, rings, (False, True))]
        for ring in rings:
            advance(ring, rec_idx, accepted, window=d)
        torch.testing.assert_close(outs[1].reshape(n, d, hv, vdim)[real].float(),
                                   outs[0].reshape(n, d, hv, vdim)[real].float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(pools[0], pools[1])
        for name, t in rings[0].buffers().items():
            if name == "u":
                torch.testing.assert_close(rings[1].u, t, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(t, rings[1].buffers()[name]), name
    assert folds >= 2


@pytest.mark.parametrize("family,hk,hv", [("gdn", 2, 4), ("kda", 2, 2)])
def test_records_hold_the_exact_raw_inputs_gate_and_beta(family, hk, hv):
    """Raw k, v are the inputs bit for bit; g and beta equal the compact records (same code as the
    native kernel); a padding row writes nothing; positions follow phase * L + count."""
    n, d, L, kdim, vdim = 3, 3, 4, 16, 32
    params, x, pool, _ = make_case(family, n, d, hk, hv, kdim, vdim, torch.float32, seed=45)
    state_idx = torch.tensor([1, -1, 4])
    ring = ReplayRing.allocate(n, L, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
    ring.phase[2] = 1
    ring.count[2] = 1  # one older record at position L; the window goes to L + 1 ..
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    pool = pool.to(DEVICE)
    call_replay_verify(params, x, family, n, d, pool, state_idx, ring, rec_idx)
    inp = to_device(flat_inputs(x, family, n, d), DEVICE)
    rec = CompactRecordBuffers.allocate(n, d, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
    compact_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                   inp["b"], pool, state_idx.to(DEVICE), rec, rec_idx, is_kda=family == "kda")
    for i, start in ((0, 0), (2, L + 1)):
        w = slice(start, start + d)
        assert torch.equal(ring.k_raw[i, w].cpu(), x.k[i]) and torch.equal(ring.v_raw[i, w].cpu(), x.v[i])
        assert torch.equal(ring.g[i, w], rec.g[i]) and torch.equal(ring.beta[i, w], rec.beta[i])
    assert (ring.u[1] == 0).all() and (ring.k_raw[1] == 0).all()  # the padding row's slot
    assert (ring.u[2, :L + 1] == 0).all() and (ring.u[0, d:] == 0).all()
    assert torch.equal(ring.count, torch.tensor([0, 0, 1], dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("n", [1, 5, 300])
def test_fold_order_puts_folding_requests_first(n):
    """``fold_order_kernel`` (more requests than one block: 300 > 256 walks two): a permutation of the
    batch, the requests whose window overflows first in request order, the others (padding rows among
    them) after, from the back."""
    L, T = 8, 3
    gen = torch.Generator().manual_seed(n)
    ring = ReplayRing.allocate(n + 4, L, 1, 1, 16, 16, False, torch.bfloat16, DEVICE)
    ring.count.copy_(torch.randint(0, L - T + 2, (n + 4,), generator=gen).to(DEVICE))
    rec_idx = torch.randperm(n + 4, generator=gen)[:n].to(torch.int32)
    ring.count[rec_idx[0]], ring.count[rec_idx[-1]] = L, 0  # row 0 folds, the last row does not
    state_idx = torch.arange(n, dtype=torch.int32)
    state_idx[n // 2] = -1  # a padding row
    rec_idx, state_idx = rec_idx.to(DEVICE), state_idx.to(DEVICE)
    order = torch.full((n,), -7, dtype=torch.int32, device=DEVICE)
    fold_order_kernel[(1,)](state_idx, rec_idx, ring.count, order, n, T, L=L, BLOCK=256)
    folds = ((state_idx >= 0) & (ring.count[rec_idx.long()] + T > L)).cpu()
    expect = torch.cat([torch.nonzero(folds).flatten(), torch.nonzero(~folds).flatten().flip(0)])
    assert torch.equal(order.cpu().long(), expect)
    assert 0 < int(folds.sum()) < n or n == 1


def test_request_count_is_not_a_compile_time_constant():
    """No kernel takes the request count as a constexpr; the request count ``N`` (the order program's and
    the window launch's) and the window length ``T`` are runtime integers Triton must not specialise (but the
    write-through's ``T``: 1 for a decode, a server's D for a verify, fixed for the server's life); so are the
    fold's slot counts per layer (a materialise into a temporary of N requests has N)."""
    for jit, runtime in ((replay_window_kernel, {"N", "T"}), (replay_output_kernel, {"T"}), (replay_step_kernel, {"T"}),
                         (fold_order_kernel, {"N", "T"}),
                         (replay_fold_kernel, {"src_slots", "dst_slots", "R", "window"}),
                         (replay_write_through_kernel, set())):
        params = inspect.signature(jit.fn).parameters
        assert not any(params[name].annotation is not inspect.Parameter.empty
                       for name in ("N", "B", "batch", "num_requests") if name in params)
        assert {name for name in ("N", "B", "batch", "num_requests") if name in params} <= runtime
        marked = getattr(jit, "do_not_specialize", None) or getattr(jit, "kwargs", {}).get("do_not_specialize") or []
        assert {jit.arg_names[i] if isinstance(i, int) else i for i in marked} == runtime


@pytest.mark.gpu
def test_request_counts_1_to_511_compile_the_served_variants_once():
    """Request counts run through 1..511, decode (T = 1) and a 4-token verify: each launch compiles once
    per served choice and never per count. Per window length the output launch has three — narrow tiling in
    request order, narrow fold-first, wide fold-first (:data:`FOLD_FIRST_MIN_REQUESTS` 32,
    :data:`WIDE_VERIFY_FROM` 40 and :data:`WIDE_DECODE_FROM` 64 for float32 GDN at L = 8) — the
    window launch two (request order; fold-first, with the order
    program) and the one-launch kernel one (up to :data:`ONE_LAUNCH_MAX_TOKENS` 8 tokens: 8 decode requests, 2
    verify), with a head shape no other test uses (earlier compilations cannot hide a recompile); the separate
    order launch none (it serves a one-launch verify of 32 requests or more, never a served choice)."""
    n_max, hk, hv, kdim, vdim, L = 511, 1, 2, 32, 16, 8
    kernels = (replay_window_kernel, replay_output_kernel, replay_step_kernel)
    assert (FOLD_FIRST_MIN_REQUESTS, WIDE_VERIFY_FROM[("gdn", 16, 4)], WIDE_DECODE_FROM[("gdn", 16, 4)],
            ONE_LAUNCH_MAX_TOKENS) == (32, 40, 64, 8)  # hence the counts
    order_before = compiled_variants(fold_order_kernel)
    for d in (1, 4):
        params, x, pool, _ = make_case("gdn", n_max, d, hk, hv, kdim, vdim, torch.float32, seed=60 + d)
        inp = to_device(flat_inputs(x, "gdn", n_max, d), DEVICE)
        pool = pool.to(DEVICE)
        ring = ReplayRing.allocate(n_max, L, hk, hv, kdim, vdim, False, torch.bfloat16, DEVICE)
        idx = torch.arange(n_max, dtype=torch.int32, device=DEVICE)
        before = [compiled_variants(j) for j in kernels]
        for n in range(1, n_max + 1):
            t = slice(0, n * d)
            replay_verify(params.A_log.to(DEVICE), inp["a"][t], params.dt_bias.to(DEVICE), inp["q"][:, t],
                          inp["k"][:, t], inp["v"][:, t], inp["b"][:, t], pool, idx[:n], ring, idx[:n], is_kda=False)
            advance(ring, idx[:n], d, window=d)
        torch.cuda.synchronize()
        after = [compiled_variants(j) for j in kernels]
        assert tuple(a - b for a, b in zip(after, before)) == (2, 3, 1), (d, before, after)
    assert compiled_variants(fold_order_kernel) == order_before


def test_one_launch_is_served_for_small_gdn_windows_over_short_histories_only():
    """The served launch count (``served_launches``): one launch for GDN up to 8 tokens in all and L = 16,
    and for one token up to L = 32; two past those bounds and always for KDA."""
    assert [served_launches(t, False, 16) for t in (1, 8, 9)] == [1, 1, 2]
    assert [served_launches(1, False, L) for L in (8, 16, 32, 64)] == [1, 1, 1, 2]
    assert [served_launches(t, False, 32) for t in (1, 2, 8)] == [1, 2, 2]
    assert [served_launches(1, True, L) for L in (8, 16)] == [2, 2]


def test_the_served_output_tiling():
    """Wide from the measured bound per family, history and state width: for a verify (T > 1,
    :data:`WIDE_VERIFY_FROM`) float32 L = 16 and GDN L = 32 40, 2-byte L = 16 32, 64 elsewhere; for one token
    (:data:`WIDE_DECODE_FROM`) float32 L = 16 64, GDN L = 32 112, never at L = 64 or KDA L = 32; 2-byte states 80
    at L = 16, 112 / 192 at L = 32. L < 16 as L = 16."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    keys = {(f, L, b) for f in ("gdn", "kda") for L in (16, 32, 64) for b in (4, 2)}
    assert set(WIDE_DECODE_FROM) == set(WIDE_VERIFY_FROM) == keys

    def wide_from(tokens, kda, L, dt):  # the first request count served wide, None if none up to 511
        tilings = {n: output_tiling(n, tokens, kda, L, dt) for n in range(1, 512)}
        assert set(tilings.values()) <= {NARROW_TILING, WIDE_TILING}
        return next((n for n, tiling in tilings.items() if tiling == WIDE_TILING), None)

    verify_bounds = {(kda, L, dt): 64 for kda in (False, True) for L in (8, 16, 32, 64) for dt in (f32, bf16, f16)}
    verify_bounds |= {(kda, L, f32): 40 for kda in (False, True) for L in (8, 16)} | {(False, 32, f32): 40}
    verify_bounds |= {(kda, L, dt): 32 for kda in (False, True) for L in (8, 16) for dt in (bf16, f16)}
    for t in (2, 4):
        assert {key: wide_from(t, *key) for key in verify_bounds} == verify_bounds
    assert {(kda, L, dt): wide_from(1, kda, L, dt) for kda in (False, True) for L in (8, 16, 32, 64)
            for dt in (f32, bf16, f16)} == {
        **{(kda, L, f32): 64 for kda in (False, True) for L in (8, 16)},
        **{(kda, L, dt): 80 for kda in (False, True) for L in (8, 16) for dt in (bf16, f16)},
        (False, 32, f32): 112, (True, 32, f32): None, (False, 32, bf16): 112, (True, 32, bf16): 192,
        (False, 32, f16): 112, (True, 32, f16): 192,
        **{(kda, 64, dt): None for kda in (False, True) for dt in (f32, bf16, f16)}}
    for history in (24, 128):  # no measured bound: refused, naming the histories served
        with pytest.raises(ValueError, match=f"replay history {history}: .* 8, 16, 32, 64"):
            output_tiling(64, 1, False, history, f32)


@pytest.mark.parametrize("family,d,state_dtype", [("gdn", 1, torch.float32), ("kda", 4, torch.bfloat16)])
def test_replay_verify_asks_for_the_tiling_of_its_launch(family, d, state_dtype, monkeypatch):
    """``replay_verify`` tiles its output launch by :func:`output_tiling` of its own request count, tokens per
    request, family, ring history and checkpoint dtype (the served choice is the one benchmarked)."""
    asked = []

    def spy(*args):
        asked.append(args)
        return NARROW_TILING

    monkeypatch.setattr(replay_verify_module, "output_tiling", spy)
    n, hk, hv, kdim, vdim, L = 3, 1, 2, 16, 16, 8
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, state_dtype, seed=81)
    ring = ReplayRing.allocate(n, L, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    call_replay_verify(params, x, family, n, d, pool.to(DEVICE), state_idx, ring, rec_idx)
    assert asked == [(n, d, family == "kda", L, state_dtype)]


def test_gdn_window_launches_are_served_per_key_head():
    """GDN's window launch runs a program per key head wherever there is one (two launches); KDA's per value head."""
    assert [served_window_key_heads(kda, launches) for kda in (False, True) for launches in (1, 2)] == [
        False, True, False, False]


def test_kda_windows_served_raw_keys_are_the_measured_rows(monkeypatch):
    """The window launch renormalises the history's raw keys for KDA in two launches at the rows of
    :data:`~.served.SERVED_WINDOW_RAW_KEYS` — a verify of 2 to 4 tokens at L <= 16, a decode and a verify of 2 tokens
    at L = 32 — and reads the normalised keys elsewhere: GDN, a decode at L <= 16, 3 to 4 tokens at L = 32, windows
    of 5 tokens or more (not timed), L = 64, one launch; and ``replay_verify`` launches what that says."""
    assert served_module.SERVED_WINDOW_RAW_KEYS == {("kda", 16, 2), ("kda", 16, 4), ("kda", 32, 1), ("kda", 32, 2)}
    chosen = {(kda, launches, L, T): served_module.served_window_raw_keys(launches, kda, L, T)
              for kda in (False, True) for launches in (1, 2) for L in (8, 16, 32, 64) for T in (1, 2, 3, 4, 5, 8)}
    assert {key for key, raw in chosen.items() if raw} == (
        {(True, 2, L, T) for L in (8, 16) for T in (2, 3, 4)} | {(True, 2, 32, 1), (True, 2, 32, 2)})
    seen = record_launches(monkeypatch, "RAW_KEYS", "replay_window_kernel")
    skip_launches(monkeypatch, "replay_output_kernel")
    for family, d, L, raw in (("kda", 2, 16, True), ("kda", 1, 16, False), ("kda", 4, 32, False),
                              ("kda", 1, 32, True), ("gdn", 4, 16, False)):
        n, hk, hv, kdim, vdim = 2, 1, 2, 16, 16
        params, x, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, torch.float32, seed=82)
        ring = ReplayRing.allocate(n, L, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
        call_replay_verify(params, x, family, n, d, pool.to(DEVICE), state_idx, ring,
                           torch.arange(n, dtype=torch.int32, device=DEVICE), launches=2)
        assert seen.pop() is raw, (family, d, L)



def test_kda_windows_read_the_history_a_block_at_a_time_where_measured(monkeypatch):
    """A served KDA window program reads the history a block of records a step after the window's tokens at the rows
    of :data:`~.served.SERVED_WINDOW_HISTORY_ROWS` — 4 for a decode at L <= 16, 2 for 3-4 tokens at L <= 16, 4 for
    3-4 tokens at L = 32 — on one warp at every L, and holds the whole history elsewhere (GDN, one launch, D = 2,
    L = 64, a decode at L = 32, 5 tokens or more) on :func:`~.served.served_window_warps`' warps;
    ``replay_verify`` launches what that says, and refuses a block read where no program per value head runs."""
    assert served_module.SERVED_WINDOW_HISTORY_ROWS == {("kda", 16, 1): 4, ("kda", 16, 4): 2, ("kda", 32, 4): 4}
    rows = {(kda, launches, L, T): served_module.served_window_history_rows(launches, kda, L, T)
            for kda in (False, True) for launches in (1, 2) for L in (8, 16, 32, 64) for T in (1, 2, 3, 4, 5, 8)}
    expected = {**{(True, 2, L, 1): 4 for L in (8, 16)}, **{(True, 2, L, T): 2 for L in (8, 16) for T in (3, 4)},
                **{(True, 2, 32, T): 4 for T in (3, 4)}}
    assert {key: hr for key, hr in rows.items() if hr} == expected
    assert [served_module.served_window_warps(L, 4, 4) for L in (16, 32, 64)] == [1, 1, 1]
    assert [served_module.served_window_warps(L, 1) for L in (16, 32, 64)] == [1, 2, 4]  # the whole history
    skip_launches(monkeypatch, "replay_output_kernel")
    for family, d, L, hr, warps in (("kda", 1, 16, 4, 1), ("kda", 4, 16, 2, 1), ("kda", 2, 16, 0, 1),
                                    ("kda", 4, 64, 0, 4), ("kda", 1, 64, 0, 4), ("kda", 3, 32, 4, 1),
                                    ("gdn", 4, 64, 0, 4)):
        n, hk, hv, kdim, vdim = 2, 1, 2, 16, 16
        params, x, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, torch.float32, seed=84)
        ring = ReplayRing.allocate(n, L, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
        for constant, want in (("HR", hr), ("num_warps", warps)):
            seen = record_launches(monkeypatch, constant, "replay_window_kernel")
            call_replay_verify(params, x, family, n, d, pool.to(DEVICE), state_idx, ring,
                               torch.arange(n, dtype=torch.int32, device=DEVICE), launches=2)
            assert seen == [want], (family, d, L, constant)
    for bad in (dict(launches=1), dict(launches=2, window_key_heads=True)):
        with pytest.raises(ValueError, match="window_history_rows"):
            call_replay_verify(params, x, "gdn", n, d, pool.to(DEVICE), state_idx, ring,
                               torch.arange(n, dtype=torch.int32, device=DEVICE), window_history_rows=2, **bad)
    with pytest.raises(ValueError, match="window_history_rows 3"):
        call_replay_verify(params, x, "gdn", n, d, pool.to(DEVICE), state_idx, ring,
                           torch.arange(n, dtype=torch.int32, device=DEVICE), window_history_rows=3, launches=2,
                           window_key_heads=False)


def test_kda_float32_verify_folds_its_tile_in_one_pass(monkeypatch):
    """A served fused fold advances ``FOLD_WARP_COLUMNS`` value columns a warp a pass, twice that (the wide tile's
    32 columns at once) for a KDA verify over a float32 checkpoint at L <= 16 — the rows of
    :data:`~.served.SERVED_ONE_PASS_FOLD` — and never more than the tile; ``replay_verify`` launches what that
    says (both tilings, decode and verify, both families and state dtypes)."""
    assert served_module.SERVED_ONE_PASS_FOLD == {("kda", 16, 4)}
    assert served_module.FOLD_WARP_COLUMNS == 16
    fold_block_v = served_module.served_fold_block_v
    for L in (8, 16):
        assert fold_block_v(32, 1, 2, True, L, torch.float32) == 32
        assert fold_block_v(32, 1, 4, True, L, torch.float32) == 32
        assert fold_block_v(16, 1, 4, True, L, torch.float32) == 16  # at most the tile
        assert fold_block_v(128, 2, 4, True, L, torch.float32) == 64
    for args in ((32, 1, 1, True, 16, torch.float32), (32, 1, 4, False, 16, torch.float32),
                 (32, 1, 4, True, 16, torch.bfloat16), (32, 1, 4, True, 32, torch.float32),
                 (32, 1, 2, True, 64, torch.float32), (128, 2, 4, False, 16, torch.float32)):
        assert fold_block_v(*args) == min(args[0], 16 * args[1]), args
    seen = record_launches(monkeypatch, "FBV", "replay_output_kernel", "replay_step_kernel")
    for family, d, state_dtype, tiling, fbv in (("kda", 2, torch.float32, WIDE_TILING, 32),
                                                ("kda", 4, torch.float32, WIDE_TILING, 32),
                                                ("kda", 4, torch.float32, NARROW_TILING, 16),
                                                ("kda", 1, torch.float32, WIDE_TILING, 16),
                                                ("kda", 4, torch.bfloat16, WIDE_TILING, 16),
                                                ("gdn", 4, torch.float32, WIDE_TILING, 16)):
        n, hk, hv, kdim, vdim = 2, 1, 2, 16, 64
        params, x, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, state_dtype, seed=83)
        ring = ReplayRing.allocate(n, 16, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
        block_v, num_warps, block_k, num_stages = tiling
        call_replay_verify(params, x, family, n, d, pool.to(DEVICE), state_idx, ring,
                           torch.arange(n, dtype=torch.int32, device=DEVICE), block_v=block_v, num_warps=num_warps,
                           block_k=min(block_k or kdim, kdim), num_stages=num_stages)
        assert seen.pop() == fbv, (family, d, state_dtype, tiling)

@pytest.mark.gpu
@pytest.mark.parametrize("family,d", [("gdn", 1), ("gdn", 4), ("kda", 1), ("kda", 4)])
def test_programmatic_dependent_launch_in_a_cuda_graph_changes_no_bit(family, d):
    """The output launch overlapping the window launch (``pdl=True``), captured in a CUDA graph as served and
    replayed round after round (40 requests: fold-first order, requests folding at different rounds; padding
    rows), against plain launches on the same inputs: outputs, checkpoints, every ring buffer and cursor bit
    for bit."""
    if not pdl_available(DEVICE):
        pytest.skip("programmatic dependent launch needs a CUDA device of compute capability 9.0 or newer")
    n, hk, hv, kdim, vdim, L = 40, 2, 4 if family == "gdn" else 2, 64, 64, 8
    params, _, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, torch.float32, seed=70 + d)
    gen = torch.Generator().manual_seed(71)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    real = (state_idx >= 0).to(DEVICE)
    # on the device before the capture: a host-to-device copy cannot be captured
    A_log, dt_bias, slots = params.A_log.to(DEVICE), params.dt_bias.to(DEVICE), state_idx.to(DEVICE)
    rounds = [(to_device(flat_inputs(random_inputs(family, n, d, hk, hv, kdim, vdim, gen, torch.bfloat16), family,
                                     n, d), DEVICE),
               torch.randint(0, d + 1, (n,), generator=gen).to(DEVICE).to(torch.int32) * real) for _ in range(2 * L)]
    results = []
    for pdl in (False, True):
        p = pool.to(DEVICE).clone()
        ring = ReplayRing.allocate(n, L, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
        ring.count.copy_(torch.arange(n, dtype=torch.int32, device=DEVICE) % L)  # folds spread over rounds
        inp = {name: t.clone() for name, t in rounds[0][0].items()}
        accepted = torch.zeros(n, dtype=torch.int32, device=DEVICE)

        def step():
            o = replay_verify(A_log, inp["a"], dt_bias, inp["q"], inp["k"], inp["v"], inp["b"], p, slots, ring,
                              rec_idx, is_kda=family == "kda", launches=2, pdl=pdl)
            advance(ring, rec_idx, accepted, window=d)
            return o

        warm = ring_snapshot(ring), p.clone()
        step()  # compile outside the capture, then restore
        torch.cuda.synchronize()
        for name, t in warm[0].items():
            ring.buffers()[name].copy_(t)
        p.copy_(warm[1])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o = step()
        outs = []
        for x, acc in rounds:
            for name, t in x.items():
                inp[name].copy_(t)
            accepted.copy_(acc)
            graph.replay()
            outs.append(o.clone())
        torch.cuda.synchronize()
        results.append((outs, p, ring.buffers()))
    (o0, p0, b0), (o1, p1, b1) = results
    assert all(torch.equal(a, b) for a, b in zip(o0, o1))
    assert torch.equal(p0, p1)
    for name, t in b0.items():
        assert torch.equal(t, b1[name]), name


def test_programmatic_dependent_launch_is_refused_where_it_cannot_run():
    """``pdl=True`` off a CUDA device of compute capability 9.0 (here: CPU tensors, also on the GPU machine)
    is a ValueError naming the fix, raised before any launch; the default there is two plain launches."""
    ring = ReplayRing.allocate(1, 2, 1, 1, 16, 16, False, torch.bfloat16)
    x = torch.zeros(1, 1, 1, 16)
    assert not pdl_available(x.device)
    with pytest.raises(ValueError, match="compute capability 9.0 or newer.*pdl=False"):
        replay_verify(torch.zeros(1), torch.zeros(1, 1), torch.zeros(1), x, x, x, torch.zeros(1, 1, 1),
                      torch.zeros(1, 1, 16, 16), torch.zeros(1, dtype=torch.int32), ring,
                      torch.zeros(1, dtype=torch.int32), is_kda=False, launches=2, pdl=True)


def test_window_larger_than_history_is_refused():
    ring = ReplayRing.allocate(1, 2, 1, 1, 16, 16, False, torch.bfloat16)
    x = torch.zeros(1, 3, 1, 16)
    with pytest.raises(ValueError, match="L >= D"):
        replay_verify(torch.zeros(1), torch.zeros(3, 1), torch.zeros(1), x, x, x, torch.zeros(1, 3, 1),
                      torch.zeros(1, 1, 16, 16), torch.zeros(1, dtype=torch.int32), ring,
                      torch.zeros(1, dtype=torch.int32), is_kda=False)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv", [("gdn", 16, 32), ("kda", 32, 32)])
@pytest.mark.parametrize("L,d,tiling", [(16, 1, "served"), (16, 4, "served"), (32, 1, "served"), (32, 2, "served"),
                                        (32, 4, "served"), (64, 4, "served"), (16, 1, "wide"), (16, 4, "wide"),
                                        (16, 1, "one"), (64, 4, "one"), (16, 4, "wide:one"), (16, 4, "otherkeys"),
                                        (64, 4, "otherkeys"), (16, 4, "wholehistory"), (64, 4, "blocks")])
def test_replay_real_shapes_against_float64(family, hk, hv, state_dtype, L, d, tiling):
    """Qwen3-Next / Kimi-Linear head shapes: 3·L/d rounds (several folds, fused into the verify launch)
    of verify + accept; outputs within bf16 output rounding of the float64 truth, materialised state
    within 1e-5 (float32) or bf16 rounding (bfloat16) of it; ``served`` at L 16 / 32 / 64: window programs of
    1 / 1 (a decode's: 2) / 4 warps (:func:`served_window_warps`), KDA's reading the history's raw keys for 2-4
    tokens at L = 16 and 1-2 at L = 32 (:data:`~.served.SERVED_WINDOW_RAW_KEYS`). ``wide``: the tiling served from
    40-64 requests (two K steps, two fold passes — KDA's float32 state one, :func:`~.served.served_fold_block_v` —
    3 stages) on these 9; ``one``: the one-launch kernel;
    ``otherkeys``: the window launch reading the history's keys the other way than served (``window_raw_keys``: raw
    where the normalised ones are served, :func:`~.served.served_window_raw_keys`, and the other way round);
    ``wholehistory`` / ``blocks``: the window program holding the whole history (KDA's served window at D = 4
    reads it 2 records a step at L = 16, :data:`~.served.SERVED_WINDOW_HISTORY_ROWS`) / reading it 4 records a step
    on one warp (at L = 64: not served there)."""
    n, kdim, vdim = 9, 128, 128
    tiling_options = dict(launches=1) if tiling.endswith("one") else {}
    if tiling == "otherkeys":
        tiling_options.update(launches=2, window_raw_keys=not served_module.served_window_raw_keys(2, family == "kda",
                                                                                                   L, d))
    if tiling in ("wholehistory", "blocks"):
        tiling_options.update(launches=2, window_history_rows=4 if tiling == "blocks" else 0,
                              window_key_heads=False)
    if tiling.startswith("wide"):
        tiling_options.update(zip(("block_v", "num_warps", "block_k", "num_stages"), WIDE_TILING))
    params, _, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, state_dtype, seed=46 + L + d)
    gen = torch.Generator().manual_seed(47)
    pool = pool.to(DEVICE)
    ring = ReplayRing.allocate(n, L, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    real = state_idx >= 0
    truth = pool[state_idx.clamp_min(0)].double().cpu()
    for _ in range(3 * L // d):
        x = random_inputs(family, n, d, hk, hv, kdim, vdim, gen, torch.bfloat16)
        o = call_replay_verify(params, x, family, n, d, pool, state_idx, ring, rec_idx, **tiling_options)
        o_ref, _ = chain_verify(truth, x, params, torch.float64)
        got = o.reshape(n, d, hv, vdim)[real.to(DEVICE)].double().cpu()
        assert torch.allclose(got, o_ref[real], rtol=2e-2, atol=2e-2)
        accepted = torch.randint(1, d + 1, (n,), generator=gen) * real
        advance(ring, rec_idx, accepted.to(DEVICE).to(torch.int32), window=d)
        for i in range(n):
            if accepted[i] > 0:
                row = LinearAttnInputs(*(t[i:i + 1, :int(accepted[i])] for t in (x.q, x.k, x.v, x.a, x.b)))
                truth[i] = decode(truth[i:i + 1], row, params, torch.float64)[1][0]
    mat = torch.zeros_like(pool)
    replay_fold(pool, state_idx.to(DEVICE), ring, rec_idx, torch.ones(n, dtype=torch.bool, device=DEVICE),
                is_kda=family == "kda", dst=mat, dst_indices=torch.arange(n, device=DEVICE))
    err = ((mat[:n][real.to(DEVICE)].double().cpu() - truth[real]).abs().max() / truth[real].abs().max()).item()
    assert err < (1e-5 if state_dtype == torch.float32 else 2e-2)
