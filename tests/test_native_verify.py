"""Our native verify (per-step state scratch, GDN and KDA) against SGLang 0.5.14's GDN/KDA-capable
fused kernel: outputs and every stored node state bit for bit, chain and tree. For KDA this is the
native baseline compact and replay are compared against (SGLang's KDA backend has no verify)."""

import pytest
import torch

from kernel_cases import (DEVICE, flat_inputs, make_case, random_tree_parents, sglang_accept, sglang_native_verify,
                          to_device)
from sglang_ssm_modes.ops.compact import CompactRecordBuffers, compact_commit, compact_verify
from sglang_ssm_modes.ops.native import native_verify
from sglang_ssm_modes.reference import tree_verify
from sglang_ssm_modes.reference.gating import sigmoid_beta


def _ours(params, x, pool, state_idx, family, n, d, parents=None, beta_activated=False):
    inp = to_device(flat_inputs(x, family, n, d), DEVICE)
    if beta_activated:
        inp["b"] = sigmoid_beta(inp["b"], torch.float32)
    hv, vdim, kdim = pool.shape[1:]
    pool = pool.to(DEVICE)
    before = pool.clone()
    inter = torch.zeros(n + 1, d, hv, vdim, kdim, dtype=pool.dtype, device=DEVICE)
    o = native_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                      inp["b"], pool, state_idx.to(DEVICE), inter, torch.arange(n, dtype=torch.int32, device=DEVICE),
                      is_kda=family == "kda", beta_activated=beta_activated,
                      retrieve_parent_token=None if parents is None else parents.to(DEVICE))
    assert torch.equal(pool, before)
    assert (inter[n] == 0).all(), "a scratch row no request owns was written"
    return o, inter[:n]


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv", [("gdn", 2, 4), ("kda", 2, 2)])
def test_native_verify_bit_identical_to_sglang_kernel(family, hk, hv, state_dtype, tree):
    _check_against_sglang(family, hk, hv, 16, 32, 5, 4, state_dtype, tree, seed=21 + hv)


def _check_against_sglang(family, hk, hv, kdim, vdim, n, d, state_dtype, tree, seed):
    """Outputs and every stored node state of our native verify equal SGLang's kernel, bit for bit."""
    params, x, pool, state_idx = make_case(family, n, d, hk, hv, kdim, vdim, state_dtype, seed=seed)
    parents = random_tree_parents(n, d, torch.Generator().manual_seed(seed + 1)) if tree else None
    o_sgl, inter_sgl = sglang_native_verify(params, x, pool, state_idx, family, n, d, parents)
    o_ours, inter_ours = _ours(params, x, pool, state_idx, family, n, d, parents)
    real = (state_idx >= 0).to(DEVICE)
    assert torch.equal(o_ours.reshape(n, d, hv, vdim)[real], o_sgl.reshape(n, d, hv, vdim)[real])
    assert torch.equal(inter_ours[real], inter_sgl[real])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_kda_verify_with_activated_beta(state_dtype):
    """Kimi-Linear hands the backend sigmoid(b) in extend/verify mode: our KDA native verify takes it
    as is, matches the reference tree verify within float tolerance, and compact commits
    bit-identically to it (the KDA baseline)."""
    n, d, hk, hv = 6, 4, 2, 2
    params, x, pool, state_idx = make_case("kda", n, d, hk, hv, 16, 32, state_dtype, seed=23)
    parents = random_tree_parents(n, d, torch.Generator().manual_seed(24))
    o, inter = _ours(params, x, pool, state_idx, "kda", n, d, parents, beta_activated=True)
    real = state_idx >= 0
    o_ref, steps_ref = tree_verify(pool[state_idx.clamp_min(0)], x, params, parents)
    assert torch.allclose(o.reshape(n, d, hv, 32)[real.to(DEVICE)].float().cpu(),
                          o_ref[real].to(torch.bfloat16).float(), atol=3e-2, rtol=3e-2)
    assert torch.allclose(inter[real.to(DEVICE)].float().cpu(), steps_ref[real].float(), atol=2e-2, rtol=2e-2)
    # compact against this baseline
    inp = to_device(flat_inputs(x, "kda", n, d), DEVICE)
    inp["b"] = sigmoid_beta(inp["b"], torch.float32)
    rec = CompactRecordBuffers.allocate(n, d, hk, hv, 16, 32, True, torch.bfloat16, DEVICE)
    rec_idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    last = torch.tensor([3, -1, 2, 0, 0, 1], device=DEVICE)  # row 3 is padding (its 0 must not commit)
    assert not real.all() and sorted(last[real.to(DEVICE)].tolist()) == list(range(-1, d)), "every accepted length"
    pool_cmp = pool.to(DEVICE).clone()
    o_cmp = compact_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                           inp["b"], pool_cmp, state_idx.to(DEVICE), rec, rec_idx, is_kda=True, beta_activated=True,
                           retrieve_parent_token=parents.to(DEVICE))
    compact_commit(pool_cmp, state_idx.to(DEVICE), rec, rec_idx, last, is_kda=True,
                   retrieve_parent_token=parents.to(DEVICE))
    assert torch.equal(o_cmp.reshape(n, d, hv, 32)[real.to(DEVICE)], o.reshape(n, d, hv, 32)[real.to(DEVICE)])
    pool_nat = pool.to(DEVICE).clone()
    sglang_accept(pool_nat, inter, state_idx.to(DEVICE), last)  # SGLang's acceptance scatter
    assert not torch.equal(pool_nat, pool.to(DEVICE)), "the scatter committed something"
    assert torch.equal(pool_cmp, pool_nat)


@pytest.mark.gpu
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,hk,hv", [("gdn", 16, 32), ("kda", 32, 32)])
def test_native_verify_bit_identical_real_shapes(family, hk, hv, state_dtype, tree):
    _check_against_sglang(family, hk, hv, 128, 128, 37, 6, state_dtype, tree, seed=25)
