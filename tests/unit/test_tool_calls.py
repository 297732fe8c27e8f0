"""Tool calls parsed from model output (whole and streamed), format detection, tool_choice
schemas and tools validation."""

from __future__ import annotations

import json
import random

import pytest

from tandem.server.tool_calls import (
    FORMATS,
    MAX_TOOLS,
    CallStart,
    ToolCall,
    ToolCallStreamer,
    calls_from_required,
    detect_format,
    make_call_id,
    named_schema,
    parse_tool_calls,
    required_schema,
    to_openai,
    to_openai_delta,
    validate_tools,
)


def random_split(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice((0, 1, 1, 2, 3, 4, 7, 16))  # empty deltas too
        pieces.append(text[i : i + n])
        i += n
    return pieces


def stream(fmt: str, pieces: list[str]) -> list:
    streamer = ToolCallStreamer(fmt)
    events = [e for p in pieces for e in streamer.feed(p)]
    return events + streamer.finish()


def joined(events: list) -> tuple[str, list[ToolCall]]:
    content = "".join(v for k, v in events if k == "content")
    return content, [v for k, v in events if k == "tool_call"]


def args(call: ToolCall) -> object:
    return json.loads(call.arguments)


def hermes(name: str, arguments: object) -> str:
    body = {"name": name, "arguments": arguments}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


# --- hermes ------------------------------------------------------------------------------


def test_hermes_single_call():
    content, calls = parse_tool_calls(hermes("get_weather", {"city": "Paris"}), "hermes")
    assert content == ""
    assert calls == [ToolCall("get_weather", '{"city": "Paris"}')]


def test_hermes_content_before_and_several_calls():
    text = (
        "Let me check both.\n\n"
        + hermes("get_weather", {"city": "Paris"})
        + "\n"
        + hermes("get_time", {"tz": "CET"})
    )
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me check both."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert [args(c) for c in calls] == [{"city": "Paris"}, {"tz": "CET"}]


def test_hermes_nested_arguments_with_braces_and_closing_tag_inside_strings():
    arguments = {
        "code": 'if (x) { return "}"; } // </tool_call> <tool_call>',
        "nested": {"list": [1, {"deep": [True, None]}], "s": "{{}}"},
    }
    text = hermes("run", arguments) + "\nafter"
    content, calls = parse_tool_calls(text, "hermes")
    assert calls == [ToolCall("run", json.dumps(arguments, ensure_ascii=False))]
    assert content == "after"


def test_hermes_unicode_is_kept_unescaped():
    content, calls = parse_tool_calls(
        "Voilà " + hermes("traduire", {"mot": "été ☀️ 東京"}), "hermes"
    )
    assert content == "Voilà"
    assert calls[0].arguments == '{"mot": "été ☀️ 東京"}'


def test_hermes_compact_block_and_arguments_as_json_string():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_calls(text, "hermes") == ("", [ToolCall("f", '{"a": 1}')])


def test_hermes_arguments_string_that_is_not_json_stays_content():
    text = '<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>'
    assert parse_tool_calls(text, "hermes") == (text, [])


def test_hermes_missing_arguments_means_empty_object():
    assert parse_tool_calls('<tool_call>{"name": "ping"}</tool_call>', "hermes") == (
        "",
        [ToolCall("ping", "{}")],
    )


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>\n{"name": "f", \'arguments\': {}}\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        "<tool_call>\nnot json at all\n</tool_call>",
        "<tool_call></tool_call>",
        '<tool_call>["f", {}]</tool_call>',
    ],
)
def test_hermes_malformed_block_stays_content_and_later_calls_still_parse(block: str):
    text = "Hi " + block + " " + hermes("g", {"x": 1})
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Hi " + block
    assert calls == [ToolCall("g", '{"x": 1}')]


def test_hermes_unclosed_final_block_parses_if_its_json_is_valid():
    text = 'ok\n<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n'
    assert parse_tool_calls(text, "hermes") == ("ok", [ToolCall("f", '{"a": [1, 2]}')])
    # cut inside the closing tag
    assert parse_tool_calls(text + "</tool_", "hermes")[1] == [ToolCall("f", '{"a": [1, 2]}')]


def test_hermes_call_stands_once_its_header_matched_even_if_cut_short_or_followed_by_junk():
    # Arguments stream as they are generated, so a call cannot turn back into content: cut
    # short (max_tokens), its arguments are what was generated, as OpenAI passes them on.
    text = 'ok\n<tool_call>\n{"name": "f", "arguments": {"a": 1'
    assert parse_tool_calls(text, "hermes") == ("ok", [ToolCall("f", '{"a": 1')])
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {}} trailing\n</tool_call>'
    assert parse_tool_calls(text, "hermes") == ("Hi  trailing\n</tool_call>", [ToolCall("f", "{}")])
    assert parse_tool_calls("<tool_call>", "hermes") == ("<tool_call>", [])


def test_empty_and_plain_outputs_for_every_format():
    for fmt in FORMATS:
        assert parse_tool_calls("", fmt) == ("", [])
        assert parse_tool_calls("  \n", fmt) == ("", [])
        assert parse_tool_calls("  Plain answer.\n", fmt) == ("Plain answer.", [])


def test_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="unknown tool call format"):
        parse_tool_calls("x", "pythonic")
    with pytest.raises(ValueError, match="unknown tool call format"):
        ToolCallStreamer("xml")


def test_hermes_arguments_stream_as_they_are_generated():
    streamer = ToolCallStreamer("hermes")
    assert streamer.feed("Checking") == [("content", "Checking")]
    assert streamer.feed(" now <tool") == [("content", " now")]
    assert streamer.feed('_call>{"name": "f", "argu') == []  # the header is not certain yet
    assert streamer.feed('ments": {"a": [1, ') == [
        ("call_start", CallStart("f")),
        ("call_args", '{"a": [1, '),
    ]
    assert streamer.feed('"}"]}') == [
        ("call_args", '"}"]}'),
        ("tool_call", ToolCall("f", '{"a": [1, "}"]}')),
    ]
    assert streamer.feed("}\n</tool_") == []
    assert streamer.feed("call>\n<tool_call>") == []
    assert streamer.finish() == [("content", " \n<tool_call>")]


def test_text_that_only_looks_like_an_opening_tag_is_released():
    streamer = ToolCallStreamer("hermes")
    assert streamer.feed("a <tool") == [("content", "a")]
    assert streamer.feed("box> b") == [("content", " <toolbox> b")]
    assert streamer.finish() == []


# --- llama3_json -------------------------------------------------------------------------


def test_llama3_single_call_with_and_without_python_tag():
    for prefix in ("", "<|python_tag|>", "\n <|python_tag|> "):
        text = prefix + '{"name": "get_weather", "parameters": {"city": "Zürich"}}'
        assert parse_tool_calls(text, "llama3_json") == (
            "",
            [ToolCall("get_weather", '{"city": "Zürich"}')],
        )


def test_llama3_arguments_key_and_several_calls_separated_by_semicolons():
    text = (
        '{"name": "a", "parameters": {"x": {"y": "}{"}}}; '
        '{"name": "b", "arguments": {}};{"name": "c", "parameters": {"n": [1]}}'
    )
    content, calls = parse_tool_calls(text, "llama3_json")
    assert content == ""
    assert [c.name for c in calls] == ["a", "b", "c"]
    assert [args(c) for c in calls] == [{"x": {"y": "}{"}}, {}, {"n": [1]}]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is nice.",
        'Sure: {"name": "f", "parameters": {}}',
        '{"name": "John", "age": 30}',  # a JSON answer, not a call
        "<|python_tag|>brave_search.call(query='x')",
        "{not json}",
    ],
)
def test_llama3_anything_else_is_all_content(text: str):
    assert parse_tool_calls(text, "llama3_json") == (text.strip(), [])


def test_llama3_call_after_its_header_then_anything_else_is_content():
    text = '{"name": "f", "parameters": {}} and some words'
    assert parse_tool_calls(text, "llama3_json") == ("and some words", [ToolCall("f", "{}")])
    text = '{"name": "f", "parameters": {}}; {"oops": 1}'
    assert parse_tool_calls(text, "llama3_json") == ('; {"oops": 1}', [ToolCall("f", "{}")])
    text = '{"name": "f", "parameters": {"a": 1'  # cut short: the arguments as generated
    assert parse_tool_calls(text, "llama3_json") == ("", [ToolCall("f", '{"a": 1')])
    # keys in another order do not stream: decided all-or-nothing at the end
    text = '{"parameters": {"a": 1}, "name": "f"}; {"name": "g", "parameters": {}}'
    assert parse_tool_calls(text, "llama3_json") == (
        "",
        [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")],
    )


def test_llama3_streamer_streams_calls_and_plain_text():
    streamer = ToolCallStreamer("llama3_json")
    assert streamer.feed(' {"name": "f", ') == []
    assert streamer.feed('"parameters": {}}') == [
        ("call_start", CallStart("f")),
        ("call_args", "{}"),
        ("tool_call", ToolCall("f", "{}")),
    ]
    assert streamer.finish() == []

    streamer = ToolCallStreamer("llama3_json")
    assert streamer.feed("<|python") == []
    assert streamer.feed("_tag|>") == []
    assert streamer.finish() == [("content", "<|python_tag|>")]

    streamer = ToolCallStreamer("llama3_json")
    assert streamer.feed("  ") == []
    assert streamer.feed("Hello") == [("content", "Hello")]
    assert streamer.feed(' {"name"') == [("content", ' {"name"')]


# --- mistral -----------------------------------------------------------------------------


def test_mistral_json_array_with_content_before():
    text = 'I will look.[TOOL_CALLS] [{"name": "a", "arguments": {"q": "ü"}}, {"name": "b"}]'
    assert parse_tool_calls(text, "mistral") == (
        "I will look.",
        [ToolCall("a", '{"q": "ü"}'), ToolCall("b", "{}")],
    )


def test_mistral_name_args_form_repeated_and_with_call_id():
    text = (
        '[TOOL_CALLS]search[ARGS]{"q": "a]b[ARGS]{", "n": {"m": 2}}'
        "[TOOL_CALLS]fetch[CALL_ID]a1b2c3d4e[ARGS]{}"
    )
    assert parse_tool_calls(text, "mistral") == (
        "",
        [ToolCall("search", '{"q": "a]b[ARGS]{", "n": {"m": 2}}'), ToolCall("fetch", "{}")],
    )


@pytest.mark.parametrize(
    "tail",
    [
        "[TOOL_CALLS]",
        '[TOOL_CALLS][{"arguments": {}}]',
        "[TOOL_CALLS][]",
        '[TOOL_CALLS]{"name": "a"}',
        "[TOOL_CALLS]two words[ARGS]{}",
        "[TOOL_CALLS]f[ARGS]not json",
        "[TOOL_CALLS]f",
    ],
)
def test_mistral_malformed_stays_content(tail: str):
    text = "Before. " + tail
    assert parse_tool_calls(text, "mistral") == (text, [])


def test_mistral_partial_marker_is_held_then_released():
    streamer = ToolCallStreamer("mistral")
    assert streamer.feed("x [TOOL_") == [("content", "x")]
    assert streamer.feed("CALLED]") == [("content", " [TOOL_CALLED]")]
    assert streamer.feed("[TOOL_CALLS]f[AR") == []
    assert streamer.feed('GS]{"a": [1,') == [
        ("call_start", CallStart("f")),
        ("call_args", '{"a": [1,'),
    ]
    assert streamer.finish() == [("tool_call", ToolCall("f", '{"a": [1,'))]  # cut short


def test_mistral_arguments_stream_and_model_call_ids_are_kept():
    streamer = ToolCallStreamer("mistral")
    assert joined(streamer.feed('[TOOL_CALLS][{"name": "f", "arguments": {}}')) == (
        "",
        [ToolCall("f", "{}")],
    )
    assert streamer.feed("]") == []
    events = streamer.feed('[TOOL_CALLS]g[CALL_ID]a1b2c3d4e[ARGS]{"b": {"c": 1}')
    assert events == [("call_start", CallStart("g", "a1b2c3d4e")), ("call_args", '{"b": {"c": 1}')]
    assert streamer.feed("}") == [
        ("call_args", "}"),
        ("tool_call", ToolCall("g", '{"b": {"c": 1}}')),
    ]
    assert streamer.finish() == []
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}'  # cut short after the arguments
    assert parse_tool_calls(text, "mistral") == ("", [ToolCall("a", "{}")])


# --- streaming equals parsing ------------------------------------------------------------

CORPUS = {
    "hermes": [
        "Let me check.\n\n" + hermes("get_weather", {"city": "Paris", "unit": "°C"}),
        hermes("a", {"s": "</tool_call>{]"}) + "\n" + hermes("b", {}) + "\nDone.",
        "no calls at all, just < and <tool and </tool_call> text",
        'Hi <tool_call>{"name": "f", "arguments": {}} x </tool_call> <tool_call>{"name": "g"}',
        '<tool_call>\n{"name": "f", "arguments": {"a": "\\u00e9\\"}"}}',
        "<tool_call>\n{broken\n</tool_call>\n\n" + hermes("ok", {"n": 1}) + "  tail  ",
        '<tool_call>{"name": "f", "arguments": {}}</tool_',
        "<tool_call>\n",
        "<<tool_call>tool_call>",
        "  \n " + hermes("日本", {"キー": "値 ✓"}),
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "f", "parameters": {"a": "}"}}',
        ' {"name": "f", "parameters": {}}; {"name": "g", "arguments": {"b": [1, 2]}}',
        "Plain answer { with braces }",
        '{"name": "f", "parameters": {}} trailing words',
        "<|python_",
        "  ",
        '<|python_tag|>{"name": "f", "parameters": ',
    ],
    "mistral": [
        'Sure.[TOOL_CALLS][{"name": "a", "arguments": {"x": "[TOOL_CALLS]"}}]',
        '[TOOL_CALLS]a[ARGS]{"x": {"y": 1}}[TOOL_CALLS]b[ARGS]{}',
        "[TOOL_CALLS] nonsense [TOOL_CALLS]f[ARGS]{} after",
        "text with [TOOL_ and [ARGS] but no calls",
        '[TOOL_CALLS]f[CALL_ID]123456789[ARGS]{"q": "été"}\n',
        '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": 5}] tail',
        "[TOOL_CALLS]f[ARGS]",
    ],
}


@pytest.mark.parametrize(
    ("fmt", "text"), [(fmt, text) for fmt, texts in CORPUS.items() for text in texts]
)
def test_streaming_equals_parsing_for_random_splits(fmt: str, text: str):
    expected = parse_tool_calls(text, fmt)
    rng = random.Random(f"{fmt}|{text}")  # str seeds are stable across runs
    for _ in range(80):
        pieces = random_split(text, rng)
        assert "".join(pieces) == text
        assert joined(stream(fmt, pieces)) == expected


def test_streamed_content_matches_exactly_and_never_starts_or_ends_with_whitespace():
    text = "  \n" + hermes("f", {}) + "\n\nSome words.\n\n" + hermes("g", {}) + "\n"
    rng = random.Random(3)
    for _ in range(50):
        events = stream("hermes", random_split(text, rng))
        content = [v for k, v in events if k == "content"]
        assert "".join(content) == "Some words."
        kinds = [k for k, _ in events if k in ("content", "tool_call")]
        assert kinds == ["tool_call"] + ["content"] * len(content) + ["tool_call"]


def test_random_markup_soup_never_raises_and_stream_matches():
    parts = [
        "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}",
        "[", "]", '"name"', ": ", '"f"', ", ", '"arguments"', '"parameters"', ";", " ", "\n",
        "x", "é", '"', "\\",
    ]  # fmt: skip
    rng = random.Random(11)
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 25)))
        for fmt in FORMATS:
            expected = parse_tool_calls(text, fmt)
            assert joined(stream(fmt, random_split(text, rng))) == expected


def test_finish_is_final():
    streamer = ToolCallStreamer("hermes")
    assert streamer.feed("hi") == [("content", "hi")]
    assert streamer.finish() == []
    assert streamer.finish() == []
    with pytest.raises(RuntimeError):
        streamer.feed("more")


# --- OpenAI shapes -----------------------------------------------------------------------


def test_openai_shapes():
    call = ToolCall("f", '{"a": 1}')
    function = {"name": "f", "arguments": '{"a": 1}'}
    assert to_openai(call, "call_x") == {
        "id": "call_x",
        "type": "function",
        "function": function,
    }
    assert to_openai_delta(call, 2, "call_y") == {
        "index": 2,
        "id": "call_y",
        "type": "function",
        "function": function,
    }


def test_call_ids_are_unique_and_openai_like():
    ids = {make_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)


# --- detect_format -----------------------------------------------------------------------

QWEN_TEMPLATE = (
    "{%- if tools %}\n# Tools\n\nYou may call one or more functions...\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call>"
    ' XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
LLAMA31_TEMPLATE = (
    '{{- "Environment: ipython\\n" }}{{- "Given the following functions, please respond with '
    "a JSON for a function call with its proper arguments that best answers the given prompt."
    '\\n\\n" }}{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.' }}{{- '<|python_tag|>' + tool_call.name }}"
)
LLAMA32_NO_PYTHON_TAG = (
    "Given the following functions, please respond with a JSON for a function call with its "
    'proper arguments... Respond in the format {"name": function name, "parameters": ...}'
)
MISTRAL_TEMPLATE = (
    '{%- if message.tool_calls %}{{- "[TOOL_CALLS][" }}{%- for tool_call in message.tool_calls '
    "%}{{- tool_call | tojson }}{%- endfor %}{{- ']' + eos_token }}"
)
CHATML_PLAIN = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"


def test_detect_format_from_templates():
    assert detect_format(QWEN_TEMPLATE) == "hermes"
    assert detect_format(LLAMA31_TEMPLATE) == "llama3_json"
    assert detect_format(LLAMA32_NO_PYTHON_TAG) == "llama3_json"
    assert detect_format("{{- '<|start_header_id|>ipython<|end_header_id|>' }}") == "llama3_json"
    assert detect_format(MISTRAL_TEMPLATE) == "mistral"
    # the template outranks the model type (Hermes fine-tunes of Llama)
    assert detect_format(QWEN_TEMPLATE, "llama") == "hermes"


def test_detect_format_falls_back_to_model_type():
    assert detect_format(CHATML_PLAIN, "qwen3_moe") == "hermes"
    assert detect_format(None, "Qwen2") == "hermes"
    assert detect_format(None, "llama") == "llama3_json"
    assert detect_format("", "mistral") == "mistral"
    assert detect_format(None, "mixtral") == "mistral"
    assert detect_format(CHATML_PLAIN, "gemma3") is None
    assert detect_format(None) is None


# --- tool_choice schemas -----------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}


def test_required_schema_is_an_array_of_one_choice_per_tool():
    schema = required_schema([WEATHER, PING])
    assert schema["type"] == "array" and schema["minItems"] == 1
    choices = schema["items"]["anyOf"]
    assert [c["properties"]["name"] for c in choices] == [
        {"const": "get_weather"},
        {"const": "ping"},
    ]
    assert choices[0]["properties"]["parameters"] == {"$ref": "#/$defs/tool_0"}
    assert schema["$defs"]["tool_0"] == WEATHER["function"]["parameters"]
    assert schema["$defs"]["tool_1"] == {"type": "object"}
    for choice in choices:
        assert choice["required"] == ["name", "parameters"]
        assert choice["additionalProperties"] is False
        assert choice["type"] == "object"
    with pytest.raises(ValueError, match="at least one tool"):
        required_schema([])


def test_required_schema_keeps_references_resolving():
    """A Pydantic-style tool ($ref into its own $defs) nested in the required wrapper."""
    import jsonschema

    ship = {
        "type": "function",
        "function": {
            "name": "ship",
            "parameters": {
                "type": "object",
                "properties": {"addr": {"$ref": "#/$defs/Addr"}},
                "required": ["addr"],
                "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}}}},
            },
        },
    }
    schema = required_schema([WEATHER, ship])
    assert schema["$defs"]["tool_1"]["properties"]["addr"] == {"$ref": "#/$defs/tool_1/$defs/Addr"}
    jsonschema.validate([{"name": "ship", "parameters": {"addr": {"city": "Oslo"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ship", "parameters": {"addr": {"city": 5}}}], schema)


def test_named_schema_is_that_tools_parameters():
    assert named_schema([WEATHER, PING], "get_weather") == WEATHER["function"]["parameters"]
    assert named_schema([WEATHER, PING], "ping") == {"type": "object"}
    with pytest.raises(ValueError, match="'nope'"):
        named_schema([WEATHER, PING], "nope")


def test_calls_from_required_output():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "ping", '
    text += '"parameters": {}}]'
    assert calls_from_required(text) == [
        ToolCall("get_weather", '{"city": "Oslo"}'),
        ToolCall("ping", "{}"),
    ]
    assert calls_from_required('[{"name": "ping", "parameters": {}') == []  # cut short
    assert calls_from_required('{"name": "ping", "parameters": {}}') == []
    assert calls_from_required('[{"name": "ping"}]') == []


def test_named_call_streams_its_arguments_as_generated():
    """Under a named tool_choice the whole output is the arguments: streamed as fragments
    from the first piece, joining to the whole message's arguments (whitespace around them
    dropped), also when cut short."""
    import random

    from tandem.server.chat_output import ChatOutput
    from tandem.server.guided import ToolMode

    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    for text in (' {"city": "Kyiv 🌻",  "days": [1, 2]} \n', '{"city": "Ky'):
        whole = ChatOutput(tools=ToolMode(tools, "function", "get_weather")).message(text)
        (call,) = whole["tool_calls"]
        assert call["function"]["arguments"] == text.strip()
        rng = random.Random(0)
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), 5))
            pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            out = ChatOutput(tools=ToolMode(tools, "function", "get_weather"))
            deltas = [out.feed(p) for p in pieces] + [out.finish()]
            entries = [e for d in deltas for e in d.get("tool_calls", [])]
            assert entries[0]["id"] == out.calls[0][1] and entries[0]["function"]["name"]
            joined = "".join(e["function"]["arguments"] for e in entries)
            assert joined == text.strip() and not any("content" in d for d in deltas)
            assert any(d.get("tool_calls") for d in deltas[:-1])  # before the end


# --- validate_tools ----------------------------------------------------------------------


def test_validate_tools_accepts_well_formed_tools():
    tools = [WEATHER, PING, {"type": "function", "function": {"name": "n", "parameters": None}}]
    assert validate_tools(tools) == tools
    assert validate_tools([]) == []


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ({"type": "function"}, "tools must be an array"),
        ([WEATHER, "ping"], r"tools\[1\] must be an object"),
        ([{"type": "retrieval"}], r"tools\[0\]\.type must be 'function'"),
        ([{"type": "function"}], r"tools\[0\]\.function must be an object"),
        ([{"type": "function", "function": {}}], r"tools\[0\]\.function\.name"),
        ([{"type": "function", "function": {"name": 7}}], r"tools\[0\]\.function\.name"),
        ([{"type": "function", "function": {"name": ""}}], r"tools\[0\]\.function\.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            r"tools\[0\]\.function\.parameters must be an object",
        ),
        (
            [{"type": "function", "function": {"name": "f", "description": 1}}],
            r"description must be a string",
        ),
        ([PING, PING], r"tools\[1\]\.function\.name 'ping' is used by an earlier tool"),
    ],
)
def test_validate_tools_rejects_malformed_tools(tools: object, message: str):
    with pytest.raises(ValueError, match=message):
        validate_tools(tools)


def test_validate_tools_limits_the_count():
    tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(MAX_TOOLS + 1)]
    assert len(validate_tools(tools[:MAX_TOOLS])) == MAX_TOOLS
    with pytest.raises(ValueError, match=f"at most {MAX_TOOLS}"):
        validate_tools(tools)
