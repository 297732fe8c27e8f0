"""The device refusing a KV pool growth (out of memory) retracts and resumes instead of ending
the engine: outputs stay token-exact, the budget shrinks."""

from __future__ import annotations

import random

import mlx.core as mx  # noqa: I001
import pytest
from test_mlx_lm_parity import reference

import tandem.runner.kv as kv
from tandem import LLM, SamplingParams


class _FlakyMx:
    """``mx`` for kv.py whose ``zeros`` fails once, mid-way through the ``grow``-th growth."""

    def __init__(self, fail_on_growth: int, fail_at_layer_call: int) -> None:
        self.growths = 0
        self.calls = 0
        self.fail_on_growth = fail_on_growth
        self.fail_at = fail_at_layer_call
        self.failed = False

    def __getattr__(self, name):
        return getattr(mx, name)

    def zeros(self, *a, **kw):
        if self.growths == self.fail_on_growth and not self.failed:
            self.calls += 1
            if self.calls == self.fail_at:
                self.failed = True
                raise RuntimeError("[malloc] Unable to allocate 1073741824 bytes.")
        return mx.zeros(*a, **kw)


@pytest.mark.parametrize("overlap", [True, False])
def test_growth_oom_retracts_resumes_exact(tiny_model_dir, monkeypatch, overlap):
    path = tiny_model_dir("qwen3")
    llm = LLM(str(path), overlap=overlap, check_invariants=True, max_num_seqs=6)
    flaky = _FlakyMx(fail_on_growth=2, fail_at_layer_call=3)
    grow = kv.KVPool._grow

    def counting_grow(self, rows, cap):
        flaky.growths += 1
        return grow(self, rows, cap)

    monkeypatch.setattr(kv, "mx", flaky)
    monkeypatch.setattr(kv.KVPool, "_grow", counting_grow)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(3, 30))] for _ in range(10)]
    lengths = [rng.randint(20, 320) for _ in prompts]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    budget = llm.engine.scheduler.config.kv_budget_tokens
    outs = llm.generate(prompts, params)
    assert flaky.failed, "the fault never fired (no second growth)"
    sched = llm.engine.scheduler
    assert sched.stats.kv_oom_recoveries == 1
    assert sched.config.kv_budget_tokens < budget
    for p, n, o in zip(prompts, lengths, outs, strict=True):
        assert o.finish_reason == "length"
        assert o.token_ids == reference(path, p, n)
