"""Anthropic's Messages API against a live server, through the official ``anthropic`` SDK
(and raw HTTP where the exact event sequence matters)."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import jsonschema
import pytest

from tandem.testing.live_server import API_KEY, Server

GREEDY = {"temperature": 0}  # the SDK has no temperature keyword any more: it rides in the body
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(served_model):
    s = Server(served_model, "--tool-call-format", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def ask(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("max_tokens", 12)
    kw.setdefault("messages", [{"role": "user", "content": "hello there"}])
    kw.setdefault("extra_body", GREEDY)
    return client.messages.create(**kw)


def events(server, body: dict) -> list[tuple[str, dict]]:
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    return server.named_events("/v1/messages", body, headers)


def test_create_and_count_tokens(client):
    m = ask(client, system="Be brief.")
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert m.stop_reason in ("max_tokens", "end_turn")
    assert m.usage.output_tokens == (12 if m.stop_reason == "max_tokens" else m.usage.output_tokens)
    assert [b.type for b in m.content] in (["text"], [])
    counted = client.messages.count_tokens(
        model="tiny", system="Be brief.", messages=[{"role": "user", "content": "hello there"}]
    ).input_tokens
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    again = ask(client, system="Be brief.")
    assert again.usage.cache_read_input_tokens > 0  # the prefix cache served it
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted
    assert again.content == m.content  # greedy


def test_stream_event_sequence_equals_whole_message(client, server):
    body = {
        "model": "tiny",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "stream me"}],
        "stream": True,
        **GREEDY,
    }
    evs = events(server, body)
    names = [n for n, _ in evs]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    middle = names[1:-2]
    assert middle[0] == "content_block_start" and middle[-1] == "content_block_stop"
    assert set(middle[1:-1]) == {"content_block_delta"}
    text = "".join(d["delta"]["text"] for n, d in evs if n == "content_block_delta")
    whole = ask(client, max_tokens=16, messages=body["messages"])
    assert text == whole.content[0].text
    final = evs[-2][1]
    assert final["delta"]["stop_reason"] == whole.stop_reason
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens
    with client.messages.stream(
        model="tiny", max_tokens=16, messages=body["messages"], extra_body=GREEDY
    ) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].text == text


def test_forced_tool_use_whole_and_streamed(client):
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        kw = dict(max_tokens=48, tools=[WEATHER], tool_choice=choice)
        m = ask(client, messages=[{"role": "user", "content": "weather?"}], **kw)
        if m.stop_reason == "max_tokens":
            continue  # the random model may write a long string; bounded by maxLength here
        assert m.stop_reason == "tool_use"
        (block,) = m.content
        assert block.type == "tool_use" and block.name == "get_weather"
        jsonschema.validate(block.input, WEATHER["input_schema"])
        with client.messages.stream(
            model="tiny",
            messages=[{"role": "user", "content": "weather?"}],
            extra_body=GREEDY,
            **kw,
        ) as s:
            streamed = s.get_final_message()
        assert streamed.content[0].input == block.input
        assert streamed.stop_reason == "tool_use"


def test_tool_result_history(client):
    history = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    m = ask(client, messages=history, tools=[WEATHER])
    assert m.usage.output_tokens > 0
    base = client.messages.count_tokens(model="tiny", messages=history, tools=[WEATHER])
    longer = json.loads(json.dumps(history))
    longer[2]["content"][0]["content"] = [{"type": "text", "text": "sunny, 21 C, light wind"}]
    more = client.messages.count_tokens(model="tiny", messages=longer, tools=[WEATHER])
    assert more.input_tokens > base.input_tokens  # the tool result reaches the prompt


def test_stop_sequence(client):
    text = ask(client, max_tokens=12).content[0].text
    stop = next((c for c in text[1:] if c.strip() and c != text[0]), None)
    if stop is None:
        pytest.skip("greedy output has no usable stop character")
    m = ask(client, max_tokens=12, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)] if text.index(stop) else not m.content


def test_billing_header_block_is_dropped(client):
    msgs = [{"role": "user", "content": "cache me"}]

    def system(tag: str):
        return [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=1; cch={tag};"},
            {"type": "text", "text": "You are a coding agent."},
        ]

    plain = client.messages.count_tokens(
        model="tiny", messages=msgs, system="You are a coding agent."
    )
    with_header = client.messages.count_tokens(model="tiny", messages=msgs, system=system("a1"))
    assert with_header.input_tokens == plain.input_tokens
    ask(client, messages=msgs, system=system("b2"))
    hit = ask(client, messages=msgs, system=system("c3"))
    assert hit.usage.cache_read_input_tokens >= 16  # a changing header does not defeat it


def test_errors_in_anthropic_shape(client, server):
    cases = [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA==",
                                },
                            }
                        ],
                    }
                ]
            },
            400,
        ),
        ({"extra_body": {"bogus": 1}}, 400),
        ({"model": "nope"}, 404),
        ({"max_tokens": 0}, 400),
        ({"messages": []}, 400),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "missing"}}, 400),
    ]
    for kw, status in cases:
        with pytest.raises(anthropic.APIStatusError) as info:
            ask(client, **kw)
        e = info.value
        assert e.status_code == status, kw
        assert e.body["type"] == "error" and e.body["error"]["message"], e.body
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        assert e.body["error"]["type"] == kind
    no_key = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        ask(no_key)
    assert info.value.body["error"]["type"] == "authentication_error"
    r = server.post(
        "/v1/messages", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]


def test_ping_while_waiting(server, monkeypatch):
    """While the engine is paused (as during a long prefill) the stream sends pings."""
    assert server.post("/pause").status_code == 200
    threading.Timer(6.5, lambda: server.post("/resume")).start()
    t0 = time.monotonic()
    evs = events(
        server,
        {
            "model": "tiny",
            "max_tokens": 4,
            "stream": True,
            **GREEDY,
            "messages": [{"role": "user", "content": "wait for it"}],
        },
    )
    names = [n for n, _ in evs]
    assert time.monotonic() - t0 > 6
    assert names[0] == "message_start" and names[1] == "ping"
    assert names[-1] == "message_stop"


def test_agent_session_cache_grows(client):
    """A replayed multi-turn session: each turn resends the history, and the prefix cache
    serves a longer part of it every turn."""
    history = [{"role": "user", "content": "start a task " * 6}]
    cached = []
    for turn in range(4):
        m = ask(client, messages=history, system="You are an agent.", max_tokens=10)
        cached.append(m.usage.cache_read_input_tokens)
        reply = "".join(b.text for b in m.content if b.type == "text") or "ok"
        history += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"next step {turn} " * 5},
        ]
    assert all(b > a for a, b in zip(cached[1:], cached[2:], strict=False)), cached
    assert cached[1] > 0


def test_misplaced_blocks_and_unsupported_display_are_400s(client):
    bad_turns = [
        [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
        [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
        [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}],
    ]
    for messages in bad_turns:
        with pytest.raises(anthropic.BadRequestError) as info:
            ask(client, messages=messages)
        assert "not allowed" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        ask(client, max_tokens=20, thinking={"type": "adaptive", "display": "omitted"})


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_the_request(server, stream):
    body = {
        "model": "tiny",
        "max_tokens": 3000,
        "stream": stream,
        "messages": [{"role": "user", "content": "go on"}],
    }
    headers = {"x-api-key": API_KEY}
    gone = 'tandem_requests_total{endpoint="messages",status="disconnected"}'
    before = server.metric(gone, 0.0)
    assert server.post("/pause").status_code == 200  # the request cannot finish first
    if stream:
        with httpx.stream(
            "POST", server.url + "/v1/messages", json=body, headers=headers, timeout=30
        ) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 0:
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=1.0)
    assert server.post("/resume").status_code == 200
    server.wait_idle(10)
    assert server.metric("tandem_num_requests_running") == 0
    assert server.get("/health").status_code == 200
    deadline = time.time() + 10
    while server.metric(gone, 0.0) == before and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric(gone, 0.0) == before + 1
