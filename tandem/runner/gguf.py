"""Load a llama / qwen2 GGUF file as an mlx-lm model.

``mx.load`` reads the tensors; Q4_0, Q4_1 and Q8_0 come back as MLX affine-quantized
triples (``.weight`` packed uint32, ``.scales``, ``.biases``, group size 32). The
hyper-parameters come from the GGUF metadata and are turned into an HF-style config.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tandem.frontend.gguf_meta import GGUFError, read_gguf_metadata

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
GGUF_GROUP_SIZE = 32  # block size of Q4_0 / Q4_1 / Q8_0

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IN_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
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


def _mlx_name(name: str, path: str) -> str:
    module, _, suffix = name.rpartition(".")
    parts = module.split(".")
    if suffix in _SUFFIXES:
        if len(parts) == 1 and parts[0] in _TOP_LEVEL:
            return f"{_TOP_LEVEL[parts[0]]}.{suffix}"
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _IN_BLOCK:
            return f"model.layers.{int(parts[1])}.{_IN_BLOCK[parts[2]]}.{suffix}"
    raise GGUFError(f"{path}: unsupported tensor {name!r}")


def _unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's q/k row order (interleaved rope pairs) back to HF's rotate-half.

    llama.cpp writes rows as ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``; this is the
    inverse. Quantization groups run along the input dim, so rows of a quantized weight,
    its scales and its biases permute exactly the same way.
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


def _config(meta: dict[str, Any], weights: dict[str, mx.array], path: str) -> dict[str, Any]:
    arch = _architecture(meta, path)

    def get(key: str, kind: type, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata key {arch}.{key} is missing")
        if isinstance(value, bool) or not isinstance(value, kind | int):
            raise GGUFError(f"{path}: metadata key {arch}.{key}={value!r} is not a {kind}")
        return kind(value)

    hidden = get("embedding_length", int)
    n_head = get("attention.head_count", int)
    if "token_embd.weight" not in weights:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count", int),
        "intermediate_size": get("feed_forward_length", int),
        "num_attention_heads": n_head,
        "num_key_value_heads": get("attention.head_count_kv", int, n_head),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", float),
        "rope_theta": get("rope.freq_base", float, 10000.0),
        "max_position_embeddings": get("context_length", int),
        # the embedding's rows, which is the token list (llama.cpp pads it to match)
        "vocab_size": weights["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in weights,
    }
    if arch == "llama":
        config["head_dim"] = get("attention.key_length", int, hidden // n_head)
        config["attention_bias"] = "blk.0.attn_q.bias" in weights
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
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


def load_gguf_model(
    path: str | os.PathLike[str], dtype: mx.Dtype | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """Load a llama / qwen2 GGUF file as an mlx-lm model; returns it and its HF-style config.

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
    weights: dict[str, mx.array] = {}
    for gguf_name, w in raw.items():
        if arch == "llama" and gguf_name.startswith("blk."):
            if ".attn_q." in gguf_name:
                w = _unpermute_rows(w, config["num_attention_heads"])
            elif ".attn_k." in gguf_name:
                w = _unpermute_rows(w, config["num_key_value_heads"])
        weights[_mlx_name(gguf_name, name)] = w

    target = dtype or _compute_dtype(weights)
    for key, w in weights.items():
        if mx.issubdtype(w.dtype, mx.floating) and w.dtype != target:
            weights[key] = w.astype(target)

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model: nn.Module = module.Model(module.ModelArgs.from_dict(config))
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
