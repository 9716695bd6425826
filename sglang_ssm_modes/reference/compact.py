"""Reference for the ``compact`` mode: output-only verify that records each draft token's raw
inputs, and a commit that re-runs the accepted prefix from the committed state and writes it once.

The commit rounds exactly where the native path it replaces rounds (DESIGN §2):

* chain verify (topk = 1): the state stays in the working dtype across the accepted prefix and is
  rounded once at its end — SGLang's stored copy ``round(S_n)``;
* tree verify (topk > 1): SGLang reloads each parent's stored copy, so the commit rounds after every
  step of the accepted path;
* plain decode is the chain with D = 1: one step, one rounding — SGLang's decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gating import GateParams, LinearAttnInputs, expand_key_heads, l2norm, prepare
from .native import accepted_path, delta_rule_step


@dataclass(frozen=True)
class CompactRecords:
    """Raw inputs of D draft tokens per request: ``k_raw`` ``[N, D, HK, K]`` (per key head, shared by
    its GQA group) and ``v_raw`` ``[N, D, HV, V]`` in the activation dtype; ``g`` ``[N, D, HV, Kg]``
    (decay, float32 in the kernels) and ``beta`` ``[N, D, HV]``."""

    k_raw: torch.Tensor
    v_raw: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def compact_verify(state: torch.Tensor, inputs: LinearAttnInputs, params: GateParams,
                   parents: torch.Tensor | None = None,
                   compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, CompactRecords]:
    """Output-only verify of D draft tokens (a chain, or a tree with ``parents`` ``[N, D]``): the
    outputs native verify gives, the records, and ``state`` untouched.

    Chain outputs carry the state in ``compute_dtype`` across the window; a tree node's output starts
    from its parent's rounded state (as native tree verify), so the reference walks each node's path
    from the root. Returns ``(o [N, D, HV, V], records)``.
    """
    x = prepare(inputs, params, compute_dtype)
    records = CompactRecords(k_raw=inputs.k, v_raw=inputs.v, g=x.g, beta=x.beta)
    n, d = inputs.k.shape[:2]
    if parents is None:
        h, outs = state.to(compute_dtype), []
        for t in range(d):
            h, o, _ = delta_rule_step(h, x.q[:, t], x.k[:, t], x.v[:, t], x.g[:, t], x.beta[:, t])
            outs.append(o)
        return torch.stack(outs, 1), records
    outs = torch.empty(n, d, *x.v.shape[2:], dtype=compute_dtype)
    for t in range(d):
        for i, path in enumerate(accepted_path(torch.full((n,), t), parents)):
            h = state[i:i + 1]
            for node in path:
                hs, o, _ = delta_rule_step(h.to(compute_dtype), x.q[i:i + 1, node], x.k[i:i + 1, node],
                                           x.v[i:i + 1, node], x.g[i:i + 1, node], x.beta[i:i + 1, node])
                h = hs.to(state.dtype)
            outs[i, t] = o[0]
    return outs, records


def compact_commit(state: torch.Tensor, records: CompactRecords, last_index: torch.Tensor,
                   parents: torch.Tensor | None = None,
                   compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Commit each request's accepted prefix: re-run it from ``state`` ``[N, HV, V, K]`` over the raw
    records and write the state once.

    ``last_index`` ``[N]``: window index of the last accepted node (accepted length ``n`` minus one,
    base token included; ``-1`` for padding or nothing accepted: the state is left as it is).
    ``parents`` ``[N, D]`` selects tree semantics (path through the parents, rounding per step);
    None is a chain (rounding once). Returns the new state in ``state.dtype``.
    """
    hv = records.v_raw.shape[2]
    k = expand_key_heads(l2norm(records.k_raw.to(compute_dtype)), hv)
    v, g, beta = (t.to(compute_dtype) for t in (records.v_raw, records.g, records.beta))
    out = state.clone()
    for i, path in enumerate(accepted_path(last_index, parents)):
        if not path:
            continue
        h = state[i:i + 1].to(compute_dtype)
        for node in path:
            h, _, _ = delta_rule_step(h, None, k[i:i + 1, node], v[i:i + 1, node], g[i:i + 1, node],
                                      beta[i:i + 1, node])
            if parents is not None:
                h = h.to(state.dtype).to(compute_dtype)
        out[i] = h[0].to(state.dtype)
    return out
