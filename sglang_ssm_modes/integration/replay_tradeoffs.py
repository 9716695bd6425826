"""Where replay's kernels are faster and where slower than SGLang's native ones, said in the server log
at startup so that a user who chose ``--ssm-state-mode replay`` for speed learns where it does not pay.

Kernel-level ratios (native µs / replay µs, one run side by side, CUDA-graph replay over rotating
slots, folds amortised as in serving) measured on an NVIDIA H200 at Qwen3-Next (GDN) and Kimi-Linear
(KDA) head shapes; the sources are under ``bench/results/`` (README "Results"). A configuration that
was not measured says so instead of guessing.
"""

from __future__ import annotations

import logging

import torch

from ..config import SSMModeConfig, dtype_name

OFFICIAL = "bench/results/replay_h200.md, commit 34d5527"
SOURCES = {**{(family, L): OFFICIAL for family in ("gdn", "kda") for L in (16, 32, 64)},
           **{("gdn", L): OFFICIAL + "; below 32 requests bench/results/replay/onelaunch_bound_20261204, commit "
                                     "b29f6ef" for L in (32, 64)}}
"""Where the figures of each ``(family, history)`` come from (GDN's cells of 1 and 8 requests at L = 32 and 64,
as served now, from a later run than the rest: ratios within one run each, not across)."""

DECODE = {
    ("gdn", 16): ("plain decode 0.60-0.89x native below 64 running requests, 1.17-1.25x from 64 to 256", False),
    ("kda", 16): ("plain decode 0.41-0.85x native below 64 running requests, 1.01-1.10x from 64 to 256", False),
    ("gdn", 32): ("plain decode 0.57x native at 1 and 8 running requests, 0.79-0.83x at 32-64, 1.10-1.12x at "
                  "128-256", False),
    ("kda", 32): ("plain decode 0.44-0.85x native at 1-256 running requests", True),
    ("gdn", 64): ("plain decode 0.42-0.85x native at 1-256 running requests (1 and 8 measured: 0.42x, 0.47x)",
                  True),
    ("kda", 64): ("plain decode 0.42-0.59x native at 1-256 running requests", True),
}
"""Plain decode (float32 state) per ``(family, history)``: the sentence, and whether replay was slower than
native at every batch measured. Below 64 requests a replay step is launch-bound, not byte-bound: SGLang's
decode is one launch, ours one (a GDN window of at most 8 tokens over at most 16 records) or two (window,
output), plus the cursor's. At L = 64 the window launch reads up to 64 history keys per head."""

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
"""Chain verify + acceptance (float32 state, D = 4) per ``(family, history)``, as :data:`DECODE` (same keys)."""

LOW_PRECISION = ("with a {dtype} state replay's kernels were slower than native's at most batches measured "
                 "(L = 16, a bfloat16 state: plain decode 0.48-0.89x (GDN) and 0.26-0.74x (KDA) at every batch, a "
                 "D = 4 round 0.75-0.80x (GDN) and 0.62x (KDA) below 32 requests, 1.14-1.50x and 1.06-1.33x from "
                 "32; bench/results/replay_h200.md; float16 not measured): native's 2-byte state moves half the "
                 "bytes of a float32 one, replay's history reads do not shrink. What replay gives there is a "
                 "checkpoint rounded once per fold (bench/results/replay/drift_20261203: a third to a half of "
                 "native's drift over 10 000 tokens). For speed pass --mamba-ssm-dtype float32; for memory, "
                 "--ssm-state-mode compact")


def replay_tradeoffs(cfg: SSMModeConfig, family: str, state_dtype: torch.dtype,
                     tree_verify: bool) -> list[tuple[int, str]]:
    """``(logging level, sentence)`` pairs on replay's speed against native for a replay pool of this
    configuration, model family (``"gdn"`` / ``"kda"``) and the state dtype the pool holds (``--mamba-ssm-dtype``
    or the model's own): WARNING where replay's kernels were measured slower than native's at every batch,
    INFO otherwise. Empty for other modes."""
    if cfg.mode != "replay":
        return []
    where = f"{family.upper()}, L = {cfg.replay_history}"
    if state_dtype != torch.float32:
        return [(logging.WARNING, "replay " + LOW_PRECISION.format(dtype=dtype_name(state_dtype)))]
    key = (family, cfg.replay_history)
    if key not in DECODE:
        measured = sorted({L for _, L in SOURCES})
        return [(logging.INFO, f"replay ({where}): speed against native not measured for this history "
                               f"(measured: L = {', '.join(map(str, measured))})")]
    out = []
    for text, slower_everywhere in [DECODE[key]] + ([VERIFY[key]] if cfg.draft_tokens > 1 and not tree_verify else []):
        text += f" ({SOURCES[key]})"
        if slower_everywhere:
            text += ": slower than native at every batch measured (L = 16 is the fastest history)"
        out.append((logging.WARNING if slower_everywhere else logging.INFO,
                    f"replay kernels against native ({where}, float32 state, H200): {text}"))
    if cfg.draft_tokens > 1 and tree_verify:
        out.append((logging.INFO, "replay's tree verify runs compact's kernels: bench/results/compact_h200.md"))
    return out
