"""Shared pieces of the GPU benchmarks: shapes, the copy-bandwidth ceiling, random inputs and
CUDA-graph timing over rotating state slots."""

from __future__ import annotations

import statistics

import torch

FAMILIES = {"gdn": dict(hk=16, hv=32, layers=36), "kda": dict(hk=32, hv=32, layers=20)}
"""Qwen3-Next-80B / Kimi-Linear-48B at TP 1: key and value heads, linear layers (``sizing.BUILTIN_SHAPES``)."""
K = V = 128
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TARGET_BYTES = 1 << 30  # rotate over about 1 GiB of state so L2 (50 MB) never holds it


def copy_bandwidth_gbps() -> float:
    """Device copy bandwidth (read + write bytes per second) of a 2 GiB device-to-device copy."""
    src = torch.empty(1 << 29, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); dst.copy_(src); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def make_inputs(family, batch, d, act, gen):
    hk, hv = FAMILIES[family]["hk"], FAMILIES[family]["hv"]
    t = batch * d

    def rn(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(act)

    a = rn(t, hv * K) if family == "kda" else rn(t, hv)
    A_log = torch.log(torch.empty(hv, device="cuda").uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(hv * K if family == "kda" else hv, generator=gen, device="cuda") * 0.1 - 4
    return dict(q=rn(1, t, hk, K), k=rn(1, t, hk, K), v=rn(1, t, hv, V), a=a, b=rn(1, t, hv), A_log=A_log,
                dt_bias=dt_bias)


def time_graph(fn, rounds: int, repeats: int = 20) -> float:
    """Median µs per round of ``fn(r)`` for r in 0..rounds-1, captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for r in range(rounds):
            fn(r)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(rounds):
            fn(r)
    g.replay(); torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / rounds)
    return statistics.median(times)


def kernel_times(fn, rounds: int, names: dict) -> dict:
    """Device µs per round of each kernel ``fn(r)`` launches (r in 0..rounds-1, eager, after one warm-up
    pass), read from the CUDA profiler: ``{label: µs}`` for each kernel whose name contains a key of
    ``names`` (``{substring: label}``; others are summed under ``"other"``)."""
    from torch.profiler import ProfilerActivity, profile

    for r in range(rounds):
        fn(r)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for r in range(rounds):
            fn(r)
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if not us or ev.key.startswith(("cuda", "Memcpy", "Memset")) and "kernel" not in ev.key.lower():
            continue
        label = next((lab for sub, lab in names.items() if sub in ev.key), "other")
        out[label] = round(out.get(label, 0.0) + us / rounds, 2)
    return out


def parse_tilings(parser, values: list[str]) -> list[tuple[int, int]]:
    """``--tilings`` values ``BLOCKVxWARPS`` (e.g. ``128x4``) as ``(block_v, num_warps)`` pairs; a bad
    value is a ``parser.error`` naming the rule."""
    try:
        tilings = [tuple(int(x) for x in t.split("x")) for t in values]
    except ValueError:
        parser.error(f"--tilings {' '.join(values)}: each is BLOCKVxWARPS, e.g. 128x4")
    if any(len(t) != 2 or t[0] < 1 or t[0] & (t[0] - 1) or t[1] not in (1, 2, 4, 8, 16) for t in tilings):
        parser.error(f"--tilings {' '.join(values)}: block_v a power of two, warps one of 1, 2, 4, 8, 16")
    return tilings


def compiled_resources(jit_fns: dict, fn) -> str:
    """Call ``fn()`` once and name the registers and spills per thread of the variants of each of
    ``jit_fns`` (``{label: Triton JIT function}``) it compiled (``"<label> <regs> regs, <spills> spills"``;
    ``""`` when it compiled none: an earlier call did). Triton reads both from ``ptxas`` when a kernel is
    loaded; spills mean local-memory traffic."""
    def variants(jit_fn):
        caches = getattr(jit_fn, "device_caches", {})  # Triton >= 3.2
        return [k for cache, *_ in caches.values() for k in cache.values()]

    before = {label: {id(k) for k in variants(j)} for label, j in jit_fns.items()}
    fn()
    torch.cuda.synchronize()
    return "; ".join(f"{label} {getattr(k, 'n_regs', '?')} regs, {getattr(k, 'n_spills', '?')} spills"
                     for label, j in jit_fns.items() for k in variants(j) if id(k) not in before[label])


def plot_speedups(points: dict, title: str, path: str) -> None:
    """One panel per family of native / ours speedup against batch (log2 x axis), a line per series.
    ``points``: ``{family: {series label: [(batch, speedup), ...]}}``. Writes a PNG to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted(points)
    fig, axes = plt.subplots(1, len(families), figsize=(5.5 * len(families), 4), sharey=True, squeeze=False)
    for ax, fam in zip(axes[0], families):
        for label, pts in sorted(points[fam].items()):
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{fam.upper()} {title}")
        ax.set_xlabel("batch")
        ax.legend(fontsize=6)  # each panel its own: families may have different series
    axes[0][0].set_ylabel("speedup (×)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
