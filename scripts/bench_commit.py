"""Benchmark: the commit after a speculative verify — the one step of a speculative round SGLang runs eagerly,
outside its CUDA graphs — per mode, side by side in one run on one GPU, at a real model's depth.

Each mode's ``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`` as a server calls it (through the
plugin's hook on SGLang 0.5.14's real backend classes and ``HybridReqToTokenPool``): native = SGLang's state and
conv-window scatters; compact = the conv scatters + :class:`~sglang_ssm_modes.acceptance.StateAcceptance`'s
re-run of the accepted prefix; replay = the conv scatters + its cursor advance (chain verify). With ``track``,
the radix cache's extra_buffer snapshot of every request is committed too (SGLang passes track indices on every
step under that strategy; a snapshot is due only where a request crosses the track interval: ``steps`` -1
elsewhere, here one request in four).

Per call, in a loop with nothing else queued: ``host_us`` — CPU time to issue it (what a server whose GPU is
waiting pays per step), ``span_us`` — the stream's time from before its first launch to after its last (device
work and any gap the host leaves), and from the CUDA profiler the kernels it launched. Replay's rings are
emptied between calls (not timed) so cursors stay in range.

Usage (GPU): python3 scripts/bench_commit.py --out DIR [--layers 36] [--batches 1 8 32 64] [--families gdn kda]
Writes DIR/commit_h200.json, .md and .png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from tqdm import tqdm

from bench_common import DTYPES, FAMILIES, K, V

MODES = ("native", "compact", "replay")


def cache_params(family: str, layers: int, state_dtype: torch.dtype):
    """SGLang's cache parameters of ``layers`` linear layers at the family's TP-1 heads (bench_common)."""
    from sglang.srt.configs.mamba_utils import (KimiLinearCacheParams, KimiLinearStateShape, Mamba2CacheParams,
                                                Mamba2StateDType, Mamba2StateShape)

    hk, hv = FAMILIES[family]["hk"], FAMILIES[family]["hv"]
    dtypes = Mamba2StateDType(conv=torch.bfloat16, temporal=state_dtype)
    if family == "kda":
        shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=hv, head_dim=K, conv_kernel_size=4)
        return KimiLinearCacheParams(shape=shape, layers=list(range(layers)), dtype=dtypes)
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=hv * V, n_groups=hk, num_heads=hv,
                                    head_dim=V, state_size=K, conv_kernel=4)
    return Mamba2CacheParams(shape=shape, layers=list(range(layers)), dtype=dtypes)


def build(mode: str, family: str, layers: int, batch: int, draft: int, history: int, state_dtype: torch.dtype):
    """``(hybrid backend, pool)``: SGLang's request pool built through the plugin's pool hook in ``mode``,
    with ``2 * batch + 1`` state slots (the batch's and as many snapshot slots), and its backends."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
    from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from sglang_ssm_modes.config import SSMModeConfig
    from sglang_ssm_modes.pool.mode_pool import init_mode_mamba_pool

    cfg = SSMModeConfig(mode=mode, draft_tokens=draft, replay_history=history)
    original = HybridReqToTokenPool._init_mamba_pool
    HybridReqToTokenPool._init_mamba_pool = lambda self, **kw: init_mode_mamba_pool(original, self, cfg, **kw)
    try:
        pool = HybridReqToTokenPool(
            size=batch + 1, mamba_size=2 * batch + 1, mamba_spec_state_size=batch, max_context_len=16, device="cuda",
            enable_memory_saver=False, cache_params=cache_params(family, layers, state_dtype),
            mamba_layer_ids=list(range(layers)), enable_mamba_extra_buffer=False,
            speculative_num_draft_tokens=draft, speculative_eagle_topk=1, enable_overlap_schedule=False)
    finally:
        HybridReqToTokenPool._init_mamba_pool = original
    runner = SimpleNamespace(device="cuda", server_args=SimpleNamespace(speculative_eagle_topk=1),
                             is_draft_worker=False, req_to_token_pool=pool, token_to_kv_pool=None)
    linear = (KDAAttnBackend if family == "kda" else GDNAttnBackend)(runner)
    hybrid = HybridLinearAttnBackend(SimpleNamespace(token_to_kv_pool=None, req_to_token_pool=pool,
                                                     needs_cpu_seq_lens=False), linear, [])
    return hybrid, pool.mamba_pool


def bench_case(mode, family, layers, batch, draft, history, state_dtype, track, iters):
    """One mode's commit at one batch: ``host_us`` / ``span_us`` medians over ``iters`` calls, the kernels one
    call launches (CUDA profiler) and the path it took."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata
    from torch.profiler import ProfilerActivity, profile

    from sglang_ssm_modes.integration import backend_hooks

    hybrid, pool = build(mode, family, layers, batch, draft, history, state_dtype)
    gen = torch.Generator(device="cuda").manual_seed(batch)
    slots = torch.arange(1, batch + 1, dtype=torch.int32, device="cuda")
    hybrid.linear_attn_backend.forward_metadata = ForwardMetadata(
        query_start_loc=torch.arange(0, batch * draft + 1, draft, dtype=torch.int32, device="cuda"),
        mamba_cache_indices=slots, is_target_verify=True, draft_token_num=draft)
    last = torch.randint(-1, draft, (batch,), generator=gen, device="cuda")
    track_idx = steps = None
    if track:
        track_idx = slots + batch
        steps = torch.where(torch.arange(batch, device="cuda") % 4 == 0,
                            torch.randint(0, draft, (batch,), generator=gen, device="cuda"), -1)

    def call():
        backend_hooks.update_mamba_state_after_mtp_verify(HybridLinearAttnBackend.update_mamba_state_after_mtp_verify,
                                                          hybrid, last, track_idx, steps, None)

    def reset():
        if pool.replay_rings is not None:
            pool.clear_history(slots)

    for _ in range(3):
        reset(); call()
    torch.cuda.synchronize()
    host, span = [], []
    for _ in range(iters):
        reset()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e6)
        b.record(); b.synchronize()
        span.append(a.elapsed_time(b) * 1e3)
    reset(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = sorted({_kernel_name(ev.key) for ev in prof.key_averages() if ev.device_type.name == "CUDA"})
    launches = sum(ev.count for ev in prof.key_averages() if ev.device_type.name == "CUDA")
    path = {"native": "sglang scatters", "compact": "conv scatters + compact_commit (all layers)",
            "replay": "conv scatters + cursor advance (all layers)"}[mode]
    if track:
        path += " + snapshots"
    del hybrid, pool
    torch.cuda.empty_cache()
    return dict(host_us=round(statistics.median(host), 1), span_us=round(statistics.median(span), 1),
                launches=launches, kernels=kernels, path=path)


def _kernel_name(key: str) -> str:
    """A profiler kernel name without its template and argument lists (``at::native::where_kernel_impl``)."""
    return re.split(r"[<(]", key.removeprefix("void "))[0] or key


def write_report(out: str, meta: dict, rows: list[dict]) -> None:
    """``commit_h200.{json,md,png}`` under ``out`` (named as the project's other results whatever the card:
    ``gpu`` in the JSON names it): the rows, a table with each mode's span against native's, a plot."""
    with open(os.path.join(out, "commit_h200.json"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    lines = [f"# Commit after a speculative verify, per step — {meta['gpu']}, commit {meta['commit']}, "
             f"{meta['date']}",
             "", f"{meta['layers']} linear layers, D = {meta['draft_tokens']}, {meta['state_dtype']} state, replay "
             f"L = {meta['history']}. host = CPU µs to issue; span = stream µs; launches = kernels per call.", "",
             "| family | track | batch | mode | host µs | span µs | launches | span / native |",
             "|---|---|---|---|---|---|---|---|"]
    base = {(r["family"], r["track"], r["batch"]): r["span_us"] for r in rows if r["mode"] == "native"}
    for r in rows:
        ratio = r["span_us"] / base[(r["family"], r["track"], r["batch"])]
        lines.append(f"| {r['family']} | {r['track']} | {r['batch']} | {r['mode']} | {r['host_us']} | "
                     f"{r['span_us']} | {r['launches']} | {ratio:.2f} |")
    with open(os.path.join(out, "commit_h200.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["family"], r["track"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.8), sharey=True, squeeze=False)
    for ax, (fam, tr) in zip(axes[0], keys):
        for mode in MODES:
            pts = sorted((r["batch"], r["span_us"]) for r in rows
                         if (r["family"], r["track"], r["mode"]) == (fam, tr, mode))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{fam.upper()} commit{' + track' if tr else ''}")
        ax.set_xlabel("batch")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("µs per step (stream span)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "commit_h200.png"), dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=36, help="linear layers (Qwen3-Next-80B: 36, Kimi-Linear-48B: 20)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--families", nargs="+", default=["gdn", "kda"], choices=list(FAMILIES))
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--history", type=int, default=16, choices=(8, 16, 32, 64))
    p.add_argument("--state-dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--track", choices=("both", "on", "off"), default="both")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    args = p.parse_args(argv)
    if args.layers < 1 or args.iters < 1 or args.draft_tokens < 2 or min(args.batches) < 1:
        p.error("--layers, --iters and --batches at least 1, --draft-tokens at least 2 (a speculative window)")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the commit's SGLang scatters are CUDA kernels)")
    os.makedirs(args.out, exist_ok=True)
    tracks = {"both": [False, True], "on": [True], "off": [False]}[args.track]
    cases = [(f, t, b, m) for f in args.families for t in tracks for b in args.batches for m in MODES]
    rows = []
    for fam, tr, batch, mode in tqdm(cases, desc="commit", file=sys.stdout):
        res = bench_case(mode, fam, args.layers, batch, args.draft_tokens, args.history, DTYPES[args.state_dtype],
                         tr, args.iters)
        rows.append(dict(op="commit", family=fam, mode=mode, impl="sglang-0.5.14-native" if mode == "native" else
                         f"ours-{mode}", state_dtype=args.state_dtype, batch=batch, draft_tokens=args.draft_tokens,
                         track=tr, **res))
        print(json.dumps(rows[-1]), flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=args.commit,
                layers=args.layers, draft_tokens=args.draft_tokens, history=args.history, state_dtype=args.state_dtype)
    write_report(args.out, meta, rows)
    print(open(os.path.join(args.out, "commit_h200.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
