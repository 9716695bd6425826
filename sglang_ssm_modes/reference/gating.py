"""Input preparation shared by every reference recurrence, op for op as SGLang 0.5.14 computes it.

SGLang's fused kernels (``fla/fused_sigmoid_gating_recurrent.py``, ``fla/fused_gdn_gating.py``,
``fla/fused_recurrent.py``) compute, per token and value head, in float32:

* gate ``g = -exp(A_log) * softplus(a + dt_bias)`` with softplus(beta=1, threshold=20) written as
  ``log(1 + exp(x))`` for ``x <= 20`` and ``x`` above; a scalar per value head for GDN, a K-vector per
  value head for KDA;
* ``beta = 1 / (1 + exp(-b))``;
* ``q / sqrt(sum(q*q) + 1e-6)`` and the same for k (L2 norm with SGLang's epsilon *inside* the root),
  then ``q *= scale`` (``scale = K ** -0.5`` by default).

Tensor layout (batch of N requests, T tokens each; HK key heads, HV value heads, HV % HK == 0):
``q, k``: ``[N, T, HK, K]``; ``v``: ``[N, T, HV, V]``; ``a``: GDN ``[N, T, HV]``, KDA ``[N, T, HV, K]``;
``b``: ``[N, T, HV]``. Gate parameters: ``A_log`` ``[HV]`` (any shape with HV elements, e.g. Kimi's
``[1, 1, HV, 1]``), ``dt_bias`` GDN ``[HV]``, KDA ``[HV * K]`` or ``[HV, K]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Family = Literal["gdn", "kda"]

L2NORM_EPS = 1e-6
SOFTPLUS_BETA = 1.0
SOFTPLUS_THRESHOLD = 20.0


@dataclass(frozen=True)
class GateParams:
    """Per-layer parameters of the decay gate: ``family`` ("gdn" scalar gate, "kda" per-channel gate),
    ``A_log`` with HV elements, ``dt_bias`` with HV (GDN) or HV*K (KDA) elements, and ``scale``
    (None means ``K ** -0.5``, SGLang's default)."""

    family: Family
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    scale: float | None = None


@dataclass(frozen=True)
class LinearAttnInputs:
    """Raw per-token inputs of one linear-attention layer, exactly what SGLang hands its kernels
    after the causal conv: ``q, k`` ``[N, T, HK, K]``, ``v`` ``[N, T, HV, V]`` (activation dtype),
    ``a`` (gate logits: ``[N, T, HV]`` GDN, ``[N, T, HV, K]`` KDA) and ``b`` (beta logits ``[N, T, HV]``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    def tokens(self, start: int, stop: int) -> "LinearAttnInputs":
        """The same inputs restricted to tokens ``start:stop`` of every request."""
        return LinearAttnInputs(*(t[:, start:stop] for t in (self.q, self.k, self.v, self.a, self.b)))


@dataclass(frozen=True)
class PreparedInputs:
    """Inputs in the working dtype, ready for the recurrence (all expanded to value heads):
    ``q`` ``[N, T, HV, K]`` (normalised and scaled), ``k`` ``[N, T, HV, K]`` (normalised),
    ``v`` ``[N, T, HV, V]``, ``g`` ``[N, T, HV, Kg]`` (Kg = 1 for GDN, K for KDA), ``beta`` ``[N, T, HV]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def softplus(x: torch.Tensor) -> torch.Tensor:
    """SGLang's softplus: ``log(1 + exp(x))`` below the threshold 20, identity above (beta = 1)."""
    return torch.where(x * SOFTPLUS_BETA <= SOFTPLUS_THRESHOLD,
                       (1.0 / SOFTPLUS_BETA) * torch.log(1.0 + torch.exp(x * SOFTPLUS_BETA)), x)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x*x) + 1e-6)`` over the last dimension (SGLang's in-kernel L2 norm)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def decay_gate(a: torch.Tensor, params: GateParams, dtype: torch.dtype) -> torch.Tensor:
    """Log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` as ``[N, T, HV, Kg]`` in ``dtype``."""
    hv = params.A_log.numel()
    A_log = params.A_log.reshape(hv, 1).to(dtype)
    if params.family == "gdn":
        x = a.to(dtype)[..., None] + params.dt_bias.reshape(hv, 1).to(dtype)
    elif params.family == "kda":
        x = a.to(dtype).reshape(*a.shape[:2], hv, -1) + params.dt_bias.reshape(hv, -1).to(dtype)
    else:
        raise ValueError(f"unknown linear-attention family {params.family!r}: expected 'gdn' or 'kda'")
    return -torch.exp(A_log) * softplus(x)


def sigmoid_beta(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``beta = 1 / (1 + exp(-b))`` in ``dtype`` (SGLang's form, not ``torch.sigmoid``)."""
    return 1.0 / (1.0 + torch.exp(-b.to(dtype)))


def expand_key_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """Repeat key heads ``[..., HK, K]`` to value heads ``[..., HV, K]``: value head ``h`` reads key
    head ``h // (HV // HK)`` (SGLang's GQA mapping)."""
    hk = x.shape[-2]
    if num_v_heads % hk:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({hk})")
    return x.repeat_interleave(num_v_heads // hk, dim=-2)


def prepare(inputs: LinearAttnInputs, params: GateParams, dtype: torch.dtype) -> PreparedInputs:
    """Gate, beta, L2 norm and scale of raw inputs, in ``dtype`` (float32 as the kernels, float64 for checks)."""
    hv, kdim = inputs.v.shape[2], inputs.k.shape[-1]
    scale = kdim ** -0.5 if params.scale is None else params.scale
    q = expand_key_heads(l2norm(inputs.q.to(dtype)), hv) * scale
    k = expand_key_heads(l2norm(inputs.k.to(dtype)), hv)
    return PreparedInputs(q=q, k=k, v=inputs.v.to(dtype), g=decay_gate(inputs.a, params, dtype),
                          beta=sigmoid_beta(inputs.b, dtype))
