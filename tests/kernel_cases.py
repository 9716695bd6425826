"""Shared cases for the kernel tests: seeded inputs in SGLang's flat layout, SGLang 0.5.14's own
native verify + acceptance as the baseline, random draft trees."""

import torch
import triton

from sglang.srt.layers.attention.fla.fused_recurrent import (fused_recurrent_gated_delta_rule_packed_decode,
                                                              fused_recurrent_kda_packed_decode)
from sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent import fused_sigmoid_gating_delta_rule_update
from sglang.srt.layers.attention.mamba.mamba_state_scatter_triton import (_fused_mamba_state_scatter_with_mask_kernel,
                                                                           fused_mamba_state_scatter_with_mask)

from sglang_ssm_modes.ops.replay import replay_verify
from sglang_ssm_modes.reference.random_layer import random_gate_params, random_inputs, random_state

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ring_snapshot(ring):
    """A copy of every buffer of a :class:`~sglang_ssm_modes.ops.replay.ReplayRing`, by name."""
    return {name: t.clone() for name, t in ring.buffers().items()}


def ulps(a, b) -> int:
    """The most units in the last place two same-dtype tensors differ by (their bit patterns as integers)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return int((a.view(ints).long() - b.view(ints).long()).abs().max()) if a.numel() else 0


def bf16_ulp(a, b):
    """Elementwise, one bfloat16 unit in the last place of the larger magnitude of ``a`` and ``b`` (float64)."""
    return torch.ldexp(torch.ones_like(a), torch.frexp(torch.maximum(a.abs(), b.abs()))[1] - 8)


def f16_ulp(a, b):
    """Elementwise, one float16 unit in the last place of the larger magnitude of ``a`` and ``b`` (float64):
    ``2**(e - 11)`` for ``|x|`` in ``[2**(e-1), 2**e)``, ``2**-24`` in the subnormal range."""
    e = torch.frexp(torch.maximum(a.abs(), b.abs()).double())[1]
    return torch.ldexp(torch.ones_like(a, dtype=torch.float64), (e - 11).clamp_min(-24))


def assert_same_bits(ours, native, v_major=False, flips=0):
    """``ours`` is ``native`` bit for bit — on the GPU always, either tile. One exception, replay's ``[BV, K]``
    write-through tile (``v_major``) on the CPU interpreter, whose NumPy sums over the transposed view in another
    order: float32 within one epsilon of the largest element (measured: at most 0.95 of it, as SGLang's two decode
    kernels differ on the interpreter); bfloat16 and float16 bit for bit but for at most ``flips`` elements one ulp
    apart (a float32 sum a hair either side of a rounding midpoint: measured 1 of 16 640 bfloat16 elements in a
    write-through verify's fold, none in the decodes, up to 2 float16 ones a token in a decode — float16's 3 more
    bits land near a midpoint more often; callers pass ``flips`` only where they measured them)."""
    assert ours.shape == native.shape and ours.dtype == native.dtype, (ours.shape, native.shape, ours.dtype)
    if not (v_major and DEVICE == "cpu"):
        assert torch.equal(ours, native), f"{ulps(ours, native)} ulps apart"
    elif ours.dtype == torch.float32:
        worst = float((ours.double() - native.double()).abs().max())
        bound = torch.finfo(torch.float32).eps * float(native.double().abs().max())
        assert worst <= bound, f"{worst / bound:.2f} float32 epsilons of the largest element (at most 1)"
    else:
        assert ours.dtype in (torch.bfloat16, torch.float16), ours.dtype
        a, b = ours.double(), native.double()
        differ = int((a != b).sum())
        ulp = bf16_ulp(a, b) if ours.dtype == torch.bfloat16 else f16_ulp(a, b)
        assert ((a - b).abs() <= ulp).all() and differ <= flips, f"{differ} elements differ, {ulps(ours, native)} ulps"


def assert_same_outputs_but_tiling(ours, native):
    """bfloat16 outputs of two verify tilings of the same arithmetic (one tile of columns or another; each output
    element is the same float32 sum over K either way): bit for bit under the CPU interpreter (measured); on the
    GPU the compiled reductions may add in another order, so the float32 values agree to float32 rounding and
    their bfloat16 roundings by at most one bfloat16 ulp — plus, for outputs near zero, float32
    rounding (2**-20) of the largest output."""
    assert ours.shape == native.shape and ours.dtype == native.dtype, (ours.shape, native.shape, ours.dtype)
    if DEVICE == "cpu":
        assert torch.equal(ours, native), f"{ulps(ours, native)} ulps apart"
        return
    a, b = ours.double(), native.double()
    bound = bf16_ulp(a, b) + 2.0 ** -20 * float(b.abs().max())
    assert ((a - b).abs() <= bound).all(), f"{ulps(ours, native)} ulps apart"


def compiled_variants(jit) -> int:
    """How many variants of a Triton kernel have been compiled on any device so far."""
    return sum(len(cache[0]) for cache in jit.device_caches.values())


def make_case(family, n, d, hk, hv, kdim, vdim, state_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    params = random_gate_params(family, hv, kdim, g)
    x = random_inputs(family, n, d, hk, hv, kdim, vdim, g, torch.bfloat16)
    slots = 2 * n + 3
    pool = random_state(slots, hv, vdim, kdim, g, state_dtype)
    perm = torch.randperm(slots, generator=g)[:n]
    state_idx = perm.clone()
    state_idx[n // 2] = -1  # a padding row in the middle of the batch
    return params, x, pool, state_idx


def every_accepted_length(state_idx, n, d):
    """``[N]`` int64 last accepted indices (SGLang's ``-1..D-1``) with every accepted length ``0..D`` among the real
    rows (``state_idx >= 0``, at least ``D + 1`` of them) in turn; a padding row gets a real-looking ``D - 1``,
    which must change nothing."""
    real_rows = [i for i in range(n) if state_idx[i] >= 0]
    assert len(real_rows) >= d + 1
    last = torch.full((n,), d - 1, dtype=torch.int64)
    for j, i in enumerate(real_rows):
        last[i] = (j % (d + 1)) - 1
    return last


def flat_inputs(x, family, n, d):
    a = x.a.reshape(n * d, -1)
    return dict(q=x.q.reshape(1, n * d, *x.q.shape[2:]), k=x.k.reshape(1, n * d, *x.k.shape[2:]),
                v=x.v.reshape(1, n * d, *x.v.shape[2:]), a=a, b=x.b.reshape(1, n * d, -1))


def to_device(d, device):
    return {k: t.to(device) for k, t in d.items()}


def call_replay_verify(params, x, family, n, d, pool, state_idx, ring, rec_idx, **options):
    """``replay_verify`` of the case's inputs ``x`` (``n`` requests, ``d`` tokens each) on ``DEVICE``."""
    inp = to_device(flat_inputs(x, family, n, d), DEVICE)
    return replay_verify(params.A_log.to(DEVICE), inp["a"], params.dt_bias.to(DEVICE), inp["q"], inp["k"], inp["v"],
                         inp["b"], pool, state_idx.to(DEVICE), ring, rec_idx, is_kda=family == "kda", **options)


def sglang_decode(params, x, pool, state_idx, family, n):
    """SGLang 0.5.14's decode (``fused_sigmoid_gating_delta_rule_update``, one token per request) of ``x``
    on ``pool`` (on ``DEVICE``, updated in place); returns ``o`` ``[1, n, HV, V]``."""
    inp = to_device(flat_inputs(x, family, n, 1), DEVICE)
    return fused_sigmoid_gating_delta_rule_update(
        A_log=params.A_log.to(DEVICE), dt_bias=params.dt_bias.to(DEVICE), softplus_beta=1.0, softplus_threshold=20.0,
        initial_state_source=pool, initial_state_indices=state_idx.to(DEVICE), use_qk_l2norm_in_kernel=True,
        cu_seqlens=torch.arange(n + 1, dtype=torch.int32, device=DEVICE), is_kda=family == "kda", **inp)


def sglang_packed_decode(params, x, pool, state_idx, family, n):
    """SGLang 0.5.14's packed decode (``fused_recurrent_{gated_delta_rule,kda}_packed_decode``: what its Triton
    GDN / KDA kernels run for a decode on CUDA; GDN rounds beta to b's dtype) of ``x`` on ``pool`` (on
    ``DEVICE``, updated in place); returns ``o`` ``[n, 1, HV, V]`` (zero for padding rows)."""
    inp = to_device(flat_inputs(x, family, n, 1), DEVICE)
    mixed = torch.cat([inp[name][0].flatten(1) for name in ("q", "k", "v")], 1).contiguous()
    out = mixed.new_empty(n, 1, inp["v"].shape[2], inp["v"].shape[3])
    kernel = fused_recurrent_kda_packed_decode if family == "kda" else fused_recurrent_gated_delta_rule_packed_decode
    kernel(mixed_qkv=mixed, a=inp["a"].contiguous(), b=inp["b"][0].contiguous(),
           A_log=params.A_log.to(DEVICE).reshape(-1), dt_bias=params.dt_bias.to(DEVICE).reshape(-1),
           scale=x.k.shape[-1] ** -0.5, initial_state=pool, out=out,
           ssm_state_indices=state_idx.to(DEVICE).to(torch.int32), use_qk_l2norm_in_kernel=True)
    return out


def sglang_native_verify(params, x, pool, state_idx, family, n, d, parents=None):
    """SGLang 0.5.14's target verify writing per-step states (a chain, or a tree through
    ``retrieve_parent_token``); returns ``(o, intermediate states [n, d, HV, V, K])``. ``pool`` is
    not modified (disable_state_update)."""
    inp = to_device(flat_inputs(x, family, n, d), DEVICE)
    hv, vdim, kdim = pool.shape[1:]
    pool = pool.to(DEVICE)
    inter = torch.zeros(n, d, hv, vdim, kdim, dtype=pool.dtype, device=DEVICE)
    cu = torch.arange(0, n * d + 1, d, dtype=torch.int32, device=DEVICE)
    o = fused_sigmoid_gating_delta_rule_update(
        A_log=params.A_log.to(DEVICE), dt_bias=params.dt_bias.to(DEVICE), softplus_beta=1.0, softplus_threshold=20.0,
        initial_state_source=pool, initial_state_indices=state_idx.to(DEVICE), use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu, is_kda=family == "kda", disable_state_update=True, intermediate_states_buffer=inter,
        intermediate_state_indices=torch.arange(n, dtype=torch.int32, device=DEVICE), cache_steps=d,
        retrieve_parent_token=None if parents is None else parents.to(DEVICE), **inp)
    return o, inter


def sglang_native_round(params, x, pool, state_idx, last, family, n, d, parents=None):
    """SGLang 0.5.14's native speculative round: verify, then the masked scatter of the last
    accepted node's state. Returns ``(o, new pool)``."""
    pool = pool.to(DEVICE).clone()
    o, inter = sglang_native_verify(params, x, pool, state_idx, family, n, d, parents)
    sglang_accept(pool, inter, state_idx.to(DEVICE), last.to(DEVICE))
    return o, pool


def sglang_accept(pool, inter, state_idx, last):
    """SGLang 0.5.14's acceptance copy, ``pool[state_idx[i]] = inter[i, last[i]]`` where ``last[i] >= 0`` (and
    the slot is in range: padding rows' -1 is skipped by the kernel's bounds check), by SGLang's own kernel.
    On CUDA through its wrapper ``fused_mamba_state_scatter_with_mask``; the wrapper refuses CPU tensors, so on
    the CPU its Triton kernel ``_fused_mamba_state_scatter_with_mask_kernel`` is launched directly (under the
    interpreter) with the wrapper's grid and arguments: one layer (``pool[None]``, ``inter[None]``)."""
    dst, src = pool[None], inter[None]
    if pool.is_cuda:
        fused_mamba_state_scatter_with_mask(dst, src, state_idx, last)
        return
    # as the wrapper, from its `total_requests = ...` on (SGLang 0.5.14), bar the CUDA check
    total_requests = last.shape[0]
    if total_requests == 0:
        return
    assert dst.is_contiguous() and src.is_contiguous() and dst.shape[2:] == src.shape[3:]
    assert state_idx.shape == last.shape and state_idx.ndim == 1
    elem_per_entry = dst.numel() // (dst.shape[0] * dst.shape[1])
    block = 1024
    grid = (total_requests, dst.shape[0], triton.cdiv(elem_per_entry, block))
    _fused_mamba_state_scatter_with_mask_kernel[grid](
        src, dst, state_idx.to(torch.int32).contiguous(), last.to(torch.int32).contiguous(), elem_per_entry,
        src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1), src.shape[1], src.shape[2],
        dst.shape[1], BLOCK_SIZE=block)


def random_tree_parents(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """``retrieve_parent_token`` of random draft trees: node t > 0 hangs under a node < t."""
    parents = torch.zeros(n, d, dtype=torch.int64)
    for t in range(1, d):
        parents[:, t] = torch.randint(0, t, (n,), generator=gen)
    return parents
