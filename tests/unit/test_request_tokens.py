"""Request.token_at / token_slice agree with slicing the copied history."""

import random

from tandem.engine.request import Request
from tandem.sampling_params import SamplingParams


def test_token_at_and_slice_match_the_history():
    rng = random.Random(0)
    for _ in range(200):
        prompt = [rng.randrange(100) for _ in range(rng.randint(1, 12))]
        req = Request("r", prompt, SamplingParams(max_tokens=32), seed=0, stop_ids=frozenset())
        req.output_token_ids.extend(rng.randrange(100) for _ in range(rng.randint(0, 12)))
        whole = req.token_ids()
        assert [req.token_at(i) for i in range(len(whole))] == whole
        for _ in range(10):
            a = rng.randint(0, len(whole) + 3)
            b = rng.randint(a, len(whole) + 3)
            assert req.token_slice(a, b) == whole[a:b]
