"""Replay's bfloat16-state drift against native over a long decode, on the GPU (issue #4: ≥ 10 000 tokens).

    python scripts/replay_drift.py --out OUT [--tokens 10000] [--history 16] [--families gdn kda]

The same random decode tokens (Qwen3-Next / Kimi-Linear head shapes, a few requests) go through three
states side by side in one run: SGLang 0.5.14's packed decode kernel with a float32 state (the
reference), the same kernel with a bfloat16 state (native bf16: rounds after every token), and replay's
output-only path with a bfloat16 checkpoint (rounds once per fold; the fold is fused into the decode launch
— the rounding of replay's speculative rounds and of its output-only decode, served for a 2-byte state from
128 requests per step at L <= 16; below that, and at longer histories, a served plain decode writes through,
rounding after every token as native does, ``ops.replay.decode``). Every
``--every`` tokens the canonical states are compared with the reference: relative error = max |x - ref|
/ max |ref| over all requests and heads. Writes ``replay_drift.json`` (``gpu``, ``date``, ``commit``,
``rows``: family, tokens, impl, rel_err), ``replay_drift.md`` and ``replay_drift.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

from bench_common import FAMILIES, K, V, make_inputs

BANK = 64  # distinct random tokens, cycled


def drift(family: str, tokens: int, history: int, batch: int, every: int, seed: int) -> list[dict]:
    from sglang.srt.layers.attention.fla.fused_recurrent import (
        fused_recurrent_gated_delta_rule_packed_decode, fused_recurrent_kda_packed_decode)

    from sglang_ssm_modes.ops.replay import ReplayRing, advance, replay_fold, replay_verify

    is_kda = family == "kda"
    hk, hv = FAMILIES[family]["hk"], FAMILIES[family]["hv"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bank = [make_inputs(family, batch, 1, torch.bfloat16, gen) for _ in range(BANK)]
    A_log, dt_bias = bank[0]["A_log"], bank[0]["dt_bias"]
    start = 0.1 * torch.randn(batch, hv, V, K, generator=gen, device="cuda")
    ref, nat = start.clone(), start.to(torch.bfloat16)
    rep = start.to(torch.bfloat16)
    idx = torch.arange(batch, dtype=torch.int32, device="cuda")
    ring = ReplayRing.allocate(batch, history, hk, hv, K, V, is_kda, torch.bfloat16, "cuda")
    decode = fused_recurrent_kda_packed_decode if is_kda else fused_recurrent_gated_delta_rule_packed_decode
    out = torch.empty(batch, 1, hv, V, dtype=torch.bfloat16, device="cuda")
    canon = torch.empty_like(rep)
    everyone = torch.ones(batch, dtype=torch.bool, device="cuda")
    rows = []
    for t in range(1, tokens + 1):
        x = bank[t % BANK]
        mixed = torch.cat([x["q"].flatten(2), x["k"].flatten(2), x["v"].flatten(2)], -1)[0]
        for state in (ref, nat):
            decode(mixed_qkv=mixed, a=x["a"].reshape(batch, -1), b=x["b"].reshape(batch, -1), A_log=A_log,
                   dt_bias=dt_bias, scale=K ** -0.5, initial_state=state, out=out, ssm_state_indices=idx,
                   use_qk_l2norm_in_kernel=True)
        replay_verify(A_log, x["a"], dt_bias, x["q"], x["k"], x["v"], x["b"], rep, idx, ring, idx, is_kda=is_kda,
                      round_beta=not is_kda)
        advance(ring, idx, 1, window=1)
        if t % every == 0 or t == tokens:
            replay_fold(rep, idx, ring, idx, everyone, is_kda=is_kda, dst=canon, dst_indices=idx)
            scale = ref.abs().max().item()
            for impl, state in (("sglang-0.5.14-native-bf16", nat), ("ours-replay-bf16", canon)):
                err = (state.float() - ref).abs().max().item() / scale
                if not err < float("inf"):
                    raise RuntimeError(f"{family} {impl}: non-finite state after {t} tokens")
                rows.append(dict(family=family, tokens=t, impl=impl, history=history, rel_err=err))
    return rows


def write_report(result: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "replay_drift.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# bfloat16 state drift vs a float32 reference — {result['gpu']}, {result['date']}, commit "
             f"{result['commit']}", "", "Relative error = max |state - ref| / max |ref| (float32-state native decode "
             "as the reference; replay's canonical state materialised).", "",
             "| family | tokens | native bf16 | replay bf16 |", "|---|---|---|---|"]
    by = {}
    for r in result["rows"]:
        by.setdefault((r["family"], r["tokens"]), {})[r["impl"]] = r["rel_err"]
    for (family, tokens), errs in sorted(by.items()):
        lines.append(f"| {family} | {tokens} | {errs['sglang-0.5.14-native-bf16']:.3g} | "
                     f"{errs['ours-replay-bf16']:.3g} |")
    with open(os.path.join(out, "replay_drift.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({r["family"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(families), figsize=(5 * len(families), 3.6), squeeze=False)
    for ax, family in zip(axes[0], families):
        for impl in ("sglang-0.5.14-native-bf16", "ours-replay-bf16"):
            pts = [(r["tokens"], r["rel_err"]) for r in result["rows"] if r["family"] == family and r["impl"] == impl]
            ax.plot(*zip(*pts), marker=".", label=impl)
        ax.set_title(family)
        ax.set_xlabel("decode tokens")
        ax.set_ylabel("relative error vs float32")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "replay_drift.png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--history", type=int, default=16, choices=(8, 16, 32, 64))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--every", type=int, default=500, help="compare every N tokens")
    p.add_argument("--families", nargs="+", default=["gdn", "kda"], choices=list(FAMILIES))
    p.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    args = p.parse_args(argv)
    if min(args.tokens, args.batch, args.every) < 1:
        p.error("--tokens, --batch and --every must be >= 1")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    from tqdm import tqdm

    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=args.commit,
                  rows=[])
    for family in tqdm(args.families, desc="replay drift"):
        result["rows"] += drift(family, args.tokens, args.history, args.batch, args.every, seed=7)
    write_report(result, args.out)
    print(open(os.path.join(args.out, "replay_drift.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
