"""Compare the SSM state modes on your own model and GPUs: start one ``python -m sglang.launch_server`` per
mode in turn (same arguments, one more flag), run the GSM8K eval (``scripts/gsm8k_eval.py``, SGLang's CI
settings) and a serving-speed sweep against each, stop it, and write one report.

    python scripts/compare_modes.py --model-path Qwen/Qwen3-Next-80B-A3B-Instruct --out compare/ \\
        -- --tp 4 --speculative-algorithm NEXTN --speculative-num-steps 3 \\
           --speculative-eagle-topk 1 --speculative-num-draft-tokens 4

Everything after ``--`` goes to every server unchanged (it must not choose a mode itself). Per mode the
report gives: GSM8K accuracy, invalid rate and answer agreement with the first mode (native by
default), TPOT and output throughput at each ``--concurrency`` (streamed GSM8K questions as prompts,
``bench_serving``'s definitions), the max running requests SGLang reports and the mamba pool it
allocated. Writes ``compare_modes.json``, ``compare_modes.md``, ``compare_modes.png``, GSM8K's own
side-by-side report under ``gsm8k/`` and each server's log under ``logs/``. Exit status 1 when a server
fails to start or a run fails; ``--dry-run`` prints the server command lines only.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import e2e_servers
import gsm8k_eval

MODE_FLAGS = ("--ssm-state-mode", "--ssm-replay-history", "--enable-linear-replayssm", "--linear-replayssm-cache-len")


def server_argv(model_path: str, mode: str, history: int, port: int, extra: list[str]) -> list[str]:
    """The command line of one mode's server: the user's arguments plus the mode."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--port", str(port), *extra,
            "--ssm-state-mode", mode]
    return argv + (["--ssm-replay-history", str(history)] if mode == "replay" else [])


def run_gsm8k(url: str, mode: str, args) -> dict:
    """``scripts/gsm8k_eval.py`` against one live server, as a user runs it; its JSON result."""
    out = args.out / "gsm8k" / mode
    cmd = [sys.executable, str(Path(__file__).with_name("gsm8k_eval.py")), "--server", f"{mode}={url}",
           "--num-questions", str(args.gsm8k_questions), "--num-shots", str(args.gsm8k_shots),
           "--parallel", str(args.parallel), "--out", str(out)]
    subprocess.run(cmd, check=True)
    return json.loads((out / "gsm8k.json").read_text())


def run_mode(mode: str, port: int, prompts: list[str], args) -> dict:
    """One server: start, GSM8K, serving speed, server info; stopped whatever happens."""
    argv = server_argv(args.model_path, mode, args.replay_history, port, args.server_args)
    result = {"mode": mode, "argv": shlex.join(argv[1:]), "started": False}
    server = e2e_servers.Server(argv, port, args.out / "logs" / f"{mode}.log")
    try:
        result["start_s"] = round(server.wait_ready(args.start_timeout), 1)
        result["started"] = True
        if args.gsm8k_questions:
            result["gsm8k"] = run_gsm8k(server.url, mode, args)
        result["serving"] = []
        for c in args.concurrency:
            batch = [prompts[i % len(prompts)] for i in range(c)]
            result["serving"].append(e2e_servers.serving_speed(server.url, batch, args.speed_tokens))
            e2e_servers.log.info("%s: concurrency %d: TPOT %.2f ms, %.0f tok/s", mode, c,
                                 result["serving"][-1]["tpot_ms"] or float("nan"),
                                 result["serving"][-1]["throughput_tok_s"])
        result["server"] = server.info()
        result["mamba_pool"] = server.allocated_pool()
    except Exception as e:  # reported; the next mode still runs
        result["error"] = f"{type(e).__name__}: {e}"[-3000:]
        e2e_servers.log.error("%s failed: %s", mode, result["error"][-600:])
    finally:
        server.stop()
    return result


def combined_gsm8k(results: list[dict], path: Path) -> dict | None:
    """GSM8K's own side-by-side report (``gsm8k_eval``'s JSON / Markdown / PNG) over the modes that ran,
    agreement judged against the first."""
    runs = [r for r in results if "gsm8k" in r]
    if not runs:
        return None
    servers = [r["gsm8k"]["servers"][0] for r in runs]
    combined = {**runs[0]["gsm8k"], "servers": servers,
                "agreement": {s["name"]: gsm8k_eval.agreement(servers[0], s) for s in servers[1:]}}
    path.mkdir(parents=True, exist_ok=True)
    (path / "gsm8k.json").write_text(json.dumps(combined, indent=1) + "\n")
    gsm8k_eval.write_markdown(combined, path / "gsm8k.md")
    gsm8k_eval.write_plot(combined, path / "gsm8k.png")
    return combined


def summary_rows(results: list[dict], gsm: dict | None) -> list[dict]:
    rows = []
    for r in results:
        g = (r.get("gsm8k") or {}).get("servers", [{}])[0]
        agree = (gsm or {}).get("agreement", {}).get(r["mode"], {}).get("answer_agreement")
        for s in r.get("serving", []):
            rows.append({"mode": r["mode"], "concurrency": s["concurrency"], "tpot_ms": s["tpot_ms"],
                         "throughput_tok_s": s["throughput_tok_s"], "ttft_ms": s["ttft_ms"],
                         "gsm8k_accuracy": g.get("accuracy"), "gsm8k_invalid": g.get("invalid"),
                         "gsm8k_answer_agreement": 1.0 if r is results[0] and g else agree,
                         "max_running_requests": (r.get("server") or {}).get("max_running_requests"),
                         "mamba_pool_slots": (r.get("mamba_pool") or {}).get("slots"),
                         "mamba_pool_bytes": (r.get("mamba_pool") or {}).get("bytes")})
    return rows


def write_report(report: dict, out: Path) -> None:
    (out / "compare_modes.json").write_text(json.dumps(report, indent=1))
    f = lambda x, spec="{:.3g}": "—" if x is None else spec.format(x)  # noqa: E731
    lines = [f"# SSM state modes — {report['model_path']}", "", f"Server arguments: `{report['server_args']}`", "",
             "| mode | concurrency | TPOT ms | output tok/s | TTFT ms | GSM8K acc. | invalid | answers = first mode | "
             "max running | pool slots | pool GiB |", "|" + "---|" * 11]
    for r in report["rows"]:
        lines.append(f"| {r['mode']} | {r['concurrency']} | {f(r['tpot_ms'])} | {f(r['throughput_tok_s'], '{:.0f}')} | "
                     f"{f(r['ttft_ms'])} | {f(r['gsm8k_accuracy'])} | {f(r['gsm8k_invalid'])} | "
                     f"{f(r['gsm8k_answer_agreement'])} | {f(r['max_running_requests'], '{}')} | "
                     f"{f(r['mamba_pool_slots'], '{}')} | "
                     f"{f(None if r['mamba_pool_bytes'] is None else r['mamba_pool_bytes'] / (1 << 30), '{:.2f}')} |")
    for r in report["modes"]:
        if "error" in r or not r["started"]:
            lines += ["", f"**{r['mode']} failed**: {(r.get('error') or 'did not start').splitlines()[0]}"]
    (out / "compare_modes.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for mode in dict.fromkeys(r["mode"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["mode"] == mode]
        axes[0].plot([r["concurrency"] for r in rows], [r["tpot_ms"] for r in rows], marker="o", label=mode)
        axes[1].plot([r["concurrency"] for r in rows], [r["throughput_tok_s"] for r in rows], marker="o", label=mode)
    modes = [r for r in report["modes"] if r.get("mamba_pool")]
    axes[2].bar([r["mode"] for r in modes], [r["mamba_pool"]["slots"] for r in modes])
    for ax, label in zip(axes, ("TPOT (ms)", "output tok/s", "mamba pool slots")):
        ax.set_ylabel(label)
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.legend()
    fig.suptitle(f"SSM state modes — {report['model_path']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "compare_modes.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--modes", nargs="+", choices=("native", "compact", "replay"),
                   default=["native", "compact", "replay"], help="in this order; agreement is against the first")
    p.add_argument("--replay-history", type=int, default=16, help="--ssm-replay-history of the replay server")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--start-timeout", type=float, default=1800, help="seconds until /health (large models load slowly)")
    p.add_argument("--gsm8k-questions", type=int, default=200, help="0 skips GSM8K")
    p.add_argument("--gsm8k-shots", type=int, default=5)
    p.add_argument("--parallel", type=int, default=64, help="GSM8K requests in flight")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--speed-tokens", type=int, default=256, help="output tokens per serving-speed request")
    p.add_argument("--dry-run", action="store_true", help="print each server's command line and exit")
    args = p.parse_args(own)
    args.server_args = server_args
    chosen = [a for a in server_args if a.split("=")[0] in MODE_FLAGS]
    if chosen:
        p.error(f"the server arguments after -- choose a mode ({', '.join(chosen)}): this script sets it per "
                "server; drop it and pick the modes with --modes")
    if len(set(args.modes)) != len(args.modes):
        p.error(f"--modes {' '.join(args.modes)}: each mode once")
    if min(args.concurrency) < 1 or args.speed_tokens < 2 or args.gsm8k_questions < 0 or args.parallel < 1:
        p.error("--concurrency levels and --parallel must be >= 1, --speed-tokens >= 2, --gsm8k-questions >= 0")
    if args.dry_run:
        for i, mode in enumerate(args.modes):
            print(shlex.join(server_argv(args.model_path, mode, args.replay_history, args.port + i, server_args)))
        return 0
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    data = gsm8k_eval.read_jsonl(gsm8k_eval.default_data_path())
    prompts = [f"Question: {line['question']}\nAnswer:" for line in data[:max(args.concurrency)]]
    results = []
    for i, mode in enumerate(args.modes):
        e2e_servers.log.info("[%d/%d] %s", i + 1, len(args.modes), mode)
        results.append(run_mode(mode, args.port + i, prompts, args))
    gsm = combined_gsm8k(results, args.out / "gsm8k")
    report = {"date": time.strftime("%F %H:%M"), "model_path": args.model_path,
              "server_args": shlex.join(server_args), "sglang_version": e2e_servers.installed_version("sglang"),
              "rows": summary_rows(results, gsm),
              "modes": [{k: v for k, v in r.items() if k != "gsm8k"} for r in results]}
    write_report(report, args.out)
    print((args.out / "compare_modes.md").read_text())
    return 1 if any("error" in r or not r["started"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
