"""What coding agents and editors send: chat histories a strict template would reject, and
fill-in-the-middle completions (``suffix``), against a tiny model whose chat template is as
strict as Mistral's and whose tokenizer has Qwen's FIM tokens."""

from __future__ import annotations

import jinja2
import pytest

from tandem.frontend.tokenizer import Tokenizer
from tandem.testing.live_server import Server
from tandem.testing.tiny_models import make_tiny_model

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
NOT_FIRST = "System message must be at the beginning."

# ChatML with the checks of Mistral's templates: one leading system message, then user and
# assistant strictly alternating (tool results and tool-calling turns are outside the count).
STRICT_TEMPLATE = (
    "{%- set ns = namespace(turns=0) %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}"
    "{%- if not loop.first %}{{ raise_exception('" + NOT_FIRST + "') }}{%- endif %}"
    "{%- elif m['role'] == 'tool' or m.get('tool_calls') %}"
    "{%- else %}"
    "{%- if (m['role'] == 'user') != (ns.turns % 2 == 0) %}"
    "{{ raise_exception('" + ALTERNATE + "') }}"
    "{%- endif %}"
    "{%- set ns.turns = ns.turns + 1 %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def calls(*ids: str) -> list[dict]:
    return [
        {"id": i, "type": "function", "function": {"name": "ls", "arguments": "{}"}} for i in ids
    ]


# An agent's history: developer instructions, a user turn split in two, an assistant turn
# split into text and tool calls (content null), two tool results, a late system reminder.
AGENT_HISTORY = [
    {"role": "developer", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug."},
    {"role": "user", "content": [{"type": "text", "text": "It is in main.py."}]},
    {"role": "assistant", "content": "Looking."},
    {"role": "assistant", "content": None, "tool_calls": calls("c1", "c2")},
    {"role": "tool", "tool_call_id": "c1", "content": "main.py"},
    {"role": "tool", "tool_call_id": "c2", "content": "print(1)"},
    {"role": "assistant", "content": "Found it."},
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Go on."},
]
# The same history as the rules reshape it.
NORMALIZED = [
    {"role": "system", "content": "You are a coding agent.\n\nBe brief."},
    {"role": "user", "content": "Fix the bug.\n\nIt is in main.py."},
    {"role": "assistant", "content": "Looking.", "tool_calls": calls("c1", "c2")},
    {"role": "tool", "tool_call_id": "c1", "content": "main.py"},
    {"role": "tool", "tool_call_id": "c2", "content": "print(1)"},
    {"role": "assistant", "content": "Found it."},
    {"role": "user", "content": "Go on."},
]


@pytest.fixture(scope="module")
def strict_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("strict") / "qwen2"
    return make_tiny_model(path, "qwen2", extra_special_tokens=FIM, chat_template=STRICT_TEMPLATE)


@pytest.fixture(scope="module")
def strict(strict_model):
    s = Server(strict_model, "--trust-request-chat-template")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(strict_model) -> Tokenizer:
    return Tokenizer.load(strict_model)


def tokenize(server: Server, messages: list[dict]) -> list[int]:
    r = server.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_the_template_is_strict(tokenizer):
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    with pytest.raises(jinja2.TemplateError, match="must be at the beginning"):
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]
        )


def test_an_agent_history_renders_as_its_normalized_form(strict, tokenizer):
    tokens = tokenize(strict, AGENT_HISTORY)
    assert tokens == tokenize(strict, NORMALIZED)
    assert tokens == tokenizer.apply_chat_template(NORMALIZED)
    r = strict.post(
        "/v1/chat/completions",
        json={"messages": AGENT_HISTORY, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tokens)  # /tokenize counts what chat runs


def test_a_well_formed_history_is_rendered_untouched(strict, tokenizer):
    messages = NORMALIZED[:2]
    assert tokenize(strict, messages) == tokenizer.apply_chat_template(messages)


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}], ALTERNATE),
        (  # named otherwise, the late system message is not merged away
            [
                {"role": "system", "content": "a"},
                {"role": "user", "content": "u"},
                {"role": "system", "content": "b", "name": "ops"},
            ],
            NOT_FIRST,
        ),
    ],
)
def test_a_history_the_rules_cannot_fix_is_a_400_with_the_templates_message(
    strict, messages, message
):
    for path, body in (
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
        ("/tokenize", {"messages": messages}),
    ):
        r = strict.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"] == f"chat template failed: {message}"
        assert error["param"] == "messages"


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ raise_exception('no tools here') }}", "no tools here"),
        ("{{ messages[0].nothing.deeper }}", "nothing"),  # jinja2.UndefinedError
        ("{{ 1 // 0 }}", "division"),  # ZeroDivisionError
        ("{% for %}", "Expected an expression"),  # TemplateSyntaxError
        ("{{ messages | no_such_filter }}", "no_such_filter"),
    ],
)
def test_no_template_failure_is_a_500(strict, template, message):
    body = {"messages": [{"role": "user", "content": "x"}]}
    body["chat_template_kwargs"] = {"chat_template": template}
    for path, extra in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
        r = strict.post(path, json={**body, **extra})
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]


def fim_ids(tokenizer: Tokenizer, prefix: str, suffix: str) -> list[int]:
    p, s, m = (tokenizer.hf.convert_tokens_to_ids(t) for t in FIM)
    text = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    return [p, *text(prefix), s, *text(suffix), m]


def complete(server: Server, **body) -> dict:
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **body}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_fim_sends_the_engine_the_qwen_layout(strict, tokenizer):
    prefix, suffix = "def fibonacci(n):\n    a, b = 0, 1\n", "\n    return a\n"
    expected = fim_ids(tokenizer, prefix, suffix)
    fim = complete(strict, prompt=prefix, suffix=suffix)
    ids = complete(strict, prompt=expected)
    assert fim["usage"]["prompt_tokens"] == len(expected)
    assert fim["choices"][0]["token_ids"] == ids["choices"][0]["token_ids"]
    assert fim["choices"][0]["text"] == ids["choices"][0]["text"]


def test_every_prompt_of_a_list_gets_the_same_suffix(strict, tokenizer):
    prefixes, suffix = ["for i in range(10):\n", ""], "\nprint(total)\n"
    out = complete(strict, prompt=prefixes, suffix=suffix)
    for prefix, choice in zip(prefixes, out["choices"], strict=True):
        alone = complete(strict, prompt=fim_ids(tokenizer, prefix, suffix))
        assert choice["token_ids"] == alone["choices"][0]["token_ids"]


def test_an_empty_suffix_is_a_plain_completion(strict):
    with_empty = complete(strict, prompt="The morning", suffix="")
    plain = complete(strict, prompt="The morning")
    assert with_empty["choices"] == plain["choices"] and with_empty["usage"] == plain["usage"]


def test_suffix_with_token_ids_or_echo_is_a_400(strict):
    for body in (
        {"prompt": [5, 6, 7], "suffix": "x"},
        {"prompt": "a", "suffix": "x", "echo": True},
    ):
        r = strict.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text


def test_suffix_on_a_model_without_fim_tokens_is_a_400(server):
    r = server.post("/v1/completions", json={"prompt": "def f(", "suffix": "return 1"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "suffix" and "fill-in-the-middle" in error["message"]
