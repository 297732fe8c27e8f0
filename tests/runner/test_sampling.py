"""In-graph sampling: exact filtered distributions, per-row seeds, batch independence."""

from __future__ import annotations

import mlx.core as mx  # noqa: I001
import numpy as np
import pytest

import tandem.runner  # noqa: F401
from tandem import LLM, SamplingParams
from tandem.engine.plan import RowSampling
from tandem.runner.sampler import make_sampling_arrays, sample

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0], dtype=np.float32)
ROWS = 40000


def frequencies(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    s = RowSampling(
        (temperature,) * ROWS,
        (top_k,) * ROWS,
        (top_p,) * ROWS,
        tuple(range(ROWS)),
        min_p=(min_p,) * ROWS,
    )
    arrays = make_sampling_arrays(s, len(LOGITS))
    logits = mx.broadcast_to(mx.array(LOGITS), (ROWS, len(LOGITS)))
    toks = np.array(sample(logits, arrays, mx.zeros((ROWS,), dtype=mx.int32)))
    return np.bincount(toks, minlength=len(LOGITS)) / ROWS


def expected(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    p = np.exp(LOGITS / temperature)
    p /= p.sum()
    if min_p:  # vLLM's order: min-p on the tempered distribution, then top-k, top-p
        p = np.where(p >= min_p * p.max(), p, 0)
        p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, dtype=bool)
    if top_k:
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    q = np.where(keep, p, 0)
    q /= q.sum()
    mass = 0.0
    final = np.zeros_like(keep)
    for i in order:
        if not keep[i] or mass >= top_p:
            continue
        final[i] = True
        mass += q[i]
    q = np.where(final, q, 0)
    return q / q.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 0, 1.0, 0.0),
        (1.0, 2, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (1.5, 3, 0.9, 0.0),
        (1.0, 0, 1.0, 0.2),
        (2.0, 0, 1.0, 0.3),
    ],
)
def test_sampling_frequencies_match_the_filtered_softmax(temperature, top_k, top_p, min_p):
    # 40k draws: the standard error of each frequency is < 0.0025; allow 4 sigma.
    got = frequencies(temperature, top_k, top_p, min_p)
    np.testing.assert_allclose(got, expected(temperature, top_k, top_p, min_p), atol=0.01)


def test_logit_bias_moves_greedy_and_sampled_rows_alone():
    # Row 0 greedy with +100 on token 3, row 1 greedy untouched, row 2 sampled with -100 on
    # the top token: it never appears.
    s = RowSampling(
        (0.0, 0.0, 1.0),
        (0, 0, 0),
        (1.0, 1.0, 1.0),
        (1, 2, 3),
        logit_bias=((0, 3, 100.0), (2, 0, -100.0)),
    )
    arrays = make_sampling_arrays(s, len(LOGITS))
    logits = mx.broadcast_to(mx.array(LOGITS), (3, len(LOGITS)))
    for pos in range(50):
        toks = sample(logits, arrays, mx.full((3,), pos, dtype=mx.int32)).tolist()
        assert toks[0] == 3 and toks[1] == 0 and toks[2] != 0


def test_min_tokens_masks_stop_tokens_until_reached_also_in_chained_steps(tiny_model_dir):
    """EOS pushed to the top by logit_bias: without min_tokens the first token is EOS; with
    min_tokens = 6 exactly six tokens come first, then EOS ends the output."""
    path = tiny_model_dir("llama")
    for overlap in (True, False):
        llm = LLM(str(path), overlap=overlap)
        eos = min(llm.tokenizer.eos_token_ids)
        biased = {"logit_bias": {eos: 100.0}, "temperature": 0.0, "max_tokens": 20}
        plain = llm.generate([[5, 6, 7]], SamplingParams(**biased))[0]
        assert plain.token_ids == [eos] and plain.finish_reason == "stop"
        held = llm.generate([[5, 6, 7]], SamplingParams(min_tokens=6, **biased))[0]
        assert len(held.token_ids) == 7 and held.token_ids[-1] == eos
        assert eos not in held.token_ids[:6] and held.finish_reason == "stop"
        # A batchmate without edits is not affected.
        ref = llm.generate([[9, 9]], SamplingParams(max_tokens=12, temperature=0))[0]
        both = llm.generate(
            [[9, 9], [5, 6, 7]],
            [SamplingParams(max_tokens=12, temperature=0), SamplingParams(min_tokens=6, **biased)],
        )
        assert both[0].token_ids == ref.token_ids and both[1].token_ids == held.token_ids


def test_sampling_params_validate_new_fields():
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 200.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    assert SamplingParams(logit_bias=[[7, 1], [2, -3]]).logit_bias == ((2, -3.0), (7, 1.0))


def test_greedy_rows_ignore_noise_in_a_mixed_batch():
    s = RowSampling((0.0, 1.0), (0, 0), (1.0, 1.0), (1, 2))
    arrays = make_sampling_arrays(s, len(LOGITS))
    logits = mx.broadcast_to(mx.array(LOGITS), (2, len(LOGITS)))
    for pos in range(20):
        toks = sample(logits, arrays, mx.full((2,), pos, dtype=mx.int32)).tolist()
        assert toks[0] == 0


def test_seeded_request_gives_the_same_tokens_alone_and_in_batches(tiny_model_dir):
    path = tiny_model_dir("qwen2")
    sp = SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
    )
    prompt = [40, 41, 42, 43]
    alone = LLM(str(path)).generate([prompt], sp)[0].token_ids
    for overlap in (True, False):
        llm = LLM(str(path), overlap=overlap)
        others = [
            SamplingParams(max_tokens=n, temperature=1.0, seed=n, ignore_eos=True)
            for n in (5, 30, 12)
        ]
        outs = llm.generate([[7, 8], prompt, [9] * 20, [3, 4, 5]], [others[0], sp, *others[1:]])
        assert outs[1].token_ids == alone
    different = (
        LLM(str(path))
        .generate(
            [prompt], SamplingParams(max_tokens=24, temperature=0.9, seed=99, ignore_eos=True)
        )[0]
        .token_ids
    )
    assert different != alone


def test_top_k_one_equals_greedy(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = LLM(str(path))
    prompt = [100, 101, 102]
    g = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    k1 = llm.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=1.3, top_k=1, seed=3, ignore_eos=True)
    )
    assert g[0].token_ids == k1[0].token_ids


def test_top_k_candidates_draw_the_same_tokens_as_the_full_vocabulary():
    from dataclasses import replace

    rng = np.random.default_rng(0)
    rows, vocab = 64, 300
    logits = mx.array(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
    s = RowSampling(
        tuple(0.0 if i % 4 == 0 else 0.7 + i / 100 for i in range(rows)),
        tuple(5 + i % 30 for i in range(rows)),
        tuple(1.0 if i % 3 else 0.85 for i in range(rows)),
        tuple(range(rows)),
        min_p=tuple(0.05 if i % 5 == 0 else 0.0 for i in range(rows)),
    )
    arrays = make_sampling_arrays(s, vocab)
    assert arrays.candidates == 34
    full = replace(arrays, candidates=0)
    for pos in range(5):
        p = mx.full((rows,), pos, dtype=mx.int32)
        assert sample(logits, arrays, p).tolist() == sample(logits, full, p).tolist()
