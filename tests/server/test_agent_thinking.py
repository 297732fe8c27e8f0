"""Thinking through the agent APIs: a tiny model whose chat template opens a think block
(as Qwen3's does), so generation starts inside it. Anthropic's ``thinking`` (enabled with a
budget, adaptive, disabled) and the Responses API's ``reasoning`` (effort, encrypted content
round trip), through the official SDKs."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tandem.testing.live_server import API_KEY, Server
from tandem.testing.tiny_models import make_tiny_model

THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Think tags as added special tokens, as Qwen3 has them."""
    path = make_tiny_model(
        tmp_path_factory.mktemp("thinker") / "m",
        "llama",
        extra_special_tokens=("<think>", "</think>"),
        chat_template=THINK_TEMPLATE,
    )
    s = Server(path)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_thinking_budget_caps_the_think_block(claude, server):
    """The random model never closes its think block by itself; with a budget of 6 tokens
    the grammar closes it there, so the answer follows as a text block."""
    msgs = [{"role": "user", "content": "think about it"}]
    m = claude.messages.create(
        model="tiny",
        max_tokens=40,
        messages=msgs,
        thinking={"type": "enabled", "budget_tokens": 6},
        extra_body={"temperature": 0},
    )
    kinds = [b.type for b in m.content]
    assert kinds[0] == "thinking" and "<think>" not in m.content[0].thinking
    thought = server.post("/tokenize", json={"prompt": m.content[0].thinking}).json()["tokens"]
    assert len(thought) <= 6
    assert kinds[1:] in (["text"], [])
    assert m.usage.output_tokens > 6
    with claude.messages.stream(
        model="tiny",
        max_tokens=40,
        messages=msgs,
        thinking={"type": "enabled", "budget_tokens": 6},
        extra_body={"temperature": 0},
    ) as s:
        streamed = s.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in m.content]


def test_without_budget_the_block_runs_on(claude):
    m = claude.messages.create(
        model="tiny",
        max_tokens=24,
        messages=[{"role": "user", "content": "think about it"}],
        thinking={"type": "adaptive"},
        extra_body={"temperature": 0},
    )
    assert [b.type for b in m.content] == ["thinking"] and m.stop_reason == "max_tokens"


def test_thinking_disabled_renders_the_closed_block(claude):
    msgs = [{"role": "user", "content": "answer directly"}]
    on = claude.messages.count_tokens(model="tiny", messages=msgs)
    off = claude.messages.count_tokens(model="tiny", messages=msgs, thinking={"type": "disabled"})
    assert off.input_tokens > on.input_tokens  # the template closed the block in the prompt
    m = claude.messages.create(
        model="tiny",
        max_tokens=12,
        messages=msgs,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},
    )
    assert [b.type for b in m.content] in (["text"], [])


def test_thinking_history_reaches_the_template(claude):
    base = [{"role": "user", "content": "q"}]
    turn = {"role": "assistant", "content": [{"type": "text", "text": "a"}]}
    thought = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "let me see", "signature": ""},
            turn["content"][0],
        ],
    }
    follow = {"role": "user", "content": "more"}
    plain = claude.messages.count_tokens(model="tiny", messages=[*base, turn, follow])
    rich = claude.messages.count_tokens(model="tiny", messages=[*base, thought, follow])
    assert rich.input_tokens > plain.input_tokens


def test_responses_reasoning_items_round_trip(oai):
    r = oai.responses.create(
        model="tiny",
        input="think about it",
        max_output_tokens=12,
        temperature=0,
        reasoning={"effort": "high", "summary": "auto"},
        include=["reasoning.encrypted_content"],
    )
    (item,) = r.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text"
    text = item.content[0].text
    assert text and item.encrypted_content
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    # Sent back as the client got it (Codex sends reasoning items back): the same tokens.
    history = [
        {"role": "user", "content": "think about it"},
        {
            "type": "reasoning",
            "id": item.id,
            "summary": [],
            "encrypted_content": item.encrypted_content,
        },
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "again"},
    ]
    plain = [dict(h) for h in history]
    plain[1] = {
        "type": "reasoning",
        "id": item.id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }
    a = oai.responses.create(model="tiny", input=history, max_output_tokens=1, temperature=0)
    b = oai.responses.create(model="tiny", input=plain, max_output_tokens=1, temperature=0)
    assert a.usage.input_tokens == b.usage.input_tokens
    off = oai.responses.create(
        model="tiny", input="x", max_output_tokens=6, temperature=0, reasoning={"effort": "none"}
    )
    assert [o.type for o in off.output] in (["message"], [])


def test_responses_streams_reasoning_text(oai):
    kinds = [
        e.type
        for e in oai.responses.create(
            model="tiny", input="think", max_output_tokens=8, temperature=0, stream=True
        )
    ]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert kinds[-1] == "response.incomplete"
