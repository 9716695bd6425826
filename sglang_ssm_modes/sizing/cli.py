"""``python -m sglang_ssm_modes memory``: bytes per request and max running requests, per mode."""

from __future__ import annotations

import argparse
import json
import sys

from ..config import DTYPES, REPLAY_HISTORIES, SSMModeConfig, SSMModeConfigError
from .bytes import ModeBytes, request_bytes
from .capacity import fit_pool, sglang_native_charge
from .shapes import BUILTIN_SHAPES, ShapeError, resolve_model

MIB = 1 << 20
GIB = 1 << 30


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def _history(text: str) -> int:
    value = _positive_int(text)
    if value not in REPLAY_HISTORIES:
        raise argparse.ArgumentTypeError(
            f"{value} is not a supported replay history; choose from "
            + ", ".join(str(x) for x in REPLAY_HISTORIES)
        )
    return value


def configure_memory_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``memory`` command's arguments to ``parser``."""
    parser.add_argument(
        "--model", default="qwen3-next-80b", metavar="{" + ",".join(BUILTIN_SHAPES) + ",PATH}",
        help="a built-in released model, or a config.json (or the directory holding it); "
             "default: %(default)s")
    parser.add_argument("--draft-tokens", type=_positive_int, default=4, metavar="D",
                        help="--speculative-num-draft-tokens, base token included; 1 = no "
                             "speculation (default: %(default)s)")
    parser.add_argument("--state-dtype", choices=list(DTYPES), default=None,
                        help="--mamba-ssm-dtype (default: what SGLang picks for the model — the "
                             "config's mamba_ssm_dtype or SGLANG_MAMBA_SSM_DTYPE, else float32)")
    parser.add_argument("--activation-dtype", choices=list(DTYPES), default="bfloat16",
                        help="dtype of recorded raw k / v (the model dtype; default: %(default)s)")
    parser.add_argument("--conv-dtype", choices=list(DTYPES), default=None,
                        help="conv-window dtype (default: SGLang's, SGLANG_MAMBA_CONV_DTYPE or "
                             "bfloat16)")
    parser.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                        help="attention tensor-parallel size; heads are split as SGLang splits "
                             "them (default: %(default)s)")
    parser.add_argument("--pool-gib", type=_positive_float, default=20.0, metavar="G",
                        help="mamba pool budget per GPU in GiB (default: %(default)s)")
    parser.add_argument("--replay-history", type=_history, nargs="+", default=[16, 32, 64],
                        metavar="L", help="replay history lengths to show (default: 16 32 64)")
    parser.add_argument("--eagle-topk", type=_positive_int, default=1, metavar="K",
                        help="--speculative-eagle-topk; > 1 makes native's conv scratch dense "
                             "(default: %(default)s)")
    parser.add_argument("--mamba-ratio", type=_positive_int, default=1, metavar="R",
                        help="pool slots per running request, as SGLang's _calculate_mamba_ratio: "
                             "1 = --disable-radix-cache (max running = floor(budget / bytes per "
                             "request)), 3 = radix cache no_buffer, 5 = extra_buffer with overlap "
                             "(default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return parser


def add_memory_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``memory`` sub-command on an ``argparse`` sub-parsers object."""
    parser = subparsers.add_parser(
        "memory",
        help="bytes per request and max running requests for each state mode",
        description="Per-request memory of the native, compact and replay state modes for a "
                    "hybrid GDN / KDA model, and how many running requests a pool budget holds.",
    )
    configure_memory_parser(parser)
    parser.set_defaults(func=run_memory)
    return parser


def _row(mode: str, history: int | None, cost: ModeBytes, budget: int, ratio: int) -> dict:
    fit = fit_pool(budget, cost, ratio=ratio)
    return {
        "mode": mode,
        "replay_history": history,
        "state_bytes": cost.state,
        "scratch_bytes": cost.scratch,
        "history_bytes": cost.history,
        "conv_bytes": cost.conv + cost.conv_scratch,
        "total_bytes": cost.total,
        "slot_bytes": cost.slot_bytes,
        "running_only_bytes": cost.running_bytes,
        "mamba_cache_size": fit.mamba_cache_size,
        "max_running_requests": fit.max_running_requests,
    }


def compute_memory_report(args: argparse.Namespace) -> dict:
    """The report ``run_memory`` prints, as a dict (raises SSMModeConfigError / ShapeError)."""
    resolved = resolve_model(args.model)
    shape = resolved.shape
    state_dtype = args.state_dtype or resolved.state_dtype
    conv_dtype = DTYPES[args.conv_dtype or resolved.conv_dtype]
    budget = int(args.pool_gib * GIB)
    d = args.draft_tokens
    common = dict(draft_tokens=d, state_dtype=state_dtype, activation_dtype=args.activation_dtype,
                  tree_verify=d > 1 and args.eagle_topk > 1)
    configs = [("native", None, SSMModeConfig(mode="native", **common)),
               ("compact", None, SSMModeConfig(mode="compact", **common))]
    for length in args.replay_history:
        configs.append(("replay", length,
                        SSMModeConfig(mode="replay", replay_history=length, **common)))
    rows = []
    for mode, length, cfg in configs:
        cost = request_bytes(shape, cfg, tp=args.tp, conv_dtype=conv_dtype,
                             eagle_topk=args.eagle_topk)
        rows.append(_row(mode, length, cost, budget, args.mamba_ratio))
    native = rows[0]
    for row in rows:
        row["bytes_vs_native"] = row["total_bytes"] / native["total_bytes"]
        n = native["max_running_requests"]
        row["capacity_vs_native"] = row["max_running_requests"] / n if n else None

    plain = request_bytes(shape, SSMModeConfig(mode="native", draft_tokens=1,
                                               state_dtype=state_dtype),
                          tp=args.tp, conv_dtype=conv_dtype)
    charge = sglang_native_charge(plain.total, d)
    sg_fit = fit_pool(budget, charge, ratio=args.mamba_ratio)
    return {
        "model": shape.label,
        "source": shape.source,
        "shape": {
            "family": shape.family,
            "num_linear_layers": shape.num_linear_layers,
            "num_v_heads": shape.num_v_heads,
            "num_k_heads": shape.num_k_heads,
            "head_k_dim": shape.head_k_dim,
            "head_v_dim": shape.head_v_dim,
            "conv_kernel": shape.conv_kernel,
            "hidden_size": shape.hidden_size,
        },
        "tp": args.tp,
        "draft_tokens": d,
        "eagle_topk": args.eagle_topk,
        "state_dtype": state_dtype,
        "activation_dtype": args.activation_dtype,
        "conv_dtype": str(conv_dtype).removeprefix("torch."),
        "pool_bytes": budget,
        "mamba_ratio": args.mamba_ratio,
        "rows": rows,
        "sglang_native_accounting": {
            "mamba_cache_per_req": plain.total,
            "charged_bytes_per_request": charge.total,
            "max_running_requests": sg_fit.max_running_requests,
        },
    }


def _format(report: dict) -> str:
    s = report["shape"]
    lines = [
        f"model: {report['model']}  ({s['family'].upper()}, {s['num_linear_layers']} linear layers, "
        f"HV {s['num_v_heads']}, HK {s['num_k_heads']}, K {s['head_k_dim']}, V {s['head_v_dim']}, "
        f"conv kernel {s['conv_kernel']})",
        f"shape from: {report['source']}",
        f"TP {report['tp']} (per-GPU figures), D = {report['draft_tokens']}, state "
        f"{report['state_dtype']}, activations {report['activation_dtype']}, conv "
        f"{report['conv_dtype']}, pool {report['pool_bytes'] / GIB:g} GiB, "
        f"{report['mamba_ratio']} slot(s) per running request",
        "",
    ]
    header = ("mode", "L", "state MiB/req", "records/scratch MiB/req", "conv MiB/req",
              "total MiB/req", "max running", "bytes vs native", "capacity vs native")
    table = [header]
    for r in report["rows"]:
        cap = r["capacity_vs_native"]
        table.append((
            r["mode"],
            "-" if r["replay_history"] is None else str(r["replay_history"]),
            f"{r['state_bytes'] / MIB:.2f}",
            f"{(r['scratch_bytes'] + r['history_bytes']) / MIB:.2f}",
            f"{r['conv_bytes'] / MIB:.2f}",
            f"{r['total_bytes'] / MIB:.2f}",
            str(r["max_running_requests"]),
            f"{r['bytes_vs_native']:.3f}",
            "-" if cap is None else f"{cap:.2f}x",
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        lines.append("  ".join(cell.rjust(w) if j else cell.ljust(w)
                               for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    sg = report["sglang_native_accounting"]
    if report["draft_tokens"] > 1:
        lines += [
            "",
            f"note: SGLang 0.5.14's own sizing charges native D x mamba_cache_per_req for the "
            f"speculative scratch ({sg['charged_bytes_per_request'] / MIB:.2f} MiB/req) -> "
            f"{sg['max_running_requests']} running requests; the native row above counts the "
            "buffers MambaPool actually allocates.",
        ]
    return "\n".join(lines)


def run_memory(args: argparse.Namespace) -> int:
    """Print the per-mode memory table (or JSON with ``--json``); 0 on success, 2 on bad input."""
    try:
        report = compute_memory_report(args)
    except (SSMModeConfigError, ShapeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_format(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m sglang_ssm_modes.sizing.cli [args]``."""
    parser = configure_memory_parser(argparse.ArgumentParser(prog="sglang_ssm_modes memory"))
    return run_memory(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
