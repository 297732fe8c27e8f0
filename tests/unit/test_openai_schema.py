"""The pydantic bodies of /v1/completions and /v1/chat/completions (``openai_schema``) and
what ``requests`` builds from them: strict types, unknown fields refused at every level,
errors naming the field as a path, cross-field rules, and the template's messages."""

from __future__ import annotations

import pytest

from tandem.server.errors import RequestError, invalid_body
from tandem.server.requests import parse_chat, parse_completion

HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def completion_error(**body) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_completion({"prompt": "x", **body}, vocab_size=400)
    return e.value


def chat_error(**body) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_chat({"messages": HI, **body})
    return e.value


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", "2"),
        ("n", 2.0),
        ("n", True),
        ("max_tokens", 1.5),
        ("seed", False),
        ("stream", 0),
        ("echo", ""),
        ("temperature", "1"),
        ("temperature", True),
        ("temperature", float("nan")),
        ("top_p", float("inf")),
        ("top_logprobs", False),
        ("user", ["a"]),
    ],
)
def test_values_of_the_wrong_json_type_are_refused_naming_the_field(field, value):
    e = completion_error(**{field: value})
    assert e.status == 400 and e.param == field and str(e).startswith(f"{field}: ")


def test_integers_may_stand_for_numbers():
    assert parse_completion({"prompt": "x", "temperature": 1}, 400).sampling["temperature"] == 1.0


@pytest.mark.parametrize(
    "body, param",
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
        ({"tools": [{**TOOL, "function": {"name": "f", "x": 1}}]}, "tools[0].function.x"),
        ({"tools": [{**TOOL, "x": 1}]}, "tools[0].x"),
        ({"messages": [{"role": "user", "content": "x", "x": 1}]}, "messages[0].x"),
        ({"response_format": {"type": "text", "x": 1}}, "response_format.x"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
            "response_format.json_schema.x",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "x": 1}}]}
                ]
            },
            "messages[0].tool_calls[0].function.x",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
            "messages[0].content[0].x",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages[0].tool_call_id",
        ),
    ],
)
def test_unknown_fields_are_refused_at_every_level(body, param):
    assert chat_error(**body).param == param


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "must be one of"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "must be one of"),
        ({"messages": [*HI, {"role": "user", "content": 5}]}, "messages[1].content", "text parts"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
            "'text'",
        ),
        ({"messages": [{"role": "assistant"}]}, "messages[0].content", "no tool_calls"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": 5}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
            "JSON",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"tools": [TOOL], "tool_choice": "maybe"}, "tool_choice", "'required'"),
        ({"tools": [TOOL], "tool_choice": 3}, "tool_choice", "none, auto, required"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
        ({"guided_json": 5}, "guided_json", "JSON schema"),
    ],
)
def test_an_error_names_one_member_of_a_union(body, param, message):
    e = chat_error(**body)
    assert e.param == param and message in str(e), str(e)


@pytest.mark.parametrize(
    "field, neutral, other",
    [("top_logprobs", 0, 3), ("tools", [], [TOOL]), ("tool_choice", "none", "auto")],
)
def test_chat_fields_on_completions_take_only_their_neutral_value(field, neutral, other):
    parse_completion({"prompt": "x", field: neutral}, vocab_size=400)
    e = completion_error(**{field: other})
    assert e.param == field and "not supported here" in str(e)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
        ({"max_tokens": 0, "echo": True, "best_of": 2}, "best_of"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"max_tokens": 3, "min_tokens": 5}, "min_tokens"),
        ({"guided_regex": "a", "min_tokens": 1}, "min_tokens"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [5, 6], "suffix": "x"}, "suffix"),
        ({"prompt": [5, 400]}, "prompt"),
        ({"response_format": {"type": "regex", "regex": "a["}}, "response_format.regex"),
        ({"guided_json": "{not json"}, "guided_json"),
    ],
)
def test_completion_rules_across_fields_name_the_field(body, param):
    assert completion_error(**body).param == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"tools": [TOOL, TOOL]}, "tools"),
        ({"max_completion_tokens": 2, "min_tokens": 3, "max_tokens": 9}, "min_tokens"),
    ],
)
def test_chat_rules_across_fields_name_the_field(body, param):
    assert chat_error(**body).param == param


def test_score_only_and_echo_logprobs_become_the_engines_parameters():
    req = parse_completion(
        {"prompt": [5, 6], "max_tokens": 0, "echo": True, "logprobs": 2}, vocab_size=400
    )
    assert req.score_only and req.max_tokens == 1 and req.prompts == [[5, 6]]
    assert req.sampling == {"logprobs": 2, "prompt_logprobs": 2}


def test_max_completion_tokens_supersedes_max_tokens():
    req = parse_chat({"messages": HI, "max_completion_tokens": 7, "max_tokens": 3})
    assert req.max_tokens == 7


def test_messages_reach_the_template_as_strings_with_parsed_tool_calls():
    req = parse_chat(
        {
            "messages": [
                {"role": "developer", "content": "terse", "name": "ops"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "ls", "arguments": '{"d": 1}'},
                        },
                        {"function": {"name": "pwd"}},
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
            ],
            "tools": [TOOL],
            "tool_choice": "none",
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert req.messages == [
        {"role": "developer", "name": "ops", "content": "terse"},
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "tool_calls": [
                {"type": "function", "function": {"name": "ls", "arguments": {"d": 1}}, "id": "c1"},
                {"type": "function", "function": {"name": "pwd", "arguments": {}}},
            ],
            "content": "",
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    ]
    assert req.template_kwargs == {"enable_thinking": False}  # none: no tools in the prompt
    assert req.tools is not None and req.tools.tools == [TOOL] and req.tools.choice == "none"


def test_a_fastapi_error_location_becomes_a_path():
    errors = [
        {
            "type": "missing",
            "loc": ("body", "messages", 2, "AssistantMessage", "tool_calls", 0, "function"),
            "msg": "Field required",
        }
    ]
    e = invalid_body(errors)
    assert e.param == "messages[2].tool_calls[0].function"
    assert str(e) == "messages[2].tool_calls[0].function: Field required"


def test_malformed_json_and_a_body_that_is_no_object_are_400s_without_a_field():
    e = invalid_body(
        [
            {
                "type": "json_invalid",
                "loc": ("body", 1),
                "msg": "",
                "ctx": {"error": "Expecting value"},
            }
        ]
    )
    assert e.param is None and str(e) == "malformed JSON: Expecting value (at character 1)"
    e = invalid_body(
        [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be"}]
    )
    assert e.param is None and str(e).startswith("request body must be a JSON object")
