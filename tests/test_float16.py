"""float16 — a ``--mamba-ssm-dtype float16`` state, a model served with ``--dtype float16`` — through the
modes' kernels, as the other kernel tests take float32 and bfloat16 through them: compact's verify + commit
against SGLang 0.5.14's native verify + scatter bit for bit; replay's rounds of verify + acceptance over several
folds (fused and separate) against the float64 reference; replay's write-through decode against SGLang's decode
kernels; the conv window's float16 branches against its reference and against SGLang's conv kernel run natively
in float16; a fold that overflows float16 flagged.

float16 differs from bfloat16 where these tests look: 11 significant bits against 8, so a float32 value a hair
from a rounding midpoint lands on the other float16 neighbour some 8x more often (where two kernels sum in
another order, more one-ulp flips: allowed below only where the bfloat16 tests allow them, on the CPU
interpreter); a largest finite value of 65504 against ~3.4e38, so a state finite in float32 can round to an
infinity; and exact float16 arithmetic under the CPU interpreter (NumPy's float16, rounding to nearest even, as
a GPU), where its bfloat16 is raw bits — so SGLang's own kernels run on float16 inputs there as they are.
"""

import pytest
import torch

import test_conv_window as conv_tests
from interpreter_shims import sglang_fla_on_cpu
from kernel_cases import (DEVICE, assert_same_bits, bf16_ulp, call_replay_verify, every_accepted_length, f16_ulp,
                          make_case, random_tree_parents, sglang_decode, sglang_native_round, sglang_packed_decode)
from test_compact_kernels import _compact_round
from test_replay_write_through import _decode, _records, _row, v_major  # noqa: F401  (v_major: a fixture)
from test_replay_write_through_verify import _run_rounds

from sglang.srt.layers.attention.mamba.causal_conv1d_triton import causal_conv1d_update

from sglang_ssm_modes.ops.conv_window import conv_ring_commit, conv_ring_load, conv_ring_materialise, conv_ring_verify
from sglang_ssm_modes.ops.replay import (FAULT_NONFINITE, ReplayRing, advance, after_fold, fold_needed, replay_fold)
from sglang_ssm_modes.reference import LinearAttnInputs, chain_verify, decode, write_through
from sglang_ssm_modes.reference import compact_verify as reference_compact_verify
from sglang_ssm_modes.reference import conv as R
from sglang_ssm_modes.reference.random_layer import random_inputs

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
CPU_V_MAJOR_FLIPS = 4
"""Elements a float16 state (or output) of replay's ``[BV, K]`` write-through tile may differ from SGLang's
decode by — one float16 ulp each — per token on the CPU interpreter, whose NumPy sums over the transposed view
in another order (:func:`kernel_cases.assert_same_bits`'s ``flips``; measured: at most 2 state elements and 1
output a token, KDA, none for GDN). The same allowance for the two SGLang decode kernels against
each other there. Bit for bit on the GPU."""


def _out_ulp(dtype, a, b):
    """One ulp of the larger magnitude of ``a`` and ``b`` (float64) in the output dtype ``dtype``."""
    return bf16_ulp(a, b) if dtype == BF16 else f16_ulp(a, b)


def _f16_inputs(family, n, d, hk, hv, kdim, vdim, act_dtype, seed):
    """:func:`kernel_cases.make_case` with a float16 state, its inputs drawn again in ``act_dtype`` (make_case
    draws bfloat16 ones: float16 ones then carry only bfloat16's 8 significant bits)."""
    params, _, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, F16, seed=seed)
    x = random_inputs(family, n, d, hk, hv, kdim, vdim, torch.Generator().manual_seed(seed + 1), act_dtype)
    return params, x, pool, state_idx


# ------------------------------------------------------------------------------------------------------------
# compact: verify + commit against SGLang's native verify + scatter
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("state_dtype,act_dtype", [(F16, F16), (F16, BF16), (F32, F16)],
                         ids=["state_f16-act_f16", "state_f16-act_bf16", "state_f32-act_f16"])
@pytest.mark.parametrize("case", [("gdn", 7, 4, 2, 4, 16, 32), ("gdn", 7, 3, 1, 2, 32, 64),
                                  ("kda", 9, 4, 2, 2, 16, 32)], ids=["gdn-gqa", "gdn-gqa-k32", "kda"])
def test_compact_round_float16_bit_identical_to_sglang_native(case, state_dtype, act_dtype):
    """A chain round (verify + commit) with a float16 state and/or float16 activations against SGLang 0.5.14's
    native verify + scatter, as the bfloat16 test asserts it: outputs of real rows and the whole pool
    (committed, untouched and padding slots) bit for bit — the same float32 arithmetic rounded once to float16,
    round-to-nearest-even on the GPU and under the interpreter alike. Every accepted length 0..D among the real
    rows; the padding row (odd batch) given one too. Records: raw k, v the inputs bit for bit in the activation
    dtype (float16 records, not bfloat16: a float16 input would lose 3 bits), padding row unrecorded; g and beta
    within float32 rounding of the reference (the bfloat16 test's bounds); outputs within one float16 ulp of the
    float32 reference's, plus 2**-20 of the largest for outputs near zero (float32 noise between torch and the
    kernel); bfloat16 outputs: one bfloat16 ulp (the interpreter's float32 -> bfloat16 truncates)."""
    family, n, d, hk, hv, kdim, vdim = case
    params, x, pool, state_idx = _f16_inputs(family, n, d, hk, hv, kdim, vdim, act_dtype, seed=n + d + kdim)
    pool = pool.to(state_dtype)
    assert (state_idx < 0).any()  # a padding row
    last = every_accepted_length(state_idx, n, d)
    o_nat, pool_nat = sglang_native_round(params, x, pool, state_idx, last, family, n, d)
    o_cmp, pool_cmp, rec = _compact_round(params, x, pool, state_idx, last, family, n, d, hk)
    real = state_idx >= 0
    o_cmp = o_cmp.reshape(n, d, hv, vdim)[real.to(DEVICE)]
    assert o_cmp.dtype == act_dtype and pool_cmp.dtype == state_dtype
    assert torch.equal(o_cmp, o_nat.reshape(n, d, hv, vdim)[real.to(DEVICE)])
    assert torch.equal(pool_cmp, pool_nat)
    assert not torch.equal(pool_cmp, pool.to(DEVICE))
    rows = torch.arange(n)[real]
    assert torch.equal(rec.k[1:n + 1][rows].cpu(), x.k[rows]) and torch.equal(rec.v[1:n + 1][rows].cpu(), x.v[rows])
    assert (rec.k[0] == 0).all() and (rec.k[n + 1] == 0).all() and (rec.k[1 + n // 2] == 0).all()
    o_ref, rec_ref = reference_compact_verify(pool[state_idx.clamp_min(0)], x, params)
    got, want = o_cmp.double().cpu(), o_ref[real].double()
    assert ((got - want).abs() <= _out_ulp(act_dtype, got, want) + 2.0 ** -20 * want.abs().max()).all()
    assert torch.allclose(rec.g[1:n + 1][rows].cpu(), rec_ref.g[rows], rtol=1e-4, atol=1e-7)
    assert torch.allclose(rec.beta[1:n + 1][rows].cpu(), rec_ref.beta[rows], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family,hk,hv", [("gdn", 2, 4), ("kda", 2, 2)])
def test_compact_tree_round_float16_bit_identical_to_sglang_native(family, hk, hv):
    """EAGLE topk > 1 trees with a float16 state and float16 activations: every node's output and the state of
    the last accepted node (any node, or none) equal SGLang's native tree verify + scatter bit for bit, whole
    pool — the commit rounds to float16 after every step of the path, where native reloads each parent's stored
    float16 copy."""
    n, d = 7, 5
    params, x, pool, state_idx = _f16_inputs(family, n, d, hk, hv, 16, 32, F16, seed=11 + hv)
    gen = torch.Generator().manual_seed(12)
    parents = random_tree_parents(n, d, gen)
    parents[0] = torch.tensor([0, 0, 1, 2, 3])  # one deep chain-shaped tree: four roundings on its path
    last = torch.randint(-1, d, (n,), generator=gen)
    last[0], last[1] = d - 1, -1
    o_nat, pool_nat = sglang_native_round(params, x, pool, state_idx, last, family, n, d, parents)
    o_cmp, pool_cmp, _ = _compact_round(params, x, pool, state_idx, last, family, n, d, hk, parents)
    real = (state_idx >= 0).to(DEVICE)
    assert torch.equal(o_cmp.reshape(n, d, hv, 32)[real], o_nat.reshape(n, d, hv, 32)[real])
    assert torch.equal(pool_cmp, pool_nat)
    assert not torch.equal(pool_cmp, pool.to(DEVICE))


# ------------------------------------------------------------------------------------------------------------
# replay: rounds over several folds against float64; write-through against SGLang's decode
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,hk,hv,act_dtype", [("gdn", 2, 4, F16), ("kda", 2, 2, F16), ("gdn", 1, 2, BF16)],
                         ids=["gdn-act_f16", "kda-act_f16", "gdn-act_bf16"])
def test_replay_float16_rounds_against_float64_over_several_folds(family, hk, hv, act_dtype):
    """Rounds of verify + acceptance on a float16 state (ring raw records in the activation dtype), two ways side
    by side: A folds inside the verify (fused fold, served two launches) and settles the cursor in the
    acceptance; B folds first (fold kernel + cursor update) and verifies in one launch. Every round: A's and B's
    checkpoints bit for bit, every ring buffer but ``u`` bit for bit (``u`` to float32 rounding: another
    reduction order), cursors the same; the padding row's and unowned slots never written; both outputs against
    the float64 reference. At the end the committed state materialised against float64.

    The float64 truth rounds its state to float16 where a fold does (``fold_needed`` before each round), so the
    comparison measures the kernels' rounding, not float16's: the kernel folds in float32 and rounds once, the
    truth in float64 and rounds once, at the same points. They differ only where float32 noise (~1e-7 relative)
    sits across a float16 rounding midpoint (spacing 2**-11 relative): a one-ulp flip, rare (measured 0.3 % of
    elements after 4-5 folds each), carried on by later steps that do not expand an error (decay <= 1,
    ``I - beta k k^T`` with beta <= 1 and |k| <= 1). Hence the state bound: at least 98 % of elements equal to
    the truth's rounding, none more than one float16 ulp of the largest element away (measured half that).
    Outputs: one ulp of the output in its dtype (its own rounding — half an ulp to nearest, a whole one where
    the interpreter truncates to bfloat16 — plus float32 noise),
    plus, for the checkpoint's flips, the state bound (one float16 ulp of the largest element) dotted with the
    scaled unit query (``|q| = K**-0.5``). Measured: outputs within 10-17 % of that bound (78 % with bfloat16
    outputs, which the interpreter truncates), states 0.3-0.5 % of elements off, by at most half an ulp of the
    largest."""
    n, d, L, rounds, kdim, vdim = 5, 3, 4, 6, 16, 32
    params, _, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, F16, seed=141 + hv)
    gen = torch.Generator().manual_seed(142)
    kda, real = family == "kda", state_idx >= 0
    pools = [pool.to(DEVICE), pool.to(DEVICE).clone()]
    pool_init = pool.to(DEVICE).clone()
    rings = [ReplayRing.allocate(n + 2, L, hk, hv, kdim, vdim, kda, act_dtype, DEVICE) for _ in range(2)]
    rec_idx = torch.where(real, torch.arange(1, n + 1), -1).to(torch.int32).to(DEVICE)
    nobody = [0, n + 1] + [i + 1 for i in range(n) if not real[i]]
    untouched = [s for s in range(pool.shape[0]) if s not in state_idx.tolist()]
    truth = pool[state_idx.clamp_min(0)].double()
    for _ in range(rounds):
        need = fold_needed(rings[1], rec_idx, d)
        truth[need.cpu()] = truth[need.cpu()].to(F16).double()  # a fold rounds the checkpoint once
        replay_fold(pools[1], state_idx.to(DEVICE), rings[1], rec_idx, need, is_kda=kda)
        after_fold(rings[1], rec_idx, need)
        x = random_inputs(family, n, d, hk, hv, kdim, vdim, gen, act_dtype)
        outs = [call_replay_verify(params, x, family, n, d, pools[0], state_idx, rings[0], rec_idx),
                call_replay_verify(params, x, family, n, d, pools[1], state_idx, rings[1], rec_idx, launches=1)]
        assert torch.equal(pools[0], pools[1])
        o_ref = chain_verify(truth, x, params, torch.float64)[0][real]
        bound = _out_ulp(act_dtype, o_ref, o_ref) + f16_ulp(truth.abs().max(), truth.abs().max()) * kdim ** -0.5
        for o in outs:
            assert o.dtype == act_dtype
            got = o.reshape(n, d, hv, vdim)[real.to(DEVICE)].double().cpu()
            assert ((got - o_ref).abs() <= bound).all(), float(((got - o_ref).abs() / bound).max())
        accepted = torch.randint(0, d + 1, (n,), generator=gen) * real
        accepted[0] = d  # one request folds every round from the second
        advance(rings[0], rec_idx, accepted.to(DEVICE).to(torch.int32), window=d)
        advance(rings[1], rec_idx, accepted.to(DEVICE).to(torch.int32))
        for name, t in rings[0].buffers().items():
            if name == "u":
                torch.testing.assert_close(t, rings[1].u, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(t, rings[1].buffers()[name]), name
            assert (t[nobody] == 0).all(), f"ring {name} of a slot nobody owns (padding's included)"
        assert not rings[0].faults.any()
        for i in range(n):
            if accepted[i] > 0:
                row = LinearAttnInputs(*(t[i:i + 1, :int(accepted[i])] for t in (x.q, x.k, x.v, x.a, x.b)))
                truth[i] = decode(truth[i:i + 1], row, params, torch.float64)[1][0]
        assert torch.equal(pools[0][untouched], pool_init[untouched])
    assert int(rings[0].folds[1]) >= 2 and int(rings[0].folds.sum()) >= 6  # several folds, of several requests
    mat = torch.zeros_like(pools[0])
    replay_fold(pools[0], state_idx.to(DEVICE), rings[0], rec_idx, torch.ones(n, dtype=torch.bool, device=DEVICE),
                is_kda=kda, dst=mat, dst_indices=torch.arange(n, device=DEVICE))
    got, want = mat[:n][real.to(DEVICE)].double().cpu(), truth[real].to(F16).double()
    assert (mat[:n][~real.to(DEVICE)] == 0).all() and (mat[n:] == 0).all()
    assert float((got != want).double().mean()) <= 0.02
    top = want.abs().max()
    assert ((got - want).abs() <= f16_ulp(top, top)).all(), float((got - want).abs().max())


@pytest.mark.parametrize("act_dtype", [F16, BF16], ids=["act_f16", "act_bf16"])
@pytest.mark.parametrize("family,hk,hv,kdim,vdim", [("gdn", 2, 4, 16, 40), ("kda", 2, 2, 16, 40),
                                                    ("gdn", 1, 1, 32, 32)])
def test_write_through_float16_is_sglang_decode(family, hk, hv, kdim, vdim, act_dtype, v_major):
    """From an empty history a write-through on a float16 state is SGLang 0.5.14's decode
    (``fused_sigmoid_gating_delta_rule_update``), token after token, either tile: outputs of real rows and the
    whole pool bit for bit (``[K, BV]``, and ``[BV, K]`` on the GPU); ``[BV, K]`` on the CPU interpreter within
    :data:`CPU_V_MAJOR_FLIPS` one-ulp flips a token (its NumPy sums over the transposed view differ in float32's
    last bits; float16's 11 bits turn that into a flip where bfloat16's 8 rarely do — the bfloat16 test allows
    none in a decode), each token then starting from SGLang's state. The ring is not touched."""
    n, tokens = 5, 3
    params, x_all, pool, state_idx = _f16_inputs(family, n, tokens, hk, hv, kdim, vdim, act_dtype, seed=171)
    initial = pool.to(DEVICE).clone()
    native, ours = initial.clone(), initial.clone()
    ring = ReplayRing.allocate(n + 1, 4, hk, hv, kdim, vdim, family == "kda", act_dtype, DEVICE)
    rec_idx = torch.arange(1, n + 1, dtype=torch.int32, device=DEVICE)
    before = {name: t.clone() for name, t in ring.buffers().items()}
    real = (state_idx >= 0).to(DEVICE)
    for t in range(tokens):
        x = x_all.tokens(t, t + 1)
        want = sglang_decode(params, x, native, state_idx, family, n)
        got = _decode(params, x, family, n, ours, state_idx, ring, rec_idx, write_through=True)
        assert_same_bits(got[0][real], want[0][real], v_major, flips=CPU_V_MAJOR_FLIPS)
        assert_same_bits(ours, native, v_major, flips=CPU_V_MAJOR_FLIPS)
        ours.copy_(native)
    assert not torch.equal(ours, initial)
    assert all(torch.equal(before[name], buf) for name, buf in ring.buffers().items())


@pytest.mark.parametrize("family,hk,hv,kdim,vdim", [("gdn", 2, 4, 16, 40), ("kda", 2, 2, 16, 40),
                                                    ("gdn", 1, 1, 32, 32)])
def test_write_through_float16_is_sglangs_packed_decode_as_served(family, hk, hv, kdim, vdim):
    """As served (GDN: sigmoid(b) rounded to b's dtype — here float16, 11 bits), a write-through on a float16
    state from an empty history is SGLang's packed decode, the kernel it runs on CUDA: state and outputs of real
    rows equal but for at most :data:`CPU_V_MAJOR_FLIPS` elements a token one float16 ulp apart (on the CPU
    interpreter SGLang's two decode kernels themselves sum in another order; measured at most 2 state elements
    and 2 outputs a token), each token then starting from SGLang's state. Without the rounded beta a GDN state
    is off in far more elements (measured hundreds a token): asserted, so the allowance cannot hide it."""
    n, tokens = 5, 2
    params, x_all, pool, state_idx = _f16_inputs(family, n, tokens, hk, hv, kdim, vdim, F16, seed=179)
    real = (state_idx >= 0).to(DEVICE)
    for round_beta in ([True, False] if family == "gdn" else [False]):
        native, ours = pool.to(DEVICE), pool.to(DEVICE).clone()
        ring = ReplayRing.allocate(n, 4, hk, hv, kdim, vdim, family == "kda", F16, DEVICE)
        rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
        for t in range(tokens):
            x = x_all.tokens(t, t + 1)
            with sglang_fla_on_cpu():  # its `exp` alias, under the interpreter (a no-op elsewhere)
                want = sglang_packed_decode(params, x, native, state_idx, family, n)
            got = _decode(params, x, family, n, ours, state_idx, ring, rec_idx, write_through=True,
                          round_beta=round_beta)
            if round_beta or family == "kda":
                assert_same_bits(got[0][real], want[:, 0][real], DEVICE == "cpu", flips=CPU_V_MAJOR_FLIPS)
                assert_same_bits(ours, native, DEVICE == "cpu", flips=CPU_V_MAJOR_FLIPS)
            else:
                assert int((ours != native).sum()) > 20 * CPU_V_MAJOR_FLIPS, "beta unrounded: should differ"
            ours.copy_(native)


@pytest.mark.parametrize("family,hk,hv,kdim,vdim", [("gdn", 2, 4, 16, 40), ("kda", 2, 2, 16, 40)])
def test_write_through_float16_folds_the_pending_history_first(family, hk, hv, kdim, vdim):
    """Output-only decodes of subsets of the batch leave 0 .. L float16 raw records (one request folding on the
    way, fused, rounding its float16 checkpoint), then write-throughs of the whole batch (switching back and
    forth): per write-through every real cursor emptied (a fold counted where there were records), records and
    other slots' words untouched, and the state within one float16 ulp of the float64 reference (the history
    folded, then the token, rounded once to float16 from the same checkpoint: the kernel's float32 result is
    the same value to ~1e-7 relative, so its rounding is the reference's or a neighbour at a midpoint), plus
    2**-20 of the largest element for elements near zero; outputs (float16) within one float16 ulp of the
    reference's plus float32 noise of the largest output."""
    n, L, kda = 6, 4, family == "kda"
    params, _, pool, state_idx = make_case(family, n, 1, hk, hv, kdim, vdim, F16, seed=173)
    gen = torch.Generator().manual_seed(174)
    ours = pool.to(DEVICE)
    ring = ReplayRing.allocate(n + 2, L, hk, hv, kdim, vdim, kda, F16, DEVICE)
    rec_idx = torch.arange(2, n + 2, dtype=torch.int32, device=DEVICE)  # slots 0 and 1 belong to nobody
    real = state_idx >= 0  # row 3 is padding
    everyone = list(range(n))
    plan = [([0, 1, 2, 4], False), ([0, 1, 2], False), ([0, 2], False), ([0], False), ([0, 1], False),
            (everyone, True), ([1, 2], False), (everyone, True), (everyone, True)]
    pending = {i: [] for i in everyone}
    write_throughs, folded = 0, 0
    for rows, through in plan:
        sel = torch.tensor(rows)
        x = random_inputs(family, len(rows), 1, hk, hv, kdim, vdim, gen, F16)
        words = {name: getattr(ring, name).clone() for name in ("count", "phase", "folds")}
        checkpoints = ours.clone()
        records = {name: getattr(ring, name).clone() for name in ("u", "k_norm", "g", "beta", "k_raw", "v_raw")}
        got = _decode(params, x, family, len(rows), ours, state_idx[sel], ring, rec_idx[sel.to(DEVICE)], through)
        live = [j for j, i in enumerate(rows) if real[i]]
        if not through:  # a record each; a full history was folded first
            for j in live:
                pending[rows[j]] = (pending[rows[j]] if len(pending[rows[j]]) < L else []) + [_row(x, j)]
            continue
        write_throughs += 1
        slots = rec_idx[[rows[j] for j in live]].long()
        had = words["count"][slots] > 0
        folded += int(had.sum())
        assert (ring.count[slots] == 0).all() and (ring.tickets == 0).all() and not ring.faults.any()
        assert torch.equal(ring.folds[slots], words["folds"][slots] + had.to(torch.int32))
        assert torch.equal(ring.count[:2], words["count"][:2]) and torch.equal(ring.folds[:2], words["folds"][:2])
        assert all(torch.equal(records[name], getattr(ring, name)) for name in records)
        for j in live:
            i, s = rows[j], int(state_idx[rows[j]])
            o_ref, h_ref = write_through(checkpoints[s:s + 1].cpu(), _records(pending[i], params), _row(x, j),
                                         params, torch.float64)
            pending[i] = []
            mine, want = ours[s].double().cpu(), h_ref[0].double()
            assert ((mine - want).abs() <= f16_ulp(mine, want) + 2.0 ** -20 * want.abs().max()).all(), (i, s)
            o, r = got[0, j].double().cpu(), o_ref[0, 0]
            assert ((o - r).abs() <= f16_ulp(o, r) + 2.0 ** -20 * r.abs().max()).all(), (i, s)
    assert write_throughs == 3 and folded == 6  # 4 requests hold records at the first, 2 at the second
    unused = [s for s in range(pool.shape[0]) if s not in state_idx[real].tolist()]
    assert torch.equal(ours[unused], pool.to(DEVICE)[unused])


@pytest.mark.filterwarnings("ignore:overflow encountered")  # NumPy's float32 -> float16 of 1e5, interpreted
def test_a_fold_that_overflows_float16_is_written_as_infinity_and_flagged():
    """float16's largest finite value is 65504: a fold whose float32 state is finite past it (here 60000 + 65504
    / sqrt(2) = 106318 at one element) rounds to an infinity in a float16 checkpoint — written, as native's
    float16 store would, and flagged FAULT_NONFINITE on that request's slot only. The same history materialised
    into a float32 destination is finite and flags nothing (float32 and bfloat16 reach ~3.4e38)."""
    hk, hv, kdim, vdim, L = 1, 1, 16, 16, 4
    pool = torch.zeros(3, hv, vdim, kdim, dtype=F16, device=DEVICE)
    pool[0, 0, 3, 0], pool[0, 0, 3, 1] = 60000.0, -60000.0  # h . k = 0 for k along (e0 + e1) / sqrt(2)
    pool[2] = 0.25
    ring = ReplayRing.allocate(2, L, hk, hv, kdim, vdim, False, F16, DEVICE)
    ring.k_raw[:, 0, 0, :2] = 1.0  # raw keys, normalised by the fold
    ring.v_raw[:, 0, 0, :] = 65504.0
    ring.beta[:, 0] = 1.0  # g = 0: no decay
    ring.count.fill_(1)
    state_idx, rec_idx = torch.tensor([0, 2], device=DEVICE), torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    wide = torch.zeros(2, hv, vdim, kdim, dtype=F32, device=DEVICE)
    replay_fold(pool, state_idx, ring, rec_idx, None, is_kda=False, dst=wide,
                dst_indices=torch.arange(2, device=DEVICE))
    assert torch.isfinite(wide).all() and not ring.faults.any()
    assert abs(float(wide[0, 0, 3, 0]) - (60000 + 65504 / (2 + 1e-6) ** 0.5)) < 0.1
    assert float(wide.abs().max()) > 65504
    replay_fold(pool, state_idx, ring, rec_idx, None, is_kda=False)
    assert pool[0, 0, 3, 0] == float("inf") and torch.isfinite(pool[2]).all()
    assert ring.faults.tolist() == [FAULT_NONFINITE, 0]


# ------------------------------------------------------------------------------------------------------------
# the conv window: its float16 branches
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("transposed,conv_dtype,d,has_bias", [(False, F16, 4, False), (True, F16, 3, True),
                                                              (False, F32, 3, True), (True, F32, 2, False)])
def test_conv_ring_float16_rounds_match_reference(transposed, conv_dtype, d, has_bias):
    """The bfloat16 rounds of ``test_conv_window`` (load, verify, tracked materialise, commit, acceptance,
    materialise over three rounds; the whole ring, offsets and destination pools; both layouts) with float16
    activations and a float16 or float32 ring: the kernels' float16 branches (``_round_to``'s plain float16
    cast, ``_tap_product``'s float16 x float16 product rounded to float16, float16 stores) against the reference
    bit for bit, and against SGLang's verify on float32 copies within that test's tolerance."""
    conv_tests.test_ring_rounds_match_reference_and_sglang(transposed, conv_dtype, F16, d, has_bias)


@pytest.mark.parametrize("transposed", [False, True])
def test_conv_ring_bfloat16_ring_float16_activations_match_reference(transposed):
    """SGLang's conv state is bfloat16 unless SGLANG_MAMBA_CONV_DTYPE says otherwise, whatever ``--dtype``: a
    float16 model's conv ring is bfloat16 with float16 inputs and weights. The kernel's ``_tap_product`` rounds
    that product to float16 as Triton does (bit for bit SGLang's kernel:
    :func:`test_conv_ring_float16_bit_identical_to_sglang_native`), and so does the reference's
    ``tap_product`` (torch alone would promote the pair to float32: ~23 % of outputs off, by up to 4e-3, before
    the reference followed Triton). Bit for bit on the CPU; on a GPU to the hardware ``exp``'s rounding."""
    conv_tests.test_ring_rounds_match_reference_and_sglang(transposed, BF16, F16, 3, True)


@pytest.mark.parametrize("conv_dtype", [F16, BF16, F32], ids=["ring_f16", "ring_bf16", "ring_f32"])
@pytest.mark.parametrize("transposed", [False, True], ids=["gdn", "kda"])
def test_conv_ring_float16_bit_identical_to_sglang_native(transposed, conv_dtype):
    """Float16 activations and weights, the ring in float16, bfloat16 (SGLang's default conv dtype, what a
    float16 model gets) or float32, against SGLang 0.5.14's ``causal_conv1d_update`` run as it is on the same
    dtypes — also under the CPU interpreter, which does float16 arithmetic exactly (and the bfloat16 -> float16
    cast) — over three rounds of verify + acceptance (accepted 0..D, padding row): outputs of real rows bit for
    bit (the GPU's SiLU ``exp``: to its rounding, :func:`test_conv_window._assert_same`), and the committed state
    (materialised from the ring, whole pool) bit for bit the state SGLang's acceptance scatters. SGLang stores its
    windows into a float32 buffer here, converted by torch (to nearest even, as a GPU's store): the interpreter's
    own float32/float16 -> bfloat16 store truncates."""
    d, n = 3, len(conv_tests.SLOT_ROWS)
    gen = torch.Generator().manual_seed(19 + int(transposed))
    C, KW, SLOTS, layout = conv_tests.C, conv_tests.KW, conv_tests.SLOTS, conv_tests._layout
    slot_rows = torch.tensor(conv_tests.SLOT_ROWS, device=DEVICE)
    real = slot_rows >= 0
    w_cols = R.ring_width(KW, d)
    weight, bias = conv_tests._randn(gen, (C, KW), F16), conv_tests._randn(gen, (C,), F16)
    pool = conv_tests._randn(gen, layout((SLOTS, C, KW - 1), transposed), conv_dtype)  # SGLang's conv pool
    ring = torch.zeros(layout((SLOTS, C, w_cols), transposed), dtype=conv_dtype, device=DEVICE)
    offsets = torch.zeros(SLOTS, dtype=torch.int32, device=DEVICE)
    everything = torch.arange(SLOTS, device=DEVICE)
    conv_ring_load(pool, everything, ring, offsets, everything, transposed=transposed)
    for rnd in range(3):
        x = conv_tests._randn(gen, (n, d, C), F16).transpose(1, 2)
        inter = torch.zeros(n, d, C, KW - 1, dtype=F32, device=DEVICE)  # exact: the windows' values are float16s
        o_sgl = causal_conv1d_update(x, conv_tests._pool_view(pool.clone(), transposed), weight, bias, "silu",
                                     conv_state_indices=slot_rows.to(torch.int32), intermediate_conv_window=inter,
                                     intermediate_state_indices=torch.arange(n, dtype=torch.int32, device=DEVICE))
        o = conv_ring_verify(x, weight, bias, ring, offsets, slot_rows, transposed=transposed)
        assert o.dtype == F16
        conv_tests._assert_same(o[real], o_sgl[real], f"round {rnd} outputs vs SGLang")
        accepted = torch.randint(0, d + 1, (n,), generator=gen).to(DEVICE)
        accepted[rnd % 2], accepted[1 - rnd % 2] = d, 0  # rows 0 and 1 are real: a full and an empty acceptance
        conv_ring_commit(offsets, slot_rows, accepted.to(torch.int32), w_cols)
        pv = conv_tests._pool_view(pool, transposed)
        pv[slot_rows[real]] = R.native_accept(pv[slot_rows[real]], inter[real].to(conv_dtype), accepted[real])
        out = torch.zeros_like(pool)
        conv_ring_materialise(ring, offsets, everything, out, everything, KW, transposed=transposed)
        assert torch.equal(out, pool), f"round {rnd}: whole pool"


@pytest.mark.parametrize("family,hk,hv,kdim,vdim", [("gdn", 2, 4, 16, 40), ("kda", 2, 2, 16, 40)])
def test_write_through_verify_float16_rounds_are_sglangs_verify_and_scatter(family, hk, hv, kdim, vdim, v_major):
    """Replay's write-through verify with a float16 state, float16 activations and float16 raw records: five
    rounds of verify + acceptance (accepted 0..D, a padding row, V = 40: a part column tile) against SGLang's
    verify + masked scatter, checked as the bfloat16 rounds are (``test_replay_write_through_verify``): outputs
    and the committed state native's bit for bit (on the CPU's ``[BV, K]`` tile, one-ulp flips of one element in a
    thousand where the write-through folds), the window's records the float64 reference's, cursors emptied where
    it folded, other slots untouched."""
    folded = _run_rounds(family, hk, hv, kdim, vdim, F16, v_major, n=5, d=3, L=4, plan=[True] * 5, seed=131,
                         act_dtype=F16)
    assert folded >= 6

