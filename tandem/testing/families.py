"""Tiny random-weight models of the model families beyond plain full attention.

Each entry is a real mlx-lm ``model_type`` with a config small enough for CPU tests but with
every layer kind of the family present: sliding-window and global layers (gemma3_text,
cohere2, gpt_oss with attention sinks), models that compute attention themselves (gemma2's
logit soft-capping), MLA latent caches (deepseek_v3), and recurrent state: Gated DeltaNet
beside attention (qwen3_next), Mamba-2 alone (mamba2) and beside attention in one layer
(falcon_h1). Windows are 8 positions, so test prompts run far past them.

Models whose layers attend over another layer's KV come from the model zoo's tiny configs
(``SHARED_KV``): gemma4_text and gemma3n (the last layers reuse an earlier layer's keys, of
their own kind, window or global) and iquestloopcoder (a second loop attends over the first
loop's keys, and over its own within a window). So does deepseek_v32 (``SPARSE``): an MLA
latent cache beside a lightning indexer's key cache, whose top-16 keys each token attends
to once its history is longer. llama4 (``CHUNKED``) attends in chunks of 8 positions in three
of its four layers (``ChunkedKVCache``); its global layer scales queries by a temperature of
their position, whose floor scale is lowered to 4 here so that it varies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.testing import tiny_models

WINDOW = 8

_BASE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}

FAMILIES: dict[str, dict[str, Any]] = {
    "gemma2": {
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3_text": {
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 16,
        "rope_local_base_freq": 10000.0,
    },
    "cohere2": {
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "layer_norm_eps": 1e-5,
        "logit_scale": 0.5,
    },
    "gpt_oss": {
        "sliding_window": WINDOW,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_scaling": None,
        "swiglu_limit": 7.0,
    },
    "deepseek_v3": {
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "rope_scaling": None,
    },
    "qwen3_next": {
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "partial_rotary_factor": 0.5,
        "full_attention_interval": 2,
    },
    "mamba2": {
        "num_heads": 8,
        "head_dim": 16,
        "state_size": 16,
        "layer_norm_epsilon": 1e-6,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": False,
        "time_step_limit": [0.0, float("inf")],
        "time_step_rank": 8,
        "ssm_state_size": 16,
    },
    "falcon_h1": {
        "embedding_multiplier": 1.0,
        "mamba_chunk_size": 16,
        "mamba_d_conv": 4,
        "mamba_d_head": 32,
        "mamba_d_ssm": 128,
        "mamba_d_state": 16,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_n_heads": 4,
    },
}

# Families with recurrent layers (per-request state slots).
RECURRENT = ("falcon_h1", "mamba2", "qwen3_next")
# Families whose layers read another layer's KV, built from the model zoo's tiny configs.
SHARED_KV = ("gemma3n", "gemma4_text", "iquestloopcoder")
# DeepSeek sparse attention: its indexer picks the keys each token attends to (top 16).
SPARSE = ("deepseek_v32",)
# Chunked attention (llama4), from the model zoo's tiny config.
CHUNKED = ("llama4",)


def family_config(model_type: str) -> dict[str, Any]:
    return {
        **_BASE,
        **FAMILIES[model_type],
        "model_type": model_type,
        "architectures": [f"{model_type}ForCausalLM"],
    }


def make_family_model(path: Path, model_type: str, *, seed: int = 0) -> Path:
    """Write a tiny float32 ``model_type`` model (one of FAMILIES, SHARED_KV, SPARSE or
    CHUNKED) into ``path``."""
    if model_type in SHARED_KV + SPARSE + CHUNKED:
        from tandem.testing.model_zoo import make_zoo_model

        out = make_zoo_model(Path(path), model_type, seed=seed)
        if model_type in CHUNKED:
            config = json.loads((out / "config.json").read_text())
            assert config["text_config"]["attention_chunk_size"] == WINDOW
            config["text_config"]["floor_scale"] = 4
            (out / "config.json").write_text(json.dumps(config))
        return out
    return tiny_models._write_model(
        Path(path), family_config(model_type), seed, "float32", _BASE["vocab_size"]
    )
