"""Where replay's kernels are faster and where slower than SGLang's native ones, said in the server log
at startup so that a user who chose ``--ssm-state-mode replay`` for speed learns where it does not pay.

Kernel-level ratios (native µs / replay µs, one run side by side, CUDA-graph replay over rotating
slots, folds amortised as in serving) measured on an NVIDIA H200 (the write-through decode as served now: on
an H100; each source names its card) at Qwen3-Next (GDN) and Kimi-Linear (KDA) head shapes; the sources are
under ``bench/results/`` (README "Results"). A configuration that was not measured says so instead of guessing.
"""

from __future__ import annotations

import logging

import torch

from ..config import SSMModeConfig, dtype_name
from ..ops.replay.decode import state_bytes, write_through_max_requests

OFFICIAL = "bench/results/replay_h200.md, commit 34d5527"
SOURCES = {**{(family, L): OFFICIAL for family in ("gdn", "kda") for L in (16, 32, 64)},
           **{("gdn", L): OFFICIAL + "; below 32 requests bench/results/replay/onelaunch_bound_20261204, commit "
                                     "b29f6ef" for L in (32, 64)}}
"""Where the figures of each ``(family, history)`` come from (GDN's cells of 1 and 8 requests at L = 32 and 64,
as served now, from a later run than the rest: ratios within one run each, not across)."""

OUTPUT_ONLY_SOURCE = "bench/results/replay/writethrough_20261205, commit a6a4a2a, H200"
WRITE_THROUGH_SOURCE = "bench/results/replay/writethrough_tile_20261205, commit bd811dc, H100"
"""Where the plain-decode figures come from: the output-only path's (both paths side by side in one run per state
dtype) and the write-through's as served now (its 16-column tile, side by side with native in one run)."""

OUTPUT_ONLY_DECODE = {
    ("gdn", 16, 4): ("1.17-1.24x native from 64 to 256 running requests", False),
    ("kda", 16, 4): ("1.13-1.15x native from 64 to 256 running requests", False),
    ("gdn", 32, 4): ("1.11-1.12x native at 128-256 running requests", False),
    ("gdn", 16, 2): ("0.88-0.91x native at 128-256 running requests", True),
    ("kda", 16, 2): ("0.76x native at 128-256 running requests", True),
}
"""Plain decode per ``(family, history, state bytes)`` where it is served output-only (from
``ops.replay.decode.WRITE_THROUGH_BELOW`` requests on): the measured ratio there, and whether it was slower than
native."""
WRITE_THROUGH = ("a write-through is SGLang's decode work in one launch (the state read and written, a float32 "
                 "state's bits native's) plus the fold of any pending history")
WRITE_THROUGH_SPEED = {
    ("gdn", 4): ("1.19x native at 1 request, 0.96-1.00x from 8 to 256", False),
    ("kda", 4): ("0.97-1.11x native at every batch measured", False),
    ("gdn", 2): ("0.99-1.01x native below 32 requests, 0.87-0.92x from 32 to 256 (SGLang's packed decode moves a "
                 "2-byte state at 0.85-0.94 of copy bandwidth, the write-through at 0.76-0.82; for speed pass "
                 "--mamba-ssm-dtype float32)", False),
    ("kda", 2): ("0.99-1.02x native below 32 requests, 0.86-0.92x from 32 to 256 (as GDN; for speed pass "
                 "--mamba-ssm-dtype float32)", False),
}
"""Write-through decode against native per ``(family, state bytes)`` (a steady write-through has no history, so
one figure for every L), and whether it was never faster than native."""
LOW_PRECISION_DECODE = ("where plain decode writes through, a {dtype} state rounds after every token as native's "
                        "does; output-only decode and speculative rounds round it once per fold (bench/results/"
                        "replay/drift_20261203: a third to a half of native's drift over 10 000 tokens)")
VERIFY = {
    ("gdn", 16): ("a D = 4 speculative round 0.92-0.99x native below 32 requests, 1.63-2.05x from 32 to 256", False),
    ("kda", 16): ("a D = 4 speculative round 0.99-1.04x native below 32 requests, 1.71-1.82x from 32 to 256", False),
    ("gdn", 32): ("a D = 4 speculative round 0.63x native at 1 request, 0.85x at 8, 1.20-1.85x from 32 to 256",
                  False),
    ("kda", 32): ("a D = 4 speculative round 0.78-0.84x native below 32 requests, 1.18-1.73x from 32 to 256", False),
    ("gdn", 64): ("a D = 4 speculative round 0.72x native at 1 request, 0.90x at 8, 1.09-1.40x from 32 to 256",
                  False),
    ("kda", 64): ("a D = 4 speculative round 0.81-0.95x native below 128 requests, 1.08-1.09x at 128-256", False),
}
"""Chain verify + acceptance (float32 state, D = 4) per ``(family, history)``: the sentence, and whether replay
was slower than native at every batch measured."""

FASTEST_HISTORY = " (L = 16 is the fastest history)"
"""The hint a float32 pool's warning ends with."""
LOW_PRECISION_VERIFY = ("with a {dtype} state a D = 4 speculative round was slower than native below 32 requests "
                        "(L = 16, bfloat16: 0.75-0.80x GDN, 0.62x KDA) and faster from 32 (1.14-1.50x GDN, "
                        "1.06-1.33x KDA; float16 not measured): native's 2-byte state moves half the bytes of a "
                        "float32 one, replay's history reads do not shrink. For speed pass --mamba-ssm-dtype "
                        "float32; for memory, --ssm-state-mode compact")


def decode_sentence(family: str, history: int, state_dtype: torch.dtype) -> tuple[str, bool]:
    """How a replay pool of this family, history and state dtype serves plain decode, with the measured ratios of
    both paths (:data:`WRITE_THROUGH_SPEED`, :data:`OUTPUT_ONLY_DECODE`), and whether it was slower than native at
    every batch measured."""
    nbytes = state_bytes(state_dtype)
    most = write_through_max_requests(family == "kda", history, state_dtype)
    speed, through_slower = WRITE_THROUGH_SPEED[(family, nbytes)]
    through = f"{WRITE_THROUGH}: {speed} ({WRITE_THROUGH_SOURCE})"
    if most is None:
        return ("plain decode writes through at every batch (output-only decode was measured slower than that at "
                f"every batch for this history and state): {through}"), through_slower
    measured = "" if history >= 16 else " (measured at L = 16)"
    output_only, output_only_slower = OUTPUT_ONLY_DECODE[(family, max(history, 16), nbytes)]
    return (f"plain decode writes through below {most + 1} requests per step, counting a CUDA graph's padding "
            f"({through}); output-only from {most + 1}: {output_only}{measured} ({OUTPUT_ONLY_SOURCE})",
            through_slower and output_only_slower)


def replay_tradeoffs(cfg: SSMModeConfig, family: str, state_dtype: torch.dtype,
                     tree_verify: bool) -> list[tuple[int, str]]:
    """``(logging level, sentence)`` pairs on replay's speed against native for a replay pool of this
    configuration, model family (``"gdn"`` / ``"kda"``) and the state dtype the pool holds (``--mamba-ssm-dtype``
    or the model's own): WARNING where replay's kernels were measured slower than native's at every batch,
    INFO otherwise. Empty for other modes."""
    if cfg.mode != "replay":
        return []
    where = f"{family.upper()}, L = {cfg.replay_history}"
    spec_chain = cfg.draft_tokens > 1 and not tree_verify
    decode, slower = decode_sentence(family, cfg.replay_history, state_dtype)
    state = dtype_name(state_dtype)
    if slower:
        decode += (": slower than native at every batch measured" + (
            "; for speed pass --mamba-ssm-dtype float32, for memory --ssm-state-mode compact"
            if state_dtype != torch.float32 else FASTEST_HISTORY))
    out = [(logging.WARNING if slower else logging.INFO,
            f"replay kernels against native ({where}, {state} state): {decode}")]
    key = (family, cfg.replay_history)
    if state_dtype != torch.float32:
        out.append((logging.INFO, f"replay ({where}): " + LOW_PRECISION_DECODE.format(dtype=state)))
        if spec_chain:
            out.append((logging.WARNING, "replay " + LOW_PRECISION_VERIFY.format(dtype=state)))
    elif spec_chain and key in VERIFY:
        text, slower_everywhere = VERIFY[key]
        text += f" ({SOURCES[key]})"
        if slower_everywhere:
            text += ": slower than native at every batch measured" + FASTEST_HISTORY
        out.append((logging.WARNING if slower_everywhere else logging.INFO,
                    f"replay kernels against native ({where}, float32 state, H200): {text}"))
    elif spec_chain:
        measured = sorted({L for _, L in SOURCES})
        out.append((logging.INFO, f"replay ({where}): a speculative round's speed against native not measured "
                                  f"for this history (measured: L = {', '.join(map(str, measured))})"))
    if cfg.draft_tokens > 1 and tree_verify:
        out.append((logging.INFO, "replay's tree verify runs compact's kernels: bench/results/compact_h200.md"))
    return out
