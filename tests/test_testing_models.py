"""The seeded test models of ``sglang_ssm_modes.testing.models``, checked on CPU against SGLang
0.5.14 itself: its config loader, its hybrid-model detection, its model classes (built on CPU in a
one-process gloo group) and their ``load_weights``, its tokenizer / processor loaders; plus the
HF transformers reference implementation for a forward pass of the two Qwen models."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import socket
import sys
import types
import warnings
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from sglang_ssm_modes.testing import models as tm

pytestmark = pytest.mark.slow

EXPECTED = {
    # kind: (config class of get_config, architecture, text-config class, family)
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3NextConfig", "gdn"),
    "kimi-linear": ("KimiLinearConfig", "KimiLinearForCausalLM", "KimiLinearConfig", "kda"),
    "qwen3.5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "Qwen3_5TextConfig", "gdn"),
}
DRAFT_ARCH = {"qwen3-next": "Qwen3NextForCausalLMMTP", "qwen3.5": "Qwen3_5ForCausalLMMTP"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("test_models")
    assert tm.main(["--kind", "all", "--out", str(root), "--seed", "0"]) == 0
    return {kind: root / kind for kind in tm.KINDS}


def _text_config(raw: dict) -> dict:
    return raw.get("text_config", raw)


# ------------------------------------------------------------------------------------------------
# files, determinism, sizes
# ------------------------------------------------------------------------------------------------


def test_files_sizes_and_determinism(model_dirs, tmp_path):
    for kind, d in model_dirs.items():
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", "special_tokens_map.json"):
            assert (d / f).is_file(), (kind, f)
        size = (d / "model.safetensors").stat().st_size
        assert 10e6 < size < 60e6, (kind, size)
        assert json.loads((d / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (model_dirs["qwen3.5"] / "preprocessor_config.json").is_file()

    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()
    again = tm.make_test_model("kimi-linear", tmp_path / "same", seed=0)
    other = tm.make_test_model("kimi-linear", tmp_path / "other", seed=1)
    assert digest(again) == digest(model_dirs["kimi-linear"])
    assert digest(other) != digest(again)
    with pytest.raises(ValueError):
        tm.make_test_model("mamba", tmp_path / "x")


# ------------------------------------------------------------------------------------------------
# (b) SGLang's config loader and hybrid-model detection
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_cpu():
    """SGLang's global server args and a one-process gloo model-parallel group (TP = PP = 1)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.server_args as sa_mod
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.models.registry import ModelRegistry  # import every model module now

    args = object.__new__(sa_mod.ServerArgs)  # the dataclass defaults, without __post_init__
    for f in dataclasses.fields(sa_mod.ServerArgs):
        if f.default is not dataclasses.MISSING:
            setattr(args, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(args, f.name, f.default_factory())
    args.device = "cpu"
    args.mm_process_config = {}
    previous = sa_mod._global_server_args
    sa_mod.set_global_server_args_for_scheduler(args)
    owns_process_group = not torch.distributed.is_initialized()
    owns_parallel_state = not ps.model_parallel_is_initialized()
    if owns_parallel_state:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ps.init_distributed_environment(  # keeps an existing torch.distributed group
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
        )
        ps.initialize_model_parallel(1)
    try:
        yield SimpleNamespace(args=args, registry=ModelRegistry)
    finally:
        if owns_parallel_state:
            ps.destroy_model_parallel()
        if owns_process_group:
            ps.destroy_distributed_environment()
        sa_mod._global_server_args = previous


def _model_config(path: Path, draft: bool = False):
    from sglang.srt.configs.model_config import ModelConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ModelConfig(str(path), is_draft_model=draft)


@pytest.mark.parametrize("kind", tm.KINDS)
def test_sglang_config_and_hybrid_detection(kind, model_dirs, sglang_cpu):
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.utils.hf_transformers_utils import get_config

    from sglang_ssm_modes.sizing.shapes import load_config_json

    path = model_dirs[kind]
    cfg_cls, arch, text_cls, family = EXPECTED[kind]
    raw = json.loads((path / "config.json").read_text())
    assert type(get_config(str(path), trust_remote_code=False)).__name__ == cfg_cls

    mc = _model_config(path)
    assert type(mc.hf_config).__name__ == cfg_cls
    assert mc.hf_config.architectures == [arch]
    assert type(mc.hf_text_config).__name__ == text_cls
    assert mc.dtype == torch.bfloat16
    assert mc.context_len == tm.MAX_POSITIONS
    assert mc.is_multimodal == (kind == "qwen3.5")
    assert mc.hf_text_config.vocab_size == _text_config(raw)["vocab_size"]

    # the properties ModelRunner picks its linear-attention backend and MambaPool from
    runner = SimpleNamespace(model_config=mc, is_draft_worker=False)
    gdn = ModelRunner.hybrid_gdn_config.fget(runner)
    kda = ModelRunner.kimi_linear_config.fget(runner)
    hybrid = gdn if family == "gdn" else kda
    assert hybrid is not None and (kda if family == "gdn" else gdn) is None
    assert hybrid is mc.hf_text_config
    assert hybrid.linear_layer_ids == [0, 1, 2]
    assert hybrid.full_attention_layer_ids == [3]
    with mock.patch("sglang.srt.layers.dp_attention.get_attention_tp_size", return_value=1):
        cache = hybrid.mamba2_cache_params
    assert list(cache.layers) == [0, 1, 2]
    if kind == "kimi-linear":
        assert mc.attention_arch.name == "MLA"

    resolved = load_config_json(path)  # this package's own reading of the config
    s = resolved.shape
    assert s.family == family and s.linear_layer_ids == (0, 1, 2)
    assert (s.head_k_dim, s.head_v_dim, s.conv_kernel, s.hidden_size) == (128, 128, 4, 512)
    if family == "gdn":
        assert (s.num_k_heads, s.num_v_heads) == (tm.GDN_K_HEADS, tm.GDN_V_HEADS) == (4, 8)
    else:
        assert s.num_k_heads == s.num_v_heads == tm.KDA_HEADS == 8

    if kind in DRAFT_ARCH:
        draft = _model_config(path, draft=True)
        assert draft.hf_config.architectures == [DRAFT_ARCH[kind]]
        assert draft.hf_config.num_nextn_predict_layers == 1


# ------------------------------------------------------------------------------------------------
# (c) the checkpoint against SGLang's model classes and load_weights
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _cpu_construction(dtype):
    """What SGLang's CPU-less construction needs: device-module calls answered by torch.cpu, no
    CUDA streams, and a stand-in for ``vllm._custom_ops`` (RotaryEmbedding imports its fallback
    kernel when it is not on CUDA; no forward is run here)."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    vllm = types.ModuleType("vllm")
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        stack.enter_context(mock.patch.dict(sys.modules, {"vllm": vllm, "vllm._custom_ops": ops}))
        stack.enter_context(mock.patch("torch.get_device_module", lambda *a: torch.cpu))
        stack.enter_context(mock.patch("torch.cuda.Stream", lambda *a, **k: None))
        stack.enter_context(set_default_torch_dtype(dtype))
        stack.enter_context(torch.device("cpu"))
        yield


def _build(path: Path, sglang_cpu, draft: bool, fuse_shared_expert: bool = False):
    from sglang.srt.layers.dp_attention import initialize_dp_attention

    mc = _model_config(path, draft)
    sglang_cpu.args.model_path = str(path)
    initialize_dp_attention(sglang_cpu.args, mc)
    cls, arch = sglang_cpu.registry.resolve_model_cls(mc.hf_config.architectures)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_cpu_construction(mc.dtype))
        if fuse_shared_expert:  # what CUDA does: the shared expert becomes fused expert 8
            stack.enter_context(mock.patch("sglang.srt.models.qwen2_moe._is_cuda", True))
        model = cls(mc.hf_config)
    return arch, model


_CODE0 = 0x3F80  # bf16 bit pattern of 1.0; tensor i is filled with the bf16 value of CODE0 + i


def _load_codes(model, tensors: list[tuple[str, torch.Tensor]]):
    """Fill every parameter with NaN, load ``tensors`` (tensor i filled with code i) through the
    model's own ``load_weights``; return ({param: set of codes in it}, [params with NaN left])."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    model.load_weights(iter(tensors))
    codes, unwritten = {}, []
    for name, p in params.items():
        if torch.isnan(p).any():
            unwritten.append(name)
            continue
        bits = p.detach().to(torch.bfloat16).contiguous().view(torch.int16).flatten().long()
        codes[name] = set((torch.unique(bits) - _CODE0).tolist())
    return codes, unwritten


CASES = [("qwen3-next", False), ("qwen3-next", True), ("kimi-linear", False), ("qwen3.5", False)]


@pytest.mark.parametrize("kind,fuse", CASES, ids=["qwen3-next", "qwen3-next-fused-shared-expert",
                                                  "kimi-linear", "qwen3.5"])
def test_checkpoint_loads_into_every_sglang_parameter(kind, fuse, model_dirs, sglang_cpu):
    """Every tensor of the checkpoint is taken by SGLang's ``load_weights`` of the target or of its
    MTP draft model, every parameter of both is written (save the draft's embedding and head,
    which SGLang shares from the target), and no value arrives altered (shape checks are the
    loaders' own)."""
    from safetensors.torch import load_file

    path = model_dirs[kind]
    sd = load_file(str(path / "model.safetensors"))
    names = sorted(sd)
    assert len(names) < 0x7FC0 - _CODE0  # codes stay finite, distinct bf16 values
    coded = []
    for i, n in enumerate(names):
        value = torch.tensor(_CODE0 + i, dtype=torch.int16).view(torch.bfloat16).item()
        coded.append((n, torch.full_like(sd[n], value)))

    seen: set[int] = set()
    for draft in ([False, True] if kind in DRAFT_ARCH else [False]):
        arch, model = _build(path, sglang_cpu, draft, fuse_shared_expert=fuse)
        assert arch == (DRAFT_ARCH[kind] if draft else EXPECTED[kind][1])
        if fuse:
            assert model.num_fused_shared_experts == 1
        codes, unwritten = _load_codes(model, coded)
        shared = {"model.embed_tokens.weight", "lm_head.weight"} if draft else set()
        assert sorted(unwritten) == sorted(shared), f"{arch}: parameters not in the checkpoint"
        for pname, cs in codes.items():
            assert cs <= set(range(len(names))), f"{arch}: {pname} holds values not loaded as-is"
            seen |= cs
    missing = [names[i] for i in sorted(set(range(len(names))) - seen)]
    assert not missing, f"checkpoint tensors no SGLang parameter took: {missing[:10]}"


def test_qwen3_next_mtp_names(model_dirs):
    from safetensors import safe_open

    with safe_open(str(model_dirs["qwen3-next"] / "model.safetensors"), "pt") as f:
        mtp = sorted(k for k in f.keys() if k.startswith("mtp."))
    assert "mtp.fc.weight" in mtp and "mtp.norm.weight" in mtp
    assert "mtp.layers.0.self_attn.q_proj.weight" in mtp
    assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in mtp
    assert {"mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"} <= set(mtp)


# ------------------------------------------------------------------------------------------------
# (d) tokenizer
# ------------------------------------------------------------------------------------------------

SAMPLES = [
    "Alice has 12 apples. She buys 7 more at the market; how many apples does she have now?",
    "The lighthouse keeper climbed the narrow stairs every evening at dusk.\n\n  Indented\ttab.",
    "Ünïcödé — naïve café, 日本語のテキスト, emoji 🙂, math: 3.14 × 2 = 6.28!",
    "def f(x):\n    return x ** 2  # comment\n",
    "",
]


def test_tokenizer_round_trip_and_vocab(model_dirs):
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    ids = tm.special_token_ids()
    for kind, path in model_dirs.items():
        raw = json.loads((path / "config.json").read_text())
        tok = get_tokenizer(str(path))
        vocab = _text_config(raw)["vocab_size"]
        assert len(tok) <= vocab and vocab % 64 == 0 and vocab - len(tok) < 64, (kind, len(tok))
        for text in SAMPLES:
            enc = tok.encode(text, add_special_tokens=False)
            assert tok.decode(enc) == text
            assert all(0 <= i < len(tok) for i in enc)
        assert len(tok.encode(SAMPLES[0], add_special_tokens=False)) < len(SAMPLES[0]) / 2.5
        assert tok.eos_token_id == ids[tm.IM_END] == _text_config(raw)["eos_token_id"]
        assert tok.convert_tokens_to_ids(tm.IM_START) == ids[tm.IM_START]
        prompt = tok.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
            tokenize=False, add_generation_prompt=True,
        )
        assert prompt == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        parts = tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}],
            tokenize=False, add_generation_prompt=True,
        )
        assert parts == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((model_dirs["qwen3-next"] / "generation_config.json").read_text())
    assert ids[tm.IM_END] in gen["eos_token_id"]


def test_qwen3_5_processor_matches_config(model_dirs, sglang_cpu):
    from sglang.srt.utils.hf_transformers_utils import get_processor

    path = model_dirs["qwen3.5"]
    raw = json.loads((path / "config.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proc = get_processor(str(path))
    assert proc.image_token_id == raw["image_token_id"]
    assert proc.video_token_id == raw["video_token_id"]
    assert proc.vision_start_token_id == raw["vision_start_token_id"]
    assert proc.vision_end_token_id == raw["vision_end_token_id"]
    assert proc.image_processor.patch_size == raw["vision_config"]["patch_size"]
    assert proc.image_processor.merge_size == raw["vision_config"]["spatial_merge_size"]


# ------------------------------------------------------------------------------------------------
# (e) weight statistics, and a reference forward pass (HF transformers) of the Qwen models
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", tm.KINDS)
def test_weight_statistics(kind, model_dirs):
    from safetensors.torch import load_file

    sd = load_file(str(model_dirs[kind] / "model.safetensors"))
    _, specs = tm.model_spec(kind)
    assert sorted(sd) == sorted(s.name for s in specs)
    r = tm.INITIALIZER_RANGE
    for s in specs:
        t = sd[s.name].float()
        assert tuple(t.shape) == s.shape, s.name
        assert t.dtype == torch.float32 and sd[s.name].dtype == (
            torch.float32 if s.fp32 else torch.bfloat16), s.name
        if s.init == "normal":
            tol = 0.05 if t.numel() >= 4096 else 4 / math.sqrt(t.numel())
            assert abs(t.std().item() / r - 1) < tol, (s.name, t.std().item())
            assert abs(t.mean().item()) < 4 * r / math.sqrt(t.numel()), s.name
            assert t.unique().numel() > min(t.numel() // 2, 1000), s.name  # not a constant
        elif s.init in ("zeros", "ones"):
            assert torch.equal(t, torch.full_like(t, float(s.init == "ones"))), s.name
        elif s.init == "a_log":
            a = t.exp()
            assert 1 <= a.min() and a.max() <= 16 and a.std() > 1, s.name
        elif s.init == "dt_bias":
            dt = torch.nn.functional.softplus(t)
            assert 1e-4 <= dt.min() and dt.max() <= 0.1 + 1e-6, s.name
        else:  # pragma: no cover
            raise AssertionError(s.init)
    # the norm conventions of the real models
    zero_centred = kind != "kimi-linear"
    final = "model.language_model.norm.weight" if kind == "qwen3.5" else "model.norm.weight"
    assert sd[final].float().abs().sum().item() == (0 if zero_centred else sd[final].numel())
    for name in sd:
        if name.endswith(("linear_attn.norm.weight", "self_attn.o_norm.weight")):
            assert torch.all(sd[name] == 1), name  # GDN / KDA gated output norms: plain weight


@pytest.mark.parametrize("kind", ["qwen3-next", "qwen3.5"])
def test_hf_reference_forward_depends_on_state(kind, model_dirs):
    """HF transformers loads the checkpoint with no missing or unexpected key, its logits are far
    from the constant logits of ``--load-format dummy`` and depend on the recurrent state: making
    every GDN head forget at once (A_log = 10) moves the last position's logits a lot."""
    import transformers

    cls = {"qwen3-next": transformers.Qwen3NextForCausalLM,
           "qwen3.5": transformers.Qwen3_5ForConditionalGeneration}[kind]
    path = model_dirs[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = cls.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.tensor([tok.encode(" ".join(SAMPLES[:2]), add_special_tokens=False)])
    a_logs = [p for n, p in model.named_parameters() if n.endswith("linear_attn.A_log")]
    assert len(a_logs) == 3
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
        for p in a_logs:
            p.fill_(10.0)
        amnesic = model(input_ids=ids).logits[0, -1].float()
    assert logits.std(-1).min() > 0.2  # dummy weights: ~0
    assert logits.argmax(-1).unique().numel() > ids.shape[1] // 2  # depends on the input
    lp = logits.log_softmax(-1)
    assert (lp.exp().max(-1).values > 2 / logits.shape[-1]).all()  # top-1 above 2x uniform
    change = (amnesic - logits[-1]).norm() / logits[-1].norm()
    assert change > 0.3, change.item()
