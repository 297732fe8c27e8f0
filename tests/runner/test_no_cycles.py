"""Steps make no reference cycles: a step's caches, context and arrays go when the step
does, and an engine's memory (model, KV pool) when its last reference does, without waiting
for Python's cyclic collector (a cycle per step once held every step's caches and the pool
until a collection: GPU memory freed late, and a deleted engine's pool kept)."""

from __future__ import annotations

import gc
import weakref

import pytest

from tandem import LLM, SamplingParams


@pytest.mark.parametrize(
    ("arch", "options"),
    [("llama", {}), ("qwen3", {"speculative": "ngram"}), ("qwen3", {"compile_decode": True})],
)
def test_steps_make_no_garbage_and_del_frees_the_engine(tiny_model_dir, arch, options) -> None:
    llm = LLM(str(tiny_model_dir(arch)), max_num_seqs=8, kv_double_buffer=False, **options)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm.generate([[1, 2, 3]], sp)  # warm-up (first traces, caches of the tokenizer)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        llm.generate([[5 + i, 9, 2, 7] * (1 + i) for i in range(6)], sp)
        assert gc.collect() == 0, "a step left reference cycles"
        pool = weakref.ref(llm.engine.loop.runner.pool)
        del llm
        assert pool() is None, "the KV pool outlived its engine"
    finally:
        if enabled:
            gc.enable()


def test_close_frees_the_engine_while_something_still_holds_it(tiny_model_dir) -> None:
    """``close`` (and leaving ``with``) gives the pool and the model back even where a hook
    or a frame still references the engine: the next engine in the process sizes its pool
    from the memory left free."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(tiny_model_dir("qwen3")), kv_budget_tokens=4096, host_thread=True) as llm:
        runner = llm.engine.loop.runner
        runner.launch = lambda *a, _real=runner.launch, **kw: _real(*a, **kw)  # a cycle
        first = llm.generate([[5, 9, 2, 7]], sp)[0].token_ids
        stream = llm.stream([5, 9, 2, 7], sp)
        next(stream)  # (a stream left open across the close: it ends with an error)
        assert mx.get_active_memory() > base
        pool, model = weakref.ref(runner.pool), weakref.ref(runner.model)
        helper = llm.engine.loop._helper
        assert helper is not None, "the forced host thread ran no step"
    assert pool() is None and model() is None
    assert mx.get_active_memory() == base
    assert helper._shutdown
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[5, 9, 2, 7]], sp)
    with pytest.raises(RuntimeError, match="closed"):
        next(stream)
    llm.close()  # (again: nothing left to let go of)
    with LLM(str(tiny_model_dir("qwen3")), kv_budget_tokens=4096) as again:
        assert again.generate([[5, 9, 2, 7]], sp)[0].token_ids == first
