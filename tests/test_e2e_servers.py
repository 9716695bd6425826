"""scripts/e2e_servers.py end to end against stand-in servers (tests/fake_sglang_server.py): the real
script starts one process per configuration, sends the requests, judges parity against native and
writes its reports; what it would start on the GPU is checked against SGLang's real parser."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import e2e_report  # noqa: E402
import e2e_servers  # noqa: E402

FAKE = Path(__file__).with_name("fake_sglang_server.py")


@pytest.fixture
def fake_servers(monkeypatch, tmp_path):
    """Each mode's server is the stand-in with a behaviour: compact exact, replay noisy; the
    ``bf16`` variant is a near-tie divergence, ``nograph`` a real one, ``noradix`` a crash; a native server
    behaves as native except under ``maxrun8`` (a real divergence: another batching)."""
    behaviour = {"native": "exact", "compact": "exact", "replay": "noisy"}
    variant = {"bf16": "tie", "nograph": "wrong", "noradix": "crash", "maxrun8": "wrong"}

    def argv(cfg, model_dir, port):
        v = cfg["variants"][0] if cfg["variants"] else None
        b = (variant.get(v, behaviour[cfg["mode"]]) if v and (cfg["mode"] != "native" or v == "maxrun8")
             else behaviour[cfg["mode"]])
        return [sys.executable, str(FAKE), str(port), b]

    monkeypatch.setattr(e2e_servers, "server_argv", argv)
    for model in ("qwen3-next", "kimi-linear"):
        (tmp_path / "models" / model).mkdir(parents=True)
        (tmp_path / "models" / model / "config.json").write_text(json.dumps({"vocab_size": 97}))
    return tmp_path


def test_parity_and_reports(fake_servers):
    out = fake_servers
    configs = ["qwen3-next-compact-nextn", "qwen3-next-replay-L16-nextn", "qwen3-next-native-nextn",
               "qwen3-next-native-nextn-bf16", "qwen3-next-compact-nextn-bf16"]
    rc = e2e_servers.main(["--out", str(out), "--models", str(out / "models"), "--configs", *configs,
                           "--prompts", "3", "--new-tokens", "12",
                           "--port", "31900", "--start-timeout", "60"])
    assert rc == 0
    report = json.loads((out / "e2e_h200.json").read_text())
    rows = {r["name"]: r for r in report["configs"]}
    assert list(rows)[:2] == ["qwen3-next-native-nextn", "qwen3-next-native-nextn-bf16"], "natives run first"
    compact = rows["qwen3-next-compact-nextn"]["parity"]
    assert compact["greedy_agreement"] == 1.0 and compact["max_logprob_diff_teacher_forced"] == 0.0
    assert compact["teacher_forced_tokens"] == 3 * 12 + (16 + 23 + 30)  # continuation + extra tokens (16 + 7 i)
    replay = rows["qwen3-next-replay-L16-nextn"]["parity"]
    assert 0 < replay["max_logprob_diff_teacher_forced"] < 1e-5 and replay["greedy_agreement"] == 1.0
    tie = rows["qwen3-next-compact-nextn-bf16"]["parity"]
    assert tie["divergences"] and all(d["near_tie"] and d["position"] == 5 for d in tie["divergences"])
    assert tie["unexplained_divergences"] == 0
    assert rows["qwen3-next-compact-nextn"]["speed"]["accept_length"] == pytest.approx(3.0)
    assert "qwen3-next-compact-nextn" in (out / "e2e_h200.md").read_text()
    # the committed schema: one row per configuration and concurrency level
    table = {(r["config"], r["concurrency"]): r for r in report["rows"]}
    assert report["sglang_version"] == "0.5.14" and len(table) == 3 * len(configs)
    native, replay = table["qwen3-next-native-nextn", 8], table["qwen3-next-replay-L16-nextn", 32]
    assert native["tokens_equal_native"] and native["max_abs_logprob_diff"] == 0.0 and native["family"] == "gdn"
    assert replay["spec"] == "nextn" and replay["history"] == 16 and replay["draft_tokens"] == 4
    assert replay["tokens_equal_native"] and 0 < replay["max_abs_logprob_diff"] < 1e-5
    assert table["qwen3-next-compact-nextn-bf16", 1]["state_dtype"] == "bfloat16"
    assert not table["qwen3-next-compact-nextn-bf16", 1]["tokens_equal_native"]
    assert replay["tpot_ms"] > 0 and replay["throughput_tok_s"] > 0 and replay["mamba_pool_slots"] == 100
    assert replay["max_running_requests"] == 40  # what the scheduler runs with, not the argument (32)
    assert {r["mamba_pool_bytes"] for r in report["rows"]} == {1000 + 31900 + i for i in range(len(configs))}
    # two runs merged into the committed report: the later run's rows win, the core matrix gaps are named
    later = {**report, "commit": "later", "rows": [{**r, "tpot_ms": 99.0} for r in report["rows"]
                                                   if r["config"] == "qwen3-next-replay-L16-nextn"]}
    (out / "later.json").write_text(json.dumps(later))
    assert e2e_report.main([str(out / "e2e_h200.json"), str(out / "later.json"), "--out", str(out / "merged")]) == 0
    merged = json.loads((out / "merged" / "e2e_h200.json").read_text())
    assert merged["commit"] == "later" and len(merged["rows"]) == len(report["rows"])
    assert {r["tpot_ms"] for r in merged["rows"] if r["config"] == "qwen3-next-replay-L16-nextn"} == {99.0}
    assert ("qwen3-next-native-nospec" in merged["core_missing"]
            and "qwen3-next-native-nextn" not in merged["core_missing"])
    assert merged["rows"][0]["config"] == "qwen3-next-native-nextn"  # core matrix first
    merged_md = (out / "merged" / "e2e_h200.md").read_text()
    assert "| qwen3-next-replay-L16-nextn | 32 |" in merged_md and "near-tie tolerance 0.05" in merged_md
    assert (out / "merged" / "e2e_h200.png").stat().st_size > 10_000


def test_unexplained_divergence_and_failed_start_fail_the_run(fake_servers):
    out = fake_servers
    rc = e2e_servers.main(["--out", str(out), "--models", str(out / "models"), "--configs",
                           "kimi-linear-native-ngram", "kimi-linear-compact-ngram-nograph",
                           "kimi-linear-replay-L16-ngram-noradix", "--prompts", "2", "--new-tokens", "8",
                           "--port", "31950", "--start-timeout", "60", "--gsm8k", "3"])
    assert rc == 1
    rows = {r["name"]: r for r in json.loads((out / "e2e_h200.json").read_text())["configs"]}
    assert rows["kimi-linear-compact-ngram-nograph"]["parity"]["unexplained_divergences"] == 2
    # the GSM8K script ran against each live server; the "wrong" server answers differently from native
    gsm = rows["kimi-linear-compact-ngram-nograph"]
    assert len(gsm["gsm8k"]["answers"]) == 3 and gsm["parity"]["gsm8k_answer_agreement"] == 0.0
    assert (out / "gsm8k" / "kimi-linear-native-ngram" / "gsm8k.json").exists()
    crashed = rows["kimi-linear-replay-L16-ngram-noradix"]
    assert not crashed["started"] and "exited with 3" in crashed["error"]


def test_a_native_server_is_judged_against_native_and_never_fails_the_run(fake_servers):
    """``maxrun8`` (another batching of native itself) and ``nograph`` natives pair with the first native of
    their model and speculation, whatever order they are named in: their divergences are reported (the
    yardstick for a mode's) and the run passes; the reference native's row stays exact."""
    out = fake_servers
    configs = ["qwen3-next-native-nospec-maxrun8", "qwen3-next-replay-L16-nospec", "qwen3-next-native-nospec",
               "qwen3-next-native-nospec-nograph"]
    assert e2e_servers.main(["--out", str(out), "--models", str(out / "models"), "--configs", *configs,
                             "--prompts", "2", "--new-tokens", "10", "--concurrency", "2", "--port", "31990",
                             "--start-timeout", "60"]) == 0
    report = json.loads((out / "e2e_h200.json").read_text())
    rows = {r["name"]: r for r in report["configs"]}
    assert list(rows) == ["qwen3-next-native-nospec", "qwen3-next-native-nospec-nograph",
                          "qwen3-next-native-nospec-maxrun8", "qwen3-next-replay-L16-nospec"]
    assert "parity" not in rows["qwen3-next-native-nospec"]
    assert rows["qwen3-next-native-nospec-nograph"]["parity"]["greedy_agreement"] == 1.0
    spread = rows["qwen3-next-native-nospec-maxrun8"]["parity"]
    assert spread["unexplained_divergences"] == 2 and spread["greedy_agreement"] < 1.0
    table = {r["config"]: r for r in report["rows"]}
    assert table["qwen3-next-native-nospec"]["tokens_equal_native"]
    assert not table["qwen3-next-native-nospec-maxrun8"]["tokens_equal_native"]
    assert table["qwen3-next-native-nospec-maxrun8"]["unexplained_divergences"] == 2
    assert "--max-running-requests" in e2e_servers.VARIANTS["maxrun8"]
    assert "qwen3-next-replay-L16-nospec-maxrun8" not in e2e_servers.MATRIX


def test_parallel_layouts_are_judged_against_native_of_the_same_layout(fake_servers, monkeypatch):
    """``tp2`` / ``dp2`` / ``dpattn`` servers (issue 8) pair with the native server of their own layout; where
    fewer GPUs are visible than a configuration needs, the run stops before starting anything."""
    out = fake_servers
    configs = ["qwen3-next-compact-nextn-tp2", "qwen3-next-native-nextn", "qwen3-next-native-nextn-tp2"]
    base = ["--out", str(out), "--models", str(out / "models"), "--configs", *configs, "--prompts", "2",
            "--new-tokens", "8", "--port", "31980", "--start-timeout", "60"]
    monkeypatch.setattr(e2e_servers, "_gpu_count", lambda: 1)
    with pytest.raises(SystemExit) as exc:
        e2e_servers.main(base)
    assert exc.value.code == 2 and not (out / "e2e_h200.json").exists()
    monkeypatch.setattr(e2e_servers, "_gpu_count", lambda: 2)
    assert e2e_servers.main(base) == 0
    rows = {r["name"]: r for r in json.loads((out / "e2e_h200.json").read_text())["configs"]}
    assert e2e_servers.reference_key(rows["qwen3-next-compact-nextn-tp2"]) == e2e_servers.reference_key(
        rows["qwen3-next-native-nextn-tp2"]) != e2e_servers.reference_key(rows["qwen3-next-native-nextn"])
    assert rows["qwen3-next-compact-nextn-tp2"]["parity"]["greedy_agreement"] == 1.0
    assert [e2e_servers.gpus_needed(e2e_servers.MATRIX[f"kimi-linear-replay-L16-ngram{v}"])
            for v in ("", "-tp2", "-dp2", "-dpattn")] == [1, 2, 2, 2]


def test_hicache_eviction_variant_must_load_from_the_host(fake_servers, monkeypatch):
    """``hicacheevict``: the prefixes are pushed out before teacher forcing and the row records the server's
    host loads; a server that loaded nothing back fails the configuration (the variant missed its point)."""
    out = fake_servers
    behaviour = {"native": "hicache", "replay": "hicache", "compact": "hicachenoload"}
    monkeypatch.setattr(e2e_servers, "server_argv", lambda cfg, model_dir, port: [
        sys.executable, str(FAKE), str(port), behaviour[cfg["mode"]]])
    configs = ["qwen3-next-native-nextn-hicacheevict", "qwen3-next-replay-L16-nextn-hicacheevict",
               "qwen3-next-compact-nextn-hicacheevict"]
    rc = e2e_servers.main(["--out", str(out), "--models", str(out / "models"), "--configs", *configs,
                           "--prompts", "3", "--prompt-len", "64", "--new-tokens", "8", "--concurrency", "2",
                           "--port", "31990",
                           "--start-timeout", "60"])
    assert rc == 1
    report = json.loads((out / "e2e_h200.json").read_text())
    rows = {r["name"]: r for r in report["configs"]}
    replay = rows["qwen3-next-replay-L16-nextn-hicacheevict"]
    assert replay["hicache"]["sglang:load_back_tokens_total"] == 3 * 40  # the three teacher-forced requests
    assert replay["hicache"]["sglang:evicted_tokens_total"] == e2e_servers.EVICT_PROMPTS * 68
    assert replay["parity"]["greedy_agreement"] == 1.0 and "error" not in replay
    assert "loaded nothing back" in rows["qwen3-next-compact-nextn-hicacheevict"]["error"]
    assert all(r["hicache"] for r in report["rows"] if r["config"] == "qwen3-next-replay-L16-nextn-hicacheevict")
    assert "--max-total-tokens" in e2e_servers.VARIANTS["hicacheevict"]


def test_arguments_are_validated():
    for argv, message in ((["--configs", "nope"], "unknown configuration"), (["--prompts", "0"], "--prompts"),
                          (["--concurrency", "1", "64"], "--concurrency"),
                          (["--configs", "kimi-linear-replay-L16-nospec-hicacheevict"], "--prompt-len 64")):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "e2e_servers.py"), *argv], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr


def test_every_configuration_parses_with_sglangs_parser_and_the_plugin(tmp_path):
    """Each of the matrix's server command lines is accepted by SGLang 0.5.14's own parser with the
    plugin loaded (in a subprocess: hooks stay out of this process)."""
    driver = (
        "import json, sys\nfrom sglang.srt.plugins import load_plugins\nload_plugins()\n"
        "import argparse\nfrom sglang.srt.server_args import ServerArgs\n"
        "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\n"
        "bad = []\nfor name, argv in json.load(sys.stdin).items():\n"
        "    try: p.parse_args(argv)\n    except SystemExit: bad.append(name)\nprint(json.dumps(bad))\n")
    lines = {name: e2e_servers.server_argv(cfg, tmp_path, 30000)[3:] for name, cfg in e2e_servers.MATRIX.items()}
    proc = subprocess.run([sys.executable, "-c", driver], input=json.dumps(lines), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_ssm_metrics_are_read_from_a_prometheus_page():
    page = ("""# HELP sglang:ssm_state_folds_total Replay histories folded into their checkpoints.
sglang:num_running_reqs{model_name="m",tp_rank="0"} 3.0
sglang:ssm_state_folds_total{model_name="m",tp_rank="0"} 12.0
sglang:ssm_state_faults_total{kind="nonfinite",model_name="m"} 0.0
""" 'sglang:ssm_state_mode_info{decode_path="replay",draft_tokens="4",history="16",mode="replay",model_name="m",'
            'verify_path="replay"} 1.0\n')
    assert e2e_servers.ssm_metrics(page) == {
        "sglang:ssm_state_folds_total": 12.0, 'sglang:ssm_state_faults_total{kind="nonfinite"}': 0.0,
        'sglang:ssm_state_mode_info{decode_path="replay",draft_tokens="4",history="16",mode="replay",'
        'verify_path="replay"}': 1.0}
