"""Which path, launch count, tiling and order a replay step is served with, and the measurements behind each
choice: one place for the policy the kernels (:mod:`.verify`, :mod:`.write_through`) and their callers
(:mod:`.decode`, the SGLang glue) follow.

* the tables' key: :func:`measured_key` — ``(family, history, state bytes)``, a history below 16 as 16;
* plain decode: written through below :data:`WRITE_THROUGH_BELOW` requests, output-only from there;
* chain verify: written through below :data:`WRITE_THROUGH_VERIFY_BELOW`, output-only from there;
* an output-only launch: one launch or two (:func:`served_launches`), the window launch per key head
  (:func:`served_window_key_heads`), its warps (:func:`served_window_warps`) and keys
  (:func:`served_window_raw_keys`), the output launch's order (:data:`FOLD_FIRST_MIN_REQUESTS`) and tiling
  (:func:`output_tiling`), a fused fold's columns a pass (:func:`served_fold_block_v`), no programmatic dependent
  launch (:data:`SERVED_PDL`);
* a write-through's tile (:func:`write_through_block_v`, :data:`WRITE_THROUGH_V_MAJOR`,
  :data:`WRITE_THROUGH_VERIFY_PREFETCH`).

Every figure names the run it comes from (``bench/results/…``), each choice's alternatives timed side by side
where it was measured, on the card it names (what was not timed says so).
"""

from __future__ import annotations

import torch
import triton


def state_bytes(state_dtype: torch.dtype) -> int:
    """The state-bytes column of :data:`WIDE_DECODE_FROM`, :data:`WIDE_VERIFY_FROM`, :data:`WRITE_THROUGH_BELOW`
    and :data:`WRITE_THROUGH_VERIFY_BELOW` a pool of ``state_dtype`` is measured under: 4 (float32) or 2 (bfloat16,
    float16)."""
    return 4 if state_dtype.itemsize >= 4 else 2


MEASURED_HISTORIES = (16, 32, 64)
"""The histories the served bounds were measured at (a shorter history takes L = 16's)."""


def measured_key(is_kda: bool, history: int, state_dtype: torch.dtype) -> tuple[str, int, int]:
    """The ``(family, history, state bytes)`` row of the measured bound tables (:data:`WIDE_DECODE_FROM`,
    :data:`WIDE_VERIFY_FROM`, :data:`WRITE_THROUGH_BELOW`, :data:`WRITE_THROUGH_VERIFY_BELOW`) a replay ring of
    ``history`` records and a ``state_dtype`` pool is served by; a history between or beyond the measured ones
    is a ``ValueError`` (the server offers ``--ssm-replay-history`` 8, 16, 32 or 64 only)."""
    measured = max(history, MEASURED_HISTORIES[0])
    if measured not in MEASURED_HISTORIES:
        raise ValueError(f"replay history {history}: the served paths were measured at L <= 16, 32 and 64 only; "
                         "pass one of 8, 16, 32, 64 or choose the tiling and path explicitly")
    return ("kda" if is_kda else "gdn", measured, state_bytes(state_dtype))


WRITE_THROUGH_BELOW = {
    ("gdn", 16, 4): 32, ("kda", 16, 4): 40, ("gdn", 32, 4): 40, ("kda", 32, 4): 64,
    ("gdn", 64, 4): 112, ("kda", 64, 4): None,
    ("gdn", 16, 2): 80, ("kda", 16, 2): 128, ("gdn", 32, 2): 112, ("kda", 32, 2): None,
    ("gdn", 64, 2): None, ("kda", 64, 2): None,
}
"""Per ``(family, history, state bytes)``: the request count from which output-only decode serves (None:
never — write-through at every batch). Since a decode's output launch keeps the narrow tile at long histories
(:data:`WIDE_DECODE_FROM`), three bounds moved, both paths side by side on an H100 (bench/results/replay/
decode_tiling_20261206, commit 7d73792; ratios against SGLang's decode, write-through / output-only): float32 GDN
L = 64 1.01 / 0.92x at 80 requests, 1.00 / 1.01x at 96 (a tie), 1.00 / 1.08x at 112, output-only 1.16-1.18x at
128 where the wide tile gave 1.05-1.07x (was 128); KDA L = 32 0.99 / 1.04x at 64, 0.97-1.00 / 1.00-1.03x from 80 to
256 (one output-only step of 0.95x at 128 whose launches add up to 1.06x; was never; at 56 0.99 / 0.98x,
thresholds_20261206); bfloat16 GDN L = 32 (wide tile) 0.89 / 0.88x at 96,
0.88 / 0.96x at 112 (was 128). Since the cursors settle once a step (3bfe099), the bounds between the
earlier measured batches, both paths side by side on an H100 (bench/results/replay/thresholds_20261206; ratios
against SGLang's decode, write-through / output-only): float32 GDN L = 32 0.99 / 0.99x at 32 requests, 1.00 /
1.12x at 40, 1.01 / 1.24x at 48; KDA L = 16 1.00 / 1.01x at 32, 0.99 / 1.03x at 40, 0.99 / 1.05x at 48 (at L = 32
output-only 0.79-0.98x to 56: then still write-through); bfloat16 GDN L = 16 0.88 / 0.89x at 72, 0.89 / 0.95x at
80, 0.88 / 1.01x at 88, 0.89 / 1.07x at 96, 0.88 / 1.13x at 112 (at L = 32 0.89 / 0.88x at 96: then still 128; KDA
L = 16 0.87 / 0.83x at 96: still 128). Before that, GDN's rows since its window launch runs per key head
(:func:`served_window_key_heads`), both paths side by side on an H100 (bench/results/replay/
keyhead_bounds_20261206, commit 4a280d3; ratios against SGLang's decode, write-through / output-only, batch 16 /
32 / 64 / 128 / 256): float32 L = 16 1.00 / 0.67, 1.06, 1.36, 1.36, 1.38x; L = 32 1.00 / 0.73, 0.96, 1.02,
1.34, 1.32x; L = 64 1.00 / 0.63, 0.70, 0.71, 1.04, 1.13x; bfloat16 (write-through 0.87-0.98x) L = 16 output-only
0.45, 0.75, 0.81, 1.11, 1.05x; L = 32 0.43, 0.51, 0.70, 0.97, 0.97x; L = 64 0.46-0.75x. KDA's rows (and GDN's
before) measured side by side on the H200 (bench/results/replay/writethrough_20261205, commit a6a4a2a):
float32 GDN L = 16 0.90-0.92 / 0.94-0.95x at 32 requests (a tie), 0.94-0.96 / 1.17-1.21x at 64; KDA L = 16
0.94-0.96 / 0.89-0.90x at 32, 0.96 / 1.13-1.15x at 64; GDN L = 32 0.97 / 0.87x at 64, 0.97 / 1.12x at
128; KDA L = 32 and both at L = 64: output-only slower at every batch (0.43-0.86x against 0.84-1.22x).
bfloat16 at L = 16: GDN 0.77-0.78 / 0.69x at 64, 0.74-0.75 / 0.91x at 128; KDA 0.73-0.74 / 0.70x at 64,
0.69 / 0.76x at 128; at L = 64 output-only 0.26-0.54x (at L = 32, from commit 34d5527: output-only 0.74x
GDN at 128 requests against write-through's 0.74-0.75x, KDA slower than at L = 16). A history of L < 16 takes
L = 16's bound; a state of 2-byte elements (bfloat16, float16) the bfloat16 row."""


def write_through_max_requests(is_kda: bool, history: int, state_dtype: torch.dtype) -> int | None:
    """The most requests a served plain decode writes through (:data:`WRITE_THROUGH_BELOW`), None for every
    batch."""
    below = WRITE_THROUGH_BELOW[measured_key(is_kda, history, state_dtype)]
    return None if below is None else below - 1


def serves_write_through(requests: int, is_kda: bool, history: int, state_dtype: torch.dtype) -> bool:
    """Whether a served plain decode of ``requests`` requests writes through
    (:func:`write_through_max_requests`)."""
    most = write_through_max_requests(is_kda, history, state_dtype)
    return most is None or requests <= most


WRITE_THROUGH_VERIFY_BELOW = {
    ("gdn", 16, 4): 32, ("kda", 16, 4): 32, ("gdn", 16, 2): 32, ("kda", 16, 2): 32,
    ("gdn", 32, 4): 40, ("kda", 32, 4): 64, ("gdn", 32, 2): 32, ("kda", 32, 2): 96,
    ("gdn", 64, 4): 96, ("kda", 64, 4): None, ("gdn", 64, 2): 128, ("kda", 64, 2): None,
}
"""Per ``(family, history, state bytes)``: the request count from which a served chain verify is output-only
(:func:`~.verify.replay_verify`; None: never — write-through at every batch). Measured side by side on an H100
(bench/results/replay/writethrough_verify_20261205: L = 16 and 64 at commit 08d2506, L = 32 at 7f7be68; speedup
of a speculative round, verify + acceptance, over SGLang's verify + scatter, write-through / output-only, D = 2
and 4, the same bounds for both). float32: L = 16 GDN 1.14-1.55 / 0.89-1.16x below 32 requests, 1.63-1.71 /
2.04-2.67x from 32; KDA 1.51-1.77 / 0.84-1.16x below 32, 1.58-1.72 / 1.94-2.40x from 32; L = 32 GDN 1.60-1.66 /
1.47-1.70x at 32, 1.66-1.71 / 2.17-2.42x from 64; KDA 1.54-1.70 / 1.34-1.48x at 32, 1.59-1.63 / 1.61-2.16x from
64; L = 64 GDN 1.59-1.69 / 1.39-1.53x at 32-64, 1.69-1.73 / 1.84-1.99x at 128-256; KDA write-through ahead
everywhere (1.56-1.91 / 0.74-1.45x). bfloat16: L = 16 write-through ahead below 32 (GDN 1.00-1.15 / 0.72-0.91x,
KDA 0.89-1.11 / 0.62-0.76x), output-only from 32 (GDN 1.40-1.93x, KDA 1.24-1.71x against 0.86-1.21x); L = 32
likewise (output-only from 32: GDN 1.14-1.53x, KDA 0.98-1.27x against 0.85-1.20x); L = 64 write-through ahead
or tied everywhere (GDN 1.01-1.20 / 0.62-1.20x, KDA 0.86-1.13 / 0.48-0.84x). GDN's window launch per key head
(:func:`served_window_key_heads`; bench/results/replay/keyhead_bounds_20261206, commit 4a280d3, H100,
D = 4, both side by side, batch 16 / 32 / 64 / 128 / 256) moved one bound: bfloat16 L = 64, write-through
1.13-1.17x, output-only 0.84, 0.90, 1.06, 1.18, 1.27x (output-only from 128; 64 a tie). The others held: float32
L = 16 1.61-1.71 / 1.62 (a tie at 16), 2.16-2.90x; L = 32 1.60-1.71 / 1.20, 1.46 then 2.39-2.73x from 64; L = 64
1.58-1.72 / 1.33-1.42x below 64, 1.67 at 64 (a tie), 2.06-2.16x from 128; bfloat16 L = 16 1.10-1.14 / 1.15 (a tie
at 16), 1.44-2.04x; L = 32 1.12-1.16 / 0.91, 1.14 (a tie at 32), 1.35-1.58x. Between those batches, D = 2 at
L = 32 / 64 (bench/results/replay/verify_bounds_20261207, commit d04da19, H100, side by side, batch 56 / 64 / 96 /
104 / 112 / 128 / 256) moved two float32 GDN bounds: L = 32 write-through 1.68x at 56 requests, output-only
1.83x (the narrow tile served there; 2.22x wide), so from 56 (was 64); L = 64 write-through 1.65-1.67x from 56 to
112, output-only (wide) 1.44 / 1.58x at 56 / 64, 1.82 / 1.91 / 1.95x at 96 / 104 / 112, so from 96 (was 128). D = 4
was not timed at those batches: its output-only round gains more over native than D = 2's (above), and its
crossings at 64 (L = 32: 2.39x) and 128 (L = 64: 2.06x, a tie at 64) bracket the new bounds. The others held
there: KDA float32 L = 32 1.71 / 1.51x at 56, 1.65 / 1.63x at 64 (a tie), 1.80-1.96x output-only from 96; KDA
float32 L = 64 write-through 1.61-1.68x, output-only 1.08-1.43x; bfloat16 GDN L = 64 1.16-1.21 / 0.96-1.24x
below 128 (a tie or a few per cent). D = 4 at those batches and below them (bench/results/replay/
verify_tiles_20261207, commit 9a21fe3, H100, side by side) moved float32 GDN L = 32 again, with the wide output
tile from 40 requests (:data:`WIDE_VERIFY_FROM`): write-through / output-only (wide) D = 2 1.56-1.59 / 1.35x at
24, 1.67 / 1.73x at 32, 1.62-1.63 / 1.88x at 40, 1.66 / 2.10x at 48; D = 4 1.57-1.58 / 1.31x at 24, 1.61-1.62 /
1.69x at 32, 1.59-1.62 / 1.87-1.92x at 40, 1.61-1.65 / 2.08-2.12x at 48, so from 40 (32 a few per cent). L = 64
held at D = 4: write-through 1.61-1.67x from 40 to 64, output-only 1.55-1.67x there (a tie at 64), 1.97 / 2.07 / 2.05x
at 96 / 112 / 128 against 1.68-1.71x. Same directory (commit 07da41b): bfloat16 KDA L = 32 from 96 (was 32): output-only
0.89-1.02x native at 32-48 requests (below native at 40, and at 32 / 48 for D = 4), the write-through 1.02-1.09x; level
at 64 / 80 (1.02-1.06 / 1.03-1.07x), output-only 1.11-1.12 / 1.05-1.08x at 96, 1.15-1.28 / 1.04-1.08x at 128-256. A
history of L < 16 takes L = 16's bound; a state of 2-byte elements (bfloat16, float16) the bfloat16 row.
KDA float32 L = 64 with a window program reading the history 4 records a step on one warp
(``replay_verify(window_history_rows=4, window_warps=1)``; bench/results/replay/window_20261207, H100, D = 4, side by
side in one run, write-through / output-only): 1.61 / 1.53x at 64 requests, 1.66 / 1.94x at 128, 1.61 / 1.97x at
256. Not moved yet: the bound holds for D = 2 as well, whose output-only verify at L = 64 was not timed that way
(holding the whole history it was 1.08-1.43x against 1.61-1.68x, above)."""


def write_through_verify_below(is_kda: bool, history: int, state_dtype: torch.dtype) -> int | None:
    """The request count from which a served chain verify is output-only (:data:`WRITE_THROUGH_VERIFY_BELOW`; a
    history of L < 16 takes L = 16's row, a state of 2-byte elements the bfloat16 one), None for never."""
    return WRITE_THROUGH_VERIFY_BELOW[measured_key(is_kda, history, state_dtype)]


def serves_write_through_verify(requests: int, is_kda: bool, history: int, state_dtype: torch.dtype) -> bool:
    """Whether a served chain verify of ``requests`` requests writes through (:func:`write_through_verify_below`)."""
    below = write_through_verify_below(is_kda, history, state_dtype)
    return below is None or requests < below


ONE_LAUNCH_MAX_TOKENS = 8
"""A GDN window of at most this many tokens (requests x T) over a history of at most :data:`ONE_LAUNCH_MAX_HISTORY`
records runs in one launch (:func:`~.verify.replay_step_kernel`), larger windows and KDA in two. On the H200
(bench/results/replay/onelaunch_20261203, float32, L = 16, both side by side in each of two runs) one launch is
faster for GDN decode at batch 1 (8.8-8.9 against 11.5-12.3 µs) and 8 (20.8-21.6 against 24.9-25.7 µs) and for a
4-token verify of one request (18.0-18.3 against 20.6-21.1 µs), slower from 32 tokens on (decode batch 32:
51.5-52.9 against 47.0-47.8 µs; D = 4 batch 8: 44.5-45.0 against 40.4-40.5 µs) — its programs carry the window's
work and need 210-255 registers. KDA gains nothing at batch 1 or 8 (within 3 % either way at decode, slower at
D = 4): its per-channel gates make every program rebuild the history's decays."""
ONE_LAUNCH_MAX_HISTORY = 16
"""The longest history a one-launch window of up to :data:`ONE_LAUNCH_MAX_TOKENS` tokens is served for; one token
is served in one launch up to :data:`ONE_TOKEN_MAX_HISTORY`. On the H200 (bench/results/replay/
onelaunch_bound_20261204, GDN, both side by side in one run, commit b29f6ef; the one-launch programs spill 10-158
bytes at L = 32 and 296-494 at L = 64): at L = 32 one launch is faster for a decode of one request (float32 10.4
against 12.3 µs, bfloat16 9.1 against 11.9) and slower for 8 (float32 24.8 against 21.9; bfloat16 21.1 against
23.1 — a mixed result left to two launches), for a 4-token verify of one request (27.2 against 24.8) and of 8;
at L = 64 it is slower everywhere (decode batch 1 18.4 against 14.2, batch 8 55.2 against 26.6; D = 4 batch 8
247.9 against 45.3)."""
ONE_TOKEN_MAX_HISTORY = 32
"""The longest history a one-token GDN window (output-only decode of one request) runs in one launch for. A
served plain decode of so few requests writes through instead (:func:`serves_write_through`); this is the
output-only path's choice (``replay_decode(write_through=False)``, the drift study)."""


def served_launches(tokens: int, is_kda: bool, history: int) -> int:
    """Launches of a served verify of ``tokens`` tokens in all (requests x T) over a history of ``history``
    records: 1 for a GDN window of at most :data:`ONE_LAUNCH_MAX_TOKENS` tokens and a history of at most
    :data:`ONE_LAUNCH_MAX_HISTORY`, or of one token over at most :data:`ONE_TOKEN_MAX_HISTORY`; else 2
    (window, then output)."""
    if is_kda:
        return 2
    short = tokens <= ONE_LAUNCH_MAX_TOKENS and history <= ONE_LAUNCH_MAX_HISTORY
    return 1 if short or (tokens == 1 and history <= ONE_TOKEN_MAX_HISTORY) else 2


def served_window_key_heads(is_kda: bool, launches: int) -> bool:
    """Whether a served window launch runs one program per request and key head
    (:func:`~.verify.window_key_head_program`) rather than per value head: for every GDN verify of two launches
    (KDA's gates are per channel and value head; one launch has no window launch). On an H100
    (bench/results/replay/keyhead_20261206, commit 0689fd3, both side by side in one run, Qwen3-Next heads: 2 value
    heads per key head) it was faster at every case measured — float32 decode at L = 16 1.03-1.04x (batch 128:
    window 12.8 -> 8.3 µs, 141.4 -> 136.7 µs a step), at L = 32 1.05-1.07x; D = 4 1.03-1.10x at L = 16, 1.10-1.12x
    at L = 32 (batch 256: window 137.2 -> 77.0 µs); bfloat16 1.01-1.13x — the key head's history keys read and
    dotted once instead of once per value head, and half the programs (one wave where the per-value-head launch
    needed two)."""
    return not is_kda and launches == 2


def served_window_raw_keys(launches: int, is_kda: bool, history: int, tokens: int) -> bool:
    """Whether a served window launch of ``tokens`` tokens a request over a ``history``-record ring renormalises the
    history's raw keys: a window whose family, history (below 16 as 16) and tokens rounded up to a power of two (the
    window kernel's ``TP``: the rows its registers hold) are a row of :data:`SERVED_WINDOW_RAW_KEYS`, of two launches
    (the one-launch kernel reads the normalised keys either way)."""
    family = "kda" if is_kda else "gdn"
    row = (family, max(history, MEASURED_HISTORIES[0]), triton.next_power_of_2(tokens))
    return launches == 2 and row in SERVED_WINDOW_RAW_KEYS


def served_window_history_rows(launches: int, is_kda: bool, history: int, tokens: int) -> int:
    """History records a served window program of a window of ``tokens`` tokens a request over a ``history``-record
    ring reads a step (0: the whole history held at once): the :data:`SERVED_WINDOW_HISTORY_ROWS` row of the family,
    history (below 16 as 16) and tokens rounded up to a power of two, for a window launch per value head (two
    launches; GDN's per key head holds the whole history)."""
    family = "kda" if is_kda else "gdn"
    row = (family, max(history, MEASURED_HISTORIES[0]), triton.next_power_of_2(tokens))
    key_heads = served_window_key_heads(is_kda, launches)
    return SERVED_WINDOW_HISTORY_ROWS.get(row, 0) if launches == 2 and not key_heads else 0


def served_window_warps(history: int, tokens: int, history_rows: int = 0) -> int:
    """Warps of a served window program (one request and value head: the history's ``[L, K]`` key block and
    the window's ``[TP, K]`` blocks) for a history of ``history`` records and ``tokens`` tokens per request:
    1 up to L = 16, and at L = 32 for a window of more than one token (every reduction over K inside one
    warp: no cross-warp round trips in the token chain); 2 at L = 32 for one token; 4 at L = 64 (fewer warps
    hold the ``[64, K]`` block in too few threads). 1 at every L for a program reading the history
    ``history_rows > 0`` records a step (:func:`served_window_history_rows`: no ``[L, K]`` block to hold; KDA
    float32 at L = 64, bench/results/replay/window_20261207, H100, 4 records a step, window launch µs on 4 warps /
    1 at 256 requests: 404.4 / 145.3 for a decode, 592.5 / 214.9 for D = 4). On the H200
    (bench/results/replay/windowwarps_20261204, float32, all three side by side) 1 warp against 4 at L = 16,
    batch 128: GDN decode 118.0 against 122.1 µs, D = 4 251.0 against 279.4; KDA decode 136.6 against 143.0, D = 4
    290.6 against 306.6; at L = 32, D = 4, batch 128: GDN 283.1 against 306.6, KDA 313.2 against 345.5; at L = 64
    the whole block on 1 warp was up to 1.4x slower (GDN D = 4 batch 128: 497.4 against 365.5)."""
    if history <= 16 or history_rows > 0:
        return 1
    if history <= 32:
        return 1 if tokens > 1 else 2
    return 4


FOLD_FIRST_MIN_REQUESTS = 32
"""From this many requests on, the output launch runs in fold-first order (:func:`~.verify.fold_order_program`). On the
H200 (bench/results/replay/foldfirst_20261203, the order then a launch of its own) the order launch cost 2-3 µs:
below batch 8 that is all it did, at 8 and 16 it was a wash (within 3 µs either way), from 32 on fold-first was
as fast or faster everywhere measured — up to 1.26x at batch 256 (GDN decode, L = 64), where the folding
programs would otherwise be the launch's tail. Since 986b1f6 the order is one more program of the window launch
(no launch of its own; not yet timed)."""
NARROW_TILING = (16, 1, None, 2)
"""``(block_v, num_warps, block_k, num_stages)`` of the output launch below :data:`WIDE_VERIFY_FROM` requests (a
decode's: below :data:`WIDE_DECODE_FROM`): 16 value columns on one warp, the whole of K in one step — more,
smaller programs for a launch too small to fill the GPU with native-sized ones, and for a decode over a long
history at every batch measured."""
WIDE_TILING = (32, 1, 64, 3)
"""The output launch's tiling from :data:`WIDE_VERIFY_FROM` requests on (a decode's: from
:data:`WIDE_DECODE_FROM`): 32 columns on one warp (SGLang's native decode tile), the checkpoint read 64 K rows
per step of a loop pipelined 3 deep."""


WIDE_VERIFY_FROM = {
    ("gdn", 16, 4): 40, ("kda", 16, 4): 40, ("gdn", 32, 4): 40, ("kda", 32, 4): 64,
    ("gdn", 64, 4): 64, ("kda", 64, 4): 64,
    ("gdn", 16, 2): 32, ("kda", 16, 2): 32, ("gdn", 32, 2): 64, ("kda", 32, 2): 64,
    ("gdn", 64, 2): 64, ("kda", 64, 2): 64,
}
"""Per ``(family, history, state bytes)``: the requests per launch from which a verify's output launch (T > 1) runs
:data:`WIDE_TILING`, D = 2 and 4 alike. On the H200 (bench/results/replay/kloop_20261203, float32, L = 16, both
tilings side by side in each run) wide was faster from 64 requests on: decode 1.08x (GDN) / 1.16x (KDA) at batch
64, 1.07 / 1.16x at 128, 1.06 / 1.17x at 256; D = 4 1.06 / 1.04x at 64, 1.06 / 1.07x at 128; narrow faster at 32
requests and fewer but D = 4 at 32 (wide 1.06 / 1.02x). On an H100 (bench/results/replay/verify_bounds_20261207,
commit d04da19, D = 2 at L = 32 / 64) wide was as fast or faster from 64 requests (narrow's µs over wide's
0.98-1.39, float32 L = 64 at 64 requests 0.95-0.97) and slower at 56 but for a float32 L = 32 state (GDN 1.21, KDA
1.03; the others 0.91-0.96). Below 64 for float32 GDN (bench/results/replay/verify_tiles_20261207, commit 9a21fe3, H100,
speedup of a round over SGLang's verify + scatter, both tiles output-only side by side, batch 16-56, narrow / wide): L =
16 D = 2 2.12 / 2.06x at 32, 2.20 / 2.32, 2.21 / 2.42, 2.24 / 2.40x at 40 / 48 / 56; D = 4 2.17 / 2.33x at 32, 2.18 /
2.31, 2.26 / 2.50, 2.30 / 2.55x at 40 / 48 / 56; L = 32 D = 2 1.73 / 1.73x at 32, 1.70 / 1.88, 1.78 / 2.10, 1.84 / 2.24x
at 40 / 48 / 56; D = 4 1.48 / 1.69x at 32, 1.53-1.56 / 1.87-1.92, 1.61-1.63 / 2.08-2.12, 1.73-1.74 / 2.27-2.29x at 40 /
48 / 56: so wide from 40 for both (at 32 L = 16 D = 2 is a few per cent faster narrow; a verify below 40 at L = 32
writes through, :data:`WRITE_THROUGH_VERIFY_BELOW`). L = 64 (D = 4, same run as :data:`WRITE_THROUGH_VERIFY_BELOW`'s D =
4 check) 1.55 / 1.41x at 40, 1.61 / 1.55x at 48, 1.60 / 1.59x at 56, 1.63 / 1.67x at 64: from 64. The others below 64
(same directory, commit 07da41b, batch 32-56, the served narrow tile / wide): KDA float32 L = 16 D = 2 1.92 / 1.85x at
32, 1.98-2.07 / 2.07-2.17x at 40-56, D = 4 2.03 / 2.09x at 32, 1.89-2.03 / 1.92-2.13x at 40-56, so from 40; L = 32 the
write-through ahead (wide 1.28-1.54x against 1.55-1.69x) but D = 4 at 56 (wide 1.69x, the write-through 1.63x). bfloat16
L = 16 wide ahead from 32: GDN D = 2 1.46-1.56 / 1.53-1.68x, D = 4 1.43-1.54 / 1.49-1.75x; KDA D = 2 1.27-1.37 /
1.28-1.45x, D = 4 1.16-1.26 / 1.23-1.38x; L = 32 narrow ahead or level (GDN 1.12-1.48 / 1.08-1.44x). A history of L < 16
takes L = 16's bound; a state of 2-byte elements the bfloat16 row."""


WIDE_DECODE_FROM = {
    ("gdn", 16, 4): 64, ("kda", 16, 4): 64, ("gdn", 32, 4): 112, ("kda", 32, 4): None,
    ("gdn", 64, 4): None, ("kda", 64, 4): None,
    ("gdn", 16, 2): 80, ("kda", 16, 2): 80, ("gdn", 32, 2): 112, ("kda", 32, 2): 192,
    ("gdn", 64, 2): None, ("kda", 64, 2): None,
}
"""Per ``(family, history, state bytes)``: the requests per launch from which a one-token output launch (an
output-only decode) runs :data:`WIDE_TILING` (None: narrow at every batch). Both tilings output-only side by side
on an H100 (bench/results/replay/decode_tiling_20261206, commit 7d73792, batch 64-256, output launch µs narrow /
wide): the wide tile loses at long histories — float32 GDN L = 32 61.9 / 81.8 µs at 64 requests,
95.3 / 97.5 at 96, 109.3 / 104.8 at 112; L = 64 narrow faster at every batch (103.2 / 118.3 at 64, 261.6 / 279.6
at 256); KDA L = 32 every batch (123.9 / 133.2 at 128, 257.3 / 272.6 at 256), L = 64 narrow or level. At L = 16
wide from 64 (GDN 60.5 against 64.3 µs at 64). bfloat16: GDN L = 16 wide from 80 (47.7 / 54.2 µs
narrow at 64, 60.6 / 57.8 at 80), L = 32 from 112 (69.8 / 69.0 at 96, 79.0 / 72.9 at 112), KDA L = 16 from 80,
L = 32 from 192 (97.3 / 98.7 at 128, 145.6 / 139.6 at 192); L = 64 narrow at every batch. A history of L < 16
takes L = 16's bound; a state of 2-byte elements the bfloat16 row. What makes the history matter was not isolated:
with a float32 state GDN's programs hold the same registers at L = 16 and 32 (wide 168, narrow 127-128), KDA's
wide 168 / 192 / 220 at L = 16 / 32 / 64 against narrow 168 / 128 / 167, GDN's at L = 64 220 against 127 (none
spill). A verify's bound is :data:`WIDE_VERIFY_FROM`."""


def output_tiling(requests: int, tokens: int, is_kda: bool, history: int,
                  state_dtype: torch.dtype) -> tuple[int, int, int | None, int]:
    """The served ``(block_v, num_warps, block_k, num_stages)`` of an output launch of ``requests`` requests of
    ``tokens`` tokens each over a ``history``-record ring and a ``state_dtype`` checkpoint: :data:`WIDE_TILING`
    from :data:`WIDE_DECODE_FROM` requests on for one token, from :data:`WIDE_VERIFY_FROM` for more, else
    :data:`NARROW_TILING` (with fold-first order from :data:`FOLD_FIRST_MIN_REQUESTS`, at most three compiled
    variants of the output kernel per window length)."""
    wide_from = (WIDE_DECODE_FROM if tokens == 1 else WIDE_VERIFY_FROM)[measured_key(is_kda, history, state_dtype)]
    return WIDE_TILING if wide_from is not None and requests >= wide_from else NARROW_TILING


FOLD_WARP_COLUMNS = 16
"""Value columns per warp a fused fold advances at a time where :data:`SERVED_ONE_PASS_FOLD` does not say otherwise
(``FBV = min(BV, 16 * num_warps)``): a ``[K, 16]`` float32 tile per warp beside the output path; wider output tiles
fold in several passes. A fold's bits are the same for every tiling of one warp (every served tile; a review's check
on an H100, 2026-12-07, its log not kept: any ``fold_block_v`` from 4 to 32 at K = V = 128); a tile of several warps
may reduce over K across warps and round some elements one unit in the last place differently (the same check: 64
columns on 4 or 8 warps, 32 on 2 with 4 columns a pass; a ``[16, 16]`` tile on 4 warps,
bench/results/replay/kloop_20261203, run 1)."""


SERVED_ONE_PASS_FOLD = frozenset({("kda", 16, 4)})
"""The ``(family, history, state bytes)`` rows (:func:`measured_key`) whose verify (more than one token) folds its
output tile in one pass, up to twice :data:`FOLD_WARP_COLUMNS` a warp: :data:`WIDE_TILING`'s 32 columns at once
instead of two passes of 16 (the output kernel 237 registers against 128, no spills; the same bits, one warp).
Side by side on an H100 at d172bfd, L = 16, float32, two runs (bench/results/replay/onepassfold_20261207, round µs
two passes / one): KDA D = 4 162.3 / 159.1 at 64 requests, 231.2 / 228.0 at 96, 296.7 / 292.3 and 301.1 / 295.6 at
128, 437.7 / 426.9 at 192, 554.1 / 544.1 and 560.3 / 547.1 at 256 (round 2.42-2.44 -> 2.47-2.49x native); D = 2
level to 96 (117.6 / 118.0 at 64, 163.3 / 163.8 at 96), then 209.9 / 208.2 and 209.6 / 207.6 at 128, 301.5 / 297.6 at
192, 395.8 / 389.1 and 391.7 / 384.4 at 256. Not served: GDN (float32 level: 0.98-1.02 of two passes' µs, D = 4 at
64 1.02 slower), a bfloat16 state (one pass 1.04-1.13x slower, its output kernel 255 registers against 167: GDN D =
4 at 256 401.0 against 356.0 µs, KDA 458.1 against 430.9), KDA at L = 32 (bench/results/replay/rawkeys_kda_20261207/
fold, D = 4: slower), four passes of 8 (slower everywhere, up to 1.17x), a decode (not timed)."""


def served_fold_block_v(block_v: int, num_warps: int, tokens: int, is_kda: bool, history: int,
                        state_dtype: torch.dtype) -> int:
    """The value columns a served fused fold advances at a time in an output tile ``block_v`` wide on ``num_warps``
    warps, for ``tokens`` tokens a request over a ``history``-record ring and a ``state_dtype`` checkpoint:
    ``2 * FOLD_WARP_COLUMNS`` a warp for a verify of a :data:`SERVED_ONE_PASS_FOLD` row, else
    :data:`FOLD_WARP_COLUMNS`; at most the tile."""
    one_pass = tokens > 1 and measured_key(is_kda, history, state_dtype) in SERVED_ONE_PASS_FOLD
    return min(block_v, (2 if one_pass else 1) * FOLD_WARP_COLUMNS * num_warps)


SERVED_PDL = False
"""Whether a served two-launch verify overlaps its output launch with its window launch (programmatic dependent
launch, ``replay_verify(pdl=True)``). Off: on the H200 (bench/results/replay/pdl_20261205, commit 4a2c657, both
side by side, D = 4, L = 16, float32) it changed nothing — GDN 136.8 / 136.7 µs at batch 64, 474.6 / 474.9 at
256; KDA 153.7 / 153.6, 556.2 / 557.7 — CUDA-graph replay already hides the launch gap, and from 32 requests
(fold-first order) the output programs wait for the window launch before their first read. Bit for bit the
same under CUDA graphs there (``test_programmatic_dependent_launch_in_a_cuda_graph_changes_no_bit``). Asked
again per (L, D) on an H100 (bench/results/replay/pdl_20261206, commit 3ce6289, float32, side by side): at
L = 16 0.977-0.999 of served's µs for decode (under 1 % from 128 requests) and 0.989-1.005 for D = 4; at L = 32
and 64 level or slower — GDN decode at L = 32 and 64 requests 1.09x (twice in two runs), KDA D = 4 at L = 32
1.11 / 1.05 / 1.01x at 64 / 128 / 256: not worth a second compiled variant per launch."""


SERVED_WINDOW_HISTORY_ROWS = {("kda", 16, 1): 4, ("kda", 16, 4): 2, ("kda", 32, 4): 4}
"""Per ``(family, history, window tokens rounded up to a power of two)``: the history records a served window program
reads a step after the window's tokens (:func:`~.verify.window_history`, ``replay_verify(window_history_rows=...)``)
instead of holding the history's decayed ``[L, K]`` keys beside the tokens' work (0, elsewhere): a ``[HR, K]`` block
of keys and gates in registers, a loop over the ``count`` records present only. Side by side on an H100
(bench/results/replay/window_20261207, commit a92bc16 plus this path, KDA float32, output-only, window launch µs whole
/ 2 / 4 records a step at 64 / 128 / 256 requests): D = 4, L = 16 35.9 / 28.2 / 36.5, 62.9 / 47.9 / 68.8, 113.9 /
87.3 / 128.6 (round 2.22 -> 2.32x, 2.35 -> 2.48x, 2.48 -> 2.63x native; Triton 3.6 allots 237 registers a thread
at 4 records, 252 whole); decode, L = 16, 14.4 / 13.1 / 11.4, 24.6 / 22.6 / 20.1, 44.8 / 37.4 / 34.6 (a step 3-4 %
faster); D = 4, L = 32 (4 records, one warp) 119.7 -> 71.5 at 128, 219.4 -> 129.8 at 256 (round 2.02 -> 2.27x,
2.17 -> 2.39x: the whole block spilled 16 bytes there). Not served: GDN (its window per key head holds the block, and
is fast), D = 2 (not timed), L = 64 (served written through: output-only with 4 records a step on one warp, D = 4,
1.94 / 1.97x native at 128 / 256 against the write-through's 1.66 / 1.61x, but the bound is D = 2's too,
:data:`WRITE_THROUGH_VERIFY_BELOW`; a decode 426.1 µs against the write-through's 370.4 at 256), a decode at L = 32
(not timed). A bfloat16 state's window is the same launch (it reads no state)."""


SERVED_WINDOW_RAW_KEYS = frozenset({("kda", 16, 2), ("kda", 16, 4), ("kda", 32, 1), ("kda", 32, 2)})
"""The ``(family, history, window tokens rounded up to a power of two)`` rows whose window launch renormalises the
history's raw keys (activation dtype) rather than reading the normalised float32 keys the ring also holds
(:func:`~.verify.history_keys`): half the bytes of the history's keys for 2-byte activations, the window launch's
largest read with GDN's scalar gates and half of it with KDA's per-channel ones, for one more L2 norm per record and
more registers. Side by side on an H100 (bench/results/replay/rawkeys_20261207, commit 67d35eb, float32 state, D = 4,
L = 16, normalised / raw keys): KDA's window launch 38.0 / 35.2 µs at 64 requests (round 2.17 / 2.21x native) and
136.4 / 115.4 µs at 256 (2.35 / 2.45x); GDN's per key head 13.0 / 11.7 µs at 64 (2.61 / 2.63x) but 40.7 / 43.7 µs at
256 (2.86 / 2.84x): not served for GDN. KDA at every D and L asked again (bench/results/replay/rawkeys_kda_20261207,
commit 05ce693, H100, float32, both output-only side by side; window launch µs normalised / raw at
32 / 64 / 128 / 256 requests): D = 4, L = 16: 21.2 / 21.1, 38.4 / 35.9, 71.8 / 62.9, 137.0 / 113.5 (round 2.34 -> 2.42x
at 256); D = 2, L = 16: 14.2 / 13.3, 23.5 / 22.4, 37.3 / 34.8, 66.7 / 63.9 (round 1-2 % faster); D = 2, L = 32:
24.9 / 19.6, 47.1 / 35.8, 81.5 / 62.6, 153.3 / 118.6 (round 1.62 -> 1.71x at 64, 1.98 -> 2.12x at 256; its ptxas
reports 40 bytes of spills there, yet faster); a decode at L = 32 (one token, two warps): 31.9 / 30.0 µs at 64,
56.2 / 53.5 at 128, 105.8 / 99.5 at 256 (step 1-3 % faster). Not served: a decode at L = 16 (step 1-4 % slower from 64
requests), D = 4 at L = 32 (window 76.3 / 80.5 µs at 64, 206.2 / 262.4 at 256, with 10 bytes of spills; on two warps
63.7 at 64 but 217.2 at 256) and L = 64 (written through at every batch; output-only with raw keys 1.06-1.51x slower
than that). A bfloat16 state's window is the same launch (it reads no state); windows of 5 or more tokens (8 rows a
program) were not timed and read the normalised keys."""


WRITE_THROUGH_BLOCK_V = 16
"""Value columns per write-through program, on one warp and three stages as SGLang 0.5.14's decode, which takes
32: a 32-column program holds 168-254 registers a thread with the fold's loop beside the token (SGLang's
packed decode, without one, fewer), too few warps a multiprocessor to cover the state's loads; 16 columns hold
106-128. Side by side on an H100 (bench/results/replay/writethrough_tile_20261205, commit bd811dc, speedup
over SGLang's packed decode at batch 1 / 8 / 32 / 64 / 128 / 256, L = 16, empty histories): bfloat16 state
GDN 1.01 / 0.99 / 0.92 / 0.88 / 0.87 / 0.88x against 32 columns' 0.87 / 0.93 / 0.86 / 0.83 / 0.82 / 0.84x,
KDA 1.02 / 0.99 / 0.92 / 0.89 / 0.87 / 0.86x against 0.86 / 0.93 / 0.82 / 0.78 / 0.74 / 0.73x; float32
GDN 1.19 / 0.96 / 0.99 / 1.00 / 1.00 / 1.00x against 0.79 / 0.83 / 0.95 / 0.98 / 0.99 / 0.99x, KDA 0.96-1.11x
either way (8 columns: :data:`WRITE_THROUGH_DECODE_BLOCK_V`). The committed state is the same bits whatever the
columns (each column's sums over K are unchanged; tested on the GPU)."""

WRITE_THROUGH_DECODE_BLOCK_V = {("kda", 4): 8}
"""Value columns per write-through *decode* program where they are not :data:`WRITE_THROUGH_BLOCK_V`, per
``(family, state bytes)``: a KDA float32 state takes 8 (64 registers a thread against 106 at 16 columns). In the
same H100 run (bench/results/replay/writethrough_tile_20261205/run2_columns_bd811dc, commit bd811dc, L = 16, empty
histories, 8 / 16 columns side by side) it was faster at every batch: write-through launch µs 4.4 / 5.4 at batch 1,
14.2 / 15.6 at 8, 48.9 / 52.3 at 32, 94.2 / 97.4 at 64, 184.9 / 189.5 at 128, 365.5 / 371.9 at 256 (a step 1.34 /
1.06 / 1.04 / 1.01 / 1.00 / 1.01x SGLang's packed decode against 1.11 / 0.97 / 0.99 / 0.98 / 0.98 / 0.99x). Not for
GDN (8 columns 0.93x at batch 8 against 0.96x, within 0.03 elsewhere), a bfloat16 KDA state (0.79-0.92x from 8
requests against 0.86-0.99x) or a verify (not measured). Served, again side by side with 16 columns (bench/results/
replay/writethrough_kda8_20261207, commit d04da19, H100, L = 16 and 64): 1.29-1.32 / 1.06 / 1.05-1.06 / 1.02-1.03 /
1.01 / 1.00-1.01x against 0.97-1.10x."""


def write_through_block_v(is_kda: bool, state_dtype: torch.dtype, draft: bool) -> int:
    """Value columns per program of a served write-through: :data:`WRITE_THROUGH_DECODE_BLOCK_V` for a decode
    (``draft`` false) where it names the family and state width, else :data:`WRITE_THROUGH_BLOCK_V`."""
    if draft:
        return WRITE_THROUGH_BLOCK_V
    return WRITE_THROUGH_DECODE_BLOCK_V.get(("kda" if is_kda else "gdn", state_bytes(state_dtype)),
                                            WRITE_THROUGH_BLOCK_V)

WRITE_THROUGH_V_MAJOR = True
"""Whether a served write-through holds its tile ``[BV, K]`` (SGLang's packed decode) or ``[K, BV]`` (its
generic decode): the bits are the same on the GPU (float32 state equal to both kernels', tested); ``[BV, K]``
was as fast or faster in the same H100 runs (bfloat16 KDA at 128 requests 0.87x native against 0.83x, 16
columns; 0.76x against 0.75x, 32 columns, commit 713c0de)."""


WRITE_THROUGH_VERIFY_PREFETCH = {"gdn": False, "kda": True}
"""Whether a served write-through verify loads each draft token's inputs one step ahead (the first while the fold
runs), per family: where that was faster in the one run that timed both side by side (H100,
bench/results/prefetch_20261206, commit 4798d3d, L = 16, D = 4, a round at batch 1 / 16 / 256): KDA bfloat16
1.11 / 1.08 / 1.23x (0.86x native at 256 becomes 1.06x), float32 1.02 / 1.04 / 1.03x; GDN 0.96-1.00x (not
taken). Registers a thread there (sm_90): KDA 237 -> 239 (bfloat16), 228 -> 239 (float32); GDN 211 -> 229."""
