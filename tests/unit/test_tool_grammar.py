"""``strict`` tools under ``tool_choice: "auto"`` (server/guided.py, tool_calls/grammar.py): the
grammar lets the model write free text or calls in its format, and a strict tool's arguments
must follow its schema. Checked with llguidance on byte-level tokenizers whose markers are
single added tokens (as in the real models) or plain text."""

from __future__ import annotations

import functools
import json

import llguidance
import llguidance.hf
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tandem.engine.grammar import grammar_text
from tandem.server.errors import RequestError
from tandem.server.guided import ToolMode, parse_tools, strict_tool_grammar
from tandem.server.tool_calls import FORMATS, grammar_markers, parse_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # not strict: any object
TOOLS = [WEATHER, TIME]


@functools.cache
def tokenizer(markers: tuple[str, ...]) -> tuple[PreTrainedTokenizerFast, object]:
    """Bytes, plus each marker as one added token (special when it looks like a control
    token), wrapped for llguidance."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True, normalized=False)])
    for m in markers:
        special = m.startswith(("<|", "[")) or "▁" in m
        tok.add_tokens([AddedToken(m, special=special, normalized=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    return hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))


def strict_grammar(fmt: str, markers: bool = True, **kwargs) -> tuple[str, str]:
    hf, _ = tokenizer(grammar_markers(fmt) if markers else ())
    mode = ToolMode(TOOLS, "auto", parallel=kwargs.pop("parallel", True))
    grammar = strict_tool_grammar(
        mode, fmt, functools.partial(hf.encode, add_special_tokens=False), **kwargs
    )
    assert grammar is not None
    return grammar


def accepts(fmt: str, text: str, markers: bool = True, **kwargs) -> bool:
    hf, ll = tokenizer(grammar_markers(fmt) if markers else ())
    matcher = llguidance.LLMatcher(ll, grammar_text(*strict_grammar(fmt, markers, **kwargs)))
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in hf.encode(text, add_special_tokens=False)) and (
        matcher.is_accepting()
    )


def dumps(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def call(fmt: str, name: str, args: dict) -> str:
    """A call as the strict grammar for ``fmt`` writes it."""
    if fmt == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {dumps(args)}}}\n</tool_call>'
    if fmt == "llama3_json":
        return f'{{"name": "{name}", "parameters": {dumps(args)}}}'
    if fmt == "mistral":  # with an [ARGS] token
        return f"[TOOL_CALLS]{name}[ARGS]{dumps(args)}"
    if fmt == "harmony":
        return (
            "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
            f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{dumps(args)}"
        )
    if fmt == "deepseek_v3":
        return (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            f"{name}\n```json\n{dumps(args)}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        )
    if fmt == "deepseek_v31":
        return (
            f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{dumps(args)}"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        )
    if fmt == "kimi_k2":
        return (
            f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0"
            f"<|tool_call_argument_begin|>{dumps(args)}<|tool_call_end|><|tool_calls_section_end|>"
        )
    value = {k: v if isinstance(v, str) else json.dumps(v) for k, v in args.items()}
    if fmt == "qwen3_coder":
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in value.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if fmt == "glm45":
        pairs = "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in value.items()
        )
        return f"<tool_call>{name}\n{pairs}</tool_call>"
    assert fmt == "minimax_m2"
    params = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in value.items())
    return f'<minimax:tool_call>\n<invoke name="{name}">\n{params}</invoke>\n</minimax:tool_call>'


GOOD = {"city": "Paris été", "days": 3}
BAD = {"city": "Paris", "days": "three"}  # days must be an integer


@pytest.mark.parametrize("fmt", FORMATS)
def test_strict_tool_calls_follow_the_schema_and_text_stays_free(fmt: str):
    good = call(fmt, "get_weather", GOOD)
    assert accepts(fmt, good)
    assert not accepts(fmt, call(fmt, "get_weather", BAD))
    assert not accepts(fmt, call(fmt, "get_weather", {"city": "Paris"}))  # days is required
    assert not accepts(fmt, call(fmt, "no_such_tool", {}))
    assert accepts(fmt, call(fmt, "get_time", {"anything": "goes"}))  # not strict
    if fmt == "harmony":
        assert accepts(fmt, "<|channel|>final<|message|>The weather is nice.")
    else:
        assert accepts(fmt, "The weather is nice.")
        assert accepts(fmt, "")
    # what the grammar lets through parses back to the call
    calls = parse_tool_calls(good, fmt, TOOLS)[1]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", GOOD)]


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "glm45", "minimax_m2", "deepseek_v31"])
def test_text_around_calls_and_parallel_tool_calls(fmt: str):
    good = call(fmt, "get_weather", GOOD)
    assert accepts(fmt, f"Let me check.\n{good}\n{good}")
    assert not accepts(fmt, f"Let me check.\n{good}\n{good}", parallel=False)
    assert accepts(fmt, f"Let me check.\n{good}", parallel=False)


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "glm45", "minimax_m2", "kimi_k2"])
def test_markers_that_are_plain_text_work_too(fmt: str):
    good = call(fmt, "get_weather", GOOD)
    assert accepts(fmt, "Hi " + good, markers=False)
    assert not accepts(fmt, "Hi " + call(fmt, "get_weather", BAD), markers=False)


def test_mistral_without_an_args_token_writes_the_json_array():
    text = f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {dumps(GOOD)}}}]'
    assert accepts("mistral", text, markers=False)
    bad = f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {dumps(BAD)}}}]'
    assert not accepts("mistral", bad, markers=False)


def test_a_think_block_stays_free_before_the_constrained_output():
    good = call("hermes", "get_weather", GOOD)
    think = "<think>I could call <tool_call> here.</think>\n"
    assert accepts("hermes", think + good, reasoning=True)
    assert not accepts("hermes", think + call("hermes", "get_weather", BAD), reasoning=True)
    assert accepts("hermes", "thinking...</think>" + good, reasoning=True, inside=True)
    assert accepts("hermes", good, markers=False, reasoning=True)
    assert accepts("hermes", "<think>hm</think>" + good, markers=False, reasoning=True)


def test_harmony_needs_its_markers_as_tokens():
    with pytest.raises(RequestError, match="not supported with the harmony"):
        strict_grammar("harmony", markers=False)


def test_no_strict_tool_or_no_auto_means_no_grammar():
    encode = functools.partial(tokenizer(())[0].encode, add_special_tokens=False)
    assert strict_tool_grammar(ToolMode([TIME], "auto"), "hermes", encode) is None
    assert strict_tool_grammar(ToolMode(TOOLS, "none"), "hermes", encode) is None
    with pytest.raises(RequestError, match="tool-call format"):
        strict_tool_grammar(ToolMode(TOOLS, "auto"), None, encode)


def test_strict_under_auto_cannot_combine_with_another_constraint():
    body = {"tools": TOOLS}
    assert parse_tools(body, None).strict
    with pytest.raises(RequestError, match="strict"):
        parse_tools(body, ("json_object", ""))
    with pytest.raises(RequestError, match="strict must be a boolean"):
        parse_tools({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]}, None)


@pytest.mark.parametrize("fmt", ["qwen3_coder", "glm45", "minimax_m2"])
def test_several_loose_tools_beside_a_strict_one(fmt: str):
    hf, ll = tokenizer(grammar_markers(fmt))
    loose = [{"type": "function", "function": {"name": n}} for n in ("get_time", "get_date")]
    mode = ToolMode([WEATHER, *loose], "auto")
    encode = functools.partial(hf.encode, add_special_tokens=False)
    grammar = strict_tool_grammar(mode, fmt, encode)
    assert grammar is not None
    for name, ok in (("get_date", True), ("get_weather", False)):
        matcher = llguidance.LLMatcher(ll, grammar_text(*grammar))
        text = call(fmt, name, {"any": "thing"})
        accepted = all(matcher.consume_token(t) for t in encode(text)) and matcher.is_accepting()
        assert accepted == ok
