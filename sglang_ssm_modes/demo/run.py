"""``make demo``: a speculative-decoding loop over a tiny hybrid stack in all three modes, checked
against native every round; then the memory table of a released model.

Per round every request verifies a window of D tokens (its base token plus D - 1 drafts), a random
number of them is accepted (1..D), padding rows (HOLD, slot -1) accept nothing, and every mode commits.
Compact must match native bit for bit (same arithmetic, same rounding); replay within float32
tolerance (it rounds once per fold instead of once per round). Padding rows must never change.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .layer_state import make_layer_state
from .stack import StackConfig, TinyHybridStack

MODES = ("native", "compact", "replay")
REPLAY_RTOL = 1e-5  # float32 state and activations: replay's fold rounds once per L tokens, native every round


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def run_demo(rounds: int, draft_tokens: int, history: int, batch: int, padding_rows: int, seed: int) -> dict:
    """Run the loop; returns per-mode results ``{mode: {max_logit_rel, max_state_rel, bitwise, folds}}``."""
    stack = TinyHybridStack(StackConfig(), seed)
    n = batch + padding_rows
    init = stack.initial_states(n, seed + 1, torch.float32)
    states = {m: [make_layer_state(m, s, lw.gate, history) for s, lw in zip(init, stack.layers)] for m in MODES}
    g = torch.Generator().manual_seed(seed + 2)
    base = torch.randint(0, stack.cfg.vocab, (n,), generator=g)
    results = {m: {"max_logit_rel": 0.0, "max_state_rel": 0.0, "bitwise": True, "folds": 0} for m in MODES}
    for _ in range(rounds):
        drafts = torch.randint(0, stack.cfg.vocab, (n, draft_tokens - 1), generator=g)
        window = torch.cat([base[:, None], drafts], 1)
        window[batch:] = 0
        last = torch.randint(0, draft_tokens, (n,), generator=g)
        last[batch:] = -1
        logits = {m: stack.forward(window, states[m]) for m in MODES}
        for m in MODES:
            for st in states[m]:
                st.accept(last)
        for m in MODES[1:]:
            r = results[m]
            r["max_logit_rel"] = max(r["max_logit_rel"], _rel(logits[m][:batch], logits["native"][:batch]))
            for ref, st in zip(states["native"], states[m]):
                got, want = st.committed(), ref.committed()
                r["max_state_rel"] = max(r["max_state_rel"], _rel(got, want))
                r["bitwise"] &= torch.equal(got, want)
        # padding rows keep the state they started with, in every mode
        for m in MODES:
            for s0, st in zip(init, states[m]):
                if not torch.equal(st.committed()[batch:], s0[batch:]):
                    raise AssertionError(f"{m}: a padding row's state changed")
        # the bonus token after the last accepted position is the next round's base token (greedy)
        base = logits["native"][torch.arange(n), last.clamp_min(0)].argmax(-1)
    for m in MODES:
        results[m]["folds"] = sum(getattr(st, "folds", 0) for st in states[m])
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_ssm_modes demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--draft-tokens", type=int, default=4, help="verify width D (base token included)")
    p.add_argument("--replay-history", type=int, default=8, help="replay history L (L >= D)")
    p.add_argument("--batch", type=int, default=5, help="real requests")
    p.add_argument("--padding-rows", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="qwen3-next-80b", help="model for the memory table")
    args = p.parse_args(argv)
    if args.draft_tokens < 1 or args.rounds < 1 or args.batch < 1 or args.padding_rows < 0:
        p.error("--draft-tokens, --rounds and --batch must be >= 1 and --padding-rows >= 0")
    if args.replay_history < args.draft_tokens:
        p.error(f"--replay-history {args.replay_history} < --draft-tokens {args.draft_tokens}: replay needs L >= D")

    t0 = time.time()
    res = run_demo(args.rounds, args.draft_tokens, args.replay_history, args.batch, args.padding_rows, args.seed)
    print(f"tiny hybrid stack {StackConfig().layers}, {args.batch} requests + {args.padding_rows} padding rows, "
          f"{args.rounds} rounds, D={args.draft_tokens}, replay L={args.replay_history} ({time.time() - t0:.1f}s)")
    print(f"{'mode':8} {'max rel dlogits':>16} {'max rel dstate':>15} {'bit-identical':>14} {'folds':>6}  verdict")
    failed = False
    for m in MODES[1:]:
        r = res[m]
        ok = r["bitwise"] if m == "compact" else (r["max_logit_rel"] < REPLAY_RTOL and r["max_state_rel"] < REPLAY_RTOL)
        failed |= not ok
        print(f"{m:8} {r['max_logit_rel']:16.2e} {r['max_state_rel']:15.2e} {str(r['bitwise']):>14} {r['folds']:6d}  "
              f"{'OK' if ok else 'DISAGREES WITH NATIVE'}")
    print()
    from ..sizing.cli import main as memory_main

    memory_main(["--model", args.model, "--draft-tokens", str(args.draft_tokens)])
    if failed:
        print("demo FAILED: a mode disagrees with native", file=sys.stderr)
        return 1
    return 0
