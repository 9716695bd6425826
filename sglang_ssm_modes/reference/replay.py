"""Reference for the ``replay`` mode: outputs from a checkpoint ``S0`` plus per-token records,
without materialising the state, and the exact fold (DESIGN §2, "Replay algebra").

Per value head, with ``G_t = sum_{i<=t} g_i`` counted from the checkpoint (a scalar for GDN, a
K-vector for KDA) and ``k, q`` normalised (q scaled)::

    u_t = beta_t [ v_t - S0 (e^{G_t} * k_t) - sum_{j<t} u_j ((k_j * e^{G_t - G_j}) . k_t) ]
    o_t = S0 (e^{G_t} * q_t) + sum_{j<=t} u_j ((k_j * e^{G_t - G_j}) . q_t)

``u_t`` equals the native step's ``beta * (v - h k)`` exactly in exact arithmetic, so ``o_t`` is the
native output. The fold re-runs the native recurrence from the *raw* records (raw k re-normalised,
raw v, stored g and beta) in the working dtype and rounds once: it never depends on the ``u`` the
fast path computed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .gating import GateParams, LinearAttnInputs, expand_key_heads, l2norm, prepare
from .native import decode, delta_rule_step


@dataclass(frozen=True)
class ReplayRecords:
    """History records of T tokens per request (the reference keeps them as dense tensors; the pool
    keeps them in a ring of 2·L with a cursor).

    ``u`` ``[N, T, HV, V]``, ``k_norm`` ``[N, T, HK, K]`` (normalised key, per key head), ``g``
    ``[N, T, HV, Kg]`` and ``beta`` ``[N, T, HV]`` in the record dtype (float32 in the kernels);
    ``k_raw`` ``[N, T, HK, K]`` and ``v_raw`` ``[N, T, HV, V]`` in the activation dtype.
    """

    u: torch.Tensor
    k_norm: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    k_raw: torch.Tensor
    v_raw: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.u.shape[1]

    def tokens(self, start: int, stop: int) -> "ReplayRecords":
        """Records ``start:stop`` of every request."""
        return ReplayRecords(*(getattr(self, f.name)[:, start:stop] for f in fields(self)))

    def cat(self, other: "ReplayRecords") -> "ReplayRecords":
        """These records followed by ``other``'s."""
        return ReplayRecords(*(torch.cat([getattr(self, f.name), getattr(other, f.name)], 1) for f in fields(self)))


def replay_forward(checkpoint: torch.Tensor, history: ReplayRecords | None, inputs: LinearAttnInputs,
                   params: GateParams,
                   compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ReplayRecords]:
    """Outputs of new tokens against ``checkpoint`` ``[N, HV, V, K]`` plus ``history`` (records since
    the checkpoint, or None), and the new tokens' records. The checkpoint is only read.

    Returns ``(o [N, T, HV, V] in compute_dtype, records of the T new tokens)``.
    """
    x = prepare(inputs, params, compute_dtype)
    hv = x.v.shape[2]
    s0 = checkpoint.to(compute_dtype)
    if history is None or history.num_tokens == 0:
        k_all, u_all, g_all = x.k[:, :0], x.v[:, :0], x.g[:, :0]
    else:
        k_all = expand_key_heads(history.k_norm.to(compute_dtype), hv)
        u_all, g_all = history.u.to(compute_dtype), history.g.to(compute_dtype)
    k_all, g_all = torch.cat([k_all, x.k], 1), torch.cat([g_all, x.g], 1)
    G = g_all.cumsum(1)  # [N, Th + T, HV, Kg]
    th = k_all.shape[1] - inputs.num_tokens
    outs, us = [], []
    for t in range(inputs.num_tokens):
        p = th + t
        decay = torch.exp(G[:, p:p + 1] - G[:, :p + 1])  # [N, p+1, HV, Kg]: e^{G_p - G_j}
        kj = k_all[:, :p + 1] * decay  # [N, p+1, HV, K]
        e = torch.exp(G[:, p])[:, :, None, :]  # [N, HV, 1, Kg]
        w_k = (kj[:, :p] * x.k[:, t, None]).sum(-1)  # [N, p, HV]
        u = x.beta[:, t, :, None] * (x.v[:, t] - (s0 * e * x.k[:, t, :, None, :]).sum(-1)
                                     - (u_all * w_k[..., None]).sum(1))
        u_all = torch.cat([u_all, u[:, None]], 1)
        w_q = (kj * x.q[:, t, None]).sum(-1)  # [N, p+1, HV]
        outs.append((s0 * e * x.q[:, t, :, None, :]).sum(-1) + (u_all * w_q[..., None]).sum(1))
        us.append(u)
    records = ReplayRecords(u=torch.stack(us, 1), k_norm=l2norm(inputs.k.to(compute_dtype)),
                            g=x.g, beta=x.beta, k_raw=inputs.k, v_raw=inputs.v)
    return torch.stack(outs, 1), records


def fold(checkpoint: torch.Tensor, records: ReplayRecords, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The exact fold: the native recurrence from ``checkpoint`` over the raw records (raw k
    re-normalised with SGLang's epsilon, raw v, stored g and beta) in ``compute_dtype``, rounded once
    to the checkpoint's dtype. Also the *materialise* of a committed state. Returns ``[N, HV, V, K]``.
    """
    hv = records.v_raw.shape[2]
    k = expand_key_heads(l2norm(records.k_raw.to(compute_dtype)), hv)
    v, g, beta = (t.to(compute_dtype) for t in (records.v_raw, records.g, records.beta))
    h = checkpoint.to(compute_dtype)
    for t in range(records.num_tokens):
        h, _, _ = delta_rule_step(h, None, k[:, t], v[:, t], g[:, t], beta[:, t])
    return h.to(checkpoint.dtype)


def write_through(checkpoint: torch.Tensor, records: ReplayRecords | None, inputs: LinearAttnInputs,
                  params: GateParams, compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The write-through decode of one token per request (``inputs`` T = 1): the history (None: empty) replayed
    as the fold replays it (:func:`fold`), then the token as native decode applies it (:func:`~.native.decode`),
    in ``compute_dtype`` throughout, rounded once to the checkpoint's dtype. Returns ``(o [N, 1, HV, V] in
    compute_dtype, new checkpoint [N, HV, V, K])``; the history is empty afterwards."""
    h = checkpoint.to(compute_dtype)
    if records is not None:
        h = fold(h, records, compute_dtype)
    o, h = decode(h, inputs, params, compute_dtype)
    return o, h.to(checkpoint.dtype)


def write_through_verify(checkpoint: torch.Tensor, records: ReplayRecords | None, inputs: LinearAttnInputs,
                         params: GateParams, compute_dtype: torch.dtype = torch.float32
                         ) -> tuple[torch.Tensor, ReplayRecords, torch.Tensor]:
    """The write-through verify of a window of T draft tokens per request: the history (None: empty) folded
    into the checkpoint (:func:`fold`, rounded once to its dtype), then the window's outputs and records
    against the folded checkpoint and an empty history (:func:`replay_forward`). Returns ``(o [N, T, HV, V]
    in compute_dtype, the window's records, the folded checkpoint [N, HV, V, K])``."""
    h = checkpoint if records is None else fold(checkpoint, records, compute_dtype)
    o, window = replay_forward(h, None, inputs, params, compute_dtype)
    return o, window, h
