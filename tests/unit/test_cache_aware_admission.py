"""Cache-aware admission (engine/admission.py, ``_jump``): a head of the queue that would evict
cached pages lets mostly-cached requests just behind it start first, a bounded number of times.
The real scheduler and loop on the fake runner (no MLX)."""

from __future__ import annotations

import random

import pytest

from tandem.engine import admission
from tandem.engine.engine import Engine
from tandem.engine.scheduler import SchedulerConfig
from tandem.sampling_params import SamplingParams
from tandem.testing.fake_runner import FakeRecurrentRunner, FakeRunner, fake_token

LONG = 400  # prompt tokens (25 pages of 16)
EOS = 999


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


def test_requests_sharing_a_long_prefix_in_one_step_compute_it_once():
    """Requests sent together that share more than ``SHARED_PREFIX_WAIT`` uncached tokens
    start one after the other: the first computes the prefix, the rest hit it. Requests
    sharing less, or after a different first token, start together (no hits among them)."""
    engine, _, computed = make(False, pages=200, max_num_seqs=16)
    shared = [5 + j % 200 for j in range(320)]  # 20 pages
    group = {f"s{i}": shared + [300 + i] * 20 for i in range(4)}
    short = {f"t{i}": shared[:200] + [400 + i] * 8 for i in range(2)}  # under the wait
    other = {"o": [7] + shared[1:] + [500] * 20}  # the same tokens after a different first
    sent = {**short, **other, **group}
    got = run(engine, sent, 4)
    stats = engine.scheduler.stats
    assert stats.hit_tokens == 3 * 320, stats.hit_tokens
    prompt_tokens = sum(len(p) for p in sent.values())
    assert computed[0] == prompt_tokens - 3 * 320 + 7 * 3  # hits skipped; 3 decodes each
    for i, (rid, prompt) in enumerate(sent.items()):
        assert got[rid] == expected(prompt, i, 4), rid


def test_admitting_into_a_full_cache_compares_only_prompts_with_a_common_head(monkeypatch):
    """64 distinct prompts admitted into a pool full of cached ones (every head evicts, and
    the lookahead behind it is matched): no two prompts are compared token by token, since
    none shares its first ``SHARED_PREFIX_WAIT`` tokens with another (each request against
    every one admitted before it cost 0.9 s of a 256-prompt ramp on an H100's host)."""
    calls = [0]
    real = admission._common_prefix

    def counted(a: list[int], b: list[int]) -> int:
        calls[0] += 1
        return real(a, b)

    monkeypatch.setattr(admission, "_common_prefix", counted)
    engine, _, _ = make(False, pages=64 * 17 + 8, max_num_seqs=64)
    rng = random.Random(0)
    for tag in ("a", "b"):
        batch = {f"{tag}{i}": [rng.randrange(1, 300) for _ in range(260)] for i in range(64)}
        got = run(engine, batch, 2)
        for i, (rid, prompt) in enumerate(batch.items()):
            assert got[rid] == expected(prompt, i, 2), rid
    assert engine.scheduler.kv.evicted_pages > 0  # the second batch evicted the first's
    assert calls[0] == 0


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
    order: dict[str, int] = {}
    while engine.has_unfinished():
        engine.step()
        for rid, req in sched.running.items():
            if rid not in started:
                started.append(rid)
                order[rid] = req.admit_order
    assert "head" in started
    before = started[: started.index("head")]
    assert len(before) == 3, started
    assert all(r.startswith("hit") for r in before)
    # Retraction takes the latest admitted first: the head counts as admitted before them.
    assert all(order["head"] < order[r] for r in before)


def _fuzz(seed: int, overlap: bool, kind: str) -> int:
    """Squeezed pools, prompts sharing a few prefixes, n > 1 followers, aborts, stop tokens;
    every token exact, the invariants after every step, nothing left held. Returns the jumps."""
    rng = random.Random(seed)
    page, pages = 4, rng.randint(20, 60)
    seqs = rng.randint(2, 8)
    cfg: dict = {
        "max_num_seqs": seqs,
        "max_model_len": pages * page,
        "page_size": page,
        "kv_budget_tokens": pages * page,
        "max_num_batched_tokens": rng.choice([16, 32, 64, 256]),
    }
    if kind == "recurrent":
        cfg.update(state_slots=seqs, state_snapshots=rng.randint(2, 10))
        runner: FakeRunner = FakeRecurrentRunner(pages, page)
    elif kind == "window":
        wpages = rng.randint(6, 20)
        cfg.update(window=10, window_pages=wpages)
        runner = FakeRunner(pages, page, window=10, window_pages=wpages)
    else:
        runner = FakeRunner(pages, page)
    engine = Engine(
        runner,
        SchedulerConfig(**cfg),
        eos_token_ids=[EOS],
        overlap=overlap,
        check_invariants=True,
        host_thread=overlap and seed % 2 == 0,
    )
    jumps = [0]
    real = engine.scheduler.admission._jump

    def jump(waiting, *a):
        out = real(waiting, *a)
        jumps[0] += len(out)
        assert waiting[0].num_passed + len(out) <= admission.JUMP_LIMIT
        return out

    engine.scheduler.admission._jump = jump  # type: ignore[method-assign]
    longest = pages * page // 2
    bases = [[rng.randrange(900) for _ in range(rng.randint(page, longest))] for _ in range(4)]
    specs: list[tuple[int, str, list[int], SamplingParams, int | None, str | None]] = []
    for i, at in enumerate(sorted(rng.randrange(0, 150) for _ in range(80))):
        if rng.random() < 0.6:
            base = rng.choice(bases)
            prompt = base[: max(1, len(base) - rng.randint(0, 3))]
            prompt += [rng.randrange(900) for _ in range(rng.randint(0, 3))]
        else:
            prompt = [rng.randrange(900) for _ in range(rng.randint(1, longest))]
        most = max(1, min(20, pages * page - len(prompt) - 1))
        stops = tuple(rng.sample(range(1000), 20)) if rng.random() < 0.2 else ()
        params = SamplingParams(
            max_tokens=rng.randint(1, most),
            seed=i,
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=stops,
        )
        abort_at = at + rng.randint(0, 20) if rng.random() < 0.1 else None
        follows = None
        if specs and rng.random() < 0.15:  # n > 1: the previous request's prompt, same step
            at, follows, prompt = specs[-1][0], specs[-1][1], specs[-1][2]
            prev = specs[-1][3]
            params = SamplingParams(
                max_tokens=prev.max_tokens,
                seed=i,
                ignore_eos=prev.ignore_eos,
                stop_token_ids=prev.stop_token_ids,
            )
        specs.append((at, f"r{i}", prompt, params, abort_at, follows))
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    aborted: set[str] = set()
    step = 0
    while step < 200 or engine.has_unfinished():
        for at, rid, prompt, params, _, follows in specs:
            if at == step:
                live = follows is not None and follows in tokens and follows not in reasons
                engine.add_request(prompt, params, rid, follows=follows if live else None)
                tokens[rid] = []
        for _, rid, _, _, abort_at, _ in specs:
            if abort_at == step and rid in tokens and rid not in reasons and engine.abort(rid):
                aborted.add(rid)
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
        step += 1
        assert step < 20000, "no progress"
    for _, rid, prompt, params, _, _ in specs:
        want, why = expected_run(int(rid[1:]), prompt, params)
        if rid in aborted:
            assert reasons[rid] == "abort" and tokens[rid] == want[: len(tokens[rid])]
        else:
            assert (tokens[rid], reasons[rid]) == (want, why), (rid, seed, kind)
    sched = engine.scheduler
    assert not sched.running and not sched.waiting and sched.kv.num_held == 0
    return jumps[0]


def expected_run(seed: int, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    seq, out = list(prompt), []
    for _ in range(params.max_tokens):
        out.append(fake_token(seed, seq))
        seq.append(out[-1])
        if out[-1] in params.stop_token_ids or (out[-1] == EOS and not params.ignore_eos):
            return out, "stop"
    return out, "length"


@pytest.mark.parametrize("kind", ["plain", "recurrent", "window"])
@pytest.mark.parametrize("overlap", [False, True])
def test_jumps_in_random_schedules_keep_tokens_exact(kind, overlap):
    assert sum(_fuzz(seed, overlap, kind) for seed in range(4)) > 0
