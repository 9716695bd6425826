"""Seeded random layer parameters and inputs at realistic scales, for tests, the demo and benchmarks."""

from __future__ import annotations

import math

import torch

from .gating import Family, GateParams, LinearAttnInputs


def random_gate_params(family: Family, num_v_heads: int, head_k_dim: int, generator: torch.Generator,
                       dtype: torch.dtype = torch.float32) -> GateParams:
    """Gate parameters as the models initialise them: ``A = exp(A_log)`` uniform in [1, 16]
    (Qwen3-Next / Kimi-Linear init), ``dt_bias`` the inverse softplus of a log-uniform dt in
    [1e-3, 1e-1] (Mamba's dt init), per value head (GDN) or per value head and key channel (KDA)."""
    A_log = torch.log(torch.empty(num_v_heads).uniform_(1.0, 16.0, generator=generator)).to(dtype)
    n_bias = num_v_heads if family == "gdn" else num_v_heads * head_k_dim
    log_dt = torch.empty(n_bias).uniform_(math.log(1e-3), math.log(1e-1), generator=generator)
    dt = torch.exp(log_dt)
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(dtype)
    return GateParams(family=family, A_log=A_log, dt_bias=dt_bias)


def random_inputs(family: Family, batch: int, tokens: int, num_k_heads: int, num_v_heads: int,
                  head_k_dim: int, head_v_dim: int, generator: torch.Generator,
                  dtype: torch.dtype = torch.bfloat16) -> LinearAttnInputs:
    """Raw inputs ``[batch, tokens, ...]`` in ``dtype``: q, k, v standard normal (post-conv SiLU
    activations are O(1)), gate logits ``a`` and beta logits ``b`` standard normal."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    a_shape = (batch, tokens, num_v_heads) if family == "gdn" else (batch, tokens, num_v_heads, head_k_dim)
    return LinearAttnInputs(q=randn(batch, tokens, num_k_heads, head_k_dim),
                            k=randn(batch, tokens, num_k_heads, head_k_dim),
                            v=randn(batch, tokens, num_v_heads, head_v_dim), a=randn(*a_shape),
                            b=randn(batch, tokens, num_v_heads))


def random_state(batch: int, num_v_heads: int, head_v_dim: int, head_k_dim: int, generator: torch.Generator,
                 dtype: torch.dtype = torch.float32, scale: float = 0.5) -> torch.Tensor:
    """A random committed state ``[batch, HV, V, K]`` in ``dtype`` (entries of a few tenths, like a
    state after a prefill of normalised keys)."""
    return (scale * torch.randn(batch, num_v_heads, head_v_dim, head_k_dim, generator=generator)).to(dtype)
