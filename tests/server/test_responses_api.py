"""OpenAI's Responses API (stateless) against a live server, through the official ``openai``
SDK and raw HTTP for the exact event sequence."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from tandem.testing.live_server import API_KEY, Server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
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
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def ask(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("input", "hello there")
    kw.setdefault("max_output_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.responses.create(**kw)


def events(server, body: dict) -> list[dict]:
    return [data for _, data in server.named_events("/v1/responses", body)]


def test_create_string_input(client):
    r = ask(client, instructions="Be brief.", store=False)
    assert r.object == "response" and r.model == "tiny"
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 12
    assert [o.type for o in r.output] in (["message"], [])
    again = ask(client, instructions="Be brief.")
    assert again.output_text == r.output_text  # greedy
    assert again.usage.input_tokens_details.cached_tokens > 0
    assert again.usage.total_tokens == again.usage.input_tokens + again.usage.output_tokens


def test_stream_event_sequence(client, server):
    body = {"model": "tiny", "input": "stream me", "max_output_tokens": 16, "temperature": 0}
    evs = events(server, {**body, "stream": True})
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    types = [e["type"] for e in evs]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    inner = types[2:-1]
    assert inner[:2] == ["response.output_item.added", "response.content_part.added"]
    assert inner[-3:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert set(inner[2:-3]) == {"response.output_text.delta"}
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    done = next(e for e in evs if e["type"] == "response.output_text.done")
    assert done["text"] == text
    whole = ask(client, input="stream me", max_output_tokens=16)
    assert whole.output_text == text
    assert evs[-1]["response"]["output"][0]["content"][0]["text"] == text
    parsed = list(client.responses.create(**body, stream=True))  # the SDK's event types
    assert [e.type for e in parsed] == types
    if parsed[-1].type == "response.completed":  # its stream helper knows only this end
        with client.responses.stream(**body) as s:
            assert s.get_final_response().output_text == text


def test_function_calls_whole_and_streamed(client, server):
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        kw = dict(input="weather?", tools=[WEATHER], tool_choice=choice, max_output_tokens=48)
        r = ask(client, **kw)
        if r.status == "incomplete":
            continue
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
        body = {"model": "tiny", "temperature": 0, "stream": True, **kw}
        evs = events(server, body)
        deltas = [e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta"]
        done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
        assert "".join(deltas) == done["arguments"] == call.arguments


def test_item_history_and_cache_growth(client):
    history: list = [{"role": "developer", "content": "You are an agent."}]
    history.append(
        {"role": "user", "content": [{"type": "input_text", "text": "fix the bug " * 5}]}
    )
    cached = []
    for turn in range(4):
        r = ask(client, input=history, tools=[WEATHER], max_output_tokens=8)
        cached.append(r.usage.input_tokens_details.cached_tokens)
        history += [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": r.output_text or "ok"}],
            },
            {
                "type": "function_call",
                "call_id": f"c{turn}",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {
                "type": "function_call_output",
                "call_id": f"c{turn}",
                "output": f"result {turn} " * 4,
            },
        ]
    assert all(b > a for a, b in zip(cached[1:], cached[2:], strict=False)), cached


def test_text_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    r = ask(client, text=fmt, max_output_tokens=24)
    if r.status == "completed":
        jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_refusals(client):
    cases = [
        dict(store=True),
        dict(previous_response_id="resp_123"),
        dict(tools=[{"type": "web_search"}]),
        dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
        dict(extra_body={"bogus": 1}),
        dict(text={"verbosity": "high"}),
        dict(input=[{"type": "item_reference", "id": "x"}]),
    ]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, **kw)
        err = info.value.body
        assert err["type"] == "invalid_request_error" and err["message"], kw
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, store=True)
    assert info.value.body["param"] == "store" and "stateless" in info.value.body["message"]


def test_long_string_input_and_calls_sent_back_as_returned(client):
    r = ask(client, input="word " * 800, max_output_tokens=2)  # one string: no item limit
    assert r.usage.input_tokens > 800
    history = [
        {"role": "user", "content": "go"},
        # A call cut short by max_output_tokens comes back with arguments as generated.
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"ci'},
        {"type": "function_call_output", "call_id": "c1", "output": "cut short"},
    ]
    assert ask(client, input=history, tools=[WEATHER], max_output_tokens=2).usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_the_request(server, stream):
    body = {"model": "tiny", "max_output_tokens": 3000, "stream": stream, "input": "go on"}
    gone = 'tandem_requests_total{endpoint="responses",status="disconnected"}'
    before = server.metric(gone, 0.0)
    assert server.post("/pause").status_code == 200  # the request cannot finish first
    if stream:
        with httpx.stream(
            "POST", server.url + "/v1/responses", json=body, headers=server.headers(), timeout=30
        ) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 0:
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                server.url + "/v1/responses", json=body, headers=server.headers(), timeout=1.0
            )
    assert server.post("/resume").status_code == 200
    server.wait_idle(10)
    assert server.metric("tandem_num_requests_running") == 0
    assert server.get("/health").status_code == 200
    deadline = time.time() + 10
    while server.metric(gone, 0.0) == before and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric(gone, 0.0) == before + 1
