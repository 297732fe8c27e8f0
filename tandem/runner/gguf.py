"""Load a llama / qwen2 / qwen3 / qwen3moe / gemma2 / gemma3 GGUF file as an mlx-lm model.

``mx.load`` reads the tensors; Q4_0, Q4_1 and Q8_0 come back as MLX affine-quantized
triples (``.weight`` packed uint32, ``.scales``, ``.biases``, group size 32), stacked
expert tensors included. The hyper-parameters come from the GGUF metadata and are turned
into an HF-style config, with llama.cpp's defaults where it hard-codes them.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tandem.frontend.gguf_meta import GGUFError, read_gguf_metadata

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3")
GGUF_GROUP_SIZE = 32  # block size of Q4_0 / Q4_1 / Q8_0

# general.architecture -> the mlx_lm.models module (and model_type) it loads as
_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
# llama.cpp stores Gemma's RMSNorm weights as (1 + w); mlx-lm's Gemma modules add the 1.
_GEMMA = ("gemma2", "gemma3")
# their mlx-lm models take no rope scaling
_NO_ROPE_SCALING = ("gemma2", "qwen3moe")

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LLAMA = {**_ATTENTION, **_MLP, "ffn_norm": "post_attention_layernorm"}
# Gemma: norms after attention and after the MLP too; ffn_norm is the one before the MLP.
_GEMMA_BLOCK = {
    **_ATTENTION,
    **_MLP,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Stacked experts, (experts, out, in) like mlx-lm's SwitchGLU, and the router.
_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_IN_BLOCK: dict[str, dict[str, str]] = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": {**_LLAMA, **_QK_NORMS},
    "qwen3moe": {**_ATTENTION, **_QK_NORMS, **_EXPERTS, "ffn_norm": "post_attention_layernorm"},
    "gemma2": _GEMMA_BLOCK,
    "gemma3": {**_GEMMA_BLOCK, **_QK_NORMS},
}
# "bias" is a float bias vector; "biases" is the zero-point part of a quantized weight.
_SUFFIXES = ("weight", "bias", "scales", "biases")
_ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.1-style per-frequency rope scaling


class _FactorRoPE(nn.Module):
    """RoPE whose periods ``base**(2i/d)`` are multiplied by per-frequency factors."""

    def __init__(self, dims: int, base: float, factors: mx.array) -> None:
        super().__init__()
        self.dims = dims
        periods = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        self._freqs = periods * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


def _mlx_name(name: str, arch: str, path: str) -> str:
    module, _, suffix = name.rpartition(".")
    parts = module.split(".")
    in_block = _IN_BLOCK[arch]
    if suffix in _SUFFIXES:
        if len(parts) == 1 and parts[0] in _TOP_LEVEL:
            return f"{_TOP_LEVEL[parts[0]]}.{suffix}"
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in in_block:
            return f"model.layers.{int(parts[1])}.{in_block[parts[2]]}.{suffix}"
    raise GGUFError(f"{path}: unsupported tensor {name!r} for architecture {arch!r}")


def _unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's q/k row order (interleaved rope pairs) back to HF's rotate-half.

    llama.cpp writes rows as ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``; this is the
    inverse. Quantization groups run along the input dim, so rows of a quantized weight,
    its scales and its biases permute exactly the same way. Only llama is permuted: qwen
    and gemma use NEOX rope in llama.cpp, so their q/k rows are stored as HF has them.
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _architecture(meta: dict[str, Any], path: str) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: unsupported architecture general.architecture={arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


Getter = Callable[..., Any]


def _getter(meta: dict[str, Any], arch: str, path: str) -> Getter:
    def get(key: str, kind: type, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata key {arch}.{key} is missing")
        if isinstance(value, bool) or not isinstance(value, kind | int):
            raise GGUFError(f"{path}: metadata key {arch}.{key}={value!r} is not a {kind}")
        return kind(value)

    return get


def _swa_period(value: Any, n_layers: int, path: str) -> int:
    """``sliding_window_pattern`` as mlx-lm's period: every p-th layer is global."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, list) and len(value) == n_layers and False in value:
        period = value.index(False) + 1  # true: sliding, false: global
        if all(bool(v) == ((i + 1) % period != 0) for i, v in enumerate(value)):
            return period
    raise GGUFError(
        f"{path}: gemma3.attention.sliding_window_pattern={value!r} is not a pattern of one "
        "global layer every p layers"
    )


def _gemma_config(
    arch: str, get: Getter, c: dict[str, Any], meta: dict[str, Any], path: str
) -> dict[str, Any]:
    # llama.cpp's f_attention_scale: the 27B models (46 / 62 layers) scale queries by
    # hidden / heads, all others by the head dim (HF's query_pre_attn_scalar).
    big = c["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
    out: dict[str, Any] = {
        "query_pre_attn_scalar": float(
            c["hidden_size"] // c["num_attention_heads"] if big else c["head_dim"]
        )
    }
    if arch == "gemma2":
        # llama.cpp's defaults; mlx-lm's gemma2 attends globally in every layer (no window)
        out["attn_logit_softcapping"] = get("attn_logit_softcapping", float, 50.0)
        out["final_logit_softcapping"] = get("final_logit_softcapping", float, 30.0)
        return out
    if get("final_logit_softcapping", float, 0.0):
        raise GGUFError(f"{path}: gemma3 with final logit soft-capping is not supported")
    window = get("attention.sliding_window", int, 0)
    if window > 0:  # llama.cpp: one global layer in 6 unless the file says otherwise
        pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
        out["sliding_window_pattern"] = _swa_period(pattern, c["num_hidden_layers"], path)
        out["sliding_window"] = window
    else:  # no window: every layer global
        out["sliding_window_pattern"] = 1
        out["sliding_window"] = c["max_position_embeddings"]
    out["rope_local_base_freq"] = get("rope.freq_base_swa", float, 10000.0)
    return out


def _moe_config(get: Getter, meta: dict[str, Any], path: str) -> dict[str, Any]:
    if meta.get("qwen3moe.expert_gating_func", 1) != 1:  # 1: softmax
        raise GGUFError(f"{path}: qwen3moe expert gating other than softmax is not supported")
    norm = meta.get("qwen3moe.expert_weights_norm", True)  # llama.cpp always normalizes
    return {
        "num_experts": get("expert_count", int),
        "num_experts_per_tok": get("expert_used_count", int),
        "moe_intermediate_size": get("expert_feed_forward_length", int),
        "decoder_sparse_step": 1,  # llama.cpp's qwen3moe: every layer is sparse
        "mlp_only_layers": [],
        "norm_topk_prob": bool(norm),
    }


def _config(meta: dict[str, Any], weights: dict[str, mx.array], path: str) -> dict[str, Any]:
    arch = _architecture(meta, path)
    get = _getter(meta, arch, path)
    hidden = get("embedding_length", int)
    n_head = get("attention.head_count", int)
    if "token_embd.weight" not in weights:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
    config: dict[str, Any] = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count", int),
        "num_attention_heads": n_head,
        "num_key_value_heads": get("attention.head_count_kv", int, n_head),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", float),
        "rope_theta": get("rope.freq_base", float, 1e6 if arch == "gemma3" else 10000.0),
        "max_position_embeddings": get("context_length", int),
        # the embedding's rows, which is the token list (llama.cpp pads it to match)
        "vocab_size": weights["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in weights,
    }
    if arch == "qwen3moe":
        config.update(_moe_config(get, meta, path))
    ffn_default = config.get("moe_intermediate_size")  # unused when every layer is sparse
    config["intermediate_size"] = get("feed_forward_length", int, ffn_default)
    if arch != "qwen2":
        head_dim = get("attention.key_length", int, hidden // n_head)
        if get("attention.value_length", int, head_dim) != head_dim:
            raise GGUFError(f"{path}: {arch}.attention.value_length differs from key_length")
        config["head_dim"] = head_dim
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in weights
    if arch in _GEMMA:
        config.update(_gemma_config(arch, get, config, meta, path))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" and arch in _NO_ROPE_SCALING:
        raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported for {arch}")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": get("rope.scaling.factor", float)}
    elif scaling == "yarn":
        config["rope_scaling"] = {
            "type": "yarn",
            "factor": get("rope.scaling.factor", float),
            "original_max_position_embeddings": get("rope.scaling.original_context_length", int),
        }
    elif scaling != "none":
        raise GGUFError(f"{path}: unsupported rope scaling {arch}.rope.scaling.type={scaling!r}")
    return config


def _quant_params(weights: dict[str, mx.array], path: str) -> dict[str, dict[str, int]]:
    """Per mlx-lm module path: the group size and bits of its quantized weight."""
    params: dict[str, dict[str, int]] = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        module = name.removesuffix(".scales")
        packed = weights.get(f"{module}.weight")
        # packed cols = in * bits / 32 and scales cols = in / group size (32), so
        # bits = packed cols / scales cols.
        if packed is None or packed.dtype != mx.uint32 or packed.shape[-1] % scales.shape[-1]:
            raise GGUFError(f"{path}: quantized tensor {module!r} has inconsistent shapes")
        bits = packed.shape[-1] // scales.shape[-1]
        if bits not in (2, 3, 4, 5, 6, 8):
            raise GGUFError(f"{path}: quantized tensor {module!r} has {bits} bits")
        params[module.removesuffix(".weight")] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
    return params


def _compute_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """The float type of the embedding (its scales when quantized)."""
    embed = weights.get("model.embed_tokens.scales", weights["model.embed_tokens.weight"])
    return embed.dtype if mx.issubdtype(embed.dtype, mx.floating) else mx.float32


def _mlx_weights(
    raw: dict[str, mx.array], arch: str, config: dict[str, Any], path: str
) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for gguf_name, w in raw.items():
        if arch == "llama" and gguf_name.startswith("blk."):
            if ".attn_q." in gguf_name:
                w = _unpermute_rows(w, config["num_attention_heads"])
            elif ".attn_k." in gguf_name:
                w = _unpermute_rows(w, config["num_key_value_heads"])
        elif arch in _GEMMA and gguf_name.endswith("norm.weight"):
            # back to HF's w: exact in float32 for any w with |w| >= 2**-16 that a bf16 /
            # f16 checkpoint holds, since 1 + w was rounded into float32 by the converter
            w = w.astype(mx.float32) - 1.0
        weights[_mlx_name(gguf_name, arch, path)] = w
    return weights


def load_gguf_model(
    path: str | os.PathLike[str], dtype: mx.Dtype | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """Load a GGUF file (see SUPPORTED_ARCHITECTURES) as an mlx-lm model; returns it and its
    HF-style config.

    Float tensors are cast to ``dtype``; by default to the embedding's float type, so the
    F32 norm vectors llama.cpp writes next to F16 / quantized matrices become F16.
    Raises :class:`GGUFError` naming the file for a missing, corrupt or unsupported file.
    """
    name = os.fspath(path)
    meta = read_gguf_metadata(name)  # validates the header with clear errors
    arch = _architecture(meta, name)
    try:
        raw = mx.load(name, format="gguf")
    except (RuntimeError, ValueError) as e:
        raise GGUFError(f"{name}: cannot read tensors ({e})") from None
    assert isinstance(raw, dict)
    config = _config(meta, raw, name)

    rope_factors = raw.pop(_ROPE_FACTORS, None)
    if rope_factors is not None and arch in _GEMMA:
        raise GGUFError(f"{name}: {_ROPE_FACTORS} is not supported for {arch}")
    weights = _mlx_weights(raw, arch, config, name)
    target = dtype or _compute_dtype(weights)
    for key, w in weights.items():
        if mx.issubdtype(w.dtype, mx.floating) and w.dtype != target:
            weights[key] = w.astype(target)

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model: nn.Module = module.Model(module.ModelArgs.from_dict(config))
    if arch == "gemma3" and config["tie_word_embeddings"]:
        model.tie_word_embeddings = True  # what its sanitize does for a checkpoint without it
        model.pop("lm_head")
    quant = _quant_params(weights, name)
    if quant:
        nn.quantize(model, class_predicate=lambda p, _m: quant.get(p, False))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise GGUFError(f"{name}: tensors do not match a {arch} model ({e})") from None
    if rope_factors is not None:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        if rope_factors.shape != (head_dim // 2,):
            raise GGUFError(f"{name}: {_ROPE_FACTORS} has shape {rope_factors.shape}")
        rope = _FactorRoPE(head_dim, config["rope_theta"], rope_factors)
        for layer in model.layers:
            layer.self_attn.rope = rope
    mx.eval(model.parameters())
    model.eval()
    return model, config
