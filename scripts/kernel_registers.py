"""Registers and spills per thread of the replay verify's two kernels (window and output; with
``--write-through`` also the write-through kernel: decode at D = 1, verify above), compiled for
an H100/H200 (sm_90a) on any machine, GPU or not: Triton compiles each kernel to PTX and the ``ptxas``
shipped in Triton's wheel reports what it allocates. A CPU-side loop for kernel work between GPU
sessions (the GPU bench reports the same figures from the loaded kernels: ``bench_replay.py``'s
``verify kernel`` column; Triton versions differ between machines, so compare variants within one run,
not across machines).

    python scripts/kernel_registers.py [--tilings narrow wide 64x1:k32:s4] [--histories 16 64]
        [--families gdn kda] [--state-dtypes float32 bfloat16] [--fold fused separate] [--draft-tokens 4]
        [--one-launch] [--write-through] [--prefetch]
    python scripts/kernel_registers.py --verify-window [BVxWARPS ...] [--families ...] [--prefetch]

Prints a Markdown table (``family, state, L, fold, output tiling``, then registers / spill bytes of the
window kernel, of the output kernel and, with ``--one-launch``, of the one-launch kernel at that tiling; with
``--write-through``, of the write-through kernel at its served tiling); ``--verify-window``: compact's verify
instead (chain and tree per tile). ``--prefetch``: the verifies loading each token's inputs one step ahead.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

from bench_common import DTYPES, FAMILIES, K, V, parse_tilings

STATE = {"float32": "fp32", "bfloat16": "bf16"}


def _ptxas_resources(kernel, pointers: dict, consts: dict, num_warps: int, num_stages: int = 2) -> tuple[int, int]:
    """``(registers per thread, spill-store bytes)`` of one Triton kernel compiled for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    floats = ("softplus_beta", "softplus_threshold", "scale")
    names = kernel.arg_names
    signature = {n: "*" + pointers[n] if n in pointers else "constexpr" if n in consts else
                 "fp32" if n in floats else "i32" for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spills = re.search(r"(\d+) bytes spill stores", out.stderr)
    if out.returncode or not regs:
        raise RuntimeError(f"ptxas failed: {out.stderr[-800:]}")
    return int(regs.group(1)), int(spills.group(1)) if spills else 0


def verify_kernel_resources(family: str, state_dtype: str, history: int, fused_fold: bool, tiling: tuple,
                            draft_tokens: int = 4, one_launch: bool = False,
                            raw_keys: bool | None = None,
                            history_rows: int | None = None) -> dict[str, tuple[int, int]]:
    """``{kernel: (registers per thread, spill-store bytes)}`` of the replay verify's two launches for one
    variant (the served constants: bf16 activations, ROUND_BETA for GDN as in decode): the window kernel
    (its served warps) and the output kernel at ``tiling`` = ``(block_v, num_warps, block_k, num_stages)``
    (a fused fold's columns a pass as served, :func:`~sglang_ssm_modes.ops.replay.served.served_fold_block_v`;
    ``block_k`` None: all of K; the S0 projections on tensor cores for a window of more than one token,
    as served, where ``block_v >= 16``; in fold-first order with a fused fold, as served from batch 32 on; both
    with programmatic dependent launch where :data:`~sglang_ssm_modes.ops.replay.served.SERVED_PDL` serves it);
    with ``one_launch`` also the one-launch kernel (``replay_step_kernel``) at the same tiling; ``raw_keys``: the
    window kernel renormalising the history's raw keys (default: the served
    :func:`~sglang_ssm_modes.ops.replay.served.served_window_raw_keys`); ``history_rows``: the window kernel reading
    the history this many records a step, on its served warps (default: the served
    :func:`~sglang_ssm_modes.ops.replay.served.served_window_history_rows`)."""
    import triton

    from sglang_ssm_modes.ops.replay.served import (SERVED_PDL, served_fold_block_v, served_window_history_rows,
                                                    served_window_key_heads, served_window_raw_keys,
                                                    served_window_warps)
    from sglang_ssm_modes.ops.replay.verify import replay_output_kernel, replay_step_kernel, replay_window_kernel

    is_kda = family == "kda"
    tp = triton.next_power_of_2(draft_tokens)
    if history_rows is None:
        history_rows = served_window_history_rows(2, is_kda, history, draft_tokens)
    heads = FAMILIES[family]
    shared = dict(H=heads["hk"], HV=heads["hv"], K=K, L=history, TP=tp,
                  W=2 * K + 2 * history + 2 * tp + 1, IS_KDA=is_kda, FUSED_FOLD=fused_fold)
    ring = dict(r_u="fp32", r_kn="fp32", r_g="fp32", r_beta="fp32", r_kraw="bf16", r_vraw="bf16", r_count="i32",
                r_phase="i32", r_faults="i32", rec_indices="i32", h0_indices="i32", proj="fp32")
    window = _ptxas_resources(
        replay_window_kernel,
        dict(ring, A_log="fp32", a="bf16", dt_bias="fp32", q="bf16", k="bf16", b="bf16", order="i32"),
        dict(shared, BETA_ACTIVATED=False, ROUND_BETA=not is_kda, FOLD_FIRST=fused_fold,
             KEY_HEADS=served_window_key_heads(is_kda, 2), GP=triton.next_power_of_2(heads["hv"] // heads["hk"]),
             PDL=SERVED_PDL, RAW_KEYS=(served_window_raw_keys(2, is_kda, history, draft_tokens) if raw_keys is None
                                       else raw_keys), HR=history_rows),
        served_window_warps(history, draft_tokens, history_rows))
    block_v, num_warps, block_k, num_stages = tiling
    bv = min(block_v, V)
    pointers = dict(ring, v="bf16", o="bf16", h0_source=STATE[state_dtype], order="i32")
    fbv = served_fold_block_v(bv, num_warps, draft_tokens, is_kda, history, DTYPES[state_dtype])
    tile = dict(shared, V=V, BV=bv, BK=min(block_k or K, K), FBV=fbv,
                NP=max(16, 2 * tp), DOT=draft_tokens > 1 and bv >= 16, FOLD_FIRST=fused_fold, PDL=SERVED_PDL)
    out = {"window": window, "output": _ptxas_resources(replay_output_kernel, pointers, tile, num_warps, num_stages)}
    if one_launch:
        step = dict(tile, BETA_ACTIVATED=False, ROUND_BETA=not is_kda)
        out["one launch"] = _ptxas_resources(
            replay_step_kernel, dict(pointers, A_log="fp32", a="bf16", dt_bias="fp32", q="bf16", k="bf16", b="bf16"),
            {n: c for n, c in step.items() if n in replay_step_kernel.arg_names}, num_warps, num_stages)
    return out


def write_through_resources(family: str, state_dtype: str, history: int, draft: bool,
                            prefetch: bool = False) -> tuple[int, int]:
    """``(registers per thread, spill-store bytes)`` of the write-through kernel as served, a decode or (``draft``)
    a verify (bf16 activations; a GDN decode rounds beta as SGLang's packed decode, KDA's beta comes
    activated); ``prefetch``: a verify loading each draft token's inputs one step ahead (served for KDA)."""
    from sglang_ssm_modes.ops.replay.served import WRITE_THROUGH_V_MAJOR, write_through_block_v
    from sglang_ssm_modes.ops.replay.write_through import replay_write_through_kernel

    is_kda = family == "kda"
    pointers = dict(A_log="fp32", a="bf16", dt_bias="fp32", q="bf16", k="bf16", v="bf16", b="bf16", o="bf16",
                    h0_source=STATE[state_dtype], h0_indices="i32", r_u="fp32", r_kn="fp32", r_g="fp32",
                    r_beta="fp32", r_kraw="bf16", r_vraw="bf16", r_count="i32", r_phase="i32", r_folds="i32",
                    r_faults="i32", r_tickets="i32", rec_indices="i32")
    consts = dict(H=FAMILIES[family]["hk"], HV=FAMILIES[family]["hv"], K=K, V=V,
                  BV=min(write_through_block_v(is_kda, DTYPES[state_dtype], draft), V),
                  L=history, IS_KDA=is_kda, BETA_ACTIVATED=is_kda, ROUND_BETA=not (is_kda or draft),
                  V_MAJOR=WRITE_THROUGH_V_MAJOR, DRAFT=draft, PREFETCH=prefetch)
    return _ptxas_resources(replay_write_through_kernel, pointers, consts, num_warps=1, num_stages=3)


def verify_window_resources(family: str, state_dtype: str, draft_tokens: int, tree: bool, tile: tuple[int, int],
                            prefetch: bool) -> tuple[int, int]:
    """``(registers per thread, spill-store bytes)`` of compact's verify (``ops.verify_window``, writing records;
    native KDA's stores steps instead, same loop) at ``tile`` = ``(block_v, num_warps)``, a chain or a tree,
    loading each token's inputs at the top of its step or (``prefetch``) one step ahead."""
    import triton

    from sglang_ssm_modes.ops.verify_window import verify_window_kernel

    is_kda = family == "kda"
    pointers = dict(A_log="fp32", a="bf16", dt_bias="fp32", q="bf16", k="bf16", v="bf16", b="bf16", o="bf16",
                    h0_source=STATE[state_dtype], h0_indices="i32", cu_seqlens="i32", rec_k="bf16", rec_v="bf16",
                    rec_g="fp32", rec_beta="fp32", rec_indices="i32", steps=STATE[state_dtype], steps_indices="i32",
                    parents="i32")
    consts = dict(H=FAMILIES[family]["hk"], HV=FAMILIES[family]["hv"], K=K, V=V, BK=K, BV=tile[0], D=draft_tokens,
                  NP2_D=triton.next_power_of_2(draft_tokens), IS_KDA=is_kda, IS_VARLEN=False, IS_TREE=tree,
                  BETA_ACTIVATED=is_kda, WRITE_RECORDS=True, WRITE_STEPS=False, PREFETCH=prefetch)
    return _ptxas_resources(verify_window_kernel, pointers, consts, num_warps=tile[1], num_stages=3)


def parse_output_tilings(parser, values: list[str]) -> list[tuple[str, tuple]]:
    """``--tilings`` values as ``(name, (block_v, num_warps, block_k, num_stages))``; a bad value is a
    ``parser.error`` naming the rule."""
    from sglang_ssm_modes.ops.replay.served import NARROW_TILING, WIDE_TILING

    out = []
    for value in values:
        if value in ("narrow", "wide"):
            out.append((value, NARROW_TILING if value == "narrow" else WIDE_TILING))
            continue
        tiling, *opts = value.split(":")
        (bv, warps), = parse_tilings(parser, [tiling])
        block_k, stages = None, 2
        for opt in opts:
            if opt[:1] == "k" and opt[1:] in ("16", "32", "64", "128"):
                block_k = int(opt[1:])
            elif opt[:1] == "s" and opt[1:] in ("1", "2", "3", "4"):
                stages = int(opt[1:])
            else:
                parser.error(f"--tilings {value}: options are :kN (16, 32, 64, 128) and :sN (1-4)")
        out.append((value, (bv, warps, block_k, stages)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tilings", nargs="+", default=["narrow", "wide"], metavar="narrow|wide|BVxWARPS[:kN][:sN]",
                   help="output-kernel tilings: the served ones (ops.replay.served.NARROW_TILING, WIDE_TILING) or "
                        "V columns x warps per program, K rows per loop step (:k64; default all of K) and "
                        "pipeline depth (:s3; default 2)")
    p.add_argument("--histories", type=int, nargs="+", default=[16])
    p.add_argument("--families", nargs="+", default=["gdn"], choices=list(FAMILIES))
    p.add_argument("--state-dtypes", nargs="+", default=["float32"], choices=list(STATE))
    p.add_argument("--fold", nargs="+", default=["fused"], choices=["fused", "separate"])
    p.add_argument("--draft-tokens", type=int, default=4, help="window length D (1 = plain decode)")
    p.add_argument("--one-launch", action="store_true",
                   help="also the one-launch kernel (ops.replay.verify.replay_step_kernel) at each tiling")
    p.add_argument("--write-through", action="store_true",
                   help="also the write-through kernel (ops.replay.write_through): plain decode at --draft-tokens 1, "
                        "verify above")
    p.add_argument("--prefetch", action="store_true",
                   help="the verifies loading each token's inputs one step ahead (not served): the write-through "
                        "verify and, with --verify-window, compact's")
    p.add_argument("--window-keys", choices=["served", "raw", "normalised"], default="served",
                   help="the window kernel renormalising the history's raw keys (ops.replay.verify.history_keys) or "
                        "reading the normalised ones (default: ops.replay.served.served_window_raw_keys)")
    p.add_argument("--window-history-rows", type=int, choices=[0, 1, 2, 4, 8, 16],
                   help="the window kernel reading the history this many records a step after the window's tokens "
                        "(replay_verify's window_history_rows) or holding it whole (0); default: "
                        "ops.replay.served.served_window_history_rows, on its served warps")
    p.add_argument("--verify-window", nargs="*", metavar="BVxWARPS",
                   help="instead: compact's verify (ops.verify_window) at these tiles (none given: native's 32x1 and "
                        "ops.compact.FAST_VERIFY_TILE), chain and tree")
    args = p.parse_args(argv)
    tilings = parse_output_tilings(p, args.tilings)
    if any(L not in (8, 16, 32, 64) for L in args.histories):
        p.error("each history must be one of 8, 16, 32, 64")
    if not 1 <= args.draft_tokens <= min(args.histories):
        p.error(f"--draft-tokens must be between 1 and the smallest history ({min(args.histories)})")
    replay_only = [flag for flag, given in (("--window-keys", args.window_keys != "served"),
                                            ("--one-launch", args.one_launch), ("--write-through", args.write_through))
                   if given]
    if args.verify_window is not None and replay_only:
        p.error(f"{', '.join(replay_only)}: replay's kernels only; --verify-window reports compact's verify")
    if args.verify_window is not None:
        from sglang_ssm_modes.ops.compact import FAST_VERIFY_TILE
        from sglang_ssm_modes.ops.verify_window import native_tile

        tiles = parse_tilings(p, args.verify_window) if args.verify_window else [native_tile(V), FAST_VERIFY_TILE]
        print("| family | state | D | tile | chain regs / spills | tree regs / spills |\n|---|---|---|---|---|---|")
        for fam, dt, (bv, warps) in itertools.product(args.families, args.state_dtypes, tiles):
            res = [verify_window_resources(fam, dt, args.draft_tokens, tree, (bv, warps), args.prefetch)
                   for tree in (False, True)]
            print(f"| {fam} | {dt} | {args.draft_tokens} | {bv}x{warps}{' prefetch' if args.prefetch else ''} | "
                  + " | ".join(f"{r} / {sp}" for r, sp in res) + " |", flush=True)
        return 0
    kernels = ["window", "output"] + ["one-launch"] * args.one_launch + ["write-through"] * args.write_through
    print("| family | state | L | fold | output tiling | " + " | ".join(f"{k} kernel regs / spills" for k in kernels)
          + " |\n|---|---|---|---|---|" + "---|" * len(kernels))
    for fam, dt, L, fold, (name, tiling) in itertools.product(args.families, args.state_dtypes, args.histories,
                                                              args.fold, tilings):
        res = verify_kernel_resources(fam, dt, L, fold == "fused", tiling, args.draft_tokens, args.one_launch,
                                      {"served": None, "raw": True, "normalised": False}[args.window_keys],
                                      args.window_history_rows)
        if args.write_through:
            res["write-through"] = write_through_resources(fam, dt, L, args.draft_tokens > 1, args.prefetch)
        print(f"| {fam} | {dt} | {L} | {fold} | {name} | " + " | ".join(f"{r} / {s}" for r, s in res.values()) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
