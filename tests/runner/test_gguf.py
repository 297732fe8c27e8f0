"""GGUF loading: tiny random llama / qwen2 models written as GGUF the way llama.cpp does."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from tandem.frontend.gguf_meta import GGUFError, read_gguf_metadata
from tandem.frontend.gguf_tokenizer import eos_token_ids, tokenizer_from_gguf
from tandem.runner.gguf import _quant_params, _unpermute_rows, load_gguf_model

# isort: off
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama, qwen2

# isort: on

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 4, 2, 128, 300
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKEN = "<tool>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT = [1, 5, 260, 42, 17, 299, 100, 3, 77]

_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _vocab() -> tuple[list[str], list[str], list[int]]:
    tokens = SPECIALS + _byte_chars()
    merges = []
    for left, right in [
        ("Ġ", "w"),
        ("h", "e"),
        ("l", "l"),
        ("he", "ll"),
        ("hell", "o"),
        ("1", "2"),
    ]:
        merges.append(f"{left} {right}")
        tokens.append(left + right)
    tokens.append(USER_TOKEN)
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4]
    while len(tokens) < VOCAB:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(5)
    return tokens, merges, types


def _llama_cpp_permute(w: mx.array, n_head: int) -> mx.array:
    """What llama.cpp's converter does to llama q/k rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_name(name: str) -> str:
    module, _, suffix = name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, index, rest = module.split(".", 3)
        return f"blk.{index}.{_TO_GGUF[rest]}.{suffix}"
    return f"{_TO_GGUF[module]}.{suffix}"


def _tokenizer_meta(pre: str = "smollm", **extra: Any) -> dict[str, Any]:
    tokens, merges, types = _vocab()
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
        **extra,
    }


def _write(
    path: Path, arch: str, tie: bool, rope_scaling: dict[str, Any] | None = None
) -> tuple[Any, dict[str, mx.array]]:
    """A random float32 mlx-lm model, and the GGUF file written at ``path`` for it."""
    module = llama if arch == "llama" else qwen2
    args = module.ModelArgs(
        model_type=arch,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        intermediate_size=FFN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        rope_scaling=rope_scaling,
    )
    model = module.Model(args)
    mx.random.seed(0)
    model.update(tree_map(lambda p: 0.2 * mx.random.normal(p.shape), model.parameters()))
    mx.eval(model.parameters())

    tensors = {}
    for name, w in tree_flatten(model.parameters()):
        if arch == "llama" and ".q_proj." in name:
            w = _llama_cpp_permute(w, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            w = _llama_cpp_permute(w, KV_HEADS)
        tensors[_gguf_name(name)] = w
    if rope_scaling:
        head_dim = HIDDEN // HEADS
        periods = 10000.0 ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
        tensors["rope_freqs.weight"] = model.layers[0].self_attn.rope._freqs / periods

    def u32(v: int) -> mx.array:
        return mx.array(v, dtype=mx.uint32)

    tok = _tokenizer_meta()
    meta = {
        "general.architecture": arch,
        f"{arch}.block_count": u32(LAYERS),
        f"{arch}.context_length": u32(512),
        f"{arch}.embedding_length": u32(HIDDEN),
        f"{arch}.feed_forward_length": u32(FFN),
        f"{arch}.attention.head_count": u32(HEADS),
        f"{arch}.attention.head_count_kv": u32(KV_HEADS),
        f"{arch}.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        **{
            k: v
            for k, v in tok.items()
            if isinstance(v, str | list) and k != "tokenizer.ggml.token_type"
        },
        "tokenizer.ggml.token_type": mx.array(tok["tokenizer.ggml.token_type"], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.padding_token_id": u32(0),
        "tokenizer.ggml.add_bos_token": mx.array(False),
    }
    mx.save_gguf(str(path), tensors, meta)
    return model, tensors


def _logits(model: Any) -> mx.array:
    return model(mx.array([PROMPT]))


@pytest.mark.parametrize(("arch", "tie"), [("llama", False), ("llama", True), ("qwen2", True)])
def test_logits_match_original(tmp_path: Path, arch: str, tie: bool) -> None:
    path = tmp_path / f"{arch}.gguf"
    original, _ = _write(path, arch, tie)
    model, config = load_gguf_model(path)
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] is tie
    assert config["vocab_size"] == VOCAB and config["num_key_value_heads"] == KV_HEADS
    params = dict(tree_flatten(model.parameters()))
    assert ("lm_head.weight" in params) is not tie
    assert ("model.layers.0.self_attn.q_proj.bias" in params) is (arch == "qwen2")
    assert mx.allclose(_logits(model), _logits(original), atol=1e-5).item()


def test_llama_unpermute_is_needed(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    original, tensors = _write(path, "llama", tie=False)
    # the file really holds permuted q rows, so loading without undoing it would differ
    q = original.layers[0].self_attn.q_proj.weight
    assert not mx.array_equal(tensors["blk.0.attn_q.weight"], q).item()
    model, _ = load_gguf_model(path)
    assert mx.array_equal(model.layers[0].self_attn.q_proj.weight, q).item()


def test_llama3_rope_factors(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = tmp_path / "llama3.gguf"
    original, _ = _write(path, "llama", tie=True, rope_scaling=scaling)
    model, _ = load_gguf_model(path)
    assert mx.allclose(_logits(model), _logits(original), atol=1e-5).item()


def test_quantized_rows_unpermute_exactly() -> None:
    w = mx.random.normal((4 * 16, 64))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
    triple = [_unpermute_rows(_llama_cpp_permute(t, 4), 4) for t in (packed, scales, biases)]
    assert all(
        mx.array_equal(a, b).item() for a, b in zip(triple, (packed, scales, biases), strict=True)
    )
    permuted = [_llama_cpp_permute(t, 4) for t in (packed, scales, biases)]
    deq = mx.dequantize(*permuted, group_size=32, bits=4)
    assert mx.array_equal(
        deq, _llama_cpp_permute(mx.dequantize(packed, scales, biases, 32, 4), 4)
    ).item()

    weights = {"a.weight": packed, "a.scales": scales, "a.biases": biases}
    weights |= dict(zip(("b.weight", "b.scales", "b.biases"), mx.quantize(w, 32, 8), strict=True))
    assert _quant_params(weights, "f") == {
        "a": {"group_size": 32, "bits": 4},
        "b": {"group_size": 32, "bits": 8},
    }


def test_metadata_reader_agrees_with_mx_load(tmp_path: Path) -> None:
    path = tmp_path / "qwen2.gguf"
    _write(path, "qwen2", tie=True)
    ours = read_gguf_metadata(path)
    _, theirs = mx.load(str(path), return_metadata=True)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        expected = value.tolist() if isinstance(value, mx.array) else value
        assert ours[key] == pytest.approx(expected), key
    assert ours["qwen2.block_count"] == LAYERS and ours["tokenizer.ggml.add_bos_token"] is False


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.gguf"
    for call in (read_gguf_metadata, load_gguf_model):
        with pytest.raises(GGUFError, match=r"nope\.gguf: no such file"):
            call(path)


def test_bad_magic_and_version(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match=r"garbage\.gguf: not a GGUF file"):
        load_gguf_model(garbage)
    old = tmp_path / "old.gguf"
    old.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(GGUFError, match=r"old\.gguf: unsupported GGUF version 1"):
        read_gguf_metadata(old)


def test_truncated_file(tmp_path: Path) -> None:
    full = tmp_path / "full.gguf"
    _write(full, "llama", tie=True)
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in (10, 300, 4000, len(data) - 100):
        cut.write_bytes(data[:size])
        with pytest.raises(GGUFError, match=r"cut\.gguf: .*(truncated|past the end)"):
            load_gguf_model(cut)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    mx.save_gguf(
        str(path), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "mamba"}
    )
    with pytest.raises(GGUFError, match=r"mamba\.gguf: unsupported architecture.*'mamba'"):
        load_gguf_model(path)


def test_tokenizer_special_tokens() -> None:
    meta = _tokenizer_meta()
    tok = tokenizer_from_gguf(meta, "tiny.gguf")
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert tok.encode("<|im_start|>") == [1]
    ids = tok.encode("<|im_start|>user\nhello world<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    hello = tok.convert_tokens_to_ids("hello")
    assert hello in ids and tok.convert_tokens_to_ids("Ġw") in ids
    assert tok.decode(ids) == "<|im_start|>user\nhello world<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhello world"
    user = tok.convert_tokens_to_ids(USER_TOKEN)
    assert tok.encode(f"a{USER_TOKEN}b") == [
        tok.convert_tokens_to_ids("a"),
        user,
        tok.convert_tokens_to_ids("b"),
    ]
    assert tok.decode([user], skip_special_tokens=True) == USER_TOKEN  # user-defined stays
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert eos_token_ids(meta) == {0, 2}  # eos plus the <|endoftext|> control token


def test_tokenizer_pre_and_bos() -> None:
    twelve = _vocab()[0].index("12")
    assert twelve in tokenizer_from_gguf(_tokenizer_meta("gpt2"), "t").encode("123")
    for pre in ("smollm", "qwen2"):
        assert twelve not in tokenizer_from_gguf(_tokenizer_meta(pre), "t").encode("123")
    with_bos = tokenizer_from_gguf(_tokenizer_meta(**{"tokenizer.ggml.add_bos_token": True}), "t")
    assert with_bos.encode("hello")[0] == 1 and len(with_bos.encode("hello")) == 2
    with pytest.raises(GGUFError, match=r"t\.gguf: .*tokenizer\.ggml\.pre='mystery'"):
        tokenizer_from_gguf(_tokenizer_meta("mystery"), "t.gguf")
    with pytest.raises(GGUFError, match=r"t\.gguf: .*tokenizer\.ggml\.model='bert'"):
        tokenizer_from_gguf({**_tokenizer_meta(), "tokenizer.ggml.model": "bert"}, "t.gguf")


def test_quantized_gguf_dequantizes_exactly_in_float32(tmp_path: Path) -> None:
    """Q8_0 / Q4_1 / Q4_0 tensors written by llama.cpp's own ``gguf`` package, computed in
    float32 on the CPU backend: every weight equals ``gguf``'s float32 dequantization."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import dequantize, quantize

    from tandem.runner.loader import load_model, prepare_for_device

    model, tensors = _write(tmp_path / "float.gguf", "qwen2", tie=True)
    path = tmp_path / "quant.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    for key, value in {
        "block_count": LAYERS,
        "context_length": 512,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
    }.items():
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_float32("qwen2.rope.freq_base", 10000.0)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-5)
    kinds = {"token_embd": Q.Q8_0, "ffn_down": Q.Q4_0}
    want: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        x = np.array(w.astype(mx.float32))
        if x.ndim == 2:
            kind = next((k for part, k in kinds.items() if part in name), Q.Q4_1)
            data = quantize(x, kind)
            writer.add_tensor(name, data, raw_dtype=kind)
            want[name] = dequantize(data, kind).reshape(x.shape)
        else:
            writer.add_tensor(name, x)
            want[name] = x
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    loaded, _ = load_model(path, "auto")
    assert prepare_for_device(loaded, "auto") == "float32"
    got = dict(tree_flatten(loaded.parameters()))
    names = {n: m for n, m in ((_gguf_name(m), m) for m, _ in tree_flatten(model.parameters()))}
    for name, ref in want.items():
        w = got[names[name]]
        assert w.dtype == mx.float32, name
        assert np.array_equal(np.array(w), ref), (name, float(np.abs(np.array(w) - ref).max()))


def test_exported_gguf_tokenizer_is_the_same_tokenizer(tmp_path: Path) -> None:
    """``tandem export-tokenizer`` on a GGUF file: the Hugging Face folder it writes encodes,
    templates and ends (EOS) exactly as the tokenizer rebuilt from the GGUF metadata."""
    from transformers import AutoTokenizer

    from tandem.cli import main
    from tandem.frontend.tokenizer import Tokenizer

    path = tmp_path / "m.gguf"
    _write(path, "qwen2", tie=True)
    out = tmp_path / "tok"
    assert main(["export-tokenizer", str(out), "--model", str(path)]) == 0
    original, exported = Tokenizer.load(path), Tokenizer.load(out)
    hf = AutoTokenizer.from_pretrained(str(out))
    text = "hello 12 world<|im_end|> <tool>é\n"
    assert exported.encode(text) == original.encode(text) == hf.encode(text)
    msgs = [{"role": "user", "content": "hello"}]
    assert exported.apply_chat_template(msgs) == original.apply_chat_template(msgs)
    assert exported.eos_token_ids == original.eos_token_ids
    ids = original.encode(text)
    assert exported.decode(ids) == original.decode(ids)
    assert main(["export-tokenizer", str(path), "--model", str(path)]) == 2  # a file, not a dir
