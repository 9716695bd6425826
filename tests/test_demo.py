"""`make demo` runs as shipped, and its checks can fail."""

import subprocess
import sys

import pytest
import torch

from sglang_ssm_modes.demo import layer_state
from sglang_ssm_modes.demo.run import run_demo


def test_demo_command_runs_and_agrees():
    proc = subprocess.run([sys.executable, "-m", "sglang_ssm_modes", "demo", "--rounds", "12"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for line in ("compact", "replay"):
        assert any(l.startswith(line) and l.rstrip().endswith("OK") for l in out.splitlines()), out
    assert "native" in out and "max running" in out.lower()


def test_demo_folds_replay_history_and_compact_is_bit_identical():
    res = run_demo(rounds=10, draft_tokens=4, history=8, batch=3, padding_rows=1, seed=3)
    assert res["compact"]["bitwise"] and res["compact"]["max_state_rel"] == 0.0
    assert res["replay"]["folds"] > 0
    assert 0 < res["replay"]["max_state_rel"] < 1e-5


def test_demo_detects_an_off_by_one_commit(monkeypatch):
    """A compact commit that keeps one draft token too many (the classic acceptance bug) is caught."""
    real = layer_state.compact_commit

    def one_too_many(state, records, last_index, parents=None, compute_dtype=torch.float32):
        d = records.k_raw.shape[1]
        return real(state, records, torch.where(last_index >= 0, (last_index + 1).clamp_max(d - 1), last_index),
                    parents, compute_dtype)

    monkeypatch.setattr(layer_state, "compact_commit", one_too_many)
    res = run_demo(rounds=3, draft_tokens=4, history=8, batch=2, padding_rows=1, seed=4)
    assert not res["compact"]["bitwise"]


def test_demo_rejects_bad_arguments():
    from sglang_ssm_modes.demo import main

    with pytest.raises(SystemExit):
        main(["--replay-history", "2", "--draft-tokens", "4"])
