"""Where replay's kernels are faster and where slower than SGLang's native ones, said in the server log
at startup so that a user who chose ``--ssm-state-mode replay`` for speed learns where it does not pay.

Kernel-level ratios (native µs / replay µs, one run side by side, CUDA-graph replay over rotating
slots, folds amortised as in serving) measured on an NVIDIA H200 or H100 (each source names its card) at
Qwen3-Next (GDN) and Kimi-Linear (KDA) head shapes; the sources are
under ``bench/results/`` (README "Results"). A configuration that was not measured says so instead of guessing.
"""

from __future__ import annotations

import logging

import torch

from ..config import SSMModeConfig, dtype_name
from ..ops.replay.served import measured_key, write_through_max_requests, write_through_verify_below

KEY_HEAD_SOURCE = "bench/results/replay/keyhead_bounds_20261206, commit 4a280d3, H100"
"""Where GDN's output-only figures come from since its window launch runs per key head (both paths side by side
with native in one run: plain decode, and D = 4 speculative rounds)."""
WRITE_THROUGH_SOURCE = "bench/results/replay/writethrough_tile_20261205, commit bd811dc, H100"
"""Where the write-through's plain-decode figures come from as served now (its 16-column tile, 8 columns for a KDA
float32 state, side by side with native in one run)."""

THRESHOLD_SOURCE = "bench/results/replay/thresholds_20261206, foldproj_20261206 and pdl_20261206, H100"
"""Where the bounds moved since the cursors settle once a step come from: both paths side by side with native in
one run per family and state dtype, at the batches between those measured before; the figures above them from
the served rows of two more runs that day (commit 3ce6289, same card kind)."""

DECODE_TILING_SOURCE = "bench/results/replay/decode_tiling_20261206, commit 7d73792, H100"
"""Where the figures of the bounds moved with the narrow decode tile at long histories come from (the output-only
path in both tilings and the write-through side by side with native in each of two runs)."""

OUTPUT_ONLY_DECODE = {
    ("gdn", 16, 4): ("1.06x native at 32 running requests, 1.36-1.38x from 64 to 256", False, KEY_HEAD_SOURCE),
    ("kda", 16, 4): ("1.03 / 1.05 / 1.08x native at 40 / 48 / 56 running requests, 1.22-1.25x from 64 to 256; with "
                     "the window reading the history 4 records a step, as served since, 1.25 / 1.29 / 1.28x at 64 / "
                     "128 / 256 (bench/results/replay/window_20261207)", False, THRESHOLD_SOURCE),
    ("gdn", 32, 4): ("1.12 / 1.24 / 1.31x native at 40 / 48 / 56 running requests (bench/results/replay/"
                     "thresholds_20261206), 1.27-1.33x at 64-96, 1.30-1.39x at 112-256", False, DECODE_TILING_SOURCE),
    ("kda", 32, 4): ("1.00-1.04x native from 64 to 256 running requests (one step of 0.95x at 128 whose launches "
                     "add up to 1.06x; the write-through 0.97-1.00x there); with the window reading the history's "
                     "raw keys, as served since, 1.07 / 1.06 / 1.04x at 64 / 128 / 256 (bench/results/replay/"
                     "rawkeys_kda_20261207)", False, DECODE_TILING_SOURCE),
    ("gdn", 64, 4): ("1.08-1.19x native at 112-256 running requests (the write-through 1.00x at 112)", False,
                     DECODE_TILING_SOURCE),
    ("gdn", 16, 2): ("0.95 / 1.01 / 1.07 / 1.13x native at 80 / 88 / 96 / 112 running requests (the write-through "
                     "0.88-0.89x there), 1.06-1.16x at 128-256", False, THRESHOLD_SOURCE),
    ("kda", 16, 2): ("0.89-0.90x native at 128-256 running requests", True, THRESHOLD_SOURCE),
    ("gdn", 32, 2): ("0.93-0.98x native at 112-256 running requests (one step of 0.89x at 128 whose launches add "
                     "up to 1.00x; the write-through 0.88x)", True, DECODE_TILING_SOURCE),
}
"""Plain decode per ``(family, history, state bytes)`` where it is served output-only (from
``ops.replay.served.WRITE_THROUGH_BELOW`` requests on): the measured ratio there, whether it was slower than
native, and where it was measured."""
WRITE_THROUGH = ("a write-through is SGLang's decode work in one launch (the state read and written, a float32 "
                 "state's bits native's) plus the fold of any pending history")
WRITE_THROUGH_SPEED = {
    ("gdn", 4): ("1.19x native at 1 request, 0.96-1.00x from 8 to 256", False),
    ("kda", 4): ("1.00-1.34x native at every batch measured (8 value columns a program)", False),
    ("gdn", 2): ("0.99-1.01x native below 32 requests, 0.87-0.92x from 32 to 256 (SGLang's packed decode moves a "
                 "2-byte state at 0.85-0.94 of copy bandwidth, the write-through at 0.76-0.82)", True),
    ("kda", 2): ("0.99-1.02x native below 32 requests, 0.86-0.92x from 32 to 256 (as GDN)", True),
}
"""Write-through decode against native per ``(family, state bytes)`` (a steady write-through has no history, so
one figure for every L), and whether it was never faster than native (level with it at best: within 2 %)."""
LOW_PRECISION_DECODE = ("where plain decode or a speculative verify writes through, a {dtype} state rounds where "
                        "native's does (after every token, every accepted prefix); output-only decode and verify "
                        "round it once per fold (bench/results/replay/drift_20261203: a third to a half of "
                        "native's drift over 10 000 tokens)")
VERIFY_SOURCE = "bench/results/replay/writethrough_verify_20261205, commits 08d2506 and 7f7be68, H100"
"""Where the chain-verify figures come from: both paths side by side with native in one run, D = 2 and 4."""
VERIFY_TILES_SOURCE = ("bench/results/replay/verify_tiles_20261207, commits 9a21fe3, 07da41b and abfa856, "
                       "and h100_20261207_9a21fe3, H100")
"""Where the verify figures measured with a verify's output tile per key come from (``served.WIDE_VERIFY_FROM``):
both paths and both tiles side by side with native, D = 2 and 4, batch 16-256."""
WRITE_THROUGH_VERIFY = ("a write-through verify is SGLang's verify + scatter in one launch (the scatter deferred "
                        "into the next verify, no per-step states; outputs and committed state native's bits)")
WRITE_THROUGH_VERIFY_SPEED = {
    ("gdn", 4): "1.03-1.73x native at every batch measured",
    ("kda", 4): "1.48-1.92x native at every batch measured",
    ("gdn", 2): "1.00-1.21x native at every batch measured",
    ("kda", 2): ("0.97-1.13x native at 1 request, 0.85-0.99x from 8 (a 2-byte state halves native's bytes, not "
                 "the records'; for speed pass --mamba-ssm-dtype float32); since then loading each draft token's "
                 "inputs a step ahead, 1.12 / 1.05 / 1.06x at 1 / 16 / 256 requests, L = 16, D = 4 "
                 "(bench/results/prefetch_20261206, H100)"),
}
"""A speculative round (verify + acceptance) written through, against native, per ``(family, state bytes)`` (a
steady write-through folds only the last round's records, so one figure for every L)."""
OUTPUT_ONLY_VERIFY = {
    ("gdn", 16, 4): ("2.16-2.90x native from 32 to 256 requests (D = 4)", KEY_HEAD_SOURCE),
    ("kda", 16, 4): ("1.90-2.17x native at 32-56 requests, 2.14-2.40x from 64 to 256 (D = 2 and 4); with the "
                     "window reading the history's raw keys, as served since, D = 4 2.21 / 2.45x at 64 / 256 "
                     "(bench/results/replay/rawkeys_20261207; 2.20 / 2.31 / 2.42x at 64 / 128 / 256 in "
                     "rawkeys_kda_20261207); with the fold's 32 columns in one pass, as served since, D = 4 "
                     "2.21 / 2.34 / 2.49x and D = 2 2.12 / 2.33 / 2.45x at 64 / 128 / 256 (onepassfold_20261207); "
                     "with D = 4's window reading the history 2 records a step, as served since, 2.32 / 2.48 / 2.63x "
                     "(window_20261207)", VERIFY_TILES_SOURCE),
    ("gdn", 32, 4): ("1.85-1.92x native at 40 requests, 2.06-2.30x at 48-56 (D = 2 and 4; the write-through "
                     "1.59-1.68x there), 2.33-2.74x from 64 to 256", VERIFY_TILES_SOURCE),
    ("kda", 32, 4): ("1.61-2.16x native from 64 to 256 requests; a D = 2 window reading the history's raw keys, "
                     "as served since, 1.71 / 2.01 / 2.12x at 64 / 128 / 256 (bench/results/replay/"
                     "rawkeys_kda_20261207); a D = 4 window reading the history 4 records a step, as served since, "
                     "2.27 / 2.39x at 128 / 256 (window_20261207)", VERIFY_SOURCE),
    ("gdn", 64, 4): ("1.82-1.95x native at 96-112 requests (D = 2, the write-through 1.65-1.67x: bench/results/"
                     "replay/verify_bounds_20261207, H100), 2.06-2.16x at 128-256 (D = 4)", KEY_HEAD_SOURCE),
    ("gdn", 16, 2): ("1.44-2.04x native from 32 to 256 requests (D = 4)", KEY_HEAD_SOURCE),
    ("kda", 16, 2): ("1.24-1.71x native from 32 to 256 requests", VERIFY_SOURCE),
    ("gdn", 32, 2): ("1.14-1.58x native from 32 to 256 requests (D = 4)", KEY_HEAD_SOURCE),
    ("kda", 32, 2): ("1.11-1.28x native from 96 to 256 requests (D = 2 and 4; the write-through 1.04-1.08x "
                     "there)", VERIFY_TILES_SOURCE),
    ("gdn", 64, 2): ("1.18-1.27x native at 128-256 requests (D = 4)", KEY_HEAD_SOURCE),
}
"""A speculative round served output-only (from ``ops.replay.served.WRITE_THROUGH_VERIFY_BELOW`` requests
on) per ``(family, history, state bytes)``: the measured ratio there and where it was measured (KDA's at D = 2
and 4, GDN's since the key-head window at D = 4)."""


def decode_sentence(family: str, history: int, state_dtype: torch.dtype) -> tuple[str, bool]:
    """How a replay pool of this family, history and state dtype serves plain decode, with the measured ratios of
    both paths (:data:`WRITE_THROUGH_SPEED`, :data:`OUTPUT_ONLY_DECODE`), and whether it was never faster than
    native at any batch measured."""
    key = measured_key(family == "kda", history, state_dtype)  # (family, measured history, state bytes)
    most = write_through_max_requests(family == "kda", history, state_dtype)
    speed, through_slower = WRITE_THROUGH_SPEED[(family, key[2])]
    through = f"{WRITE_THROUGH}: {speed} ({WRITE_THROUGH_SOURCE})"
    if most is None:
        return ("plain decode writes through at every batch (output-only decode was measured slower than that at "
                f"every batch for this history and state): {through}"), through_slower
    measured = "" if history >= 16 else " (measured at L = 16)"
    output_only, output_only_slower, source = OUTPUT_ONLY_DECODE[key]
    return (f"plain decode writes through below {most + 1} requests per step, counting a CUDA graph's padding "
            f"({through}); output-only from {most + 1}: {output_only}{measured} ({source})",
            through_slower and output_only_slower)


def verify_sentence(family: str, history: int, state_dtype: torch.dtype) -> str:
    """How a replay pool of this family, history and state dtype serves a chain speculative verify, with the
    measured ratios of both paths (:data:`WRITE_THROUGH_VERIFY_SPEED`, :data:`OUTPUT_ONLY_VERIFY`)."""
    key = measured_key(family == "kda", history, state_dtype)  # (family, measured history, state bytes)
    below = write_through_verify_below(family == "kda", history, state_dtype)
    through = f"{WRITE_THROUGH_VERIFY}: {WRITE_THROUGH_VERIFY_SPEED[(family, key[2])]}"
    if below is None:
        return (f"a speculative chain verify writes through at every batch (output-only verify was measured slower "
                f"than that at every batch for this history and state): {through} ({VERIFY_SOURCE})")
    measured = "" if history >= 16 else " (measured at L = 16)"
    output_only, source = OUTPUT_ONLY_VERIFY[key]
    return (f"a speculative chain verify writes through below {below} requests per step, counting a CUDA graph's "
            f"padding ({through}; {VERIFY_SOURCE}); output-only from {below}: {output_only}{measured} ({source})")


def replay_tradeoffs(cfg: SSMModeConfig, family: str, state_dtype: torch.dtype,
                     tree_verify: bool) -> list[tuple[int, str]]:
    """``(logging level, sentence)`` pairs on replay's speed against native for a replay pool of this
    configuration, model family (``"gdn"`` / ``"kda"``) and the state dtype the pool holds (``--mamba-ssm-dtype``
    or the model's own): WARNING where replay's plain decode was measured no faster than native's at any batch
    (a 2-byte state: level below 32 requests, slower from 32), INFO otherwise. Empty for other modes."""
    if cfg.mode != "replay":
        return []
    where = f"{family.upper()}, L = {cfg.replay_history}"
    spec_chain = cfg.draft_tokens > 1 and not tree_verify
    decode, slower = decode_sentence(family, cfg.replay_history, state_dtype)
    state = dtype_name(state_dtype)
    if slower:
        decode += (": no faster than native at any batch measured; "
                   + ("for speed pass --mamba-ssm-dtype float32, " if state_dtype != torch.float32 else "")
                   + "for memory --ssm-state-mode compact")
    out = [(logging.WARNING if slower else logging.INFO,
            f"replay kernels against native ({where}, {state} state): {decode}")]
    if state_dtype != torch.float32:
        out.append((logging.INFO, f"replay ({where}): " + LOW_PRECISION_DECODE.format(dtype=state)))
    if spec_chain:
        out.append((logging.INFO, f"replay kernels against native ({where}, {state} state): "
                                  + verify_sentence(family, cfg.replay_history, state_dtype)))
    if cfg.draft_tokens > 1 and tree_verify:
        out.append((logging.INFO, "replay's tree verify runs compact's kernels: bench/results/compact_h200.md"))
    return out
