"""Plain-torch references of every recurrence the modes use (any dtype, float64 for checks).

* :mod:`.gating` — SGLang 0.5.14's gate, beta, L2 norm and GQA head mapping;
* :mod:`.native` — native decode, chain / tree verify and chunked prefill, with SGLang's rounding;
* :mod:`.compact` — output-only verify with raw-input records and the commit of an accepted prefix;
* :mod:`.replay` — outputs from a checkpoint plus history records, the exact fold and the write-through decode;
* :mod:`.conv` — SGLang's causal conv update and the conv window as a ring committed by offset;
* :mod:`.random_layer` — seeded parameters and inputs at realistic scales.
"""

from .compact import CompactRecords, compact_commit, compact_verify
from .gating import GateParams, LinearAttnInputs, prepare
from .native import accepted_path, chain_verify, chunked_prefill, decode, delta_rule_step, scatter_accepted, tree_verify
from .replay import ReplayRecords, fold, replay_forward, write_through, write_through_verify

__all__ = [
    "CompactRecords", "GateParams", "LinearAttnInputs", "ReplayRecords", "accepted_path", "chain_verify",
    "chunked_prefill", "compact_commit", "compact_verify", "decode", "delta_rule_step", "fold", "prepare",
    "replay_forward", "scatter_accepted", "tree_verify", "write_through", "write_through_verify",
]
