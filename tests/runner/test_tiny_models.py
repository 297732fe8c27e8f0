"""tandem.testing.tiny_models: random models that mlx-lm loads and decodes like real ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import tandem.testing.tiny_models as tm
from tandem.testing.tiny_models import (
    ARCHITECTURES,
    QWEN3_0_6B,
    QWEN3_8B,
    make_random_model,
    make_tiny_model,
)

# isort: off
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

# isort: on

SENTENCE = "The quick brown fox jumps over the lazy dog, and then it sleeps."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object, object]]:
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHITECTURES:
        path = make_tiny_model(root / arch, arch)
        model, tokenizer = load(str(path))
        out[arch] = (path, model, tokenizer)
    return out


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_loads_float32_and_decodes_varied_tokens(tiny, arch: str) -> None:
    path, model, tokenizer = tiny[arch]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch
    params = dict(tree_flatten(model.parameters()))
    assert {v.dtype for v in params.values()} == {mx.float32}

    prompt = mx.array(tokenizer.encode("The quick brown fox"))
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=32)]
    assert len(tokens) == 32
    assert len(set(tokens)) >= 5, tokens
    assert all(0 <= t < config["vocab_size"] for t in tokens)
    assert isinstance(tokenizer.decode(tokens), str)


def test_architecture_specific_weights(tiny) -> None:
    def names(arch: str) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in tree_flatten(tiny[arch][1].parameters())}

    llama, qwen2, qwen3, moe = (names(a) for a in ARCHITECTURES)
    assert "model.layers.0.self_attn.q_proj.bias" not in llama
    assert "lm_head.weight" in llama  # untied by default
    assert qwen2["model.layers.0.self_attn.q_proj.bias"] == (64,)
    assert qwen2["model.layers.0.self_attn.k_proj.bias"] == (32,)
    assert "lm_head.weight" not in qwen2 and "lm_head.weight" not in qwen3  # tied
    assert qwen3["model.layers.1.self_attn.q_norm.weight"] == (16,)
    assert qwen3["model.layers.1.self_attn.k_norm.weight"] == (16,)
    assert moe["model.layers.0.mlp.gate.weight"] == (4, 64)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert moe[f"model.layers.1.mlp.switch_mlp.{proj}.weight"] == (4, 64, 64)


@pytest.mark.parametrize("tie", [True, False])
def test_tie_override(tmp_path: Path, tie: bool) -> None:
    path = make_tiny_model(tmp_path, "qwen3", tie_word_embeddings=tie, num_layers=1)
    model, tokenizer = load(str(path))
    assert ("lm_head.weight" in dict(tree_flatten(model.parameters()))) is not tie
    prompt = mx.array(tokenizer.encode("Hello there"))
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=32)]
    assert len(set(tokens)) >= 5, tokens


def test_tokenizer(tiny) -> None:
    path, _, tokenizer = tiny["qwen3"]
    config = json.loads((path / "config.json").read_text())
    hf = tokenizer._tokenizer
    assert len(hf) == config["vocab_size"] == 512
    assert type(tokenizer.detokenizer).__name__ == "BPEStreamingDetokenizer"

    ids = tokenizer.encode(SENTENCE)
    assert tokenizer.decode(ids) == SENTENCE
    assert len(ids) < 0.6 * len(SENTENCE)  # merges were learned, not just bytes

    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer.encode(special)) == 1
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert config["eos_token_id"] == im_end
    assert tokenizer.eos_token_ids == {im_end}
    gen_config = json.loads((path / "generation_config.json").read_text())
    assert gen_config["eos_token_id"] == im_end

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tokenizer.encode(text)
    assert chat_ids[0] == hf.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(chat_ids) == text

    for i in range(config["vocab_size"]):  # every id decodes
        assert isinstance(hf.decode([i]), str)


def test_same_seed_same_files(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", "qwen3_moe", seed=3)
    b = make_tiny_model(tmp_path / "b", "qwen3_moe", seed=3)
    c = make_tiny_model(tmp_path / "c", "qwen3_moe", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_random_model_pads_vocab_and_shards(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tm, "_SHARD_BYTES", 64 << 10)
    overrides = {**QWEN3_0_6B, "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "vocab_size": 1000}  # fmt: skip
    path = make_random_model(tmp_path, "qwen3", overrides, tokenizer_vocab=300)
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)

    model, tokenizer = load(str(path))
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.bfloat16}
    assert len(tokenizer._tokenizer) == 1000
    assert tokenizer.decode(tokenizer.encode(SENTENCE)) == SENTENCE
    detok = tokenizer.detokenizer
    for i in (0, 299, 300, 999):  # trained ids and filler ids alike
        detok.add_token(i)
    detok.finalize()
    assert detok.text


@pytest.mark.parametrize(("config", "billions"), [(QWEN3_0_6B, 0.596), (QWEN3_8B, 8.19)])
def test_qwen3_shapes(config: dict, billions: float) -> None:
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs.from_dict({"model_type": "qwen3", **config})
    model = qwen3.Model(args)  # lazy: nothing is allocated
    count = sum(math.prod(v.shape) for _, v in tree_flatten(model.parameters()))
    assert count == pytest.approx(billions * 1e9, rel=0.01)
