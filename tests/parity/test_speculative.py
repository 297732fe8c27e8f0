"""N-gram speculative decoding on real tiny models: greedy output equal to mlx-lm's
``generate_step`` (and so to Tandem without speculation) under staggered arrivals, prefix
hits, stop tokens, aborts, page boundaries inside accepted runs and a fuzzed schedule, overlap
on and off; log-probabilities of accepted tokens (hybrid models: test_speculative_hybrid.py)."""

from __future__ import annotations

import random

import pytest
from test_mlx_lm_parity import greedy, reference, run_staggered

from tandem import LLM
from tandem.testing.fuzz_parity import run as fuzz

# Speculating from the first decode step on, whatever the step times say (engine/spec_gain.py
# has its own tests).
SPEC = {"speculative": "ngram", "num_speculative_tokens": 4, "speculative_min_gain": 0}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_staggered_requests_match_mlx_lm_overlap_on_and_off(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    results = []
    for overlap in (True, False):
        llm = LLM(str(path), overlap=overlap, check_invariants=True, max_num_seqs=32, **SPEC)
        results.append(run_staggered(llm, path, random.Random(arch)))
        # Verifies ran (short random outputs reject most proposals: the cut-back path).
        assert llm.engine.scheduler.stats.spec_verifies > 0
    assert results[0] == results[1]


@pytest.mark.parametrize("overlap", [True, False])
def test_repetitive_output_speculates_across_page_boundaries(tiny_model_dir, overlap):
    """A prompt the model continues in a loop: long accepted runs, many crossing the
    4-position pages; equal to mlx-lm."""
    path = tiny_model_dir("llama")
    llm = LLM(str(path), overlap=overlap, check_invariants=True, kv_page_size=4, **SPEC)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(6)] * 4 for _ in range(4)]
    outs = llm.generate(prompts, greedy(80))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(path, prompt, 80)
    stats = llm.engine.scheduler.stats
    assert stats.spec_accepted > 0
    steps = llm.engine.loop.num_steps
    assert steps < 4 * 80  # fewer steps than one token per request per step would take


def test_logprobs_of_accepted_tokens_equal_plain_decoding(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompt = [11, 12, 13, 14] * 5
    plain = LLM(str(path)).generate([prompt], greedy(40, logprobs=3))[0]
    llm = LLM(str(path), **SPEC)
    spec = llm.generate([prompt], greedy(40, logprobs=3))[0]
    assert spec.token_ids == plain.token_ids
    assert llm.engine.scheduler.stats.spec_accepted > 0
    for (lp_a, top_a), (lp_b, top_b) in zip(spec.logprobs, plain.logprobs, strict=True):
        assert abs(lp_a - lp_b) < 1e-4
        assert [t for t, _ in top_a] == [t for t, _ in top_b]


@pytest.mark.parametrize(("overlap", "seed"), [(True, 7), (False, 8)])
def test_fuzzed_schedule_with_speculation_is_token_exact(tiny_model_dir, overlap, seed):
    report = fuzz(
        str(tiny_model_dir("qwen3")),
        80,
        seed,
        overlap=overlap,
        speculative="ngram",
        speculative_min_gain=0,
    )
    assert report.mismatches == []
    assert report.aborted > 0 and report.hit_tokens > 0 and report.spec_accepted > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_sampled_rows_draw_what_plain_decoding_draws_for_every_seed(tiny_model_dir, overlap):
    """Temperature, top-p, top-k, min-p: with speculation each seed's sample is the one plain
    decoding gives (the acceptance rule for a one-token proposal is the rejection-sampling
    rule, and the sampler's noise is a function of seed and position), so the output
    distribution is unchanged; proposals were accepted and rejected on the way."""
    from tandem import SamplingParams

    path = tiny_model_dir("llama")
    prompt = [21, 22, 23, 24, 25] * 4
    params = [
        SamplingParams(
            max_tokens=24,
            temperature=(0.6, 1.0, 1.3)[s % 3],
            top_p=(1.0, 0.9)[s % 2],
            top_k=(0, 50)[s % 2],
            min_p=0.02 if s % 5 == 0 else 0.0,
            seed=s,
            ignore_eos=True,
            logprobs=1 if s % 4 == 0 else None,
        )
        for s in range(48)
    ]
    plain = LLM(str(path), overlap=overlap).generate([prompt] * 48, params)
    llm = LLM(str(path), overlap=overlap, check_invariants=True, speculative_max_batch=48, **SPEC)
    spec = llm.generate([prompt] * 48, params)
    for a, b in zip(spec, plain, strict=True):
        assert a.token_ids == b.token_ids
        if b.logprobs is not None:
            # The same top tokens; their values within float32 rounding (a verify row's
            # logits come from another matmul shape than a decode's, which on some CPUs'
            # BLAS kernels rounds differently).
            for (va, ta), (vb, tb) in zip(a.logprobs, b.logprobs, strict=True):
                assert [t for t, _ in ta] == [t for t, _ in tb]
                assert va == pytest.approx(vb, abs=1e-5)
                assert [v for _, v in ta] == pytest.approx([v for _, v in tb], abs=1e-5)
    stats = llm.engine.scheduler.stats
    assert 0 < stats.spec_accepted < stats.spec_proposed
    assert len({tuple(o.token_ids) for o in spec}) > 10


def penalized(count: int, max_tokens: int) -> list:
    """Greedy and sampled rows with presence, frequency and repetition penalties."""
    from tandem import SamplingParams

    return [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=(0, 0.8)[s % 2],
            seed=s,
            presence_penalty=(0.0, 0.4)[s % 2],
            frequency_penalty=(0.3, 0.0)[s % 2],
            repetition_penalty=(1.0, 1.2, 1.1)[s % 3],
            ignore_eos=True,
        )
        for s in range(count)
    ]


@pytest.mark.parametrize("overlap", [True, False])
def test_penalized_rows_speculate_and_match_plain_decoding(tiny_model_dir, overlap):
    """Presence, frequency and repetition penalties: each verify row counts the proposals
    before it, so the tokens are plain decoding's (which test_mlx_lm_parity checks against a
    reference processor)."""

    path = tiny_model_dir("llama")
    prompt = [31, 32, 33, 34] * 5
    params = penalized(12, 30)
    plain = LLM(str(path), overlap=overlap).generate([prompt] * 12, params)
    llm = LLM(str(path), overlap=overlap, check_invariants=True, speculative_max_batch=16, **SPEC)
    spec = llm.generate([prompt] * 12, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.scheduler.stats.spec_verifies > 0


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss", "deepseek_v3"])
def test_windowed_sink_and_mla_models_speculate_exactly(family_model_dir, model_type):
    """Verify positions attend like decodes: inside sliding windows (gemma3), with attention
    sinks (gpt-oss) and over MLA latents (dense layers): equal to plain decoding."""
    path = str(family_model_dir(model_type))
    rng = random.Random(model_type)
    prompts = [[rng.randrange(3, 200) for _ in range(5)] * 6 for _ in range(3)]
    plain = LLM(path).generate(prompts, greedy(48))
    llm = LLM(path, check_invariants=True, kv_page_size=4, **SPEC)
    spec = llm.generate(prompts, greedy(48))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.scheduler.stats.spec_verifies > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_guided_requests_speculate_valid_and_exact(tiny_model_dir, overlap):
    """JSON schemas, regexes, grammars and choices, greedy and sampled, with unconstrained
    batchmates: with speculation the same tokens as without, every answer valid."""
    path = tiny_model_dir("llama")
    llm = LLM(str(path), overlap=overlap, check_invariants=True, speculative_max_batch=64, **SPEC)
    guided_exact(LLM(str(path), overlap=overlap), llm, seed=4)


def guided_exact(plain_llm: LLM, llm: LLM, seed: int) -> None:
    """A batch of guided requests (test_guided_model) gives the same tokens on ``llm`` (which
    speculates) as on ``plain_llm``, every answer valid, and proposals were accepted."""
    from test_guided_model import _batch

    prompts, params, cases = _batch(seed=seed)
    plain = plain_llm.generate(prompts, params)
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for o, case in zip(spec, cases, strict=True):
        if case is not None:
            assert o.finish_reason == "stop" and case.check(o.text), (case.name, o.text)
    assert llm.engine.scheduler.stats.spec_accepted > 0
