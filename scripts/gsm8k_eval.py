#!/usr/bin/env python3
"""GSM8K few-shot accuracy of one or more running SGLang servers, side by side (e.g. one server per
SSM state mode: native, compact, replay).

By default this is SGLang 0.5.14's own GSM8K eval exactly as its CI runs it: ``sglang.test.run_eval``
with ``eval_name="gsm8k"`` driven by ``sglang/test/kits/eval_accuracy_kit.py`` ``GSM8KMixin``
(lines 196-228: ``api="completion"``, ``max_tokens=512``, 5 shots, 200 examples; this is the path of
the Qwen3-Next MTP tests and their ``gsm8k_accuracy_thres = 0.93``):

* data: the first ``k`` lines of ``test.jsonl`` are the shots, the questions are the lines after
  them (``simple_eval_gsm8k.py:59-67``); read from the package's local copy, never downloaded
  (SGLang downloads ``GSM8K_URL`` when no ``data_path`` is given, ``simple_eval_gsm8k.py:54-57``);
* prompt: ``"Question: {q}\\nAnswer: {a}\\n\\n"`` per shot, then ``"Question: {q}\\nAnswer:"``
  (``simple_eval_gsm8k.py:21-29, 78-84``), sent as the raw prompt of ``POST /v1/completions``
  (``CompletionSampler``, ``simple_eval_common.py:208-228``);
* sampling: ``temperature=0.0``, ``top_p=1.0``, ``max_tokens=512``,
  ``stop=["Question", "Assistant:", "<|separator|>"]`` (``run_eval.py:64-79``);
* model: the first id of ``GET /v1/models`` (``simple_eval_common.py:192-193``);
* extraction: the last match of ``-?\\d+\\.?\\d*`` after removing commas, through
  ``ast.literal_eval`` (``simple_eval_gsm8k.py:32-40``); score = extracted == gold.

``--api chat`` switches to ``POST /v1/chat/completions`` with the prompt as one user message
(``ChatCompletionSampler``, ``simple_eval_common.py:138-157``; ``run_eval``'s own command-line default
is ``--api chat --max-tokens 2048``, ``run_eval.py:314-322``, not what CI uses).

The SGLang functions are replicated here (with their source lines) rather than imported: importing
``sglang.test.simple_eval_gsm8k`` pulls in torch (~5 s) and its data loader may download.
``tests/test_gsm8k_eval.py`` checks the replication against SGLang's own code.

Usage::

    python scripts/gsm8k_eval.py --server native=http://127.0.0.1:30000 \\
        --server compact=http://127.0.0.1:30001 --server replay=http://127.0.0.1:30002 \\
        --out out/gsm8k --min-accuracy 0.93

Writes ``gsm8k.json``, ``gsm8k.md`` and ``gsm8k.png`` under ``--out``. Exit status: 0 on success,
1 when ``--min-accuracy`` is given and a server is below it, 2 on invalid arguments or an
unreachable server (checked for every server before any question is sent).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import sys
import time
from datetime import datetime, timezone
from importlib.util import find_spec
from multiprocessing.pool import ThreadPool
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
from openai import OpenAI
from tqdm import tqdm

SGLANG_VERSION = "0.5.14"
INVALID = -9999999  # simple_eval_gsm8k.py:18
DEFAULT_STOP = ["Question", "Assistant:", "<|separator|>"]  # run_eval.py:75
DEFAULT_NUM_SHOTS = 5  # run_eval.py:178 / eval_accuracy_kit.py:191
DEFAULT_NUM_QUESTIONS = 200  # eval_accuracy_kit.py:188
DEFAULT_PARALLEL = 64  # simple_eval_gsm8k.py:47 (GSM8KEval num_threads; CI passes 128)
DEFAULT_MAX_TOKENS = 512  # eval_accuracy_kit.py:226
DEFAULT_TEMPERATURE = 0.0  # run_eval.py:69
DEFAULT_TOP_P = 1.0  # run_eval.py:67
DEFAULT_URL = "http://127.0.0.1:30000"
MAX_ATTEMPTS = 6  # simple_eval_common.py:216 (`while trial < 6`, back-off 2**trial s)
DATA_RELPATH = ("data", "gsm8k", "test.jsonl")


# --------------------------------------------------------------------------------------------
# SGLang 0.5.14's GSM8K eval, replicated (sglang/test/simple_eval_gsm8k.py, sglang/utils.py).
# --------------------------------------------------------------------------------------------

def read_jsonl(path) -> list[dict]:
    """sglang/utils.py:150-156: one JSON object a line, lines starting with '#' skipped."""
    rows = []
    with open(path, encoding="utf-8") as fin:
        for lineno, line in enumerate(fin, 1):
            if line.startswith("#"):
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({e})") from None
    return rows


def get_one_example(lines, i, include_answer):
    """simple_eval_gsm8k.py:21-25."""
    ret = f"Question: {lines[i]['question']}\nAnswer:"
    if include_answer:
        ret += f" {lines[i]['answer']}"
    return ret


def get_few_shot_examples(lines, k):
    """simple_eval_gsm8k.py:28-29."""
    return "".join(get_one_example(lines, i, True) + "\n\n" for i in range(k))


def get_answer_value(answer_str):
    """simple_eval_gsm8k.py:32-40: the last number, commas removed; INVALID when none parses."""
    answer_str = answer_str.replace(",", "")
    numbers = re.findall(r"-?\d+\.?\d*", answer_str)
    if len(numbers) < 1:
        return INVALID
    try:
        return ast.literal_eval(numbers[-1])
    except (SyntaxError, ValueError):
        return INVALID


def split_shots_questions(all_lines, num_shots, num_questions):
    """simple_eval_gsm8k.py:59-67 (+ 69-71): the shots are lines [0, k), the questions the next
    ``num_questions`` lines. Returns (few-shot prefix, question lines)."""
    few_shot_prompt = get_few_shot_examples(all_lines, num_shots)
    return few_shot_prompt, all_lines[num_shots:][:num_questions]


def build_prompt(few_shot_prompt, lines, idx):
    """simple_eval_gsm8k.py:78-84: prefix + the question, one user message. CompletionSampler joins
    the messages' contents with "\\n" (simple_eval_common.py:210-214): one message, the text itself."""
    return few_shot_prompt + get_one_example(lines, idx, include_answer=False)


# --------------------------------------------------------------------------------------------
# The request, as SGLang's samplers send it (sglang/test/simple_eval_common.py).
# --------------------------------------------------------------------------------------------

def make_client(url: str) -> OpenAI:
    """run_eval.py:101-106 (base url + "/v1", OPENAI_API_KEY=EMPTY when unset) and
    simple_eval_common.py:73-80 (LargerHttpxClient: 3600 s timeout, 3600 connections)."""
    http_client = httpx.Client(timeout=httpx.Timeout(3600),
                               limits=httpx.Limits(max_keepalive_connections=3600, max_connections=3600))
    return OpenAI(base_url=f"{url}/v1", api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                  http_client=http_client)


def sample(client: OpenAI, api: str, model: str, prompt: str, *, temperature: float, top_p: float,
           max_tokens: int, stop) -> tuple[str, int | None, str | None]:
    """One request with SGLang's retry policy (simple_eval_common.py:138-172 chat, 208-241 completion):
    up to 6 attempts with 2**trial s back-off, a 400 answered with "" at once, "" when all fail.
    Returns (text, completion tokens or None, last error or None)."""
    error = None
    for trial in range(MAX_ATTEMPTS):
        try:
            if api == "completion":
                response = client.completions.create(model=model, prompt=prompt, temperature=temperature,
                                                     top_p=top_p, max_tokens=max_tokens, stop=stop)
                text = response.choices[0].text or ""
            else:
                # run_eval.py:81-85: no system message, reasoning_effort None, extra_body None.
                response = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], temperature=temperature,
                    top_p=top_p, max_tokens=max_tokens, reasoning_effort=None, extra_body=None)
                text = response.choices[0].message.content or ""
            tokens = None
            if response.usage and response.usage.completion_tokens is not None:
                tokens = response.usage.completion_tokens
            return text, tokens, None
        except openai.BadRequestError as e:
            return "", None, f"BadRequestError: {e}"
        except Exception as e:  # noqa: BLE001 - SGLang retries on anything else
            error = f"{type(e).__name__}: {e}"
            if trial + 1 < MAX_ATTEMPTS:
                tqdm.write(f"request failed ({error}); retry {trial + 1} after {2 ** trial} s", file=sys.stderr)
            time.sleep(2 ** trial)
    return "", None, error


# --------------------------------------------------------------------------------------------
# Servers: argument parsing, probing, mode lookup.
# --------------------------------------------------------------------------------------------

class ServerAction(argparse.Action):
    """--url URL and --server NAME=URL append (name, url) to one list, in command-line order."""

    def __call__(self, parser, namespace, values, option_string=None):
        servers = list(getattr(namespace, self.dest) or [])
        if option_string == "--server":
            name, sep, url = values.partition("=")
            if not sep or not name.strip() or not url.strip():
                parser.error(f"--server {values!r}: expected NAME=URL, e.g. native=http://127.0.0.1:30000")
            servers.append((name.strip(), url.strip()))
        else:
            servers.append((None, values.strip()))
        setattr(namespace, self.dest, servers)


def check_url(url: str) -> str | None:
    """None when ``url`` is a well-formed server root (http(s)://host[:port]), else the problem."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as e:
        return f"not a valid URL ({e})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not a valid http(s) URL: expected e.g. http://127.0.0.1:30000"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return "give the server root (http(s)://host:port), without a path such as /v1"
    return None


def default_data_path() -> Path:
    """The package's copy of GSM8K test.jsonl, found without importing the package."""
    spec = find_spec("sglang_ssm_modes")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            path = Path(loc).joinpath(*DATA_RELPATH)
            if path.is_file():
                return path
    return Path(__file__).resolve().parents[1].joinpath("sglang_ssm_modes", *DATA_RELPATH)


def probe_server(url: str, timeout: float) -> list[str]:
    """The model ids of ``GET {url}/v1/models``; raises RuntimeError naming the URL when unreachable."""
    endpoint = f"{url}/v1/models"
    try:
        r = httpx.get(endpoint, timeout=timeout)
    except httpx.HTTPError as e:
        raise RuntimeError(f"server {url} is not reachable ({endpoint}: {type(e).__name__}: {e}); "
                           "is it running and serving?") from None
    if r.status_code != 200:
        raise RuntimeError(f"server {url}: {endpoint} answered HTTP {r.status_code}: {r.text[:200]!r}")
    try:
        ids = [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise RuntimeError(f"server {url}: {endpoint} did not return an OpenAI model list: {r.text[:200]!r}") from None
    if not ids:
        raise RuntimeError(f"server {url}: {endpoint} lists no model")
    return ids


def fetch_server_info(url: str, timeout: float) -> dict | None:
    """``GET /get_server_info`` (SGLang 0.5.14: deprecated alias of ``/server_info``, tried next)."""
    for path in ("/get_server_info", "/server_info"):
        try:
            r = httpx.get(f"{url}{path}", timeout=timeout)
            if r.status_code == 200:
                info = r.json()
                if isinstance(info, dict):
                    return info
        except (httpx.HTTPError, ValueError):
            pass
    return None


def find_ssm_mode(info: dict | None) -> str | None:
    """The SSM state mode a server reports: ``ssm_mode_config`` (the resolved configuration, a dict
    with "mode" or its repr) first, then the ``ssm_state_mode`` server arg; None when absent."""
    if not isinstance(info, dict):
        return None
    cfg = info.get("ssm_mode_config")
    if isinstance(cfg, dict) and isinstance(cfg.get("mode"), str) and cfg["mode"]:
        return cfg["mode"]
    if isinstance(cfg, str):
        m = re.search(r"""mode\s*[=:]\s*['"]?(\w+)""", cfg)
        if m:
            return m.group(1)
        if cfg.strip():
            return cfg.strip()
    mode = info.get("ssm_state_mode")
    if isinstance(mode, str) and mode:
        return mode
    return None


# --------------------------------------------------------------------------------------------
# Evaluation and report.
# --------------------------------------------------------------------------------------------

def evaluate_server(name, url, model, few_shot_prompt, lines, args) -> dict:
    """All questions against one server: SGLang's GSM8KEval.__call__ (simple_eval_gsm8k.py:76-92,
    ThreadPool + tqdm as in map_with_progress, simple_eval_common.py:393-401), keeping every answer."""
    client = make_client(url)
    labels = [get_answer_value(line["answer"]) for line in lines]

    def fn(idx):
        prompt = build_prompt(few_shot_prompt, lines, idx)
        t0 = time.perf_counter()
        try:
            text, tokens, error = sample(client, args.api, model, prompt, temperature=args.temperature,
                                         top_p=args.top_p, max_tokens=args.max_tokens, stop=DEFAULT_STOP)
        except Exception as e:  # noqa: BLE001 - simple_eval_gsm8k.py:86-89
            text, tokens, error = "", None, f"{type(e).__name__}: {e}"
        return text, tokens, error, time.perf_counter() - t0

    idxs = list(range(len(lines)))
    tic = time.perf_counter()
    with ThreadPool(min(args.parallel, len(idxs))) as pool:
        outs = list(tqdm(pool.imap(fn, idxs), total=len(idxs), desc=f"gsm8k {name}", file=sys.stderr))
    latency = time.perf_counter() - tic  # run_eval.py:88-90

    questions = []
    for idx, (text, tokens, error, q_latency) in enumerate(outs):
        pred = get_answer_value(text)
        questions.append(dict(index=idx, line=args.num_shots + idx, label=labels[idx], pred=pred,
                              correct=pred == labels[idx], invalid=pred == INVALID,
                              completion_tokens=tokens, latency_s=round(q_latency, 4), error=error,
                              response=text))
    n = len(questions)
    token_counts = [q["completion_tokens"] for q in questions if q["completion_tokens"] is not None]
    total_tokens = sum(token_counts)
    client.close()
    return dict(
        accuracy=sum(q["correct"] for q in questions) / n,  # score, simple_eval_gsm8k.py:92
        invalid=sum(q["invalid"] for q in questions) / n,  # few_shot_gsm8k.py:130
        latency_s=latency,
        # run_eval.py:203-205: completion tokens / wall time; None when the server reports no usage.
        output_throughput=total_tokens / latency if total_tokens > 0 and latency > 0 else None,
        completion_tokens=total_tokens,
        request_errors=sum(q["error"] is not None for q in questions),
        questions=questions,
    )


def agreement(first: dict, other: dict) -> dict:
    """Per-question agreement of the extracted answers (INVALID == INVALID counts as agreeing) and
    of the raw response texts of ``other`` with ``first``."""
    a, b = first["questions"], other["questions"]
    same = [x["pred"] == y["pred"] for x, y in zip(a, b)]
    same_text = [x["response"] == y["response"] for x, y in zip(a, b)]
    n = len(same)
    return dict(
        answer_agreement=sum(same) / n,
        text_agreement=sum(same_text) / n,
        both_correct=sum(x["correct"] and y["correct"] for x, y in zip(a, b)),
        only_first_correct=sum(x["correct"] and not y["correct"] for x, y in zip(a, b)),
        only_this_correct=sum(y["correct"] and not x["correct"] for x, y in zip(a, b)),
        disagreeing_questions=[i for i, s in enumerate(same) if not s],
    )


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def write_markdown(result: dict, path: Path) -> None:
    s = result["settings"]
    out = [
        "# GSM8K few-shot accuracy",
        "",
        f"SGLang {SGLANG_VERSION} GSM8K eval (`run_eval --eval-name gsm8k`, CI settings): {s['num_shots']} shots, "
        f"{s['num_questions']} questions, `/v1/{'completions' if s['api'] == 'completion' else 'chat/completions'}`, "
        f"temperature {s['temperature']}, top_p {s['top_p']}, max_tokens {s['max_tokens']}, "
        f"data `{s['data']}` (sha256 {s['data_sha256'][:12]}), {result['date']}.",
        "",
        "| server | url | ssm mode | model | accuracy | invalid | latency (s) | output tok/s | errors "
        "| answer agreement | text agreement |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    first = result["servers"][0]["name"]
    for srv in result["servers"]:
        ag = result["agreement"].get(srv["name"])
        if srv["name"] == first and len(result["servers"]) > 1:
            ans, txt = "(reference)", "(reference)"
        else:
            ans = _fmt(ag and ag["answer_agreement"], ".3f")
            txt = _fmt(ag and ag["text_agreement"], ".3f")
        out.append(f"| {srv['name']} | {srv['url']} | {srv['ssm_mode'] or '—'} | {srv['model']} "
                   f"| {srv['accuracy']:.3f} | {srv['invalid']:.3f} | {srv['latency_s']:.1f} "
                   f"| {_fmt(srv['output_throughput'], '.1f')} | {srv['request_errors']} | {ans} | {txt} |")
    if result["min_accuracy"] is not None:
        out += ["", f"Minimum accuracy {result['min_accuracy']}: "
                + ("all servers pass." if not result["below_min_accuracy"]
                   else "below: " + ", ".join(result["below_min_accuracy"]) + ".")]
    if len(result["servers"]) > 1:
        out += ["", f"Agreement is per question, with the first server ({first}); questions are numbered from 0 "
                f"(0-based line of the data = number + {s['num_shots']}).", ""]
        for name, ag in result["agreement"].items():
            dis = ag["disagreeing_questions"]
            out.append(f"- {name}: both correct {ag['both_correct']}, only {first} correct "
                       f"{ag['only_first_correct']}, only {name} correct {ag['only_this_correct']}; "
                       f"answers differ on {len(dis)} question(s)"
                       + (f": {dis[:20]}{' …' if len(dis) > 20 else ''}" if dis else ""))
    path.write_text("\n".join(out) + "\n")


def write_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = result["servers"]
    labels = [s["name"] + (f"\n({s['ssm_mode']})" if s["ssm_mode"] and s["ssm_mode"] != s["name"] else "")
              for s in servers]
    accs = [s["accuracy"] for s in servers]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(servers) + 2), 4))
    bars = ax.bar(range(len(servers)), accs, color="tab:blue")
    for bar, acc in zip(bars, accs):
        ax.text(bar.get_x() + bar.get_width() / 2, acc + 0.01, f"{acc:.3f}", ha="center", va="bottom")
    if result["min_accuracy"] is not None:
        ax.axhline(result["min_accuracy"], color="tab:red", ls="--", lw=1,
                   label=f"min accuracy {result['min_accuracy']}")
        ax.legend(loc="best")
    ax.set_xticks(range(len(servers)), labels)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("accuracy")
    s = result["settings"]
    ax.set_title(f"GSM8K {s['num_shots']}-shot, {s['num_questions']} questions")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="GSM8K few-shot accuracy of running SGLang servers (SGLang 0.5.14's own gsm8k eval, "
                    "CI settings), side by side.")
    p.add_argument("--url", dest="servers", action=ServerAction, metavar="URL",
                   help=f"server root, repeatable (default {DEFAULT_URL} when no --url/--server is given)")
    p.add_argument("--server", dest="servers", action=ServerAction, metavar="NAME=URL",
                   help="named server, repeatable, e.g. native=http://127.0.0.1:30000; the first server is "
                        "the reference of the agreement columns")
    p.add_argument("--num-shots", type=int, default=DEFAULT_NUM_SHOTS,
                   help="few-shot examples: the first k lines of the data (default %(default)s)")
    p.add_argument("--num-questions", type=int, default=DEFAULT_NUM_QUESTIONS,
                   help="questions: the lines after the shots (default %(default)s)")
    p.add_argument("--parallel", type=int, default=DEFAULT_PARALLEL,
                   help="concurrent requests per server (default %(default)s)")
    p.add_argument("--data", type=Path, default=None,
                   help="GSM8K test.jsonl (default: the package copy, sglang_ssm_modes/data/gsm8k/test.jsonl)")
    p.add_argument("--api", choices=("completion", "chat"), default="completion",
                   help="/v1/completions (SGLang CI, default) or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models id)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="default %(default)s (SGLang CI)")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="default %(default)s")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help="default %(default)s")
    p.add_argument("--no-flush-cache", action="store_true",
                   help="do not GET /flush_cache before each server's run (SGLang's GSM8KMixin flushes)")
    p.add_argument("--probe-timeout", type=float, default=10.0,
                   help="seconds to wait for /v1/models and /get_server_info (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("out/gsm8k"), help="output folder (default %(default)s)")
    p.add_argument("--min-accuracy", type=float, default=None,
                   help="exit 1 when any server's accuracy is below this (e.g. 0.93, SGLang's Qwen3-Next MTP bar)")
    return p


def validate(parser: argparse.ArgumentParser, args) -> tuple[list[tuple[str, str]], list[dict]]:
    """Argument checks (parser.error, exit 2). Returns the named servers and the data lines."""
    if args.num_shots < 0:
        parser.error(f"--num-shots {args.num_shots}: must be >= 0")
    if args.num_questions < 1:
        parser.error(f"--num-questions {args.num_questions}: must be >= 1")
    if args.parallel < 1:
        parser.error(f"--parallel {args.parallel}: must be >= 1")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens {args.max_tokens}: must be >= 1")
    if args.temperature < 0:
        parser.error(f"--temperature {args.temperature}: must be >= 0")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.probe_timeout <= 0:
        parser.error(f"--probe-timeout {args.probe_timeout}: must be > 0")
    if args.min_accuracy is not None and not 0 <= args.min_accuracy <= 1:
        parser.error(f"--min-accuracy {args.min_accuracy}: must be in [0, 1]")

    raw = args.servers or [(None, DEFAULT_URL)]
    servers, names = [], set()
    for name, url in raw:
        problem = check_url(url)
        if problem:
            parser.error(f"server URL {url!r}: {problem}")
        url = url.rstrip("/")
        if name is None:
            base = urlsplit(url).netloc
            name, k = base, 2
            while name in names:
                name, k = f"{base}#{k}", k + 1
        elif name in names:
            parser.error(f"--server {name}=...: the name {name!r} is given twice")
        names.add(name)
        servers.append((name, url))

    data = args.data if args.data is not None else default_data_path()
    if not Path(data).is_file():
        parser.error(f"--data {data}: no such file")
    args.data = Path(data)
    try:
        lines = read_jsonl(args.data)
    except (OSError, ValueError) as e:
        parser.error(f"--data {args.data}: {e}")
    for i, line in enumerate(lines):
        if not isinstance(line, dict) or not {"question", "answer"} <= line.keys():
            parser.error(f"--data {args.data}: record {i} has no 'question' and 'answer'")
    if args.num_shots + args.num_questions > len(lines):
        parser.error(f"--num-shots {args.num_shots} + --num-questions {args.num_questions} = "
                     f"{args.num_shots + args.num_questions} lines, but {args.data} has only {len(lines)} "
                     f"(at most {max(len(lines) - args.num_shots, 0)} questions after {args.num_shots} shots)")
    return servers, lines


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    servers, all_lines = validate(parser, args)
    few_shot_prompt, lines = split_shots_questions(all_lines, args.num_shots, args.num_questions)
    labels = [get_answer_value(line["answer"]) for line in lines]
    bad = [args.num_shots + i for i, lab in enumerate(labels) if lab == INVALID]
    if bad:
        parser.error(f"--data {args.data}: no numeric gold answer on line(s) {bad[:10]}")

    # Fail early: every server must answer /v1/models before any question is sent.
    infos = []
    for name, url in servers:
        try:
            models = probe_server(url, args.probe_timeout)
        except RuntimeError as e:
            parser.error(str(e) if name == urlsplit(url).netloc else f"--server {name}: {e}")
        model = args.model or models[0]  # simple_eval_common.py:192-193
        info = fetch_server_info(url, args.probe_timeout)
        infos.append(dict(name=name, url=url, model=model, ssm_mode=find_ssm_mode(info),
                          server_version=(info or {}).get("version"),
                          server_model_path=(info or {}).get("model_path")))
        print(f"{name}: {url} model={model} ssm_mode={infos[-1]['ssm_mode']}", file=sys.stderr)

    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for srv in infos:
        if not args.no_flush_cache:
            try:  # eval_accuracy_kit.py:197, response ignored
                httpx.get(f"{srv['url']}/flush_cache", timeout=args.probe_timeout)
            except httpx.HTTPError as e:
                print(f"{srv['name']}: /flush_cache failed ({e}); continuing", file=sys.stderr)
        res = evaluate_server(srv["name"], srv["url"], srv["model"], few_shot_prompt, lines, args)
        results.append({**srv, **res})
        print(f"{srv['name']}: Accuracy: {res['accuracy']:.3f}  Invalid: {res['invalid']:.3f}  "
              f"Latency: {res['latency_s']:.3f} s  Output throughput: {_fmt(res['output_throughput'], '.3f')} token/s"
              + (f"  request errors: {res['request_errors']}" if res["request_errors"] else ""))

    agree = {r["name"]: agreement(results[0], r) for r in results[1:]}
    below = [r["name"] for r in results if args.min_accuracy is not None and r["accuracy"] < args.min_accuracy]
    result = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        reference=f"sglang {SGLANG_VERSION} sglang.test.run_eval eval_name=gsm8k (GSM8KMixin CI settings)",
        settings=dict(num_shots=args.num_shots, num_questions=len(lines), parallel=args.parallel, api=args.api,
                      endpoint="/v1/completions" if args.api == "completion" else "/v1/chat/completions",
                      max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                      stop=DEFAULT_STOP if args.api == "completion" else None,
                      flush_cache=not args.no_flush_cache, data=str(args.data),
                      data_sha256=hashlib.sha256(args.data.read_bytes()).hexdigest()),
        min_accuracy=args.min_accuracy,
        below_min_accuracy=below,
        servers=results,
        agreement=agree,
    )
    (args.out / "gsm8k.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result, args.out / "gsm8k.md")
    write_plot(result, args.out / "gsm8k.png")
    for name, ag in agree.items():
        print(f"{name} vs {results[0]['name']}: answer agreement {ag['answer_agreement']:.3f}, "
              f"text agreement {ag['text_agreement']:.3f}")
    print(f"wrote {args.out / 'gsm8k.json'}, {args.out / 'gsm8k.md'}, {args.out / 'gsm8k.png'}")
    if below:
        print(f"FAIL: accuracy below --min-accuracy {args.min_accuracy}: "
              + ", ".join(f"{r['name']} {r['accuracy']:.3f}" for r in results if r["name"] in below),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
