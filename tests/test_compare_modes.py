"""scripts/compare_modes.py end to end against stand-in servers (tests/fake_sglang_server.py): one server
per mode in turn, the real GSM8K script against each, the serving sweep, one report."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import compare_modes  # noqa: E402

FAKE = Path(__file__).with_name("fake_sglang_server.py")


def test_one_server_per_mode_and_one_report(monkeypatch, tmp_path):
    behaviour = {"native": "exact", "compact": "exact", "replay": "wrong"}  # replay answers GSM8K differently
    seen, real_argv = [], compare_modes.server_argv

    def argv(model_path, mode, history, port, extra):
        seen.append(real_argv(model_path, mode, history, port, extra))
        return [sys.executable, str(FAKE), str(port), behaviour[mode]]

    monkeypatch.setattr(compare_modes, "server_argv", argv)
    rc = compare_modes.main(["--model-path", "some/model", "--out", str(tmp_path), "--port", "32100",
                             "--gsm8k-questions", "4", "--gsm8k-shots", "1", "--concurrency", "1", "4",
                             "--speed-tokens", "6", "--", "--tp", "4", "--speculative-algorithm", "NEXTN"])
    assert rc == 0
    # each mode's server got the user's arguments and its own mode flag
    assert [a[a.index("--ssm-state-mode") + 1] for a in seen] == ["native", "compact", "replay"]
    assert all(a[a.index("--tp") + 1] == "4" for a in seen) and seen[2][-2:] == ["--ssm-replay-history", "16"]
    report = json.loads((tmp_path / "compare_modes.json").read_text())
    rows = {(r["mode"], r["concurrency"]): r for r in report["rows"]}
    assert set(rows) == {(m, c) for m in ("native", "compact", "replay") for c in (1, 4)}
    assert rows["compact", 4]["gsm8k_answer_agreement"] == 1.0 and rows["replay", 1]["gsm8k_answer_agreement"] == 0.0
    assert rows["native", 1]["gsm8k_answer_agreement"] == 1.0
    assert rows["replay", 4]["tpot_ms"] > 0 and rows["replay", 4]["mamba_pool_bytes"] == 1000 + 32102
    gsm = json.loads((tmp_path / "gsm8k" / "gsm8k.json").read_text())
    assert [s["name"] for s in gsm["servers"]] == ["native", "compact", "replay"]
    assert "| replay | 4 |" in (tmp_path / "compare_modes.md").read_text()
    assert (tmp_path / "compare_modes.png").stat().st_size > 10_000
    assert (tmp_path / "logs" / "replay.log").exists()


def test_a_failed_server_is_reported_and_fails_the_run(monkeypatch, tmp_path):
    monkeypatch.setattr(compare_modes, "server_argv",
                        lambda m, mode, h, port, extra: [sys.executable, str(FAKE), str(port),
                                                         "crash" if mode == "compact" else "exact"])
    rc = compare_modes.main(["--model-path", "m", "--out", str(tmp_path), "--port", "32150", "--modes", "native",
                             "compact", "--gsm8k-questions", "0", "--concurrency", "2", "--speed-tokens", "4"])
    assert rc == 1
    assert "**compact failed**: RuntimeError: server exited with 3" in (tmp_path / "compare_modes.md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["--", "--ssm-state-mode", "replay"], "choose a mode (--ssm-state-mode)"),
    (["--modes", "native", "native"], "each mode once"),
    (["--concurrency", "0"], "--concurrency"),
])
def test_bad_arguments_are_refused(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_modes.py"), "--model-path", "m",
                           "--out", str(tmp_path), *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


def test_dry_run_prints_the_command_lines(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_modes.py"), "--model-path", "M",
                           "--out", str(tmp_path), "--dry-run", "--replay-history", "32", "--", "--tp", "4"],
                          capture_output=True, text=True, timeout=60, check=True)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3 and lines[2].endswith("--tp 4 --ssm-state-mode replay --ssm-replay-history 32")
    assert "--port 30001" in lines[1]
