"""A hand list of hostile requests: every one gets a 4xx with an OpenAI error body (or a
normal answer), never a 5xx, and the server stays healthy and correct afterwards."""

from __future__ import annotations

import pytest

from tandem.testing.live_server import Server

BIG = 10**30
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    ("/v1/completions", b"{"),
    ("/v1/completions", b"\xff\xfe\x00 not utf-8"),
    ("/v1/completions", b"[]"),
    ("/v1/completions", b"null"),
    ("/v1/completions", b'"prompt"'),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "x", "top_p": Infinity}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
]
BODIES = [
    ("/v1/completions", {"prompt": "x", "max_tokens": BIG}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "seed": BIG}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "top_k": BIG}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "n": BIG}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "logprobs": BIG}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": BIG}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "logit_bias": {str(BIG): 1}}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "stop_token_ids": [BIG]}),
    ("/v1/completions", {"prompt": [BIG]}),
    ("/v1/completions", {"prompt": [-1]}),
    ("/v1/completions", {"prompt": [[]]}),
    ("/v1/completions", {"prompt": ["x", 5]}),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 10_000}),
    ("/v1/completions", {"prompt": "x", "stop": [""]}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": -0.0}),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True, "x": 1}}),
    ("/v1/completions", {"prompt": "x", "user": ["a"]}),
    ("/v1/completions", {"prompt": "x" * 200_000}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}),
    ("/v1/chat/completions", {"messages": MSG * 5_000, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0}),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": "x"}),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": BIG, "logprobs": True}),
    ("/v1/chat/completions", {"messages": MSG, "n": 0}),
    # Found by the OpenAPI fuzzer (tandem/testing/openapi_fuzz.py), each once a 5xx or a
    # dead engine:
    ("/v1/completions", {"prompt": [[True]], "max_tokens": 2, "repetition_penalty": 1.5}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\u00b2": 1}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2}),
    ("/v1/completions", {"prompt": "x", "stream": True, "logit_bias": {"99999": 1}}),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "0", "repetition_penalty": 5e-324}),
    ("/v1/completions", {"prompt": ["a"] * 100, "n": 16, "max_tokens": 1}),
    ("/v1/completions", {"prompt": "x", "stream": 0}),
    ("/v1/completions", {"prompt": "x", "echo": ""}),
    ("/v1/completions", {"prompt": "x", "top_logprobs": False}),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 2, "max_tokens": -1}),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "text", "x": 1}}),
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = Server(tiny_model_dir("llama"))
    yield s
    s.stop()


def _check(r) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"]


@pytest.mark.parametrize(("path", "raw"), CASES)
def test_malformed_bodies_get_4xx(server, path, raw):
    headers = {**server.headers(), "content-type": "application/json"}
    _check(server.post(path, content=raw, headers=headers))


@pytest.mark.parametrize(("path", "body"), BODIES, ids=[str(i) for i in range(len(BODIES))])
def test_hostile_values_never_5xx(server, path, body):
    _check(server.post(path, json=body))


def test_huge_integer_literal_is_a_400(server):
    headers = {**server.headers(), "content-type": "application/json"}
    raw = b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}"
    r = server.post("/v1/completions", content=raw, headers=headers)
    assert r.status_code == 400


def test_routing_errors_have_the_openai_shape(server):
    import httpx

    r = httpx.delete(server.url + "/v1/completions", headers=server.headers())
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert "POST" in r.headers["allow"]
    r = server.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_fuzz_findings_are_rejected_not_ignored(server):
    """Values that used to be accepted and ignored (or crash) are 400s naming the field."""
    cases = [
        ({"prompt": [[True]], "max_tokens": 2}, "prompt"),
        ({"prompt": "x", "logit_bias": {"\u00b2": 1}}, "logit_bias"),
        ({"prompt": "x", "stream": True, "logit_bias": {"99999": 1}}, "logit_bias"),
        ({"prompt": ["a"] * 100, "n": 16, "max_tokens": 1}, "n"),
        ({"prompt": "x", "stream": 0}, "stream"),
        ({"prompt": "x", "echo": ""}, "echo"),
        ({"prompt": "x", "top_logprobs": False}, "top_logprobs"),
    ]
    for body, param in cases:
        r = server.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = server.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2, "ignore_eos": True},
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    r = server.post(
        "/v1/completions",
        json={"prompt": "hi", "guided_regex": "0", "repetition_penalty": 5e-324, "max_tokens": 3},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "0"


def test_message_count_is_limited(server):
    from tandem.server.openai_schema import MAX_MESSAGES

    body = {"messages": MSG * (MAX_MESSAGES + 1), "max_tokens": 1}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_server_is_healthy_and_exact_after_the_fuzz(server):
    assert server.get("/health").status_code == 200
    r = server.post(
        "/v1/completions",
        json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_disconnect_while_queued_leaves_no_trace(tiny_model_dir):
    """One row: a long request runs, a second waits in the queue; its client leaves. The
    queued request is dropped without ever running, and the server answers exactly after."""
    import threading
    import time

    import httpx

    s = Server(tiny_model_dir("llama"), "--max-num-seqs", "1")
    try:
        long = {"prompt": "a", "max_tokens": 1500, "ignore_eos": True}
        t = threading.Thread(target=lambda: s.post("/v1/completions", json=long))
        t.start()
        time.sleep(0.5)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                s.url + "/v1/completions",
                headers=s.headers(),
                timeout=0.5,
                json={"prompt": "queued", "max_tokens": 50, "ignore_eos": True},
            )
        t.join(60)

        metric = s.metric
        s.wait_idle(10)
        assert metric("tandem_num_requests_running") == 0
        assert metric("tandem_num_requests_waiting") == 0
        # Only the long request generated tokens: the queued one never ran.
        assert metric("tandem_generation_tokens_total") == 1500
        r = s.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_during_a_long_prefill_leaves_no_trace(tiny_model_dir, stream):
    """A 2,000-token prompt prefilled 2 tokens a step (about a thousand steps); the client
    leaves before its first token. The request stops mid-prefill (no token is ever generated),
    its row and locks are freed, and the server answers exactly afterwards."""

    import httpx

    s = Server(tiny_model_dir("llama"), "--max-num-batched-tokens", "2")
    try:
        body = {"prompt": [5 + i % 400 for i in range(2000)], "max_tokens": 5, "stream": stream}
        with (
            pytest.raises(httpx.ReadTimeout),
            httpx.stream(
                "POST", s.url + "/v1/completions", headers=s.headers(), json=body, timeout=0.5
            ) as r,
        ):
            for _ in r.iter_lines():
                pass
        metric = s.metric
        s.wait_idle(20)
        assert metric("tandem_num_requests_running") == 0
        assert metric("tandem_num_requests_waiting") == 0
        assert metric("tandem_kv_cache_usage_ratio") == 0
        assert metric("tandem_generation_tokens_total") == 0  # aborted before its first token
        r = s.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        s.stop()
