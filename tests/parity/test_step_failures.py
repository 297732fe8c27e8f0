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
