"""Merge end-to-end runs (``OUT/e2e_h200.json`` of ``scripts/e2e_servers.py``, one per GPU call) into the
committed report: ``e2e_h200.json`` (issue #7's schema: ``gpu``, ``date``, ``commit``, ``sglang_version``,
``rows``), ``e2e_h200.md`` (the table, core matrix first, with what is missing from it) and
``e2e_h200.png`` (TPOT and throughput against concurrency per model and speculation, one line per mode;
pool slots per mode).

    python scripts/e2e_report.py RUN.json [RUN.json ...] --out bench/results

A configuration measured in several runs keeps its latest run's rows. Each row names the run it came
from (``run_commit``, ``run_date``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from e2e_servers import MATRIX

MODE_ORDER = ("native", "compact", "replay")
CORE = [f"{model}-{mode}-{spec}" for model, specs in (("qwen3-next", ("nospec", "nextn")),
                                                       ("kimi-linear", ("nospec", "ngram")))
        for spec in specs for mode in ("native", "compact", "replay-L16")]
"""The core matrix of issue #7: GDN and KDA, three modes (replay L = 16), without and with speculation,
CUDA graphs and the radix cache on, bfloat16 activations and float32 state."""


def load_runs(paths: list[Path]) -> list[dict]:
    """The runs in the order given; refuses files that are not ``e2e_servers.py`` reports."""
    runs = []
    for path in paths:
        run = json.loads(path.read_text())
        if "configs" not in run or "rows" not in run:
            raise SystemExit(f"{path}: not an e2e_servers.py report with 'rows' and 'configs' "
                             "(reports before commit 578f1b5 lack the per-concurrency rows)")
        runs.append(run)
    return runs


def merge(runs: list[dict]) -> dict:
    """One report: each configuration's rows from the last run that served it."""
    latest: dict[str, list[dict]] = {}
    for run in runs:
        by_config: dict[str, list[dict]] = {}
        for row in run["rows"]:
            by_config.setdefault(row["config"], []).append({**row, "run_commit": run["commit"],
                                                            "run_date": run["date"]})
        latest.update(by_config)
    failed = {c["name"]: c.get("error", "")[-300:] for run in runs for c in run["configs"]
              if c["name"] not in latest and (not c["started"] or "error" in c)}
    order = {name: i for i, name in enumerate(CORE)}
    rows = sorted((r for rs in latest.values() for r in rs),
                  key=lambda r: (order.get(r["config"], len(CORE)), r["config"], r["concurrency"]))
    last = runs[-1]
    return {"gpu": last["gpu"], "date": last["date"], "commit": last["commit"],
            "sglang_version": last["sglang_version"],
            "runs": [{"gpu": r["gpu"], "date": r["date"], "commit": r["commit"], "settings": r.get("settings")}
                     for r in runs],
            "core_missing": [c for c in CORE if c not in latest], "failed": failed, "rows": rows}


def _fmt(x, f="{:.3g}") -> str:
    return "" if x is None else f.format(x)


def write_markdown(report: dict, path: Path) -> None:
    lines = [f"# End-to-end servers — {report['gpu']}, SGLang {report['sglang_version']}",
             "", "Runs: " + ", ".join(f"{r['commit']} ({r['date']}, near-tie tolerance "
                                      f"{(r['settings'] or {}).get('tie_gap', 'not recorded')})"
                                      for r in report["runs"]), "",
             "Parity is against the native server of the same model, speculation and dtypes (max |Δ log-prob| over "
             "teacher-forced and generated tokens; token agreement = greedy tokens identical up to the first "
             "divergence). Every divergence must sit at a near-tie of native's; `unexpl.` counts those that do not.",
             "", "| config | conc. | spec | D | state | max \\|Δlogprob\\| | token agree | equal | unexpl. | "
             "TPOT ms | tok/s | accept | max running | pool slots | pool GiB |", "|" + "---|" * 15]
    for r in report["rows"]:
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['spec']} | {r['draft_tokens']} | {r['state_dtype']} | "
            f"{_fmt(r['max_abs_logprob_diff'])} | {_fmt(r['token_agreement'])} | "
            f"{_fmt(r['tokens_equal_native'], '{}')} | "
            f"{_fmt(r.get('unexplained_divergences'), '{}')} | {_fmt(r['tpot_ms'])} | "
            f"{_fmt(r['throughput_tok_s'], '{:.0f}')} | "
            f"{_fmt(r.get('accept_length'))} | {_fmt(r['max_running_requests'], '{}')} | "
            f"{_fmt(r.get('mamba_pool_slots'), '{}')} | "
            f"{_fmt(None if r['mamba_pool_bytes'] is None else r['mamba_pool_bytes'] / (1 << 30), '{:.2f}')} |")
    if report["core_missing"]:
        lines += ["", "Core-matrix configurations not in any run yet: " + ", ".join(report["core_missing"]) + "."]
    for name, error in report["failed"].items():
        lines += ["", f"Failed: `{name}`: {error.splitlines()[0] if error else 'did not start'}"]
    path.write_text("\n".join(lines) + "\n")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, dict[str, list[dict]]] = {}  # (model, speculation, variants) -> mode -> rows
    for r in report["rows"]:
        cfg = MATRIX[r["config"]]
        label = r["mode"] + (f" L{r['history']}" if r["history"] else "")
        groups.setdefault((r["model"], cfg["spec"], "-".join(cfg["variants"])), {}).setdefault(label, []).append(r)
    keys = sorted(groups)
    fig, axes = plt.subplots(3, max(len(keys), 1), figsize=(4.2 * max(len(keys), 1), 10), squeeze=False)
    for col, key in enumerate(keys):
        for label, rows in sorted(groups[key].items(), key=lambda kv: MODE_ORDER.index(kv[0].split()[0])):
            rows = sorted(rows, key=lambda r: r["concurrency"])
            conc = [r["concurrency"] for r in rows]
            axes[0][col].plot(conc, [r["tpot_ms"] for r in rows], marker="o", label=label)
            axes[1][col].plot(conc, [r["throughput_tok_s"] for r in rows], marker="o", label=label)
        labels = sorted(groups[key], key=lambda lab: (MODE_ORDER.index(lab.split()[0]), lab))
        slots = [groups[key][lab][0].get("mamba_pool_slots") or 0 for lab in labels]
        axes[2][col].bar(range(len(labels)), slots)
        axes[2][col].set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
        axes[0][col].set_title(" ".join(k for k in key if k), fontsize=9)
        axes[0][col].set_ylabel("TPOT (ms)")
        axes[1][col].set_ylabel("output tok/s")
        axes[2][col].set_ylabel("mamba pool slots")
        for ax in axes[0][col], axes[1][col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.legend(fontsize=7)
    fig.suptitle(f"sglang-ssm-modes end to end — {report['gpu']}, commit {report['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="e2e_h200.json files of scripts/e2e_servers.py, oldest first")
    p.add_argument("--out", type=Path, required=True, help="folder for e2e_h200.json / .md / .png")
    args = p.parse_args(argv)
    missing = [str(r) for r in args.runs if not r.is_file()]
    if missing:
        p.error(f"no such report(s): {', '.join(missing)}")
    report = merge(load_runs(args.runs))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "e2e_h200.json").write_text(json.dumps(report, indent=1))
    write_markdown(report, args.out / "e2e_h200.md")
    plot(report, args.out / "e2e_h200.png")
    print(f"{len(report['rows'])} rows from {len(args.runs)} run(s); core matrix missing: "
          f"{', '.join(report['core_missing']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
