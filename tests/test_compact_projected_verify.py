"""The projected compact verify (replay algebra, ``ops/compact/projected_verify.py``) against the verify it
replaces (``verify_window`` at native's tiling) and SGLang 0.5.14's native round: records bit for bit (whole
buffers), so the commit after it equals native's whole pool bit for bit; outputs within float32 rounding of
native's and of the float64 reference; the state never written. CPU interpreter at small shapes; the same at
real shapes on the GPU (marked ``gpu``)."""

import inspect

import pytest
import torch

from kernel_cases import DEVICE, compiled_variants, flat_inputs, make_case, sglang_native_round, to_device
from sglang_ssm_modes.ops.compact import CompactRecordBuffers, compact_commit, compact_verify
from sglang_ssm_modes.ops.compact.projected_verify import compact_projected_verify, compact_projected_verify_kernel
from sglang_ssm_modes.reference import compact_verify as reference_compact_verify


def _both_verifies(params, x, pool, state_idx, family, n, width, d, hk, tile, beta_activated=False):
    """``(o_window, rec_window, o_projected, rec_projected, pool)``: both verifies of the same inputs into fresh
    record buffers (record slot of request i: i + 1, slots 0 and n + 1 never written)."""
    inp = to_device(flat_inputs(x, family, n, width), DEVICE)
    if beta_activated:
        inp["b"] = torch.sigmoid(inp["b"].float()).to(inp["b"].dtype)
    hv, vdim, kdim = pool.shape[1:]
    pool = pool.to(DEVICE)
    before = pool.clone()
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE) + 1
    args = (params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"], inp["b"],
            pool, state_idx.to(DEVICE))
    kw = dict(is_kda=family == "kda", beta_activated=beta_activated)
    recs = [CompactRecordBuffers.allocate(n + 2, d, hk, hv, kdim, vdim, family == "kda", torch.bfloat16, DEVICE)
            for _ in range(2)]
    o_win = compact_verify(*args, recs[0], rec_idx, **kw)
    o_proj = compact_projected_verify(*args, recs[1], rec_idx, tile=tile, **kw)
    assert torch.equal(pool, before), "verify wrote the state"
    return o_win, recs[0], o_proj, recs[1], pool


def _assert_same_records(rec_a, rec_b):
    for name in ("k", "v", "g", "beta"):
        assert torch.equal(getattr(rec_a, name), getattr(rec_b, name)), name


def _assert_outputs_close(o, o_ref, real, shape):
    """bf16 outputs within one bf16 rounding (plus float32 noise) of ``o_ref`` (any float dtype)."""
    a = o.reshape(shape)[real].double()
    b = o_ref.reshape(shape)[real].double()
    assert ((a - b).abs() <= 2 ** -7 * b.abs() + 1e-4).all(), (a - b).abs().max().item()


CASES = [  # family, N (odd), window T, record capacity D, HK, HV, K, V, tile (BV, warps)
    ("gdn", 5, 4, 4, 2, 4, 16, 32, (16, 1)),    # GQA, two column tiles
    ("gdn", 3, 3, 4, 1, 2, 32, 40, (16, 2)),    # T < D, a part tile (V = 40)
    ("gdn", 7, 1, 1, 2, 2, 16, 16, (32, 1)),    # one token (plain decode through compact), BV > V
    ("kda", 5, 4, 4, 2, 2, 16, 32, (16, 1)),
    ("kda", 3, 5, 5, 1, 1, 16, 16, (16, 4)),    # T = 5: an unrolled tail past the window
]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_projected_verify_records_what_the_native_tiling_records(case, state_dtype):
    family, n, width, d, hk, hv, kdim, vdim, tile = case
    params, x, pool, state_idx = make_case(family, n, width, hk, hv, kdim, vdim, state_dtype, seed=n + width + vdim)
    o_win, rec_win, o_proj, rec_proj, pool_dev = _both_verifies(params, x, pool, state_idx, family, n, width, d, hk,
                                                                 tile)
    _assert_same_records(rec_win, rec_proj)  # whole buffers: padding row and unused slots stay zero
    assert (rec_proj.k[0] == 0).all() and (rec_proj.k[n + 1] == 0).all() and (rec_proj.v[1 + n // 2] == 0).all()
    real = (state_idx >= 0).to(DEVICE)
    shape = (n, width, hv, vdim)
    _assert_outputs_close(o_proj, o_win, real, shape)
    o_ref, _ = reference_compact_verify(pool[state_idx.clamp_min(0)], x, params, compute_dtype=torch.float64)
    _assert_outputs_close(o_proj, o_ref.to(DEVICE), real, shape)


@pytest.mark.parametrize("family,hk,hv", [("gdn", 2, 4), ("kda", 2, 2)])
def test_commit_after_the_projected_verify_is_sglangs_native_round(family, hk, hv):
    """Every accepted length 0..D among the real rows, a padding row with a real-looking one: the commit from
    the projected verify's records = SGLang's verify + scatter, whole pool bit for bit."""
    n, d = 7, 4
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, 16, 32, torch.bfloat16, seed=41)
    last = torch.full((n,), d - 1, dtype=torch.int64)
    for j, i in enumerate(i for i in range(n) if state_idx[i] >= 0):
        last[i] = (j % (d + 1)) - 1
    o_nat, pool_nat = sglang_native_round(params, x, pool, state_idx, last, family, n, d)
    _, _, o_proj, rec, pool_dev = _both_verifies(params, x, pool, state_idx, family, n, d, d, hk, (16, 1))
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE) + 1
    compact_commit(pool_dev, state_idx.to(DEVICE), rec, rec_idx, last.to(DEVICE), is_kda=family == "kda")
    assert torch.equal(pool_dev, pool_nat)
    _assert_outputs_close(o_proj, o_nat, (state_idx >= 0).to(DEVICE), (n, d, hv, 32))


def test_kimi_pre_activated_beta():
    """Kimi-Linear's extend path hands the backend sigmoid(b): records and outputs as the native tiling's."""
    n, d, hk, hv = 3, 4, 2, 2
    params, x, pool, state_idx = make_case("kda", n, d, hk, hv, 16, 32, torch.float32, seed=5)
    o_win, rec_win, o_proj, rec_proj, _ = _both_verifies(params, x, pool, state_idx, "kda", n, d, d, hk, (16, 1),
                                                          beta_activated=True)
    _assert_same_records(rec_win, rec_proj)
    _assert_outputs_close(o_proj, o_win, (state_idx >= 0).to(DEVICE), (n, d, hv, 32))


@pytest.mark.parametrize("bad,message", [
    (dict(tile=(8, 1)), "tile BV 8 must be a power of two >= 16"),
    (dict(tile=(24, 1)), "tile BV 24 must be a power of two >= 16"),
    (dict(kdim=24), "head_k_dim 24 must be a power of two >= 16"),
    (dict(d=2), "buffers hold 2 tokens per request, the window has 4"),
])
def test_bad_arguments_are_refused(bad, message):
    n, width, hk, hv, vdim = 3, 4, 1, 2, 16
    kdim = bad.get("kdim", 16)
    params, x, pool, state_idx = make_case("gdn", n, width, hk, hv, kdim, vdim, torch.float32, seed=1)
    inp = flat_inputs(x, "gdn", n, width)
    rec = CompactRecordBuffers.allocate(n, bad.get("d", width), hk, hv, kdim, vdim, False, torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        compact_projected_verify(params.A_log, inp["a"], params.dt_bias, inp["q"], inp["k"], inp["v"], inp["b"], pool,
                                 state_idx, rec, torch.arange(n, dtype=torch.int32), is_kda=False,
                                 tile=bad.get("tile", (16, 1)))


def test_request_count_is_not_a_compile_time_constant():
    """N only sets the grid; the window length T is marked do_not_specialize."""
    params = inspect.signature(compact_projected_verify_kernel.fn).parameters
    assert not any(name in params for name in ("N", "B", "batch", "num_requests"))
    jit = compact_projected_verify_kernel
    marked = getattr(jit, "do_not_specialize", None) or jit.kwargs.get("do_not_specialize", [])  # JIT / interpreter
    assert {jit.arg_names[i] if isinstance(i, int) else i for i in marked} == {"T"}


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv", [("gdn", 16, 32), ("kda", 32, 32)])
@pytest.mark.parametrize("n,d", [(1, 4), (7, 2), (33, 4), (64, 8)])
@pytest.mark.parametrize("tile", [(32, 4), (16, 1), (64, 4)])
def test_projected_verify_real_shapes(family, hk, hv, n, d, state_dtype, tile):
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, 128, 128, state_dtype, seed=n * d)
    last = torch.randint(-1, d, (n,), generator=torch.Generator().manual_seed(n))
    o_nat, pool_nat = sglang_native_round(params, x, pool, state_idx, last, family, n, d)
    o_win, rec_win, o_proj, rec_proj, pool_dev = _both_verifies(params, x, pool, state_idx, family, n, d, d, hk, tile)
    _assert_same_records(rec_win, rec_proj)
    real = (state_idx >= 0).to(DEVICE)
    _assert_outputs_close(o_proj, o_nat, real, (n, d, hv, 128))
    compact_commit(pool_dev, state_idx.to(DEVICE), rec_proj, torch.arange(n, dtype=torch.int32, device=DEVICE) + 1,
                   last.to(DEVICE), is_kda=family == "kda")
    assert torch.equal(pool_dev, pool_nat)


@pytest.mark.gpu
def test_request_counts_1_to_511_compile_once():
    """One variant per (state dtype, D, tile) whatever the request count: Triton would otherwise specialise
    integer arguments equal to 1 or divisible by 16 (none of the kernel's depends on N)."""
    hk, hv, d = 16, 32, 4
    params, x, pool, _ = make_case("gdn", 511, d, hk, hv, 128, 128, torch.float32, seed=3)
    inp = to_device(flat_inputs(x, "gdn", 511, d), DEVICE)
    pool = pool.to(DEVICE)
    rec = CompactRecordBuffers.allocate(511, d, hk, hv, 128, 128, False, torch.bfloat16, DEVICE)
    before = compiled_variants(compact_projected_verify_kernel)
    for n in range(1, 512):
        idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
        compact_projected_verify(params.A_log.to(DEVICE), inp["a"][:n * d], params.dt_bias.to(DEVICE),
                                 inp["q"][:, :n * d], inp["k"][:, :n * d], inp["v"][:, :n * d], inp["b"][:, :n * d],
                                 pool, idx, rec, idx, is_kda=False)
    assert compiled_variants(compact_projected_verify_kernel) - before <= 1
