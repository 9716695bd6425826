"""The startup validation, table-driven over the choices of SGLang 0.5.14's own argument parser: for
every mode, model family and value of each server flag that touches the recurrent state, the plugin
either accepts or refuses with one message naming the flag and the fix. The table must cover every
choice the parser offers, so a value SGLang adds cannot be forgotten."""

import argparse

import pytest
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_ssm_modes.config import REPLAY_HISTORIES, SSMModeConfigError
from sglang_ssm_modes.integration.cli_args import add_ssm_mode_args, resolve_ssm_mode
from sglang_ssm_modes.integration.validation import validate_mode

MODES = ("native", "compact", "replay")
FAMILIES = {"gdn": "Qwen3NextConfig", "kda": "KimiLinearConfig", None: "LlamaConfig"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    add_ssm_mode_args(p)
    return p


def choices(flag: str) -> list:
    (action,) = [a for a in parser()._actions if flag in a.option_strings]
    return list(action.choices)


# flag -> {value: modes refused (with that flag named in the message)}; every parser choice listed
CHOICE_TABLE = {
    "--mamba-radix-cache-strategy": {"auto": (), "no_buffer": (), "extra_buffer": (), "extra_buffer_lazy": ()},
    "--linear-attn-backend": {"triton": (), "cutedsl": (), "flashinfer": ()},
    "--linear-attn-decode-backend": {"triton": (), "cutedsl": (), "flashinfer": ()},
    "--linear-attn-prefill-backend": {"triton": (), "cutedsl": (), "flashinfer": ()},
    "--mamba-backend": {"triton": (), "flashinfer": ()},
    "--mamba-ssm-dtype": {"float32": (), "bfloat16": (), "float16": ()},
    "--disaggregation-mode": {"null": (), "prefill": (), "decode": ()},
    "--cuda-graph-backend-decode": {"full": (), "breakable": (), "tc_piecewise": (), "disabled": ()},
    "--cuda-graph-backend-prefill": {"full": (), "breakable": (), "tc_piecewise": (), "disabled": ()},
    "--ssm-compact-verify": {"exact": (), "fast": ("native", "replay")},
}
SWITCHES = {  # boolean flags and free values: (argv, modes refused, flag named)
    "hicache": (["--enable-hierarchical-cache", "--hicache-mem-layout", "page_first_direct"], (), None),
    "hicache_page_first": (["--enable-hierarchical-cache"], ("compact", "replay"), "--hicache-mem-layout"),
    "int8_ckpt": (["--enable-int8-mamba-checkpoint"], (), None),
    "no_overlap": (["--disable-overlap-schedule"], (), None),
    "page_16": (["--page-size", "16"], (), None),
    "tp_2": (["--tp-size", "2"], (), None),
    "dp_attention": (["--dp-size", "2", "--enable-dp-attention"], (), None),
    "no_radix": (["--disable-radix-cache"], (), None),
    "adaptive_spec": (["--speculative-algorithm", "EAGLE", "--speculative-adaptive"], ("compact", "replay"),
                      "--speculative-adaptive"),
    "ray": (["--use-ray"], ("compact", "replay"), "--use-ray"),
}


def judge(mode: str, family, argv: list[str], draft: int | None = None, tree: bool = False,
          config_name: str | None = None):
    """``None`` when the plugin accepts, else its error message."""
    args = parser().parse_args(["--model-path", "m", "--ssm-state-mode", mode, *argv])
    try:
        cfg = resolve_ssm_mode(args, draft_tokens=draft, state_dtype=args.mamba_ssm_dtype, tree_verify=tree)
        validate_mode(cfg, args, family, config_name or FAMILIES[family])
    except SSMModeConfigError as e:
        return str(e)
    return None


def test_the_table_covers_every_choice_of_sglangs_parser():
    for flag, table in CHOICE_TABLE.items():
        assert sorted(map(str, choices(flag))) == sorted(table), flag


@pytest.mark.parametrize("family", ["gdn", "kda"])
@pytest.mark.parametrize("mode", MODES)
def test_each_choice_is_accepted_or_refused_naming_the_flag(mode, family):
    for flag, table in CHOICE_TABLE.items():
        for value, refused_modes in table.items():
            message = judge(mode, family, [flag, value])
            if mode in refused_modes:
                assert message and f"{flag} {value}" in message and "--ssm-state-mode compact" in message
            else:
                assert message is None, (flag, value, message)
    for name, (argv, refused_modes, named) in SWITCHES.items():
        message = judge(mode, family, argv)
        if mode in refused_modes:
            assert message and named in message, (name, message)
        else:
            assert message is None, (name, message)


@pytest.mark.parametrize("mode", ["native", "compact"])
def test_a_replay_history_outside_replay_is_refused(mode):
    """``--ssm-replay-history`` (or its alias) sets what only replay uses: outside replay it is refused, like
    ``--ssm-compact-verify`` outside compact; the environment's value is neither checked nor used there."""
    for flag in ("--ssm-replay-history", "--linear-replayssm-cache-len"):
        message = judge(mode, "gdn", [flag, "32"])
        assert f"{flag} 32" in message and "--ssm-state-mode replay" in message and f"drop {flag}" in message


@pytest.mark.parametrize("mode", MODES)
def test_models_without_gdn_or_kda_layers(mode):
    message = judge(mode, None, [])
    if mode == "native":
        assert message is None
    else:
        assert "LlamaConfig" in message and "--ssm-state-mode" in message


SPEC_ALGORITHMS = sorted(a.name for a in SpeculativeAlgorithm if a is not SpeculativeAlgorithm.NONE) + ["NEXTN"]


@pytest.mark.parametrize("algorithm", SPEC_ALGORITHMS)
def test_every_speculative_algorithm_with_its_verify_width(algorithm):
    """Every algorithm commits through the hooked acceptance (EAGLE v2 / NEXTN / NGRAM / STANDALONE /
    FROZEN_KV_MTP via ``commit_mamba_states_after_verify``, DFLASH via the backend method), so every
    one is served; replay's chain verify needs L >= D, its tree verify (compact's records) any L; a verify
    width of 1 (no draft token) is refused."""
    for draft in (1, 2, 4, 12, 16, 17, 64, 65):
        for history in REPLAY_HISTORIES:
            for mode in MODES:
                argv = ["--speculative-algorithm", algorithm] + (
                    ["--ssm-replay-history", str(history)] if mode == "replay" else [])
                for tree in (False, True):
                    message = judge(mode, "gdn", argv, draft=draft, tree=tree)
                    if mode != "native" and draft == 1:
                        assert "verifies no draft token" in message and "verify width of 1" in message
                        assert "--speculative-num-steps 1 or more" in message  # top-k 1: D is steps + 1
                    elif mode == "replay" and history < draft and not tree:
                        assert f"--ssm-replay-history {history}" in message
                        assert f"--speculative-num-draft-tokens {draft}" in message
                        assert ("--speculative-num-steps" in message) == (draft > REPLAY_HISTORIES[-1])
                    else:
                        assert message is None, (algorithm, draft, history, mode, tree, message)


@pytest.mark.parametrize("config_name", ["JetNemotronConfig", "JetVLMConfig"])
@pytest.mark.parametrize("mode", MODES)
def test_gdn_models_with_their_own_recurrent_kernel_are_refused(mode, config_name):
    """SGLang counts JetNemotron / JetVLM as Gated DeltaNet hybrids, but their ``JetBlock`` runs its own
    kernel on the pool's state, bypassing the backend the modes hook."""
    import sglang.srt.model_executor.model_runner as model_runner

    assert hasattr(model_runner, config_name), "still one of SGLang's GDN hybrid configs"
    message = judge(mode, "gdn", [], config_name=config_name)
    if mode == "native":
        assert message is None
    else:
        assert config_name in message and "own recurrent kernel" in message and "drop --ssm-state-mode" in message
