"""Guided decoding through the real scheduler and overlap loop with a fake runner: the masks
(llguidance, the tiny model's tokenizer) alone keep every output valid, chained steps wait
only for their sampling, and overlap on/off give the same tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tandem.engine.engine import Engine
from tandem.engine.grammar import GrammarCompiler, words_for
from tandem.engine.scheduler import SchedulerConfig
from tandem.frontend.tokenizer import Tokenizer
from tandem.sampling_params import SamplingParams
from tandem.testing.fake_runner import FakeRunner
from tandem.testing.guided_cases import CASES

VOCAB = 512  # the tiny model's


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.load(tiny_model_dir("llama"))


def make_engine(
    tokenizer: Tokenizer, overlap: bool, host_thread: bool | None = None, **cfg
) -> tuple[Engine, FakeRunner]:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_model_len": 1024, **cfg})
    runner = FakeRunner(config.num_pages, config.page_size, words=words_for(VOCAB))
    engine = Engine(
        runner,
        config,
        eos_token_ids=tokenizer.eos_token_ids,
        overlap=overlap,
        check_invariants=True,
        vocab_size=VOCAB,
        grammar=lambda: GrammarCompiler(tokenizer.hf, VOCAB, tokenizer.eos_token_ids),
        host_thread=host_thread,
    )
    return engine, runner


def run_mixed(
    tokenizer: Tokenizer, overlap: bool, seed: int, n: int = 40, drain_every: int = 0, **cfg
):
    """Random arrivals; about half the requests constrained by a random case. With
    ``drain_every``, the loop is drained (a pause) every that many steps."""
    rng = random.Random(seed)
    engine, runner = make_engine(tokenizer, overlap, **cfg)
    arrivals = sorted(rng.randrange(0, 60) for _ in range(n))
    specs = []
    for i, step in enumerate(arrivals):
        case = rng.choice(CASES) if rng.random() < 0.5 else None
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(
            max_tokens=300 if case else rng.randint(1, 40),
            seed=i,
            ignore_eos=case is None,
            guided=case.guided if case else None,
        )
        specs.append((step, f"r{i}", prompt, params, case))
    outputs: dict[str, list[int]] = {rid: [] for _, rid, *_ in specs}
    reasons: dict[str, str] = {}
    pending = list(specs)
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params, _ = pending.pop(0)
            engine.add_request(prompt, params, rid)
        outs = engine.step()
        if drain_every and step % drain_every == drain_every - 1:
            outs += engine.loop.drain()
        for out in outs:
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
        step += 1
        assert step < 10_000
    return specs, outputs, reasons, runner, engine


@pytest.mark.parametrize("seed", [0, 1])
def test_constrained_rows_with_host_work_on_the_helper_thread(tokenizer, seed):
    """host_thread=True (engine/loop.py) with guided requests in the batch: a plan with
    constrained rows is never held back (its sampling waits for masks), drains (pauses)
    that meet one finalize and then complete it, and every output equals overlap off."""
    on = run_mixed(tokenizer, True, seed, drain_every=5, host_thread=True)
    off = run_mixed(tokenizer, False, seed)
    specs, outputs, reasons, runner, engine = on
    finished = [rid for _, rid, *_ in specs if reasons[rid] != "abort"]
    assert [outputs[r] for r in finished] == [off[1][r] for r in finished]
    assert all(reasons[r] == off[2][r] for r in finished)
    assert not any(why == "error" for why in reasons.values())
    assert engine.loop.num_threaded > 0 and runner.completed_late > 5


def test_drain_meets_a_grammar_step_sent_whole(tokenizer):
    """host_thread=True: unconstrained requests run with their host work on the helper; a
    guided request then joins, so the step the helper plans has constrained rows and goes
    out whole (its sampling waits for masks). A drain at that moment (a pause) finalizes
    the step before it, then completes and finalizes it: nothing fails, output stays valid."""
    case = next(c for c in CASES if c.bounded)
    met = 0
    for arrive in range(3, 9):
        engine, runner = make_engine(tokenizer, True, host_thread=True)
        for i in range(3):
            params = SamplingParams(max_tokens=40, seed=i, ignore_eos=True)
            engine.add_request([5 + i, 6, 7], params, f"p{i}")
        outs, drained = [], False
        for k in range(400):
            if k == arrive:
                guided = SamplingParams(max_tokens=300, seed=9, guided=case.guided)
                engine.add_request([5, 9, 7], guided, "g")
            outs += engine.step()
            pending = engine.loop.pending
            if not drained and pending is not None and pending.submitted:
                assert pending.plan.sampling.constrained
                outs += engine.loop.drain()
                drained = True
            if not engine.has_unfinished():
                break
        met += drained
        assert not any(o.finish_reason == "error" for o in outs)
        text = tokenizer.decode([t for o in outs if o.request_id == "g" for t in o.new_token_ids])
        assert case.check(text), text
    assert met >= 3


@pytest.mark.parametrize("seed", [0, 1])
def test_every_constrained_output_is_valid_and_overlap_is_exact(tokenizer, seed):
    on = run_mixed(tokenizer, True, seed)
    off = run_mixed(tokenizer, False, seed)
    specs, outputs, reasons, runner, engine = on
    assert outputs == off[1] and reasons == off[2]
    constrained = [s for s in specs if s[4] is not None]
    assert len(constrained) >= 10
    for _, rid, _, _, case in constrained:
        text = tokenizer.decode(outputs[rid])
        if case.bounded or reasons[rid] == "stop":
            assert reasons[rid] == "stop", (case.name, text)
            assert case.check(text), (case.name, text)
        else:
            assert text.startswith("{"), (case.name, text)
    # The chain held through constrained steps: their sampling waited, their forward didn't.
    assert runner.completed_late > 20
    assert engine.loop.num_chained > 0
    assert off[3].completed_late == 0


def test_unconstrained_rows_are_unchanged_by_constrained_batchmates(tokenizer):
    """An unconstrained request's tokens don't depend on what shares its batch."""
    specs, outputs, *_ = run_mixed(tokenizer, True, seed=3)
    alone_engine, _ = make_engine(tokenizer, True)
    for _, rid, prompt, params, case in specs:
        if case is None:
            alone_engine.add_request(prompt, params, rid)
    alone: dict[str, list[int]] = {}
    while alone_engine.has_unfinished():
        for out in alone_engine.step():
            alone.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert alone and all(alone[rid] == outputs[rid] for rid in alone)


def test_small_kv_budget_retracts_and_resumes_grammar_state(tokenizer):
    """Retraction re-prefills prompt + output; the matcher keeps its state (no re-consume)."""
    specs, outputs, reasons, _, engine = run_mixed(
        tokenizer, True, seed=4, n=30, kv_budget_tokens=21 * 16
    )
    for _, rid, _, _, case in specs:
        if case is not None and (case.bounded or reasons[rid] == "stop"):
            assert case.check(tokenizer.decode(outputs[rid])), case.name
    assert engine.scheduler.stats.retractions > 0


def test_invalid_grammars_are_rejected_with_the_reason(tokenizer):
    engine, _ = make_engine(tokenizer, True)
    bad = [
        (("json_schema", "{not json"), "not valid JSON"),
        (("json_schema", '{"type": "objectx"}'), "objectx"),
        (("regex", "a["), "regex"),
        (("grammar", "start: foo"), "foo"),
        (("choice", "[]"), "non-empty list"),
    ]
    for guided, words in bad:
        with pytest.raises(ValueError, match="invalid|JSON|list") as e:
            engine.add_request([5, 6], SamplingParams(max_tokens=4, guided=guided))
        assert words in str(e.value)
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="kind"):
        SamplingParams(guided=("xml", "<a/>"))


def test_guided_without_a_compiler_is_rejected():
    engine = Engine(FakeRunner(), SchedulerConfig(max_num_seqs=2, max_model_len=64))
    with pytest.raises(ValueError, match="not available"):
        engine.add_request([1], SamplingParams(guided=("regex", "a")))


def test_a_token_the_grammar_rejects_fails_only_that_request(tokenizer):
    """If a rejected token ever got through (a bug, a mask race), that request ends with an
    error and its batchmates carry on."""
    engine, runner = make_engine(tokenizer, True)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, guided=("regex", "[0-9]{5}")), "g")
    engine.add_request([8, 9], SamplingParams(max_tokens=20, ignore_eos=True), "u")
    engine.step()
    req = engine.scheduler.running["g"]
    original = req.grammar.accept
    req.grammar.accept = lambda token: original(tokenizer.encode("x", add_special_tokens=False)[0])
    errors, done = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finish_reason:
                done[out.request_id] = out.finish_reason
                errors[out.request_id] = out.error
    assert done == {"g": "error", "u": "length"}
    assert "grammar rejected" in errors["g"]


def test_parallel_masks_and_consumption_equal_sequential(tokenizer, monkeypatch):
    """llguidance's thread pool (many rows) gives the same masks and verdicts as one by one."""
    import tandem.engine.grammar as grammar
    from tandem.engine.grammar import accept_all, fill_masks

    PARALLEL_MIN = 4
    monkeypatch.setattr(grammar, "PARALLEL_MIN", PARALLEL_MIN)

    compiler = GrammarCompiler(tokenizer.hf, VOCAB, tokenizer.eos_token_ids)
    cases = [c for c in CASES if c.bounded][: 2 * PARALLEL_MIN]
    rng = random.Random(0)

    def matchers():
        return [compiler.matcher(*c.guided) for c in cases]

    par, seq = matchers(), matchers()
    for _ in range(6):
        out_par = np.full((len(par), compiler.words), -1, dtype=np.int32)
        out_seq = out_par.copy()
        fill_masks(par, out_par)
        for i, m in enumerate(seq):
            m.fill(out_seq[i])
        assert (out_par == out_seq).all()
        # Mostly allowed tokens, sometimes a random one (may be rejected).
        tokens = []
        for row in out_seq:
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            tokens.append(int(rng.choice(allowed)) if rng.random() < 0.8 else rng.randrange(VOCAB))
        verdicts = accept_all(list(zip(par, tokens, strict=True)))
        assert verdicts == [m.accept(t) for m, t in zip(seq, tokens, strict=True)]


@pytest.mark.parametrize("overlap", [True, False])
def test_many_random_schemas_every_output_validates(tokenizer, overlap):
    """80 random bounded schemas, two seeds each, all in flight together with unconstrained
    requests: the masks alone make every output valid JSON of its schema."""
    from tandem.testing.guided_cases import random_schema_case

    rng = random.Random(11)
    engine, _ = make_engine(tokenizer, overlap, max_num_seqs=32)
    cases = {}
    for i in range(80):
        case = random_schema_case(rng)
        for seed in range(2):
            rid = f"g{i}-{seed}"
            cases[rid] = case
            engine.add_request(
                [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))],
                SamplingParams(max_tokens=400, seed=seed, guided=case.guided),
                rid,
            )
        engine.add_request([5, 6], SamplingParams(max_tokens=20, ignore_eos=True), f"u{i}")
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
    for rid, case in cases.items():
        text = tokenizer.decode(out[rid])
        assert reasons[rid] == "stop" and case.check(text), (case.spec, text)


def test_a_tokenizer_llguidance_cannot_wrap_disables_only_guided_requests():
    def broken():
        raise ValueError("Only fast tokenizers are supported")

    engine = Engine(FakeRunner(), SchedulerConfig(max_num_seqs=2, max_model_len=64), grammar=broken)
    with pytest.raises(ValueError, match="not available.*fast tokenizers"):
        engine.add_request([1], SamplingParams(guided=("regex", "a")))
    engine.add_request([1, 2], SamplingParams(max_tokens=3, ignore_eos=True), "free")
    got = []
    while engine.has_unfinished():
        got += [o for o in engine.step() if o.finish_reason]
    assert [(o.request_id, o.finish_reason) for o in got] == [("free", "length")]


@pytest.mark.parametrize("overlap", [True, False])
def test_constrained_rows_speculate_and_match_plain_decoding(tokenizer, overlap):
    """Grammar rows propose only what the grammar allows and each verify row samples under
    the mask after the proposals before it: the same tokens as without speculation, every
    constrained output valid."""
    from tandem.engine.speculation import SpecConfig

    spec = SpecConfig(num_tokens=4, max_batch=64, patience=1000)
    plain = run_mixed(tokenizer, overlap, seed=5)
    specs, outputs, reasons, runner, engine = run_mixed(
        tokenizer, overlap, seed=5, speculation=spec
    )
    assert outputs == plain[1] and reasons == plain[2]
    stats = engine.scheduler.stats
    assert stats.spec_verifies > 0
    constrained = {rid for _, rid, _, _, case in specs if case is not None}
    verify_rows = [
        p.sample_request_ids[s.sample_row]
        for p in runner.launched
        for s in p.segments
        if s.num_samples > 1 and p.sample_request_ids[s.sample_row] in constrained
    ]
    assert verify_rows  # constrained requests did verify
