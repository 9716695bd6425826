"""Memory model: DESIGN §3 figures, GQA and TP accounting, SGLang parity, capacity and the CLI.

Expected values are written out by hand (or taken from SGLang's own classes), never by calling the
function under test a second time.
"""

import argparse
import json
import subprocess
import sys

import pytest
import torch

from sglang_ssm_modes.config import SSMModeConfig, SSMModeConfigError
from sglang_ssm_modes.sizing import (
    BUILTIN_SHAPES,
    LinearAttnShape,
    ModeBytes,
    ShapeError,
    fit_pool,
    layer_bytes,
    lightllm_native_value_head_bytes,
    load_config_json,
    local_shape,
    mamba_ratio,
    record_bytes,
    request_bytes,
    resolve_model,
    sglang_native_charge,
    value_head_bytes,
)
from sglang_ssm_modes.sizing.cli import add_memory_parser, run_memory

KIB = 1024
MIB = 1 << 20
GIB = 1 << 30
BF16 = torch.bfloat16


def kda_cfg(mode, length=16, d=3):
    return SSMModeConfig(mode=mode, replay_history=length, draft_tokens=d,
                         state_dtype=BF16, activation_dtype=BF16)


def kda_head(cfg):
    return value_head_bytes(cfg, family="kda", head_k_dim=128, head_v_dim=128)


# ----------------------------------------------------------------- DESIGN §3 (exact figures)

def test_design_record_sizes():
    # compact record: raw k 256 + raw v 256 + decay 512 (128 fp32) + beta 4
    assert record_bytes("compact", head_k_dim=128, head_v_dim=128, gate_width=128,
                        activation_dtype=BF16) == 256 + 256 + 512 + 4 == 1028
    # replay record: u 512 + normalised k 512 + g 512 + raw k 256 + raw v 256 + beta 4
    assert record_bytes("replay", head_k_dim=128, head_v_dim=128, gate_width=128,
                        activation_dtype=BF16) == 512 + 512 + 512 + 256 + 256 + 4 == 2052


def test_design_compact_figure():
    got = kda_head(kda_cfg("compact"))
    assert got == 32768 + 3 * 1028 == 35852
    assert round(got / KIB, 2) == 35.01


@pytest.mark.parametrize("length,exact,kib", [
    (16, 32768 + 32 * 2052 + 20, 96.14),
    (32, 32768 + 64 * 2052 + 20, 160.27),
    (64, 32768 + 128 * 2052 + 20, 288.52),
])
def test_design_replay_figures(length, exact, kib):
    """DESIGN §3's replay figures plus 12 B: beside its 8 B of cursor the served ring keeps a fold counter,
    fault flags (DESIGN §7) and the write-through's tickets per slot and layer, so each figure is 0.01 KiB above
    the document's."""
    got = kda_head(kda_cfg("replay", length=length))
    assert got == exact
    assert round(got / KIB, 2) == kib


def test_design_native_figures():
    assert lightllm_native_value_head_bytes(kda_cfg("native"), head_k_dim=128,
                                            head_v_dim=128) == 3 * 32768 == 96 * KIB
    assert kda_head(kda_cfg("native")) == 4 * 32768 == 128 * KIB
    assert kda_head(kda_cfg("native", d=1)) == 32768


def test_gdn_value_head_has_scalar_gate():
    # GDN record: raw k 256 + raw v 256 + one fp32 decay + beta = 520 B
    cfg = SSMModeConfig(mode="compact", draft_tokens=2, state_dtype=torch.float32,
                        activation_dtype=BF16)
    assert value_head_bytes(cfg, family="gdn", head_k_dim=128,
                            head_v_dim=128) == 128 * 128 * 4 + 2 * 520


def test_per_value_head_matches_one_head_layer():
    one_head = LinearAttnShape(family="kda", num_linear_layers=1, num_v_heads=1, num_k_heads=1,
                               head_k_dim=128, head_v_dim=128, conv_kernel=4, hidden_size=128,
                               source="test")
    for mode, length in (("compact", 16), ("replay", 16), ("replay", 64)):
        got = layer_bytes(one_head, kda_cfg(mode, length=length))
        assert got.state + got.scratch + got.history == kda_head(kda_cfg(mode, length=length))


# ----------------------------------------------------------------- GQA and TP

GQA = LinearAttnShape(family="gdn", num_linear_layers=1, num_v_heads=8, num_k_heads=2,
                      head_k_dim=16, head_v_dim=32, conv_kernel=4, hidden_size=64, source="test")


def test_gqa_keys_counted_per_key_head():
    fp32 = torch.float32
    compact = layer_bytes(GQA, SSMModeConfig(mode="compact", draft_tokens=3, state_dtype=fp32))
    # record: raw k HK*K*2 = 64, raw v HV*V*2 = 512, decay HV*4 = 32, beta HV*4 = 32 -> 640
    assert compact.scratch == 3 * 640
    assert compact.state == 8 * 32 * 16 * 4
    # conv window: (2*HK*K + HV*V) = 320 channels, K-1 = 3 columns, bf16; scratch D + K - 2 = 5 columns
    assert compact.conv == 320 * 3 * 2 and compact.conv_scratch == 320 * 5 * 2
    replay = layer_bytes(GQA, SSMModeConfig(mode="replay", replay_history=8, draft_tokens=3,
                                            state_dtype=fp32))
    # replay record: 640 + u HV*V*4 = 1024 + normalised k HK*K*4 = 128 -> 1792; 16 records + 20, per slot
    assert replay.history == 16 * 1792 + 20 and replay.scratch == 0
    assert replay.slot_bytes == replay.state + replay.conv + replay.history
    # counting k per value head instead would give 16 * (1792 + 6*16*6) + 16
    assert replay.history != 16 * (1792 + 6 * 16 * 6) + 20
    tree = layer_bytes(GQA, SSMModeConfig(mode="replay", replay_history=8, draft_tokens=3, state_dtype=fp32),
                       eagle_topk=2)
    assert tree.scratch == 3 * 640 and tree.conv_scratch == 3 * 320 * 3 * 2  # compact's records, dense window


def test_tp_division_qwen3_next():
    shape = BUILTIN_SHAPES["qwen3-next-80b"]
    loc = local_shape(shape, 4)
    assert (loc.num_v_heads, loc.num_k_heads, loc.conv_dim) == (8, 4, 2048)
    cost = layer_bytes(shape, SSMModeConfig(mode="native"), tp=4)
    assert cost.state == 8 * 128 * 128 * 4
    assert cost.conv == 2048 * 3 * 2
    compact = layer_bytes(shape, SSMModeConfig(mode="compact", draft_tokens=4), tp=4)
    # per rank: raw k 4*128*2 + raw v 8*128*2 + decay 8*4 + beta 8*4 = 3136 per record
    assert compact.scratch == 4 * 3136


def test_tp_replicates_key_groups_like_sglang():
    # HK 16 < tp 32: SGLang replicates the key groups to 32, one per rank
    loc = local_shape(BUILTIN_SHAPES["qwen3-next-80b"], 32)
    assert (loc.num_v_heads, loc.num_k_heads) == (1, 1)
    assert loc.conv_dim == (32 * 128 + 2 * 32 * 128) // 32


@pytest.mark.parametrize("tp", [3, 5, 64])
def test_tp_not_dividing_heads_is_rejected(tp):
    with pytest.raises(ShapeError, match=f"--tp {tp} does not divide"):
        local_shape(BUILTIN_SHAPES["qwen3-next-80b"], tp)


def test_kda_tp_division():
    loc = local_shape(BUILTIN_SHAPES["kimi-linear-48b"], 2)
    assert (loc.num_v_heads, loc.num_k_heads, loc.conv_dim) == (16, 16, 3 * 32 * 128 // 2)
    cost = layer_bytes(BUILTIN_SHAPES["kimi-linear-48b"],
                       SSMModeConfig(mode="compact", draft_tokens=4), tp=2)
    # 16 heads: raw k 16*256 + raw v 16*256 + decay 16*512 + beta 16*4
    assert cost.scratch == 4 * (16 * 256 + 16 * 256 + 16 * 512 + 16 * 4)


# ----------------------------------------------------------------- whole model

def test_qwen3_next_native_state_is_72_mib():
    cost = request_bytes(BUILTIN_SHAPES["qwen3-next-80b"], SSMModeConfig(mode="native"))
    assert cost.state == 36 * 32 * 128 * 128 * 4 == 72 * MIB
    assert cost.scratch == 0 and cost.conv_scratch == 0


def test_native_speculative_scratch():
    shape = BUILTIN_SHAPES["qwen3-next-80b"]
    chain = request_bytes(shape, SSMModeConfig(mode="native", draft_tokens=4))
    assert chain.scratch == 4 * 72 * MIB
    # deduplicated conv window: 8192 channels x (D + K - 2) columns, bf16, 36 layers
    assert chain.conv_scratch == 36 * 8192 * (4 + 4 - 2) * 2
    tree = request_bytes(shape, SSMModeConfig(mode="native", draft_tokens=4), eagle_topk=4)
    assert tree.conv_scratch == 36 * 4 * 8192 * 3 * 2


def test_compact_and_replay_keep_sglangs_conv_window_and_its_scratch():
    shape = BUILTIN_SHAPES["qwen3-next-80b"]
    native = request_bytes(shape, SSMModeConfig(mode="native", draft_tokens=4))
    for mode in ("compact", "replay"):
        cost = request_bytes(shape, SSMModeConfig(mode=mode, draft_tokens=4))
        assert (cost.conv, cost.conv_scratch) == (native.conv, native.conv_scratch)
    kda = request_bytes(BUILTIN_SHAPES["kimi-linear-48b"], SSMModeConfig(mode="compact", draft_tokens=4))
    assert kda.conv_scratch == 20 * 4 * (3 * 32 * 128) * 3 * 2  # dense for KDA


def test_builtin_shapes_are_the_released_models():
    qn = BUILTIN_SHAPES["qwen3-next-80b"]
    assert (qn.num_linear_layers, qn.num_v_heads, qn.num_k_heads, qn.hidden_size) == (36, 32, 16, 2048)
    assert 3 not in qn.linear_layer_ids and 47 not in qn.linear_layer_ids
    kimi = BUILTIN_SHAPES["kimi-linear-48b"]
    assert kimi.family == "kda" and kimi.hidden_size == 2304
    full_1based = {4, 8, 12, 16, 20, 24, 27}
    assert kimi.linear_layer_ids == tuple(i - 1 for i in range(1, 28) if i not in full_1based)
    assert (kimi.num_v_heads, kimi.num_k_heads, kimi.head_k_dim, kimi.conv_kernel) == (32, 32, 128, 4)
    assert BUILTIN_SHAPES["qwen3.5-35b-a3b"].num_linear_layers == 30
    big = BUILTIN_SHAPES["qwen3.5-397b-a17b"]
    assert (big.num_linear_layers, big.num_v_heads, big.num_k_heads) == (45, 64, 16)
    for shape in BUILTIN_SHAPES.values():
        assert shape.source


# ----------------------------------------------------------------- parity with SGLang's own sizing

@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16, 32])
def test_native_matches_sglang_mamba_cache_per_req_gdn(tp):
    from sglang.srt.configs.mamba_utils import (
        Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape)

    shape = BUILTIN_SHAPES["qwen3-next-80b"]
    sg = Mamba2CacheParams(
        shape=Mamba2StateShape.create(tp_world_size=tp, intermediate_size=32 * 128, n_groups=16,
                                      num_heads=32, head_dim=128, state_size=128, conv_kernel=4),
        layers=list(shape.linear_layer_ids),
        dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
    )
    ours = request_bytes(shape, SSMModeConfig(mode="native"), tp=tp)
    assert ours.total == sg.mamba_cache_per_req


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_native_matches_sglang_mamba_cache_per_req_kda(tp):
    from sglang.srt.configs.mamba_utils import (
        KimiLinearCacheParams, KimiLinearStateShape, Mamba2StateDType)

    shape = BUILTIN_SHAPES["kimi-linear-48b"]
    sg = KimiLinearCacheParams(
        shape=KimiLinearStateShape.create(tp_world_size=tp, num_heads=32, head_dim=128,
                                          conv_kernel_size=4),
        layers=list(shape.linear_layer_ids),
        dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.bfloat16),
    )
    ours = request_bytes(shape, SSMModeConfig(mode="native", state_dtype="bfloat16"), tp=tp)
    assert ours.total == sg.mamba_cache_per_req


# ----------------------------------------------------------------- capacity

def test_capacity_is_floor_of_budget_over_bytes():
    cost = ModeBytes(state=1000, scratch=300, conv=24)
    assert fit_pool(10 * 1324 - 1, cost).max_running_requests == 9
    assert fit_pool(10 * 1324, cost).max_running_requests == 10
    assert fit_pool(0, cost).max_running_requests == 0


def test_capacity_monotone_in_budget_and_compact_beats_native():
    shape = BUILTIN_SHAPES["qwen3-next-80b"]
    native = request_bytes(shape, SSMModeConfig(mode="native", draft_tokens=4), tp=4)
    compact = request_bytes(shape, SSMModeConfig(mode="compact", draft_tokens=4), tp=4)
    last = -1
    for gib in (1, 2, 5, 10, 20, 40):
        n = fit_pool(gib * GIB, native).max_running_requests
        c = fit_pool(gib * GIB, compact).max_running_requests
        assert n >= last and c > n
        last = n
    # hand figures at 20 GiB: native per layer 5 states of 512 KiB + conv 12288 + conv scratch
    # 24576; compact per layer 1 state + 4 records of 3136 + the same conv window and scratch; 36 layers
    assert native.total == 36 * (5 * 524288 + 12288 + 24576)
    assert compact.total == 36 * (524288 + 4 * 3136 + 12288 + 24576)
    assert fit_pool(20 * GIB, native).max_running_requests == 20 * GIB // native.total == 224
    assert fit_pool(20 * GIB, compact).max_running_requests == 20 * GIB // compact.total == 1039


def test_capacity_mirrors_sglang_ratio_formula():
    per_req, d, ratio, budget = 91_000_000, 4, 3, 20 * GIB
    fit = fit_pool(budget, sglang_native_charge(per_req, d), ratio=ratio)
    # SGLang: max_mamba_cache_size = int(budget // (per_req * (1 + D / ratio))), reqs = size // ratio
    expected_size = int(budget // (per_req * (1 + d / ratio)))
    assert fit.mamba_cache_size == expected_size
    assert fit.max_running_requests == expected_size // ratio
    plain = fit_pool(budget, sglang_native_charge(per_req, 1), ratio=ratio)
    assert plain.mamba_cache_size == budget // per_req
    assert fit_pool(budget, sglang_native_charge(per_req, 1), ratio=3,
                    max_running_requests=5).max_running_requests == 5


def test_mamba_ratio_matches_sglang_constants():
    from sglang.srt.model_executor import model_runner_kv_cache_mixin as mixin

    base = mixin.MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO
    assert mamba_ratio() == 1
    assert mamba_ratio(radix_cache=True) == base == 3
    assert mamba_ratio(radix_cache=True, extra_buffer=True) == \
        base + mixin.MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP
    assert mamba_ratio(radix_cache=True, lazy=True) == \
        base + mixin.MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP_LAZY
    assert mamba_ratio(radix_cache=True, extra_buffer=True, overlap_schedule=False) == \
        base + mixin.MAMBA_CACHE_V2_ADDITIONAL_RATIO_NO_OVERLAP


# ----------------------------------------------------------------- CLI

def parse(argv):
    parser = argparse.ArgumentParser(prog="sglang_ssm_modes")
    add_memory_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["memory", *argv])


def test_cli_table_contains_every_mode(capsys):
    args = parse(["--model", "qwen3-next-80b", "--tp", "4", "--pool-gib", "20",
                  "--draft-tokens", "4", "--state-dtype", "float32"])
    assert args.func is run_memory
    assert run_memory(args) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] + ":" + line.split()[1]: line.split()
            for line in out.splitlines() if line.split()[:1] in (["native"], ["compact"], ["replay"])}
    assert set(rows) == {"native:-", "compact:-", "replay:16", "replay:32", "replay:64"}
    assert rows["native:-"][6] == "224" and rows["compact:-"][6] == "1039"
    assert "shape from: Qwen3-Next-80B-A3B" in out


def test_cli_json(capsys):
    assert run_memory(parse(["--model", "kimi-linear-48b", "--tp", "2", "--draft-tokens", "4",
                             "--replay-history", "16", "--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in report["rows"]] == ["native", "compact", "replay"]
    compact = report["rows"][1]
    # 20 layers, 16 heads per rank: state 16*128*128*4; 4 records of 16*1028; conv 6144 x 3 x 2 and
    # KDA's dense scratch 4 x 6144 x 3 x 2
    assert compact["state_bytes"] == 20 * 16 * 128 * 128 * 4
    assert compact["scratch_bytes"] == 20 * 4 * 16 * 1028 and compact["history_bytes"] == 0
    assert compact["conv_bytes"] == 20 * (6144 * 3 * 2 + 4 * 6144 * 3 * 2)
    replay = report["rows"][2]
    assert replay["history_bytes"] == 20 * (32 * 16 * (1028 + 512 + 512) + 20)
    assert compact["max_running_requests"] == 20 * GIB // compact["total_bytes"]


@pytest.mark.parametrize("argv,needle", [
    (["--tp", "3"], "--tp 3 does not divide"),
    (["--draft-tokens", "20", "--replay-history", "16"], "--ssm-replay-history 16 is smaller"),
    (["--model", "no-such-model"], "neither a built-in model"),
])
def test_cli_rejects_bad_arguments(argv, needle, capsys):
    assert run_memory(parse(argv)) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--replay-history", "12"], ["--tp", "0"],
                                  ["--pool-gib", "-1"], ["--state-dtype", "int8"],
                                  ["--draft-tokens", "x"]])
def test_cli_argparse_errors(argv):
    with pytest.raises(SystemExit) as err:
        parse(argv)
    assert err.value.code == 2


def test_core_does_not_import_sglang():
    code = ("import sys, sglang_ssm_modes.config, sglang_ssm_modes.sizing, "
            "sglang_ssm_modes.sizing.cli; "
            "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------- config.json via SGLang's classes

from model_configs import KIMI_SMALL, LLAMA_SMALL, QWEN3_NEXT_SMALL  # noqa: E402


def write_config(tmp_path, name, cfg):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_qwen3_next_config_json_is_gdn(tmp_path):
    resolved = load_config_json(write_config(tmp_path, "qn", QWEN3_NEXT_SMALL))
    s = resolved.shape
    assert s.family == "gdn"
    assert s.linear_layer_ids == (0, 1, 2, 4, 5, 6)
    assert (s.num_v_heads, s.num_k_heads, s.head_k_dim, s.head_v_dim, s.conv_kernel,
            s.hidden_size) == (8, 4, 32, 64, 4, 256)
    assert resolved.state_dtype == "float32" and resolved.conv_dtype == "bfloat16"
    assert "qwen3_next" in s.source


def test_kimi_config_json_is_kda(tmp_path):
    folder = write_config(tmp_path, "kimi", KIMI_SMALL)
    s = load_config_json(folder / "config.json").shape
    assert s.family == "kda"
    assert s.linear_layer_ids == (0, 1, 2)
    assert (s.num_v_heads, s.num_k_heads, s.head_k_dim, s.head_v_dim) == (4, 4, 32, 32)


def test_config_json_state_dtype_from_config(tmp_path):
    cfg = dict(QWEN3_NEXT_SMALL, mamba_ssm_dtype="bfloat16")
    assert load_config_json(write_config(tmp_path, "qn16", cfg)).state_dtype == "bfloat16"


def test_non_hybrid_config_is_rejected(tmp_path, capsys):
    folder = write_config(tmp_path, "llama", LLAMA_SMALL)
    with pytest.raises(ShapeError) as err:
        resolve_model(str(folder))
    message = str(err.value)
    assert str(folder / "config.json") in message
    assert "has no GDN or KDA" in message
    assert run_memory(parse(["--model", str(folder)])) == 2
    assert "has no GDN or KDA" in capsys.readouterr().err


def test_cli_on_config_json(tmp_path, capsys):
    folder = write_config(tmp_path, "qn", QWEN3_NEXT_SMALL)
    assert run_memory(parse(["--model", str(folder), "--draft-tokens", "2", "--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    native = report["rows"][0]
    # 6 layers: state 8*64*32*4 = 65536; 2 intermediate states; conv 768 ch x 3 cols bf16;
    # conv scratch 768 x (2 + 2) bf16
    assert native["total_bytes"] == 6 * (3 * 65536 + 768 * 3 * 2 + 768 * 4 * 2)
    assert report["shape"]["family"] == "gdn"


def test_missing_config_file(tmp_path):
    with pytest.raises(ShapeError, match="no such config file"):
        load_config_json(tmp_path / "nothing")


def test_config_error_is_not_swallowed():
    with pytest.raises(SSMModeConfigError):
        SSMModeConfig(mode="replay", replay_history=8, draft_tokens=9)
