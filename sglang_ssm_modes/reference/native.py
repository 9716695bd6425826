"""Reference for SGLang 0.5.14's native recurrent-state paths (plain torch, any working dtype).

State layout is SGLang's: ``[N, HV, V, K]`` (value-major, key contiguous), stored in the pool's
dtype (float32, bfloat16 or float16). The step is the kernel's, op for op
(``fused_sigmoid_gating_delta_rule_update_kernel``)::

    h *= exp(g)                  # scalar (GDN) or per key channel (KDA)
    v -= sum_k h[v, k] * k[k]
    v *= beta                    # this v is the replay record's ``u``
    h += v[:, None] * k[None, :]
    o  = sum_k h[v, k] * q[k]    # q already normalised and scaled

Where the native paths round the state to its storage dtype differs, and matters for bfloat16:

* ``decode``: after every token (each token is one kernel launch that writes the state back);
* ``chain_verify``: never inside the window; each step's state is *stored* as a rounded copy
  (SGLang's ``intermediate_ssm``) and the accepted copy is scattered back, so the committed state is
  ``round(S_n)``;
* ``tree_verify``: every step reloads its parent's stored (rounded) state, so it rounds per step;
* ``chunked_prefill``: the state carried in float32 across chunks and rounded once when stored
  (SGLang's chunk kernels additionally round q/k, the WY factors and per-chunk states to the
  activation dtype, so they agree with this reference to bf16 precision, not float32).
"""

from __future__ import annotations

import torch

from .gating import GateParams, LinearAttnInputs, PreparedInputs, prepare


def delta_rule_step(h: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch, in the dtype of its inputs.

    ``h`` ``[N, HV, V, K]``; ``q, k`` ``[N, HV, K]`` (normalised, q scaled); ``v`` ``[N, HV, V]``;
    ``g`` ``[N, HV, Kg]``; ``beta`` ``[N, HV]``. Returns the new state, the output ``o`` ``[N, HV, V]``
    (None when ``q`` is None: a state-only step, as in a fold) and the update vector
    ``u = beta * (v - h k)`` ``[N, HV, V]``.
    """
    h = h * torch.exp(g)[:, :, None, :]
    u = (v - (h * k[:, :, None, :]).sum(-1)) * beta[..., None]
    h = h + u[..., :, None] * k[:, :, None, :]
    o = None if q is None else (h * q[:, :, None, :]).sum(-1)
    return h, o, u


def _step(h: torch.Tensor, x: PreparedInputs, t: int):
    return delta_rule_step(h, x.q[:, t], x.k[:, t], x.v[:, t], x.g[:, t], x.beta[:, t])


def decode(state: torch.Tensor, inputs: LinearAttnInputs, params: GateParams,
           compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """T decode steps, the state rounded to its storage dtype after every token.

    Returns ``(o [N, T, HV, V] in compute_dtype, new state [N, HV, V, K] in state.dtype)``.
    """
    x = prepare(inputs, params, compute_dtype)
    outs = []
    for t in range(inputs.num_tokens):
        h, o, _ = _step(state.to(compute_dtype), x, t)
        state = h.to(state.dtype)
        outs.append(o)
    return torch.stack(outs, 1), state


def chain_verify(state: torch.Tensor, inputs: LinearAttnInputs, params: GateParams,
                 compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Target verify of a chain of T tokens (EAGLE/NEXTN topk = 1): the state stays in
    ``compute_dtype`` across the window; step t's state is stored as a rounded copy.

    Returns ``(o [N, T, HV, V], intermediate states [N, T, HV, V, K] in state.dtype)``; ``state`` is
    not modified (SGLang runs verify with ``disable_state_update``).
    """
    x = prepare(inputs, params, compute_dtype)
    h = state.to(compute_dtype)
    outs, steps = [], []
    for t in range(inputs.num_tokens):
        h, o, _ = _step(h, x, t)
        outs.append(o)
        steps.append(h.to(state.dtype))
    return torch.stack(outs, 1), torch.stack(steps, 1)


def tree_verify(state: torch.Tensor, inputs: LinearAttnInputs, params: GateParams, parents: torch.Tensor,
                compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Target verify of a draft tree (EAGLE topk > 1, NGRAM): node 0 is the base token and starts
    from ``state``; node ``t > 0`` starts from the *stored, rounded* state of node ``parents[:, t]``
    (SGLang's ``retrieve_parent_token``), so the state is rounded at every step.

    ``parents`` ``[N, T]`` (int; entry 0 is ignored). Returns ``(o, intermediate states)`` as
    :func:`chain_verify`.
    """
    x = prepare(inputs, params, compute_dtype)
    n = state.shape[0]
    rows = torch.arange(n)
    outs, steps = [], []
    for t in range(inputs.num_tokens):
        if t == 0:
            h0 = state.to(compute_dtype)
        else:
            h0 = torch.stack(steps, 1)[rows, parents[:, t].long()].to(compute_dtype)
        h, o, _ = _step(h0, x, t)
        outs.append(o)
        steps.append(h.to(state.dtype))
    return torch.stack(outs, 1), torch.stack(steps, 1)


def accepted_path(last_index: torch.Tensor, parents: torch.Tensor | None) -> list[list[int]]:
    """Node indices of each request's accepted path, root first.

    ``last_index`` ``[N]``: window index of the last accepted node (SGLang's
    ``last_correct_step_indices``; ``-1`` = nothing accepted). For a chain (``parents is None``) the
    path is ``0..last``; for a tree it follows ``parents`` ``[N, T]`` back to node 0.
    """
    paths = []
    for i, last in enumerate(last_index.tolist()):
        if last < 0:
            paths.append([])
        elif parents is None:
            paths.append(list(range(last + 1)))
        else:
            path = [last]
            while path[-1] != 0:
                path.append(int(parents[i, path[-1]]))
                if len(path) > parents.shape[1]:
                    raise ValueError(f"request {i}: parent links do not reach node 0: {parents[i].tolist()}")
            paths.append(path[::-1])
    return paths


def scatter_accepted(state: torch.Tensor, intermediates: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """SGLang's acceptance (``fused_mamba_state_scatter_with_mask``): copy each request's stored state
    at ``last_index`` (``-1``: keep the old state). Returns the new ``[N, HV, V, K]`` state."""
    out = state.clone()
    for i, last in enumerate(last_index.tolist()):
        if last >= 0:
            out[i] = intermediates[i, last]
    return out


def chunked_prefill(state: torch.Tensor, inputs: LinearAttnInputs, params: GateParams,
                    chunk_size: int = 64,
                    compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel prefill (the algebra of ``chunk_gated_delta_rule`` / ``chunk_kda``): within a
    chunk the tokens are solved together (UT / WY form), across chunks the state is carried in
    ``compute_dtype`` and rounded once at the end.

    For a chunk starting from state ``S`` with cumulative log-decay ``G_t`` (per key channel; a
    scalar broadcast for GDN) and relative decays ``D[t, j] = exp(G_t - G_j)`` (j <= t, formed from
    differences so nothing overflows)::

        A[t, j] = beta_t * sum_c k_t[c] k_j[c] D[t, j, c]  for j < t      (strictly lower triangular)
        U = (I + A)^-1 * beta * (V - (k * exp(G)) S^T)                      (all updates u_t at once)
        O[t] = S (q_t * exp(G_t)) + sum_{j<=t} u_j sum_c q_t[c] k_j[c] D[t, j, c]
        S' = S * exp(G_C) + sum_j u_j (k_j * exp(G_C - G_j))^T

    Returns ``(o [N, T, HV, V], final state in state.dtype)``.
    """
    x = prepare(inputs, params, compute_dtype)
    h = state.to(compute_dtype)
    outs = []
    for c0 in range(0, inputs.num_tokens, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, inputs.num_tokens))
        q, k, v, g, beta = (t[:, sl].transpose(1, 2) for t in (x.q, x.k, x.v, x.g, x.beta))  # heads first
        G = g.cumsum(2).expand(*k.shape)  # [N, HV, C, K]
        c = k.shape[2]
        causal = torch.tril(torch.ones(c, c, dtype=torch.bool))[:, :, None]
        rel = G[:, :, :, None, :] - G[:, :, None, :, :]  # [N, HV, C(t), C(j), K]
        D = torch.exp(torch.where(causal, rel, torch.full((), float("-inf"), dtype=rel.dtype)))
        A = torch.einsum("nhtc,nhjc,nhtjc->nhtj", k, k, D).tril(-1) * beta[..., None]
        rhs = beta[..., None] * (v - (k * torch.exp(G)) @ h.transpose(-1, -2))
        U = torch.linalg.solve_triangular(torch.eye(c, dtype=A.dtype) + A, rhs, upper=False, unitriangular=True)
        P = torch.einsum("nhtc,nhjc,nhtjc->nhtj", q, k, D)
        outs.append(((q * torch.exp(G)) @ h.transpose(-1, -2) + P @ U).transpose(1, 2))
        GC = G[:, :, -1:, :]
        h = h * torch.exp(GC) + U.transpose(-1, -2) @ (k * torch.exp(GC - G))
    return torch.cat(outs, 1), h.to(state.dtype)
