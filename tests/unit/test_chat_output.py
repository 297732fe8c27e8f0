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
    assert [d["function"]["name"] for d in deltas] == names


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
