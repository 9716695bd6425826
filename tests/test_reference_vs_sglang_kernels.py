"""SGLang 0.5.14's own Triton kernels against the plain-torch references in
:mod:`sglang_ssm_modes.reference`.

Kernels exercised (all from ``sglang.srt.layers.attention.fla``), called the way
``linear/kernels/gdn_triton.py`` / ``kda_triton.py`` call them:

* ``fused_sigmoid_gating_delta_rule_update`` — chain verify (``disable_state_update`` + intermediate
  states), tree verify (``retrieve_parent_token``) and decode (state written back);
* ``fused_recurrent_gated_delta_rule_packed_decode`` / ``fused_recurrent_kda_packed_decode``;
* ``chunk_gated_delta_rule`` (after ``fused_gdn_gating``) and ``chunk_kda`` — varlen chunked prefill.

On a machine without a GPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set
below before triton is imported). What the interpreter does differently from a GPU, and how these
tests account for it:

* ``x.to(tl.bfloat16)`` truncates (rounds toward zero) in the interpreter, rounds to nearest-even on a
  GPU: :func:`kernel_round` reproduces whichever applies, bit for bit.
* Triton 3.8's interpreter cannot run parts of the chunk kernels as they are; the module fixture
  ``interpreter_shims`` patches the *emulator*, never SGLang's arithmetic (each item says why):
  FLA's ``exp = tl.exp``-style aliases in ``fla/op.py`` are not patched by the interpreter (calls fail
  with "Did you forget to add @triton.jit"); ``tl.dot`` on bf16 operands multiplies the raw uint16
  bit patterns (only fp8 operands are converted); autotuning needs a GPU benchmarker;
  ``fla.utils.input_guard`` enters ``torch.cpu.device(...)``, which does not exist. A guard makes any
  bf16 elementwise arithmetic in an interpreted kernel fail loudly (the interpreter would compute it on
  raw bits), so no result here silently depends on that gap.
"""

from __future__ import annotations

import os

import torch

# Before triton (and SGLang's fla kernels, decorated at import) is imported: the interpreter on a
# machine without CUDA (the conftest does the same); on the GPU machine the kernels run compiled.
if os.environ.get("SSM_MODES_FORCE_GPU") != "1" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools
import zlib

import numpy as np
import pytest
import triton.language as tl

from sglang_ssm_modes.reference import chain_verify, chunked_prefill, decode, prepare, tree_verify
from sglang_ssm_modes.reference.gating import GateParams, LinearAttnInputs
from sglang_ssm_modes.reference.native import delta_rule_step
from sglang_ssm_modes.reference.random_layer import random_gate_params, random_inputs, random_state

from sglang.srt.layers.attention.fla import chunk as fla_chunk  # noqa: E402  (after TRITON_INTERPRET)
from sglang.srt.layers.attention.fla import kda as fla_kda
from sglang.srt.layers.attention.fla.fused_gdn_gating import fused_gdn_gating
from sglang.srt.layers.attention.fla.fused_recurrent import (
    fused_recurrent_gated_delta_rule_packed_decode,
    fused_recurrent_kda_packed_decode,
)
from sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent import fused_sigmoid_gating_delta_rule_update

from interpreter_shims import sglang_fla_on_cpu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if not INTERPRET and torch.cuda.is_available() else "cpu")

# Shapes: GQA for GDN (value head h reads key head h // 2), key heads = value heads for KDA (Kimi).
# V = 48 is not a power of two and spans two BV = 32 tiles of the recurrent kernels (masking and the
# i_v offset are exercised); K = 16 keeps the interpreter fast. Observed figures quoted in comments
# are from this file's [observed] lines, on the CPU interpreter and on an H200 (Triton 3.6, compiled).
HEADS = {"gdn": (2, 4), "kda": (4, 4)}
K_DIM, V_DIM = 16, 48
D = 4  # verify width (draft tokens incl. the base token)
ACT = torch.bfloat16  # activation dtype of q, k, v, a, b (as the models run)

BF16_EPS = 2.0 ** -8  # bf16 ulp at 1.0 (8 significand bits incl. the implicit one)
FP16_EPS = 2.0 ** -11
# Outputs are stored in bf16 from a float32 value that differs from the reference's by float32 noise:
# at most this fraction of output elements may land on the neighbouring bf16 value.
OUT_FRACTION = 5e-3


# ----------------------------------------------------------------------------------------------------
# Interpreter shims (module scope, restored afterwards; only under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def interpreter_shims():
    with sglang_fla_on_cpu():
        yield


# ----------------------------------------------------------------------------------------------------
# Rounding and comparison helpers
# ----------------------------------------------------------------------------------------------------

def kernel_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) converted to ``dtype`` the way a kernel's ``.to(dtype)`` does it here: bf16
    truncates under the interpreter (exact bit truncation), rounds to nearest-even on a GPU."""
    x = x.float()
    if dtype == torch.bfloat16 and INTERPRET:
        return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return x.to(dtype)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (normal range)."""
    e = torch.floor(torch.log2(x.float().abs().clamp_min(2.0 ** -126)))
    return torch.pow(2.0, e - 7)


def assert_close(actual, expected, *, rtol, atol, what):
    """All elements within ``atol + rtol * |expected|``; returns the max abs difference."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    diff = (actual - expected).abs()
    bad = diff > atol + rtol * expected.abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{bad.numel()} elements off, max |diff| "
                           f"{diff.max().item():.3e} (atol {atol}, rtol {rtol})")
    return diff.max().item()


def assert_bf16_rounding_of(actual_bf16, ref32, *, max_fraction, what, atol=4e-6):
    """``actual_bf16`` equals :func:`kernel_round` of the float32 ``ref32`` except at a fraction of
    elements <= ``max_fraction``: the kernel's float32 value differs from the reference's by float32
    noise (reduction order, exp; ``atol`` + ``atol`` * |ref|, as the float32 comparisons), which moves a
    rounding boundary only rarely. At those elements the difference is at most one bf16 ulp plus that
    noise (an element that is itself tiny from cancellation can carry an absolute error larger than its
    own ulp). Returns (fraction of mismatches, max |diff| in bf16 ulps of the element)."""
    assert actual_bf16.dtype == torch.bfloat16
    actual_bf16, ref32 = actual_bf16.cpu(), ref32.cpu().float()
    expected = kernel_round(ref32, torch.bfloat16)
    mismatch = actual_bf16 != expected
    fraction = mismatch.float().mean().item()
    diff = (actual_bf16.float() - expected.float()).abs()
    ulp = bf16_ulp(torch.maximum(actual_bf16.float().abs(), expected.float().abs()))
    assert fraction <= max_fraction, f"{what}: {fraction:.2e} of elements differ from the rounded reference"
    bad = diff > ulp + atol + atol * ref32.abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements more than 1 bf16 ulp (+ float32 noise) "
                           f"from the rounded reference, max {(diff / ulp).max().item():.2f} ulps")
    return fraction, (diff / ulp).max().item()


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def observed(msg: str) -> None:
    print(f"[observed] {msg}")  # shown with -s / -rP; the figures quoted in the tolerance comments


# ----------------------------------------------------------------------------------------------------
# Batch assembly: real requests at scattered pool slots plus padding rows
# ----------------------------------------------------------------------------------------------------

def _nan_like_inputs(x: LinearAttnInputs) -> LinearAttnInputs:
    """A padding row's garbage: NaN everywhere (q, k, v, gate and beta logits)."""
    return LinearAttnInputs(*(torch.full_like(t, float("nan")) for t in (x.q, x.k, x.v, x.a, x.b)))


def _flatten(rows: list[LinearAttnInputs]):
    """Concatenate per-request inputs ``[1, T_i, ...]`` into SGLang's varlen layout on DEVICE:
    q, k, v, b as ``[1, total, H, *]``, a as 2-D ``[total, HV]`` (GDN) / ``[total, HV*K]`` (KDA), and
    ``cu_seqlens`` (int32, SGLang's ``query_start_loc``)."""
    cat = lambda name: torch.cat([getattr(r, name) for r in rows], 1)  # noqa: E731
    q, k, v, a, b = (cat(n) for n in ("q", "k", "v", "a", "b"))
    lens = [r.k.shape[1] for r in rows]
    cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32)
    total = q.shape[1]
    return dict(q=q.to(DEVICE), k=k.to(DEVICE), v=v.to(DEVICE), a=a.reshape(total, -1).to(DEVICE),
                b=b.to(DEVICE), cu=cu.to(DEVICE))


def _params_on_device(p: GateParams):
    return p.A_log.to(DEVICE), p.dt_bias.to(DEVICE)


def _row(x: LinearAttnInputs, i: int) -> LinearAttnInputs:
    return LinearAttnInputs(*(t[i:i + 1] for t in (x.q, x.k, x.v, x.a, x.b)))


def _verify_setup(family, state_dtype, tag):
    """3 real requests with D tokens each at pool slots [5, 1, 6] (pool of 8, random contents),
    intermediate slots [2, 0, 5] (buffer of 7, random contents), and two padding rows in SGLang's
    forms: a HOLD row with D NaN tokens, pool slot -1 and intermediate slot -1 (between real rows), and
    a CUDA-graph padding row with zero tokens, pool slot -1 and intermediate slot 4 (its arange position,
    as ``verify_intermediate_state_indices`` gives it)."""
    hk, hv = HEADS[family]
    g = seeded(tag, family, str(state_dtype))
    p = random_gate_params(family, hv, K_DIM, g)
    x = random_inputs(family, 3, D, hk, hv, K_DIM, V_DIM, g, ACT)
    s = random_state(3, hv, V_DIM, K_DIM, g, state_dtype)
    pool = random_state(8, hv, V_DIM, K_DIM, g, state_dtype)
    slots = torch.tensor([5, 1, 6])
    pool[slots] = s
    inter = random_state(7 * D, hv, V_DIM, K_DIM, g, state_dtype).reshape(7, D, hv, V_DIM, K_DIM)
    hold = _nan_like_inputs(_row(x, 0))
    empty = _row(x, 0).tokens(0, 0)
    rows = [_row(x, 0), _row(x, 1), hold, _row(x, 2), empty]
    batch = _flatten(rows)
    batch["pool_idx"] = torch.tensor([5, 1, -1, 6, -1], dtype=torch.int32, device=DEVICE)
    batch["inter_idx"] = torch.tensor([2, 0, -1, 5, 4], dtype=torch.int32, device=DEVICE)
    real_tokens = torch.cat([torch.arange(0, D), torch.arange(D, 2 * D), torch.arange(3 * D, 4 * D)])
    hold_tokens = torch.arange(2 * D, 3 * D)
    return p, x, s, pool, inter, slots, batch, real_tokens, hold_tokens


def _run_verify(family, p, pool, inter, batch, parents=None):
    A_log, dt_bias = _params_on_device(p)
    pool_dev, inter_dev = pool.clone().to(DEVICE), inter.clone().to(DEVICE)
    o = fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, a=batch["a"], dt_bias=dt_bias, softplus_beta=1.0, softplus_threshold=20.0,
        q=batch["q"], k=batch["k"], v=batch["v"], b=batch["b"],
        initial_state_source=pool_dev, initial_state_indices=batch["pool_idx"],
        use_qk_l2norm_in_kernel=True, cu_seqlens=batch["cu"], is_kda=family == "kda",
        disable_state_update=True, intermediate_states_buffer=inter_dev,
        intermediate_state_indices=batch["inter_idx"], cache_steps=D,
        retrieve_parent_token=None if parents is None else parents.to(DEVICE))
    return o.cpu(), pool_dev.cpu(), inter_dev.cpu()


def _check_verify_common(o, pool_after, pool, inter_after, inter, real_tokens, hold_tokens, what):
    # disable_state_update: the whole pool, real and padding slots alike, is bit-unchanged.
    assert torch.equal(pool_after, pool), f"{what}: verify wrote the state pool"
    # Intermediate slots nobody owns (1, 3, 6) and the zero-token padding row's slot 4 are untouched.
    untouched = torch.tensor([1, 3, 4, 6])
    assert torch.equal(inter_after[untouched], inter[untouched]), f"{what}: untouched intermediate slots changed"
    # The HOLD row's NaN inputs stay in its own outputs: every real output is finite.
    assert torch.isfinite(o[0, real_tokens]).all(), f"{what}: non-finite output in a real request"
    assert o[0, hold_tokens].isnan().any(), "the NaN padding row was expected to produce NaN outputs"


# ----------------------------------------------------------------------------------------------------
# 1. Chain verify (EAGLE / NEXTN topk = 1)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_chain_verify_matches_reference(family, state_dtype):
    p, x, s, pool, inter, slots, batch, real_tokens, hold_tokens = _verify_setup(family, state_dtype, "chain")
    o, pool_after, inter_after = _run_verify(family, p, pool, inter, batch)
    what = f"chain verify {family} {state_dtype}"
    _check_verify_common(o, pool_after, pool, inter_after, inter, real_tokens, hold_tokens, what)
    hv = HEADS[family][1]
    o_real = o[0, real_tokens].reshape(3, D, hv, V_DIM)
    steps = inter_after[torch.tensor([2, 0, 5])]  # [3, D, HV, V, K]

    # Reference in float32 with the state kept unrounded across the window (s.float() is exact).
    o_ref, steps32 = chain_verify(s.float(), x, p)
    # Outputs are stored in the activation dtype (bf16): the kernel's rounding of its float32 output.
    # Tolerance: <= 0.5% of elements one bf16 ulp off (observed <= 8.7e-4, i.e. 2 of 2304).
    frac, _ = assert_bf16_rounding_of(o_real, o_ref, max_fraction=OUT_FRACTION, what=f"{what} outputs")
    if state_dtype == torch.float32:
        # float32 states: same recurrence, different reduction order / exp implementation.
        # atol/rtol 4e-6 (a few float32 ulps of entries ~1 after 4 steps; observed <= 1.2e-6).
        diff = assert_close(steps, steps32, rtol=4e-6, atol=4e-6, what=f"{what} stored states")
        observed(f"{what}: outputs {frac:.2e} off by 1 ulp; states max |diff| {diff:.2e}")
    else:
        # bf16 states: SGLang keeps the state in float32 across the window and rounds only the stored
        # copies, so each stored step is round(S_t) of the *unrounded* float32 chain. Tolerance: at most
        # 0.1% of elements one bf16 ulp off (observed <= 1.7e-4, 6 of 36864); rounding per step instead
        # would be off at a quarter to half of them (checked below).
        sfrac, _ = assert_bf16_rounding_of(steps, steps32, max_fraction=1e-3, what=f"{what} stored states")
        h, per_step = s, []
        for t in range(D):  # the counterfactual: rounding after every step (decode-style)
            _, h32 = decode(h.float(), x.tokens(t, t + 1), p)
            h = kernel_round(h32, torch.bfloat16)
            per_step.append(h)
        per_step_frac = (torch.stack(per_step, 1) != steps).float().mean().item()
        assert per_step_frac > 10 * max(sfrac, 1e-4), "per-step rounding unexpectedly matches chain verify"
        observed(f"{what}: outputs {frac:.2e} off by 1 ulp; states {sfrac:.2e} off by 1 ulp "
                 f"(per-step rounding would differ at {per_step_frac:.2e})")


# ----------------------------------------------------------------------------------------------------
# 2. Tree verify (EAGLE topk > 1): each node starts from its parent's stored (rounded) state
# ----------------------------------------------------------------------------------------------------

TREE_PARENTS = torch.tensor([
    [0, 0, 0, 1],  # node 1 and 2 children of the root, node 3 child of node 1
    [0, 0, 1, 2],  # a chain written as a tree (still reloaded from the rounded copies)
    [0, 0, 0, 0],  # HOLD row
    [0, 0, 1, 1],  # node 2 and 3 siblings under node 1
    [0, 0, 0, 0],  # zero-token padding row
], dtype=torch.int32)  # SGLang's retrieve_parent_token buffers are int32 [bs, draft_token_num]


def _tree_emulation(s, x, p, parents, state_dtype):
    """The kernel's tree walk from the reference's decode step: node t starts from the rounded stored
    state of its parent (kernel_round, i.e. truncation under the interpreter)."""
    n = s.shape[0]
    outs, stored = [], []
    for t in range(D):
        if t == 0:
            h0 = s
        else:
            h0 = torch.stack(stored, 1)[torch.arange(n), parents[:, t].long()]
        o, h32 = decode(h0.float(), x.tokens(t, t + 1), p)
        outs.append(o[:, 0])
        stored.append(kernel_round(h32, state_dtype))
    return torch.stack(outs, 1), torch.stack(stored, 1)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_tree_verify_matches_reference(family, state_dtype):
    p, x, s, pool, inter, slots, batch, real_tokens, hold_tokens = _verify_setup(family, state_dtype, "tree")
    o, pool_after, inter_after = _run_verify(family, p, pool, inter, batch, parents=TREE_PARENTS)
    what = f"tree verify {family} {state_dtype}"
    _check_verify_common(o, pool_after, pool, inter_after, inter, real_tokens, hold_tokens, what)
    hv = HEADS[family][1]
    o_real = o[0, real_tokens].reshape(3, D, hv, V_DIM)
    steps = inter_after[torch.tensor([2, 0, 5])]
    parents = TREE_PARENTS[[0, 1, 3]]

    o_ref, steps_ref = tree_verify(s, x, p, parents)  # the reference itself (torch rounding: RNE)
    if state_dtype == torch.float32:
        # float32: rounding is the identity; atol/rtol 4e-6 as for the chain (observed <= 1.4e-6).
        diff = assert_close(steps, steps_ref, rtol=4e-6, atol=4e-6, what=f"{what} stored states")
        frac, _ = assert_bf16_rounding_of(o_real, o_ref, max_fraction=OUT_FRACTION, what=f"{what} outputs")
        observed(f"{what}: states max |diff| {diff:.2e}; outputs {frac:.2e} off by 1 ulp")
        return
    # bf16: the state is rounded at every node, so the interpreter's truncation and torch's RNE in the
    # reference diverge by up to one ulp per rounding, and truncation is biased (toward zero), so the
    # differences add up along a path (depth + 1 roundings) and the recurrence spreads them over the
    # head's [V, K] block. Bound: 2 * (depth + 1) ulps of the largest entry of that head's state, per
    # node (the "<= 2 ulp" one might expect holds only at the root; observed: 1 ulp at depth 0, 2 at
    # depth 1, up to 4 at depth 2 and 3 at depth 3). On a GPU both round to nearest-even (observed on
    # the H200: <= 0.5 ulp of the head max).
    depth = torch.zeros_like(parents)
    for t in range(1, D):
        depth[:, t] = depth.gather(1, parents[:, t:t + 1].long())[:, 0] + 1
    head_max = steps_ref.float().abs().amax(dim=(-1, -2), keepdim=True)  # [3, D, HV, 1, 1]
    err = (steps.float() - steps_ref.float()).abs()
    bound = 2 * (depth[:, :, None, None, None] + 1) * bf16_ulp(head_max)
    assert (err <= bound).all(), f"{what}: states differ from the reference by more than 2 ulps per rounding"
    per_node = (err / bf16_ulp(head_max)).amax(dim=(-1, -2, -3))
    observed(f"{what}: vs reference (RNE) max |diff| {err.max().item():.3e}; in ulps of the head max per "
             f"node {per_node.tolist()} (depths {depth.tolist()})")
    # And exactly: the same walk with the kernel's rounding (truncation here) reproduces the stored
    # states up to rare 1-ulp boundary cases (<= 0.1%; observed <= 1.7e-4), and the outputs likewise.
    o_emu, steps_emu = _tree_emulation(s, x, p, parents, state_dtype)
    sfrac, _ = assert_bf16_rounding_of(steps, steps_emu.float(), max_fraction=1e-3, what=f"{what} stored states")
    ofrac, _ = assert_bf16_rounding_of(o_real, o_emu, max_fraction=OUT_FRACTION, what=f"{what} outputs")
    observed(f"{what}: vs kernel-rounding emulation: states {sfrac:.2e}, outputs {ofrac:.2e} off by 1 ulp")


# ----------------------------------------------------------------------------------------------------
# 3. Decode: the generic kernel (state written back) and the packed decode kernels
# ----------------------------------------------------------------------------------------------------

DECODE_STEPS = 2


def _decode_setup(family, state_dtype, tag):
    """3 real requests at pool slots [5, 1, 6] of 8 (random contents) and a padding row (slot -1, NaN
    inputs) in the middle, as SGLang pads decode batches (mamba_cache_indices = -1)."""
    hk, hv = HEADS[family]
    g = seeded(tag, family, str(state_dtype))
    p = random_gate_params(family, hv, K_DIM, g)
    x = random_inputs(family, 3, DECODE_STEPS, hk, hv, K_DIM, V_DIM, g, ACT)
    s = random_state(3, hv, V_DIM, K_DIM, g, state_dtype)
    pool = random_state(8, hv, V_DIM, K_DIM, g, state_dtype)
    pool[torch.tensor([5, 1, 6])] = s
    pool_idx = torch.tensor([5, 1, -1, 6], dtype=torch.int32, device=DEVICE)
    return p, x, s, pool, pool_idx


def _decode_token(x: LinearAttnInputs, t: int) -> list[LinearAttnInputs]:
    """Token t of each real request, with the NaN padding row inserted at batch position 2."""
    rows = [_row(x.tokens(t, t + 1), i) for i in range(3)]
    return rows[:2] + [_nan_like_inputs(rows[0])] + rows[2:]


def _emulate_decode(s, x, p, state_dtype, round_beta_to=None):
    """Reference decode step by step, the state rounded after every token the kernel's way.
    ``round_beta_to``: round beta to that dtype first (the GDN packed kernel does, see below)."""
    h, outs = s, []
    for t in range(DECODE_STEPS):
        xt = x.tokens(t, t + 1)
        if round_beta_to is None:
            o, h32 = decode(h.float(), xt, p)
            o = o[:, 0]
        else:
            pr = prepare(xt, p, torch.float32)
            beta = kernel_round(pr.beta[:, 0], round_beta_to).float()
            h32, o, _ = delta_rule_step(h.float(), pr.q[:, 0], pr.k[:, 0], pr.v[:, 0], pr.g[:, 0], beta)
        h = kernel_round(h32, state_dtype)
        outs.append(o)
    return torch.stack(outs, 1), h


def _check_decode(o_steps, pool_after, pool, s, x, p, state_dtype, what, round_beta_to=None):
    real = torch.tensor([0, 1, 3])
    o_real = torch.stack([o[real] for o in o_steps], 1)  # [3, steps, HV, V]
    assert torch.isfinite(o_real).all(), f"{what}: non-finite output in a real request"
    # Full pool: slots 5, 1, 6 hold the decoded states, every other slot (0, 2, 3, 4, 7) is bit-unchanged.
    other = torch.tensor([0, 2, 3, 4, 7])
    assert torch.equal(pool_after[other], pool[other]), f"{what}: decode wrote slots it does not own"
    new = pool_after[torch.tensor([5, 1, 6])]
    o_emu, h_emu = _emulate_decode(s, x, p, state_dtype, round_beta_to)
    if state_dtype == torch.float32:
        # atol/rtol 4e-6: float32 reduction order / exp over 2 steps (observed <= 1.8e-6).
        diff = assert_close(new, h_emu, rtol=4e-6, atol=4e-6, what=f"{what} states")
        if round_beta_to is None:  # the reference's own decode, unchanged
            o_ref, h_ref = decode(s, x, p)
            assert_close(new, h_ref, rtol=4e-6, atol=4e-6, what=f"{what} states vs reference decode")
    else:
        # bf16: rounded after every token; <= 0.1% of elements one ulp off (observed <= 1.1e-4).
        frac, _ = assert_bf16_rounding_of(new, h_emu.float(), max_fraction=1e-3, what=f"{what} states")
        diff = frac
    ofrac, _ = assert_bf16_rounding_of(o_real, o_emu, max_fraction=OUT_FRACTION, what=f"{what} outputs")
    observed(f"{what}: states {'max |diff|' if state_dtype == torch.float32 else 'fraction 1 ulp off'} "
             f"{diff:.2e}; outputs {ofrac:.2e} off by 1 ulp")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_decode_matches_reference(family, state_dtype):
    """``fused_sigmoid_gating_delta_rule_update`` as ``TritonGDNKernel.decode`` / ``TritonKDAKernel.decode``
    call it: one token per request (``cu_seqlens`` = arange), the state written back every token."""
    p, x, s, pool, pool_idx = _decode_setup(family, state_dtype, "decode")
    A_log, dt_bias = _params_on_device(p)
    pool_dev = pool.clone().to(DEVICE)
    outs = []
    for t in range(DECODE_STEPS):
        batch = _flatten(_decode_token(x, t))
        o = fused_sigmoid_gating_delta_rule_update(
            A_log=A_log, dt_bias=dt_bias, q=batch["q"], k=batch["k"], v=batch["v"], a=batch["a"],
            b=batch["b"], initial_state_source=pool_dev, initial_state_indices=pool_idx,
            cu_seqlens=batch["cu"], use_qk_l2norm_in_kernel=True, softplus_beta=1.0,
            softplus_threshold=20.0, is_kda=family == "kda")
        outs.append(o[0].cpu())  # [4 tokens, HV, V]
    _check_decode(outs, pool_dev.cpu(), pool, s, x, p, state_dtype, f"decode {family} {state_dtype}")


def _packed(batch, family):
    """The post-conv packed projection ``mixed_qkv`` [B, q_dim + k_dim + v_dim] and a, b as the
    packed decode kernels take them (a: [B, HV] GDN / [B, HV*K] KDA; b: [B, HV] raw logits)."""
    q, k, v = (batch[n][0].flatten(1) for n in ("q", "k", "v"))
    return torch.cat([q, k, v], 1).contiguous(), batch["a"].contiguous(), batch["b"][0].contiguous()


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_packed_decode_matches_reference(family, state_dtype):
    """``fused_recurrent_*_packed_decode`` as ``TritonGDNKernel`` / ``TritonKDAKernel.packed_decode`` call
    them (the CUDA decode path of SGLang 0.5.14 with the Triton backend).

    Finding: the GDN packed kernel rounds beta to the dtype of ``b`` (``tl.sigmoid(b).to(b.dtype)``,
    fused_recurrent.py, packed decode kernel), the generic decode/verify kernel and the KDA packed kernel
    keep it in float32. The GDN case is compared with the reference decode on a beta rounded that way;
    the reference's own decode (float32 beta) is shown to differ beyond float32 noise."""
    p, x, s, pool, pool_idx = _decode_setup(family, state_dtype, "packed")
    hv = HEADS[family][1]
    A_log, dt_bias = _params_on_device(p)
    pool_dev = pool.clone().to(DEVICE)
    outs = []
    for t in range(DECODE_STEPS):
        mixed_qkv, a, b = _packed(_flatten(_decode_token(x, t)), family)
        out = mixed_qkv.new_empty(4, 1, hv, V_DIM)
        kernel = (fused_recurrent_gated_delta_rule_packed_decode if family == "gdn"
                  else fused_recurrent_kda_packed_decode)
        kernel(mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log.reshape(-1), dt_bias=dt_bias.reshape(-1),
               scale=K_DIM ** -0.5, initial_state=pool_dev, out=out, ssm_state_indices=pool_idx,
               use_qk_l2norm_in_kernel=True)
        out = out.cpu()
        assert torch.equal(out[2], torch.zeros_like(out[2])), "packed decode: padding row output not zero"
        outs.append(out[:, 0])
    round_beta = ACT if family == "gdn" else None
    what = f"packed decode {family} {state_dtype}"
    _check_decode(outs, pool_dev.cpu(), pool, s, x, p, state_dtype, what, round_beta_to=round_beta)
    if family == "gdn" and state_dtype == torch.float32:
        _, h_ref = decode(s, x, p)
        dev = (pool_dev.cpu()[torch.tensor([5, 1, 6])] - h_ref).abs().max().item()
        observed(f"{what}: vs the reference decode with float32 beta: max |diff| {dev:.2e}")
        assert dev > 1e-4, "GDN packed decode no longer rounds beta to bf16?"


# ----------------------------------------------------------------------------------------------------
# 4. Chunked prefill (varlen, two sequences across the 64-token chunk boundary)
# ----------------------------------------------------------------------------------------------------

PREFILL_LENS = (37, 70)
PREFILL_K, PREFILL_V = 32, 48
PREFILL_SLOTS = (4, 1)


def _prefill_setup(family, act_dtype, state_dtype):
    hk, hv = HEADS[family]
    g = seeded("prefill", family, str(act_dtype), str(state_dtype))
    p = random_gate_params(family, hv, PREFILL_K, g)
    xs = [random_inputs(family, 1, n, hk, hv, PREFILL_K, PREFILL_V, g, act_dtype) for n in PREFILL_LENS]
    s = random_state(len(xs), hv, PREFILL_V, PREFILL_K, g, state_dtype)
    pool = random_state(6, hv, PREFILL_V, PREFILL_K, g, state_dtype)
    pool[torch.tensor(PREFILL_SLOTS)] = s
    return p, xs, s, pool


@functools.lru_cache(maxsize=None)
def _run_prefill(family, act_dtype, state_dtype):
    """SGLang's extend path for one layer; returns (params, inputs, initial states, pool before,
    outputs [total, HV, V], pool after)."""
    p, xs, s, pool = _prefill_setup(family, act_dtype, state_dtype)
    batch = _flatten(xs)
    idx = torch.tensor(PREFILL_SLOTS, dtype=torch.int32, device=DEVICE)
    A_log, dt_bias = _params_on_device(p)
    pool_dev = pool.clone().to(DEVICE)
    if family == "gdn":
        # GDNAttnBackend.forward_extend: g, beta = fused_gdn_gating(A_log, a, b, dt_bias) on the 2-D
        # [tokens, HV] a and b, then TritonGDNKernel.extend -> chunk_gated_delta_rule.
        gate, beta = fused_gdn_gating(A_log, batch["a"], batch["b"][0], dt_bias)
        o, _, _ = fla_chunk.chunk_gated_delta_rule(
            q=batch["q"], k=batch["k"], v=batch["v"], g=gate, beta=beta, initial_state=pool_dev,
            initial_state_indices=idx, cu_seqlens=batch["cu"], head_first=False, use_qk_l2norm_in_kernel=True)
    else:
        # KimiDeltaAttention.forward (extend): the raw gate unflattened to [1, T, H, K], beta =
        # sigmoid(b.float()); KDAAttnBackend.forward_extend -> TritonKDAKernel.extend -> chunk_kda with
        # A_log (Kimi's [1, 1, H, 1] parameter), dt_bias [H*K], lower_bound None. chunk_kda writes its
        # output into v's buffer (o=v), so it gets its own copy.
        hv = HEADS[family][1]
        o = fla_kda.chunk_kda(
            q=batch["q"], k=batch["k"], v=batch["v"].clone(), g=batch["a"].reshape(1, -1, hv, PREFILL_K),
            beta=batch["b"].float().sigmoid(), initial_state=pool_dev, initial_state_indices=idx,
            use_qk_l2norm_in_kernel=True, cu_seqlens=batch["cu"], A_log=A_log.reshape(1, 1, hv, 1),
            dt_bias=dt_bias, lower_bound=None)
    return p, xs, s, pool, o[0].cpu(), pool_dev.cpu()


def _prefill_tolerance(act_dtype):
    # The chunk kernels round by design: l2norm_fwd writes normalised q, k in the activation dtype; w, u
    # and the state operand of w @ S are cast to it before tl.dot; GDN's beta is rounded to b's dtype in
    # fused_gdn_gating; KDA's intra-chunk blocks are cast to bf16 whatever the input dtype. So agreement
    # is at activation precision: max |diff| <= 8 eps * max |truth| (bf16, eps = 2^-8; truncating
    # casts under the interpreter roughly double and bias the error: observed <= 5.3 eps there, <= 2.2
    # eps on the H200) or <= 4 eps * max |truth| (fp16 activations, eps = 2^-11; observed <= 1.5 eps;
    # the errors scale with the activation precision, as rounding errors do). A formula error
    # (gate, beta, scale, GQA map, decay placement) gives errors of tens of percent.
    return 8 * BF16_EPS if act_dtype == torch.bfloat16 else 4 * FP16_EPS


def _prefill_truth(p, xs, s):
    """float64 token-by-token recurrence (the reference decode) per sequence: outputs, final states."""
    outs, finals = [], []
    for i, x in enumerate(xs):
        o, h = decode(s[i:i + 1].double(), x, p, compute_dtype=torch.float64)
        outs.append(o[0])
        finals.append(h[0])
    return torch.cat(outs, 0), torch.stack(finals)


def _assert_prefill(o, pool_after, pool, truth_o, truth_h, act_dtype, what):
    other = torch.tensor([i for i in range(pool.shape[0]) if i not in PREFILL_SLOTS])
    assert torch.equal(pool_after[other], pool[other]), f"{what}: prefill wrote slots it does not own"
    final = pool_after[torch.tensor(PREFILL_SLOTS)]
    tol = _prefill_tolerance(act_dtype)
    eps = BF16_EPS if act_dtype == torch.bfloat16 else FP16_EPS
    o_err = (o.double() - truth_o).abs().max().item() / truth_o.abs().max().item()
    h_err = (final.double() - truth_h).abs().max().item() / truth_h.abs().max().item()
    observed(f"{what}: max |diff| / max |truth|: outputs {o_err:.2e} ({o_err / eps:.2f} eps), "
             f"final states {h_err:.2e} ({h_err / eps:.2f} eps)")
    assert o_err <= tol, f"{what}: outputs off by {o_err / eps:.1f} eps of the activation dtype"
    assert h_err <= tol, f"{what}: final states off by {h_err / eps:.1f} eps of the activation dtype"


PREFILL_CASES = [
    pytest.param(torch.bfloat16, torch.float32, id="act_bf16-state_fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="act_bf16-state_bf16"),
    pytest.param(torch.float16, torch.float32, id="act_fp16-state_fp32"),
]


@pytest.mark.parametrize("act_dtype,state_dtype", PREFILL_CASES)
def test_gdn_chunked_prefill_matches_reference(act_dtype, state_dtype):
    p, xs, s, pool, o, pool_after = _run_prefill("gdn", act_dtype, state_dtype)
    truth_o, truth_h = _prefill_truth(p, xs, s)
    # The reference chunked_prefill (float32) is the same algebra: it equals the float64 recurrence
    # to float32 precision (atol 1e-5 on entries <= ~2; observed < 1e-6).
    ref = [chunked_prefill(s[i:i + 1].float(), x, p, chunk_size=64) for i, x in enumerate(xs)]
    assert_close(torch.cat([r[0][0] for r in ref]), truth_o, rtol=0, atol=1e-5, what="chunked_prefill outputs")
    assert_close(torch.cat([r[1] for r in ref]), truth_h, rtol=0, atol=1e-5, what="chunked_prefill states")
    what = f"chunk_gated_delta_rule act {act_dtype} state {state_dtype}"
    _assert_prefill(o, pool_after, pool, truth_o, truth_h, act_dtype, f"{what} vs float64 recurrence")
    ref_o, ref_h = torch.cat([r[0][0] for r in ref]).double(), torch.cat([r[1] for r in ref]).double()
    _assert_prefill(o, pool_after, pool, ref_o, ref_h, act_dtype, f"{what} vs reference chunked_prefill")


# KDA: SGLang 0.5.14's chunk_kda mixes exponent bases. kda_gate_chunk_cumsum produces the chunk-local
# cumulative gate G in natural-log units (no RCP_LN2 scale, kda.py chunk_kda_fwd), the state update
# (chunk_delta_h.py: exp(gk_last)), the w/u/kg recompute and the inter-chunk output (kda.py
# chunk_gla_fwd_kernel_o: exp(g)) use exp, but the intra-chunk attention blocks Aqk / Akk
# (chunk_intra.py chunk_kda_fwd_kernel_inter_solve_fused and chunk_intra_token_parallel.py) use exp2,
# i.e. decay 2^(G_i - G_j) = e^(ln2 (G_i - G_j)) instead of e^(G_i - G_j) inside a chunk. Fixed upstream
# by sgl-project/sglang#31904 ("[KDA] Fix mixed exponent bases in Triton chunk prefill"). The kernel is
# checked against a float64 model of exactly that computation, and shown to miss the true recurrence.

KDA_EXP2_BUG = ("SGLang 0.5.14 chunk_kda evaluates intra-chunk decays with exp2 on natural-log "
                "cumulative gates (fixed upstream by sgl-project/sglang#31904)")


def _kda_chunk_model_0514(p, xs, s, chunk_size=64):
    """float64 model of SGLang 0.5.14's chunk_kda: the chunked algebra of ``chunked_prefill`` with the
    intra-chunk decays of Aqk and Akk taken as 2^(G_t - G_j); w, u, the state carry and the inter-chunk
    output with e^G. Returns (outputs [total, HV, V], final states [N, HV, V, K])."""
    outs, finals = [], []
    for i, x in enumerate(xs):
        X = prepare(x, p, torch.float64)
        h = s[i].double()  # [HV, V, K]
        for c0 in range(0, x.num_tokens, chunk_size):
            sl = slice(c0, min(c0 + chunk_size, x.num_tokens))
            q, k, v, g, beta = (t[0, sl].transpose(0, 1) for t in (X.q, X.k, X.v, X.g, X.beta))  # heads first
            G = g.cumsum(1)  # [HV, C, K]
            c = k.shape[1]
            rel = G[:, :, None, :] - G[:, None, :, :]
            causal = torch.tril(torch.ones(c, c, dtype=torch.bool))[:, :, None]
            d2 = torch.exp2(torch.where(causal, rel, torch.tensor(float("-inf"), dtype=rel.dtype)))
            akk = torch.einsum("htc,hjc,htjc->htj", k, k, d2).tril(-1) * beta[..., None]
            aqk = torch.einsum("htc,hjc,htjc->htj", q, k, d2)
            inv = torch.linalg.inv(torch.eye(c, dtype=akk.dtype) + akk)
            w, u = inv @ (beta[..., None] * k * torch.exp(G)), inv @ (beta[..., None] * v)
            v_new = u - w @ h.transpose(-1, -2)
            outs.append(((q * torch.exp(G)) @ h.transpose(-1, -2) + aqk @ v_new).transpose(0, 1))
            g_last = G[:, -1:, :]
            h = h * torch.exp(g_last) + v_new.transpose(-1, -2) @ (k * torch.exp(g_last - G))
        finals.append(h)
    return torch.cat(outs, 0), torch.stack(finals)


def _kda_tolerance(act_dtype):
    # chunk_kda casts its intra-chunk blocks to bf16 whatever the input dtype (chunk_intra.py
    # `.to(tl.bfloat16)`), so its precision floor is bf16 even with fp16 activations: max |diff| <=
    # 4 eps_bf16 * max |truth| (fp16 activations; observed <= 1.6 eps) or 8 eps_bf16 (bf16 activations,
    # as for GDN; observed 1.7 eps on the H200).
    return 4 * BF16_EPS if act_dtype == torch.float16 else 8 * BF16_EPS


_INTERPRETER_BF16_KDA = ("Triton 3.8's interpreter cannot run chunk_kda on bf16 activations: "
                         "chunk_gla_fwd_kernel_o computes (b_q * scale) in bf16 (no InterpreterBuilder.get_bf16, "
                         "bf16 arithmetic on raw bits); run on a GPU")

KDA_PREFILL_CASES = [
    pytest.param(torch.float16, torch.float32, id="act_fp16-state_fp32"),
    pytest.param(torch.float16, torch.bfloat16, id="act_fp16-state_bf16"),
    pytest.param(torch.bfloat16, torch.float32, id="act_bf16-state_fp32",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(INTERPRET, reason=_INTERPRETER_BF16_KDA)]),
]


def _max_rel(a, b):
    return (a.double() - b.double()).abs().max().item() / b.double().abs().max().item()


@pytest.mark.parametrize("act_dtype,state_dtype", KDA_PREFILL_CASES)
def test_kda_chunked_prefill_is_sglang_0514_mixed_exp_base(act_dtype, state_dtype):
    """chunk_kda reproduces the float64 model of its mixed-base computation to bf16 precision, and that
    computation misses the true KDA recurrence by far more than rounding (see KDA_EXP2_BUG)."""
    p, xs, s, pool, o, pool_after = _run_prefill("kda", act_dtype, state_dtype)
    other = torch.tensor([i for i in range(pool.shape[0]) if i not in PREFILL_SLOTS])
    assert torch.equal(pool_after[other], pool[other]), "chunk_kda wrote slots it does not own"
    final = pool_after[torch.tensor(PREFILL_SLOTS)]
    model_o, model_h = _kda_chunk_model_0514(p, xs, s)
    truth_o, truth_h = _prefill_truth(p, xs, s)
    tol = _kda_tolerance(act_dtype)
    o_err, h_err = _max_rel(o, model_o), _max_rel(final, model_h)
    bug_o, bug_h = _max_rel(model_o, truth_o), _max_rel(model_h, truth_h)
    observed(f"chunk_kda act {act_dtype} state {state_dtype}: vs 0.5.14 model: outputs {o_err / BF16_EPS:.2f}, "
             f"states {h_err / BF16_EPS:.2f} bf16 eps of max; model vs true recurrence: outputs "
             f"{bug_o / BF16_EPS:.1f}, states {bug_h / BF16_EPS:.1f} bf16 eps of max")
    assert o_err <= tol and h_err <= tol, "chunk_kda differs from the model of its 0.5.14 computation"
    # The deviation from the recurrence is not rounding: over twice the tolerance, and over 5x the
    # kernel's distance to the model (observed 27-35 bf16 eps vs <= 1.7 eps, CPU and H200 alike).
    assert bug_o > 2 * tol and bug_o > 5 * o_err, "the mixed exponent bases no longer matter at these gates?"


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=KDA_EXP2_BUG)
@pytest.mark.parametrize("act_dtype,state_dtype", KDA_PREFILL_CASES)
def test_kda_chunked_prefill_matches_reference(act_dtype, state_dtype):
    """What chunk_kda should satisfy (it does after sgl-project/sglang#31904): outputs and final states
    equal the KDA recurrence (reference chunked_prefill / float64 decode) to activation precision."""
    p, xs, s, pool, o, pool_after = _run_prefill("kda", act_dtype, state_dtype)
    truth_o, truth_h = _prefill_truth(p, xs, s)
    ref = [chunked_prefill(s[i:i + 1].float(), x, p, chunk_size=64) for i, x in enumerate(xs)]
    assert_close(torch.cat([r[0][0] for r in ref]), truth_o, rtol=0, atol=1e-5, what="chunked_prefill outputs")
    assert_close(torch.cat([r[1] for r in ref]), truth_h, rtol=0, atol=1e-5, what="chunked_prefill states")
    final = pool_after[torch.tensor(PREFILL_SLOTS)]
    tol = _kda_tolerance(act_dtype)
    assert _max_rel(o, truth_o) <= tol, "chunk_kda outputs differ from the KDA recurrence"
    assert _max_rel(final, truth_h) <= tol, "chunk_kda final states differ from the KDA recurrence"
