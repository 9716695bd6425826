"""Compact-mode Triton kernels against SGLang 0.5.14's native verify + scatter, kernel against kernel:
outputs and committed states bit for bit (same arithmetic; under the CPU interpreter both round the
same way), records equal to the raw inputs, the whole pool compared (padding and other slots too).
On the GPU the same tests run at real shapes (marked ``gpu``)."""

import inspect

import pytest
import torch

from kernel_cases import (DEVICE, assert_same_outputs_but_tiling, compiled_variants, every_accepted_length, flat_inputs,
                          make_case, random_tree_parents, sglang_native_round, to_device)
from sglang_ssm_modes.ops.compact import CompactRecordBuffers, compact_commit, compact_verify
from sglang_ssm_modes.ops.compact.commit import compact_commit_kernel
from sglang_ssm_modes.ops.verify_window import verify_window, verify_window_kernel
from sglang_ssm_modes.reference import compact_verify as reference_compact_verify

def _compact_round(params, x, pool, state_idx, last, family, n, d, hk, parents=None):
    """Compact's verify + commit of ``x`` on a copy of ``pool`` (on ``DEVICE``; the verify must not write it),
    records in the activation dtype (``x``'s) at record slots 1..n of n + 2; returns ``(o, pool, records)``."""
    inp = to_device(flat_inputs(x, family, n, d), DEVICE)
    hv, vdim, kdim = pool.shape[1:]
    pool = pool.to(DEVICE).clone()
    rec = CompactRecordBuffers.allocate(n + 2, d, hk, hv, kdim, vdim, family == "kda", x.k.dtype, DEVICE)  # raw k, v
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE) + 1  # record slots need not be 0..n-1
    before = pool.clone()
    o = compact_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                       inp["b"], pool, state_idx.to(DEVICE), rec, rec_idx, is_kda=family == "kda",
                       retrieve_parent_token=None if parents is None else parents.to(DEVICE))
    assert torch.equal(pool, before), "verify wrote the state"
    compact_commit(pool, state_idx.to(DEVICE), rec, rec_idx, last.to(DEVICE), is_kda=family == "kda",
                   retrieve_parent_token=None if parents is None else parents.to(DEVICE))
    return o, pool, rec


CASES = [  # family, N (odd), D, HK, HV, K, V
    ("gdn", 7, 4, 2, 4, 16, 32),
    ("gdn", 7, 3, 1, 2, 32, 64),
    ("kda", 9, 4, 2, 2, 16, 32),
]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_compact_round_bit_identical_to_sglang_native(case, state_dtype):
    family, n, d, hk, hv, kdim, vdim = case
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, state_dtype, seed=n + d + kdim)
    last = every_accepted_length(state_idx, n, d)
    o_nat, pool_nat = sglang_native_round(params, x, pool, state_idx, last, family, n, d)
    o_cmp, pool_cmp, rec = _compact_round(params, x, pool, state_idx, last, family, n, d, hk)
    real = state_idx >= 0
    o_nat = o_nat.reshape(n, d, hv, vdim)[real]
    o_cmp = o_cmp.reshape(n, d, hv, vdim)[real]
    assert torch.equal(o_cmp, o_nat)
    assert torch.equal(pool_cmp, pool_nat)  # whole pool: committed, untouched and padding slots
    assert not torch.equal(pool_cmp, pool.to(DEVICE)) or (last < 0).all()
    # records: raw inputs bit for bit, per key head; padding row not recorded
    rows = torch.arange(n)[real]
    assert torch.equal(rec.k[1:n + 1][rows].cpu(), x.k[rows])
    assert torch.equal(rec.v[1:n + 1][rows].cpu(), x.v[rows])
    assert (rec.k[0] == 0).all() and (rec.k[n + 1] == 0).all() and (rec.k[1 + n // 2] == 0).all()
    # outputs agree with the plain-torch reference within float32 tolerance
    o_ref, rec_ref = reference_compact_verify(pool[state_idx.clamp_min(0)], x, params)
    assert torch.allclose(o_cmp.float().cpu(), o_ref[real].to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
    # g = -exp(A_log) * log(1 + exp(x)): for x << 0, one ulp of (1 + exp(x)) is a relative error of
    # ~6e-8 / exp(x) in the log, so numpy (interpreter) and torch float32 differ by up to ~1e-5 relative
    assert torch.allclose(rec.g[1:n + 1][rows].cpu(), rec_ref.g[rows], rtol=1e-4, atol=1e-7)
    assert torch.allclose(rec.beta[1:n + 1][rows].cpu(), rec_ref.beta[rows], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv", [("gdn", 2, 4), ("kda", 2, 2)])
def test_compact_tree_round_bit_identical_to_sglang_native(family, hk, hv, state_dtype):
    """EAGLE topk > 1 / NGRAM trees: outputs of every node and the committed state of the last
    accepted node (any node, 0..D-1, or none) equal native tree verify + scatter, whole pool."""
    n, d = 7, 5
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, 16, 32, state_dtype, seed=11 + hv)
    gen = torch.Generator().manual_seed(12)
    parents = random_tree_parents(n, d, gen)
    parents[0] = torch.tensor([0, 0, 1, 2, 3])  # one deep chain-shaped tree
    last = torch.randint(-1, d, (n,), generator=gen)
    last[0], last[1] = d - 1, -1
    o_nat, pool_nat = sglang_native_round(params, x, pool, state_idx, last, family, n, d, parents)
    o_cmp, pool_cmp, _ = _compact_round(params, x, pool, state_idx, last, family, n, d, hk, parents)
    real = state_idx >= 0
    assert torch.equal(o_cmp.reshape(n, d, hv, 32)[real], o_nat.reshape(n, d, hv, 32)[real])
    assert torch.equal(pool_cmp, pool_nat)
    assert not torch.equal(pool_cmp, pool.to(DEVICE))


def test_request_count_is_not_a_compile_time_constant():
    """N only sets the grid; T is marked do_not_specialize; no kernel argument depends on the batch."""
    verify_args = inspect.signature(verify_window_kernel.fn).parameters
    commit_args = inspect.signature(compact_commit_kernel.fn).parameters
    for params in (verify_args, commit_args):
        assert not any(name in params for name in ("N", "B", "batch", "num_requests"))
    jit = verify_window_kernel
    marked = getattr(jit, "do_not_specialize", None) or jit.kwargs.get("do_not_specialize", [])  # JIT / interpreter
    assert {jit.arg_names[i] if isinstance(i, int) else i for i in marked} == {"T"}


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv", [("gdn", 16, 32), ("kda", 32, 32)])
@pytest.mark.parametrize("n,d,tree", [(1, 4, False), (7, 4, False), (33, 2, False), (64, 8, False), (5, 6, True),
                                      (48, 8, True)])
def test_compact_round_bit_identical_real_shapes(family, hk, hv, n, d, tree, state_dtype):
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, 128, 128, state_dtype, seed=n * d)
    gen = torch.Generator().manual_seed(n)
    last = torch.randint(-1, d, (n,), generator=gen)
    parents = random_tree_parents(n, d, gen) if tree else None
    o_nat, pool_nat = sglang_native_round(params, x, pool, state_idx, last, family, n, d, parents)
    o_cmp, pool_cmp, _ = _compact_round(params, x, pool, state_idx, last, family, n, d, hk, parents)
    real = (state_idx >= 0).to(DEVICE)
    assert torch.equal(o_cmp.reshape(n, d, hv, 128)[real], o_nat.reshape(n, d, hv, 128)[real])
    assert torch.equal(pool_cmp, pool_nat)


@pytest.mark.parametrize("tile", [(8, 1), (16, 2), (64, 4)])
def test_other_verify_tiles_record_the_same_and_commit_bit_identically(tile):
    """Any verify tile records the exact inputs, so the commit stays bit-identical to native; the
    outputs agree to float32 rounding: bit for bit under the CPU interpreter, within a bfloat16 ulp on the GPU
    (:func:`kernel_cases.assert_same_outputs_but_tiling`). BV 64 > V 32 checks masking."""
    family, n, d, hk, hv, kdim, vdim = "gdn", 7, 4, 2, 4, 16, 32
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, torch.bfloat16, seed=31)
    last = torch.randint(-1, d, (n,), generator=torch.Generator().manual_seed(32))
    o_nat, pool_nat = sglang_native_round(params, x, pool, state_idx, last, family, n, d)
    inp = to_device(flat_inputs(x, family, n, d), DEVICE)
    pool_t = pool.to(DEVICE).clone()
    rec = CompactRecordBuffers.allocate(n, d, hk, hv, kdim, vdim, False, torch.bfloat16, DEVICE)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    o = compact_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                       inp["b"], pool_t, state_idx.to(DEVICE), rec, rec_idx, is_kda=False, tile=tile)
    compact_commit(pool_t, state_idx.to(DEVICE), rec, rec_idx, last.to(DEVICE), is_kda=False)
    real = (state_idx >= 0).to(DEVICE)
    assert_same_outputs_but_tiling(o.reshape(n, d, hv, vdim)[real], o_nat.reshape(n, d, hv, vdim)[real])
    assert torch.equal(pool_t, pool_nat)


@pytest.mark.gpu
def test_request_counts_1_to_511_compile_each_kernel_once():
    """Request counts run through 1..511: the verify and commit kernels compile once per shape
    (N is only the grid; T is do_not_specialize; strides and pointers do not depend on N)."""
    family, d, hk, hv = "gdn", 4, 2, 4
    params, x, pool, _ = make_case(family, 511, d, hk, hv, 16, 32, torch.float32, seed=33)
    inp = to_device(flat_inputs(x, family, 511, d), DEVICE)
    pool = pool.to(DEVICE)
    rec = CompactRecordBuffers.allocate(511, d, hk, hv, 16, 32, False, torch.bfloat16, DEVICE)
    idx = torch.arange(511, dtype=torch.int32, device=DEVICE)
    last = torch.full((511,), d - 1, dtype=torch.int64, device=DEVICE)
    before = (compiled_variants(verify_window_kernel), compiled_variants(compact_commit_kernel))
    for n in range(1, 512):
        t = slice(0, n * d)
        compact_verify(params.A_log.to(DEVICE), inp["a"][t], params.dt_bias.to(DEVICE), inp["q"][:, t], inp["k"][:, t],
                       inp["v"][:, t], inp["b"][:, t], pool, idx[:n], rec, idx[:n], is_kda=False)
        compact_commit(pool, idx[:n], rec, idx[:n], last[:n], is_kda=False)
    torch.cuda.synchronize()
    after = (compiled_variants(verify_window_kernel), compiled_variants(compact_commit_kernel))
    assert (after[0] - before[0], after[1] - before[1]) in {(1, 1), (0, 0)}, (before, after)


def _random_kernel_case(case: int, gen: torch.Generator):
    """One random speculative round: family, GQA group, odd or even batch with a padding row, D 2..5,
    chain or tree, state dtype, last accepted node -1..D-1 per row."""
    def pick(*options):
        return options[int(torch.randint(0, len(options), (1,), generator=gen))]

    family = pick("gdn", "kda")
    hk = pick(1, 2)
    hv = hk * (pick(1, 2) if family == "gdn" else 1)
    n, d = pick(1, 2, 3, 5), pick(2, 3, 4, 5)
    state_dtype = pick(torch.float32, torch.bfloat16)
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, 16, 16, state_dtype, seed=10_000 + case)
    last = torch.randint(-1, d, (n,), generator=gen)
    parents = random_tree_parents(n, d, gen) if pick(False, True) else None
    return family, hk, hv, n, d, params, x, pool, state_idx, last, parents


def _acceptance_cases(count: int):
    gen = torch.Generator().manual_seed(4242)
    for case in range(count):
        family, hk, hv, n, d, params, x, pool, state_idx, last, parents = _random_kernel_case(case, gen)
        o_nat, pool_nat = sglang_native_round(params, x, pool, state_idx, last, family, n, d, parents)
        o_cmp, pool_cmp, _ = _compact_round(params, x, pool, state_idx, last, family, n, d, hk, parents)
        real = (state_idx >= 0).to(DEVICE)
        assert torch.equal(o_cmp.reshape(n, d, -1)[real], o_nat.reshape(n, d, -1)[real]), case
        assert torch.equal(pool_cmp, pool_nat), case  # the whole pool


def test_random_acceptance_cases_through_the_kernels_sample():
    """The first 24 of the random acceptance cases through the kernels (the interpreter is slow); all
    1 000 run on the GPU below."""
    _acceptance_cases(24)


@pytest.mark.gpu
def test_random_acceptance_cases_through_the_kernels_1000():
    """1 000 random speculative rounds (GDN with and without GQA, KDA; chains and trees; float32 and
    bfloat16 states; accepted node -1..D-1; padding rows) through SGLang's native verify + scatter and
    compact's verify + commit: outputs and the whole pool bit for bit."""
    _acceptance_cases(1000)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("family,hk,hv", [("gdn", 2, 4), ("kda", 2, 2)])
def test_prefetching_token_inputs_changes_no_bit(family, hk, hv, tree):
    """``verify_window(prefetch=True)`` loads each token's inputs during the previous token's step instead of at
    the top of its own (served): outputs, records and stored per-step states are the same bits."""
    n, d = 5, 4
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, 16, 32, torch.float32, seed=23)
    parents = random_tree_parents(n, d, torch.Generator().manual_seed(24)).to(DEVICE) if tree else None
    inp = to_device(flat_inputs(x, family, n, d), DEVICE)
    pool = pool.to(DEVICE)
    idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    runs = []
    for prefetch in (True, False):
        rec = CompactRecordBuffers.allocate(n, d, hk, hv, 16, 32, family == "kda", torch.bfloat16, DEVICE)
        steps = torch.zeros(n, d, hv, 32, 16, dtype=pool.dtype, device=DEVICE)
        o = verify_window(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"],
                          inp["v"], inp["b"], pool, state_idx.to(DEVICE), is_kda=family == "kda", records=rec,
                          record_indices=idx, steps=steps, steps_indices=idx, retrieve_parent_token=parents,
                          prefetch=prefetch)
        runs.append((o, rec, steps))
    (o1, r1, s1), (o2, r2, s2) = runs
    assert torch.equal(o1, o2) and torch.equal(s1, s2) and (s1 != 0).any()
    for name in ("k", "v", "g", "beta"):
        assert torch.equal(getattr(r1, name), getattr(r2, name)), name
