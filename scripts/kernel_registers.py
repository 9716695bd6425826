"""Registers and spills per thread of the replay verify kernel, compiled for an H100/H200 (sm_90a) on
any machine, GPU or not: Triton compiles the kernel to PTX and the ``ptxas`` shipped in Triton's wheel
reports what it allocates. A CPU-side loop for kernel work between GPU sessions (the GPU bench reports
the same figures from the loaded kernels: ``bench_replay.py``'s ``verify kernel`` column; Triton
versions differ between machines, so compare variants within one run, not across machines).

    python scripts/kernel_registers.py [--tilings 128x4 32x4] [--histories 16 64] [--families gdn kda]
        [--state-dtypes float32 bfloat16] [--fold fused separate]

Prints a Markdown table (``family, state, L, fold, tiling, registers, spill bytes``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

from bench_common import FAMILIES, K, V, parse_tilings

STATE = {"float32": "fp32", "bfloat16": "bf16"}


def verify_kernel_resources(family: str, state_dtype: str, history: int, fused_fold: bool, block_v: int,
                            num_warps: int) -> tuple[int, int]:
    """``(registers per thread, spill-store bytes)`` of ``replay_verify_kernel`` for one variant (the
    served constants: bf16 activations, ROUND_BETA for GDN as in decode)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_ssm_modes.ops.replay.verify import replay_verify_kernel as kernel

    is_kda = family == "kda"
    pointers = dict(A_log="fp32", a="bf16", dt_bias="fp32", q="bf16", k="bf16", v="bf16", b="bf16", o="bf16",
                    h0_source=STATE[state_dtype], h0_indices="i32", r_u="fp32", r_kn="fp32", r_g="fp32", r_beta="fp32",
                    r_kraw="bf16", r_vraw="bf16", r_count="i32", r_phase="i32", rec_indices="i32")
    consts = dict(H=FAMILIES[family]["hk"], HV=FAMILIES[family]["hv"], K=K, V=V, BK=K, BV=min(block_v, V),
                  L=history, IS_KDA=is_kda, BETA_ACTIVATED=False, ROUND_BETA=not is_kda, FUSED_FOLD=fused_fold)
    floats = ("softplus_beta", "softplus_threshold", "scale")
    names = kernel.arg_names
    signature = {n: "*" + pointers[n] if n in pointers else "constexpr" if n in consts else
                 "fp32" if n in floats else "i32" for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=2))
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tilings", nargs="+", default=["128x4", "32x4"], metavar="BVxWARPS")
    p.add_argument("--histories", type=int, nargs="+", default=[16])
    p.add_argument("--families", nargs="+", default=["gdn"], choices=list(FAMILIES))
    p.add_argument("--state-dtypes", nargs="+", default=["float32"], choices=list(STATE))
    p.add_argument("--fold", nargs="+", default=["fused"], choices=["fused", "separate"])
    args = p.parse_args(argv)
    tilings = parse_tilings(p, args.tilings)
    if any(L not in (8, 16, 32, 64) for L in args.histories):
        p.error("each history must be one of 8, 16, 32, 64")
    print("| family | state | L | fold | tiling | registers | spill bytes |\n|---|---|---|---|---|---|---|")
    for fam, dt, L, fold, (bv, w) in itertools.product(args.families, args.state_dtypes, args.histories, args.fold,
                                                       tilings):
        regs, spills = verify_kernel_resources(fam, dt, L, fold == "fused", bv, w)
        print(f"| {fam} | {dt} | {L} | {fold} | {bv}x{w} | {regs} | {spills} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
