"""The SGLang plugin: discovered by SGLang's own loader, flags on SGLang's real parser and
``prepare_server_args`` (in subprocesses, so hooks never leak into other tests), validation at startup."""

import json
import subprocess
import sys
import textwrap

import pytest

from model_configs import LLAMA_SMALL, QWEN3_NEXT_SMALL
from sglang_ssm_modes.config import SSMModeConfigError
from sglang_ssm_modes.integration.cli_args import resolve_ssm_mode

SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"]

CASES = {  # name: (extra argv, env)
    "default": ([], {}),
    "compact_spec": (["--ssm-state-mode", "compact", *SPEC], {}),
    "replay_alias": (["--enable-linear-replayssm", "--linear-replayssm-cache-len", "32", *SPEC], {}),
    "env": ([], {"SGLANG_SSM_STATE_MODE": "replay", "SGLANG_SSM_REPLAY_HISTORY": "8"}),
    "history_too_small": (["--ssm-state-mode", "replay", "--ssm-replay-history", "8", *SPEC[:2],
                           "--speculative-num-steps", "15", "--speculative-eagle-topk", "1",
                           "--speculative-num-draft-tokens", "16"], {}),
    "alias_conflict": (["--enable-linear-replayssm", "--ssm-state-mode", "compact"], {}),
    "replay_spec_flag": (["--enable-linear-replayssm-spec"], {}),
    "replay_pd": (["--ssm-state-mode", "replay", "--disaggregation-mode", "decode"], {}),
    "compact_not_hybrid": (["--ssm-state-mode", "compact", "@llama"], {}),
    "native_not_hybrid": (["@llama"], {}),
    "engine_env": (["@engine"], {"SGLANG_SSM_STATE_MODE": "compact"}),
    "flag_over_env": (["--ssm-state-mode", "replay"], {"SGLANG_SSM_STATE_MODE": "compact"}),
    "compact_fast": (["--ssm-state-mode", "compact", "--ssm-compact-verify", "fast", *SPEC], {}),
    "compact_fast_env": (["--ssm-state-mode", "compact"], {"SGLANG_SSM_COMPACT_VERIFY": "fast"}),
    "fast_without_compact": (["--ssm-compact-verify", "fast", *SPEC], {}),
    "fast_env_replay": (["--ssm-state-mode", "replay"], {"SGLANG_SSM_COMPACT_VERIFY": "fast"}),
    "bad_fast_env": (["--ssm-state-mode", "compact"], {"SGLANG_SSM_COMPACT_VERIFY": "quick"}),
    # the flags override the environment before either is validated
    "flag_native_over_env_on_llama": (["--ssm-state-mode", "native", "@llama"], {"SGLANG_SSM_STATE_MODE": "compact"}),
    "flag_history_over_env": (["--ssm-state-mode", "replay", "--ssm-replay-history", "16", *SPEC[:2],
                               "--speculative-num-steps", "15", "--speculative-eagle-topk", "1",
                               "--speculative-num-draft-tokens", "16"], {"SGLANG_SSM_REPLAY_HISTORY": "8"}),
    "flag_over_bad_env": (["--ssm-state-mode", "compact"], {"SGLANG_SSM_STATE_MODE": "Replay"}),
    "bad_env_mode": ([], {"SGLANG_SSM_STATE_MODE": "Replay"}),
    "env_history_too_small": (["--ssm-state-mode", "replay", *SPEC[:2], "--speculative-num-steps", "15",
                               "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "16"],
                              {"SGLANG_SSM_REPLAY_HISTORY": "8"}),
    "spec_without_draft": (["--ssm-state-mode", "compact", *SPEC[:2], "--speculative-num-steps", "0",
                            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "1"], {}),
    "replay_tree_short_history": (["--ssm-state-mode", "replay", "--ssm-replay-history", "8", *SPEC[:2],
                                   "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
                                   "--speculative-num-draft-tokens", "16"], {}),
    "draft_flag_without_algorithm": (["--ssm-state-mode", "compact", "--speculative-num-draft-tokens", "16"], {}),
    "bf16_state": (["--ssm-state-mode", "compact", "--mamba-ssm-dtype", "bfloat16"], {}),
}

DRIVER = textwrap.dedent("""
    import contextlib, io, json, os, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    model, llama, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    out = {}
    for name, (argv, env) in cases.items():
        saved = dict(os.environ)
        os.environ.update(env)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                path = llama if "@llama" in argv else model
                argv = [a for a in argv if a != "@llama"]
                if argv == ["@engine"]:  # sglang.Engine(**kwargs) builds ServerArgs directly, no flags
                    from sglang.srt.server_args import ServerArgs
                    sa = ServerArgs(model_path=path, device="cpu", disable_radix_cache=True)
                else:
                    sa = prepare_server_args(["--model-path", path, "--device", "cpu", "--disable-radix-cache", *argv])
            c = sa.ssm_mode_config
            json.dumps(c)  # plain values: SGLang serialises its server args (/server_info)
            out[name] = {"mode": c["mode"], "history": c["replay_history"], "draft_tokens": c["draft_tokens"],
                         "compact_verify": c["compact_verify"]}
            out.setdefault("@state_dtype", {})[name] = c["state_dtype"]
            out.setdefault("@tree_verify", {})[name] = c["tree_verify"]
        except SystemExit as e:
            out[name] = {"exit": e.code, "stderr": err.getvalue()[-400:]}
        except Exception as e:
            out[name] = {"error": type(e).__name__, "message": str(e)}
        finally:
            os.environ.clear(); os.environ.update(saved)
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model = tmp_path_factory.mktemp("qwen3_next_small")
    (model / "config.json").write_text(json.dumps(QWEN3_NEXT_SMALL))
    llama = tmp_path_factory.mktemp("llama_small")
    (llama / "config.json").write_text(json.dumps(LLAMA_SMALL))
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(model), str(llama), json.dumps(CASES)],
                          capture_output=True, text=True, timeout=600)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


def test_entry_point_is_discovered_by_sglangs_loader():
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert "ssm_modes" in plugins
    assert plugins["ssm_modes"][0].__module__ == "sglang_ssm_modes.integration.plugin"


def test_flags_resolve_through_prepare_server_args(results):
    """Flags, aliases and environment resolve into the mode configuration on SGLang's ServerArgs."""
    assert results["default"] == {"mode": "native", "history": 16, "draft_tokens": 1, "compact_verify": "exact"}
    assert results["compact_spec"] == {"mode": "compact", "history": 16, "draft_tokens": 4, "compact_verify": "exact"}
    assert results["replay_alias"] == {"mode": "replay", "history": 32, "draft_tokens": 4, "compact_verify": "exact"}
    assert results["env"] == {"mode": "replay", "history": 8, "draft_tokens": 1, "compact_verify": "exact"}
    assert results["native_not_hybrid"]["mode"] == "native"
    assert results["engine_env"] == {"mode": "compact", "history": 16, "draft_tokens": 1, "compact_verify": "exact"}
    assert results["flag_over_env"]["mode"] == "replay"
    assert results["compact_fast"] == {"mode": "compact", "history": 16, "draft_tokens": 4, "compact_verify": "fast"}
    assert results["compact_fast_env"]["compact_verify"] == "fast"
    assert results["fast_env_replay"]["compact_verify"] == "exact", "the environment's applies to compact only"
    assert results["replay_pd"] == {"mode": "replay", "history": 16, "draft_tokens": 1,
                                    "compact_verify": "exact"}, "replay serves PD"


def test_flags_override_the_environment_before_either_is_checked(results):
    """An environment value the flags override is never validated (nor refused) on its own; a bad or too
    small one that does apply is named as the environment variable it came from."""
    assert results["flag_native_over_env_on_llama"]["mode"] == "native"
    assert results["flag_history_over_env"] == {"mode": "replay", "history": 16, "draft_tokens": 16,
                                                "compact_verify": "exact"}
    assert results["flag_over_bad_env"]["mode"] == "compact"
    r = results["bad_env_mode"]
    assert r["error"] == "SSMModeConfigError" and "SGLANG_SSM_STATE_MODE='Replay'" in r["message"], r
    r = results["env_history_too_small"]
    assert r["error"] == "SSMModeConfigError" and "came from SGLANG_SSM_REPLAY_HISTORY" in r["message"], r


def test_verify_width_and_shape_at_startup(results):
    """A speculative algorithm verifying no draft token is refused; a tree verify in replay needs no L >= D
    (it runs on compact's records); a draft width without an algorithm is no verify (D = 1); the state dtype
    reported is the pool's."""
    r = results["spec_without_draft"]
    assert r["error"] == "SSMModeConfigError" and "verifies no draft token" in r["message"], r
    assert results["replay_tree_short_history"] == {"mode": "replay", "history": 8, "draft_tokens": 16,
                                                    "compact_verify": "exact"}
    assert results["@tree_verify"]["replay_tree_short_history"] and not results["@tree_verify"]["compact_spec"]
    assert results["draft_flag_without_algorithm"]["draft_tokens"] == 1
    assert results["@state_dtype"]["bf16_state"] == "bfloat16"
    assert results["@state_dtype"]["compact_spec"] == "float32"


def test_bad_combinations_fail_at_startup_naming_the_flag(results):
    r = results["history_too_small"]
    assert r["error"] == "SSMModeConfigError"
    assert "--ssm-replay-history 8" in r["message"] and "--speculative-num-draft-tokens 16" in r["message"]
    assert results["alias_conflict"]["error"] == "SSMModeConfigError"
    assert "pass only one of them" in results["alias_conflict"]["message"]
    r = results["replay_spec_flag"]
    assert r["exit"] == 2 and "--ssm-state-mode replay" in r["stderr"]
    r = results["compact_not_hybrid"]
    assert r["error"] == "SSMModeConfigError" and "LlamaConfig" in r["message"], r
    assert "drop --ssm-state-mode" in r["message"]
    r = results["fast_without_compact"]
    assert r["error"] == "SSMModeConfigError" and "--ssm-compact-verify fast" in r["message"], r
    assert "--ssm-state-mode compact" in r["message"]
    r = results["bad_fast_env"]
    assert r["error"] == "SSMModeConfigError" and "SGLANG_SSM_COMPACT_VERIFY='quick'" in r["message"], r


def test_every_hook_target_exists_in_sglang():
    """Each target the plugin hooks resolves to a function of SGLang 0.5.14 (SGLang itself would only
    log a missing one; the pool hook then refuses to start)."""
    import importlib

    from sglang_ssm_modes.integration.hook_targets import MODE_TARGETS
    from sglang_ssm_modes.integration.plugin import HOOKS

    assert set(HOOKS) == set(MODE_TARGETS), "every mode target has its hook, and nothing else is checked"
    for target in HOOKS:
        module, cls, attr = target.rsplit(".", 2)
        assert callable(getattr(getattr(importlib.import_module(module), cls), attr)), target


def test_launch_server_help_shows_the_flags():
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--ssm-state-mode {native,compact,replay}", "--ssm-replay-history",
                 "--ssm-compact-verify {exact,fast}", "--enable-linear-replayssm",
                 "--linear-replayssm-cache-len"):
        assert flag in proc.stdout


def test_environment_values_apply_to_their_own_mode_only(monkeypatch):
    """One environment can serve every mode: its replay history is neither checked nor used outside replay
    (and named as the environment's where it is wrong for replay); an empty mode variable means unset."""
    import argparse

    from sglang_ssm_modes.config import SSMModeConfig

    monkeypatch.setenv("SGLANG_SSM_REPLAY_HISTORY", "12")
    cfg = resolve_ssm_mode(argparse.Namespace(ssm_state_mode="compact"), draft_tokens=4, state_dtype=None)
    assert cfg.mode == "compact" and cfg.replay_history == SSMModeConfig().replay_history
    with pytest.raises(SSMModeConfigError, match="came from SGLANG_SSM_REPLAY_HISTORY"):
        resolve_ssm_mode(argparse.Namespace(ssm_state_mode="replay"), draft_tokens=4, state_dtype=None)
    monkeypatch.setenv("SGLANG_SSM_STATE_MODE", "")
    assert resolve_ssm_mode(argparse.Namespace(), draft_tokens=None, state_dtype=None).mode == "native"


def test_resolve_rejects_a_bad_environment_value(monkeypatch):
    import argparse

    monkeypatch.setenv("SGLANG_SSM_REPLAY_HISTORY", "sixteen")
    with pytest.raises(SSMModeConfigError, match="SGLANG_SSM_REPLAY_HISTORY"):
        resolve_ssm_mode(argparse.Namespace(ssm_state_mode="replay"), draft_tokens=None, state_dtype=None)
