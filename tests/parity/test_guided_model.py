"""Guided decoding on a real (tiny, random-weight) model: the grammar alone makes every
constrained output valid, in batches shared with unconstrained requests, greedy and sampled,
overlap on and off token-identical, and unconstrained batchmates still match mlx-lm."""

from __future__ import annotations

import json
import random

import pytest
from test_mlx_lm_parity import greedy, reference

from tandem import LLM, SamplingParams
from tandem.testing.guided_cases import CASES, SCHEMAS


def _batch(seed: int) -> tuple[list[list[int]], list[SamplingParams], list]:
    rng = random.Random(seed)
    prompts, params, cases = [], [], []
    for i, case in enumerate([c for c in CASES if c.bounded] * 2):
        prompts.append([rng.randrange(3, 500) for _ in range(rng.randint(2, 20))])
        params.append(
            SamplingParams(
                max_tokens=200,
                temperature=0.0 if i % 2 == 0 else 1.0,
                seed=seed * 1000 + i,
                guided=case.guided,
            )
        )
        cases.append(case)
        if i % 3 == 0:  # unconstrained batchmates, greedy (checked against mlx-lm)
            prompts.append([rng.randrange(3, 500) for _ in range(rng.randint(2, 20))])
            params.append(greedy(rng.randint(4, 24)))
            cases.append(None)
    return prompts, params, cases


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_guided_batch_valid_exact_and_overlap_identical(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    prompts, params, cases = _batch(seed=1)
    on = LLM(str(path), overlap=True, check_invariants=True)
    off = LLM(str(path), overlap=False, check_invariants=True)
    got_on = on.generate(prompts, params)
    got_off = off.generate(prompts, params)
    assert [o.token_ids for o in got_on] == [o.token_ids for o in got_off]
    for p, o, case in zip(prompts, got_on, cases, strict=True):
        if case is None:
            assert o.token_ids == reference(path, p, len(o.token_ids))
        else:
            assert o.finish_reason == "stop", (case.name, o.text)
            assert case.check(o.text), (case.name, o.text)
    assert on.engine.loop.num_chained > 0


def test_n_samples_of_one_schema_each_valid(tiny_model_dir):
    """n > 1 (follows): every sample gets its own grammar state."""
    path = tiny_model_dir("llama")
    llm = LLM(str(path))
    engine = llm.engine
    schema = json.dumps(SCHEMAS["person"])
    prompt = [5, 6, 7, 8]
    first = engine.add_request(
        prompt,
        SamplingParams(max_tokens=120, temperature=1.0, seed=0, guided=("json_schema", schema)),
    )
    ids = [first] + [
        engine.add_request(
            prompt,
            SamplingParams(max_tokens=120, temperature=1.0, seed=s, guided=("json_schema", schema)),
            follows=first,
        )
        for s in range(1, 4)
    ]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    texts = [llm.tokenizer.decode(got[rid]) for rid in ids]
    for t in texts:
        obj = json.loads(t)
        assert set(obj) == {"name", "age", "member"}
    assert len(set(texts)) > 1


def test_random_schemas_on_a_real_model(tiny_model_dir):
    """24 random bounded schemas, sampled, with greedy unconstrained batchmates: valid,
    overlap on == off."""
    from tandem.testing.guided_cases import random_schema_case

    rng = random.Random(5)
    path = tiny_model_dir("llama")
    cases = [random_schema_case(rng) for _ in range(24)]
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 16))] for _ in range(30)]
    params = [
        SamplingParams(max_tokens=300, temperature=1.0, seed=i, guided=c.guided)
        for i, c in enumerate(cases)
    ] + [greedy(12) for _ in range(6)]
    got = {}
    for overlap in (True, False):
        llm = LLM(str(path), overlap=overlap, check_invariants=True)
        got[overlap] = llm.generate(prompts, params)
    assert [o.token_ids for o in got[True]] == [o.token_ids for o in got[False]]
    for case, o in zip(cases, got[True], strict=False):
        assert o.finish_reason == "stop" and case.check(o.text), (case.spec, o.text)
