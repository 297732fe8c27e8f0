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

PROMPT = [41, 42, 43, 44, 45] * 6


@pytest.fixture(scope="module")
def spec_server(served_model):
    s = Server(served_model, "--speculative", "ngram", "--num-speculative-tokens", "6")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain(served_model):
    llm = LLM(str(served_model))
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logprobs=0)
    return llm.generate([PROMPT], params)[0]


def stream(server, **body) -> tuple[str, list, str]:
    text, lps, reason = "", [], None
    req = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "stream": True, **body}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=req, headers=server.headers(), timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            lps += (choice.get("logprobs") or {}).get("token_logprobs") or []
            reason = choice["finish_reason"] or reason
    return text, lps, reason


def test_streamed_output_equals_plain_greedy(spec_server, plain):
    text, lps, reason = stream(spec_server, max_tokens=60, ignore_eos=True, logprobs=0)
    assert text == plain.text and reason == "length"
    assert len(lps) == 60
    assert all(abs(a - b) < 1e-4 for a, (b, _) in zip(lps, plain.logprobs, strict=True))


def test_stop_string_inside_an_accepted_run(spec_server, plain):
    stop = plain.text[len(plain.text) // 2 :][:3]
    text, _, reason = stream(spec_server, max_tokens=60, ignore_eos=True, stop=[stop])
    assert reason == "stop" and text == plain.text[: plain.text.index(stop)]


def test_speculation_shows_in_metrics_and_the_dashboard(spec_server):
    stream(spec_server, max_tokens=60, ignore_eos=True)
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
