"""The tables of ``model_zoo``: tiny values by field name, and per-type settings that the
name heuristics cannot guess."""

from __future__ import annotations

from typing import Any

VOCAB = 512

# Field name -> tiny value, applied to every ModelArgs field of that name (required or not)
# unless its default is 0 (e.g. num_experts=0: a dense variant stays dense).
_DIMS = {"hidden_size": 64, "d_model": 64, "n_embd": 64, "model_dim": 64, "hidden_dim": 64}
LAYER_COUNTS = ("num_hidden_layers", "n_layers", "n_layer", "num_layers", "num_transformer_layers")
SIZES: dict[str, Any] = {
    **_DIMS,
    **dict.fromkeys(LAYER_COUNTS, 2),
    **dict.fromkeys(("num_attention_heads", "n_heads", "n_head", "num_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads"), 2),
    **dict.fromkeys(("num_attention_groups", "num_global_key_value_heads"), 2),
    **dict.fromkeys(("swa_num_attention_heads", "num_swa_attention_heads"), 4),
    **dict.fromkeys(("swa_num_key_value_heads", "num_swa_key_value_heads"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "hidden_size_per_head", "swa_head_dim"), 16),
    **dict.fromkeys(("swa_v_head_dim", "global_head_dim", "index_head_dim"), 16),
    **dict.fromkeys(("intermediate_size", "ffn_hidden_size", "n_inner"), 128),
    **dict.fromkeys(("ff_intermediate_size", "intermediate_size_mlp", "block_ff_dim"), 128),
    "dense_intermediate_size": 128,
    "block_dim": 64,
    **dict.fromkeys(("moe_intermediate_size", "expert_ffn_hidden_size", "moe_hidden_size"), 32),
    **dict.fromkeys(("routed_expert_hidden_size", "moe_latent_size"), 32),
    **dict.fromkeys(("shared_intermediate_size", "shared_expert_intermediate_size"), 64),
    **dict.fromkeys(("moe_shared_expert_intermediate_size", "share_expert_dim"), 64),
    **dict.fromkeys(("vocab_size", "n_vocab", "num_vocab", "vocab_size_per_layer_input"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "block_size"), 4096),
    **dict.fromkeys(("model_max_length", "original_max_position_embeddings"), 4096),
    **dict.fromkeys(("rope_theta", "rotary_emb_base", "rope_embedding_base"), 10000.0),
    **dict.fromkeys(("rope_freq_constant", "rope_local_base_freq", "swa_rope_theta"), 10000.0),
    **dict.fromkeys(("rope_local_theta", "compress_rope_theta"), 10000.0),
    **dict.fromkeys(("rms_norm_eps", "norm_eps", "layer_norm_eps", "norm_epsilon"), 1e-6),
    **dict.fromkeys(("layer_norm_epsilon", "layernorm_epsilon", "mixer_rms_eps"), 1e-6),
    # Mixture of experts: 4 experts, top-2, one shared, one dense layer first.
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("moe_num_experts",), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts"), 2),
    **dict.fromkeys(("moe_top_k", "num_experts_per_token"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "num_shared_expert"), 1),
    **dict.fromkeys(("moe_num_shared_experts",), 1),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers"), 1),
    "decoder_sparse_step": 1,
    "zero_expert_num": 1,
    "routed_scaling_factor": 1.0,
    # Multi-head latent attention.
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "o_lora_rank": 16,
    "o_groups": 2,
    "index_n_heads": 2,
    "index_topk": 16,
    # State-space and linear-attention layers.
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state"), 16),
    **dict.fromkeys(("conv_kernel", "mamba_d_conv", "conv1d_width"), 4),
    **dict.fromkeys(("short_conv_kernel_size", "linear_conv_kernel_dim"), 4),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 4),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim"), 32),
    **dict.fromkeys(("n_groups", "mamba_n_groups"), 1),
    "mamba_d_ssm": 128,
    "mamba_chunk_size": 16,
    "mamba_expand": 2,
    "time_step_rank": 8,
    "conv_L_cache": 3,
    "conv_window": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    **dict.fromkeys(("a_low_rank_dim", "v_low_rank_dim"), 8),
    **dict.fromkeys(("gate_low_rank_dim", "decay_low_rank_dim"), 8),
    # Sliding windows smaller than the test prompts.
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size"), 8),
    **dict.fromkeys(("window_size", "loop_window_size", "attention_chunk_size"), 8),
    # Periodic layer patterns: every other layer (2 layers hold one of each kind).
    **dict.fromkeys(("sliding_window_pattern", "full_attention_interval"), 2),
    **dict.fromkeys(("full_attn_interval", "attn_layer_period", "expert_layer_period"), 2),
    **dict.fromkeys(("dense_attention_every_n_layers", "no_rope_layer_interval"), 2),
    **dict.fromkeys(("interleave_moe_layer_step", "mamba_step", "layer_group_size"), 2),
    **dict.fromkeys(("attn_layer_offset", "expert_layer_offset"), 1),
    "cla_share_factor": 2,
    # Miscellaneous sizes and scales.
    "rotary_dim": 8,
    "partial_rotary_factor": 0.5,
    "rotary_pct": 0.5,
    "hidden_size_per_layer_input": 16,
    "laurel_rank": 8,
    "group_norm_size": 1,
    "dim_model_base": 64,
    "scale_emb": 1.0,
    "scale_depth": 1.4,
    "logits_scaling": 1.0,
    "attention_multiplier": 0.25,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "gegelu_limit": 20.0,
    "logits_soft_cap": 30.0,
    "ffn_dim_divisor": 16,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "query_pre_attn_scalar": 16,
    "n_shared_head": 2,
    "num_kv_reuse_layers": 1,
    "blocksparse_block_size": 4,
    "blocksparse_num_local_blocks": 2,
    "blocksparse_vert_stride": 2,
}

# Fields listing one entry per layer: given in an override, they set the layer count.
LAYER_PATTERNS: tuple[str, ...] = (
    "layer_types",
    "block_types",
    "hybrid_override_pattern",
    "layers_block_type",
    "hybrid_layer_pattern",
    "no_rope_layers",
    "is_moe_layer",
    "block_configs",
    "num_query_heads",
)

# Values for fields only where they are required (an optional one keeps its default).
REQUIRED: dict[str, Any] = {
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "hidden_act": "silu",
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "attention_method": "MLA",
    "zero_expert_type": "identity",
    "time_step_limit": [0.0, float("inf")],
}

# Wrapper type -> the type whose text arguments its text_config takes.
TEXT_ARGS: dict[str, str] = {"qwen3_5_moe": "qwen3_5"}

# Types whose Model cannot run on token ids alone -> why.
NOT_TEXT: dict[str, str] = {}

# Types no tiny float model can stand for -> why.
UNBUILDABLE: dict[str, str] = {
    "prism_hadamard_qwen35": (
        "a 2-bit Hadamard-rotated quantized pack of qwen3_5 (a packed-module manifest, "
        "widths divisible by 128), not a float checkpoint"
    ),
}

# Parameters a type's sanitize() rewrites on load (so they differ from what was written).
SANITIZED: dict[str, tuple[str, ...]] = {"baichuan_m1": ("lm_head.weight",)}  # normalized

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_PER_LAYER_ROPE = {"full_attention": _ROPE, "sliding_attention": _ROPE}
_SF = ["sliding_attention", "full_attention"]
_YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

_LLAMA4_YARN = {
    **_YARN,
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "llama_4_scaling_beta": 0.1,
}

OVERRIDES: dict[str, dict[str, Any]] = {
    "afmoe": {"layer_types": _SF},
    "baichuan_m1": {"sliding_window_layers": [0]},
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "deepseek_v2": {"rope_scaling": _YARN},
    # transformers' config (read by the tokenizer loader) needs layer_types for a str pattern.
    "exaone4": {"sliding_window_pattern": "LG", "layer_types": _SF},
    "exaone_moe": {"layer_types": _SF, "is_moe_layer": [False, True]},
    "gear": {"layer_types": _SF},
    "gemma3n": {
        "text_config": {
            "num_hidden_layers": 4,
            "layer_types": _SF * 2,
            "num_kv_shared_layers": 2,
            "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
            "final_logit_softcapping": 30.0,
            "altup_num_inputs": 4,
            "altup_coef_clip": 120.0,
            "altup_correct_scale": True,
            "altup_active_idx": 0,
        }
    },
    "gemma4": {"text_config": {"num_hidden_layers": 4, "num_kv_shared_layers": 2}},
    "gemma4_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2},
    "glm_moe_dsa": {"moe_layer_freq": 1},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "hunyuan": {"use_cla": True, "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "kimi_linear": {
        "linear_attn_config": {"kda_layers": [1], "num_heads": 4, "head_dim": 16},
    },
    "kimi_k3": {
        "text_config": {
            "linear_attn_config": {
                "kda_layers": [1],
                "num_heads": 4,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
            }
        }
    },
    "laguna": {"layer_types": _SF},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "lfm2-vl": {"text_config": {"layer_types": ["conv", "full_attention"]}},
    "llama4": {
        "text_config": {"num_hidden_layers": 4, "rope_scaling": None, "num_experts_per_tok": 1}
    },
    "llama4_text": {"no_rope_layers": [1, 1, 1, 0]},
    "longcat_flash": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "longcat_flash_ngram": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "ministral3": {"rope_parameters": _LLAMA4_YARN},
    "mistral3": {"text_config": {"model_type": "ministral3", "rope_parameters": _LLAMA4_YARN}},
    "mistral4": {"rope_parameters": _LLAMA4_YARN},
    "mamba2": {"num_heads": 8, "head_dim": 16},
    "mellum": {"layer_types": _SF, "rope_parameters": _PER_LAYER_ROPE},
    "mimo_v2_flash": {"hybrid_layer_pattern": [1, 0], "moe_layer_freq": [0, 1]},
    "minicpm3": {
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [1.0] * 4,
            "original_max_position_embeddings": 4096,
        }
    },
    "muse_spark": {
        "text_config": {
            "post_norm_eps": 1e-6,
            "rope_parameters": _ROPE,
            "layer_rope_theta": [10000.0, 0.0],
            "layer_types": _SF,
            "final_logit_softcapping": 30.0,
            "output_multiplier": 1.0,
        },
        "audio_config": {"out_hidden_size": 64},  # transformers' config checks it
    },
    "nemotron-nas": {
        "block_configs": [
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.5}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}},
        ]
    },
    "nemotron_h": {
        "hybrid_override_pattern": ["M", "*", "E", "-"],
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
    },
    "openelm": {"num_query_heads": [4, 4], "num_kv_heads": [2, 2], "ffn_multipliers": [2.0, 2.0]},
    # Its logits mask ids 100256-100351 (the real tokenizer's dummies) in place.
    "phi3small": {"blocksparse_block_size": 32, "vocab_size": 100352},
    "plamo3": {"num_hidden_layers": 2},
    "qwen3_5_moe": {
        "text_config": {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        }
    },
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "spark2_5": {"layer_types": _SF, "rope_parameters": _PER_LAYER_ROPE},
}
