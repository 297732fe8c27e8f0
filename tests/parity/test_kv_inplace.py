"""In-place KV writes (runner/kv_write.py) reach every reader of the pool.

The kernels are CUDA's; here ``kv_write`` is replaced by MLX ops with the same contract, so
the wiring is checked on the CPU: the K/V layouts handed to the write (rows with a singleton
axis, the sequence layout, MLA rows) and every read path (gathers of decode groups, windows,
sinks, chunks, dense layers) against mlx-lm. The stand-in never changes the pool array (MLX
never sees the kernel's write either): the token it returns *is* the buffer after the write
and every write chained before it, and a read sees exactly what its token carries. So a
write left out of a layer's chain — one no submission would evaluate on the GPU — is a write
the readers miss here. On the GPU, ``scripts/gpu_inplace_check.py`` compares the real kernels
with MLX scatters token for token.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from tandem import LLM
from tandem.runner import kv_write
from tandem.testing.families import RECURRENT
from tests.parity.test_mlx_lm_parity import greedy, reference, run_staggered


def _write(pool, slots, k, v=None, after=None):
    n = slots.shape[0]
    rows = k.reshape(n, -1)
    if v is not None:
        rows = mx.concatenate([rows, v.reshape(n, -1)], axis=1)
    assert after is None or after.shape == pool.shape, "one chain per buffer"
    new = (pool if after is None else after) + 0  # a new array: the pool stays as it is
    new[slots] = rows.reshape(n, *pool.shape[1:]).astype(pool.dtype)
    return new


def _gather(src, idx, token):
    assert token is not None and token.size == src.size
    return token.reshape(src.shape[0], -1)[idx]


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(kv_write, "available", lambda dtype: True)
    monkeypatch.setattr(kv_write, "write", _write)
    monkeypatch.setattr(kv_write, "gather", _gather)


def _staggered(path, seed: str, **options) -> LLM:
    """Staggered requests against mlx-lm; the engine they ran on."""
    llm = LLM(
        str(path),
        kv_double_buffer=False,
        check_invariants=True,
        max_num_seqs=32,
        max_num_batched_tokens=64,
        kv_page_size=4,
        **options,
    )
    runner = llm.engine.loop.runner
    assert runner.pool.inplace or not runner.specs  # (no KV layers: mamba2)
    run_staggered(llm, path, random.Random(seed))
    return llm


@pytest.mark.parametrize("overlap", [True, False])
def test_plain_model_in_place_matches_mlx_lm(emulated, tiny_model_dir, overlap):
    _staggered(tiny_model_dir("llama"), "llama", overlap=overlap)


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss", "deepseek_v3"])
def test_families_in_place_match_mlx_lm(emulated, family_model_dir, model_type):
    """Windows and sinks (gathers), MLA rows (dense layers); recurrent models (the sequence
    layout: several model calls per step, each writing the pool) below."""
    _staggered(family_model_dir(model_type), model_type)


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_a_small_window_group_in_place_matches_mlx_lm(emulated, family_model_dir, model_type):
    """The window layers' pool of 8 pages (engine/kv_manager.py's window group), written in
    place at their own slots and its pages handed from request to request."""
    _staggered(family_model_dir(model_type), model_type, kv_window_pages=8)


@pytest.mark.parametrize("model_type", RECURRENT)
def test_recurrent_states_in_place_match_mlx_lm(emulated, family_model_dir, model_type):
    """Recurrent states stored and read through the same kernels (runner/state.py): chunk
    boundaries, prefix hits on snapshot slots, rows joining and leaving (the resident states
    flushed), aborts. A store left out of a buffer's chain is a state its next read misses."""
    llm = _staggered(family_model_dir(model_type), model_type)
    pool = llm.engine.loop.runner.state_pool
    assert pool is not None and pool.inplace
    assert llm.engine.scheduler.stats.hit_tokens > 0
    assert any(t is not None for layer in pool.tokens for t in layer)


@pytest.mark.parametrize("per_position", [True, False])
def test_recurrent_speculation_in_place_matches_mlx_lm(
    emulated, family_model_dir, monkeypatch, per_position
):
    """Verifies on in-place states: backups stored before a verify, rolled-back requests
    reading them (replaying), or states per position (held outside the pool)."""
    from tests.parity.test_speculative_hybrid import SPEC, oracle, prompts_for, replaying

    if not per_position:
        replaying(monkeypatch)
    path = family_model_dir("qwen3_next")
    prompts = prompts_for(7)
    oracle(monkeypatch, path, prompts, seed=8)
    llm = LLM(str(path), kv_double_buffer=False, check_invariants=True, kv_page_size=4, **SPEC)
    assert llm.engine.loop.runner.state_pool.inplace
    for p, o in zip(prompts, llm.generate(prompts, greedy(30)), strict=True):
        assert o.token_ids == reference(path, p, 30)
    stats = llm.engine.scheduler.stats
    assert 0 < stats.spec_accepted < stats.spec_proposed


def test_self_draft_in_place_is_accepted(emulated, tiny_model_dir):
    """The draft's forwards of a round (catch-up chunk, then k steps) each write its pool;
    the first chunk is read by nothing in its own forward, so only the chain carries it
    into what the round's submission evaluates. A lost chunk shows as rejected proposals."""
    from tests.parity.test_draft_speculative import draft_llm

    path = tiny_model_dir("llama")
    llm = draft_llm(path, path, kv_page_size=4, max_num_seqs=32, kv_double_buffer=False)
    assert llm.engine.loop.runner.draft.runner.pool.inplace
    run_staggered(llm, path, random.Random("draft-inplace"))
    stats = llm.engine.scheduler.stats
    assert stats.spec_proposed > 50
    assert stats.spec_accepted >= 0.97 * stats.spec_proposed


def test_quantized_pages_in_place_equal_scatters(monkeypatch, tiny_model_dir):
    """int8 pages: the three parts (values, scales, biases) written by one chain per layer.
    This stand-in stores into the part arrays themselves (the chain's tokens order the
    parts, they cannot carry three buffers), so it checks the layouts, not the chain."""

    def write(pool, slots, k, v=None, after=None):
        n = slots.shape[0]
        rows = (
            k.reshape(n, -1)
            if v is None
            else mx.concatenate([k.reshape(n, -1), v.reshape(n, -1)], 1)
        )
        pool[slots] = rows.reshape(n, *pool.shape[1:]).astype(pool.dtype)
        token = pool.reshape(-1)[:1].astype(mx.int32) * 0
        return token if after is None else token + after

    monkeypatch.setattr(kv_write, "available", lambda dtype: True)
    monkeypatch.setattr(kv_write, "write", write)
    monkeypatch.setattr(kv_write, "gather", lambda src, idx, t: src.reshape(src.shape[0], -1)[idx])
    path = tiny_model_dir("qwen3")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 60))] for _ in range(10)]
    outs = []
    for inplace in (True, False):
        llm = LLM(
            str(path),
            kv_cache_dtype="int8",
            kv_double_buffer=False,
            kv_inplace_writes=inplace,
            max_num_batched_tokens=64,
            # (The stand-in writer assigns into the pool's array, which a trace cannot do
            # to a constant; compiled steps on quantized in-place pages run on CUDA only.)
            compile_decode=0,
        )
        assert llm.engine.loop.runner.pool.inplace == inplace
        outs.append([o.token_ids for o in llm.generate(prompts, greedy(20))])
    assert outs[0] == outs[1]
