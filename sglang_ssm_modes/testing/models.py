"""Small seeded hybrid GDN / KDA checkpoints that a real SGLang 0.5.14 server can serve.

Each kind is the real architecture SGLang runs for that model family, shrunk (4 decoder layers,
hidden size 512, ~24 M parameters, ~47 MB in bfloat16) but with the real head layouts, layer
pattern and config fields:

* ``qwen3-next``: ``Qwen3NextForCausalLM`` (SGLang ``Qwen3NextConfig``, model_type
  ``qwen3_next``). Layers GDN, GDN, GDN, gated full attention (``full_attention_interval`` 4), every
  layer MoE (8 experts, top-2, a gated shared expert of the experts' size, as the real model, so
  SGLang on CUDA fuses it as a 9th expert). One MTP layer (``mtp.*``), so
  ``--speculative-algorithm NEXTN`` works (SGLang then loads ``Qwen3NextForCausalLMMTP``).
* ``kimi-linear``: ``KimiLinearForCausalLM`` (SGLang ``KimiLinearConfig``, model_type
  ``kimi_linear``; no ``trust_remote_code`` needed). Layers KDA, KDA, KDA, MLA
  (``linear_attn_config`` ``kda_layers`` [1, 2, 3], ``full_attn_layers`` [4]); layer 0 a dense MLP
  (``first_k_dense_replace`` 1), layers 1-3 MoE (8 experts, top-2, sigmoid router with correction
  bias, 1 shared expert). No MTP (the real model has none).
* ``qwen3.5``: ``Qwen3_5ForConditionalGeneration`` (SGLang ``Qwen3_5Config``, model_type
  ``qwen3_5``; text part ``Qwen3_5TextConfig``, ``qwen3_5_text``), the dense variant. Layers GDN,
  GDN, GDN, gated full attention (mRoPE as the real model), dense MLP; one MTP layer
  (``Qwen3_5ForCausalLMMTP`` under NEXTN). SGLang 0.5.14 registers Qwen3.5 only as this
  vision-language class (``Qwen3_5ForCausalLM`` exists but is no entry class, and multimodal
  serving cannot be switched off), so the checkpoint carries a tiny 2-block vision tower and HF
  image / video preprocessor configs; text-only requests never run the tower.

GDN layers have 4 key heads and 8 value heads of dimension 128 (Qwen3-Next's HV = 2 HK layout),
conv kernel 4; KDA layers have 8 heads of 128 (HK = HV), conv kernel 4; MLA is Kimi-Linear's
NoPE MLA (kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, 16 heads).

Weights are drawn like the models' own ``_init_weights`` (not ``--load-format dummy``): linear,
embedding and conv weights ~ N(0, initializer_range = 0.02), biases 0, LayerNorm / plain RMSNorm
weights 1, Qwen's zero-centred ``(1 + w)`` RMSNorms (``GemmaRMSNorm`` in SGLang) 0, the gated
output norms of GDN / KDA 1, MoE correction bias 0, ``A_log = log(U(1, 16))`` and ``dt_bias`` the
FLA / Mamba2 inverse-softplus init (``dt ~ logU(1e-3, 1e-1)``, so the per-step decay
``exp(-exp(A_log) * softplus(.. + dt_bias))`` stays close to 1 and the recurrent state carries
information over many tokens). HF's ``_init_weights`` of Qwen3-Next / Qwen3.5 sets
``dt_bias = 1`` and ``A_log = log(U(0, 16))`` instead, which forgets most of the state within one or
two tokens; Kimi-Linear's (FLA's) is the init used here for all three. Every tensor has its own
generator seeded from ``seed`` and its name, so a kind and a seed always give byte-identical
weights.

What that gives (HF transformers reference forward on CPU, Qwen3-Next and Qwen3.5): logits with
std ~0.45 (hidden 512 x 0.02), top-1 probability ~5x uniform, argmax changing with the context,
and the recurrent state weighing heavily: forcing every GDN head to forget (``A_log = 10``) moves
the last position's logits by more than their own norm. The distributions stay wide (entropy
~8.2 of log(4096) = 8.3 nats); scaling them would be the same as a sampling temperature.
A random MTP layer almost never predicts the target's token, so under NEXTN nearly every verify
step accepts only the bonus token.

The tokenizer is a byte-level BPE (Qwen2's pre-tokenizer regex) trained in-process on English
and digit text generated deterministically from word lists embedded here (no data set is read),
with ChatML special tokens (and Qwen-VL's vision tokens) and a ChatML ``chat_template``, so
``/v1/completions`` and ``/v1/chat/completions`` both work. It is the same for every kind and seed.

Usage::

    python -m sglang_ssm_modes.testing.models --kind qwen3-next --out /tmp/tm/qwen3-next [--seed 0]
    python -m sglang_ssm_modes.testing.models --kind all --out /tmp/tm      # /tmp/tm/<kind>/
    python -m sglang.launch_server --model-path /tmp/tm/qwen3-next
    python -m sglang.launch_server --model-path /tmp/tm/qwen3-next \\
        --speculative-algorithm NEXTN --speculative-num-steps 3 \\
        --speculative-eagle-topk 1 --speculative-num-draft-tokens 4

or from Python: ``make_test_model("kimi-linear", Path("/tmp/tm/kimi"), seed=0)``.

Only torch, safetensors and tokenizers are imported; SGLang is not.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

KINDS: tuple[str, ...] = ("qwen3-next", "kimi-linear", "qwen3.5")

GENERATOR_VERSION = 1
INITIALIZER_RANGE = 0.02
VOCAB_SIZE = 4096  # config vocab_size = the tokenizer's size (no unused rows a random model emits)
HIDDEN_SIZE = 512
NUM_LAYERS = 4
MAX_POSITIONS = 32768

# GDN (Qwen3-Next / Qwen3.5): HV = 2 HK, head dims 128, conv kernel 4
GDN_K_HEADS, GDN_V_HEADS, GDN_HEAD_DIM, CONV_KERNEL = 4, 8, 128, 4
# KDA (Kimi-Linear): HK = HV
KDA_HEADS, KDA_HEAD_DIM = 8, 128

# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
BPE_TRAIN_VOCAB = VOCAB_SIZE - len(SPECIAL_TOKENS)  # 256 bytes + merges; specials appended

# Qwen2's pre-tokenizer: letters runs, single digits, punctuation runs, newlines, spaces.
_QWEN2_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- elif item['type'] in ['image', 'image_url'] -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] in ['video', 'video_url'] -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_PROSE = """\
The lighthouse keeper climbed the narrow stairs every evening at dusk. From the top of the tower
he could see the whole bay: the fishing boats coming home, the long grey line of the harbour wall,
and the small houses along the shore where the lamps were being lit one after another.
In the spring the river rises quickly. Farmers move their animals to the higher fields, and the
children walk to school along the old railway embankment because the road is under water.
A good recipe is a kind of promise. It tells you that if you measure the flour, warm the milk and
wait for the dough to rise, you will have bread in the morning. Cooking teaches patience.
Scientists measure the temperature of the ocean at many depths. The data show that the surface
is warming faster than the deep water, and that currents carry heat from the tropics to the poles.
The library opens at nine o'clock. Students study in the reading room, while the librarians sort
new books, answer questions and repair old maps that have been folded too many times.
Mathematics is the art of giving the same name to different things. A number can count apples,
measure distance, or describe the chance that it will rain tomorrow.
When the train stopped in the middle of the valley, nobody knew why. The conductor walked through
the carriages, explained that a tree had fallen across the line, and promised hot tea for everyone.
Memory is not a recording. Each time we remember an event we rebuild it from pieces, and the
pieces change a little every time.
"""

_NAMES = (
    "Alice Ben Carla David Emma Farid Grace Hugo Ines James Kara Liam Maya Noah Olga Pedro Quinn "
    "Rosa Sam Tara Umar Vera Will Xena Yusuf Zoe Anna Boris Chen Diana Elena Felix Hana Ivan Julia"
).split()
_ITEMS = (
    "apples oranges pencils books marbles cookies stickers stamps coins cards shells flowers eggs "
    "bottles boxes candles tickets cupcakes muffins balloons notebooks crayons buttons rocks seeds "
    "bananas lemons peaches plums tomatoes potatoes carrots onions sandwiches pizzas pies"
).split()
_PLACES = (
    "the market|the school|the park|the library|the bakery|the farm|the station|the museum|"
    "the garden|the beach|the office|the hospital|the shop|the village|the city|the harbour"
).split("|")
_VERBS = (
    "buys sells finds gives away loses collects bakes picks eats orders packs shares plants "
    "counts paints receives borrows returns"
).split()
_ADJ = (
    "small large red blue green old new quiet busy bright dark warm cold heavy light fresh "
    "quick slow happy careful tired strong gentle simple strange famous ancient modern"
).split()
_NOUNS = (
    "river mountain forest window garden teacher doctor student engineer painter musician "
    "kitchen bridge island valley harbour machine computer network signal pattern question "
    "answer story letter message journey morning evening winter summer autumn spring weather "
    "language number problem solution history science music theatre village market bicycle "
    "camera planet ocean desert cloud storm silence memory window door table chair lamp"
).split()
_ADV = "slowly quickly carefully quietly suddenly finally often rarely always never".split()
_UNITS = "dollars minutes hours kilometres metres litres kilograms pages days weeks".split()
_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr kr pl sh st th tr".split()
_VOWELS = "a e i o u ai ea ee ie oo ou".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "rk", "ng", "x"]


def _lexicon(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct pronounceable invented words (place names, jargon) for BPE to learn."""
    words: set[str] = set()
    while len(words) < n:
        k = rng.choice((1, 2, 2, 2, 3, 3, 4))
        words.add("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                          for _ in range(k)))
    return sorted(words)


def _corpus() -> list[str]:
    """Deterministic English + digits training text (~500 KB): prose, word problems, arithmetic,
    invented words (so that BPE reaches the full vocabulary)."""
    rng = random.Random(20240517)
    lex = _lexicon(rng, 6000)
    zipf = [1.0 / (r + 1) ** 0.8 for r in range(len(lex))]
    lines = [ln for ln in _PROSE.splitlines() if ln.strip()] * 20
    for _ in range(1500):
        ws = rng.choices(lex, weights=zipf, k=rng.randint(6, 16))
        ws[0] = ws[0].capitalize()
        lines.append(" ".join(ws) + rng.choice((".", ".", "?", "!", ";")))
    for _ in range(1600):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        name, other = rng.sample(_NAMES, 2)
        item, place, verb = rng.choice(_ITEMS), rng.choice(_PLACES), rng.choice(_VERBS)
        unit = rng.choice(_UNITS)
        lines.append(
            rng.choice(
                (
                    f"{name} has {a} {item}. {name} {verb} {b} more at {place}. "
                    f"How many {item} does {name} have now? {name} has {a} + {b} = {a + b} {item}.",
                    f"{name} walks {a} {unit} on Monday and {b} {unit} on Tuesday, "
                    f"so the total is {a + b} {unit}.",
                    f"If {c} friends share {a * c} {item} equally, each friend gets {a} {item}.",
                    f"{other} paid ${a}.{b:02d} for {c} {item} at {place}; "
                    f"the change from ${a + 10} was ${10 - b / 100:.2f}.",
                    f"Step {c}: multiply {a} by {b} to get {a * b}, then subtract {c} to get "
                    f"{a * b - c}. The answer is {a * b - c}.",
                    f"In {1900 + a + b}, {name} and {other} travelled from {place} to "
                    f"{rng.choice(_PLACES)} in {c} days.",
                )
            )
        )
        lines.append(
            f"The {rng.choice(_ADJ)} {rng.choice(_NOUNS)} {rng.choice(_ADV)} met a "
            f"{rng.choice(_ADJ)} {rng.choice(_NOUNS)} near {rng.choice(_PLACES)}, and "
            f"{rng.choice(_NAMES)} wrote about the {rng.choice(_NOUNS)} in a "
            f"{rng.choice(_ADJ)} {rng.choice(_NOUNS)}."
        )
        if rng.random() < 0.3:
            xs = [rng.randint(0, 9999) for _ in range(rng.randint(3, 8))]
            lines.append(f"Values: {', '.join(map(str, xs))}; sum = {sum(xs)}; max = {max(xs)}.")
    return lines


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """The serialized ``tokenizer.json`` (trained once per process; the same for every kind)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_TRAIN_VOCAB,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() > VOCAB_SIZE:  # pragma: no cover - guarded by BPE_TRAIN_VOCAB
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} tokens > {VOCAB_SIZE}")
    return tok.to_str()


def special_token_ids() -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json())
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def _write_tokenizer(out_dir: Path) -> dict[str, int]:
    ids = special_token_ids()
    (out_dir / "tokenizer.json").write_text(tokenizer_json())
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD,
                                      VIDEO_PAD],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    _dump(out_dir / "tokenizer_config.json", tok_cfg)
    _dump(
        out_dir / "special_tokens_map.json",
        {
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "additional_special_tokens": tok_cfg["additional_special_tokens"],
        },
    )
    return ids


# ----------------------------------------------------------------------------------------------
# weights: (name, shape, init, dtype) specs, materialised with one generator per tensor
# ----------------------------------------------------------------------------------------------

# init kinds: "normal" N(0, initializer_range), "zeros", "ones", "a_log" log(U(1, 16)),
# "dt_bias" inverse softplus of dt ~ logU(1e-3, 1e-1) (clamped at 1e-4)
@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: str
    fp32: bool = False


def _lin(name: str, out_f: int, in_f: int) -> TensorSpec:
    return TensorSpec(name, (out_f, in_f), "normal")


def _vec(name: str, n: int, init: str) -> TensorSpec:
    return TensorSpec(name, (n,), init)


def _gdn_specs(p: str, h: int, fused: bool) -> list[TensorSpec]:
    """Gated DeltaNet ``linear_attn`` of Qwen3-Next (``fused``: packed in_proj_qkvz / in_proj_ba,
    as the Qwen3-Next checkpoints) or Qwen3.5 (split in_proj_qkv / _z / _b / _a)."""
    key_dim, value_dim = GDN_K_HEADS * GDN_HEAD_DIM, GDN_V_HEADS * GDN_HEAD_DIM
    if fused:
        proj = [
            _lin(f"{p}.in_proj_qkvz.weight", 2 * key_dim + 2 * value_dim, h),
            _lin(f"{p}.in_proj_ba.weight", 2 * GDN_V_HEADS, h),
        ]
    else:
        proj = [
            _lin(f"{p}.in_proj_qkv.weight", 2 * key_dim + value_dim, h),
            _lin(f"{p}.in_proj_z.weight", value_dim, h),
            _lin(f"{p}.in_proj_b.weight", GDN_V_HEADS, h),
            _lin(f"{p}.in_proj_a.weight", GDN_V_HEADS, h),
        ]
    return proj + [
        TensorSpec(f"{p}.conv1d.weight", (2 * key_dim + value_dim, 1, CONV_KERNEL), "normal"),
        TensorSpec(f"{p}.A_log", (GDN_V_HEADS,), "a_log", fp32=True),
        TensorSpec(f"{p}.dt_bias", (GDN_V_HEADS,), "dt_bias", fp32=True),
        _vec(f"{p}.norm.weight", GDN_HEAD_DIM, "ones"),  # gated RMSNorm, plain weight
        _lin(f"{p}.out_proj.weight", h, value_dim),
    ]


def _qwen_attn_specs(p: str, h: int, cfg: dict) -> list[TensorSpec]:
    """Gated full attention of Qwen3-Next / Qwen3.5 (q_proj carries q and the output gate)."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    return [
        _lin(f"{p}.q_proj.weight", nh * hd * 2, h),
        _lin(f"{p}.k_proj.weight", nkv * hd, h),
        _lin(f"{p}.v_proj.weight", nkv * hd, h),
        _lin(f"{p}.o_proj.weight", h, nh * hd),
        _vec(f"{p}.q_norm.weight", hd, "zeros"),  # zero-centred (1 + w)
        _vec(f"{p}.k_norm.weight", hd, "zeros"),
    ]


def _mlp_specs(p: str, h: int, inter: int, names=("gate_proj", "up_proj", "down_proj")):
    g, u, d = names
    return [
        _lin(f"{p}.{g}.weight", inter, h),
        _lin(f"{p}.{u}.weight", inter, h),
        _lin(f"{p}.{d}.weight", h, inter),
    ]


def _qwen_moe_specs(p: str, h: int, cfg: dict) -> list[TensorSpec]:
    out = [_lin(f"{p}.gate.weight", cfg["num_experts"], h)]
    for e in range(cfg["num_experts"]):
        out += _mlp_specs(f"{p}.experts.{e}", h, cfg["moe_intermediate_size"])
    out += _mlp_specs(f"{p}.shared_expert", h, cfg["shared_expert_intermediate_size"])
    out.append(_lin(f"{p}.shared_expert_gate.weight", 1, h))
    return out


def _qwen_layer_specs(p: str, cfg: dict, layer_type: str, fused_gdn: bool, moe: bool):
    h = cfg["hidden_size"]
    out = [_vec(f"{p}.input_layernorm.weight", h, "zeros"),
           _vec(f"{p}.post_attention_layernorm.weight", h, "zeros")]
    if layer_type == "linear_attention":
        out += _gdn_specs(f"{p}.linear_attn", h, fused=fused_gdn)
    else:
        out += _qwen_attn_specs(f"{p}.self_attn", h, cfg)
    if moe:
        out += _qwen_moe_specs(f"{p}.mlp", h, cfg)
    else:
        out += _mlp_specs(f"{p}.mlp", h, cfg["intermediate_size"])
    return out


def _mtp_specs(cfg: dict, moe: bool, fused_gdn: bool) -> list[TensorSpec]:
    """One MTP layer (``mtp.*``, as the Qwen3-Next / Qwen3.5 checkpoints): a full-attention
    decoder layer fed by ``fc([norm(embed); norm(hidden)])``; embeddings and head are shared."""
    h = cfg["hidden_size"]
    return [
        _lin("mtp.fc.weight", h, 2 * h),
        _vec("mtp.pre_fc_norm_embedding.weight", h, "zeros"),
        _vec("mtp.pre_fc_norm_hidden.weight", h, "zeros"),
        *_qwen_layer_specs("mtp.layers.0", cfg, "full_attention", fused_gdn, moe),
        _vec("mtp.norm.weight", h, "zeros"),
    ]


def _layer_types(n: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


# --- Qwen3-Next ---------------------------------------------------------------------------------


def _qwen_hybrid_text(ids: dict[str, int]) -> dict:
    """The text-model fields Qwen3-Next and Qwen3.5 share (GDN layout, layer pattern, attention)."""
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": 1024,
        "num_hidden_layers": NUM_LAYERS,
        "full_attention_interval": 4,
        "layer_types": _layer_types(NUM_LAYERS, 4),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "partial_rotary_factor": 0.25,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": CONV_KERNEL,
        "linear_key_head_dim": GDN_HEAD_DIM,
        "linear_value_head_dim": GDN_HEAD_DIM,
        "linear_num_key_heads": GDN_K_HEADS,
        "linear_num_value_heads": GDN_V_HEADS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": INITIALIZER_RANGE,
        "max_position_embeddings": MAX_POSITIONS,
        "use_cache": True,
        "tie_word_embeddings": False,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
        "torch_dtype": "bfloat16",
    }


def _qwen3_next(ids: dict[str, int]) -> tuple[dict, list[TensorSpec]]:
    cfg = {
        **_qwen_hybrid_text(ids),
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "rope_theta": 10000000,
        "rope_scaling": None,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "num_nextn_predict_layers": 1,
        "use_sliding_window": False,
    }
    h = cfg["hidden_size"]
    specs = [_lin("model.embed_tokens.weight", VOCAB_SIZE, h)]
    for i, lt in enumerate(cfg["layer_types"]):
        specs += _qwen_layer_specs(f"model.layers.{i}", cfg, lt, fused_gdn=True, moe=True)
    specs += [_vec("model.norm.weight", h, "zeros"), _lin("lm_head.weight", VOCAB_SIZE, h)]
    specs += _mtp_specs(cfg, moe=True, fused_gdn=True)
    return cfg, specs


# --- Qwen3.5 (dense) -----------------------------------------------------------------------------


def _qwen3_5(ids: dict[str, int]) -> tuple[dict, list[TensorSpec]]:
    text = {
        **_qwen_hybrid_text(ids),
        "model_type": "qwen3_5_text",
        "attn_output_gate": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
    }
    vision = {
        "model_type": "qwen3_5",
        "depth": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_heads": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": HIDDEN_SIZE,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [],
        "initializer_range": INITIALIZER_RANGE,
        "torch_dtype": "bfloat16",
    }
    cfg = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    h = HIDDEN_SIZE
    lm = "model.language_model"
    specs = [_lin(f"{lm}.embed_tokens.weight", VOCAB_SIZE, h)]
    for i, lt in enumerate(text["layer_types"]):
        specs += _qwen_layer_specs(f"{lm}.layers.{i}", text, lt, fused_gdn=False, moe=False)
    specs += [_vec(f"{lm}.norm.weight", h, "zeros"), _lin("lm_head.weight", VOCAB_SIZE, h)]
    specs += _mtp_specs(text, moe=False, fused_gdn=False)
    specs += _vision_specs(vision)
    return cfg, specs


def _vision_specs(v: dict) -> list[TensorSpec]:
    """Qwen3.5's vision tower (``model.visual.*``), HF checkpoint names."""
    d, inter, p = v["hidden_size"], v["intermediate_size"], "model.visual"
    merged = d * v["spatial_merge_size"] ** 2
    ln = lambda name, n: [_vec(f"{name}.weight", n, "ones"), _vec(f"{name}.bias", n, "zeros")]
    lin_b = lambda name, o, i: [_lin(f"{name}.weight", o, i), _vec(f"{name}.bias", o, "zeros")]
    out = [
        TensorSpec(
            f"{p}.patch_embed.proj.weight",
            (d, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"]),
            "normal",
        ),
        _vec(f"{p}.patch_embed.proj.bias", d, "zeros"),
        _lin(f"{p}.pos_embed.weight", v["num_position_embeddings"], d),
    ]
    for b in range(v["depth"]):
        q = f"{p}.blocks.{b}"
        out += ln(f"{q}.norm1", d) + ln(f"{q}.norm2", d)
        out += lin_b(f"{q}.attn.qkv", 3 * d, d) + lin_b(f"{q}.attn.proj", d, d)
        out += lin_b(f"{q}.mlp.linear_fc1", inter, d) + lin_b(f"{q}.mlp.linear_fc2", d, inter)
    out += ln(f"{p}.merger.norm", d)
    out += lin_b(f"{p}.merger.linear_fc1", merged, merged)
    out += lin_b(f"{p}.merger.linear_fc2", v["out_hidden_size"], merged)
    return out


# --- Kimi-Linear ---------------------------------------------------------------------------------


def _kimi_linear(ids: dict[str, int]) -> tuple[dict, list[TensorSpec]]:
    n = NUM_LAYERS
    cfg = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": 1024,
        "num_hidden_layers": n,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_act": "silu",
        "initializer_range": INITIALIZER_RANGE,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": KDA_HEAD_DIM,  # SGLang's KDA takes its value head dim from here
        "mla_use_nope": True,
        # 6, not 8: with a power-of-two count of at most 32 experts per group SGLang 0.5.14 takes
        # sgl_kernel's moe_fused_gate, which refuses its own bfloat16 correction bias against the float32
        # router logits (seen on the H200); the real model's 256 experts never take that path
        "num_experts": 6,
        "num_experts_per_token": 2,
        "moe_intermediate_size": 128,
        "num_shared_experts": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3],  # 1-based, as Kimi-Linear's config
            "full_attn_layers": [4],
            "num_heads": KDA_HEADS,
            "head_dim": KDA_HEAD_DIM,
            "short_conv_kernel_size": CONV_KERNEL,
        },
        "model_max_length": MAX_POSITIONS,
        "use_cache": True,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
        "torch_dtype": "bfloat16",
    }
    h = cfg["hidden_size"]
    kda = set(cfg["linear_attn_config"]["kda_layers"])
    specs = [_lin("model.embed_tokens.weight", VOCAB_SIZE, h)]
    for i in range(n):
        p = f"model.layers.{i}"
        specs += [_vec(f"{p}.input_layernorm.weight", h, "ones"),
                  _vec(f"{p}.post_attention_layernorm.weight", h, "ones")]
        specs += _kda_specs(f"{p}.self_attn", h) if (i + 1) in kda else _mla_specs(
            f"{p}.self_attn", h, cfg)
        if i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0:
            q = f"{p}.block_sparse_moe"
            e_n, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
            specs.append(_lin(f"{q}.gate.weight", e_n, h))
            specs.append(TensorSpec(f"{q}.gate.e_score_correction_bias", (e_n,), "zeros", True))
            for e in range(e_n):
                specs += _mlp_specs(f"{q}.experts.{e}", h, inter, names=("w1", "w3", "w2"))
            specs += _mlp_specs(f"{q}.shared_experts", h, inter * cfg["num_shared_experts"])
        else:
            specs += _mlp_specs(f"{p}.mlp", h, cfg["intermediate_size"])
    specs += [_vec("model.norm.weight", h, "ones"), _lin("lm_head.weight", VOCAB_SIZE, h)]
    return cfg, specs


def _kda_specs(p: str, h: int) -> list[TensorSpec]:
    """Kimi Delta Attention (HF Kimi-Linear checkpoint names)."""
    proj, hd = KDA_HEADS * KDA_HEAD_DIM, KDA_HEAD_DIM
    out = [_lin(f"{p}.{x}_proj.weight", proj, h) for x in "qkv"]
    out += [TensorSpec(f"{p}.{x}_conv1d.weight", (proj, 1, CONV_KERNEL), "normal") for x in "qkv"]
    out += [
        TensorSpec(f"{p}.A_log", (1, 1, KDA_HEADS, 1), "a_log", fp32=True),
        TensorSpec(f"{p}.dt_bias", (proj,), "dt_bias", fp32=True),
        _lin(f"{p}.b_proj.weight", KDA_HEADS, h),
        _lin(f"{p}.f_a_proj.weight", hd, h),
        _lin(f"{p}.f_b_proj.weight", proj, hd),
        _lin(f"{p}.g_a_proj.weight", hd, h),
        _lin(f"{p}.g_b_proj.weight", proj, hd),
        _vec(f"{p}.o_norm.weight", hd, "ones"),
        _lin(f"{p}.o_proj.weight", h, proj),
    ]
    return out


def _mla_specs(p: str, h: int, cfg: dict) -> list[TensorSpec]:
    """Kimi-Linear's MLA (q_lora_rank None: a plain q_proj)."""
    nh, r = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    return [
        _lin(f"{p}.q_proj.weight", nh * (nope + rope), h),
        _lin(f"{p}.kv_a_proj_with_mqa.weight", r + rope, h),
        _vec(f"{p}.kv_a_layernorm.weight", r, "ones"),
        _lin(f"{p}.kv_b_proj.weight", nh * (nope + v), r),
        _lin(f"{p}.o_proj.weight", h, nh * v),
    ]


_BUILDERS = {"qwen3-next": _qwen3_next, "kimi-linear": _kimi_linear, "qwen3.5": _qwen3_5}


def model_spec(kind: str) -> tuple[dict, list[TensorSpec]]:
    """``(config dict, tensor specs)`` of ``kind`` (no tensors are drawn)."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    return _BUILDERS[kind](special_token_ids())


def _draw(spec: TensorSpec, seed: int):
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % 2**63)
    if spec.init == "normal":
        t = torch.randn(spec.shape, generator=g) * INITIALIZER_RANGE
    elif spec.init == "zeros":
        t = torch.zeros(spec.shape)
    elif spec.init == "ones":
        t = torch.ones(spec.shape)
    elif spec.init == "a_log":
        t = torch.empty(spec.shape).uniform_(1.0, 16.0, generator=g).log()
    elif spec.init == "dt_bias":
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = (torch.rand(spec.shape, generator=g) * (hi - lo) + lo).exp().clamp(min=1e-4)
        t = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    else:  # pragma: no cover
        raise ValueError(spec.init)
    return t.to(torch.float32 if spec.fp32 else torch.bfloat16).contiguous()


def _dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def make_test_model(kind: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write the ``kind`` test model (config, safetensors, tokenizer) into ``out_dir``.

    Returns ``out_dir``. Existing files of the same names are overwritten.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, specs = model_spec(kind)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):  # pragma: no cover - a builder bug
        raise AssertionError(f"{kind}: duplicate tensor names")
    tensors = {s.name: _draw(s, seed) for s in specs}
    ids = _write_tokenizer(out_dir)
    _dump(out_dir / "config.json", cfg)
    _dump(
        out_dir / "generation_config.json",
        {
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
            "pad_token_id": ids[ENDOFTEXT],
        },
    )
    if kind == "qwen3.5":
        _write_qwen3_5_processor(out_dir, cfg["vision_config"])
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    n_params = sum(t.numel() for t in tensors.values())
    _dump(
        out_dir / "test_model.json",
        {
            "generator": "sglang_ssm_modes.testing.models",
            "generator_version": GENERATOR_VERSION,
            "kind": kind,
            "seed": seed,
            "num_parameters": n_params,
            "num_tensors": len(tensors),
            "initializer_range": INITIALIZER_RANGE,
        },
    )
    return out_dir


def _write_qwen3_5_processor(out_dir: Path, vision: dict) -> None:
    """Image / video preprocessor configs of Qwen3.5 (SGLang serves it as a multimodal model, so
    it loads the HF processor even for text-only requests)."""
    common = {
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_resize": True,
        "do_convert_rgb": True,
    }
    _dump(
        out_dir / "preprocessor_config.json",
        {
            **common,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3VLProcessor",
            "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        },
    )
    _dump(
        out_dir / "video_preprocessor_config.json",
        {
            **common,
            "video_processor_type": "Qwen3VLVideoProcessor",
            "processor_class": "Qwen3VLProcessor",
            "size": {"shortest_edge": 4096, "longest_edge": 25165824},
            "fps": 2,
            "min_frames": 4,
            "max_frames": 768,
            "do_sample_frames": True,
        },
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sglang_ssm_modes.testing.models",
        description="Write a small seeded hybrid GDN / KDA test model that SGLang 0.5.14 serves.",
    )
    ap.add_argument("--kind", required=True, choices=[*KINDS, "all"])
    ap.add_argument("--out", required=True, type=Path,
                    help="output directory (with --kind all: one subdirectory per kind)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    kinds = KINDS if args.kind == "all" else (args.kind,)
    for kind in kinds:
        out = args.out / kind if args.kind == "all" else args.out
        make_test_model(kind, out, seed=args.seed)
        meta = json.loads((out / "test_model.json").read_text())
        size = (out / "model.safetensors").stat().st_size / 2**20
        print(f"{kind}: {out} ({meta['num_parameters'] / 1e6:.1f} M parameters, {size:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
