"""Cache-aware admission (engine/admission.py, ``_jump``): a head of the queue that would evict
cached pages lets mostly-cached requests just behind it start first, a bounded number of times.
The real scheduler and loop on the fake runner (no MLX)."""

from __future__ import annotations

import pytest

from tandem.engine import admission
from tandem.engine.engine import Engine
from tandem.engine.scheduler import SchedulerConfig
from tandem.sampling_params import SamplingParams
from tandem.testing.fake_runner import FakeRunner, fake_token

LONG = 400  # prompt tokens (25 pages of 16)


def make(overlap: bool, pages: int, **cfg) -> tuple[Engine, FakeRunner, list[int]]:
    config = SchedulerConfig(
        **{"max_num_seqs": 8, "max_model_len": 1024, "kv_budget_tokens": pages * 16, **cfg}
    )
    runner = FakeRunner(config.num_pages, config.page_size)
    engine = Engine(runner, config, overlap=overlap, check_invariants=True)
    computed = [0]
    real = runner.launch

    def launch(plan, parent, masks=None, **kw):
        computed[0] += sum(s.num_tokens for s in plan.segments)
        return real(plan, parent, masks, **kw)

    runner.launch = launch  # type: ignore[method-assign]
    return engine, runner, computed


def run(engine: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Request i of ``prompts`` with seed i; its tokens."""
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    for i, (rid, prompt) in enumerate(prompts.items()):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i)
        engine.add_request(prompt, sp, rid)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return got


def expected(prompt: list[int], seed: int, n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(fake_token(seed, seq))
        seq.append(out[-1])
    return out


def prompts(tag: str) -> dict[str, list[int]]:
    return {
        f"{tag}{i}": [10 + i] + [(i * 7 + j) % 300 + 1 for j in range(LONG - 1)] for i in range(4)
    }


@pytest.mark.parametrize("overlap", [False, True])
def test_cached_prompts_in_a_pool_too_small_for_all_are_not_computed_again(overlap):
    """Four cached 400-token prompts sent again to a pool that holds three of them (plus
    their outputs): FIFO admission evicted each next request's prefix (LRU) and computed all
    four again; now three start on their hits and only one prompt is computed again."""
    engine, _, computed = make(overlap, pages=82)
    first = prompts("a")
    run(engine, first, 1)  # (each finished request leaves its prompt cached)
    computed[0] = 0
    again = {rid.replace("a", "b"): p for rid, p in first.items()}
    got = run(engine, again, 16)
    assert computed[0] < LONG + 4 * 16 + 3 * 16, computed[0]  # one prompt, hits' tails, decodes
    for i, (rid, prompt) in enumerate(again.items()):
        assert got[rid] == expected(prompt, i, 16), rid


def test_tokens_are_exact_whatever_the_admission_order():
    """The same requests with and without jumping give the same tokens (seeded)."""
    outs = []
    for limit in (0, admission.JUMP_LIMIT):
        saved = admission.JUMP_LIMIT
        admission.JUMP_LIMIT = limit
        try:
            engine, _, computed = make(True, pages=82)
            run(engine, prompts("a"), 1)
            computed[0] = 0
            got = run(engine, {rid + "b": p for rid, p in prompts("a").items()}, 16)
            outs.append((got, computed[0]))
        finally:
            admission.JUMP_LIMIT = saved
    (fifo, fifo_computed), (jump, jump_computed) = outs
    assert fifo == jump
    for i, (rid, p) in enumerate(prompts("a").items()):
        assert jump[rid + "b"] == expected(p, i, 16)
    assert jump_computed < fifo_computed / 2, (jump_computed, fifo_computed)


def test_a_head_is_passed_over_a_bounded_number_of_times(monkeypatch):
    """A request needing fresh pages behind which cached requests keep arriving starts after
    at most JUMP_LIMIT of them."""
    monkeypatch.setattr(admission, "JUMP_LIMIT", 3)
    engine, _, _ = make(False, pages=60, max_num_seqs=8)  # (7 could start before it)
    sched = engine.scheduler
    cached = [[50 + i] * 40 for i in range(8)]
    for i, p in enumerate(cached):  # eight short prompts cached (3 pages each)
        engine.add_request(p, SamplingParams(max_tokens=1), f"c{i}")
    while engine.has_unfinished():
        engine.step()
    head = [7] * 720  # 45 pages, 44 free: it must evict cached pages to start
    engine.add_request(head, SamplingParams(max_tokens=4, ignore_eos=True), "head")
    for i, p in enumerate(cached):
        engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True), f"hit{i}")
    started: list[str] = []
    while engine.has_unfinished():
        engine.step()
        for rid in sched.running:
            if rid not in started:
                started.append(rid)
    assert "head" in started
    before = started[: started.index("head")]
    assert len(before) == 3, started
    assert all(r.startswith("hit") for r in before)
