"""The plain-torch references agree with each other: chunked == recurrent, replay == native,
compact commit == native verify + scatter (bit for bit where the same rounding is claimed)."""

import pytest
import torch
import torch.nn.functional as F

from sglang_ssm_modes.reference import (
    accepted_path, chain_verify, chunked_prefill, compact_commit, compact_verify, decode, fold,
    replay_forward, scatter_accepted, tree_verify,
)
from sglang_ssm_modes.reference.gating import GateParams, l2norm, softplus
from sglang_ssm_modes.reference.random_layer import random_gate_params, random_inputs, random_state

# (family, HK, HV, K, V): GQA for GDN (HV != HK), HK == HV for KDA, K != V somewhere.
SHAPES = [("gdn", 2, 4, 16, 8), ("gdn", 1, 3, 8, 8), ("kda", 3, 3, 8, 16)]


def make(family, hk, hv, kd, vd, batch, tokens, seed, act=torch.float64, state_dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    params = random_gate_params(family, hv, kd, g)
    x = random_inputs(family, batch, tokens, hk, hv, kd, vd, g, act)
    s = random_state(batch, hv, vd, kd, g, state_dtype)
    return params, x, s


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens,chunk", [(37, 16), (70, 64), (5, 64)])
def test_chunked_prefill_equals_recurrence_float64(shape, tokens, chunk):
    params, x, s = make(*shape, batch=3, tokens=tokens, seed=tokens + chunk)
    o_rec, s_rec = decode(s, x, params, torch.float64)
    o_chk, s_chk = chunked_prefill(s, x, params, chunk, torch.float64)
    assert rel_err(o_chk, o_rec) < 1e-10
    assert rel_err(s_chk, s_rec) < 1e-10


@pytest.mark.parametrize("shape", SHAPES)
def test_replay_equals_native_over_several_folds_float64(shape):
    """Windows of 1..4 tokens against checkpoint + history, folding before L would overflow,
    over 6 folds' worth of tokens: outputs and the folded state equal native to 1e-10."""
    L = 8
    params, x, s = make(*shape, batch=3, tokens=6 * L + 3, seed=1)
    o_nat, s_nat = decode(s, x, params, torch.float64)
    gen = torch.Generator().manual_seed(2)
    checkpoint, history, outs, t, folds = s, None, [], 0, 0
    while t < x.num_tokens:
        w = min(int(torch.randint(1, 5, (1,), generator=gen)), x.num_tokens - t)
        if history is not None and history.num_tokens + w > L:
            checkpoint, history, folds = fold(checkpoint, history, torch.float64), None, folds + 1
        o, rec = replay_forward(checkpoint, history, x.tokens(t, t + w), params, torch.float64)
        outs.append(o)
        history = rec if history is None else history.cat(rec)
        t += w
    assert folds >= 5
    assert rel_err(torch.cat(outs, 1), o_nat) < 1e-10
    assert rel_err(fold(checkpoint, history, torch.float64), s_nat) < 1e-10


@pytest.mark.parametrize("shape", SHAPES)
def test_replay_float32_state_within_1e5_of_native_after_folds(shape):
    L = 16
    params, x, s = make(*shape, batch=2, tokens=4 * L, seed=3, act=torch.bfloat16, state_dtype=torch.float32)
    _, s_nat = decode(s, x, params, torch.float32)
    checkpoint = s
    for f in range(4):
        _, rec = replay_forward(checkpoint, None, x.tokens(f * L, (f + 1) * L), params, torch.float32)
        checkpoint = fold(checkpoint, rec, torch.float32)
    assert checkpoint.dtype == torch.float32
    assert rel_err(checkpoint, s_nat) < 1e-5


def test_replay_fold_uses_raw_records_not_u():
    """The fold re-runs from raw k, v (and g, beta); corrupting the fast path's u changes nothing."""
    params, x, s = make("gdn", 2, 4, 16, 8, batch=2, tokens=6, seed=4)
    _, rec = replay_forward(s, None, x, params, torch.float64)
    corrupted = type(rec)(**{**rec.__dict__, "u": torch.full_like(rec.u, float("nan"))})
    assert torch.equal(fold(s, corrupted, torch.float64), fold(s, rec, torch.float64))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_compact_chain_commit_bit_identical_to_native_verify_scatter(shape, state_dtype):
    """Every accepted length n in 0..D (last index n-1), padding rows (-1) included, whole state compared."""
    D = 4
    params, x, s = make(*shape, batch=D + 2, tokens=D, seed=5, act=torch.bfloat16, state_dtype=state_dtype)
    last = torch.tensor([-1, 0, 1, 2, 3, -1])  # n = 0 (padding), 1..D, and a trailing padding row
    o_nat, steps = chain_verify(s, x, params)
    o_cmp, records = compact_verify(s, x, params)
    assert torch.equal(o_cmp, o_nat)
    committed = compact_commit(s, records, last)
    assert torch.equal(committed, scatter_accepted(s, steps, last))
    assert torch.equal(committed[0], s[0]) and torch.equal(committed[-1], s[-1])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_compact_tree_commit_bit_identical_to_native_tree_verify(family, state_dtype):
    shape = ("gdn", 2, 4, 16, 8) if family == "gdn" else ("kda", 2, 2, 16, 8)
    params, x, s = make(*shape, batch=4, tokens=5, seed=6, act=torch.bfloat16, state_dtype=state_dtype)
    parents = torch.tensor([[0, 0, 0, 1, 2], [0, 0, 1, 2, 3], [0, 0, 0, 0, 0], [0, 0, 1, 1, 3]])
    last = torch.tensor([3, 4, -1, 4])
    o_nat, steps = tree_verify(s, x, params, parents)
    o_cmp, records = compact_verify(s, x, params, parents)
    assert torch.equal(o_cmp, o_nat)
    assert torch.equal(compact_commit(s, records, last, parents), scatter_accepted(s, steps, last))


def test_compact_decode_is_native_decode():
    params, x, s = make("gdn", 2, 4, 16, 8, batch=3, tokens=1, seed=7, act=torch.bfloat16, state_dtype=torch.bfloat16)
    _, s_nat = decode(s, x, params)
    _, records = compact_verify(s, x, params)
    assert torch.equal(compact_commit(s, records, torch.zeros(3, dtype=torch.long)), s_nat)


def test_rounding_placement_matters_for_bfloat16():
    """Four decodes (rounding each token) and a 4-token verify (rounding once) are different bf16
    states, and coincide in float32 to float precision: the references keep the distinction."""
    params, x, s = make("gdn", 2, 4, 64, 64, batch=2, tokens=4, seed=8, act=torch.bfloat16, state_dtype=torch.bfloat16)
    _, s_dec = decode(s, x, params)
    _, steps = chain_verify(s, x, params)
    assert (s_dec.float() - steps[:, -1].float()).abs().max() > 0
    _, s_dec32 = decode(s.float(), x, params)
    _, steps32 = chain_verify(s.float(), x, params)
    assert rel_err(s_dec32, steps32[:, -1]) < 1e-6


def test_accepted_path_chain_and_tree():
    parents = torch.tensor([[0, 0, 1, 1, 3], [0, 0, 0, 2, 3]])
    assert accepted_path(torch.tensor([4, 3]), parents) == [[0, 1, 3, 4], [0, 2, 3]]
    assert accepted_path(torch.tensor([2, -1]), None) == [[0, 1, 2], []]
    with pytest.raises(ValueError, match="do not reach node 0"):
        accepted_path(torch.tensor([2]), torch.tensor([[0, 2, 1]]))


def test_gating_matches_torch_softplus_and_sglang_epsilon():
    x = torch.linspace(-30, 40, 1001, dtype=torch.float64)
    assert torch.allclose(softplus(x), F.softplus(x, beta=1.0, threshold=20.0), rtol=1e-12, atol=1e-12)
    v = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    assert torch.allclose(l2norm(v), v / (25.0 + 1e-6) ** 0.5, rtol=0, atol=1e-15)


def test_unknown_family_is_rejected():
    params = GateParams(family="mamba2", A_log=torch.zeros(2), dt_bias=torch.zeros(2))
    _, x, s = make("gdn", 1, 2, 8, 8, batch=1, tokens=1, seed=9)
    with pytest.raises(ValueError, match="expected 'gdn' or 'kda'"):
        decode(s, x, params)


def test_acceptance_property_1000_random_cases():
    """1 000 random speculative rounds through the reference path (tiny shapes): family, GQA layout,
    batch 1..7, D 1..5, chain or tree, state dtype, accepted node -1..D-1 (padding included): compact's
    outputs and committed state equal native verify + scatter bit for bit, whole state compared;
    replay's outputs and materialised state equal native's in float64 to 1e-10."""
    gen = torch.Generator().manual_seed(1000)

    def pick(*options):
        return options[int(torch.randint(0, len(options), (1,), generator=gen))]

    for case in range(1000):
        family = pick("gdn", "kda")
        hk, group = pick(1, 2), (pick(1, 2, 3) if family == "gdn" else 1)
        n, d = pick(1, 2, 3, 5, 7), pick(1, 2, 3, 4, 5)
        state_dtype = pick(torch.float32, torch.bfloat16)
        params, x, s = make(family, hk, hk * group, 8, 4, batch=n, tokens=d, seed=case, act=torch.bfloat16,
                            state_dtype=state_dtype)
        last = torch.randint(-1, d, (n,), generator=gen)
        parents = None
        if d > 1 and pick(False, True):
            parents = torch.zeros(n, d, dtype=torch.long)
            for t in range(1, d):
                parents[:, t] = torch.randint(0, t, (n,), generator=gen)
        if parents is None:
            o_nat, steps = chain_verify(s, x, params)
        else:
            o_nat, steps = tree_verify(s, x, params, parents)
        o_cmp, records = compact_verify(s, x, params, parents)
        assert torch.equal(o_cmp, o_nat), case
        assert torch.equal(compact_commit(s, records, last, parents), scatter_accepted(s, steps, last)), case
        if parents is None:
            s64 = s.double()
            o64, steps64 = chain_verify(s64, x, params, torch.float64)
            o_rep, rec = replay_forward(s64, None, x, params, torch.float64)
            assert rel_err(o_rep, o64) < 1e-10, case
            for i in range(n):
                if last[i] >= 0:
                    accepted = type(rec)(*(t[i:i + 1, :int(last[i]) + 1] for t in rec.__dict__.values()))
                    folded = fold(s64[i:i + 1], accepted, torch.float64)
                    assert rel_err(folded[0], steps64[i, last[i]]) < 1e-10, case
