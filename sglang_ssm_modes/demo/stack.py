"""A tiny hybrid stack (GDN and KDA layers with seeded random weights) for the demo: tokens ->
embedding -> linear-attention layers (residual, RMS-normalised inputs) -> tied LM head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference.gating import GateParams, LinearAttnInputs
from ..reference.random_layer import random_gate_params, random_state


@dataclass(frozen=True)
class StackConfig:
    """Shapes of the demo stack: GDN layers use GQA (``gdn_heads`` = (HK, HV)), KDA layers HK = HV.

    Activations are float32 here so that replay's legitimate float32 differences (it rounds once per
    fold, native once per round) are not re-quantised to bf16 between layers, where one flipped bf16
    rounding would grow to 1e-4 and could hide a real bug behind noise. Compact is bit-identical in
    any dtype."""

    vocab: int = 96
    hidden: int = 64
    layers: tuple[str, ...] = ("gdn", "kda", "gdn")
    gdn_heads: tuple[int, int] = (2, 4)
    kda_heads: int = 4
    head_dim: int = 16
    activation_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class LayerWeights:
    family: str
    num_k_heads: int
    num_v_heads: int
    w_q: torch.Tensor
    w_k: torch.Tensor
    w_v: torch.Tensor
    w_a: torch.Tensor
    w_b: torch.Tensor
    w_o: torch.Tensor
    gate: GateParams


class TinyHybridStack:
    """Seeded random weights at realistic scale (normal, std 1/sqrt(fan_in))."""

    def __init__(self, cfg: StackConfig, seed: int = 0):
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)

        def w(fan_in, fan_out):
            return torch.randn(fan_in, fan_out, generator=g) / fan_in ** 0.5

        self.embed = torch.randn(cfg.vocab, cfg.hidden, generator=g)
        self.layers = []
        d = cfg.head_dim
        for family in cfg.layers:
            hk, hv = cfg.gdn_heads if family == "gdn" else (cfg.kda_heads, cfg.kda_heads)
            self.layers.append(LayerWeights(
                family=family, num_k_heads=hk, num_v_heads=hv, w_q=w(cfg.hidden, hk * d), w_k=w(cfg.hidden, hk * d),
                w_v=w(cfg.hidden, hv * d), w_a=w(cfg.hidden, hv * (d if family == "kda" else 1)), w_b=w(cfg.hidden, hv),
                w_o=w(hv * d, cfg.hidden), gate=random_gate_params(family, hv, d, g)))

    def initial_states(self, batch: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """A committed state per layer ``[batch, HV, V, K]``, as after a prefill."""
        g = torch.Generator().manual_seed(seed)
        d = self.cfg.head_dim
        return [random_state(batch, lw.num_v_heads, d, d, g, dtype) for lw in self.layers]

    def layer_inputs(self, lw: LayerWeights, x: torch.Tensor) -> LinearAttnInputs:
        """Projections of the normalised hidden states ``x`` ``[N, T, hidden]`` in the activation dtype."""
        n, t, _ = x.shape
        d, act = self.cfg.head_dim, self.cfg.activation_dtype
        h = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)
        a = (h @ lw.w_a).reshape(n, t, lw.num_v_heads, -1)
        return LinearAttnInputs(q=(h @ lw.w_q).reshape(n, t, lw.num_k_heads, d).to(act),
                                k=(h @ lw.w_k).reshape(n, t, lw.num_k_heads, d).to(act),
                                v=(h @ lw.w_v).reshape(n, t, lw.num_v_heads, d).to(act),
                                a=(a.squeeze(-1) if lw.family == "gdn" else a).to(act), b=(h @ lw.w_b).to(act))

    def forward(self, tokens: torch.Tensor, layer_states: list) -> torch.Tensor:
        """Logits ``[N, T, vocab]`` of a verify window ``tokens`` ``[N, T]``; each layer's recurrent
        state is served by its holder in ``layer_states`` (one per layer, any mode)."""
        x = self.embed[tokens]
        for lw, state in zip(self.layers, layer_states):
            o = state.verify(self.layer_inputs(lw, x)).float()
            x = x + o.flatten(2) @ lw.w_o
        return x @ self.embed.T
