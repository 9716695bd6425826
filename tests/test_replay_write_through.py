"""Replay's write-through decode (``ops.replay.write_through``): SGLang 0.5.14's decode bit for bit from an empty
history, the pending history folded first otherwise (against SGLang's decode of every token, float32 bit for
bit, and the float64 reference), the cursor emptied by the last program to read it, switching freely with
the output-only path, and the served choice between the two."""

import pytest
import torch
import triton

from interpreter_shims import sglang_fla_on_cpu
from kernel_cases import (DEVICE, assert_same_bits, compiled_variants, flat_inputs, make_case, ring_snapshot,
                          sglang_decode, sglang_packed_decode, to_device, ulps)

from sglang_ssm_modes.ops.replay import (FAULT_NONFINITE, ReplayRing, clear_history, replay_decode, replay_fold,
                                         replay_write_through, replay_write_through_verify)
from sglang_ssm_modes.ops.replay import write_through as write_through_module
from sglang_ssm_modes.ops.replay.served import (WRITE_THROUGH_BELOW, serves_write_through, serves_write_through_verify,
                                                write_through_block_v, write_through_max_requests)
from sglang_ssm_modes.ops.replay.write_through import replay_write_through_kernel
from sglang_ssm_modes.reference import LinearAttnInputs, replay_forward, write_through
from sglang_ssm_modes.reference.random_layer import random_inputs

CASES = [("gdn", 2, 4, 16, 40), ("kda", 2, 2, 16, 40), ("gdn", 1, 1, 32, 32)]  # V = 40: a part column tile
RECORDS = ("u", "k_norm", "g", "beta", "k_raw", "v_raw")


def _decode(params, x, family, n, pool, state_idx, ring, rec_idx, write_through, round_beta=False):
    inp = to_device(flat_inputs(x, family, n, 1), DEVICE)
    return replay_decode(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                         inp["b"], pool, state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda",
                         write_through=write_through, round_beta=round_beta)


@pytest.fixture(params=[True, False], ids=["vk", "kv"])
def v_major(request, monkeypatch):
    """Each write-through tile orientation in turn (``[BV, K]`` as served, then ``[K, BV]``)."""
    monkeypatch.setattr(write_through_module, "WRITE_THROUGH_V_MAJOR", request.param)
    return request.param


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv,kdim,vdim", CASES)
def test_write_through_is_sglang_decode_bit_for_bit(family, hk, hv, kdim, vdim, state_dtype, v_major):
    """From an empty history a write-through is SGLang's decode: outputs of real rows and the whole pool bit
    for bit (:func:`kernel_cases.assert_same_bits`: the one allowance is float32 with the ``[BV, K]`` tile on the
    CPU interpreter, one epsilon of the largest element), token after token, with either state dtype and either
    tile; the ring is not touched (no record, no cursor word)."""
    n, tokens = 5, 3
    params, _, pool, state_idx = make_case(family, n, tokens, hk, hv, kdim, vdim, state_dtype, seed=71)
    x_all = random_inputs(family, n, tokens, hk, hv, kdim, vdim, torch.Generator().manual_seed(72), torch.bfloat16)
    native, ours = pool.to(DEVICE), pool.to(DEVICE).clone()
    ring = ReplayRing.allocate(n + 1, 4, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
    rec_idx = torch.arange(1, n + 1, dtype=torch.int32, device=DEVICE)
    before = ring_snapshot(ring)
    real = (state_idx >= 0).to(DEVICE)
    for t in range(tokens):
        x = x_all.tokens(t, t + 1)
        want = sglang_decode(params, x, native, state_idx, family, n)
        got = _decode(params, x, family, n, ours, state_idx, ring, rec_idx, write_through=True)
        assert torch.equal(got[0][real], want[0][real]), t
        assert_same_bits(ours, native, v_major)
    assert all(torch.equal(before[name], buf) for name, buf in ring.buffers().items())


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv,kdim,vdim", CASES)
def test_write_through_is_sglangs_packed_decode_as_served(family, hk, hv, kdim, vdim, state_dtype):
    """As the backend hook serves it (GDN: beta rounded to b's dtype, ``round_beta``), a write-through from an
    empty history is the decode SGLang runs on CUDA, its packed kernel (beta from ``tl.sigmoid``), to float32
    rounding on the CPU interpreter (whose NumPy sums differ between the two SGLang kernels by 1-2 ulps; on the
    GPU bit for bit: the real-shapes test below); without the rounded beta the GDN states differ by ~1e-2."""
    n, tokens = 5, 2
    params, _, pool, state_idx = make_case(family, n, tokens, hk, hv, kdim, vdim, state_dtype, seed=79)
    x_all = random_inputs(family, n, tokens, hk, hv, kdim, vdim, torch.Generator().manual_seed(80), torch.bfloat16)
    native, ours = pool.to(DEVICE), pool.to(DEVICE).clone()
    ring = ReplayRing.allocate(n, 4, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    real = (state_idx >= 0).to(DEVICE)
    for t in range(tokens):
        x = x_all.tokens(t, t + 1)
        with sglang_fla_on_cpu():  # its `exp` alias, under the interpreter (a no-op elsewhere)
            want = sglang_packed_decode(params, x, native, state_idx, family, n)
        got = _decode(params, x, family, n, ours, state_idx, ring, rec_idx, write_through=True,
                      round_beta=family == "gdn")
        torch.testing.assert_close(got[0][real].float(), want[:, 0][real].float(), rtol=1e-2, atol=1e-5)
        assert ((ours.float() - native.float()).abs() <= 1e-6 * native.float().abs().max()).all(), t


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv,kdim,vdim", CASES[:2])
def test_write_through_folds_the_pending_history_first(family, hk, hv, kdim, vdim, state_dtype, v_major):
    """Requests with 0 .. L records (output-only decodes of subsets of the batch, one folding on the way), then
    steps that switch between write-through and output-only. Per write-through: the history folded and the
    token applied in one launch — float32: SGLang's decode of every token so far, outputs and state bit for
    bit (:func:`kernel_cases.assert_same_bits`), either tile; either dtype: the float64 reference (fold, then the
    token, rounded once) within a rounding — and the cursor emptied (count 0; phase flipped and one more fold
    counted where there were records; nothing changed where there were none), records and faults untouched,
    padding rows and other slots untouched."""
    n, L, kda = 6, 4, family == "kda"
    params, _, pool, state_idx = make_case(family, n, 1, hk, hv, kdim, vdim, state_dtype, seed=73)
    gen = torch.Generator().manual_seed(74)
    native, ours = pool.to(DEVICE), pool.to(DEVICE).clone()
    ring = ReplayRing.allocate(n + 2, L, hk, hv, kdim, vdim, kda, torch.bfloat16, DEVICE)
    rec_idx = torch.arange(2, n + 2, dtype=torch.int32, device=DEVICE)  # slots 0 and 1 belong to nobody
    real = state_idx >= 0  # row 3 is padding
    everyone = list(range(n))
    plan = [([0, 1, 2, 4], False), ([0, 1, 2, 4], False), ([0, 1, 2], False), ([0, 2], False), ([0], False),
            ([0, 1, 2], False), (everyone, True), ([1, 2], False), (everyone, True), (everyone, True),
            ([0, 4], False), (everyone, True)]  # (rows of the batch, write-through)
    pending = {i: [] for i in everyone}  # each request's tokens since its checkpoint
    mixed = 0
    for rows, through in plan:
        sel = torch.tensor(rows)
        x = random_inputs(family, len(rows), 1, hk, hv, kdim, vdim, gen, torch.bfloat16)
        want = sglang_decode(params, x, native, state_idx[sel], family, len(rows))
        words = {name: getattr(ring, name).clone() for name in ("count", "phase", "folds")}
        checkpoints = ours.clone()
        snap = ring_snapshot(ring)
        got = _decode(params, x, family, len(rows), ours, state_idx[sel], ring, rec_idx[sel.to(DEVICE)], through)
        live = [j for j, i in enumerate(rows) if real[i]]
        if not through:  # a record each; a full history was folded first
            for j in live:
                i = rows[j]
                pending[i] = (pending[i] if len(pending[i]) < L else []) + [_row(x, j)]
            continue
        slots = rec_idx[[rows[j] for j in live]].long()
        had = words["count"][slots] > 0
        mixed += bool(had.any() and not had.all())
        assert (ring.count[slots] == 0).all()
        assert torch.equal(ring.phase[slots], torch.where(had, 1 - words["phase"][slots], words["phase"][slots]))
        assert torch.equal(ring.folds[slots], words["folds"][slots] + had.to(torch.int32))
        others = [s for s in range(n + 2) if s not in slots.tolist()]
        assert all(torch.equal(getattr(ring, name)[others], old[others]) for name, old in words.items())
        assert all(torch.equal(snap[name], getattr(ring, name)) for name in RECORDS + ("faults",))
        assert (ring.tickets == 0).all(), "every ticket taken back"
        if state_dtype == torch.float32:
            assert torch.equal(got[0, live], want[0, live])
            assert_same_bits(ours, native, v_major)
        for j in live:  # the reference from the same checkpoint: one rounding apart
            i, s = rows[j], int(state_idx[rows[j]])
            o_ref, h_ref = write_through(checkpoints[s:s + 1].cpu(), _records(pending[i], params), _row(x, j), params,
                                         torch.float64)
            pending[i] = []
            want_h = h_ref[0].double()
            if state_dtype == torch.float32:
                assert (ours[s].double().cpu() - want_h).abs().max() <= 1e-5 * want_h.abs().max()
            else:  # within one bfloat16 ulp of the float64 result's rounding
                assert ((ours[s].double().cpu() - want_h).abs() <= 2 ** -7 * want_h.abs() + 1e-6).all()
            assert torch.allclose(got[0, j].double().cpu(), o_ref[0, 0], rtol=2e-2, atol=2e-2)
    assert mixed >= 2, "write-throughs of requests with and without records in one batch"
    unused = [s for s in range(pool.shape[0]) if s not in state_idx[real].tolist()]
    assert torch.equal(ours[unused], pool.to(DEVICE)[unused])


def _row(x, j):
    """Request ``j``'s inputs of a batch (``[1, T, ...]``)."""
    return LinearAttnInputs(*(t[j:j + 1] for t in (x.q, x.k, x.v, x.a, x.b)))


def _records(tokens, params):
    """The reference's history records of one request's ``tokens`` (a list of one-token inputs; the fold
    reads their raw k and v, g and beta, not u): none for an empty list."""
    if not tokens:
        return None
    x = LinearAttnInputs(*(torch.cat([getattr(t, f) for t in tokens], 1) for f in ("q", "k", "v", "a", "b")))
    return replay_forward(torch.zeros(1, x.v.shape[2], x.v.shape[3], x.k.shape[3], dtype=torch.float64), None, x,
                          params, torch.float64)[1]


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's sums over an infinity
@pytest.mark.parametrize("family,hk,hv,kdim,vdim", CASES[:2])
def test_a_folded_non_finite_state_is_flagged_as_a_fold_flags_it(family, hk, hv, kdim, vdim):
    """A write-through that folds a record holding an infinity writes the non-finite state (as native would)
    and sets FAULT_NONFINITE on that request's slot only; one without records checks nothing (SGLang's decode
    does not either)."""
    n = 3
    params, x, pool, _ = make_case(family, n, 2, hk, hv, kdim, vdim, torch.float32, seed=75)
    state_idx = torch.tensor([4, 0, 2])
    pool = pool.to(DEVICE)
    ring = ReplayRing.allocate(n, 4, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    _decode(params, x.tokens(0, 1), family, n, pool, state_idx, ring, rec_idx, write_through=False)
    ring.v_raw[0, 0, 0, 0] = float("inf")  # request 0's record
    step = x.tokens(1, 2)
    step.v[2, 0, 0, 0] = float("inf")  # request 2's token, no history: not a fold
    ring.count[2] = 0
    _decode(params, step, family, n, pool, state_idx, ring, rec_idx, write_through=True)
    assert ring.faults.tolist() == [FAULT_NONFINITE, 0, 0]
    assert not torch.isfinite(pool[4]).all() and not torch.isfinite(pool[2]).all() and torch.isfinite(pool[0]).all()


def test_output_only_decode_leaves_a_record_and_write_through_none():
    """``replay_decode(write_through=False)`` is the output-only path (a record appended, count + 1, checkpoint
    unchanged); both paths give the same outputs to float32 rounding and the same committed state."""
    family, hk, hv, kdim, vdim, n = "gdn", 2, 4, 16, 32, 3
    params, x, pool, _ = make_case(family, n, 1, hk, hv, kdim, vdim, torch.float32, seed=76)
    state_idx = torch.tensor([1, 3, 5])
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    out, pools, rings = {}, {}, {}
    for through in (False, True):
        pools[through] = pool.to(DEVICE).clone()
        rings[through] = ReplayRing.allocate(n, 4, hk, hv, kdim, vdim, False, torch.bfloat16, DEVICE)
        out[through] = _decode(params, x, family, n, pools[through], state_idx, rings[through], rec_idx, through)
    assert rings[False].count.tolist() == [1, 1, 1] and rings[True].count.tolist() == [0, 0, 0]
    assert torch.equal(pools[False], pool.to(DEVICE)) and not torch.equal(pools[True], pool.to(DEVICE))
    torch.testing.assert_close(out[False], out[True], rtol=1e-5, atol=1e-5)
    replay_fold(pools[False], state_idx.to(DEVICE), rings[False], rec_idx, torch.ones(n, dtype=torch.bool,
                device=DEVICE), is_kda=False)
    assert torch.equal(pools[False], pools[True])


def test_the_served_choice_between_write_through_and_output_only():
    """Write-through below the measured crossover (float32: GDN 32 requests at L <= 16, 40 at L = 32, 112 at
    L = 64, KDA 40 at L <= 16, 64 at L = 32; 2-byte states: GDN 80 at L <= 16, 112 at L = 32, KDA 128 at L <= 16),
    at every batch where output-only decode was slower than it everywhere measured (float32: KDA L = 64; 2-byte
    states: KDA L = 32, GDN and KDA L = 64); a history shorter than 16 takes L = 16's bound."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert [serves_write_through(n, False, 16, f32) for n in (1, 16, 31, 32, 256)] == [True] * 3 + [False] * 2
    assert [serves_write_through(n, True, 16, f32) for n in (39, 40)] == [True, False]
    assert [serves_write_through(n, False, 8, f32) for n in (31, 32)] == [True, False]
    assert [serves_write_through(n, False, 32, f32) for n in (39, 40)] == [True, False]
    assert [serves_write_through(n, False, 64, f32) for n in (111, 112)] == [True, False]
    assert [serves_write_through(n, True, 32, f32) for n in (63, 64)] == [True, False]
    assert all(serves_write_through(n, True, 64, f32) for n in (1, 511))
    assert [serves_write_through(n, False, L, dt) for L in (8, 16) for dt in (bf16, f16)
            for n in (79, 80)] == [True, False] * 4
    assert [serves_write_through(n, True, L, dt) for L in (8, 16) for dt in (bf16, f16)
            for n in (127, 128)] == [True, False] * 4
    assert [serves_write_through(n, False, 32, dt) for dt in (bf16, f16) for n in (111, 112)] == [True, False] * 2
    assert all(serves_write_through(511, kda, L, dt) for kda, L in ((True, 32), (False, 64), (True, 64))
               for dt in (bf16, f16))
    assert write_through_max_requests(False, 16, f32) == 31 and write_through_max_requests(True, 64, f32) is None
    assert write_through_max_requests(True, 16, bf16) == 127 and write_through_max_requests(False, 16, bf16) == 79
    assert set(WRITE_THROUGH_BELOW) == {(f, L, b) for f in ("gdn", "kda") for L in (16, 32, 64) for b in (4, 2)}


def test_the_served_choice_of_a_chain_verify():
    """A chain verify writes through below the measured crossover: 32 requests at L <= 16, at L = 32 40 (GDN) or 64
    (KDA) with a float32 state and 32 (GDN) or 96 (KDA) with a 2-byte one, at L = 64 96 (float32) or 128 (2-byte)
    for GDN, every batch for KDA at L = 64."""
    f32, bf16 = torch.float32, torch.bfloat16
    bounds = {(kda, L, dt): next((n for n in range(1, 512) if not serves_write_through_verify(n, kda, L, dt)), None)
              for kda in (False, True) for L in (8, 16, 32, 64) for dt in (f32, bf16)}
    assert bounds == {**{(kda, L, dt): 32 for kda in (False, True) for L in (8, 16) for dt in (f32, bf16)},
                      (False, 32, f32): 40, (True, 32, f32): 64, (False, 32, bf16): 32, (True, 32, bf16): 96,
                      (False, 64, f32): 96, (False, 64, bf16): 128, (True, 64, f32): None, (True, 64, bf16): None}


def test_the_served_write_through_tile(monkeypatch):
    """Value columns a write-through program takes as served: 8 for a KDA decode with a float32 state, 16 for a
    GDN one, a 2-byte state and every verify — and both launches ask for them (the grid's column blocks)."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    cases = [(kda, dt, draft) for kda in (False, True) for dt in (f32, bf16, f16) for draft in (False, True)]
    assert {case: write_through_block_v(*case) for case in cases} == {**dict.fromkeys(cases, 16), (True, f32, False): 8}
    launched = []

    class Spy:  # the kernel's launch: records its grid and BV instead of running
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((grid[0], kw["BV"]))

    monkeypatch.setattr(write_through_module, "replay_write_through_kernel", Spy())
    hk, hv, kdim, vdim, n = 2, 2, 16, 32, 3
    for family, state_dtype in (("kda", f32), ("kda", bf16), ("gdn", f32)):
        for d, launch in ((1, replay_write_through), (2, replay_write_through_verify)):
            params, x, pool, _ = make_case(family, n, d, hk, hv, kdim, vdim, state_dtype, seed=86)
            inp = to_device(flat_inputs(x, family, n, d), DEVICE)
            ring = ReplayRing.allocate(n, 4, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
            idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
            launch(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                   inp["b"], pool.to(DEVICE), idx, ring, idx, is_kda=family == "kda")
    assert launched == [(4, 8), (2, 16), (2, 16), (2, 16), (2, 16), (2, 16)]


def test_bad_calls_are_refused():
    """Two tokens per request, or output-only keywords given to a write-through, are errors naming the rule."""
    family, hk, hv, kdim, vdim, n = "gdn", 1, 1, 16, 16, 2
    params, x, pool, _ = make_case(family, n, 2, hk, hv, kdim, vdim, torch.float32, seed=77)
    ring = ReplayRing.allocate(n, 4, hk, hv, kdim, vdim, False, torch.bfloat16, DEVICE)
    idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    inp = to_device(flat_inputs(x, family, n, 2), DEVICE)
    args = (params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"], inp["b"],
            pool.to(DEVICE), idx, ring, idx)
    with pytest.raises(ValueError, match="one token per request"):
        replay_write_through(*args, is_kda=False)
    one = to_device(flat_inputs(x.tokens(0, 1), family, n, 1), DEVICE)
    args = (params.A_log.to(DEVICE), one["a"], params.dt_bias.to(DEVICE), one["q"], one["k"], one["v"], one["b"],
            pool.to(DEVICE), idx, ring, idx)
    with pytest.raises(ValueError, match="not of a write-through"):
        replay_decode(*args, is_kda=False, write_through=True, block_v=16)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv", [("gdn", 16, 32), ("kda", 32, 32)])
def test_write_through_at_real_shapes_on_the_gpu(family, hk, hv, state_dtype, v_major):
    """Qwen3-Next / Kimi-Linear head shapes (K = V = 128), 2, 7, 33 and 200 requests (a padding row each),
    histories of 0 .. L records: after a write-through, float32 state and outputs are SGLang's generic decode of
    the same tokens bit for bit (bfloat16: within one ulp of the float64 reference, per request), every real
    cursor is empty with the phase flipped and a fold counted exactly where it held records, every ticket taken
    back (the tickets under real concurrency: 256 programs a request); the state also SGLang's packed decode's as
    served (GDN beta rounded) bit for bit, the outputs to bfloat16 rounding. Either tile orientation."""
    kdim = vdim = 128
    L, kda = 16, family == "kda"
    for n in (2, 7, 33, 200):
        params, _, pool, state_idx = make_case(family, n, 1, hk, hv, kdim, vdim, state_dtype, seed=80 + n)
        gen = torch.Generator().manual_seed(90 + n)
        native, ours = pool.to(DEVICE), pool.to(DEVICE).clone()
        ring = ReplayRing.allocate(n, L, hk, hv, kdim, vdim, kda, torch.bfloat16, DEVICE)
        real = state_idx >= 0
        rec_idx = torch.where(real, torch.arange(n), -1).to(torch.int32).to(DEVICE)  # padding: -1 in both
        pending = {i: [] for i in range(n)}
        for step in range(L):  # request i takes part in the first i % (L + 1) output-only steps: 0 .. L records
            rows = [i for i in range(n) if i % (L + 1) > step]
            if not rows:
                break
            sel = torch.tensor(rows)
            x = random_inputs(family, len(rows), 1, hk, hv, kdim, vdim, gen, torch.bfloat16)
            sglang_decode(params, x, native, state_idx[sel], family, len(rows))
            _decode(params, x, family, len(rows), ours, state_idx[sel], ring, rec_idx[sel.to(DEVICE)], False)
            for j, i in enumerate(rows):
                pending[i].append(_row(x, j))
        checkpoints, phases, folds = ours.clone(), ring.phase.clone(), ring.folds.clone()
        x = random_inputs(family, n, 1, hk, hv, kdim, vdim, gen, torch.bfloat16)
        packed = native.clone()
        want_packed = sglang_packed_decode(params, x, packed, state_idx, family, n)
        want = sglang_decode(params, x, native, state_idx, family, n)
        served = ours.clone()
        ring_served = ReplayRing(**ring_snapshot(ring))
        got = _decode(params, x, family, n, ours, state_idx, ring, rec_idx, write_through=True)
        got_served = _decode(params, x, family, n, served, state_idx, ring_served, rec_idx, write_through=True,
                             round_beta=not kda)
        torch.cuda.synchronize()
        had = torch.tensor([i % (L + 1) > 0 for i in range(n)], device=DEVICE) & real.to(DEVICE)
        assert (ring.count == 0).all() and (ring.tickets == 0).all()  # a padding row's slot is never touched
        assert torch.equal(ring.phase, torch.where(had, 1 - phases, phases))
        assert torch.equal(ring.folds, folds + had.to(torch.int32))
        diffs = dict(generic=ulps(ours, native), packed=ulps(served, packed))
        print(f"{n} requests: ulps against SGLang's decode kernels {diffs}")  # shown by -rA
        if state_dtype == torch.float32:
            assert torch.equal(got[0, real.to(DEVICE)], want[0, real.to(DEVICE)]) and torch.equal(ours, native), diffs
            assert torch.equal(served, packed), diffs
            torch.testing.assert_close(got_served[0, real.to(DEVICE)].float(), want_packed[real.to(DEVICE), 0].float(),
                                       rtol=1e-2, atol=1e-5)
        else:
            for i in [i for i in range(n) if real[i]][:8]:
                s = int(state_idx[i])
                _, h_ref = write_through(checkpoints[s:s + 1].cpu(), _records(pending[i], params), _row(x, i),
                                         params, torch.float64)
                assert ((ours[s].double().cpu() - h_ref[0].double()).abs()
                        <= 2 ** -7 * h_ref[0].double().abs() + 1e-6).all(), (n, i)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_a_batch_repeating_one_slot_leaves_valid_cursor_words(rows):
    """CUDA-graph capture runs every row of a batch on one dummy slot. A write-through of such a batch, its slot
    holding records, leaves whatever state the rows race to (the dummy's) but cursor words a cursor can hold:
    count in 0..L, phase 0 or 1, tickets below rows x programs (on the GPU the rows' programs interleave; the
    interpreter runs them in turn) — so no later launch reads past the ring — and a cleared slot serves again."""
    family, hk, hv, kdim, vdim, L = "gdn", 1, 2, 16, 64, 4
    params, x, pool, _ = make_case(family, rows, 2, hk, hv, kdim, vdim, torch.float32, seed=78)
    pool = pool.to(DEVICE)
    ring = ReplayRing.allocate(2, L, hk, hv, kdim, vdim, False, torch.bfloat16, DEVICE)
    same = torch.zeros(rows, dtype=torch.int32)
    rec = same.to(DEVICE)
    _decode(params, _row(x.tokens(0, 1), 0), family, 1, pool, same[:1], ring, rec[:1], write_through=False)
    ring.count[0] = L  # a full history
    _decode(params, x.tokens(1, 2), family, rows, pool, same, ring, rec, write_through=True)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    programs = hv * triton.cdiv(vdim, write_through_block_v(False, torch.float32, False))
    assert 0 <= int(ring.count[0]) <= L and int(ring.phase[0]) in (0, 1)
    assert 0 <= int(ring.tickets[0]) < rows * programs
    assert int(ring.count[1]) == int(ring.tickets[1]) == 0, "the other slot untouched"
    clear_history(ring, rec[:1], torch.ones(1, dtype=torch.bool, device=DEVICE))  # as a slot SGLang hands out
    o = _decode(params, _row(x.tokens(1, 2), 0), family, 1, pool, same[:1], ring, rec[:1], write_through=False)
    assert torch.isfinite(o).all() and int(ring.count[0]) == 1


@pytest.mark.gpu
def test_request_counts_1_to_511_compile_the_write_through_once():
    """The write-through kernel takes no request count: 1..511 requests compile it once (a head shape no other
    test uses, so an earlier compilation cannot hide a recompile)."""
    n_max, hk, hv, kdim, vdim = 511, 1, 3, 32, 24
    params, x, pool, _ = make_case("gdn", n_max, 1, hk, hv, kdim, vdim, torch.float32, seed=85)
    inp = to_device(flat_inputs(x, "gdn", n_max, 1), DEVICE)
    pool = pool.to(DEVICE)
    ring = ReplayRing.allocate(n_max, 8, hk, hv, kdim, vdim, False, torch.bfloat16, DEVICE)
    idx = torch.arange(n_max, dtype=torch.int32, device=DEVICE)
    before = compiled_variants(replay_write_through_kernel)
    for n in range(1, n_max + 1):
        replay_write_through(params.A_log.to(DEVICE), inp["a"][:n], params.dt_bias.to(DEVICE), inp["q"][:, :n],
                             inp["k"][:, :n], inp["v"][:, :n], inp["b"][:, :n], pool, idx[:n], ring, idx[:n],
                             is_kda=False)
    torch.cuda.synchronize()
    assert compiled_variants(replay_write_through_kernel) - before == 1
