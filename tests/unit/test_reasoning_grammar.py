"""Constraints on reasoning models apply after the think block (server/guided.py)."""

from __future__ import annotations

import json

import pytest

from tandem.engine.grammar import GrammarCompiler
from tandem.frontend.tokenizer import Tokenizer
from tandem.server.guided import after_reasoning

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    tok = Tokenizer.load(tiny_model_dir("llama"))
    return tok, GrammarCompiler(tok.hf, 512, tok.eos_token_ids)


def accepts(compiler, guided, text: str) -> bool:
    tok, c = compiler
    m = c.matcher(*guided)
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and (
        m.done or m._m.is_accepting()
    )


@pytest.mark.parametrize(
    "guided, good, bad",
    [
        (("json_schema", json.dumps(SCHEMA)), '{"a": 1}', '{"b": 1}'),
        (("json_object", ""), '{"x": [1, 2]}', "[1]"),
        (("regex", r"[0-9]{3}/[a-z]"), "123/x", "12/x"),
        (("choice", json.dumps(["yes", "no", "naïve"])), "naïve", "maybe"),
    ],
)
def test_think_block_then_the_constraint(compiler, guided, good, bad):
    wrapped = after_reasoning(guided, inside=False)
    assert wrapped[0] == "grammar"
    assert accepts(compiler, wrapped, f"<think>let me\nthink {{ about it</think>\n\n{good}")
    assert accepts(compiler, wrapped, good)  # thinking disabled: straight to the answer
    assert not accepts(compiler, wrapped, f"<think>hm</think>\n\n{bad}")
    assert not accepts(compiler, wrapped, f"preamble {good}")
    inside = after_reasoning(guided, inside=True)  # the prompt opened the block
    assert accepts(compiler, inside, f"thinking...</think>\n\n{good}")
    assert not accepts(compiler, inside, good)


def test_json_after_thinking_is_compact(compiler):
    wrapped = after_reasoning(("json_schema", json.dumps(SCHEMA)), inside=False)
    assert not accepts(compiler, wrapped, '<think>x</think>{ "a" :1}')


def test_user_grammars_are_left_alone():
    g = ("grammar", 'start: "x"')
    assert after_reasoning(g, inside=False) == g
