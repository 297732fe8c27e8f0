"""tandem.testing.model_zoo and tandem.bench.models: a tiny model of any mlx-lm type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench import models as bench
from tandem.testing import model_zoo

# isort: off
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

# isort: on

# type -> the cache kinds its tiny model must have (one layer of each kind at least).
KINDS = {
    "llama": {"KVCache"},
    "gemma3_text": {"KVCache", "RotatingKVCache"},
    "gpt_oss": {"KVCache", "RotatingKVCache"},
    "deepseek_v3": set(),  # no make_cache: plain KV caches
    "qwen3_next": {"KVCache", "ArraysCache"},
    "mamba2": {"ArraysCache"},
    "falcon_h1": {"CacheList"},
}


def test_model_types_are_the_models_package_without_helpers() -> None:
    types = model_zoo.model_types()
    assert len(types) > 100
    assert {"llama", "qwen3", "gemma3_text", "mamba2", "lille-130m"} <= set(types)
    assert not set(types) & model_zoo.HELPERS


@pytest.mark.parametrize("model_type", sorted(KINDS))
def test_tiny_config_loads_in_mlx_lm_and_decodes_varied_tokens(
    tmp_path: Path, model_type: str
) -> None:
    config = model_zoo.tiny_config(model_type)
    assert config["model_type"] == model_type
    assert config.get("hidden_size", 64) == 64
    path = model_zoo.make_zoo_model(tmp_path / model_type, model_type)
    written = json.loads((path / "config.json").read_text())
    assert written["vocab_size"] == model_zoo.VOCAB
    model, tokenizer = load(str(path))
    model_zoo.check_loaded(path, model, model_type)  # sanitize() kept what was written

    caches = model.make_cache() if hasattr(model, "make_cache") else []
    assert {type(c).__name__ for c in caches} == KINDS[model_type]
    assert 2 <= len(model.layers) <= 4

    prompt, _ = bench.prompts(model_type, model_zoo.VOCAB)
    logits = model(mx.array(prompt)[None])
    assert bool(mx.all(mx.isfinite(logits)))
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=24)]
    assert len(set(tokens)) >= 4, tokens
    assert isinstance(tokenizer.decode(tokens), str)


def test_sliding_windows_are_shorter_than_the_prompts() -> None:
    config = model_zoo.tiny_config("gemma3_text")
    assert config["sliding_window"] < bench.PROMPT_LEN
    assert config["sliding_window_pattern"] == config["num_hidden_layers"] == 2


def test_wrappers_nest_a_tiny_text_config() -> None:
    config = model_zoo.tiny_config("qwen3_vl")
    assert config["text_config"]["model_type"] == "qwen3"
    assert config["text_config"]["hidden_size"] == 64
    assert model_zoo.tiny_config("qwen3_5_moe")["text_config"]["num_experts"] == 4
    assert model_zoo.tiny_config("qwen3_5")["text_config"].get("num_experts", 0) == 0


def test_unbuildable_types_say_why() -> None:
    with pytest.raises(ValueError, match="quantized pack"):
        model_zoo.tiny_config("prism_hadamard_qwen35")


def test_render_counts_every_status_and_escapes_cells() -> None:
    results = [
        bench.Result("b", "refused", "model type 'b' uses a | pipe"),
        bench.Result("a", "supported"),
        bench.Result("c", "fails", "mismatch on the single prompt: first differing token 3"),
        bench.Result("d", "no tiny config", "mlx-lm: NaN logits"),
        bench.Result("e", "not a text model", "needs pixel values"),
    ]
    text = bench.render(results, "python -m tandem.bench.models --out x.md", 60.0)
    assert "**1 of 4 text model types supported**" in text
    assert "1 refused, 1 fail, 1 without a tiny config; 1 not text models" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["a", "b", "c", "d", "e"]
    assert "a \\| pipe" in rows[1]
    assert "python -m tandem.bench.models --out x.md" in text


def test_bench_tool_reports_llama_and_qwen3_supported(tmp_path: Path) -> None:
    out = tmp_path / "models.md"
    assert bench.main(["--out", str(out), "--types", "llama,qwen3", "--jobs", "2"]) == 0
    text = out.read_text()
    assert "**2 of 2 text model types supported**" in text
    assert "| `llama` | supported |" in text and "| `qwen3` | supported |" in text
