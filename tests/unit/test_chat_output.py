"""ChatOutput: what a chat choice's text becomes (tool calls, reasoning, forced calls)."""

from __future__ import annotations

import json

import pytest

from tandem.sampling_params import SamplingParams
from tandem.server.chat_output import ChatOutput
from tandem.server.guided import ToolMode, _lark_regex

TOOLS = [
    {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}},
]
TWO_CALLS = (
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
)


@pytest.mark.parametrize("parallel, names", [(True, ["a", "b"]), (False, ["a"])])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel, names):
    out = ChatOutput(tools=ToolMode(TOOLS, "auto", parallel=parallel), fmt="hermes")
    msg = out.message(TWO_CALLS)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == names
    streamed = ChatOutput(tools=ToolMode(TOOLS, "auto", parallel=parallel), fmt="hermes")
    deltas = []
    for i in range(0, len(TWO_CALLS), 7):
        deltas += streamed.feed(TWO_CALLS[i : i + 7]).get("tool_calls", [])
    deltas += streamed.finish().get("tool_calls", [])
    assert [d["function"]["name"] for d in deltas if "name" in d["function"]] == names
    assert {d["index"] for d in deltas} == set(range(len(names)))  # no fragment of a dropped call
    assert [(c.name, c.arguments) for c, _ in streamed.calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]
    ]


def test_forced_call_cut_short_returns_its_text():
    out = ChatOutput(tools=ToolMode(TOOLS, "required"))
    text = '[{"name": "a", "parameters": {"k": '
    msg = out.message(text)
    assert msg["content"] == text and "tool_calls" not in msg
    assert out.finish_reason("length") == "length"
    ok = ChatOutput(tools=ToolMode(TOOLS, "required"))
    msg = ok.message('[{"name": "b", "parameters": {"x": 1}}]')
    assert msg["content"] is None and json.loads(msg["tool_calls"][0]["function"]["arguments"])
    assert ok.finish_reason("stop") == "tool_calls"


def test_reasoning_then_content():
    out = ChatOutput(reasoning=True)
    msg = out.message("<think>hmm</think>\n\nyes")
    assert msg["reasoning_content"] == "hmm" and msg["content"] == "yes"


def test_min_tokens_cannot_combine_with_a_grammar():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=5, min_tokens=1, guided=("regex", "a"))


@pytest.mark.parametrize(
    "pattern, lark",
    [("a/b", "a\\/b"), ("a\\/b", "a\\/b"), ("a\\\\/b", "a\\\\\\/b"), ("[^/]+", "[^\\/]+")],
)
def test_regex_slashes_escaped_once_inside_lark(pattern, lark):
    assert _lark_regex(pattern) == lark


def test_engine_errors_map_to_the_right_status():
    from tandem.frontend.engine_client import Delta
    from tandem.server.app import engine_error as _engine_error

    def status(kind: str, dead: bool = False) -> int:
        return _engine_error(Delta([], "error", "x", error_kind=kind), dead=dead).status

    assert status("request") == 400
    assert status("resource") == 503
    assert status("internal") == 500
    assert status("request", dead=True) == 500


# --- streamed tool-call deltas ------------------------------------------------------------

STREAMED = {
    "hermes": "Checking.\n" + TWO_CALLS,
    "qwen3_coder": (
        "<tool_call>\n<function=a>\n<parameter=q>\nété\n</parameter>\n</function>\n</tool_call>"
        "\n<tool_call>\n<function=b>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>"
    ),
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>"
        '{"q": [1, 2]}<|tool_call_end|><|tool_call_begin|>functions.b:1'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
    ),
    "harmony": (
        "<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.a <|constrain|>json<|message|>{"q": "x"}'
    ),
}


def stream_deltas(out: ChatOutput, text: str, rng) -> list[dict]:
    chunks, i = [], 0
    while i < len(text):
        n = rng.choice((1, 2, 3, 5, 8, 13))
        chunks.append(out.feed(text[i : i + n]))
        i += n
    return [*chunks, out.finish()]


@pytest.mark.parametrize("fmt", sorted(STREAMED))
def test_streamed_tool_call_deltas_have_the_openai_shape_and_join_to_the_message(fmt):
    import random

    text = STREAMED[fmt]
    whole = ChatOutput(tools=ToolMode(TOOLS, "auto"), fmt=fmt).message(text)
    rng = random.Random(fmt)
    for _ in range(30):
        out = ChatOutput(tools=ToolMode(TOOLS, "auto"), fmt=fmt)
        chunks = stream_deltas(out, text, rng)
        entries = [e for c in chunks for e in c.get("tool_calls", [])]
        seen: dict[int, dict] = {}
        for e in entries:
            if e["index"] not in seen:  # the first entry of a call
                assert set(e) == {"index", "id", "type", "function"} and e["type"] == "function"
                assert set(e["function"]) == {"name", "arguments"}
                seen[e["index"]] = {"id": e["id"], **e["function"]}
            else:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                seen[e["index"]]["arguments"] += e["function"]["arguments"]
        assert sorted(seen) == list(range(len(seen)))
        got = [(v["name"], v["arguments"]) for _, v in sorted(seen.items())]
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
        assert got == want
        assert [v["id"] for _, v in sorted(seen.items())] == [cid for _, cid in out.calls]
        content = "".join(c.get("content", "") for c in chunks)
        assert content == (whole["content"] or "")
        reasoning = "".join(c.get("reasoning_content", "") for c in chunks)
        assert reasoning == (whole.get("reasoning_content") or "")
        assert out.finish_reason("stop") == "tool_calls"


def test_harmony_analysis_is_reasoning_content_and_kimi_ids_are_the_models():
    msg = ChatOutput(tools=ToolMode(TOOLS, "auto"), fmt="harmony").message(STREAMED["harmony"])
    assert msg["reasoning_content"] == "Think first." and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "a", "arguments": '{"q": "x"}'}
    msg = ChatOutput(tools=ToolMode(TOOLS, "auto"), fmt="kimi_k2").message(STREAMED["kimi_k2"])
    assert [c["id"] for c in msg["tool_calls"]] == ["functions.a:0", "functions.b:1"]


def test_xml_parameters_are_typed_by_the_requests_tools():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "b",
                "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
            },
        },
        TOOLS[0],
    ]
    msg = ChatOutput(tools=ToolMode(tools, "auto"), fmt="qwen3_coder").message(
        STREAMED["qwen3_coder"]
    )
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == ['{"q": "été"}', '{"n": 2}']


def test_text_after_a_calls_fragments_waits_for_the_next_delta():
    # Consumers (Anthropic, Responses) read a delta's content before its tool calls.
    out = ChatOutput(tools=ToolMode(TOOLS, "auto"), fmt="hermes")
    assert out.feed('<tool_call>\n{"name": "a", "arguments": {"k": ')["tool_calls"][0]["id"]
    first = out.feed('1}}\n</tool_call>\nDone <tool_call>\n{"name": "b", "arguments": {}')
    assert "content" not in first and first["tool_calls"] == [
        {"index": 0, "function": {"arguments": "1}"}}
    ]
    second = out.feed("}\n</tool_call>")
    assert second["content"] == "Done"
    assert [e["index"] for e in second["tool_calls"]] == [1]
    assert out.finish() == {}
