"""Shared cases for the kernel tests: seeded inputs in SGLang's flat layout, SGLang 0.5.14's own
native verify + acceptance as the baseline, random draft trees."""

import torch

from sglang.srt.layers.attention.fla.fused_recurrent import (fused_recurrent_gated_delta_rule_packed_decode,
                                                              fused_recurrent_kda_packed_decode)
from sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent import fused_sigmoid_gating_delta_rule_update
from sglang.srt.layers.attention.mamba.mamba_state_scatter_triton import fused_mamba_state_scatter_with_mask

from sglang_ssm_modes.ops.replay import replay_verify
from sglang_ssm_modes.reference.random_layer import random_gate_params, random_inputs, random_state

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ring_snapshot(ring):
    """A copy of every buffer of a :class:`~sglang_ssm_modes.ops.replay.ReplayRing`, by name."""
    return {name: t.clone() for name, t in ring.buffers().items()}


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
    """SGLang's acceptance copy. Its wrapper refuses CPU tensors, so on the CPU the same copy
    (documented: ``dst[idx[i]] = src[i, step[i]]`` where ``step[i] >= 0``) is done in torch; it moves
    bits and computes nothing, so bit-identity is unaffected."""
    if pool.is_cuda:
        fused_mamba_state_scatter_with_mask(pool[None], inter[None], state_idx, last)
        return
    for i in range(last.shape[0]):
        if last[i] >= 0 and state_idx[i] >= 0:
            pool[state_idx[i]] = inter[i, last[i]]


def random_tree_parents(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """``retrieve_parent_token`` of random draft trees: node t > 0 hangs under a node < t."""
    parents = torch.zeros(n, d, dtype=torch.int64)
    for t in range(1, d):
        parents[:, t] = torch.randint(0, t, (n,), generator=gen)
    return parents
