"""The random-weight model shapes the benchmarks write (``--shape``): real small shapes of the
plain decoders and of the model families, and tiny ones for the CPU. No weights are
downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

RANDOM_SHAPES = (
    "qwen3-0.6b",
    "qwen3-8b",
    "smollm2-135m",
    "tiny",
    "qwen3.5-2b",
    "qwen3.5-tiny",
    "gemma3-1b",
    "gemma3-tiny",
    "nemotron-h-tiny",
    "gpt-oss-20b",
    "gpt-oss-tiny",
)

# Real small shapes of the model families (random weights): a Qwen3.5 hybrid (Gated DeltaNet
# layers with a full-attention layer every 4th) near 2B, and Gemma 3 1B (sliding windows of
# 512 with a global layer every 6th).
FAMILY_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3.5-2b": {
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 24,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_value_heads": 16,
            "linear_num_key_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "rms_norm_eps": 1e-6,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000.0,
        },
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "gemma3-1b": {
        "model_type": "gemma3_text",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "vocab_size": 262144,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
}


# gpt-oss-20b's shape: 24 layers alternating windows of 128 and full attention, attention
# sinks, 32 experts (4 a token) of width 2880, YaRN rope. In bf16 (the real checkpoint keeps
# its experts in MXFP4) it is 42 GB: it fits one 80 GB card, not this machine.
FAMILY_SHAPES["gpt-oss-20b"] = {
    "model_type": "gpt_oss",
    "num_hidden_layers": 24,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "rms_norm_eps": 1e-5,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
}
FAMILY_SHAPES["gpt-oss-tiny"] = {
    **FAMILY_SHAPES["gpt-oss-20b"],
    "num_hidden_layers": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}

# Gemma 3's layer pattern and window at a size the 2-core CPU measures (12 layers, 2 global).
FAMILY_SHAPES["gemma3-tiny"] = {
    **FAMILY_SHAPES["gemma3-1b"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 12,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "vocab_size": 4096,
}

# The hybrid at a size the 2-core CPU measures (8 layers of width 512; 4096 tokens).
FAMILY_SHAPES["qwen3.5-tiny"] = {
    **FAMILY_SHAPES["qwen3.5-2b"],
    "text_config": {
        **FAMILY_SHAPES["qwen3.5-2b"]["text_config"],
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 4,
        "vocab_size": 4096,
    },
    "vocab_size": 4096,
}


# A Mamba-2 hybrid (Nemotron-H's layer kinds: Mamba-2 "M", MLP "-", attention "*") at a
# size the 2-core CPU measures: 12 layers of width 512, 6 of them Mamba-2 (16 heads of 64,
# state 64: 256 KiB of SSM state per layer), one attention.
FAMILY_SHAPES["nemotron-h-tiny"] = {
    "model_type": "nemotron_h",
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "attention_bias": False,
    "mamba_num_heads": 16,
    "mamba_head_dim": 64,
    "mamba_proj_bias": False,
    "ssm_state_size": 64,
    "conv_kernel": 4,
    "n_groups": 2,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "num_hidden_layers": 12,
    "hybrid_override_pattern": list("M-M-M*M-M-M-"),
    "tie_word_embeddings": False,
}


def make_model(spec: str, dtype: str, root: Path) -> Path:
    from tandem.testing import tiny_models as tm

    if spec == "tiny":
        return tm.make_tiny_model(root / "tiny", "llama", dtype=dtype)
    if spec in FAMILY_SHAPES:
        config = FAMILY_SHAPES[spec]
        return tm.write_model(root / spec, config, dtype=dtype)
    if spec == "smollm2-135m":
        cfg = {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "vocab_size": 49152,
            "rope_theta": 100000,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "max_position_embeddings": 8192,
        }
        return tm.make_random_model(root / spec, "llama", cfg, dtype=dtype)
    shapes = {"qwen3-0.6b": tm.QWEN3_0_6B, "qwen3-8b": tm.QWEN3_8B}
    return tm.make_random_model(root / spec, "qwen3", shapes[spec], dtype=dtype)
