"""Failures inside a step on the real runner: the pool is recreated, every surviving request
resumes token-exact (mlx-lm), and the engine keeps serving."""

from __future__ import annotations

import pytest
from test_mlx_lm_parity import greedy, reference

from tandem import LLM


def wrap_once(runner, name: str, at_call: int, error: Exception) -> dict[str, int]:
    original = getattr(runner, name)
    seen = {"calls": 0, "raised": 0}

    def wrapper(*args, **kwargs):
        seen["calls"] += 1
        if seen["calls"] == at_call:
            seen["raised"] += 1
            raise error
        return original(*args, **kwargs)

    setattr(runner, name, wrapper)
    return seen


PROMPTS = [[5, 9, 14, 3, 200, 7, 8], list(range(20, 61)), [300, 301], list(range(90, 110))]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name", ["launch", "finalize"])
def test_device_oom_in_a_step_resumes_every_request_token_exact(tiny_model_dir, overlap, name):
    path = tiny_model_dir("qwen3")
    llm = LLM(str(path), overlap=overlap, check_invariants=True, max_num_batched_tokens=32)
    runner = llm.engine.loop.runner
    seen = wrap_once(runner, name, 6, RuntimeError("[metal::malloc] out of memory"))
    outs = llm.generate(PROMPTS, greedy(24))
    assert seen["raised"] == 1
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.finish_reason == "length"
        assert o.token_ids == reference(path, p, 24)
    sched = llm.engine.scheduler
    assert sched.stats.oom_recoveries == 1 and sched.max_step_tokens == 16


def test_a_bug_in_a_step_fails_its_requests_and_the_engine_serves_on(tiny_model_dir):
    path = tiny_model_dir("llama")
    llm = LLM(str(path), check_invariants=True)
    runner = llm.engine.loop.runner
    wrap_once(runner, "launch", 1, ValueError("shape mismatch in a kernel"))
    outs = llm.generate(PROMPTS[:2], greedy(10))
    assert all(o.finish_reason == "error" for o in outs)
    # The pool was recreated and nothing is held; the next requests are exact.
    assert llm.engine.scheduler.kv.num_held == 0
    outs = llm.generate(PROMPTS, greedy(10))
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == reference(path, p, 10)


def test_the_prefill_chunk_cap_holds_and_shrinks_with_the_budget_after_an_oom(tiny_model_dir):
    """``max_prefill_chunk`` reaches the scheduler from the engine options: no request's
    chunk exceeds it, other prompts fill the rest of the step, and after an OOM halves the
    step budget the cap halves with it; tokens stay mlx-lm's."""
    from tandem.engine import recovery

    path = tiny_model_dir("qwen3")
    llm = LLM(str(path), check_invariants=True, max_num_batched_tokens=32, max_prefill_chunk=12)
    sched, runner = llm.engine.scheduler, llm.engine.loop.runner
    assert sched.config.max_prefill_chunk == 12 and recovery.prefill_cap(sched) == 12
    chunks: list[list[int]] = []
    launch = runner.launch

    def record(plan, *args, **kwargs):
        chunks.append([s.num_tokens for s in plan.segments])
        return launch(plan, *args, **kwargs)

    runner.launch = record
    seen = wrap_once(runner, "launch", 4, RuntimeError("[metal::malloc] out of memory"))
    outs = llm.generate(PROMPTS, greedy(12))
    assert seen["raised"] == 1
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == reference(path, p, 12)
    assert chunks[0] == [7, 12, 2, 11]  # 41 tokens of the second prompt: 12 a step
    assert max(max(c) for c in chunks) <= 12
    assert sched.max_step_tokens == 16 and recovery.prefill_cap(sched) == 6
    assert max(max(c) for c in chunks[3:]) <= 6  # after the failed 4th launch: 6 at most
