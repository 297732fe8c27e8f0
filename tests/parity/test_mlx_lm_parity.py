"""Greedy output is token-exact with mlx-lm's generate_step, however requests are scheduled."""

from __future__ import annotations

import random

import mlx.core as mx  # noqa: I001
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

import tandem.runner  # noqa: F401  (BLAS preload before mlx)
from tandem import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
_refs: dict[tuple, list[int]] = {}
_models: dict[str, object] = {}


def reference(path, prompt: list[int], max_tokens: int) -> list[int]:
    key = (str(path), tuple(prompt), max_tokens)
    if key not in _refs:
        if str(path) not in _models:
            _models[str(path)] = load(str(path))[0]
        gen = generate_step(mx.array(prompt), _models[str(path)], max_tokens=max_tokens)
        _refs[key] = [int(t) for t, _ in gen]
    return _refs[key]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_single_request_matches_mlx_lm(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    llm = LLM(str(path), check_invariants=True)
    prompt = [5, 9, 14, 3, 200, 7, 8]
    out = llm.generate([prompt], greedy(40))[0]
    assert out.token_ids == reference(path, prompt, 40)
    assert out.finish_reason == "length"


def run_staggered(
    llm: LLM, path, rng: random.Random, num: int = 18, aborts: int = 3, solo=None, tie=None
):
    """Requests of different lengths join at different steps; some stop mid-chain on a stop
    token, some are aborted while a step is in flight. Each must equal mlx-lm's greedy
    output, or ``solo(prompt, n)``'s where given, unless ``tie(prompt, got, want)`` says
    they first part at a near-tie (then nothing after it is compared)."""
    engine = llm.engine
    vocab = llm.tokenizer.vocab_size
    specs = []
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    for i in range(num):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 70))]
        if i % 3 == 0:  # prefix-cache hits of different lengths, in place and by copy
            prompt = shared[: rng.randint(10, 40)] + prompt[: rng.randint(0, 8)]
        n = rng.randint(1, 28)
        ref = reference(path, prompt, n) if solo is None else solo(prompt, n)
        stop: tuple[int, ...] = ()
        if i % 4 == 1 and n > 4:  # finish early on a token the reference emits mid-way
            stop = (ref[rng.randrange(2, n - 1)],)
        specs.append((rng.randrange(0, 25), f"r{i}", prompt, n, stop, ref))
    abort_ids = {s[1]: s[0] + rng.randint(1, 6) for s in rng.sample(specs, aborts)}
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while step <= 30 or engine.has_unfinished():
        for arrive, rid, prompt, n, stop, _ in specs:
            if arrive == step:
                engine.add_request(prompt, greedy(n, stop_token_ids=stop), rid)
                got[rid] = []
        for rid, at in abort_ids.items():
            if at == step and rid not in reasons:
                engine.abort(rid)
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
        engine.check_invariants()
        step += 1
    for _, rid, prompt, n, stop, ref in specs:
        want = ref
        if stop:
            want = ref[: ref.index(stop[0]) + 1]
        if tie is not None and tie(prompt, got[rid], ref):
            continue
        if reasons[rid] == "abort":
            assert rid in abort_ids and got[rid] == want[: len(got[rid])], rid
        else:
            assert got[rid] == want, rid
            assert reasons[rid] == (
                "stop" if len(want) < n or (stop and want[-1] == stop[0]) else "length"
            )
    sched = engine.scheduler
    assert not sched.running and not sched.waiting
    assert sched.kv.num_held == 0
    sched.kv.alloc.check()
    return got


def staggered_three_ways(path, seed: str, **engine_options) -> list[LLM]:
    """run_staggered with overlap and the KV double buffer (the CPU default), overlap with one
    buffer set (the GPU default) and no overlap: identical, and equal to mlx-lm. Returns the
    three engines."""
    results, llms = [], []
    for overlap, double in ((True, True), (True, False), (False, False)):
        llm = LLM(
            str(path),
            overlap=overlap,
            kv_double_buffer=double,
            check_invariants=True,
            max_num_seqs=32,
            **engine_options,
        )
        results.append(run_staggered(llm, path, random.Random(seed)))
        assert (llm.engine.loop.num_chained > 0) == overlap
        llms.append(llm)
    assert results[0] == results[1] == results[2]
    return llms


@pytest.mark.parametrize("arch", ARCHS)
def test_staggered_concurrent_requests_match_mlx_lm_overlap_on_and_off(tiny_model_dir, arch):
    staggered_three_ways(tiny_model_dir(arch), arch)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("double", [True, False])
def test_host_work_on_the_helper_thread_matches_mlx_lm(tiny_model_dir, arch, double):
    """Every chained step with its results applied and the next planned on the loop's helper
    thread while this thread submits (engine/loop.py, host_thread=True), one or two KV buffer
    sets: staggered requests, stops and aborts equal mlx-lm's greedy output."""
    path = tiny_model_dir(arch)
    llm = LLM(
        str(path),
        host_thread=True,
        kv_double_buffer=double,
        check_invariants=True,
        max_num_seqs=32,
    )
    run_staggered(llm, path, random.Random(arch + "threads"))
    loop = llm.engine.loop
    assert loop.num_threaded > loop.num_steps // 3, (loop.num_threaded, loop.num_steps)


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_hits_match_cold_runs_and_mlx_lm(tiny_model_dir, overlap):
    """Multi-turn (a finished conversation's row adopted in place), concurrent requests on a
    shared prefix (copied from a running row), a hit covering all but the last prompt token,
    and a hit after chained decode: every output token-exact with mlx-lm and a cold engine."""
    path = tiny_model_dir("qwen3")
    rng = random.Random(11)
    base = [rng.randrange(3, 400) for _ in range(37)]
    turn1 = base + [5, 6]
    warm = LLM(str(path), overlap=overlap, check_invariants=True, max_num_batched_tokens=16)
    cold = LLM(str(path), overlap=overlap, prefix_cache=False, max_num_batched_tokens=16)
    out1 = warm.generate([turn1], greedy(20))[0]
    turn2 = turn1 + out1.token_ids + [9, 10, 11]
    same = turn1  # full hit: all but its last token is cached
    fan = [base + [rng.randrange(3, 400) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    prompts = [turn2, same] + fan
    params = [greedy(rng.randint(5, 25)) for _ in prompts]
    got = warm.generate(prompts, params)
    want = cold.generate(prompts, params)
    for p, sp, g, w in zip(prompts, params, got, want, strict=True):
        assert g.token_ids == w.token_ids == reference(path, p, sp.max_tokens)
    stats = warm.engine.scheduler.stats
    assert stats.hit_tokens >= len(turn1) - 1 + len(turn1) - 1 + 6 * 30
    assert cold.engine.scheduler.stats.hit_tokens == 0


@pytest.mark.parametrize("budget", [4, 5])
def test_prompt_chunks_at_budget_boundaries_match_mlx_lm(tiny_model_dir, budget):
    # Prompts of k*budget and k*budget+1 tokens (prefill covers prompt[:-1]).
    path = tiny_model_dir("llama")
    llm = LLM(str(path), max_num_batched_tokens=budget, check_invariants=True)
    prompts = [
        [7 + i for i in range(n)]
        for n in (budget, budget + 1, 2 * budget, 2 * budget + 1, 3 * budget + 2, 1)
    ]
    outs = llm.generate(prompts, greedy(12))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(path, p, 12)


def test_few_rows_force_queueing_and_row_reuse(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    llm = LLM(str(path), max_num_seqs=3, check_invariants=True)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(1, 30))] for _ in range(10)]
    outs = llm.generate(prompts, [greedy(rng.randint(1, 15)) for _ in prompts])
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(path, p, len(o.token_ids))


def test_eos_stops_generation_and_is_not_in_text(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = LLM(str(path))
    prompt = [11, 12, 13]
    ref = reference(path, prompt, 30)
    eos = ref[5]
    llm.engine.eos_token_ids = frozenset({eos})
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.token_ids == ref[: ref.index(eos) + 1]
    assert out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1])


def test_tiny_pool_evicts_retracts_and_resumes_token_exact(tiny_model_dir):
    """A pool of 64 pages of 16 for 16 sequences: 60 requests with shared prefixes, a few with
    400-token outputs, so cached pages are evicted, decodes running out of pages retract the
    latest admitted requests, and they resume from the cache or by recomputing — all
    token-exact."""
    path = tiny_model_dir("qwen3")
    llm = LLM(str(path), kv_budget_tokens=64 * 16, check_invariants=True, max_num_seqs=16)
    rng = random.Random(3)
    shared = [rng.randrange(3, 400) for _ in range(150)]
    prompts, params = [], []
    for i in range(60):
        tail = [rng.randrange(3, 400) for _ in range(rng.randint(1, 40))]
        prompts.append(shared[: rng.randint(20, 150)] + tail if i % 2 else tail)
        params.append(greedy(rng.randint(5, 60) if i % 7 else 400))
    outs = llm.generate(prompts, params)
    for p, sp, o in zip(prompts, params, outs, strict=True):
        assert o.token_ids == reference(path, p, sp.max_tokens)
    stats = llm.engine.scheduler.stats
    assert stats.retractions > 0 and llm.engine.scheduler.kv.evicted_pages > 0
    assert stats.hit_tokens > 0


def _penalized(prompt_len: int, presence: float, frequency: float, repetition: float):
    """A straightforward reference of the penalties as an mlx-lm logits processor."""
    import numpy as np

    def proc(tokens, logits):
        hist = np.array(tokens).astype(np.int64)
        out = hist[prompt_len:]
        x = np.array(logits.astype(mx.float32))[0]
        counts = np.bincount(out, minlength=x.shape[0]).astype(np.float32)
        seen = counts > 0
        seen[hist[:prompt_len]] |= repetition != 1
        rep = np.float32(repetition)
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
        x = x - np.float32(frequency) * counts - np.float32(presence) * (counts > 0)
        return mx.array(x.astype(np.float32))[None]

    return proc


@pytest.mark.parametrize("overlap", [True, False])
def test_penalties_match_a_reference_processor(tiny_model_dir, overlap):
    path = tiny_model_dir("qwen3")
    if str(path) not in _models:
        _models[str(path)] = load(str(path))[0]
    model = _models[str(path)]
    llm = LLM(str(path), overlap=overlap, check_invariants=True)
    prompt = [5, 9, 5, 9, 5, 14, 3, 3, 3]
    cases = [(0.5, 0.3, 1.3), (0.0, 1.5, 1.0), (1.0, 0.0, 1.0), (0.0, 0.0, 1.8)]
    params = [
        greedy(30, presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
        for p, f, r in cases
    ]
    plain = greedy(30)
    outs = llm.generate([prompt] * len(cases) + [prompt], params + [plain])
    for (p, f, r), o in zip(cases, outs, strict=False):
        proc = _penalized(len(prompt), p, f, r)
        gen = generate_step(mx.array(prompt), model, max_tokens=30, logits_processors=[proc])
        assert o.token_ids == [int(t) for t, _ in gen], (p, f, r)
        assert o.token_ids != outs[-1].token_ids  # the penalty changed something
    assert outs[-1].token_ids == reference(path, prompt, 30)


@pytest.mark.parametrize("overlap", [True, False])
def test_n_samples_share_one_prefill(tiny_model_dir, overlap):
    """Four samples of one 90-token prompt (followers of the first): the prompt is prefilled
    once, the others share its five whole pages from the cache (recomputing only the 10 tokens
    of the partial last page), and each sample equals the same seed run alone on a cold
    engine."""
    path = tiny_model_dir("qwen3")
    prompt = [(7 * i) % 300 + 3 for i in range(90)]
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in range(4)
    ]
    llm = LLM(str(path), overlap=overlap, check_invariants=True, max_num_batched_tokens=32)
    launched = []
    runner = llm.engine.loop.runner
    orig = runner.launch

    def spy(plan, parent, masks=None, **kw):
        launched.append(plan)
        return orig(plan, parent, masks, **kw)

    runner.launch = spy
    engine = llm.engine
    first = engine.add_request(prompt, params[0])
    ids = [first] + [engine.add_request(prompt, p, follows=first) for p in params[1:]]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        engine.check_invariants()
    n = len(prompt)
    prefilled = sum(max(0, min(s.end, n) - s.start) for p in launched for s in p.segments)
    assert prefilled == n + 3 * (n % 16)
    cold = LLM(str(path), prefix_cache=False)
    for rid, sp in zip(ids, params, strict=True):
        assert got[rid] == cold.generate([prompt], sp)[0].token_ids
    assert len({tuple(v) for v in got.values()}) > 1  # different seeds, different samples


@pytest.mark.parametrize("overlap", [True, False])
def test_logprobs_equal_mlx_lm_log_softmax(tiny_model_dir, overlap):
    """Sampled-token and top-5 log-probabilities of greedy and sampled rows in one batch
    equal mlx-lm's log-softmax of the model's logits at each step (float32, 1e-4)."""
    import numpy as np

    path = tiny_model_dir("llama")
    if str(path) not in _models:
        _models[str(path)] = load(str(path))[0]
    model = _models[str(path)]
    llm = LLM(str(path), overlap=overlap)
    prompts = [[5, 9, 14, 3], [100, 101], [7] * 12]
    params = [
        greedy(10, logprobs=5),
        SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True, logprobs=0),
        greedy(10),
    ]
    outs = llm.generate(prompts, params)
    assert outs[2].logprobs is None
    for prompt, o, k in zip(prompts[:2], outs[:2], (5, 0), strict=True):
        assert len(o.logprobs) == len(o.token_ids)
        # Replay the generated tokens through mlx-lm and read its log-softmax at each step.
        seq = prompt + o.token_ids
        logits = model(mx.array(seq)[None])[0].astype(mx.float32)
        ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        for i, (tok, (lp, top)) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
            row = ref[len(prompt) - 1 + i]
            assert abs(lp - row[tok]) < 1e-4
            assert len(top) == k
            want = np.argsort(-row)[:k]
            assert [t for t, _ in top] == list(want)
            assert np.allclose([v for _, v in top], row[want], atol=1e-4)


@pytest.mark.parametrize("budget", [7, 64])
def test_prompt_logprobs_equal_mlx_lm_across_chunks(tiny_model_dir, budget):
    """Prompt log-probabilities from batched first chunks and continuation chunks equal
    mlx-lm's log-softmax; such a request recomputes its prompt even when it is cached."""
    import numpy as np

    path = tiny_model_dir("qwen2")
    if str(path) not in _models:
        _models[str(path)] = load(str(path))[0]
    model = _models[str(path)]
    llm = LLM(str(path), max_num_batched_tokens=budget, check_invariants=True)
    prompts = [[(3 * i + j) % 200 + 3 for i in range(n)] for j, n in enumerate((30, 9, 2))]
    llm.generate(prompts, greedy(2))  # now cached
    outs = llm.generate(prompts, greedy(3, prompt_logprobs=2))
    for p, o in zip(prompts, outs, strict=True):
        logits = model(mx.array(p)[None])[0].astype(mx.float32)
        ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        assert len(o.prompt_logprobs) == len(p) - 1
        for i, (lp, top) in enumerate(o.prompt_logprobs):
            assert abs(lp - ref[i, p[i + 1]]) < 1e-4
            assert [t for t, _ in top] == list(np.argsort(-ref[i])[:2])
        assert o.token_ids == reference(path, p, 3)


@pytest.mark.parametrize("overlap", [True, False])
def test_distinct_prompts_and_echo_requests_run_without_stalls(tiny_model_dir, overlap):
    """The pattern that stalled the row slab (each echo / prompt-logprobs request and each
    prompt with no cached prefix moved cached rows, and every few rows the pool grew and
    copied every layer): distinct prompts and echo requests together, beside a warm cache.
    Now the pool is fixed and nothing is copied: no retraction, the loop stays chained (one
    fresh step to start, one after the batch's last sampling), and every output equals the
    request run alone."""
    path = tiny_model_dir("llama")
    llm = LLM(str(path), overlap=overlap, check_invariants=True)
    warm = [[(7 * i + 11) % 200 + 3 for i in range(70)] for _ in range(2)]
    llm.generate(warm, greedy(2))  # cached pages for the echoes to sit beside
    prompts = [[(5 * i + 13 * j) % 200 + 3 for i in range(20 + 9 * j)] for j in range(12)]
    scored = [warm[0][: 40 + 3 * j] for j in range(6)]
    params = [greedy(6)] * len(prompts) + [greedy(2, prompt_logprobs=1)] * len(scored)
    loop = llm.engine.loop
    steps, chained = loop.num_steps, loop.num_chained
    retractions = llm.engine.scheduler.stats.retractions
    outs = llm.generate(prompts + scored, params)
    assert llm.engine.scheduler.stats.retractions == retractions
    if overlap:
        assert (loop.num_steps - steps) - (loop.num_chained - chained) <= 2
    for p, sp, o in zip(prompts + scored, params, outs, strict=True):
        alone = llm.generate([p], sp)[0]
        assert o.token_ids == alone.token_ids
        if sp.prompt_logprobs is not None:
            assert len(o.prompt_logprobs) == len(p) - 1
            for (a, ta), (b, tb) in zip(o.prompt_logprobs, alone.prompt_logprobs, strict=True):
                assert abs(a - b) < 1e-4 and [t for t, _ in ta] == [t for t, _ in tb]
