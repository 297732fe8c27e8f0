"""Structured output, tool calls and reasoning through the live server (openai client).

The random-weight model writes whatever the grammar allows, so crafted outputs come from
grammars: a regex that forces a Hermes tool call or a think block tests the parsers end to
end, streamed and not."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tandem.testing.guided_cases import SCHEMAS
from tandem.testing.live_server import API_KEY, Server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MSGS = [{"role": "user", "content": "hello"}]
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
    r'"days": [1-7]\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server(served_model):
    s = Server(served_model, "--tool-call-format", "hermes", "--reasoning", "off")
    yield s
    s.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


def _stream_chat(server, **kw) -> tuple[dict, str | None]:
    """Reassemble a streamed chat choice: content, reasoning_content, tool_calls (a call's
    first entry has its id and name, later ones more of its arguments)."""
    out: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    reason = None
    for chunk in client(server).chat.completions.create(model="tiny", stream=True, **kw):
        for c in chunk.choices:
            d = c.delta.model_dump()
            out["content"] += d.get("content") or ""
            out["reasoning_content"] += d.get("reasoning_content") or ""
            for entry in d.get("tool_calls") or []:
                if entry["index"] == len(out["tool_calls"]):
                    assert entry["id"] and entry["function"]["name"]
                    out["tool_calls"].append(entry)
                else:
                    assert entry["id"] is None and entry["function"]["name"] is None
                    call = out["tool_calls"][entry["index"]]
                    call["function"]["arguments"] += entry["function"]["arguments"]
            reason = c.finish_reason or reason
    return out, reason


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_response_format_validates(server, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    r = client(server).chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=200, temperature=1.0, seed=3, response_format=fmt
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    streamed, reason = _stream_chat(
        server, messages=MSGS, max_tokens=200, temperature=1.0, seed=3, response_format=fmt
    )
    assert reason == "stop" and streamed["content"] == r.choices[0].message.content


def test_other_guided_kinds_on_both_endpoints(server):
    c = client(server)
    r = c.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=40,
        extra_body={"response_format": {"type": "regex", "regex": "[a-c]{3}-[0-9]{2}"}},
    )
    assert len(r.choices[0].text) == 6 and r.choices[0].text[3] == "-"
    r = c.completions.create(
        model="tiny", prompt="x", max_tokens=40, extra_body={"guided_choice": ["north", "south"]}
    )
    assert r.choices[0].text in {"north", "south"}
    r = c.chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=40,
        extra_body={"guided_grammar": 'root ::= "n=" [0-9] [0-9]?'},
    )
    assert r.choices[0].message.content.startswith("n=")
    r = c.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=400, response_format={"type": "json_object"}
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "regex", "regex": "a["}}, "response_format.regex"),
        (
            {"response_format": {"type": "grammar", "grammar": "start: nothing_here"}},
            "response_format.grammar",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"separate_reasoning": "yes"}, "separate_reasoning"),
    ],
)
def test_invalid_constraints_are_400_naming_the_field(server, body, param):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": MSGS, "max_tokens": 5, **body},
        headers=server.headers(),
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


def test_auto_tool_call_parsed_streamed_and_not(server):
    kw = dict(
        messages=MSGS,
        max_tokens=80,
        temperature=0,
        tools=[WEATHER, TIME],
        extra_body={"guided_regex": r"Let me check\. " + HERMES_CALL},
    )
    r = client(server).chat.completions.create(model="tiny", **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    streamed, reason = _stream_chat(server, **kw)
    assert reason == "tool_calls" and streamed["content"] == "Let me check."
    (delta,) = streamed["tool_calls"]
    assert delta["index"] == 0 and delta["function"]["name"] == "get_weather"
    assert json.loads(delta["function"]["arguments"]) == args


def test_required_and_named_tool_choice_are_enforced(server):
    for seed in range(4):
        r = client(server).chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            tools=[WEATHER, TIME],
            tool_choice="required",
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        by_name = {"get_weather": WEATHER, "get_time": TIME}
        for call in c.message.tool_calls:
            schema = by_name[call.function.name]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client(server).chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=60, tools=[WEATHER, TIME], tool_choice=named
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in {"UTC", "CET"}
    streamed, reason = _stream_chat(
        server,
        messages=MSGS,
        max_tokens=60,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice=named,
    )
    assert reason == "tool_calls" and streamed["tool_calls"][0]["function"]["name"] == "get_time"


def test_tool_choice_none_returns_text(server):
    r = client(server).chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=80,
        tools=[WEATHER],
        tool_choice="none",
        extra_body={"guided_regex": HERMES_CALL},
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("<tool_call>")


def test_tool_history_messages_are_accepted(server):
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client(server).chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, tools=[WEATHER]
    )
    assert r.choices[0].finish_reason in {"length", "stop", "tool_calls"}


# A user grammar (taken as it is, never wrapped) that writes a think block, then an answer.
THINK = r"start: /<think>[a-z ]{3,20}<\/think>\n\nanswer: (yes|no)/"


def test_reasoning_content_split_streamed_and_not(server):
    kw = dict(
        messages=MSGS,
        max_tokens=60,
        temperature=1.0,
        seed=1,
        extra_body={"guided_grammar": THINK, "separate_reasoning": True},
    )
    r = client(server).chat.completions.create(model="tiny", **kw)
    msg = r.choices[0].message.model_dump()
    assert msg["content"] in {"answer: yes", "answer: no"}
    assert msg["reasoning_content"] and "<think>" not in msg["reasoning_content"]
    streamed, _ = _stream_chat(server, **kw)
    assert streamed["content"] == msg["content"]
    assert streamed["reasoning_content"] == msg["reasoning_content"]
    # The switch: leave it inline.
    kw["extra_body"] = {**kw["extra_body"], "separate_reasoning": False}
    r = client(server).chat.completions.create(model="tiny", **kw)
    inline = r.choices[0].message.model_dump()
    assert inline["content"].startswith("<think>") and inline.get("reasoning_content") is None


def test_constrained_and_free_requests_share_the_engine(server):
    """Concurrent mixed load: every constrained answer validates, free ones complete."""
    import asyncio

    schema = SCHEMAS["person"]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}

    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY)
        jobs = []
        for i in range(16):
            extra = {"response_format": fmt} if i % 2 else {}
            jobs.append(
                c.chat.completions.create(
                    model="tiny", messages=MSGS, max_tokens=100, temperature=1.0, seed=i, **extra
                )
            )
        return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for i, r in enumerate(results):
        if i % 2:
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        else:
            assert r.choices[0].finish_reason in {"length", "stop"}


def test_constraint_applies_after_thinking(server):
    """With reasoning separated, the schema holds for the content after </think>; the random
    model may think until max_tokens, else its answer validates."""
    schema = SCHEMAS["person"]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    for seed in range(3):
        r = client(server).chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            response_format=fmt,
            extra_body={"separate_reasoning": True},
        )
        msg = r.choices[0].message.model_dump()
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(msg["content"]), schema)
        else:
            assert msg["reasoning_content"] or msg["content"]
