"""The formats beyond Hermes / Llama 3 / Mistral (Qwen3-Coder XML, gpt-oss harmony, DeepSeek
V3 and V3.1, Kimi K2, GLM-4.5, MiniMax-M2): whole and streamed, with arguments streamed as
fragments; and for every format, streaming equals parsing over random splits."""

from __future__ import annotations

import json
import random

import pytest

from tandem.server.tool_calls import (
    FORMATS,
    ToolCall,
    ToolCallStreamer,
    detect_format,
    keeps_special_tokens,
    parse_output,
    parse_tool_calls,
)
from tandem.testing.tool_call_texts import (
    deepseek_v3,
    deepseek_v31,
    glm45,
    harmony_call,
    kimi,
    minimax,
    qwen3_coder,
    render,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "hot": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "code": {"type": "string"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


NEW = ("qwen3_coder", "harmony", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "minimax_m2")
XML = ("qwen3_coder", "glm45", "minimax_m2")


def args(call: ToolCall) -> object:
    return json.loads(call.arguments)


@pytest.mark.parametrize("fmt", NEW)
def test_single_call(fmt: str):
    content, calls = parse_tool_calls(render(fmt, ("get_weather", {"city": "Paris"})), fmt, TOOLS)
    assert content == ""
    assert [(c.name, args(c)) for c in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("fmt", NEW)
def test_two_calls_in_order(fmt: str):
    text = render(fmt, ("get_weather", {"city": "Oslo"}), ("get_time", {}))
    content, calls = parse_tool_calls(text, fmt, TOOLS)
    assert content == ""
    assert [(c.name, args(c)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]


@pytest.mark.parametrize("fmt", [f for f in NEW if f != "harmony"])
def test_call_after_text(fmt: str):
    text = "Let me check.\n\n" + render(fmt, ("get_time", {}))
    assert parse_tool_calls(text, fmt, TOOLS) == ("Let me check.", [ToolCall("get_time", "{}")])


@pytest.mark.parametrize("fmt", NEW)
def test_unicode_in_arguments_is_kept_unescaped(fmt: str):
    text = render(fmt, ("get_weather", {"city": "東京 été ☀️"}))
    (call,) = parse_tool_calls(text, fmt, TOOLS)[1]
    assert "東京 été ☀️" in call.arguments and args(call) == {"city": "東京 été ☀️"}


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("qwen3_coder", "<tool_call>\nnot a function\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\n<function=two words>\n</function>\n</tool_call>"),
        ("glm45", '<tool_call>{"name": "f"}</tool_call>'),
        ("minimax_m2", "<minimax:tool_call>\n<call f>\n</minimax:tool_call>"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜>nonsense<｜tool▁calls▁end｜>"),
        ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>not json"),
        ("kimi_k2", "<|tool_calls_section_begin|>just words<|tool_calls_section_end|>"),
        ("harmony", "<|channel|>final no message marker"),
    ],
)
def test_malformed_markup_stays_content(fmt: str, text: str):
    assert parse_tool_calls("Before. " + text, fmt, TOOLS) == ("Before. " + text, [])


@pytest.mark.parametrize("fmt", XML)
def test_xml_parameters_are_typed_by_the_tools_schema(fmt: str):
    given = {
        "city": "42",  # a string parameter stays a string, even when it looks like JSON
        "days": 3,
        "ratio": 0.5,
        "hot": True,
        "opts": {"unit": "C", "n": [1, 2]},
        "tags": ["a", "b"],
        "code": "if (a < b) {\n  return 'x';\n}",
        "extra": "not in the schema",
    }
    (call,) = parse_tool_calls(render(fmt, ("get_weather", given)), fmt, TOOLS)[1]
    assert args(call) == given
    assert call.arguments == json.dumps(given, ensure_ascii=False)
    # without the tools every value is a string
    (untyped,) = parse_tool_calls(render(fmt, ("get_weather", {"days": 3})), fmt)[1]
    assert args(untyped) == {"days": "3"}


@pytest.mark.parametrize("fmt", XML)
def test_xml_typed_value_that_does_not_parse_stays_a_string(fmt: str):
    (call,) = parse_tool_calls(render(fmt, ("get_weather", {"days": "three"})), fmt, TOOLS)[1]
    assert args(call) == {"days": "three"}


def test_qwen3_coder_value_without_closing_tag_and_cut_short():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n"
    (call,) = parse_tool_calls(text, "qwen3_coder", TOOLS)[1]
    assert args(call) == {"city": "Paris", "days": 2}  # cut short: closed with what came


def test_harmony_channels_become_reasoning_content_and_calls():
    text = (
        "<|channel|>analysis<|message|>The user wants weather.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny."
    )
    assert parse_output(text, "harmony") == ("It is sunny.", "The user wants weather.", [])
    # the recipient may also sit in the role part; the call's end is a stop token (not text)
    text = (
        "<|channel|>analysis<|message|>Need a tool.<|end|>"
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": 1}'
    )
    assert parse_output(text, "harmony") == (
        "",
        "Need a tool.",
        [ToolCall("get_time", '{"tz": 1}')],
    )
    # text that is not harmony at all is content
    assert parse_output("plain words", "harmony") == ("plain words", "", [])


def test_kimi_k2_keeps_the_models_call_ids():
    streamer = ToolCallStreamer("kimi_k2")
    events = streamer.feed(kimi(("get_time", {}), ("get_weather", {"city": "Rome"})))
    starts = [v for k, v in events if k == "call_start"]
    assert [(s.name, s.id) for s in starts] == [
        ("get_time", "functions.get_time:0"),
        ("get_weather", "functions.get_weather:1"),
    ]


def test_deepseek_formats_each_parse_both_call_forms():
    v3, v31 = deepseek_v3(("get_time", {})), deepseek_v31(("get_time", {}))
    for fmt in ("deepseek_v3", "deepseek_v31"):
        assert (
            parse_tool_calls(v3, fmt)
            == parse_tool_calls(v31, fmt)
            == ("", [ToolCall("get_time", "{}")])
        )


def test_json_arguments_are_the_raw_generated_text():
    raw = '{"city":  "Paris",\n "days":3}'
    text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    text += raw + "<｜tool▁call▁end｜>"
    assert parse_tool_calls(text, "deepseek_v31")[1] == [ToolCall("get_weather", raw)]


# --- streaming equals parsing, fragments included -----------------------------------------

CORPUS = {
    "hermes": [
        'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "n": [1, '
        '{"a": "}"}]}}\n'
        '</tool_call>\n<tool_call>{"arguments": {}, "name": "get_time"}</tool_call> done',
        '<tool_call>{"name": "f", "arguments": {"s": "\\\\\\"}{"}}',
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "f", "parameters": {"a": "}"}}; {"name": "g", "parameters": {}}',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": [1, 2]}}, {"name": "b"}, '
        '{"name": "c", "arguments": {"y": "]"}}] after',
    ],
    "qwen3_coder": [
        "Sure.\n"
        + qwen3_coder("get_weather", {"city": "Paris", "days": 3, "opts": {"u": "C"}})
        + "\n"
        + qwen3_coder("get_time", {}),
        "<tool_call>\n<function=get_weather>\n<parameter=code>\na </parameter b\n</parameter>\n",
    ],
    "harmony": [
        "<|channel|>analysis<|message|>think <| hard<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>Checking…<|end|>" + harmony_call("get_weather", {"city": "Köln"}),
        "<|channel|>analysis<|message|>cut short",
    ],
    "deepseek_v3": [
        "Ok.\n" + deepseek_v3(("get_weather", {"city": "Lyon"}), ("get_time", {})) + " bye"
    ],
    "deepseek_v31": [deepseek_v31(("get_weather", {"city": "Nice"}), ("get_time", {}))],
    "kimi_k2": ["x " + kimi(("get_weather", {"city": "Kyiv 🌻"}), ("get_time", {}))],
    "glm45": [glm45("get_weather", {"city": "Bern", "hot": False}) + glm45("get_time", {})],
    "minimax_m2": [
        "Let me see. "
        + minimax(("get_weather", {"city": "Porto", "tags": ["x"]}), ("get_time", {}))
    ],
}


def random_split(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice((0, 1, 1, 2, 3, 4, 7, 16))
        pieces.append(text[i : i + n])
        i += n
    return pieces


def streamed(fmt: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]], list[ToolCall]]:
    """Joined content, joined reasoning, (name, joined fragments) per call, the ended calls."""
    streamer = ToolCallStreamer(fmt, TOOLS)
    events = [e for p in pieces for e in streamer.feed(p)] + streamer.finish()
    calls: list[list[str]] = []
    for kind, value in events:
        if kind == "call_start":
            calls.append([value.name, ""])
        elif kind == "call_args":
            calls[-1][1] += value
    content = "".join(v for k, v in events if k == "content")
    reasoning = "".join(v for k, v in events if k == "reasoning")
    ended = [v for k, v in events if k == "tool_call"]
    return content, reasoning, [(n, a) for n, a in calls], ended


@pytest.mark.parametrize(
    ("fmt", "text"), [(fmt, text) for fmt, texts in CORPUS.items() for text in texts]
)
def test_streaming_equals_parsing_fragments_included(fmt: str, text: str):
    whole = parse_output(text, fmt, TOOLS)
    rng = random.Random(f"{fmt}|{text}")
    for _ in range(60):
        content, reasoning, calls, ended = streamed(fmt, random_split(text, rng))
        assert (content, reasoning) == (whole.content, whole.reasoning)
        assert calls == [(c.name, c.arguments) for c in whole.calls]
        assert ended == whole.calls


SOUP = [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[",
    "]", '"name"', ": ", '"f"', ", ", '"arguments"', ";", " ", "\n", "x", "é", '"', "\\",
    "<function=", "f>", "<parameter=", "city>", "</parameter>", "</function>", "<|channel|>",
    "analysis", "<|message|>", "<|end|>", "<|start|>", " to=functions.f", "<|constrain|>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "function", "<｜tool▁sep｜>", "```json",
    "<｜tool▁call▁end｜>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.f:0",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<arg_key>", "</arg_key>",
    "<arg_value>", "</arg_value>", "<minimax:tool_call>", '<invoke name="f">', "</invoke>",
    '<parameter name="days">', "3",
]  # fmt: skip


def test_random_markup_soup_never_raises_and_streams_as_it_parses():
    rng = random.Random(5)
    for _ in range(150):
        text = "".join(rng.choice(SOUP) for _ in range(rng.randint(0, 30)))
        for fmt in FORMATS:
            whole = parse_output(text, fmt, TOOLS)
            content, reasoning, calls, _ = streamed(fmt, random_split(text, rng))
            assert (content, reasoning) == (whole.content, whole.reasoning)
            assert calls == [(c.name, c.arguments) for c in whole.calls]


def test_xml_arguments_stream_as_parameters_complete():
    streamer = ToolCallStreamer("qwen3_coder", TOOLS)
    assert streamer.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa") == [
        ("call_start", ("get_weather", None))
    ]
    assert streamer.feed("ris\n</parameter>\n<parameter=days>\n") == [
        ("call_args", '{"city": "Paris"')
    ]
    assert streamer.feed("4\n</parameter>\n</function>") == [
        ("call_args", ', "days": 4}'),
        ("tool_call", ToolCall("get_weather", '{"city": "Paris", "days": 4}')),
    ]


# --- detection ----------------------------------------------------------------------------

TEMPLATES = {
    "qwen3_coder": (
        "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- for args_name, args_value "
        "in tool_call.arguments|items %}{{- '<parameter=' + args_name + '>\\n' }}"
    ),
    "harmony": '{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name + '
    '"<|channel|>commentary " }}',
    "deepseek_v3": "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments']}}",
    "deepseek_v31": "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + "
    "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}",
    "kimi_k2": "{{'<|tool_calls_section_begin|>'}}{%- for tool_call in message['tool_calls'] -%}"
    "<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>",
    "glm45": "<tool_call>{{ tc.name }}\n{% for _k, _v in _args.items() %}<arg_key>{{ _k }}"
    "</arg_key>\n<arg_value>{{ _v }}</arg_value>\n{% endfor %}</tool_call>",
    "minimax_m2": '{{- "<minimax:tool_call>\\n" }}{{- \'<invoke name="\' + tool_call.name + '
    "'\">\\n' }}",
}


@pytest.mark.parametrize("fmt", NEW)
def test_detect_format_from_template_snippets(fmt: str):
    assert detect_format(TEMPLATES[fmt]) == fmt
    assert detect_format(TEMPLATES[fmt], "llama") == fmt  # the template outranks the type


def test_detect_format_from_model_types_and_hermes_still_wins_for_plain_qwen():
    assert detect_format(None, "gpt_oss") == "harmony"
    assert detect_format(None, "kimi_k2") == "kimi_k2"
    assert detect_format(None, "deepseek_v3") == "deepseek_v3"
    assert detect_format(None, "glm4_moe") == "glm45"
    assert detect_format(None, "minimax_m2") == "minimax_m2"
    qwen = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    assert detect_format(qwen, "qwen3_moe") == "hermes"


def test_formats_whose_markers_are_special_tokens_keep_them():
    keep = {f for f in FORMATS if keeps_special_tokens(f)}
    assert keep == {"mistral", "harmony", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm45"} | {
        "minimax_m2"
    }
    assert not keeps_special_tokens(None)
