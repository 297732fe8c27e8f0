"""Think-block grammars where the tags are one token each (Qwen3's `<think>` / `</think>` are
added special tokens, which a text literal in a grammar never matches) and where they are
spelled in several tokens: the constraint after the block, and the thinking budget."""

from __future__ import annotations

import functools
import json

import pytest

from tandem.engine.grammar import GrammarCompiler
from tandem.frontend.tokenizer import Tokenizer
from tandem.server.chat_prep import think_budget_grammar
from tandem.server.guided import after_reasoning, think_tag_ids
from tandem.testing.tiny_models import make_tiny_model

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module", params=["special", "text"])
def setup(request, tmp_path_factory, tiny_model_dir):
    if request.param == "special":
        path = make_tiny_model(
            tmp_path_factory.mktemp("qwen-think") / "m",
            "qwen3",
            extra_special_tokens=("<think>", "</think>"),
        )
    else:
        path = tiny_model_dir("llama")
    tok = Tokenizer.load(path)
    ids = think_tag_ids(functools.partial(tok.encode, add_special_tokens=False))
    assert (len(ids) == 2) == (request.param == "special")
    return tok, GrammarCompiler(tok.hf, 512, tok.eos_token_ids), ids


def tokens(tok, ids, pieces: list[str]) -> list[int]:
    """Token ids of the pieces, a tag as its one token where the vocabulary has it."""
    out: list[int] = []
    for p in pieces:
        out += [ids[p]] if p in ids else tok.encode(p, add_special_tokens=False)
    return out


def run(setup, guided, pieces: list[str]) -> tuple[bool, object]:
    tok, c, ids = setup
    m = c.matcher(*guided)
    ok = all(m.accept(t) for t in tokens(tok, ids, pieces))
    return ok, m


def test_constraint_after_the_think_block(setup):
    _, _, ids = setup
    guided = after_reasoning(("json_schema", json.dumps(SCHEMA)), False, ids=ids)
    ok, m = run(setup, guided, ["<think>", "let me see", "</think>", '{"a": 1}'])
    assert ok and (m.done or m._m.is_accepting())
    assert not run(setup, guided, ["<think>", "hm", "</think>", '{"b": 1}'])[0]
    inside = after_reasoning(("regex", "[0-9]{2}"), True, ids=ids)
    assert run(setup, inside, ["thinking", "</think>", "42"])[0]


def test_budget_forces_the_close(setup):
    tok, _, ids = setup
    # Thought within the budget, closed by the model: then free text. (A closing tag spelled in
    # several tokens is matched inside the thought, so its tokens count toward the budget.)
    roomy = think_budget_grammar(True, 12, "thinking", ids)
    assert run(setup, roomy, ["ab", "</think>", "hello world"])[0]
    budget = think_budget_grammar(True, 4, "thinking", ids)
    # Four tokens of thought: the next must close the block.
    four = tok.decode(tok.encode("alpha beta gamma delta", add_special_tokens=False)[:4])
    assert run(setup, budget, [four, "</think>", "ok"])[0]
    assert not run(setup, budget, [four, " more text"])[0]
    outside = think_budget_grammar(False, 4, "thinking", ids)
    assert run(setup, outside, ["<think>", "ab", "</think>", "hi"])[0]
    assert run(setup, outside, ["no thinking at all"])[0]


def test_after_the_budgeted_block_any_token_may_follow(setup):
    """A tool-call marker that is a special token must stay possible in the answer."""
    tok, c, ids = setup
    if not ids:
        pytest.skip("tags in several tokens: the answer is text")
    marker = tok.encode("<|im_start|>", add_special_tokens=False)
    assert len(marker) == 1  # a special token of the tiny tokenizer
    for inside in (True, False):
        g = think_budget_grammar(inside, 4, "thinking", ids)
        pieces = [] if inside else ["<think>"]
        m = c.matcher(*g)
        seq = tokens(tok, ids, [*pieces, "ab", "</think>", "call:"]) + marker
        assert all(m.accept(t) for t in seq)
    skipped = c.matcher(*think_budget_grammar(False, 4, "thinking", ids))
    assert all(skipped.accept(t) for t in tok.encode("no think", add_special_tokens=False) + marker)
    capped = c.matcher(*think_budget_grammar(False, 4, "thinking", ids))
    four = tok.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    assert not all(capped.accept(t) for t in [ids["<think>"], *four])


def test_the_budget_cannot_be_bypassed_by_a_second_block(setup):
    tok, c, ids = setup
    if not ids:
        pytest.skip("tags in several tokens: the answer is text")
    long = tok.encode("alpha beta gamma delta epsilon zeta eta", add_special_tokens=False)
    newline = tok.encode("\n", add_special_tokens=False)
    for inside, seq in (
        (False, [*newline, ids["<think>"], *long]),  # skip the block, then open one late
        (True, [*tok.encode("ab", add_special_tokens=False), ids["</think>"], ids["<think>"]]),
    ):
        m = c.matcher(*think_budget_grammar(inside, 4, "thinking", ids))
        assert not all(m.accept(t) for t in seq)
