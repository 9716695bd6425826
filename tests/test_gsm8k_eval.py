"""scripts/gsm8k_eval.py end to end against fake OpenAI-compatible servers (threading http.server on
127.0.0.1), and its replication of SGLang 0.5.14's GSM8K eval checked against SGLang's own code:
the split, the prompt, the answer extraction and the request bodies its samplers send."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gsm8k_eval.py"
DATA = ROOT / "sglang_ssm_modes" / "data" / "gsm8k" / "test.jsonl"
LICENSE = ROOT / "sglang_ssm_modes" / "data" / "gsm8k" / "LICENSE"
SHARED = Path("/work/shared/data/gsm8k")
DATA_SHA256 = "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"
STOP = ["Question", "Assistant:", "<|separator|>"]
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")

sys.path.insert(0, str(ROOT / "scripts"))
import gsm8k_eval  # noqa: E402

LINES = [json.loads(line) for line in DATA.read_text().splitlines()]
# the question's line in test.jsonl, found from the end of the prompt the script sends
SUFFIX_TO_LINE = {f"Question: {row['question']}\nAnswer:": i for i, row in enumerate(LINES)}


def _gold(i):
    return gsm8k_eval.get_answer_value(LINES[i]["answer"])


def _line_of(prompt):
    for suffix, i in SUFFIX_TO_LINE.items():
        if prompt.endswith(suffix):
            return i
    raise AssertionError(f"prompt ends with no GSM8K question: {prompt[-200:]!r}")


class FakeServer:
    """An OpenAI-compatible SGLang stand-in. behaviour: 'correct' (answers with the gold solution),
    'wrong' (even lines: no number, odd lines: gold + 1) or 'half' (even lines correct, odd lines no
    number). info: the /get_server_info body, ('server_info', body) to answer only /server_info, or
    None for neither."""

    def __init__(self, behaviour, info=None):
        self.behaviour, self.info = behaviour, info
        self.requests, self.gets = [], []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                with server.lock:
                    server.gets.append(self.path)
                info = server.info
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": "fake-model", "object": "model", "created": 0, "owned_by": "fake"}]})
                elif self.path == "/get_server_info" and isinstance(info, dict):
                    self._send(200, info)
                elif self.path == "/server_info" and isinstance(info, tuple):
                    self._send(200, info[1])
                elif self.path == "/flush_cache":
                    self._send(200, "Cache flushed.\n")
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((self.path, body))
                if self.path == "/v1/completions":
                    text = server.answer(body["prompt"])
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
                    obj = "text_completion"
                elif self.path == "/v1/chat/completions":
                    text = server.answer(body["messages"][-1]["content"])
                    choice = {"index": 0, "message": {"role": "assistant", "content": text},
                              "finish_reason": "stop"}
                    obj = "chat.completion"
                else:
                    return self._send(404, {"detail": "Not Found"})
                n = len(text.split())
                self._send(200, {"id": "cmpl-fake", "object": obj, "created": 0, "model": body["model"],
                                 "choices": [choice],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, prompt):
        i = _line_of(prompt)
        if self.behaviour == "correct" or (self.behaviour == "half" and i % 2 == 0):
            return " " + LINES[i]["answer"] + "\n\n"
        if self.behaviour == "wrong" and i % 2 == 1:
            return f" So the total is {_gold(i) + 1}."
        return " I am not sure how to solve this one."

    def completions(self):
        return [body for path, body in self.requests if path.startswith("/v1/")]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fakes():
    made = []

    def make(behaviour, info=None):
        made.append(FakeServer(behaviour, info))
        return made[-1]

    yield make
    for f in made:
        f.close()


@pytest.fixture(scope="module")
def sglang_gsm8k():
    """SGLang 0.5.14's own GSM8K eval module (imports torch: a few seconds, once)."""
    from sglang.test import simple_eval_gsm8k

    return simple_eval_gsm8k


def _env():
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def run_script(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=_env(), timeout=120)


def _dead_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------------------------------ data

def test_packaged_data_is_the_shared_copy():
    assert hashlib.sha256(DATA.read_bytes()).hexdigest() == DATA_SHA256 and len(LINES) == 1319
    assert "MIT License" in LICENSE.read_text()
    if SHARED.is_dir():
        assert DATA.read_bytes() == (SHARED / "test.jsonl").read_bytes()
        assert LICENSE.read_bytes() == (SHARED / "LICENSE").read_bytes()
    assert gsm8k_eval.default_data_path().resolve() == DATA.resolve()


# ------------------------------------------------------------------------ end to end, defaults

@pytest.mark.slow
def test_three_servers_end_to_end_with_sglang_ci_defaults(fakes, tmp_path, sglang_gsm8k):
    ok = fakes("correct", {"ssm_mode_config": {"mode": "native", "replay_history": 16}, "version": "0.5.14"})
    bad = fakes("wrong", ("server_info", {"ssm_state_mode": "compact"}))
    half = fakes("half", None)
    out = tmp_path / "res"
    proc = run_script("--server", f"native={ok.url}", "--server", f"compact={bad.url}",
                      "--server", f"replay={half.url}", "--out", out, "--min-accuracy", "0.9")
    assert proc.returncode == 1, proc.stderr
    assert "below --min-accuracy 0.9" in proc.stderr and "compact 0.000" in proc.stderr
    assert "gsm8k native" in proc.stderr and "200/200" in proc.stderr  # tqdm progress

    res = json.loads((out / "gsm8k.json").read_text())
    s = res["settings"]
    assert (s["num_shots"], s["num_questions"], s["api"], s["endpoint"]) == (5, 200, "completion", "/v1/completions")
    assert (s["max_tokens"], s["temperature"], s["top_p"], s["stop"]) == (512, 0.0, 1.0, STOP)
    assert s["data_sha256"] == DATA_SHA256
    by = {r["name"]: r for r in res["servers"]}
    assert [r["name"] for r in res["servers"]] == ["native", "compact", "replay"]
    assert (by["native"]["accuracy"], by["compact"]["accuracy"], by["replay"]["accuracy"]) == (1.0, 0.0, 0.5)
    assert (by["native"]["invalid"], by["compact"]["invalid"], by["replay"]["invalid"]) == (0.0, 0.5, 0.5)
    assert ((by["native"]["ssm_mode"], by["compact"]["ssm_mode"], by["replay"]["ssm_mode"])
            == ("native", "compact", None))
    assert by["native"]["server_version"] == "0.5.14" and by["native"]["model"] == "fake-model"
    for r in res["servers"]:
        assert r["request_errors"] == 0 and r["latency_s"] > 0 and r["output_throughput"] > 0
        assert [q["line"] for q in r["questions"]] == list(range(5, 205))
        assert all(q["label"] == _gold(q["line"]) for q in r["questions"])
    q = by["compact"]["questions"]
    assert q[0]["pred"] == _gold(5) + 1 and q[1]["pred"] == gsm8k_eval.INVALID  # line 5 odd, line 6 even
    assert res["below_min_accuracy"] == ["compact", "replay"]

    ag = res["agreement"]
    assert set(ag) == {"compact", "replay"}
    assert ag["compact"]["answer_agreement"] == 0.0 and ag["compact"]["only_first_correct"] == 200
    assert ag["replay"]["answer_agreement"] == 0.5 and ag["replay"]["both_correct"] == 100
    assert ag["replay"]["text_agreement"] == 0.5 and ag["replay"]["only_this_correct"] == 0
    assert ag["replay"]["disagreeing_questions"] == list(range(0, 200, 2))  # lines 5, 7, ... (odd)

    md = (out / "gsm8k.md").read_text()
    assert f"| native | {ok.url} | native | fake-model | 1.000 | 0.000 |" in md
    assert f"| replay | {half.url} | — | fake-model | 0.500 | 0.500 |" in md
    assert "below: compact, replay." in md
    assert (out / "gsm8k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # every server: one /flush_cache, then 200 requests exactly as SGLang's eval builds them
    ev = sglang_gsm8k.GSM8KEval(num_examples=200, num_threads=1, num_shots=5, data_path=str(DATA))
    want = sorted(ev._build_prefix(i) + sglang_gsm8k.get_one_example(ev._lines, i, False) for i in range(200))
    for f in (ok, bad, half):
        assert f.gets.count("/flush_cache") == 1
        bodies = f.completions()
        assert len(bodies) == 200 and {p for p, _ in f.requests} == {"/v1/completions"}
        assert sorted(b["prompt"] for b in bodies) == want
        for b in bodies:
            assert {k: v for k, v in b.items() if k != "prompt"} == dict(
                model="fake-model", temperature=0.0, top_p=1.0, max_tokens=512, stop=STOP)


def test_min_accuracy_met_exits_zero_url_form_and_chat(fakes, tmp_path):
    ok = fakes("correct")
    proc = run_script("--url", ok.url + "/", "--num-questions", 10, "--num-shots", 3, "--parallel", 4,
                      "--api", "chat", "--max-tokens", 64, "--temperature", 0.5, "--no-flush-cache",
                      "--min-accuracy", 0.99, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "gsm8k.json").read_text())
    (srv,) = res["servers"]
    assert srv["name"] == ok.url.removeprefix("http://") and srv["accuracy"] == 1.0 and srv["ssm_mode"] is None
    assert res["agreement"] == {} and res["below_min_accuracy"] == []
    assert "/flush_cache" not in ok.gets
    bodies = ok.completions()
    assert len(bodies) == 10 and all(p == "/v1/chat/completions" for p, _ in ok.requests)
    assert all(b["max_tokens"] == 64 and b["temperature"] == 0.5 and "stop" not in b for b in bodies)
    assert "all servers pass." in (tmp_path / "gsm8k.md").read_text()


# --------------------------------------------------------------------- the same as SGLang's eval

@pytest.mark.parametrize("k", [0, 1, 5, 8])
def test_split_and_prompt_are_sglangs(sglang_gsm8k, k):
    n = 40
    ev = sglang_gsm8k.GSM8KEval(num_examples=n, num_threads=1, num_shots=k, data_path=str(DATA))
    prefix, lines = gsm8k_eval.split_shots_questions(gsm8k_eval.read_jsonl(DATA), k, n)
    assert prefix == ev._few_shot_prompt and lines == ev._lines == LINES[k:k + n]
    for i in range(n):
        ours = gsm8k_eval.build_prompt(prefix, lines, i)
        assert ours == ev._build_prefix(i) + sglang_gsm8k.get_one_example(ev._lines, i, include_answer=False)
        assert ours.encode() == (ev._build_prefix(i) + sglang_gsm8k.get_one_example(ev._lines, i, False)).encode()
    if k == 1:  # literal, from simple_eval_gsm8k.py:21-29 and 78-81
        assert gsm8k_eval.build_prompt(prefix, lines, 0) == (
            f"Question: {LINES[0]['question']}\nAnswer: {LINES[0]['answer']}\n\n"
            f"Question: {LINES[1]['question']}\nAnswer:")


TRICKY = [
    "The answer is 18.", "#### 18", "$1,234,567 in total", "-7 degrees", "It costs 3.50 dollars",
    "5.", "12-4", "3.14.15", "1e5", "007", "0.5", "no number here", "", "−5 (unicode minus)",
    "Answer: 42\n\nQuestion: what is 7?", "1/2 of 10 is 5", "x = 10,000.25", "..5", "-0", "1,2,3",
    "the total is $2,000,000.", "100% of 99", "24 + 6 = 30\n#### 30",
]


def test_answer_extraction_is_sglangs(sglang_gsm8k):
    for s in TRICKY:
        assert gsm8k_eval.get_answer_value(s) == sglang_gsm8k.get_answer_value(s), s
        assert type(gsm8k_eval.get_answer_value(s)) is type(sglang_gsm8k.get_answer_value(s)), s
    assert gsm8k_eval.INVALID == sglang_gsm8k.INVALID
    ex = gsm8k_eval.get_answer_value
    assert ex("$1,234,567 in total") == 1234567 and ex("5.") == 5.0 and ex("12-4") == -4
    assert ex("007") == ex("no number here") == ex("") == gsm8k_eval.INVALID and ex("3.14.15") == 15
    assert all(ex(row["answer"]) == sglang_gsm8k.get_answer_value(row["answer"]) != gsm8k_eval.INVALID
               for row in LINES)


@pytest.mark.parametrize("api", ["completion", "chat"])
def test_requests_are_the_ones_sglangs_run_eval_sends(sglang_gsm8k, fakes, tmp_path, monkeypatch, api):
    """SGLang's own run_eval (CI arguments of GSM8KMixin) and the script, each against a fresh fake:
    the same request bodies on the same endpoint, and the same score."""
    from sglang.test.run_eval import run_eval_once

    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("OPENAI_API_KEY", "EMPTY")
    n = 12
    theirs, ours = fakes("half"), fakes("half")
    ev = sglang_gsm8k.GSM8KEval(num_examples=n, num_threads=4, num_shots=5, data_path=str(DATA))
    args = SimpleNamespace(api=api, max_tokens=512)  # eval_accuracy_kit.py:218-228
    result, _, _ = run_eval_once(args, theirs.url + "/v1", ev)
    proc = run_script("--url", ours.url, "--num-questions", n, "--parallel", 4, "--api", api, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    key = lambda body: json.dumps(body, sort_keys=True)  # noqa: E731
    assert sorted(p for p, _ in theirs.requests) == sorted(p for p, _ in ours.requests)
    assert sorted(map(key, theirs.completions())) == sorted(map(key, ours.completions()))
    assert len(ours.completions()) == n
    acc = json.loads((tmp_path / "gsm8k.json").read_text())["servers"][0]["accuracy"]
    assert acc == result.score == 0.5


# ------------------------------------------------------------------------------ validation

@pytest.mark.parametrize("args, message", [
    (["--num-questions", "1315"], "5 + --num-questions 1315 = 1320 lines, but"),
    (["--num-shots", "1319", "--num-questions", "1"], "has only 1319"),
    (["--num-questions", "0"], "--num-questions 0: must be >= 1"),
    (["--num-shots", "-1"], "--num-shots -1: must be >= 0"),
    (["--parallel", "0"], "--parallel 0: must be >= 1"),
    (["--min-accuracy", "1.5"], "--min-accuracy 1.5: must be in [0, 1]"),
    (["--url", "127.0.0.1:30000"], "not a valid http(s) URL"),
    (["--url", "ftp://127.0.0.1:30000"], "not a valid http(s) URL"),
    (["--url", "http://127.0.0.1:99999"], "not a valid URL"),
    (["--url", "http://127.0.0.1:30000/v1"], "without a path such as /v1"),
    (["--server", "native"], "expected NAME=URL"),
    (["--server", "a=http://127.0.0.1:1", "--server", "a=http://127.0.0.1:2"], "the name 'a' is given twice"),
    (["--data", "/nonexistent/test.jsonl"], "no such file"),
])
def test_argument_validation(tmp_path, args, message):
    proc = run_script(*args, "--out", tmp_path / "o")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


def test_unreachable_server_fails_before_any_question(fakes, tmp_path):
    ok, dead = fakes("correct"), _dead_url()
    proc = run_script("--server", f"native={ok.url}", "--server", f"replay={dead}", "--out", tmp_path / "o")
    assert proc.returncode == 2
    assert f"--server replay: server {dead} is not reachable ({dead}/v1/models" in proc.stderr, proc.stderr
    assert ok.completions() == [] and not (tmp_path / "o").exists()
    proc = run_script("--url", dead, "--out", tmp_path / "o")
    assert proc.returncode == 2 and f"server {dead} is not reachable" in proc.stderr


def test_bad_data_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n' * 10)
    proc = run_script("--data", bad, "--num-shots", 1, "--num-questions", 2, "--url", _dead_url())
    assert proc.returncode == 2 and "record 0 has no 'question' and 'answer'" in proc.stderr


def test_find_ssm_mode():
    f = gsm8k_eval.find_ssm_mode
    assert f(None) is None and f({}) is None and f({"ssm_state_mode": None}) is None
    assert f({"ssm_state_mode": "replay"}) == "replay"
    assert f({"ssm_mode_config": {"mode": "compact"}, "ssm_state_mode": None}) == "compact"
    assert f({"ssm_mode_config": "SSMModeConfig(mode='replay', replay_history=16)"}) == "replay"
