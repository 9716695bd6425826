"""A stand-in for ``sglang.launch_server`` speaking the few endpoints scripts/e2e_servers.py uses
(``/health``, ``/generate`` (also streamed), ``/server_info``, and for scripts/gsm8k_eval.py ``/v1/models``,
``/flush_cache``, ``/v1/completions``), so the scripts' own logic runs in the CPU tests.

    python fake_sglang_server.py PORT BEHAVIOUR

Greedy tokens and log-probabilities are a deterministic function of the input ids. BEHAVIOUR:
``exact`` (as native), ``noisy`` (log-probs off by 1e-6), ``tie`` (diverges where the top-2 gap is a
near-tie), ``wrong`` (diverges where it is not), ``crash`` (exits before answering), ``hicache`` (as
native, and its ``/metrics`` counts host loads: the teacher-forced requests that follow 160 short ones, as
if those had pushed the cached prefixes to the host), ``hicachenoload`` (as ``hicache``, never loading).
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, BEHAVIOUR = int(sys.argv[1]), sys.argv[2]
VOCAB = 97
SEEN = {"short": 0, "loads": 0}  # requests of 4 new tokens; teacher-forced ones after 160 of them


def next_token(ids):
    return (sum(ids[-3:]) * 31 + len(ids)) % VOCAB


def logprob(ids, t):
    return -((sum(ids) + t) % 13) / 7 - (1e-6 if BEHAVIOUR == "noisy" else 0.0)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/metrics"):
            page = (f'sglang:load_back_tokens_total{{model_name="m",tp_rank="0"}} {40.0 * SEEN["loads"]}\n'
                    f'sglang:evicted_tokens_total{{model_name="m",tp_rank="0"}} {68.0 * SEEN["short"]}\n')
            data = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif "server_info" in self.path:
            self._send({"max_total_num_tokens": 65536, "max_running_requests": 32, "tp_size": 1, "dp_size": 1,
                        "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4, "version": "0.5.14",
                        "internal_states": [{"effective_max_running_requests_per_dp": 40}]})
        elif self.path.startswith("/v1/models"):
            self._send({"object": "list", "data": [{"id": "fake", "object": "model"}]})
        else:  # /health, /flush_cache
            self._send({})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.startswith("/v1/completions"):  # scripts/gsm8k_eval.py: an answer from the prompt
            answer = sum(map(ord, req["prompt"])) % 100 + (1 if BEHAVIOUR == "wrong" else 0)
            self._send({"id": "x", "object": "text_completion", "created": 0, "model": "fake",
                        "choices": [{"index": 0, "text": f" So the answer is {answer}.", "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 6, "total_tokens": 7}})
            return
        if req.get("stream"):  # server-sent events, one per token, as SGLang streams them
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for n in range(1, req["sampling_params"]["max_new_tokens"] + 1):
                self.wfile.write(b"data: " + json.dumps({"meta_info": {"completion_tokens": n}}).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            return
        ids, start = list(req["input_ids"]), req.get("logprob_start_len", 0)
        new_tokens = req["sampling_params"]["max_new_tokens"]
        SEEN["short"] += new_tokens == 4
        SEEN["loads"] += new_tokens == 1 and SEEN["short"] >= 160 and BEHAVIOUR == "hicache"
        input_lp = [[None, ids[0], None]] + [[logprob(ids[:i], ids[i]), ids[i], None] for i in range(1, len(ids))]
        out, out_lp, top = [], [], []
        for step in range(req["sampling_params"]["max_new_tokens"]):
            t = next_token(ids)
            gap = 0.01 if step == 5 else 1.0  # every server: a near-tie at step 5 only
            diverge_at = {"tie": 5, "wrong": 7}.get(BEHAVIOUR)
            if step == diverge_at and len(ids) > 30:  # generation, not the teacher-forced calls
                t = (t + 1) % VOCAB
            out.append(t)
            out_lp.append([logprob(ids, t), t, None])
            top.append([[logprob(ids, t), t, None], [logprob(ids, t) - gap, (t + 1) % VOCAB, None]])
            ids.append(t)
        self._send({"output_ids": out, "meta_info": {
            "input_token_logprobs": input_lp[start:], "output_token_logprobs": out_lp, "output_top_logprobs": top,
            "completion_tokens": len(out), "spec_verify_ct": max(1, len(out) // 3)}})


if BEHAVIOUR == "crash":
    sys.exit(3)
print(f"sglang-ssm-modes: mamba pool allocated: mode={BEHAVIOUR} slots=100 bytes={1000 + PORT}", flush=True)
ThreadingHTTPServer.request_queue_size = 64  # the serving-speed phase connects 32 clients at once
ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
