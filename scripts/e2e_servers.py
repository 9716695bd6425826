"""End-to-end: real ``python -m sglang.launch_server`` processes, one per configuration, in sequence,
each sent the same requests; parity of every mode with native judged from what the servers return.

    python scripts/e2e_servers.py --out OUT [--configs NAME ...] [--list]

Configurations are named ``<model>-<mode>[-L<history>]-<spec>[-<variant>...]`` and come from
:data:`MATRIX` (``--list`` prints them). Models are this repo's test models
(``sglang_ssm_modes.testing.models``: seeded weights at a realistic scale, a local tokenizer),
generated under ``--models`` (a temporary folder by default) on first use.

Requests, identical for every server:

* greedy generation of ``--prompts`` random-token prompts, sent concurrently (batching, CUDA-graph
  padding rows), ``--new-tokens`` each, with the top-2 log-probabilities of every output token (a
  replay history of 16 folds several times over 64 tokens);
* teacher forcing: each prompt + native's greedy continuation + 16 more tokens, with the input
  log-probabilities of everything after the prompt. With the radix cache on, these requests hit the
  prefix cached by the first phase (copy-on-write of a state that replay must materialise);
* serving speed (after one untimed warm-up round at the highest level): at each ``--concurrency`` level,
  that many streamed greedy requests at once
  (``--speed-tokens`` each): TPOT and output throughput with ``bench_serving``'s definitions
  (TPOT = (latency - TTFT) / (output tokens - 1), median over requests; throughput = output tokens /
  wall time);
* with ``--gsm8k N``: ``scripts/gsm8k_eval.py`` against the server, N questions (answers compared with
  native's).

Parity per configuration against the native server of the same model, speculation, dtypes and parallel
layout (``-tp2`` / ``-dp2`` / ``-dpattn``: two GPUs, refused before anything starts where fewer are
visible): the largest teacher-forced log-probability difference, and greedy agreement: tokens identical
up to the first divergence, which must sit at a near-tie of native's (top-2 gap < ``--tie-gap``) — anything else is
reported as a bug. Writes ``OUT/e2e_h200.json`` (``rows``: one per configuration and concurrency, the
fields of ``bench/results/e2e_h200.json``; ``configs``: everything measured per server) and
``OUT/e2e_h200.md``; server logs under ``OUT/logs``. ``scripts/e2e_report.py`` merges runs into the
committed table and plots. Exits 1 when a server fails to start or a divergence is not a near-tie.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
log = logging.getLogger("e2e")

COMMON = ["--attention-backend", "triton", "--grammar-backend", "none", "--sampling-backend", "pytorch",
          "--mem-fraction-static", "0.4", "--context-length", "2048",
          "--max-total-tokens", "65536", "--cuda-graph-backend-prefill", "disabled", "--mamba-ssm-dtype", "float32",
          "--skip-server-warmup"]
GRAPHS = ["--cuda-graph-backend-decode", "full", "--cuda-graph-max-bs-decode", "40"]  # > concurrency: SGLang bug
MAX_CONCURRENCY = 32
"""Requests in flight at once, at most: below the largest captured batch (``../shared/gpu/README.md``: an
EAGLE verify batch of exactly that size crashes SGLang 0.5.14). ``--max-running-requests`` is left to
SGLang, so each server reports the running requests its pool holds."""
NO_GRAPHS = ["--cuda-graph-backend-decode", "disabled"]
SPEC = {
    "nospec": [],
    "nextn": ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4"],
    "ngram": ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
              "--speculative-ngram-max-bfs-breadth", "1"],
    "ngramtree": ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"],  # topk 10: a tree
}
MODES = {"native": [], "compact": ["--ssm-state-mode", "compact"], "replay": ["--ssm-state-mode", "replay"]}
VARIANTS = {"nograph": NO_GRAPHS, "noradix": ["--disable-radix-cache"], "bf16": ["--mamba-ssm-dtype", "bfloat16"],
            "hicache": ["--enable-hierarchical-cache", "--hicache-mem-layout", "page_first_direct"],
            "hicacheevict": ["--enable-hierarchical-cache", "--hicache-mem-layout", "page_first_direct",
                             "--hicache-write-policy", "write_through", "--max-total-tokens", "8192",
                             "--enable-metrics"],
            "metrics": ["--enable-metrics"], "tp2": ["--tp-size", "2"], "dp2": ["--dp-size", "2"],
            "dpattn": ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"],
            "fastverify": ["--ssm-compact-verify", "fast"], "maxrun8": ["--max-running-requests", "8"]}
"""``hicache``: SGLang 0.5.14's host mamba pool takes only the ``page_first_direct`` layout (its default,
``page_first``, is refused at startup in every mode). ``hicacheevict``: HiCache with a device KV pool of 8192
tokens; between generation and teacher forcing, :func:`evict_to_host` sends enough other prompts that the
cached prefixes leave the device, so teacher forcing loads them back from the host — in replay, the states a
slot backed up (folded first) and slots a load filled (history emptied): ``pool_hooks``. With ``extra_buffer``
only prompts of 64 tokens or more leave a prefix to load, so the variant needs ``--prompt-len 64`` or more.
The server's ``sglang:load_back_tokens_total`` must show a load, else the configuration is reported failed.
No float32-model variant: SGLang 0.5.14's Qwen3-Next norms run through sgl_kernel's ``gemma_rmsnorm``, which
has no float32 kernel, so ``--dtype float32`` fails capturing the decode graphs, native's server too (e2e run 18).
``tp2`` / ``dp2`` / ``dpattn``: two GPUs (:data:`PARALLEL_GPUS`), judged against the native server of the same
layout (a TP all-reduce sums in another order than one GPU). ``fastverify``: compact's 16-column verify tile
(compact configurations only; outputs to float32 rounding, so judged like replay's, by near-ties).
``maxrun8``: a native server that runs at most 8 requests at once, judged against the native server of
SGLang's own batching — native's sensitivity to batch composition (its GEMM and MoE kernels pick other tiles
by batch size, so another summation order), the yardstick for a mode's rounding-level divergences; reported,
never failing the run (native configurations only)."""
MODE_VARIANTS = {"fastverify": ("compact",), "maxrun8": ("native",)}
"""Variants that exist for some modes only (the plugin refuses them elsewhere)."""
PARALLEL_GPUS = {"tp2": 2, "dp2": 2, "dpattn": 2}
"""GPUs a parallel variant's server needs."""
MODEL_SPEC = {"qwen3-next": "nextn", "kimi-linear": "ngram", "qwen3.5": "nextn"}
FAMILY = {"qwen3-next": "gdn", "kimi-linear": "kda", "qwen3.5": "gdn"}
POOL_LINE = re.compile(r"sglang-ssm-modes: mamba pool allocated: mode=(\w+) slots=(\d+) bytes=(\d+)")


def _matrix() -> dict[str, dict]:
    out = {}
    for model, spec_name in MODEL_SPEC.items():
        for spec in ("nospec", spec_name, "ngramtree"):
            for mode in MODES:
                histories = (16, 32, 64) if mode == "replay" else (None,)
                for history in histories:
                    for variant in ((), *((v,) for v in VARIANTS if mode in MODE_VARIANTS.get(v, MODES))):
                        name = "-".join([model, mode + (f"-L{history}" if history else ""), spec, *variant])
                        out[name] = dict(model=model, mode=mode, history=history, spec=spec, variants=list(variant))
    return out


MATRIX = _matrix()
"""Every configuration by name (the core matrix is the variant-less qwen3-next / kimi-linear rows with
replay L16)."""


def server_argv(cfg: dict, model_dir: Path, port: int) -> list[str]:
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--port", str(port),
            *COMMON, *SPEC[cfg["spec"]], *MODES[cfg["mode"]]]
    argv += NO_GRAPHS if "nograph" in cfg["variants"] else GRAPHS
    for v in cfg["variants"]:
        if v != "nograph":
            argv += VARIANTS[v]
    if cfg["history"]:
        argv += ["--ssm-replay-history", str(cfg["history"])]
    return argv


def _gpu_count() -> int:
    import torch
    return torch.cuda.device_count()


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class Server:
    """One ``launch_server`` process in its own process group, stopped by its PID."""

    def __init__(self, argv: list[str], port: int, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        start = time.time()
        while time.time() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log tail:\n{self.tail()}")
            try:
                if _get(self.url + "/health", timeout=2) is not None:
                    return time.time() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(2)
        raise TimeoutError(f"no /health after {timeout:.0f} s; log tail:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        self.log_file.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def info(self) -> dict:
        """What :func:`server_summary` keeps of the live server's ``/server_info``."""
        return server_summary(json.loads(_get(self.url + "/server_info", timeout=30)))

    def allocated_pool(self) -> dict | None:
        """``{"slots", "bytes"}`` of the mamba pool the plugin logged it allocated (None without the line)."""
        self.log_file.flush()
        found = POOL_LINE.findall(self.log_path.read_text(errors="replace"))
        return {"slots": int(found[-1][1]), "bytes": int(found[-1][2])} if found else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log_file.close()


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length + 7 * i)] for i in range(count)]


def generate(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[list[dict], float]:
    """Greedy continuations, sent concurrently; ``(per-prompt results, wall seconds)``."""
    body = lambda p: {"input_ids": p, "return_logprob": True, "top_logprobs_num": 2,  # noqa: E731
                      "logprob_start_len": len(p) - 1,
                      "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    start = time.time()
    with ThreadPoolExecutor(len(prompts)) as pool:
        raw = list(pool.map(lambda p: _post(url + "/generate", body(p)), prompts))
    wall = time.time() - start
    out = []
    for r in raw:
        meta = r["meta_info"]
        top = meta["output_top_logprobs"]
        out.append({"tokens": r["output_ids"], "logprobs": [x[0] for x in meta["output_token_logprobs"]],
                    "gaps": [t[0][0] - t[1][0] if t and len(t) > 1 else float("inf") for t in top],
                    "verify_ct": meta.get("spec_verify_ct"), "completion_tokens": meta.get("completion_tokens")})
    return out, wall


EVICT_PROMPTS = 160
"""Other prompts :func:`evict_to_host` sends: 160 x (64 + 4) = 10 880 tokens, more than the ``hicacheevict``
variant's device KV pool of 8192, so the oldest cached prefixes leave the device; and with those prefixes under
the host KV pool (twice the device's: HiCache's default ratio), whose write-through backups would otherwise
evict the oldest host copies — the ones teacher forcing is to load."""
EVICT_PROMPT_LEN = 64
"""Tokens of each eviction prompt. With ``extra_buffer`` (Qwen3-Next, and any speculation) SGLang 0.5.14 caches a
finished request only up to its last tracked state: in prefill, the largest multiple of 64 (the FLA chunk) of an
extend of at least 64 tokens (``schedule_batch.py``), in decode every 256 tokens. A shorter prompt leaves
nothing in the tree, so it evicts nothing (seen: 40-token prompts, 0 tokens evicted)."""


def evict_to_host(url: str, vocab: int) -> None:
    """Push the prefixes cached so far out of the device pool (HiCache keeps them on the host): prompts
    never seen before, 32 at a time, 4 new tokens each."""
    fillers = make_prompts(EVICT_PROMPTS, EVICT_PROMPT_LEN, vocab, seed=4)
    for i in range(0, len(fillers), MAX_CONCURRENCY):
        generate(url, [f[:EVICT_PROMPT_LEN] for f in fillers[i:i + MAX_CONCURRENCY]], 4)


def counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each named Prometheus counter of a ``/metrics`` page, summed over its label sets."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


HICACHE_COUNTERS = ("sglang:evicted_tokens_total", "sglang:load_back_tokens_total",
                    "sglang:ssm_state_materialised_total")
"""What a ``hicacheevict`` row records: SGLang's device-to-host evictions and host-to-device loads (tokens) and
our requests whose replay state was materialised for a copy or transfer (HiCache's backups among them)."""


def teacher_forced(url: str, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
    """Input log-probabilities of each sequence from ``starts[i]`` on (sent one by one: each hits the
    prefix the generation phase left in the radix cache)."""
    out = []
    for seq, start in zip(sequences, starts):
        r = _post(url + "/generate", {"input_ids": seq, "return_logprob": True, "logprob_start_len": start,
                                      "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        out.append([x[0] for x in r["meta_info"]["input_token_logprobs"] if x[0] is not None])
    return out


def _stream_one(url: str, prompt: list[int] | str, new_tokens: int) -> dict:
    """One streamed greedy request (token ids or text): ``{"ttft", "latency", "tokens"}`` (seconds from
    sending it)."""
    body = {"text" if isinstance(prompt, str) else "input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, ttft, tokens = time.perf_counter(), None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            tokens = chunk["meta_info"]["completion_tokens"]
            if ttft is None and tokens:
                ttft = time.perf_counter() - start
    return {"ttft": ttft, "latency": time.perf_counter() - start, "tokens": tokens}


def serving_speed(url: str, prompts: list[list[int]] | list[str], new_tokens: int) -> dict:
    """All ``prompts`` streamed at once: TPOT (median over requests, ms) and output throughput, as
    SGLang's ``bench_serving`` defines them."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda p: _stream_one(url, p, new_tokens), prompts))
    wall = time.perf_counter() - start
    tokens = sum(d["tokens"] for d in done)
    tpots = [(d["latency"] - d["ttft"]) / (d["tokens"] - 1) for d in done if d["tokens"] > 1]
    return {"concurrency": len(prompts), "output_tokens": tokens, "wall_s": round(wall, 4),
            "throughput_tok_s": round(tokens / wall, 1),
            "tpot_ms": round(1e3 * statistics.median(tpots), 3) if tpots else None,
            "ttft_ms": round(1e3 * statistics.median(d["ttft"] for d in done), 2)}


def _percentiles(values: list[float], qs) -> list[float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in qs]


def parity(native: dict, other: dict, tie_gap: float) -> dict:
    """Greedy agreement and teacher-forced log-prob differences of ``other`` against ``native``."""
    agree, total, divergences, gen_diffs = 0, 0, [], []
    for i, (n, o) in enumerate(zip(native["gen"], other["gen"])):
        total += len(n["tokens"])
        same = 0
        while same < min(len(n["tokens"]), len(o["tokens"])) and n["tokens"][same] == o["tokens"][same]:
            same += 1
        agree += same
        gen_diffs += [abs(n["logprobs"][t] - o["logprobs"][t]) for t in range(same)]
        if same < len(n["tokens"]):
            gap = n["gaps"][same]
            divergences.append({"prompt": i, "position": same, "native_top2_gap": gap, "near_tie": gap < tie_gap})
    tf = [abs(a - b) for n, o in zip(native["tf"], other["tf"]) for a, b in zip(n, o)]
    gsm8k = {}
    if "gsm8k" in native and "gsm8k" in other:
        pairs = list(zip(native["gsm8k"]["responses"], other["gsm8k"]["responses"]))
        gsm8k = {"gsm8k_answer_agreement": sum(a == b for a, b in zip(native["gsm8k"]["answers"],
                                                                      other["gsm8k"]["answers"])) / len(pairs),
                 "gsm8k_text_agreement": sum(a == b for a, b in pairs) / len(pairs)}
    return {**gsm8k, "greedy_agreement": agree / max(total, 1), "divergences": divergences,
            "unexplained_divergences": sum(not d["near_tie"] for d in divergences),
            "max_logprob_diff_generated": max(gen_diffs, default=0.0),
            "p50_p99_logprob_diff_generated": _percentiles(gen_diffs, (0.5, 0.99)),
            "max_logprob_diff_teacher_forced": max(tf, default=0.0),
            "teacher_forced_tokens": len(tf)}


def run_gsm8k(url: str, name: str, args) -> dict:
    """scripts/gsm8k_eval.py against the live server (as a user runs it): accuracy and the extracted
    answer per question. Test models answer nonsense; what matters is that it runs and that the
    modes answer what native answers."""
    out = args.out / "gsm8k" / name
    cmd = [sys.executable, str(Path(__file__).with_name("gsm8k_eval.py")), "--server", f"{name}={url}",
           "--num-questions", str(args.gsm8k), "--num-shots", "2", "--max-tokens", "96", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    server = json.loads((out / "gsm8k.json").read_text())["servers"][0]
    return {"accuracy": server["accuracy"], "invalid": server["invalid"],
            "answers": [q["pred"] for q in server["questions"]],
            "responses": [q["response"] for q in server["questions"]]}


SERVER_INFO = ("max_total_num_tokens", "max_running_requests", "max_mamba_cache_size", "ssm_mode_config", "tp_size",
               "dp_size", "speculative_eagle_topk", "speculative_num_draft_tokens",
               "speculative_ngram_max_bfs_breadth", "mamba_ssm_dtype", "version")
"""What each row keeps of the server's ``/server_info`` (its arguments and what it sized at startup)."""


def server_summary(info: dict) -> dict:
    """The :data:`SERVER_INFO` fields of a ``/server_info`` answer, ``max_running_requests`` being what the
    scheduler runs with (``effective_max_running_requests_per_dp`` summed over its DP ranks; the
    argument stays None when SGLang derives it from the pools)."""
    out = {k: info.get(k) for k in SERVER_INFO if k in info}
    effective = [s.get("effective_max_running_requests_per_dp") for s in info.get("internal_states") or []]
    if effective and all(isinstance(e, int) for e in effective):
        out["max_running_requests_arg"] = out.get("max_running_requests")
        out["max_running_requests"] = sum(effective)
    return out


SSM_LABELS = ("kind", "mode", "history", "draft_tokens", "decode_path", "verify_path")
"""The labels of ``sglang_ssm_modes.integration.metrics`` beside SGLang's own (model name, ranks, ...)."""


def ssm_metrics(text: str) -> dict[str, float]:
    """The ``sglang:ssm_*`` samples of a Prometheus ``/metrics`` page, by series (name and our labels)."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("sglang:ssm_"):
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        own = [kv for kv in labels.rstrip("}").split(",") if kv.split("=")[0] in SSM_LABELS]
        out[name + ("{" + ",".join(own) + "}" if own else "")] = float(value)
    return out


def reference_key(cfg: dict) -> tuple:
    """Which native server a configuration is judged against: same model, speculation, dtypes and parallel
    layout."""
    return (cfg["model"], cfg["spec"], "bf16" in cfg["variants"],
            tuple(v for v in cfg["variants"] if v in PARALLEL_GPUS))


def gpus_needed(cfg: dict) -> int:
    """GPUs a configuration's server needs."""
    return max([1] + [PARALLEL_GPUS[v] for v in cfg["variants"] if v in PARALLEL_GPUS])


def run_config(name: str, cfg: dict, args, port: int, native_tokens: list[list[int]] | None) -> dict:
    from sglang_ssm_modes.testing.models import make_test_model

    model_dir = args.models / cfg["model"]
    if not (model_dir / "config.json").exists():
        make_test_model(cfg["model"], model_dir, seed=0)
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size", 512)
    row = {"name": name, **cfg, "started": False}
    server = Server(server_argv(cfg, model_dir, port), port, args.out / "logs" / f"{name}.log")
    try:
        row["start_s"] = round(server.wait_ready(args.start_timeout), 1)
        row["started"] = True
        prompts = make_prompts(args.prompts, args.prompt_len, vocab, seed=1)
        generate(server.url, make_prompts(args.prompts, args.prompt_len, vocab, seed=3), 8)  # compile, warm up
        gen, wall = generate(server.url, prompts, args.new_tokens)
        base = native_tokens or [g["tokens"] for g in gen]
        extra = make_prompts(len(prompts), 16, vocab, seed=2)
        seqs = [p + b + e for p, b, e in zip(prompts, base, extra)]
        if "hicacheevict" in cfg["variants"]:
            evict_to_host(server.url, vocab)
        row["gen"], row["tf"] = gen, teacher_forced(server.url, seqs, [len(p) for p in prompts])
        if "hicacheevict" in cfg["variants"]:
            row["hicache"] = counters(_get(server.url + "/metrics", timeout=30).decode(), HICACHE_COUNTERS)
            if not row["hicache"]["sglang:load_back_tokens_total"]:
                raise RuntimeError(f"HiCache loaded nothing back from the host ({row['hicache']}): the "
                                   "hicacheevict variant did not reach the load it exists to test")
        tokens = sum(len(g["tokens"]) for g in gen)
        verify = [g["verify_ct"] for g in gen if g["verify_ct"]]
        row["speed"] = {"output_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
                        "accept_length": round(tokens / sum(verify), 3) if verify else None}
        # untimed, at the highest level first: the first prefill and decode of a batch that large compile
        # Triton kernels (shapes never seen before), which would otherwise land in the timed run
        serving_speed(server.url, make_prompts(max(args.concurrency), args.prompt_len, vocab, seed=99), 16)
        row["serving"] = [serving_speed(server.url, make_prompts(c, args.prompt_len, vocab, seed=100 + c),
                                        args.speed_tokens) for c in args.concurrency]
        if args.gsm8k:
            row["gsm8k"] = run_gsm8k(server.url, name, args)
        row["server"] = server.info()
        row["mamba_pool"] = server.allocated_pool()
        log_text = server.tail(100000).splitlines()
        row["log_lines"] = [line for line in log_text
                            if "sglang-ssm-modes" in line or "Mamba Cache is allocated" in line][-6:]
        row["fault_lines"] = [line for line in log_text if "sglang-ssm-modes: request" in line][-20:]
        if {"metrics", "hicacheevict"} & set(cfg["variants"]):
            row["ssm_metrics"] = ssm_metrics(_get(server.url + "/metrics", timeout=30).decode())
    except Exception as e:  # reported in the row; the run goes on with the next server
        row["error"] = f"{type(e).__name__}: {e}"[-3000:]
        log.error("%s failed: %s", name, row["error"][-600:])
    finally:
        server.stop()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "sglang-ssm-modes-test-models",
                   help="where the test models are generated (kept out of --out: results only there)")
    p.add_argument("--configs", nargs="+", default=["qwen3-next-native-nextn", "qwen3-next-compact-nextn",
                                                    "qwen3-next-replay-L16-nextn"])
    p.add_argument("--list", action="store_true", help="print the configuration names and exit")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32],
                   help=f"serving-speed levels: requests in flight at once (1..{MAX_CONCURRENCY})")
    p.add_argument("--speed-tokens", type=int, default=128, help="output tokens per serving-speed request")
    p.add_argument("--tie-gap", type=float, default=0.05)
    p.add_argument("--start-timeout", type=float, default=400)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--gsm8k", type=int, default=0, metavar="N",
                   help="also run scripts/gsm8k_eval.py (N questions, 2 shots) against each server")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(MATRIX))
        return 0
    unknown = [c for c in args.configs if c not in MATRIX]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; --list prints the {len(MATRIX)} names")
    if min(args.prompts, args.prompt_len, args.new_tokens) < 1 or args.prompts > MAX_CONCURRENCY:
        p.error(f"--prompts (1..{MAX_CONCURRENCY}), --prompt-len and --new-tokens must be >= 1")
    if not all(1 <= c <= MAX_CONCURRENCY for c in args.concurrency) or args.speed_tokens < 2:
        p.error(f"--concurrency levels must lie in 1..{MAX_CONCURRENCY} (below the largest captured CUDA-graph "
                "batch) and --speed-tokens must be >= 2 (TPOT needs two tokens)")
    evicting = [c for c in args.configs if "hicacheevict" in MATRIX[c]["variants"]]
    if evicting and args.prompt_len < EVICT_PROMPT_LEN:
        p.error(f"{evicting} need --prompt-len {EVICT_PROMPT_LEN} or more: under extra_buffer (Qwen3-Next, "
                f"speculation) SGLang caches a shorter prompt's prefix nowhere, so nothing would be loaded back "
                f"from the host")
    if not 0 <= args.gsm8k <= 1300:
        p.error("--gsm8k takes 0 (off) to 1300 questions")
    gpus = _gpu_count()
    short = [c for c in args.configs if gpus_needed(MATRIX[c]) > max(gpus, 1)]  # one GPU: SGLang's own check
    if short:
        p.error(f"{short} need {max(gpus_needed(MATRIX[c]) for c in short)} GPUs, this machine has {gpus}: run them "
                "where two GPUs are visible (the GPU tool's nvidia-h200-x2 kind)")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    # natives first, SGLang's own batching before maxrun8: every configuration is judged against the first
    # native server of its model, speculation, dtypes and layout (another native, too: native against native)
    order = sorted(args.configs, key=lambda c: (MATRIX[c]["mode"] != "native", "maxrun8" in MATRIX[c]["variants"]))
    configs, native = [], {}  # reference key -> the native configuration
    settings = {k: getattr(args, k) for k in ("tie_gap", "prompts", "prompt_len", "new_tokens", "concurrency",
                                              "speed_tokens", "gsm8k")}
    for i, name in enumerate(order):
        cfg = MATRIX[name]
        key = reference_key(cfg)
        log.info("[%d/%d] %s", i + 1, len(order), name)
        ref = native.get(key)
        row = run_config(name, cfg, args, args.port + i, [g["tokens"] for g in ref["gen"]] if ref else None)
        if cfg["mode"] == "native" and "gen" in row and key not in native:
            native[key] = row
        elif key in native and "gen" in row:
            row["parity"] = parity(native[key], row, args.tie_gap)
        configs.append(row)
        _write(args.out, configs, settings)
    # a native judged against native measures SGLang's own spread: reported, not failed
    failed = [r["name"] for r in configs if not r["started"] or "error" in r
              or (r["mode"] != "native" and r.get("parity", {}).get("unexplained_divergences", 0))]
    log.info("done: %d configurations, failed: %s", len(configs), failed or "none")
    return 1 if failed else 0


def installed_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


SPEC_NAME = {"nospec": "none", "nextn": "nextn", "ngram": "ngram", "ngramtree": "ngram"}


def table_rows(configs: list[dict]) -> list[dict]:
    """The committed schema (issue #7): one row per configuration that served and per concurrency."""
    rows = []
    for c in configs:
        if "serving" not in c:
            continue
        info, par = c.get("server") or {}, c.get("parity")
        spec = SPEC_NAME[c["spec"]]
        reference = c["mode"] == "native" and not par  # the native server others are judged against
        if reference:
            diff, agreement, equal = 0.0, 1.0, True
        elif par:
            diff = max(par["max_logprob_diff_teacher_forced"], par["max_logprob_diff_generated"])
            agreement, equal = par["greedy_agreement"], par["greedy_agreement"] == 1.0
        else:  # no native server of the same model and speculation in this run
            diff = agreement = equal = None
        topk = None if spec == "none" else (info.get("speculative_ngram_max_bfs_breadth") if spec == "ngram"
                                             else info.get("speculative_eagle_topk"))
        for s in c["serving"]:
            rows.append({
                "config": c["name"], "model": c["model"], "family": FAMILY[c["model"]], "mode": c["mode"],
                "history": c["history"], "spec": spec, "topk": topk,
                "draft_tokens": 1 if spec == "none" else info.get("speculative_num_draft_tokens"),
                "cuda_graph": "nograph" not in c["variants"], "radix_cache": "noradix" not in c["variants"],
                "hicache": bool({"hicache", "hicacheevict"} & set(c["variants"])),
                "state_dtype": "bfloat16" if "bf16" in c["variants"] else "float32",
                "activation_dtype": "bfloat16",
                "tp": info.get("tp_size", 1), "dp": info.get("dp_size", 1), "concurrency": s["concurrency"],
                "max_abs_logprob_diff": diff, "token_agreement": agreement, "tokens_equal_native": equal,
                "unexplained_divergences": 0 if reference else (par or {}).get("unexplained_divergences"),
                "tpot_ms": s["tpot_ms"], "throughput_tok_s": s["throughput_tok_s"],
                "accept_length": c["speed"]["accept_length"],
                "max_running_requests": info.get("max_running_requests"),
                "mamba_pool_slots": (c.get("mamba_pool") or {}).get("slots"),
                "mamba_pool_bytes": (c.get("mamba_pool") or {}).get("bytes")})
    return rows


def _write(out: Path, configs: list[dict], settings: dict) -> None:
    slim = [{k: v for k, v in r.items() if k not in ("gen", "tf")} for r in configs]
    for r in slim:
        if "gsm8k" in r:
            r["gsm8k"] = {k: v for k, v in r["gsm8k"].items() if k != "responses"}
    meta = {"gpu": os.environ.get("GPU_NAME"), "commit": os.environ.get("COMMIT"), "date": time.strftime("%F"),
            "sglang_version": next((r["server"]["version"] for r in slim if (r.get("server") or {}).get("version")),
                                   None) or installed_version("sglang")}
    (out / "e2e_h200.json").write_text(json.dumps({**meta, "settings": settings, "rows": table_rows(configs),
                                                   "configs": slim}, indent=1))
    lines = ["| config | started | start s | tok/s | accept len | greedy agree | max Δlogprob TF | "
             "max Δlogprob gen | unexplained div. | error |", "|" + "---|" * 10]
    for r in slim:
        par, sp = r.get("parity", {}), r.get("speed", {})
        fmt = lambda x, f="{:.3g}": "" if x is None else f.format(x)  # noqa: E731
        lines.append(f"| {r['name']} | {r['started']} | {fmt(r.get('start_s'))} | {fmt(sp.get('tokens_per_s'))} | "
                     f"{fmt(sp.get('accept_length'))} | {fmt(par.get('greedy_agreement'))} | "
                     f"{fmt(par.get('max_logprob_diff_teacher_forced'))} | "
                     f"{fmt(par.get('max_logprob_diff_generated'))} | "
                     f"{fmt(par.get('unexplained_divergences'), '{}')} | {(r.get('error') or '')[:80]} |")
    (out / "e2e_h200.md").write_text(f"# E2E servers — {meta}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
