"""GGUF files of gemma2, gemma3, qwen3 and qwen3moe, written with llama.cpp's ``gguf`` writer
the way its converter writes them (tensor names, Gemma's ``1 + w`` norms, tied embeddings,
stacked experts, SentencePiece / byte-level BPE vocabularies): every parameter comes back as
the original mlx-lm model's, and Tandem's greedy output is mlx-lm's token for token."""

from __future__ import annotations

import functools
import importlib
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tandem.runner  # noqa: F401  (BLAS preload before mlx)
from tandem.frontend.gguf_tokenizer import tokenizer_from_gguf
from tandem.runner.gguf import _config, load_gguf_model
from tandem.testing.families import WINDOW, family_config
from tandem.testing.tiny_models import CORPUS
from tests.runner.test_gguf import _byte_chars

# isort: off
import mlx.core as mx
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

# isort: on

VOCAB = 512
# general.architecture -> mlx-lm model_type
ARCHS = {"gemma2": "gemma2", "gemma3": "gemma3_text", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
PROMPT = [(5 * i) % 500 + 3 for i in range(3 * WINDOW + 6)]  # 30 tokens, past the window
USER_TOKEN = "<tool>"
_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
    "input_layernorm": "attn_norm",
}
_GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _hf_config(arch: str) -> dict[str, Any]:
    if arch.startswith("gemma"):  # 4 layers; gemma3: windows of 8, every 2nd layer global
        return family_config(ARCHS[arch])
    config = {
        "model_type": ARCHS[arch],
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "tie_word_embeddings": arch == "qwen3moe",  # qwen3: an `output` tensor
    }
    if arch == "qwen3moe":
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        config.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return config


def _random_model(arch: str, seed: int = 0) -> Any:
    """A float32 mlx-lm model with random weights, norms included, rounded to bfloat16 as
    the checkpoints llama.cpp converts are (so Gemma's stored 1 + w is exact in float32)."""
    config = _hf_config(arch)
    module = importlib.import_module(f"mlx_lm.models.{ARCHS[arch]}")
    model = module.Model(module.ModelArgs.from_dict(config))
    if arch == "gemma3":  # as its sanitize does for a checkpoint without lm_head
        model.tie_word_embeddings = True
        model.pop("lm_head")
    new = []
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        key = mx.random.key(seed * 1000 + i)
        if name == "model.norm.weight":  # std 1, or greedy decoding repeats one token
            w = mx.random.uniform(-(3**0.5), 3**0.5, p.shape, key=key)
        elif name.endswith("norm.weight"):  # w in [0.5, 1.5] (gemma's scale: 1 + w)
            w = mx.random.uniform(0.5, 1.5, p.shape, key=key)
        else:
            tied = "lm_head.weight" not in dict(tree_flatten(model.parameters()))
            std = (0.2 if tied else 1.0) if "embed_tokens" in name else p.shape[-1] ** -0.5
            w = mx.random.uniform(-(3**0.5) * std, 3**0.5 * std, p.shape, key=key)
        if name.endswith("norm.weight"):  # bf16 keeps 8 bits: no |w| below 2**-16
            w = mx.where(mx.abs(w) < 2**-8, 2**-8, w)
        new.append((name, w.astype(mx.bfloat16).astype(mx.float32)))
    model.load_weights(new, strict=True)
    mx.eval(model.parameters())
    return model


def _gguf_name(mlx_name: str, arch: str) -> str:
    module, _, suffix = mlx_name.rpartition(".")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if module in top:
        return f"{top[module]}.{suffix}"
    _, _, index, rest = module.split(".", 3)
    names = {**_TO_GGUF, "post_attention_layernorm": "ffn_norm"}
    if arch.startswith("gemma"):
        names |= _GEMMA_NORMS
    return f"blk.{index}.{names[rest]}.{suffix}"


@functools.lru_cache(maxsize=1)
def _sentencepiece() -> Any:
    """A SentencePiece BPE trained like Gemma's: byte fallback, no dummy prefix, no
    normalization; ids 0-3 are pad, eos, bos, unk."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        hard_vocab_limit=False,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=[USER_TOKEN],
        control_symbols=["<start_of_turn>", "<end_of_turn>"],
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """What llama.cpp's converter writes for it: pieces, scores, token types (user-defined
    from the added tokens), padded with unused tokens to the embedding's rows."""
    sp = _sentencepiece()
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        kind = 1
        for test, k in ((sp.is_unknown, 2), (sp.is_control, 3), (sp.is_unused, 5), (sp.is_byte, 6)):
            kind = k if test(i) else kind
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(4 if piece == USER_TOKEN else kind)
    while len(tokens) < VOCAB:
        tokens.append(f"[PAD{len(tokens)}]")
        scores.append(-1000.0)
        types.append(5)
    return tokens, scores, types


def _tokenizer_meta(arch: str, add_space_prefix: bool = False) -> dict[str, Any]:
    if arch.startswith("gemma"):
        tokens, scores, types = _spm_vocab()
        return {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": add_space_prefix,
        }
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_chars() + ["Ġt", "he", "Ġthe"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens + [f"<unused{i}>" for i in range(VOCAB - len(tokens))],
        "tokenizer.ggml.token_type": types + [5] * (VOCAB - len(types)),
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }


def _add_metadata(writer: GGUFWriter, meta: dict[str, Any]) -> None:
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:  # int32 / float32 / string arrays
            writer.add_array(key, value)


def _write_gguf(
    path: Path, arch: str, model: Any, kinds: dict[str, Q] | None = None
) -> dict[str, np.ndarray]:
    """Write ``model`` as a GGUF file; returns the float32 weights the loader should give
    back, by mlx-lm name. ``kinds``: quantize matrices whose GGUF name holds a key of it
    as its value, the others as Q4_1 (None: all float32)."""
    c = _hf_config(arch)
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    if arch == "gemma2":  # no rope.freq_base: llama.cpp's default 10000
        writer.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(c["final_logit_softcapping"])
        writer.add_sliding_window(4096)
    else:
        writer.add_rope_freq_base(c["rope_theta"])
    if arch == "gemma3":
        writer.add_sliding_window(c["sliding_window"])
        writer.add_sliding_window_pattern(c["sliding_window_pattern"])  # llama.cpp: 6
    if arch == "qwen3moe":
        writer.add_expert_count(c["num_experts"])
        writer.add_expert_used_count(c["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    _add_metadata(writer, _tokenizer_meta(arch))

    want: dict[str, np.ndarray] = {}
    for name, w in tree_flatten(model.parameters()):
        gguf_name = _gguf_name(name, arch)
        x = np.array(w)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            x = x + np.float32(1.0)  # the converter's data_torch + 1
        if kinds is not None and x.ndim >= 2:
            kind = next((k for part, k in kinds.items() if part in gguf_name), Q.Q4_1)
            data = quantize(x, kind)
            writer.add_tensor(gguf_name, data, raw_dtype=kind)
            want[name] = dequantize(data, kind).reshape(x.shape)
        else:
            writer.add_tensor(gguf_name, x)
            want[name] = np.array(w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return want


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def _tandem_greedy(path: Path, prompt: list[int], n: int) -> tuple[Any, list[int]]:
    from tandem import LLM
    from tests.parity.test_mlx_lm_parity import greedy

    llm = LLM(str(path), check_invariants=True)
    return llm, llm.generate([prompt], greedy(n))[0].token_ids


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_float32_round_trip_and_greedy_parity(tmp_path: Path, arch: str) -> None:
    original = _random_model(arch)
    path = tmp_path / f"{arch}.gguf"
    want = _write_gguf(path, arch, original)
    model, config = load_gguf_model(path)
    assert config["model_type"] == ARCHS[arch]
    got = dict(tree_flatten(model.parameters()))
    assert set(got) == set(want)
    for name, ref in want.items():
        assert got[name].dtype == mx.float32, name
        assert np.array_equal(np.array(got[name]), ref), name
    assert _greedy(model, PROMPT, 30) == _greedy(original, PROMPT, 30)

    llm, out = _tandem_greedy(path, PROMPT, 30)
    assert out == _greedy(original, PROMPT, 30)
    assert len(set(out)) > 3  # the model says something
    if arch.startswith("gemma"):  # its SentencePiece vocabulary, with the bos it asks for
        assert llm.encode("Hello world") == [2, *_sentencepiece().encode("Hello world")]
        assert 1 in llm.tokenizer.eos_token_ids


@pytest.mark.parametrize("arch", ["gemma3", "qwen3moe"])
def test_quantized_round_trip_and_greedy_parity(tmp_path: Path, arch: str) -> None:
    """Q8_0 embedding, Q4_0 down projections (stacked experts too), Q4_1 the rest: computed
    in float32 each weight is ``gguf``'s own dequantization, and Tandem's greedy output is
    mlx-lm's on the original model given those weights."""
    from tandem.runner.loader import load_model, prepare_for_device

    original = _random_model(arch)
    path = tmp_path / f"{arch}.q.gguf"
    want = _write_gguf(path, arch, original, {"token_embd": Q.Q8_0, "ffn_down": Q.Q4_0})
    loaded, _ = load_model(path, "auto")
    assert prepare_for_device(loaded, "auto") == "float32"
    got = dict(tree_flatten(loaded.parameters()))
    assert set(got) == set(want)
    for name, ref in want.items():
        assert np.array_equal(np.array(got[name]), ref), name
    original.load_weights([(k, mx.array(v)) for k, v in want.items()], strict=True)
    assert _tandem_greedy(path, PROMPT, 30)[1] == _greedy(original, PROMPT, 30)


def test_gemma_file_holds_norms_plus_one_and_llama_cpp_hyperparameters(tmp_path: Path) -> None:
    original = _random_model("gemma3")
    path = tmp_path / "gemma3.gguf"
    _write_gguf(path, "gemma3", original)
    raw = mx.load(str(path))
    assert isinstance(raw, dict) and "output.weight" not in raw  # tied, as llama.cpp writes
    stored = raw["blk.0.attn_q_norm.weight"]
    q_norm = original.layers[0].self_attn.q_norm.weight
    assert mx.array_equal(stored, q_norm + 1).item()
    model, config = load_gguf_model(path)
    assert mx.array_equal(model.layers[0].self_attn.q_norm.weight, q_norm).item()
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (WINDOW, 2)
    assert config["query_pre_attn_scalar"] == 16 and config["rope_local_base_freq"] == 10000.0
    assert config["tie_word_embeddings"] and "lm_head" not in model

    _write_gguf(tmp_path / "gemma2.gguf", "gemma2", _random_model("gemma2"))
    _, g2 = load_gguf_model(tmp_path / "gemma2.gguf")
    assert (g2["attn_logit_softcapping"], g2["final_logit_softcapping"]) == (50.0, 30.0)
    assert g2["rope_theta"] == 10000.0 and g2["query_pre_attn_scalar"] == 16


def _meta(arch: str, **extra: Any) -> dict[str, Any]:
    keys = {
        "block_count": 62,
        "embedding_length": 5376,
        "attention.head_count": 32,
        "attention.head_count_kv": 16,
        "attention.key_length": 128,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "context_length": 131072,
        "feed_forward_length": 21504,
    }
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in (keys | extra).items()}}


def test_llama_cpp_defaults_for_what_the_file_does_not_say() -> None:
    embd = {"token_embd.weight": mx.zeros((VOCAB, 4))}
    # gemma3 27B (62 layers): queries scaled by hidden / heads = 168; one global layer in 6
    c = _config(_meta("gemma3", **{"attention.sliding_window": 1024}), embd, "f")
    assert c["query_pre_attn_scalar"] == 168 and c["sliding_window_pattern"] == 6
    assert c["rope_theta"] == 1e6 and c["rope_local_base_freq"] == 10000.0
    swa = {"attention.sliding_window": 8}
    pattern = {"attention.sliding_window_pattern": [True, True, False] * 20 + [True, True]}
    assert _config(_meta("gemma3", **swa, **pattern), embd, "f")["sliding_window_pattern"] == 3
    c = _config(_meta("gemma3", block_count=26), embd, "f")  # no window: all layers global
    assert c["sliding_window_pattern"] == 1 and c["query_pre_attn_scalar"] == 128
    assert _config(_meta("gemma2", block_count=46), embd, "f")["query_pre_attn_scalar"] == 168
    moe = _meta("qwen3moe", expert_count=128, expert_used_count=8, expert_feed_forward_length=768)
    c = _config(moe, embd, "f")
    assert (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]) == (128, 8, 768)
    assert c["norm_topk_prob"] and c["decoder_sparse_step"] == 1 and c["mlp_only_layers"] == []
    from tandem.frontend.gguf_meta import GGUFError

    with pytest.raises(GGUFError, match=r"f: rope scaling 'yarn' is not supported for qwen3moe"):
        _config({**moe, "qwen3moe.rope.scaling.type": "yarn"}, embd, "f")
    with pytest.raises(GGUFError, match=r"f: .*sliding_window_pattern"):
        _config(
            _meta("gemma3", **swa, **{"attention.sliding_window_pattern": [True] * 62}), embd, "f"
        )


TEXTS = [
    "Hello world",
    "  two  spaces   here \t tab",
    "The committee reviewed the proposal carefully.\nNew line\n\n",
    "naïve café – 東京 🙂",  # characters not in the vocabulary: byte fallback
    "fibonacci(10)  # 55 and 1,000,000",
    f"a{USER_TOKEN}b {USER_TOKEN} c",
    " ",
    "",
]


def test_sentencepiece_tokenizer_matches_sentencepiece() -> None:
    """``tokenizer.ggml.model == "llama"``: the rebuilt tokenizer encodes and decodes as the
    SentencePiece model the vocabulary came from (Gemma's settings); with the llama-style
    space prefix it prefixes the text."""
    sp = _sentencepiece()
    tok = tokenizer_from_gguf(_tokenizer_meta("gemma3"), "g.gguf")
    for text in [*TEXTS, CORPUS]:
        ids = tok.encode(text)
        assert ids[0] == 2 and ids[1:] == sp.encode(text), text  # add_bos_token
        assert tok.decode(ids, skip_special_tokens=True) == sp.decode(ids[1:]) == text
    assert tok.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False) == [
        sp.piece_to_id("<start_of_turn>"),
        *sp.encode("user\nhi"),
        sp.piece_to_id("<end_of_turn>"),
    ]
    prefixed = tokenizer_from_gguf(_tokenizer_meta("gemma3", True), "g.gguf")
    ids = prefixed.encode("Hello world", add_special_tokens=False)
    assert ids == sp.encode(" Hello world") and prefixed.decode(ids) == "Hello world"
