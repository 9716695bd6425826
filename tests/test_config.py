"""SSMModeConfig: every validation rule fails with a message naming the flag and the fix."""

import dataclasses

import pytest
import torch

from sglang_ssm_modes.config import (
    MODES,
    REPLAY_HISTORIES,
    SSMModeConfig,
    SSMModeConfigError,
)


def test_constants():
    assert MODES == ("native", "compact", "replay")
    assert REPLAY_HISTORIES == (8, 16, 32, 64)
    assert issubclass(SSMModeConfigError, ValueError)


def test_defaults():
    cfg = SSMModeConfig()
    assert cfg.mode == "native"
    assert cfg.replay_history == 16
    assert cfg.draft_tokens == 1
    assert cfg.state_dtype is torch.float32
    assert cfg.activation_dtype is torch.bfloat16


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("length", REPLAY_HISTORIES)
def test_good_configs_pass(mode, length):
    cfg = SSMModeConfig(mode=mode, replay_history=length, draft_tokens=min(length, 8),
                        state_dtype=torch.bfloat16, activation_dtype=torch.float16)
    assert cfg.mode == mode and cfg.replay_history == length


def test_replay_history_equal_to_draft_tokens_is_allowed():
    assert SSMModeConfig(mode="replay", replay_history=8, draft_tokens=8).draft_tokens == 8


def test_frozen():
    cfg = SSMModeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.mode = "replay"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.draft_tokens = 4
    assert hash(cfg) == hash(SSMModeConfig())


@pytest.mark.parametrize("mode", ["Native", "fast", "", None])
def test_bad_mode(mode):
    with pytest.raises(SSMModeConfigError, match="--ssm-state-mode") as err:
        SSMModeConfig(mode=mode)
    assert "native, compact, replay" in str(err.value)


@pytest.mark.parametrize("length", [0, 4, 12, 128, -16, True, "16", 16.0])
def test_bad_replay_history(length):
    with pytest.raises(SSMModeConfigError, match="--ssm-replay-history") as err:
        SSMModeConfig(mode="replay", replay_history=length)
    assert "8, 16, 32, 64" in str(err.value)


@pytest.mark.parametrize("mode", ["native", "replay"])
def test_fast_compact_verify_needs_compact_mode(mode):
    with pytest.raises(SSMModeConfigError) as err:
        SSMModeConfig(mode=mode, compact_verify="fast")
    assert str(err.value) == (f"--ssm-compact-verify fast applies to --ssm-state-mode compact only, not {mode}: "
                              "pass --ssm-state-mode compact or drop --ssm-compact-verify")
    with pytest.raises(SSMModeConfigError, match="pass --ssm-compact-verify with one of: exact, fast"):
        SSMModeConfig(mode="compact", compact_verify="faster")
    cfg = SSMModeConfig(mode="compact", compact_verify="fast")
    assert SSMModeConfig(**cfg.to_dict()) == cfg


def test_history_is_checked_in_every_mode():
    with pytest.raises(SSMModeConfigError, match="--ssm-replay-history 12"):
        SSMModeConfig(mode="compact", replay_history=12)


@pytest.mark.parametrize("d", [0, -1, 1.5, True, "4", None])
def test_bad_draft_tokens(d):
    with pytest.raises(SSMModeConfigError, match="--speculative-num-draft-tokens") as err:
        SSMModeConfig(draft_tokens=d)
    assert ">= 1" in str(err.value)


def test_replay_needs_history_at_least_draft_tokens():
    with pytest.raises(SSMModeConfigError) as err:
        SSMModeConfig(mode="replay", replay_history=8, draft_tokens=16)
    assert str(err.value) == (
        "--ssm-replay-history 8 is smaller than --speculative-num-draft-tokens 16: replay needs "
        "L >= D; pass --ssm-replay-history 16 or larger"
    )
    with pytest.raises(SSMModeConfigError, match="pass --ssm-replay-history 32 or larger"):
        SSMModeConfig(mode="replay", replay_history=16, draft_tokens=17)


def test_replay_draft_tokens_beyond_every_history():
    with pytest.raises(SSMModeConfigError,
                       match="reduce --speculative-num-draft-tokens to 64 or less"):
        SSMModeConfig(mode="replay", replay_history=64, draft_tokens=65)


def test_history_below_draft_tokens_is_fine_outside_replay():
    assert SSMModeConfig(mode="compact", replay_history=8, draft_tokens=16).ring_records == 16
    assert SSMModeConfig(mode="native", replay_history=8, draft_tokens=16).ring_records == 0


@pytest.mark.parametrize("name,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                        ("float16", torch.float16), ("torch.float16", torch.float16)])
def test_dtype_names_are_normalised(name, dtype):
    cfg = SSMModeConfig(state_dtype=name, activation_dtype=name)
    assert cfg.state_dtype is dtype and cfg.activation_dtype is dtype


@pytest.mark.parametrize("bad", ["int8", "fp32", torch.int8, torch.float64, 4, None])
def test_bad_state_dtype(bad):
    with pytest.raises(SSMModeConfigError, match="--mamba-ssm-dtype") as err:
        SSMModeConfig(state_dtype=bad)
    assert "float32, bfloat16, float16" in str(err.value)


@pytest.mark.parametrize("bad", ["int8", torch.float64])
def test_bad_activation_dtype(bad):
    with pytest.raises(SSMModeConfigError, match="--dtype"):
        SSMModeConfig(activation_dtype=bad)


@pytest.mark.parametrize("mode,length,d,expected", [
    ("native", 16, 4, 0),
    ("compact", 16, 4, 4),
    ("compact", 64, 1, 1),
    ("replay", 16, 4, 32),
    ("replay", 64, 3, 128),
    ("replay", 8, 1, 16),
])
def test_ring_records(mode, length, d, expected):
    assert SSMModeConfig(mode=mode, replay_history=length, draft_tokens=d).ring_records == expected


def test_speculative_flag():
    assert not SSMModeConfig(draft_tokens=1).speculative
    assert SSMModeConfig(draft_tokens=2).speculative
