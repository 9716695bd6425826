"""Turning per-request bytes into a request count, the way SGLang 0.5.14 does.

Mirrors ``ModelRunnerKVCacheMixin.handle_max_mamba_cache`` (auto-fit branch) and
``_resolve_max_num_reqs`` / ``_calculate_mamba_ratio`` in
``sglang/srt/model_executor/model_runner_kv_cache_mixin.py``:

* ``ratio`` pool slots are kept per running request (``MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO``
  = 3 with the radix cache, plus 2 — or 1 — ping-pong slots with the ``extra_buffer`` strategy;
  1 with ``--disable-radix-cache``);
* every slot holds the per-slot bytes (SGLang: ``mamba_cache_per_req`` = state + conv window);
  only running requests hold the speculative scratch (SGLang allocates ``intermediate_ssm`` for
  ``max_running_requests`` requests, not per slot). SGLang solves
  ``size · per_req · (1 + D / ratio) = budget`` for the slot count; with a general split
  (slot bytes S, running-only bytes R) that is ``size = floor(budget / (S + R / ratio))``;
* ``max_running_requests = size // ratio`` (further capped by ``--max-running-requests``).

Differences, stated: the budget here is the mamba pool's own budget (SGLang first takes
``mamba_full_memory_ratio / (1 + mamba_full_memory_ratio)`` of the memory left after weights);
the division is exact rational arithmetic where SGLang divides floats (they can differ by one slot
exactly at a boundary); and, as in SGLang, the pool's extra padding slot (``MambaPool`` allocates
``size + 1`` and ``spec_state_size + 1``) is not charged. With ``ratio`` = 1 the count is simply
``floor(budget / per-request bytes)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .bytes import ModeBytes

MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO = 3
MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP = 2
MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP_LAZY = 1
MAMBA_CACHE_V2_ADDITIONAL_RATIO_NO_OVERLAP = 1


def mamba_ratio(*, radix_cache: bool = False, extra_buffer: bool = False, lazy: bool = False,
                overlap_schedule: bool = True) -> int:
    """Pool slots per running request, as ``_calculate_mamba_ratio``: 1 without the radix cache,
    3 with it (``no_buffer``), 5 with ``extra_buffer`` and the overlap scheduler, 4 with
    ``extra_buffer_lazy`` or without the overlap scheduler."""
    if not radix_cache:
        return 1
    additional = 0
    if extra_buffer or lazy:
        if overlap_schedule:
            additional = (MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP_LAZY if lazy
                          else MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP)
        else:
            if lazy:
                raise ValueError("extra_buffer_lazy requires the overlap schedule")
            additional = MAMBA_CACHE_V2_ADDITIONAL_RATIO_NO_OVERLAP
    return MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO + additional


@dataclass(frozen=True)
class PoolFit:
    """Result of fitting a budget: pool slots (SGLang's ``max_mamba_cache_size``) and the
    running-request cap that follows from them."""

    mamba_cache_size: int
    max_running_requests: int


def fit_pool(budget_bytes: int, cost: ModeBytes, *, ratio: int = 1,
             max_running_requests: int | None = None) -> PoolFit:
    """Slots and max running requests a ``budget_bytes`` pool holds at ``cost`` per request.

    ``cost.slot_bytes`` is held by every slot, ``cost.running_bytes`` only by running requests
    (see the module docstring for what is mirrored from SGLang).
    """
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    budget = int(budget_bytes)
    slot, running = cost.slot_bytes, cost.running_bytes
    if slot <= 0:
        raise ValueError("a pool slot must cost more than 0 bytes")
    if budget <= 0:
        size = 0
    elif running == 0:
        size = budget // slot
    else:
        size = (budget * ratio) // (slot * ratio + running)
    reqs = size // ratio
    if max_running_requests is not None:
        reqs = min(reqs, max_running_requests)
    return PoolFit(mamba_cache_size=size, max_running_requests=reqs)


def sglang_native_charge(per_req_bytes: int, draft_tokens: int) -> ModeBytes:
    """What SGLang 0.5.14's ``handle_max_mamba_cache`` charges native per request: each slot
    ``mamba_cache_per_req`` (state + conv window) and, with speculation, ``D · mamba_cache_per_req``
    per running request for the intermediates (an over-estimate: the real ``intermediate_ssm`` is
    D states and the conv-window scratch is smaller than D windows). Returned with the scratch in
    ``scratch`` and the whole slot in ``state`` (the split is not meaningful here)."""
    extra = draft_tokens * per_req_bytes if draft_tokens > 1 else 0
    return ModeBytes(state=per_req_bytes, scratch=extra, conv=0)
