"""`tandem serve --speculative ngram`: streamed output with stop strings and logprobs equal
to plain greedy decoding, and the speculation counters in /metrics and the dashboard's
history."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tandem import LLM, SamplingParams
from tandem.testing.live_server import Server

PROMPT = [240, 316, 194, 139, 73, 98] * 4  # the tiny model loops on it: runs get accepted


@pytest.fixture(scope="module")
def spec_server(served_model):
    # (Speculating whatever the step times say: the offline engine below must speculate alike.)
    s = Server(
        served_model,
        "--speculative",
        "ngram",
        "--num-speculative-tokens",
        "6",
        "--speculative-min-gain",
        "0",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain(served_model):
    llm = LLM(str(served_model))
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logprobs=0)
    return llm.generate([PROMPT], params)[0]


def stream(server, **body) -> tuple[str, list, str, dict]:
    text, lps, reason, usage = "", [], None, {}
    req = {
        "model": "tiny",
        "prompt": PROMPT,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=req, headers=server.headers(), timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if not chunk["choices"]:
                continue
            choice = chunk["choices"][0]
            text += choice["text"]
            lps += (choice.get("logprobs") or {}).get("token_logprobs") or []
            reason = choice["finish_reason"] or reason
    return text, lps, reason, usage


def test_streamed_output_equals_plain_greedy(spec_server, plain):
    text, lps, reason, usage = stream(spec_server, max_tokens=60, ignore_eos=True, logprobs=0)
    assert text == plain.text and reason == "length" and usage["completion_tokens"] == 60
    assert len(lps) == 60
    assert all(abs(a - b) < 1e-4 for a, (b, _) in zip(lps, plain.logprobs, strict=True))


def _stop_inside_a_run(served_model, ids: list[int]) -> tuple[str, int]:
    """A stop string that a token inside an accepted run (not its last) completes, found
    with the offline engine (which speculates alike), and how many tokens end with it."""
    from tandem.frontend.tokenizer import Tokenizer

    tok = Tokenizer.load(served_model)
    llm = LLM(
        str(served_model), speculative="ngram", num_speculative_tokens=6, speculative_min_gain=0
    )
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prev = 0
    for part in llm.stream(PROMPT, params):
        n = len(part.token_ids)
        for k in range(prev + 1, n):  # a token of the run before its last completes it
            if n - prev < 2:
                break
            before, text = tok.decode(ids[: k - 1]), tok.decode(ids[:k])
            for m in range(2, 40):
                stop = text[-m:]
                if stop.strip() and stop not in before and text.startswith(before):
                    want = _plain_stop(tok, ids, stop)
                    if prev < want < n:  # the run goes on past it
                        return stop, want
        prev = n
    raise AssertionError("no accepted run to stop inside")


def _plain_stop(tok, ids: list[int], stop: str) -> int:
    """How many tokens a server without speculation emits before ``stop`` ends the output:
    one token per step through the same streaming detokenizer and stop matcher."""
    from tandem.frontend.stop import StopStringMatcher
    from tandem.frontend.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tok, PROMPT, skip_special_tokens=True)
    matcher = StopStringMatcher([stop])
    for k, token in enumerate(ids, 1):
        matcher.feed(detok.add([token]))
        if matcher.stopped:
            return k
    raise AssertionError(f"{stop!r} never completes")


def test_stop_string_inside_an_accepted_run(spec_server, plain, served_model):
    """The output ends at the token that completes the stop string, as without speculation:
    text, usage and logprobs alike, though that token came inside a run of several."""
    stop, want = _stop_inside_a_run(served_model, plain.token_ids)
    text, lps, reason, usage = stream(
        spec_server, max_tokens=60, ignore_eos=True, stop=[stop], logprobs=0
    )
    assert reason == "stop" and text == plain.text[: plain.text.index(stop)]
    assert usage["completion_tokens"] == want and len(lps) == want


def test_speculation_shows_in_metrics_and_the_dashboard(spec_server):
    _ = stream(spec_server, max_tokens=60, ignore_eos=True)
    assert spec_server.metric("tandem_spec_verify_steps_total") > 0
    assert spec_server.metric("tandem_spec_accepted_tokens_total") > 0
    assert spec_server.metric("tandem_spec_mean_acceptance_length") > 1
    deadline = time.time() + 10
    while time.time() < deadline:
        points = spec_server.get("/ui/api/stats").json()["points"]
        if any(p["spec_acceptance"] is not None for p in points):
            break
        time.sleep(0.5)
    assert any(0 < (p["spec_acceptance"] or 0) <= 1 for p in points)


def test_draft_model_server_streams_plain_greedy_and_counts(served_model, plain):
    """`--speculative draft --draft-model` (the model drafting for itself): the stream is
    plain greedy decoding's, and the accepted proposals show in /metrics."""
    s = Server(
        served_model,
        "--speculative",
        "draft",
        "--draft-model",
        str(served_model),
        "--num-speculative-tokens",
        "4",
    )
    try:
        text, lps, reason, _ = stream(s, max_tokens=60, ignore_eos=True, logprobs=0)
        assert text == plain.text and reason == "length" and len(lps) == 60
        assert s.metric("tandem_spec_accepted_tokens_total") > 0
    finally:
        s.stop()
