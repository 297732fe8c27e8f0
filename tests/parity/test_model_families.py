"""Sliding-window, attention-sink, soft-capped, MLA and recurrent models: token-exact with
mlx-lm's generate_step however requests are scheduled (windows of 8 positions, prompts far
longer; recurrent states in per-request slots, chunks of a few tokens)."""

from __future__ import annotations

import random

import pytest

from tandem import LLM
from tandem.testing.families import CHUNKED, FAMILIES, RECURRENT, SHARED_KV, SPARSE, WINDOW
from tests.parity.test_mlx_lm_parity import greedy, reference, staggered_three_ways

TYPES = sorted([*FAMILIES, *SHARED_KV, *SPARSE, *CHUNKED])


def test_layer_kinds_come_from_the_models_own_caches(family_model_dir):
    kinds = {}
    for t in TYPES:
        specs = LLM(str(family_model_dir(t))).engine.loop.runner.specs
        kinds[t] = [(s.window, s.dense) for s in specs]
    assert kinds["gemma3_text"] == [(WINDOW, False), (None, False)] * 2
    assert kinds["cohere2"] == [(WINDOW, False), (None, False)] * 2
    assert kinds["gpt_oss"] == [(WINDOW, False), (None, False)] * 2
    # Soft-capped scores computed by the model (no seam), MLA latents of two shapes.
    assert kinds["gemma2"] == [(None, True)] * 4
    assert kinds["deepseek_v3"] == [(None, True)] * 4
    # KV shared across layers: only the layers that store KV have pool entries; the rest
    # read theirs (a window layer's or a global one's).
    assert kinds["gemma4_text"] == kinds["gemma3n"] == [(WINDOW, False), (None, False)]
    assert kinds["iquestloopcoder"] == [(None, False)] * 2 + [(WINDOW, False)] * 2
    # DeepSeek sparse attention: the MLA latents and the indexer's keys, each token's
    # gathered history (the indexer picks from it).
    assert kinds["deepseek_v32"] == [(None, True)] * 4
    # Chunks of 8 positions, then a global layer (runner/adapters.py: no mask from offsets).
    assert kinds["llama4"] == [(WINDOW, False)] * 3 + [(None, False)]
    assert [s.chunked for s in LLM(str(family_model_dir("llama4"))).engine.loop.runner.specs] == [
        True
    ] * 3 + [False]
    latent = LLM(str(family_model_dir("deepseek_v3"))).engine.loop.runner.specs[0]
    assert (latent.k_heads, latent.k_dim, latent.v_heads, latent.v_dim) == (1, 32, 1, 8)
    # Recurrent: Gated DeltaNet layers between attention layers, Mamba-2 only, and a Mamba-2
    # state beside attention in every layer (a CacheList).
    from tandem.runner.layers import Attn, State

    layouts = {t: LLM(str(family_model_dir(t))).engine.loop.runner.layout for t in RECURRENT}
    assert layouts["qwen3_next"] == [State(2), Attn(), State(2), Attn()]
    assert layouts["mamba2"] == [State(2)] * 4
    assert layouts["falcon_h1"] == [(State(2), Attn())] * 4


@pytest.mark.parametrize("model_type", TYPES)
def test_single_request_past_the_window_matches_mlx_lm(family_model_dir, model_type):
    path = family_model_dir(model_type)
    llm = LLM(str(path), check_invariants=True)
    prompt = [(5 * i) % 500 + 3 for i in range(3 * WINDOW + 1)]
    out = llm.generate([prompt], greedy(30))[0]
    assert out.token_ids == reference(path, prompt, 30)
    assert len(set(out.token_ids)) > 3  # the model says something


@pytest.mark.parametrize("model_type", TYPES)
def test_staggered_requests_match_mlx_lm_overlap_on_and_off(family_model_dir, model_type):
    """18 requests up to 70 tokens joining at different steps, stops mid-chain, aborts in
    flight, shared-prefix hits; pages of 4 positions, windows of 8."""
    llms = staggered_three_ways(
        family_model_dir(model_type), model_type, max_num_batched_tokens=64, kv_page_size=4
    )
    for llm in llms:
        # Recurrent models hit too: they resume from the cached states (snapshots).
        assert llm.engine.scheduler.stats.hit_tokens > 0


@pytest.mark.parametrize("model_type", TYPES)
def test_few_sequences_force_queueing_and_slot_reuse(family_model_dir, model_type):
    """Ten requests through three sequence slots: recurrent-state slots and pages are
    handed from finished requests to new ones; no request sees another's state."""
    path = family_model_dir(model_type)
    llm = LLM(str(path), max_num_seqs=3, max_num_batched_tokens=8, check_invariants=True)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(1, 30))] for _ in range(10)]
    outs = llm.generate(prompts, [greedy(rng.randint(1, 15)) for _ in prompts])
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(path, p, len(o.token_ids))


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("budget", [4, 5])
def test_prompt_chunks_at_page_and_window_boundaries(family_model_dir, model_type, budget):
    path = family_model_dir(model_type)
    llm = LLM(str(path), max_num_batched_tokens=budget, kv_page_size=4, check_invariants=True)
    lengths = (1, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW + 1, 4 * budget + 1, 37)
    prompts = [[7 + (3 * i) % 400 for i in range(n)] for n in lengths]
    outs = llm.generate(prompts, greedy(12))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(path, p, 12), len(p)


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_hits_inside_a_window_match_cold_runs(family_model_dir, model_type, overlap):
    """A finished turn's pages adopted by the next turn, and concurrent requests sharing a
    running request's pages, with hits ending mid-window (page 4, window 8)."""
    path = family_model_dir(model_type)
    rng = random.Random(7)
    base = [rng.randrange(3, 400) for _ in range(3 * WINDOW + 3)]
    kw = dict(overlap=overlap, max_num_batched_tokens=16, kv_page_size=4)
    warm = LLM(str(path), check_invariants=True, **kw)
    cold = LLM(str(path), prefix_cache=False, **kw)
    turn1 = base + [5, 6]
    out1 = warm.generate([turn1], greedy(15))[0]
    turn2 = turn1 + out1.token_ids + [9, 10, 11]
    fan = [base[: rng.randint(9, len(base))] + [rng.randrange(3, 400)] for _ in range(5)]
    prompts = [turn2, *fan]
    params = [greedy(rng.randint(5, 20)) for _ in prompts]
    got = warm.generate(prompts, params)
    want = cold.generate(prompts, params)
    for p, sp, g, w in zip(prompts, params, got, want, strict=True):
        assert g.token_ids == w.token_ids == reference(path, p, sp.max_tokens)
    hits = warm.engine.scheduler.stats.hit_tokens
    assert hits >= len(turn1) - 1


@pytest.mark.parametrize("model_type", RECURRENT)
def test_recurrent_hits_resume_from_cached_states(family_model_dir, model_type):
    """A hybrid or recurrent model's hits resume from a cached state: a finished turn's last
    decode page boundary (the next turn), a repeated prompt's last page boundary, a chunk's
    end, and where two prompts part (kept by the first, read by the second); cached_tokens
    says what was reused and every output equals mlx-lm's."""
    path = family_model_dir(model_type)
    llm = LLM(str(path), max_num_batched_tokens=16, kv_page_size=4, check_invariants=True)
    rng = random.Random(3)
    turn1 = [rng.randrange(3, 400) for _ in range(29)]
    out1 = llm.generate([turn1], greedy(15))[0]
    turn2 = turn1 + out1.token_ids + [9, 10, 11]
    cases = [
        (turn2, 40),  # 43 positions computed in turn 1: its state at 40
        (turn1, 28),
        (turn1[:22] + [401], 16),
        (turn1[:22] + [402, 403], 20),
    ]
    for prompt, cached in cases:
        out = llm.generate([prompt], greedy(8))[0]
        assert out.token_ids == reference(path, prompt, 8)
        assert out.cached_tokens == cached, (len(prompt), out.cached_tokens)


@pytest.mark.parametrize("model_type", RECURRENT)
def test_steady_decodes_keep_states_resident_and_exact(family_model_dir, model_type):
    """A batch decoding the same rows step after step reads and writes its states outside
    the pool (written back only when the rows change), with identical tokens."""
    path = family_model_dir(model_type)
    llm = LLM(str(path), check_invariants=True)
    pool = llm.engine.loop.runner.state_pool
    flushes = []
    real_flush = pool.flush

    def flush():
        flushes.append(pool.resident is not None)
        real_flush()

    pool.flush = flush
    prompts = [[3 + (11 * i + j) % 390 for j in range(9)] for i in range(4)]
    outs = llm.generate(prompts, [greedy(20 + 3 * i) for i in range(4)])
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(path, p, len(o.token_ids))
    # About 30 steps; states reach the pool only when the rows change (a prefill step, then
    # 4 finishes one by one), not every step.
    assert llm.engine.loop.num_steps >= 25
    assert 1 <= sum(flushes) <= len(flushes) <= 6


def test_steps_of_many_calls_write_the_state_pool_without_copying_it(family_model_dir):
    """A step that runs several calls (prompts of unequal chunks, cut at snapshots) writes
    each call's states into the pool without copying the pool (on the CPU, MLX's scatter
    copies a buffer something else still holds): the run's peak stays far below one more
    pool, and the tokens are mlx-lm's."""
    import mlx.core as mx

    path = family_model_dir("qwen3_next")
    llm = LLM(str(path), max_num_batched_tokens=48, overlap=True, check_invariants=True)
    pool = llm.engine.loop.runner.state_pool
    assert pool is not None and not pool.inplace  # (the CPU backend)
    prompts = [[3 + (7 * i + j) % 390 for j in range(20 + 9 * i)] for i in range(4)]
    llm.generate([[5, 6, 7]], greedy(2))  # (buffers of the first shapes, kernels)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    outs = llm.generate(prompts, greedy(6))
    assert mx.get_peak_memory() - base < pool.bytes // 2, (mx.get_peak_memory() - base, pool.bytes)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference(path, p, 6)


def test_unserved_cache_kinds_are_refused_at_load_naming_layer_and_kind():
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

    from tandem.runner.model_runner import ModelRunner

    class Hybrid(nn.Module):
        def __init__(self, second):
            super().__init__()
            self.layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
            self.second = second

        def __call__(self, x, cache=None):
            return mx.zeros((*x.shape, 8))

        def make_cache(self):
            return [KVCache(), self.second()]

    with pytest.raises(ValueError, match="'hybrid': layer 1 needs cache kind QuantizedKVCache"):
        ModelRunner(Hybrid(QuantizedKVCache), model_type="hybrid")
    with pytest.raises(ValueError, match="layer 1 needs cache kind RotatingKVCache with keep=4"):
        ModelRunner(Hybrid(lambda: RotatingKVCache(16, keep=4)), model_type="hybrid")
    # Accepted kinds, but the layers never store anything: refused by the probe.
    with pytest.raises(ValueError, match="attention layer 0 stores nothing in its cache"):
        ModelRunner(Hybrid(KVCache), model_type="hybrid")
    with pytest.raises(ValueError, match="state layer 0 keeps no state"):
        ModelRunner(Hybrid(lambda: ArraysCache(2)), model_type="hybrid")


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        # Masks of one window over a cache of another.
        ("plamo3", "caches a window of 8 positions but asks for masks of"),
    ],
)
def test_models_tandem_cannot_serve_exactly_are_refused_at_load(tmp_path, model_type, message):
    """The load check compares a paged prefill + batched decode with mlx-lm's own caches, so
    nothing that would compute wrong tokens reaches a step."""
    from tandem.testing.model_zoo import make_zoo_model

    path = make_zoo_model(tmp_path / model_type, model_type)
    with pytest.raises(ValueError, match=message):
        LLM(str(path))


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        # Shared layers pass the keys with no cache: they would attend over the fresh keys.
        ("gemma4_text", "paged caches disagree with mlx-lm's"),
        # The second loop passes the first loop's keys with its own windowed cache: the probe
        # would see a layer reading keys it did not store and gather per-token history.
        ("iquestloopcoder", "does not take a padding mask"),
    ],
)
def test_keys_read_by_another_layer_need_their_owner(
    family_model_dir, monkeypatch, model_type, message
):
    """Layers reading another layer's KV are served because the seam attributes the keys to
    the cache that stored them (runner/kv_owners.py). Without that the model must be
    refused at load, not served wrong. (gemma3n hands over the owner's cache itself.)"""
    from tandem.runner import kv_owners

    monkeypatch.setattr(kv_owners, "owner", lambda keys, values: None)
    with pytest.raises(ValueError, match=message):
        LLM(str(family_model_dir(model_type)))


def test_models_computing_with_their_caches_keys_are_refused(tmp_path):
    """Reading a cache's ``keys`` is allowed only where it is graph bookkeeping (DeepSeek
    sparse attention, served above): minimax_m3_vl's block-sparse layers place their queries
    by the keys' count, which Tandem's gathered histories do not give, so it is refused."""
    from tandem.testing.model_zoo import make_zoo_model

    sparse = {"sparse_block_size": 4, "sparse_topk_blocks": 2}
    path = make_zoo_model(
        tmp_path / "m3",
        "minimax_m3_vl",
        overrides={"text_config": {"sparse_attention_config": sparse}},
    )
    with pytest.raises(ValueError, match="has no attribute 'keys'"):
        LLM(str(path))


WINDOWED = ("gemma3_text", "gpt_oss", "iquestloopcoder")  # (sinks; shared KV)


@pytest.mark.parametrize("model_type", WINDOWED)
@pytest.mark.parametrize("overlap", [True, False])
def test_window_pages_freed_behind_the_window_match_mlx_lm(family_model_dir, model_type, overlap):
    """The sliding-window layers' own page group, 6 pages of 4 positions for a window of 8
    (engine/kv_manager.py): 16 requests of up to 50 tokens, twice (the second time with
    hits that need their window cached), chunks cut to the window pages there are, cached
    window pages dropped for new ones; every output exact."""
    path = family_model_dir(model_type)
    llm = LLM(
        str(path),
        overlap=overlap,
        check_invariants=True,
        kv_page_size=4,
        kv_window_pages=6,
        max_num_batched_tokens=16,
    )
    assert llm.engine.loop.runner.pool.window_pages == 6
    rng = random.Random(3)
    base = [rng.randrange(3, 400) for _ in range(40)]
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(1, 50))] for _ in range(10)]
    prompts += [base + [rng.randrange(3, 400) for _ in range(rng.randint(0, 9))] for _ in range(6)]
    params = [greedy(rng.randint(1, 25)) for _ in prompts]
    for _ in range(2):
        outs = llm.generate(prompts, params)
        for p, sp, o in zip(prompts, params, outs, strict=True):
            assert o.token_ids == reference(path, p, sp.max_tokens)
    kv = llm.engine.scheduler.kv
    assert kv.dropped_window_pages > 0 and kv.num_held == 0


def test_window_group_sizing(family_model_dir):
    """Sized automatically where a window is shorter than the context; off when set to 0 or
    when no request can reach past the window; a set size beyond the KV memory refused."""
    path = str(family_model_dir("gemma3_text"))
    runner = LLM(path).engine.loop.runner
    assert runner.pool.window_pages > 0 and runner.max_window == WINDOW
    assert LLM(path, kv_window_pages=0).engine.loop.runner.pool.window_pages == 0
    assert LLM(path, max_model_len=WINDOW).engine.loop.runner.pool.window_pages == 0
    with pytest.raises(ValueError, match="more than the .* MiB of KV memory"):
        LLM(path, kv_window_pages=10**9)


def test_window_group_with_quantized_pages_equals_one_group(family_model_dir):
    """int8 pages are quantized per token, so where a window layer's token lives changes
    nothing: a small window group gives the one-group outputs exactly."""
    path = str(family_model_dir("gpt_oss"))
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(5, 45))] for _ in range(8)]
    outs = []
    for pages in (0, 6):
        llm = LLM(
            path,
            kv_cache_dtype="int8",
            kv_page_size=4,
            kv_window_pages=pages,
            max_num_batched_tokens=16,
            check_invariants=True,
        )
        assert llm.engine.loop.runner.pool.window_pages == pages
        outs.append([o.token_ids for o in llm.generate(prompts, greedy(20))])
    assert outs[0] == outs[1]


def test_learned_positions_computed_with_numpy_from_the_offset(tmp_path):
    """gpt_bigcode takes its positions from ``np.arange`` over the cache offset, a number in
    mlx-lm's caches and each row's position in Tandem's (runner/adapters.py): staggered
    batches, overlap on and off, token-exact with mlx-lm."""
    from tandem.testing.model_zoo import make_zoo_model

    staggered_three_ways(make_zoo_model(tmp_path / "gpt_bigcode", "gpt_bigcode"), "bigcode")


def test_ngram_embedding_context_is_a_state_from_zeros(tmp_path):
    """longcat_flash_ngram's n-gram embedding keeps the last n - 1 = 3 token ids, a state
    mlx-lm grows from none with the first tokens; Tandem's slots start it as zeros
    (runner/adapters.py). Prompts shorter and longer than it, chunks of 2 cutting it,
    staggered batches with hits on cached states, overlap on and off: token-exact with
    mlx-lm."""
    from tandem.testing.model_zoo import make_zoo_model

    path = make_zoo_model(tmp_path / "ngram", "longcat_flash_ngram")
    llm = LLM(str(path), max_num_batched_tokens=2, kv_page_size=4, check_invariants=True)
    assert llm.engine.loop.runner.state_specs  # the context is a state of its own
    prompts = [[7 + (3 * i + n) % 400 for i in range(n)] for n in (1, 2, 3, 4, 9)]
    for p, o in zip(prompts, llm.generate(prompts, greedy(10)), strict=True):
        assert o.token_ids == reference(path, p, 10), len(p)
    llms = staggered_three_ways(
        path, "longcat_flash_ngram", max_num_batched_tokens=16, kv_page_size=4
    )
    assert all(x.engine.scheduler.stats.hit_tokens > 0 for x in llms)


def test_kv_reuse_layers_place_queries_at_each_rows_position(tmp_path, monkeypatch):
    """afm7's KV-reuse layers attend with the last layer's keys and place queries by the
    keys' count, one per row on Tandem's caches; they take each row's position from the
    cache that stored the keys (runner/adapters.py). Chunks of 5, staggered batches with
    hits, overlap on and off: token-exact with mlx-lm."""
    from tandem.testing.model_zoo import make_zoo_model

    path = make_zoo_model(tmp_path / "afm7", "afm7")
    llm = LLM(str(path), max_num_batched_tokens=5, kv_page_size=4, check_invariants=True)
    prompts = [[7 + (3 * i + n) % 400 for i in range(n)] for n in (1, 4, 5, 6, 23)]
    for p, o in zip(prompts, llm.generate(prompts, greedy(12)), strict=True):
        assert o.token_ids == reference(path, p, 12), len(p)
    llms = staggered_three_ways(path, "afm7", max_num_batched_tokens=16, kv_page_size=4)
    assert all(x.engine.scheduler.stats.hit_tokens > 0 for x in llms)
    # Verify rows (several positions of one request in a step): proposals of mlx-lm's
    # continuation, half of them wrong from a random position on.
    from tandem.bench.speculative import oracle
    from tandem.engine import speculation

    refs = [reference(path, p, 24) for p in prompts]
    monkeypatch.setattr(speculation, "propose", oracle(prompts, refs, 0.5, 500, 3))
    options = dict(speculative="ngram", speculative_min_gain=0, kv_page_size=4)
    spec = LLM(str(path), check_invariants=True, **options)
    for o, want in zip(spec.generate(prompts, greedy(24)), refs, strict=True):
        assert o.token_ids == want
    stats = spec.engine.scheduler.stats
    assert 0 < stats.spec_accepted < stats.spec_proposed
