"""Bytes each storage mode keeps: per value head (DESIGN §3), per layer and per request.

What each mode holds per request and linear layer, as the served pool allocates it
(:mod:`sglang_ssm_modes.pool`; the sizing hook charges exactly these bytes):

* ``native`` (SGLang 0.5.14 as is): the state S ``[HV, V, K]`` and the conv window
  ``[conv_dim, conv_kernel - 1]`` per pool slot; with speculative decoding (D > 1) each running
  request adds ``intermediate_ssm`` (D states) and ``intermediate_conv_window`` — deduplicated to
  ``[conv_dim, D + conv_kernel - 2]`` for a linear draft chain (topk <= 1) on CUDA, dense
  ``[D, conv_dim, conv_kernel - 1]`` for EAGLE tree verify (``conv_window_dedup_enabled``; always
  dense for KDA, whose transposed conv state the deduplicated view would alias).
* ``compact``: S and the conv window per slot; a running request adds D records and, like native,
  the conv-window scratch. A record is raw k (per *key* head) and raw v in the activation dtype, the
  decay (fp32; 1 value per value head for GDN, K for KDA) and β (fp32).
* ``replay``: the S checkpoint, the conv window, and a ring of 2·L records plus 20 B of cursor,
  counters and tickets per pool slot (the history belongs to the slot: a radix-cache checkpoint slot keeps its own); a
  running request adds the conv-window scratch when speculating, and compact's D records when the
  verify is a tree (replay routes trees through compact). A record is u (V, fp32), the normalised k
  (K, fp32, per key head), the decay, raw k, raw v and β.

Raw k and normalised k are stored once per key head and shared by its GQA group, so a GDN layer
with HK < HV holds HK of them, not HV. (The conv ring of ``ops.conv_window`` — K - 1 + D columns per
slot, commit by offset move — is built and tested but not what the served pool keeps.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SSMModeConfig
from .shapes import LinearAttnShape, local_shape

SLOT_WORDS_BYTES = 20
"""Replay's int32 words per request and layer beside the records: the cursor (count, phase), the fold
counter, the fault flags and the write-through's tickets (:class:`~sglang_ssm_modes.ops.replay.ReplayRing`)."""

FP32 = 4


@dataclass(frozen=True)
class ModeBytes:
    """Bytes one request holds on one TP rank (per linear layer, or summed over the model).

    Per pool slot: ``state`` (S, or replay's checkpoint), ``conv`` (the conv window) and ``history``
    (replay's 2·L records plus cursors). Per running request only: ``scratch`` (native's
    ``intermediate_ssm``, D states; compact's D records) and ``conv_scratch`` (the speculative
    ``intermediate_conv_window``).
    """

    state: int
    scratch: int
    conv: int
    conv_scratch: int = 0
    history: int = 0

    @property
    def total(self) -> int:
        """Everything the request holds."""
        return self.state + self.scratch + self.conv + self.conv_scratch + self.history

    @property
    def slot_bytes(self) -> int:
        """What every pool slot holds, running request or radix-cache checkpoint."""
        return self.state + self.conv + self.history

    @property
    def running_bytes(self) -> int:
        """What only a running request holds on top of its slot: records / speculative scratch."""
        return self.scratch + self.conv_scratch

    def times(self, n: int) -> "ModeBytes":
        """These bytes ``n`` times over (e.g. over the model's linear layers)."""
        return ModeBytes(self.state * n, self.scratch * n, self.conv * n, self.conv_scratch * n, self.history * n)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def record_bytes(mode: str, *, head_k_dim: int, head_v_dim: int, gate_width: int,
                 activation_dtype: torch.dtype, num_v_heads: int = 1, num_k_heads: int = 1) -> int:
    """Bytes of one token's record for ``num_v_heads`` value heads sharing ``num_k_heads`` key heads.

    compact: raw k (HK·K·act) + raw v (HV·V·act) + decay (HV·gate_width·4) + β (HV·4).
    replay: the compact record plus u (HV·V·4) and normalised k (HK·K·4).
    ``gate_width`` is 1 for GDN's scalar gate and K for KDA's per-channel gate.
    """
    act = _itemsize(activation_dtype)
    raw = num_k_heads * head_k_dim * act + num_v_heads * head_v_dim * act
    compact = raw + num_v_heads * gate_width * FP32 + num_v_heads * FP32
    if mode == "compact":
        return compact
    if mode == "replay":
        return compact + num_v_heads * head_v_dim * FP32 + num_k_heads * head_k_dim * FP32
    raise ValueError(f"mode {mode!r} keeps no records")


def _gate_width(family: str, head_k_dim: int) -> int:
    if family == "gdn":
        return 1
    if family == "kda":
        return head_k_dim
    raise ValueError(f"family {family!r} is not 'gdn' or 'kda'")


def value_head_bytes(cfg: SSMModeConfig, *, family: str, head_k_dim: int, head_v_dim: int) -> int:
    """DESIGN §3's per-value-head figure (one request, one layer, one value head, HK == HV).

    native (SGLang-style): (1 + D) states when D > 1, else 1 state. compact: 1 state + D records.
    replay: 1 state + 2·L records + the 20 B of cursor, counters and tickets (per request and layer, counted once
    here).
    The conv window is not included (it is common to all modes).
    """
    state = head_v_dim * head_k_dim * _itemsize(cfg.state_dtype)
    if cfg.mode == "native":
        return state * (1 + cfg.draft_tokens) if cfg.speculative else state
    rec = record_bytes(cfg.mode, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                       gate_width=_gate_width(family, head_k_dim),
                       activation_dtype=cfg.activation_dtype)
    extra = SLOT_WORDS_BYTES if cfg.mode == "replay" else 0
    return state + cfg.ring_records * rec + extra


def lightllm_native_value_head_bytes(cfg: SSMModeConfig, *, head_k_dim: int, head_v_dim: int) -> int:
    """LightLLM-style native per value head: D states (for DESIGN §3's comparison only)."""
    return cfg.draft_tokens * head_v_dim * head_k_dim * _itemsize(cfg.state_dtype)


def layer_bytes(shape: LinearAttnShape, cfg: SSMModeConfig, *, tp: int = 1,
                conv_dtype: torch.dtype = torch.bfloat16, eagle_topk: int = 1) -> ModeBytes:
    """Bytes one request holds for one linear layer on one of ``tp`` ranks (exact, GQA included), as
    the served pool allocates them (module docstring).

    ``conv_dtype`` is SGLang's conv-state dtype (``SGLANG_MAMBA_CONV_DTYPE``, bfloat16 by default).
    ``eagle_topk`` selects the conv-window scratch layout (deduplicated for topk <= 1, GDN only) and,
    for replay, whether trees add compact's records.
    """
    loc = local_shape(shape, tp)
    k, v, kc = shape.head_k_dim, shape.head_v_dim, shape.conv_kernel
    d = cfg.draft_tokens
    conv_item = _itemsize(conv_dtype)
    state = loc.num_v_heads * v * k * _itemsize(cfg.state_dtype)
    conv = loc.conv_dim * (kc - 1) * conv_item
    if not cfg.speculative:
        conv_scratch = 0
    elif (eagle_topk is None or eagle_topk <= 1) and shape.family == "gdn":
        conv_scratch = loc.conv_dim * (d + kc - 2) * conv_item
    else:
        conv_scratch = d * loc.conv_dim * (kc - 1) * conv_item
    if cfg.mode == "native":
        return ModeBytes(state=state, scratch=d * state if cfg.speculative else 0, conv=conv,
                         conv_scratch=conv_scratch)

    def records(mode: str) -> int:
        return record_bytes(mode, head_k_dim=k, head_v_dim=v, gate_width=shape.gate_width,
                            activation_dtype=cfg.activation_dtype, num_v_heads=loc.num_v_heads,
                            num_k_heads=loc.num_k_heads)

    tree = eagle_topk is not None and eagle_topk > 1
    compact_records = d * records("compact") if cfg.speculative and (cfg.mode == "compact" or tree) else 0
    history = 2 * cfg.replay_history * records("replay") + SLOT_WORDS_BYTES if cfg.mode == "replay" else 0
    return ModeBytes(state=state, scratch=compact_records, conv=conv, conv_scratch=conv_scratch, history=history)


def request_bytes(shape: LinearAttnShape, cfg: SSMModeConfig, *, tp: int = 1,
                  conv_dtype: torch.dtype = torch.bfloat16, eagle_topk: int = 1) -> ModeBytes:
    """Bytes one request holds over all of the model's linear layers on one TP rank.

    For native without speculation this equals SGLang's ``mamba_cache_per_req``.
    """
    return layer_bytes(shape, cfg, tp=tp, conv_dtype=conv_dtype,
                       eagle_topk=eagle_topk).times(shape.num_linear_layers)
