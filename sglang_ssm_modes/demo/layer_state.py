"""Per-layer recurrent state of a batch of requests in each mode, driven through the references.

Each holder serves a speculative round the way the mode will in SGLang: ``verify`` gives the window's
outputs for every request (padding rows included), ``accept`` commits each request's accepted prefix
(``last_index`` = accepted length - 1, ``-1`` for padding / nothing), and ``committed`` returns the
canonical committed state (materialising it for replay, without touching checkpoint or history).
"""

from __future__ import annotations

import torch

from ..reference import (
    ReplayRecords, chain_verify, compact_commit, compact_verify, fold, replay_forward, scatter_accepted,
)
from ..reference.gating import GateParams, LinearAttnInputs


class NativeLayerState:
    """SGLang's native path: verify stores every step's state; accept copies the accepted one."""

    def __init__(self, state: torch.Tensor, params: GateParams):
        self.state, self.params, self._steps = state.clone(), params, None

    def verify(self, x: LinearAttnInputs) -> torch.Tensor:
        o, self._steps = chain_verify(self.state, x, self.params)
        return o

    def accept(self, last_index: torch.Tensor) -> None:
        self.state = scatter_accepted(self.state, self._steps, last_index)

    def committed(self) -> torch.Tensor:
        return self.state


class CompactLayerState:
    """Compact: verify is output-only and records raw inputs; accept re-runs the accepted prefix."""

    def __init__(self, state: torch.Tensor, params: GateParams):
        self.state, self.params, self._records = state.clone(), params, None

    def verify(self, x: LinearAttnInputs) -> torch.Tensor:
        o, self._records = compact_verify(self.state, x, self.params)
        return o

    def accept(self, last_index: torch.Tensor) -> None:
        self.state = compact_commit(self.state, self._records, last_index)

    def committed(self) -> torch.Tensor:
        return self.state


class ReplayLayerState:
    """Replay: a checkpoint per request plus its records since; verify is output-only against both,
    accept keeps the accepted records (the cursor moves), and a request's history is folded into its
    checkpoint before the next window could overflow ``history`` (L)."""

    def __init__(self, state: torch.Tensor, params: GateParams, history: int):
        self.checkpoint, self.params, self.L = state.clone(), params, history
        self.history: list[ReplayRecords | None] = [None] * state.shape[0]
        self._window: list[ReplayRecords] = []
        self.folds = 0

    def _length(self, i: int) -> int:
        return 0 if self.history[i] is None else self.history[i].num_tokens

    def verify(self, x: LinearAttnInputs) -> torch.Tensor:
        outs, self._window = [], []
        for i in range(self.checkpoint.shape[0]):
            if self._length(i) + x.num_tokens > self.L:
                self._fold(i)
            o, rec = replay_forward(self.checkpoint[i:i + 1], self.history[i], _row(x, i), self.params)
            outs.append(o)
            self._window.append(rec)
        return torch.cat(outs, 0)

    def _fold(self, i: int) -> None:
        self.checkpoint[i] = fold(self.checkpoint[i:i + 1], self.history[i])[0]
        self.history[i] = None
        self.folds += 1

    def accept(self, last_index: torch.Tensor) -> None:
        for i, last in enumerate(last_index.tolist()):
            if last >= 0:
                kept = self._window[i].tokens(0, last + 1)
                self.history[i] = kept if self.history[i] is None else self.history[i].cat(kept)
                assert self._length(i) <= self.L, "replay ring overflow: fold policy violated"

    def committed(self) -> torch.Tensor:
        return torch.cat([self.checkpoint[i:i + 1] if self.history[i] is None
                          else fold(self.checkpoint[i:i + 1], self.history[i])
                          for i in range(self.checkpoint.shape[0])], 0)


def _row(x: LinearAttnInputs, i: int) -> LinearAttnInputs:
    return LinearAttnInputs(*(t[i:i + 1] for t in (x.q, x.k, x.v, x.a, x.b)))


def make_layer_state(mode: str, state: torch.Tensor, params: GateParams, history: int):
    """The holder for ``mode`` ("native", "compact" or "replay")."""
    if mode == "native":
        return NativeLayerState(state, params)
    if mode == "compact":
        return CompactLayerState(state, params)
    if mode == "replay":
        return ReplayLayerState(state, params, history)
    raise ValueError(f"unknown mode {mode!r}")
