"""Replay's write-through verify (``ops.replay.write_through``): speculative rounds of it, each followed by
replay's acceptance (the cursor moved by the accepted length), are SGLang 0.5.14's verify + scatter — outputs,
and the committed state one round later, bit for bit with either state dtype — its window's records are the
float64 reference's, its cursor is emptied exactly where it folded, and it interleaves with replay's
output-only verify."""

import pytest
import torch

from kernel_cases import (DEVICE, assert_same_bits, compiled_variants, flat_inputs, make_case, ring_snapshot,
                          sglang_native_round, to_device)

from sglang_ssm_modes.ops.replay import ReplayRing, advance, replay_fold, replay_verify, replay_write_through_verify
from sglang_ssm_modes.ops.replay import write_through as write_through_module
from sglang_ssm_modes.ops.replay.write_through import replay_write_through_kernel
from sglang_ssm_modes.reference import LinearAttnInputs, ReplayRecords, write_through_verify
from sglang_ssm_modes.reference.random_layer import random_inputs

CASES = [("gdn", 2, 4, 16, 40), ("kda", 2, 2, 16, 40), ("gdn", 1, 1, 32, 32)]  # V = 40: a part column tile
RECORDS = ("u", "k_norm", "g", "beta", "k_raw", "v_raw")


@pytest.fixture(params=[True, False], ids=["vk", "kv"])
def v_major(request, monkeypatch):
    """Each write-through tile orientation in turn (``[BV, K]`` as served, then ``[K, BV]``)."""
    monkeypatch.setattr(write_through_module, "WRITE_THROUGH_V_MAJOR", request.param)
    return request.param


def _verify(params, x, family, n, d, pool, state_idx, ring, rec_idx, through):
    """One verify of the case's inputs on ``DEVICE``: the write-through, or (``through`` false) replay's
    output-only verify with its fused fold."""
    inp = to_device(flat_inputs(x, family, n, d), DEVICE)
    call = replay_write_through_verify if through else replay_verify
    return call(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"], inp["b"],
                pool, state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda")


def _committed(pool, state_idx, ring, rec_idx, family):
    """The committed state of every request (checkpoint + history, materialised into a copy of the pool)."""
    out = pool.clone()
    replay_fold(pool, state_idx.to(DEVICE), ring, rec_idx, state_idx.to(DEVICE) >= 0, is_kda=family == "kda", dst=out,
                dst_indices=state_idx.to(DEVICE))
    return out


def _ring_records(buffers, slot, pos0, count):
    """``count`` records of ring slot ``slot`` from position ``pos0`` (``buffers``: a ring's, by name) as
    reference records of one request; None for none."""
    if not count:
        return None
    return ReplayRecords(*(buffers[name][slot:slot + 1, pos0:pos0 + count].cpu() for name in RECORDS))


def _assert_close_or_same(ours, native, exact, v_major):
    """:func:`kernel_cases.assert_same_bits` where ``exact`` (a state the write-through folded: on the CPU with the
    ``[BV, K]`` tile a bfloat16 pool may have one element in a thousand one ulp apart, a float32 sum either side of
    a rounding midpoint); else within a few bfloat16 roundings of the largest element (output-only rounds fold
    several rounds' records in one rounding where native rounded every round)."""
    if exact:
        assert_same_bits(ours, native, v_major, flips=ours.numel() // 1000)
    else:
        assert ((ours.double() - native.double()).abs() <= 2 ** -6 * native.double().abs().max()).all()


def _run_rounds(family, hk, hv, kdim, vdim, state_dtype, v_major, n, d, L, plan, seed, act_dtype=torch.bfloat16):
    """Rounds of verify + acceptance on a replay pool beside SGLang's native rounds on a copy; ``plan`` one
    bool per round (write-through or output-only); activations and the ring's raw records in ``act_dtype``.
    Checks every round; returns how many real requests folded inside a write-through."""
    kda = family == "kda"
    params, _, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, state_dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    native, ours = pool.to(DEVICE), pool.to(DEVICE).clone()
    ring = ReplayRing.allocate(n + 2, L, hk, hv, kdim, vdim, kda, act_dtype, DEVICE)
    rec_idx = torch.arange(2, n + 2, dtype=torch.int32, device=DEVICE)  # slots 0 and 1 belong to nobody
    rec_idx[state_idx.to(DEVICE) < 0] = -1  # as served: a padding row has neither slot
    real = [i for i in range(n) if state_idx[i] >= 0]
    slots = rec_idx[real].long()
    exact, folded = True, 0  # bit for bit with native: float32 state, or no output-only round so far
    for r, through in enumerate(plan):
        x = random_inputs(family, n, d, hk, hv, kdim, vdim, gen, act_dtype)
        last = torch.randint(-1, d, (n,), generator=gen)  # accepted lengths 0 .. D
        last[real[r % len(real)]] = (d - 1) if r % 2 else -1  # both ends in every run
        committed_before = native.clone()
        words = {name: getattr(ring, name).clone() for name in ("count", "phase", "folds")}
        before = ours.clone()
        snap = ring_snapshot(ring)
        got = _verify(params, x, family, n, d, ours, state_idx, ring, rec_idx, through)
        want, native = sglang_native_round(params, x, native, state_idx, last, family, n, d)
        if not through:
            exact = exact and state_dtype == torch.float32
        if through:
            had = words["count"][slots] > 0
            folded += int(had.sum())
            # the history folded into the checkpoint: native's state after the last round
            _assert_close_or_same(ours, committed_before, exact, v_major)
            if exact:
                assert_same_bits(got[0].view(n, d, hv, vdim)[real], want[0].view(n, d, hv, vdim)[real], v_major)
            assert (ring.count[slots] == 0).all() and (ring.tickets == 0).all()
            assert torch.equal(ring.phase[slots], torch.where(had, 1 - words["phase"][slots], words["phase"][slots]))
            assert torch.equal(ring.folds[slots], words["folds"][slots] + had.to(torch.int32))
            others = [s for s in range(n + 2) if s not in slots.tolist()]
            for name in RECORDS + ("count", "phase", "folds", "faults"):
                assert torch.equal(getattr(ring, name)[others], snap[name][others]), name
            for j, i in enumerate(real):  # the window's records against the float64 reference
                s, rs = int(state_idx[i]), int(slots[j])
                pos0 = int(ring.phase[rs]) * L
                history = _ring_records(snap, rs, int(words["phase"][rs]) * L, int(words["count"][rs]))
                row = LinearAttnInputs(*(t[i:i + 1] for t in (x.q, x.k, x.v, x.a, x.b)))
                o_ref, rec_ref, h_ref = write_through_verify(before[s:s + 1].cpu(), history, row, params,
                                                             torch.float64)
                assert ((ours[s].double().cpu() - h_ref[0].double()).abs()
                        <= 2 ** -7 * h_ref[0].double().abs() + 1e-6).all(), "the fold: one rounding apart"
                if state_dtype != torch.float32:  # a bfloat16 ulp of the fold moves u by more: from our checkpoint
                    o_ref, rec_ref, _ = write_through_verify(ours[s:s + 1].cpu(), None, row, params, torch.float64)
                rec = _ring_records(ring.buffers(), rs, pos0, d)
                assert torch.equal(rec.k_raw, row.k) and torch.equal(rec.v_raw, row.v)
                for name in ("u", "k_norm", "g", "beta"):
                    torch.testing.assert_close(getattr(rec, name).double(), getattr(rec_ref, name).double(),
                                               rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(got[0, i * d:(i + 1) * d].double().cpu(), o_ref[0], rtol=2e-2, atol=2e-2)
        else:
            torch.testing.assert_close(got[0].view(n, d, hv, vdim)[real].float(),
                                       want[0].view(n, d, hv, vdim)[real].float(), rtol=2e-2, atol=2e-2)
        advance(ring, rec_idx, (last + 1).to(torch.int32).to(DEVICE), window=d)
        _assert_close_or_same(_committed(ours, state_idx, ring, rec_idx, family), native, exact, v_major)
        assert (ring.count[slots] <= L).all() and (ring.faults == 0).all()
    unused = [s for s in range(pool.shape[0]) if s not in state_idx[real].tolist()]
    assert torch.equal(ours[unused], pool.to(DEVICE)[unused]), "other slots untouched"
    return folded


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv,kdim,vdim", CASES)
def test_write_through_rounds_are_sglangs_verify_and_scatter(family, hk, hv, kdim, vdim, state_dtype, v_major):
    """Five rounds of write-through verify + acceptance (accepted lengths 0 .. D, a padding row, odd batch)
    against SGLang's verify + masked scatter: outputs of real rows bit for bit, the checkpoint after each
    write-through native's committed state of the round before, the committed state (checkpoint + accepted
    records) native's after every round — either state dtype, either tile; the cursor emptied exactly where it
    folded, every ticket taken back, records of the window the float64 reference's, other slots untouched."""
    folded = _run_rounds(family, hk, hv, kdim, vdim, state_dtype, v_major, n=5, d=3, L=4, plan=[True] * 5, seed=101)
    assert folded >= 6, "write-throughs that folded a history"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv,kdim,vdim", CASES[:2])
def test_write_through_and_output_only_verify_interleave(family, hk, hv, kdim, vdim, state_dtype):
    """A server switches between the two verify paths as its batch crosses the bound: output-only rounds (their
    fused folds included) leave histories a write-through folds, and write-throughs leave histories the
    output-only verify reads — outputs agree with native to rounding, committed states bit for bit (float32;
    bfloat16 within a rounding where output-only rounds folded several rounds at once)."""
    plan = [False, True, False, False, True, True, False, True]
    folded = _run_rounds(family, hk, hv, kdim, vdim, state_dtype, True, n=7, d=2, L=4, plan=plan, seed=111)
    assert folded >= 8


def test_a_window_longer_than_the_history_or_uneven_is_refused():
    """``T > L`` (the window's records would not fit a half of the ring) and a token count that does not split
    over the requests fail before any launch, naming the problem."""
    family, hk, hv, kdim, vdim = "gdn", 1, 2, 16, 16
    params, x, pool, state_idx = make_case(family, 2, 5, hk, hv, kdim, vdim, torch.float32, seed=121)
    ring = ReplayRing.allocate(2, 4, hk, hv, kdim, vdim, False, torch.bfloat16, DEVICE)
    idx = torch.arange(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit a replay history of 4"):
        _verify(params, x, family, 2, 5, pool.to(DEVICE), state_idx, ring, idx, True)
    inp = to_device(flat_inputs(x, family, 2, 5), DEVICE)
    with pytest.raises(ValueError, match="do not split evenly"):
        replay_write_through_verify(params.A_log.to(DEVICE), inp["a"][:9], params.dt_bias.to(DEVICE), inp["q"][:, :9],
                                    inp["k"][:, :9], inp["v"][:, :9], inp["b"][:, :9], pool.to(DEVICE),
                                    state_idx.to(DEVICE), ring, idx, is_kda=False)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv", [("gdn", 16, 32), ("kda", 32, 32)])
def test_write_through_rounds_at_real_shapes_on_the_gpu(family, hk, hv, state_dtype):
    """Qwen3-Next / Kimi-Linear head shapes (K = V = 128), D = 4, L = 16, 7 and 33 requests: four rounds each,
    everything :func:`test_write_through_rounds_are_sglangs_verify_and_scatter` checks, bit for bit on the
    GPU with the served tile (real concurrency for the tickets: 256 programs a request)."""
    for n in (7, 33):
        folded = _run_rounds(family, hk, hv, 128, 128, state_dtype, True, n=n, d=4, L=16, plan=[True] * 4,
                             seed=130 + n)
        assert folded > 0


@pytest.mark.gpu
def test_request_counts_1_to_511_compile_the_write_through_verify_once():
    """The write-through verify takes no request count: 1..511 requests of a 3-token window compile it once (a
    head shape no other test uses)."""
    n_max, d, hk, hv, kdim, vdim = 511, 3, 1, 3, 32, 24
    params, x, pool, _ = make_case("gdn", n_max, d, hk, hv, kdim, vdim, torch.float32, seed=141)
    inp = to_device(flat_inputs(x, "gdn", n_max, d), DEVICE)
    pool = pool.to(DEVICE)
    ring = ReplayRing.allocate(n_max, 8, hk, hv, kdim, vdim, False, torch.bfloat16, DEVICE)
    idx = torch.arange(n_max, dtype=torch.int32, device=DEVICE)
    before = compiled_variants(replay_write_through_kernel)
    for n in range(1, n_max + 1):
        replay_write_through_verify(params.A_log.to(DEVICE), inp["a"][:n * d], params.dt_bias.to(DEVICE),
                                    inp["q"][:, :n * d], inp["k"][:, :n * d], inp["v"][:, :n * d],
                                    inp["b"][:, :n * d], pool, idx[:n], ring, idx[:n], is_kda=False)
    torch.cuda.synchronize()
    assert compiled_variants(replay_write_through_kernel) - before == 1


@pytest.mark.parametrize("family,hk,hv,kdim,vdim", CASES[:2])
def test_prefetching_draft_inputs_changes_no_bit(family, hk, hv, kdim, vdim):
    """``prefetch=True`` loads each draft token's inputs one step ahead (the first while the fold runs) instead of
    at the top of its step (served): over rounds that fold accepted histories, outputs, checkpoints and every ring
    word are the same bits."""
    n, d, L = 5, 3, 4
    kda = family == "kda"
    params, _, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, torch.float32, seed=77)
    gen = torch.Generator().manual_seed(78)
    pools = [pool.to(DEVICE), pool.to(DEVICE).clone()]
    rings = [ReplayRing.allocate(n, L, hk, hv, kdim, vdim, kda, torch.bfloat16, DEVICE) for _ in range(2)]
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    rec_idx[state_idx.to(DEVICE) < 0] = -1
    folds = 0
    for _ in range(3):
        x = random_inputs(family, n, d, hk, hv, kdim, vdim, gen, torch.bfloat16)
        inp = to_device(flat_inputs(x, family, n, d), DEVICE)
        accepted = torch.randint(1, d + 1, (n,), generator=gen).to(torch.int32).to(DEVICE)
        outs = []
        for prefetch, p, ring in zip((True, False), pools, rings):
            outs.append(replay_write_through_verify(
                params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"], inp["b"],
                p, state_idx.to(DEVICE), ring, rec_idx, is_kda=kda, prefetch=prefetch))
            advance(ring, rec_idx, accepted, window=d)
        assert torch.equal(outs[0], outs[1]) and torch.equal(pools[0], pools[1])
        snaps = [ring_snapshot(ring) for ring in rings]
        for name in snaps[0]:
            assert torch.equal(snaps[0][name], snaps[1][name]), name
        folds = int(rings[0].folds.sum())
    assert folds >= 2 * (n - 1), "the later rounds folded the accepted records"
