"""Benchmark: replay mode against SGLang 0.5.14's native kernels, side by side in one run on one GPU.

* ``decode`` (one token per request): native = SGLang's default decode kernel
  (``fused_recurrent_gated_delta_rule_packed_decode`` for GDN, ``fused_recurrent_kda_packed_decode``
  for KDA; state read + written), replay = its served plain decode (``ops.replay.decode.replay_decode``:
  write-through for small batches — fold + token + checkpoint written, one launch — else the output-only
  verify of one token with the fold fused, cursor advance; variants ``:through`` / ``:nothrough`` force one).
  Output-only, the cursors settle once a step as the server settles them (after its last linear layer, every
  layer's in one launch): here one advance after each run of ``layers`` slot groups (36 GDN, 20 KDA; fewer
  where the case has fewer groups, so never cheaper than the server's); ``:layercursor`` advances each group
  after its own decode instead (each layer settling its own, as before).
* ``spec_round`` (verify of D tokens + acceptance): native as in ``bench_compact.py`` (GDN SGLang's,
  KDA ours); replay = its served chain verify + cursor advance: write-through for small batches
  (``ops.replay.served.serves_write_through_verify``: the accepted records folded into the checkpoint,
  written, and the window run from it, one launch) else output-only with the fold fused; ``:through`` /
  ``:nothrough`` force one.
* ``upstream-replayssm`` rows (decode only): upstream SGLang's ReplaySSM decode kernel from the
  sglang 0.5.23 wheel (``scripts/upstream_replayssm.py``; ``--upstream DIR``, by default the folder its
  ``extract`` fills), on the same pool with its own ring of L - 1 records and cursors spread the same
  way; its ``write_pos`` (one per request: the kernel takes it per row, the same for every layer) moves once
  a step over the same slot groups as ours. Without the extracted kernel there are no such rows, and the
  report says so.
* ``fla`` rows (decode only): flash-linear-attention's fused recurrent kernels (fla-core 0.6.0,
  ``scripts/fla_kernels.py``; ``--fla DIR``), V-first states, gates in the kernel: a second
  read-and-write decode beside SGLang's, on each round's contiguous block of pool slots.

Cursors start spread over the ring (request i has ``i mod L`` records), so folds are amortised as in
serving; every timed step includes the fold launch and its share of folding work. Timing: CUDA-graph
replay of R steps, each on its own group of slots, median over repeats, divided by R. ``path`` says
which kernels ran. Bytes (what each must move, :func:`record_bytes`): native moves 2 states per decode step;
replay reads the checkpoint and the hot words of its history records (u, normalised k, g), writes one whole
record per token, plus the amortised fold (the raw records read, the state read and written once per
L - D + 1 steps); upstream reads the checkpoint and its ring's records, writes a record (a flush: the state).

Usage (GPU): python3 scripts/bench_replay.py --out DIR [--batches ...] [--histories 16 32 64] [--draft-tokens 1 2 4]
Writes DIR/replay_h200.json, .md and .png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

import fla_kernels
import upstream_replayssm
from bench_common import (DTYPES, FAMILIES, TARGET_BYTES, K, V, compiled_resources, copy_bandwidth_gbps, kernel_times,
                          make_inputs, parse_tilings, plot_speedups, time_graph)
from sglang_ssm_modes.sizing import SLOT_WORDS_BYTES

NATIVE_IMPLS = ("sglang-0.5.14-native", "ours-native")
STATELESS_IMPLS = (*NATIVE_IMPLS, "fla")
"""Implementations without a history: one row per (family, dtype, D, batch), whatever the case's L."""

KERNELS = {"replay_window": "window", "replay_output": "output", "replay_step": "step", "advance": "advance",
           "replay_write_through": "write-through",
           "replay_fold": "fold", "packed_decode": "decode", "fused_sigmoid_gating": "verify",
           "verify_window": "verify", "scatter": "scatter", "replayssm": "upstream",
           "fused_recurrent_gated_delta_rule_fwd": "fla",
           "fused_recurrent_kda_fwd": "fla"}


def record_bytes(family: str, act_bytes: int = 2) -> dict[str, int]:
    """One token's replay record per request and layer, in bytes: ``"all"`` (written: u, normalised k, g, beta,
    raw k, raw v), ``"hot"`` (what an output-only step reads of each history record: u by the output launch,
    normalised k and g by the window launch), ``"hot_raw_keys"`` (the same with the window launch reading the raw
    keys, ``replay_verify(window_raw_keys=True)``) and ``"fold"`` (what a fold reads: raw k, raw v, g, beta)."""
    hk, hv = FAMILIES[family]["hk"], FAMILIES[family]["hv"]
    g = hv * (K if family == "kda" else 1) * 4
    raw = hk * K * act_bytes + hv * V * act_bytes
    return {"all": hv * V * 4 + hk * K * 4 + g + hv * 4 + raw, "hot": hv * V * 4 + hk * K * 4 + g,
            "hot_raw_keys": hv * V * 4 + hk * K * act_bytes + g, "fold": raw + g + hv * 4}


def bench_case(family, dtype_name, batch, d, history, copy_bw, variants=(("served", {}),), resources=None,
               upstream=None, fla=None, stateless=True, separate=True):
    """Time native and replay (each variant ``(name, replay_verify keyword arguments)``, fused fold; and,
    with ``separate``, the fold as a kernel of its own first) for one case; rows.
    ``resources`` (a dict kept across cases) collects each replay variant's registers and spills;
    ``stateless`` False skips the rows that do not depend on the history (native, fla: measured with another L)."""
    from sglang.srt.layers.attention.fla.fused_recurrent import (
        fused_recurrent_gated_delta_rule_packed_decode, fused_recurrent_kda_packed_decode)
    from sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent import fused_sigmoid_gating_delta_rule_update
    from sglang.srt.layers.attention.mamba.mamba_state_scatter_triton import fused_mamba_state_scatter_with_mask

    from sglang_ssm_modes.ops.native import native_verify
    from sglang_ssm_modes.ops.replay import (ReplayRing, advance, fold_into_checkpoints, fold_needed, replay_decode,
                                             replay_verify, replay_write_through, replay_write_through_verify)
    from sglang_ssm_modes.ops.replay.served import (FOLD_FIRST_MIN_REQUESTS, SERVED_PDL, WRITE_THROUGH_VERIFY_PREFETCH,
                                                    output_tiling, served_launches, served_window_history_rows,
                                                    served_window_raw_keys,
                                                    serves_write_through, serves_write_through_verify,
                                                    write_through_block_v)
    from sglang_ssm_modes.ops.replay.verify import replay_output_kernel, replay_step_kernel, replay_window_kernel
    from sglang_ssm_modes.ops.replay.write_through import replay_write_through_kernel

    resources = {} if resources is None else resources

    sd = DTYPES[dtype_name]
    hk, hv = FAMILIES[family]["hk"], FAMILIES[family]["hv"]
    is_kda = family == "kda"
    state_bytes = hv * V * K * sd.itemsize
    rounds = max(2, min(64, TARGET_BYTES // (batch * state_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(batch * 100 + d * 10 + history)
    x = make_inputs(family, batch, d, torch.bfloat16, gen)
    pool = (0.1 * torch.randn(rounds * batch + 1, hv, V, K, generator=gen, device="cuda")).to(sd)
    groups = [torch.arange(r * batch, (r + 1) * batch, dtype=torch.int32, device="cuda") for r in range(rounds)]
    ring = ReplayRing.allocate(rounds * batch, history, hk, hv, K, V, is_kda, torch.bfloat16, "cuda")
    spread = torch.arange(rounds * batch, device="cuda", dtype=torch.int32) % max(1, history - d + 1)
    # a step's cursor settle: after each run of `layers` rounds (and the last), their groups' slots at once
    layers = min(rounds, FAMILIES[family]["layers"])
    step_spans = {r: ((r // layers) * layers * batch, (r + 1) * batch)  # the slots [start, stop) it settles
                  for r in range(rounds) if (r + 1) % layers == 0 or r == rounds - 1}
    slot_ids = torch.arange(rounds * batch, dtype=torch.int32, device="cuda")
    step_slots = {r: slot_ids[start:stop] for r, (start, stop) in step_spans.items()}

    def spread_cursors():  # every replay row starts from the same spread cursors (a write-through empties them)
        for word in ring.cleared_words():
            word.zero_()
        ring.count.copy_(spread)
    accepted = torch.randint(1, d + 1, (batch,), generator=gen, device="cuda").to(torch.int32)
    last = (accepted - 1).to(torch.int64)
    rows = []
    rec = record_bytes(family)
    fold_share = 1.0 / max(1, history - d + 1)  # requests folding per step (spread cursors)

    round_beta = d == 1 and not is_kda  # as served: a GDN decode rounds beta as SGLang's packed kernel

    def writes_through(variant):  # whether a step of this variant is a write-through (a variant with
        through = variant.get("write_through")  # output-only options times the output-only path)
        if through is None:
            through = variant == {} and (serves_write_through(batch, is_kda, history, sd) if d == 1 else
                                         serves_write_through_verify(batch, is_kda, history, sd))
        return through

    def capped(variant):  # a served tile's fold passes (:fN) at most its own columns wide (a narrow tile: 16)
        if "fold_block_v" not in variant or "block_v" in variant:
            return variant
        return {**variant, "fold_block_v": min(variant["fold_block_v"],
                                               output_tiling(batch, d, is_kda, history, sd)[0])}

    def replay_step_fused(variant):  # as served: the fold inside the verify launch, the cursor after
        variant = capped(variant)
        kw = {key: value for key, value in variant.items() if key not in ("write_through", "cursor")}  # its tile
        through = writes_through(variant)
        per_layer = variant.get("cursor") == "layer"

        def step(r):
            if through and d > 1:  # fold + window from the checkpoint, then the cursor moved
                replay_write_through_verify(x["A_log"], x["a"], x["dt_bias"], x["q"], x["k"], x["v"], x["b"], pool,
                                            groups[r], ring, groups[r], is_kda=is_kda, **kw)
                advance(ring, groups[r], accepted, window=d)
            elif through and kw:  # a write-through tiled otherwise than served (a decode has no draft to prefetch)
                replay_write_through(x["A_log"], x["a"], x["dt_bias"], x["q"], x["k"], x["v"], x["b"], pool,
                                     groups[r], ring, groups[r], is_kda=is_kda, round_beta=round_beta,
                                     **{key: value for key, value in kw.items() if key != "prefetch"})
            elif d == 1:  # the served plain decode: output-only, the cursors settled once a step
                replay_decode(x["A_log"], x["a"], x["dt_bias"], x["q"], x["k"], x["v"], x["b"], pool, groups[r],
                              ring, groups[r], is_kda=is_kda, round_beta=round_beta, write_through=through,
                              settle=through or per_layer, **({} if through else kw))
                if not through and not per_layer and r in step_slots:
                    advance(ring, step_slots[r], 1, window=1)
            else:
                replay_verify(x["A_log"], x["a"], x["dt_bias"], x["q"], x["k"], x["v"], x["b"], pool, groups[r],
                              ring, groups[r], is_kda=is_kda, round_beta=round_beta, **kw)
                advance(ring, groups[r], accepted, window=d)
        return step

    def replay_step_separate(r):  # the fold kernel first (masked to the requests that need it)
        fold_into_checkpoints(pool, groups[r], ring, groups[r], fold_needed(ring, groups[r], d), is_kda=is_kda)
        replay_verify(x["A_log"], x["a"], x["dt_bias"], x["q"], x["k"], x["v"], x["b"], pool, groups[r], ring,
                      groups[r], is_kda=is_kda, round_beta=round_beta, fused_fold=False)
        advance(ring, groups[r], accepted)

    def fused_path(variant):  # what a timed step of the variant runs
        variant = capped(variant)
        if writes_through(variant):
            tile = {key: value for key, value in variant.items() if key not in ("write_through", "cursor")}
            tile.setdefault("block_v", write_through_block_v(is_kda, sd, d > 1))  # what ran: the served columns
            if d > 1:  # what ran: the served prefetch unless the variant sets one
                tile.setdefault("prefetch", WRITE_THROUGH_VERIFY_PREFETCH[family])
                return (f"replay_write_through_verify[write-through](fold, checkpoint written, cursor emptied, "
                        f"window from the checkpoint, records, {tile})+advance(window={d})")
            tile.pop("prefetch", None)  # a decode has no draft tokens to prefetch: not part of what ran
            return (f"replay_decode[write-through](fold + token, checkpoint written, cursor emptied"
                    f"{', ' + str(tile) if tile else ''})")
        settle = ("" if d > 1 or variant.get("cursor") == "layer" else
                  f" once a step (after each {layers} slot groups; the server: its {FAMILIES[family]['layers']} "
                  "linear layers)")
        served = zip(("block_v", "num_warps", "block_k", "num_stages"), output_tiling(batch, d, is_kda, history, sd))
        tile = {**{key: value or K for key, value in served},  # block_k None: the whole of K
                **{key: value for key, value in variant.items()
                   if key not in ("cursor", "write_through", "fold_first")}}
        order = "fold-first" if variant.get("fold_first", batch >= FOLD_FIRST_MIN_REQUESTS) else "request order"
        return (f"replay_verify[{launch_label(variant)}](fused fold, {order}, {tile}, round_beta={round_beta})"
                f"+advance(window={d}){settle}")

    def fused_bytes(variant):  # decode write-through: native's bytes (in the timed steady state no history is
        if not writes_through(variant):  # left); verify: the state read and written, the accepted records read,
            return output_only_bytes(reads_raw_keys(variant))  # the window's written
        return 2 * batch * state_bytes + (batch * d * rec["all"] + int(accepted.sum()) * rec["fold"]) * (d > 1)

    def launches_of(variant):  # a verify call's launches: its own, else the served choice
        return variant.get("launches") or served_launches(batch * d, is_kda, history)

    def reads_raw_keys(variant):  # a window launch (of two: parse_variants sets it) renormalising the raw keys
        return variant.get("window_raw_keys", served_window_raw_keys(launches_of(variant), is_kda, history, d))

    def launch_label(variant):  # the kernels a verify call runs
        if launches_of(variant) == 1:
            return "step"
        rows = variant.get("window_history_rows",
                           served_window_history_rows(launches_of(variant), is_kda, history, d))
        return ("window+output" + (" pdl" if variant.get("pdl", SERVED_PDL) else "")
                + (" raw keys" if reads_raw_keys(variant) else "") + (f" history {rows} a step" if rows else ""))

    mean_hist = (history - d) / 2  # spread cursors: 0 .. L - D records
    # the checkpoint and the history's hot words read, the window's records written, and a fold's share: the
    # state read and written once more, the full history's raw records read (the window launch's scratch not
    # counted: two launches' artifact, not a byte replay must move)
    def output_only_bytes(raw_keys):  # the history's keys read raw (by a window launch) or normalised
        hot = rec["hot_raw_keys" if raw_keys else "hot"]
        return batch * (state_bytes + mean_hist * hot + d * rec["all"]
                        + fold_share * (2 * state_bytes + history * rec["fold"]))

    replay_bytes = output_only_bytes(reads_raw_keys({}))
    if d == 1:
        mixed = torch.cat([x["q"].flatten(2), x["k"].flatten(2), x["v"].flatten(2)], -1)[0]
        out = torch.empty(batch, 1, hv, V, dtype=torch.bfloat16, device="cuda")
        a2 = x["a"].reshape(batch, -1)
        b2 = x["b"].reshape(batch, -1)
        decode_fn = fused_recurrent_kda_packed_decode if is_kda else fused_recurrent_gated_delta_rule_packed_decode

        def native_step(r):
            decode_fn(mixed_qkv=mixed, a=a2, b=b2, A_log=x["A_log"], dt_bias=x["dt_bias"], scale=K ** -0.5,
                      initial_state=pool, out=out, ssm_state_indices=groups[r], use_qk_l2norm_in_kernel=True)

        native = ("decode", "sglang-0.5.14-native", native_step, 2 * batch * state_bytes,
                  f"{decode_fn.__name__}")
        if upstream is not None:  # its own ring on the same pool, cursors spread as ours
            up_ring = upstream_replayssm.UpstreamRing.allocate(rounds * batch + 1, history, hk, hv, K, V, is_kda,
                                                               "cuda")
            up_all = (torch.arange(batch, device="cuda") % history).to(torch.int32).repeat(rounds)
            up_pos = [up_all[r * batch:(r + 1) * batch] for r in range(rounds)]
            up_out = torch.empty(batch, 1, hv, V, dtype=torch.bfloat16, device="cuda")

            def upstream_step(r):
                upstream_replayssm.decode(upstream, x["A_log"], x["a"], x["dt_bias"], x["q"], x["k"], x["v"], x["b"],
                                          pool, groups[r], up_ring, up_pos[r], is_kda=is_kda, out=up_out,
                                          mixed=mixed)
                if r in step_spans:  # its write_pos once a step, as ours
                    upstream_replayssm.advance(up_all[slice(*step_spans[r])], history)

            up_rec = hv * V * 4 + hk * K * 4 + hv * (K if is_kda else 1) * 4  # d, k (per key head), g: float32
            upstream_row = ("upstream-replayssm", "upstream", upstream_step,
                            # the state read (and rewritten by a flush, 1 step in L), the ring's (L - 1) / 2
                            # records read on average, a record written by the other L - 1 steps
                            batch * (state_bytes * (1 + 1 / history) + ((history - 1) / 2 + (history - 1) / history)
                                     * up_rec),
                            "fused_recurrent_linear_replayssm_decode (sglang 0.5.23) + write_pos advance once a "
                            f"step (after each {layers} slot groups)",
                            state_bytes + history * up_rec + 4)
        if fla is not None:  # fla keeps no state indices: each round's states are one contiguous block
            shaped = {name: x[name].reshape(batch, 1, *x[name].shape[2:]) for name in ("q", "k", "v")}

            def fla_step(r):
                fla_kernels.decode(fla, x["A_log"], a2, x["dt_bias"], shaped["q"], shaped["k"], shaped["v"], b2,
                                   pool[r * batch:(r + 1) * batch], is_kda=is_kda)

            fla_row = ("fla", "fla", fla_step, 2 * batch * state_bytes,
                       "fla-core 0.6.0 fused_recurrent (state_v_first, next states in a new tensor)", state_bytes)
    else:
        inter = torch.zeros(batch, d, hv, V, K, dtype=sd, device="cuda")
        inter_idx = torch.arange(batch, dtype=torch.int32, device="cuda")
        cu = torch.arange(0, batch * d + 1, d, dtype=torch.int32, device="cuda")

        def native_step(r):
            if is_kda:
                native_verify(x["A_log"], x["a"], x["dt_bias"], x["q"], x["k"], x["v"], x["b"], pool, groups[r],
                              inter, inter_idx, is_kda=True)
            else:
                fused_sigmoid_gating_delta_rule_update(
                    A_log=x["A_log"], dt_bias=x["dt_bias"], softplus_beta=1.0, softplus_threshold=20.0,
                    q=x["q"], k=x["k"], v=x["v"], a=x["a"], b=x["b"], initial_state_source=pool,
                    initial_state_indices=groups[r], use_qk_l2norm_in_kernel=True, cu_seqlens=cu, is_kda=False,
                    disable_state_update=True, intermediate_states_buffer=inter, intermediate_state_indices=inter_idx,
                    cache_steps=d)
            fused_mamba_state_scatter_with_mask(pool[None], inter[None], groups[r], last)

        native = ("spec_round", "ours-native" if is_kda else "sglang-0.5.14-native", native_step,
                  batch * (1 + d + 2) * state_bytes, "verify(intermediate states)+fused_mamba_state_scatter_with_mask")
    op, impl, fn, nbytes, path = native
    native_per_req = (1 + d if d > 1 else 1) * state_bytes  # SGLang: S (+ D intermediate states)
    replay_per_req = state_bytes + 2 * history * rec["all"] + SLOT_WORDS_BYTES
    for impl_, fold, fn_, nbytes_, path_, per_req in (
            (impl, None, fn, nbytes, path, native_per_req),
            *(("ours-replay", f"fused {name}", replay_step_fused(variant), fused_bytes(variant), fused_path(variant),
               replay_per_req) for name, variant in variants),
            *((("ours-replay", "separate", replay_step_separate, replay_bytes,
                 f"fold_needed+fold_into_checkpoints(masked)+replay_verify[{launch_label({})}]"
                 f"(round_beta={round_beta})+advance", replay_per_req),) if separate else ()),
            *((upstream_row,) if d == 1 and upstream is not None else ()),
            *((fla_row,) if d == 1 and fla is not None else ())):
        if impl_ in STATELESS_IMPLS and not stateless:
            continue
        # the kernels a row runs: the same for the same path; a write-through verify's draft length is a runtime
        # argument of its kernel, which Triton specialises only on divisibility by 16 (D = 2 and 4 run one compiled
        # variant), so its rows share one key across D but for that
        through_verify = path_.startswith("replay_write_through_verify")
        key = (family, dtype_name, history, ("D % 16 == 0", d % 16 == 0) if through_verify else d,
               path_.replace(f"advance(window={d})", "advance"))
        if impl_ == "ours-replay":
            spread_cursors()
        if impl_ == "ours-replay" and key not in resources:  # first call of this path: what ptxas gave it
            resources[key] = compiled_resources({"window": replay_window_kernel, "output": replay_output_kernel,
                                                 "step": replay_step_kernel,
                                                 "write-through": replay_write_through_kernel},
                                                lambda: fn_(0)) or None
        us = time_graph(fn_, rounds)
        parts = kernel_times(fn_, rounds, KERNELS)
        rows.append(dict(op=op, family=family, impl=impl_, state_dtype=dtype_name, batch=batch, draft_tokens=d,
                         history=history if impl_ not in STATELESS_IMPLS else None, fold=fold, median_us=round(us, 2),
                         bytes_min=int(nbytes_), frac_copy_bw=round(nbytes_ / (us * 1e-6) / 1e9 / copy_bw, 3),
                         bytes_per_request=int(per_req), path=path_,
                         verify_kernel_resources=resources.get(key), kernel_us=parts))
    del pool, ring
    torch.cuda.empty_cache()
    return rows


WRITE_THROUGH_TILE = ("block_v", "num_warps", "num_stages", "v_major", "prefetch")
"""The keywords of ``ops.replay.write_through.replay_write_through`` (and ``_verify``) a ``:through`` variant may
set."""


def parse_variants(parser, values: list[str]) -> list[tuple[str, dict]]:
    """``--variants`` values as ``(name, replay_verify keyword arguments)``; a bad value is a
    ``parser.error`` naming the rule."""
    out = []
    for value in values:
        tiling, *opts = value.split(":")
        kw = {}
        if tiling != "served":  # served: ops.replay.served.output_tiling's choice per launch
            (bv, warps), = parse_tilings(parser, [tiling])
            kw = dict(block_v=bv, num_warps=warps)
        for opt in opts:
            if opt in ("fma", "dot"):
                kw["dot"] = opt == "dot"
            elif opt[:1] == "w" and opt[1:] in ("1", "2", "4", "8"):
                kw["window_warps"] = int(opt[1:])
            elif opt in ("one", "two"):
                kw["launches"] = 1 if opt == "one" else 2
            elif opt in ("pdl", "nopdl"):
                kw["pdl"] = opt == "pdl"
            elif opt in ("inorder", "foldfirst"):
                kw["fold_first"] = opt == "foldfirst"
            elif opt[:1] == "k" and opt[1:] in ("16", "32", "64", "128"):
                kw["block_k"] = int(opt[1:])
            elif opt[:1] == "s" and opt[1:] in ("1", "2", "3", "4"):
                kw["num_stages"] = int(opt[1:])
            elif opt[:1] == "h" and opt[1:] in ("0", "1", "2", "4", "8", "16"):  # two launches: the window launch's
                kw["window_history_rows"] = int(opt[1:])
                kw.setdefault("launches", 2)
            elif opt[:1] == "f" and opt[1:] in ("4", "8", "16", "32", "64"):  # a served tile: capped per case
                kw["fold_block_v"] = int(opt[1:])
            elif opt in ("keyhead", "valuehead"):  # two launches: the window launch's option
                kw["window_key_heads"] = opt == "keyhead"
                kw.setdefault("launches", 2)
            elif opt in ("rawkeys", "normkeys"):  # two launches: the window launch's option
                kw["window_raw_keys"] = opt == "rawkeys"
                kw.setdefault("launches", 2)
            elif opt in ("through", "nothrough"):
                kw["write_through"] = opt == "through"
            elif opt in ("stepcursor", "layercursor"):
                kw["cursor"] = opt[:-6]
            elif opt in ("vk", "kv"):
                kw["v_major"] = opt == "vk"
            elif opt in ("prefetch", "noprefetch"):
                kw["prefetch"] = opt == "prefetch"
            else:
                parser.error(f"--variants {value}: options are :wN (N in 1, 2, 4, 8), :kN (block_k: 16, 32, 64, 128), "
                             ":sN (num_stages: 1-4), :fN (a fused fold's value columns at a time: 4-64), :hN (the "
                             "window program's history records a step: 0 whole, 1-16; two launches), :keyhead / "
                             ":valuehead (a window program per key head, GDN's served choice, or per value head; two "
                             "launches), :rawkeys / :normkeys (the window "
                             "launch renormalising the history's raw keys or reading the normalised ones; two "
                             "launches), :fma, "
                             ":dot, :inorder, :foldfirst, :one (one launch), "
                             ":two (window, then output), :pdl / :nopdl (the output launch overlapping the window "
                             "launch or after it), :through / :nothrough (written through or output-only), "
                             ":vk / :kv (a write-through's tile held [BV, K] or [K, BV]), :prefetch / :noprefetch (a "
                             "write-through verify loading each draft token's inputs during the previous token's "
                             "step, or not; else as served), :stepcursor / :layercursor (an output-only decode's "
                             "cursors settled once a step, as served, or after each layer's decode)")
        if ("window_key_heads" in kw or "window_raw_keys" in kw) and kw["launches"] == 1:
            parser.error(f"--variants {value}: :keyhead / :valuehead / :rawkeys / :normkeys tile the window launch of "
                         "two; drop :one")
        if kw.get("window_history_rows") and kw["launches"] == 1:
            parser.error(f"--variants {value}: :hN reads the history a block at a time in the window launch of two; "
                         "drop :one")
        if kw.get("write_through"):
            others = sorted(set(kw) - {"write_through", *WRITE_THROUGH_TILE})
            if others:
                parser.error(f"--variants {value}: {others} tile the output-only path; a write-through takes a "
                             "tiling (BVxW), :sN and :vk / :kv (e.g. served:through:vk, 64x2:through)")
        elif "v_major" in kw or "prefetch" in kw:
            parser.error(f"--variants {value}: :vk / :kv / :prefetch / :noprefetch apply to a write-through: add "
                         ":through")
        if kw.get("fold_block_v", 0) > kw.get("block_v", 64) or kw.get("fold_block_v", 64) < kw.get("num_warps", 1):
            parser.error(f"--variants {value}: :fN folds N of the tile's columns at a time, at least one per warp")
        if kw.get("dot") and kw.get("block_v", 16) < 16:
            parser.error(f"--variants {value}: the tensor-core path needs block_v >= 16")
        out.append((value, kw))
    return out


def rows_fold_served(rows) -> str:
    """The variant the plot shows: the first fused tiling measured (the served default first)."""
    return next(r["fold"] for r in rows if r["impl"] == "ours-replay" and r["fold"].startswith("fused"))


def write_report(result, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "replay_h200.json"), "w") as f:
        json.dump(result, f, indent=1)
    rows = result["rows"]
    key = lambda r: (r["family"], r["state_dtype"], r["draft_tokens"], r["batch"])
    nat = {key(r): r for r in rows if r["impl"] in NATIVE_IMPLS}
    lines = [f"# Replay vs native — {result['gpu']}, {result['date']}, commit {result['commit']}", "",
             f"Copy bandwidth {result['copy_bw_gbps']:.0f} GB/s. Speedup = native µs / replay µs (same run). "
             "D = 1 is plain decode (native: SGLang's packed decode kernel).", "",
             "Replay's fold runs inside the verify launch (`fused`, as served) or as its own kernel first "
             "(`separate`); `upstream` rows are upstream SGLang's ReplaySSM decode "
             f"({result.get('upstream', 'not run')}); `fla` rows flash-linear-attention's fused recurrent decode "
             f"({result.get('fla', 'not run')}: reads and writes the state, like native).", "",
             "Kernels: device µs per step of each launch (CUDA profiler, eager), beside the CUDA-graph median.", "",
             *([result["note"], ""] if result.get("note") else []),
             "| family | state | D | L | batch | fold | native µs | replay µs | speedup | native frac bw "
             "| replay frac bw | replay kernels µs | verify kernel |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["impl"] not in NATIVE_IMPLS),
                    key=lambda r: (*key(r), r["history"] or 0, r["fold"])):
        n = nat[key(r)]
        lines.append(f"| {r['family']} | {r['state_dtype']} | {r['draft_tokens']} | {r['history'] or '–'} | "
                     f"{r['batch']} | "
                     f"{r['fold']} | {n['median_us']:.1f} | {r['median_us']:.1f} | "
                     f"{n['median_us'] / r['median_us']:.2f}× | "
                     f"{n['frac_copy_bw']:.2f} | {r['frac_copy_bw']:.2f} | "
                     + " + ".join(f"{k} {u:.1f}" for k, u in (r.get("kernel_us") or {}).items())
                     + f" | {r.get('verify_kernel_resources') or ''} |")
    with open(os.path.join(out_dir, "replay_h200.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    points = {}
    for r in rows:
        if r["fold"] in (rows_fold_served(rows), "upstream", "fla"):
            label = ((r["fold"] + " " if r["fold"] in ("upstream", "fla") else "")
                     + f"{r['state_dtype']} D={r['draft_tokens']} L={r['history']}")
            points.setdefault(r["family"], {}).setdefault(label, []).append(
                (r["batch"], nat[key(r)]["median_us"] / r["median_us"]))
    plot_speedups(points, "native / replay", os.path.join(out_dir, "replay_h200.png"))


def merge_reports(parser, paths: list[str], out_dir: str) -> int:
    """One report from several runs' results (rows concatenated; a case measured twice is refused). Each
    run's copy bandwidth is kept (``copy_bw_gbps_runs``); each row's fraction is its own run's."""
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as e:
            parser.error(f"--merge {path}: {e}")
    for key in ("gpu", "commit"):
        if len({r.get(key) for r in runs}) > 1:
            parser.error(f"--merge: the runs differ in {key} ({', '.join(str(r.get(key)) for r in runs)})")
    case = lambda r: (r["op"], r["family"], r["impl"], r["state_dtype"], r["batch"], r["draft_tokens"], r["history"],
                      r["fold"])
    rows, seen = [], set()
    for run in runs:
        for row in run["rows"]:
            if case(row) in seen:
                parser.error(f"--merge: {case(row)} was measured in more than one run")
            seen.add(case(row))
            rows.append(row)
    result = {**runs[0], "date": max(r["date"] for r in runs), "copy_bw_gbps_runs": [r["copy_bw_gbps"] for r in runs],
              "rows": rows}
    write_report(result, out_dir)
    print(open(os.path.join(out_dir, "replay_h200.md")).read())
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--histories", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--state-dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--families", nargs="+", default=["gdn", "kda"], choices=list(FAMILIES))
    p.add_argument("--variants", nargs="+", default=["served"],
                   metavar="served|BVxWARPS[:wN][:kN][:sN][:fN][:hN][:keyhead|:valuehead][:rawkeys|:normkeys]"
                           "[:fma|:dot]"
                           "[:inorder|:foldfirst][:one|:two][:pdl|:nopdl][:through|:nothrough]"
                           "[:stepcursor|:layercursor]",
                   help="replay launch variants to time side by side: the output launch's tiling as served "
                        "(served: ops.replay.served.output_tiling, by requests per launch, tokens, family, "
                        "history and state dtype) or fixed (block_v x "
                        "num_warps), optionally the window launch's warps (:w2) and (GDN) one window program per "
                        "key head or per value head (:keyhead / :valuehead; served: per key head) and reading the "
                        "history's raw keys or its normalised ones (:rawkeys / :normkeys; default: "
                        "ops.replay.served.served_window_raw_keys), a value-head window program's history "
                        "records a step (:h4; :h0 the whole history at once; default "
                        "ops.replay.served.served_window_history_rows), the checkpoint rows per step of "
                        "the output launch's K loop (:k64) and its pipeline depth (:s3), a fused fold's value "
                        "columns at a time (:f32; default ops.replay.served.served_fold_block_v; a served "
                        "tile's fold at most its own columns), the S0 projections on CUDA "
                        "cores (:fma) or tensor cores (:dot; default: tensor cores for D > 1), and the output "
                        "launch in request order (:inorder) or folding requests first (:foldfirst; default: from "
                        "batch 32 on, ops.replay.served.FOLD_FIRST_MIN_REQUESTS), in one launch (:one) or two "
                        "(:two: window, then output), the output launch a programmatic dependent of the window "
                        "launch (:pdl; sm90+) or not (:nopdl; default: ops.replay.served.SERVED_PDL); a decode "
                        "or verify written through to the checkpoint (served:through) or output-only "
                        "(:nothrough; default: ops.replay.served.serves_write_through for a decode, "
                        "ops.replay.served.serves_write_through_verify for a verify, by batch); an "
                        "output-only decode's cursors settled once a step (:stepcursor, served) or after each "
                        "layer's decode (:layercursor). The first "
                        "listed is plotted: list the served default first. E.g. served 16x1:k128:s2 served:inorder "
                        "16x1:w2 32x1:fma 64x1:k64:s3")
    p.add_argument("--upstream", type=str, default=str(upstream_replayssm.DEFAULT_DIR),
                   help="folder of the extracted upstream ReplaySSM decode kernel (scripts/upstream_replayssm.py "
                        "extract); decode rows of it are added when it is there")
    p.add_argument("--fla", type=str, default=str(fla_kernels.DEFAULT_DIR),
                   help="folder of the extracted fla-core 0.6.0 (scripts/fla_kernels.py extract); fla decode rows "
                        "are added when it is there")
    p.add_argument("--separate", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the fold as a kernel of its own before the verify (the `separate` rows; "
                        "--no-separate: only the fused fold, as served)")
    p.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="no GPU: write one report (JSON, table, plot) into --out from the replay_h200.json files of "
                        "runs that split the cases between them (e.g. one per family), all of one GPU and commit")
    args = p.parse_args(argv)
    if args.merge:
        return merge_reports(p, args.merge, args.out)
    if any(b < 1 for b in args.batches) or any(d < 1 for d in args.draft_tokens):
        p.error("batches and draft tokens must be >= 1")
    bad = [(L, d) for L in args.histories for d in args.draft_tokens if L < d or L not in (8, 16, 32, 64)]
    if bad:
        p.error(f"each history must be one of 8, 16, 32, 64 and >= every draft-token count; bad (L, D): {bad}")
    variants = parse_variants(p, args.variants)
    if "kda" in args.families and any(kw.get("window_key_heads") for _, kw in variants):
        p.error("--variants ...:keyhead: one window program per key head is GDN's (KDA's gates are per channel "
                "and value head); pass --families gdn")
    if "gdn" in args.families and any(kw.get("window_history_rows") and kw.get("window_key_heads", True)
                                      for _, kw in variants):
        p.error("--variants ...:hN: a window program per value head reads the history a block at a time; GDN's "
                "served window runs per key head: add :valuehead (or pass --families kda)")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    from tqdm import tqdm

    upstream, source = None, f"not extracted at {args.upstream}"
    if os.path.isfile(os.path.join(args.upstream, upstream_replayssm.MODULE)):
        upstream = upstream_replayssm.load(args.upstream)
        source = open(os.path.join(args.upstream, "SOURCE")).read().split(" sha256")[0]
    fla, fla_source = None, f"not extracted at {args.fla}"
    if os.path.isfile(os.path.join(args.fla, "fla", "__init__.py")):
        fla = fla_kernels.load(args.fla)
        fla_source = ", ".join(line.split(" sha256")[0] for line in open(os.path.join(args.fla, "SOURCE")))
    bw = copy_bandwidth_gbps()
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=args.commit,
                  copy_bw_gbps=round(bw, 1), torch=torch.__version__, upstream=source, fla=fla_source,
                  rows=[])
    cases = [(f, dt, b, d, L) for f in args.families for dt in args.state_dtypes for d in args.draft_tokens
             for L in args.histories for b in args.batches]
    os.makedirs(args.out, exist_ok=True)
    resources = {}
    for case in tqdm(cases, desc="replay bench", mininterval=5):
        family, dtype_name, batch, d, _ = case
        first = not any((o["family"], o["state_dtype"], o["batch"], o["draft_tokens"]) == (family, dtype_name, batch, d)
                        for o in result["rows"])  # native and fla rows do not depend on L: measured with the first
        result["rows"] += bench_case(*case, bw, variants, resources, upstream, fla, stateless=first,
                                     separate=args.separate)
        with open(os.path.join(args.out, "replay_h200.partial.json"), "w") as f:
            json.dump(result, f)
    write_report(result, args.out)
    print(open(os.path.join(args.out, "replay_h200.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
