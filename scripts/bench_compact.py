"""Benchmark: one speculative round (verify + acceptance) of SGLang 0.5.14's native path against the
compact mode's, side by side in one run on one GPU.

* native: GDN ``sglang-0.5.14-native`` — ``fused_sigmoid_gating_delta_rule_update`` writing D per-step
  states to ``intermediate_ssm``, then ``fused_mamba_state_scatter_with_mask``; KDA ``ours-native`` —
  our verify storing per-step states (SGLang 0.5.14 has no KDA verify), then the same scatter;
* compact (``ours-compact``): output-only verify writing raw-input records, then the commit — with each
  verify a server runs (``variant``: ``exact``, native's tiling; ``fast``, ``--ssm-compact-verify fast``);
  ``--verify-tiles`` adds verify-only rows (``variant`` ``tile``) at other tilings.

Timing: CUDA-graph replay of R rounds, each on its own group of pool slots (rotating, so the L2
cache cannot hold the states), median over repeats, divided by R. Bytes: the minimum the round must
move for the state (native: read S, write D states, read + write the accepted one; compact: read S
in verify, read + write S in commit) plus records, against the measured device copy bandwidth.

Usage (GPU): python3 scripts/bench_compact.py --out DIR [--batches 1 8 32 64 128 256] [--draft-tokens 2 4 8]
Writes DIR/compact_h200.json, .md and .png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

from bench_common import (DTYPES, FAMILIES, TARGET_BYTES, K, V, copy_bandwidth_gbps, make_inputs, plot_speedups,
                          time_graph)


NATIVE_PATHS = {"sglang-0.5.14-native": "fused_sigmoid_gating_delta_rule_update", "ours-native": "verify_window(steps)"}


def served_verifies() -> dict:
    """The compact verifies a server runs, by ``--ssm-compact-verify`` value: their tiles."""
    from sglang_ssm_modes.ops.compact import FAST_VERIFY_TILE

    return {"exact": None, "fast": FAST_VERIFY_TILE}


def verify_path(tile, prefetch: bool = False) -> str:
    """The compact verify a row ran: ``verify_window(records,native-tile)`` or ``…,BV16xW1)``, with
    ``,prefetch`` where each token's inputs were loaded during the previous token's step."""
    name = "native-tile" if tile is None else f"BV{tile[0]}xW{tile[1]}"
    return f"verify_window(records,{name}{',prefetch' if prefetch else ''})"


def parse_tile(item: str):
    """``BVxWARPS`` or ``native`` (SGLang's tiling), optionally ``:prefetch`` / ``:noprefetch`` (each token's inputs
    loaded during the previous token's step, or not; without either, as served) -> ``(tile or None, prefetch or
    None)``."""
    spec, _, option = item.lower().partition(":")
    if option not in ("", "prefetch", "noprefetch"):
        raise ValueError(item)
    tile = None if spec == "native" else tuple(int(v) for v in spec.split("x"))
    if tile is not None and (len(tile) != 2 or tile[0] & (tile[0] - 1) or tile[1] & (tile[1] - 1)
                             or not 1 <= tile[1] <= 8):
        raise ValueError(item)
    return tile, {"": None, "prefetch": True, "noprefetch": False}[option]


def bench_case(family, dtype_name, batch, d, copy_bw, tiles):
    from sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent import fused_sigmoid_gating_delta_rule_update
    from sglang.srt.layers.attention.mamba.mamba_state_scatter_triton import fused_mamba_state_scatter_with_mask

    from sglang_ssm_modes.ops.compact import CompactRecordBuffers, compact_commit, compact_verify
    from sglang_ssm_modes.ops.native import native_verify
    from sglang_ssm_modes.ops.verify_window import native_tile, served_prefetch, verify_window

    sd = DTYPES[dtype_name]
    hk, hv = FAMILIES[family]["hk"], FAMILIES[family]["hv"]
    is_kda = family == "kda"
    state_bytes = hv * V * K * sd.itemsize
    rounds = max(2, min(64, TARGET_BYTES // (batch * state_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(batch * 10 + d)
    x = make_inputs(family, batch, d, torch.bfloat16, gen)
    pool = (0.1 * torch.randn(rounds * batch + 1, hv, V, K, generator=gen, device="cuda")).to(sd)
    groups = [torch.arange(r * batch, (r + 1) * batch, dtype=torch.int32, device="cuda") for r in range(rounds)]
    last = torch.randint(0, d, (batch,), generator=gen, device="cuda").to(torch.int64)
    cu = torch.arange(0, batch * d + 1, d, dtype=torch.int32, device="cuda")
    inter = torch.zeros(batch, d, hv, V, K, dtype=sd, device="cuda")
    inter_idx = torch.arange(batch, dtype=torch.int32, device="cuda")
    rec = CompactRecordBuffers.allocate(batch, d, hk, hv, K, V, is_kda, torch.bfloat16, "cuda")
    rec_idx = torch.arange(batch, dtype=torch.int32, device="cuda")
    kw = dict(q=x["q"], k=x["k"], v=x["v"], a=x["a"], b=x["b"])

    def native_verify_only(r):
        if is_kda:
            native_verify(x["A_log"], x["a"], x["dt_bias"], x["q"], x["k"], x["v"], x["b"], pool, groups[r], inter,
                          inter_idx, is_kda=True)
        else:
            fused_sigmoid_gating_delta_rule_update(
                A_log=x["A_log"], dt_bias=x["dt_bias"], softplus_beta=1.0, softplus_threshold=20.0,
                initial_state_source=pool, initial_state_indices=groups[r], use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu, is_kda=False, disable_state_update=True, intermediate_states_buffer=inter,
                intermediate_state_indices=inter_idx, cache_steps=d, **kw)

    def native_accept(r):
        fused_mamba_state_scatter_with_mask(pool[None], inter[None], groups[r], last)

    def native(r):
        native_verify_only(r)
        native_accept(r)

    def compact_verify_with(tile, prefetch=None):
        args = (x["A_log"], x["a"], x["dt_bias"], x["q"], x["k"], x["v"], x["b"], pool)
        if prefetch is None:  # as served
            return lambda r: compact_verify(*args, groups[r], rec, rec_idx, is_kda=is_kda, tile=tile)
        return lambda r: verify_window(*args, groups[r], is_kda=is_kda, records=rec, record_indices=rec_idx,
                                       tile=tile, prefetch=prefetch)

    def prefetches(tile, prefetch=None):  # what a verify of this tile ran: served (None) or as asked
        return served_prefetch(is_kda, tile or native_tile(V), sd) if prefetch is None else prefetch

    def compact_commit_only(r):
        compact_commit(pool, groups[r], rec, rec_idx, last, is_kda=is_kda)

    def compact_round_with(tile):
        verify = compact_verify_with(tile)
        return lambda r: (verify(r), compact_commit_only(r))

    act_bytes = batch * d * (2 * hk * K + hv * V + hv * (K if is_kda else 1) + hv) * 2  # q,k,v,a,b in
    out_bytes = batch * d * hv * V * 2
    rec_bytes = batch * d * (hk * K * 2 + hv * V * 2 + hv * (K if is_kda else 1) * 4 + hv * 4)
    mean_accept = (last.float().mean().item() + 1)
    native_impl = "ours-native" if is_kda else "sglang-0.5.14-native"
    native_bytes, compact_bytes = (1 + d) * state_bytes, state_bytes + rec_bytes // batch
    cases = [  # (op, impl, variant, path, fn, states moved, other bytes, bytes per request)
        ("spec_round", native_impl, None, NATIVE_PATHS[native_impl] + "+fused_mamba_state_scatter_with_mask", native,
         1 + d + 2, act_bytes + out_bytes, native_bytes),
        ("verify", native_impl, None, NATIVE_PATHS[native_impl], native_verify_only, 1 + d, act_bytes + out_bytes,
         native_bytes),
        ("commit", native_impl, None, "fused_mamba_state_scatter_with_mask", native_accept, 2, 0, native_bytes),
        ("commit", "ours-compact", None, "compact_commit", compact_commit_only, 2, rec_bytes * mean_accept / d,
         compact_bytes),
    ]
    for variant, tile in served_verifies().items():
        path = verify_path(tile, prefetches(tile))
        cases += [("spec_round", "ours-compact", variant, path + "+compact_commit", compact_round_with(tile), 3,
                   act_bytes + out_bytes + rec_bytes * (1 + mean_accept / d), compact_bytes),
                  ("verify", "ours-compact", variant, path, compact_verify_with(tile), 1,
                   act_bytes + out_bytes + rec_bytes, compact_bytes)]
    cases += [("verify", "ours-compact", "tile", verify_path(tile, prefetches(tile, prefetch)),
               compact_verify_with(tile, prefetch), 1,
               act_bytes + out_bytes + rec_bytes, compact_bytes) for tile, prefetch in tiles]
    rows = []
    for op, impl, variant, path, fn, states, extra, per_req in cases:
        us = time_graph(fn, rounds)
        bytes_min = batch * states * state_bytes + extra
        rows.append(dict(op=op, family=family, impl=impl, variant=variant, state_dtype=dtype_name, batch=batch,
                         draft_tokens=d, median_us=round(us, 2), bytes_min=int(bytes_min),
                         frac_copy_bw=round(bytes_min / (us * 1e-6) / 1e9 / copy_bw, 3),
                         bytes_per_request=int(per_req), path=path, mean_accepted=round(mean_accept, 2)))
    del pool, inter
    torch.cuda.empty_cache()
    return rows


def write_report(result, out_dir):
    """``compact_h200.json``, a Markdown table of the round per served verify (and the verify of any extra tile)
    and a PNG of the speedups, into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "compact_h200.json"), "w") as f:
        json.dump(result, f, indent=1)
    rows = result["rows"]
    key = lambda r: (r["family"], r["state_dtype"], r["draft_tokens"], r["batch"])
    part = {(r["op"], r["impl"] == "ours-compact", r.get("variant")) + key(r): r for r in rows
            if r.get("variant") != "tile"}
    cases = sorted({key(r) for r in rows})
    lines = [f"# Compact vs native speculative round — {result['gpu']}, {result['date']}, commit {result['commit']}",
             "", f"Copy bandwidth {result['copy_bw_gbps']:.0f} GB/s. Speedup = native µs / compact µs (same run).",
             "",
             "Native: GDN SGLang 0.5.14's kernels, KDA ours (SGLang has no KDA verify). Compact as served: `exact` "
             "(default; native's verify tiling, outputs native's bits) and `fast` (`--ssm-compact-verify fast`); the "
             "committed state is native's bits in both. Parts: verify + accept/commit µs.", "",
             "| family | state | D | batch | native µs | exact µs | exact | fast µs | fast | native parts "
             "| exact parts | fast parts | native frac bw | exact frac bw | fast frac bw | mem/req native→compact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    points = {}
    for c in cases:
        n = part[("spec_round", False, None) + c]
        nv, nc = part[("verify", False, None) + c], part[("commit", False, None) + c]
        cc = part[("commit", True, None) + c]
        cells, speedup = [], {}
        for variant in ("exact", "fast"):
            r, v = part[("spec_round", True, variant) + c], part[("verify", True, variant) + c]
            speedup[variant] = n["median_us"] / r["median_us"]
            cells.append((r, v))
            label = f"{variant} {c[1]} D={c[2]}"
            points.setdefault(c[0], {}).setdefault(label, []).append((c[3], speedup[variant]))
        (ex, exv), (fa, fav) = cells
        lines.append(f"| {c[0]} | {c[1]} | {c[2]} | {c[3]} | {n['median_us']:.1f} | {ex['median_us']:.1f} | "
                     f"{speedup['exact']:.2f}× | {fa['median_us']:.1f} | {speedup['fast']:.2f}× | "
                     f"{nv['median_us']:.1f} + {nc['median_us']:.1f} | {exv['median_us']:.1f} + "
                     f"{cc['median_us']:.1f} | {fav['median_us']:.1f} + {cc['median_us']:.1f} | "
                     f"{n['frac_copy_bw']:.2f} | {ex['frac_copy_bw']:.2f} | {fa['frac_copy_bw']:.2f} | "
                     f"{ex['bytes_per_request'] / n['bytes_per_request']:.2f}× |")
    swept = [r for r in rows if r.get("variant") == "tile"]
    if swept:
        lines += ["", "Other verify tiles (verify alone; against the exact verify of the same case):", "",
                  "| family | state | D | batch | verify | µs | exact verify / this |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(swept, key=lambda r: (key(r), r["path"])):
            exact = part[("verify", True, "exact") + key(r)]["median_us"]
            lines.append(f"| {r['family']} | {r['state_dtype']} | {r['draft_tokens']} | {r['batch']} | {r['path']} | "
                         f"{r['median_us']:.1f} | {exact / r['median_us']:.2f}× |")
    with open(os.path.join(out_dir, "compact_h200.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot_speedups(points, "spec round: native / compact", os.path.join(out_dir, "compact_h200.png"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--state-dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--families", nargs="+", default=["gdn", "kda"], choices=list(FAMILIES))
    p.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    p.add_argument("--verify-tiles", nargs="*", default=[],
                   help="extra compact verify tilings timed beside the served ones (exact: native's 32x1, fast: "
                        "FAST_VERIFY_TILE): BVxWARPS or native, each optionally :prefetch / :noprefetch (each token's "
                        "inputs loaded during the previous token's step, or not; else as served), e.g. 32x2 8x1 "
                        "native:noprefetch 16x1:prefetch")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if any(b < 1 for b in args.batches) or any(d < 1 for d in args.draft_tokens):
        p.error("batches and draft tokens must be >= 1")
    try:
        tiles = [parse_tile(t) for t in args.verify_tiles]
    except ValueError:
        p.error(f"--verify-tiles takes BVxWARPS (powers of two, WARPS 1..8) or native, optionally :prefetch or "
                f":noprefetch, "
                f"got {args.verify_tiles}")
    from tqdm import tqdm

    bw = copy_bandwidth_gbps()
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=args.commit,
                  copy_bw_gbps=round(bw, 1), torch=torch.__version__, state_dtypes=args.state_dtypes,
                  draft_tokens=args.draft_tokens, rows=[])
    cases = [(f, dt, b, d) for f in args.families for dt in args.state_dtypes for d in args.draft_tokens
             for b in args.batches]
    os.makedirs(args.out, exist_ok=True)
    for case in tqdm(cases, desc="compact bench", mininterval=5):
        result["rows"] += bench_case(*case, bw, tiles)
        with open(os.path.join(args.out, "compact_h200.partial.json"), "w") as f:  # survives a time-out
            json.dump(result, f)
    write_report(result, args.out)
    print(open(os.path.join(args.out, "compact_h200.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
