"""Small hybrid-model configs (SGLang's real config classes read them) shared by the tests."""

QWEN3_NEXT_SMALL = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 256,
    "num_hidden_layers": 8, "full_attention_interval": 4, "linear_num_value_heads": 8,
    "linear_num_key_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1000,
}
KIMI_SMALL = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 1000,
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"},
    "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 4,
                           "head_dim": 32, "short_conv_kernel_size": 4},
}
LLAMA_SMALL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000,
    "intermediate_size": 512,
}
