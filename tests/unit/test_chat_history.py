"""The chat-history rules: what strict templates reject is reshaped, nothing else changes and
nothing is lost."""

from __future__ import annotations

import copy

import jinja2
import pytest

from tandem.server.chat_history import normalize_messages, template_error
from tandem.server.requests import parse_chat


def system(text: str, **kw) -> dict:
    return {"role": "system", "content": text, **kw}


def dev(text: str) -> dict:
    return {"role": "developer", "content": text}


def user(text: str, **kw) -> dict:
    return {"role": "user", "content": text, **kw}


def asst(text: str = "", calls: list | None = None, **kw) -> dict:
    m = {"role": "assistant", "content": text, **kw}
    if calls is not None:
        m["tool_calls"] = calls
    return m


def tool(text: str, call_id: str) -> dict:
    return {"role": "tool", "content": text, "tool_call_id": call_id}


def call(name: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": {}}}


WELL_FORMED = [
    [user("hi")],
    [system("be brief"), user("hi"), asst("hello"), user("bye")],
    [system("s"), user("u"), asst("", [call("ls", "1")]), tool("a", "1"), asst("done")],
    [user("u"), asst("", [call("ls", "1"), call("cat", "2")]), tool("a", "1"), tool("b", "2")],
    [user("u", name="ann"), asst("a"), user("v", name="bob")],
    [asst("I start"), user("fine")],  # not our rule to fix: the template decides
]


@pytest.mark.parametrize("messages", WELL_FORMED)
def test_a_well_formed_history_comes_back_unchanged(messages):
    before = copy.deepcopy(messages)
    out = normalize_messages(messages)
    assert out == before
    assert all(a is b for a, b in zip(out, messages, strict=True))
    assert messages == before  # the input is never modified


def test_developer_becomes_system():
    assert normalize_messages([dev("rules"), user("hi")]) == [system("rules"), user("hi")]


def test_system_messages_are_joined_into_one_leading_system_message():
    messages = [user("u1"), system("a"), asst("x"), dev("b"), user("u2"), system("c")]
    assert normalize_messages(messages) == [
        system("a\n\nb\n\nc"),
        user("u1"),
        asst("x"),
        user("u2"),
    ]


def test_a_lone_system_message_that_is_not_first_moves_to_the_front():
    assert normalize_messages([user("u"), system("s")]) == [system("s"), user("u")]


def test_consecutive_user_messages_merge_with_a_blank_line():
    assert normalize_messages([user("a"), user("b"), user("c")]) == [user("a\n\nb\n\nc")]


def test_users_around_a_moved_system_message_merge():
    assert normalize_messages([system("s"), user("a"), system("t"), user("b")]) == [
        system("s\n\nt"),
        user("a\n\nb"),
    ]


def test_consecutive_assistant_messages_merge_texts_and_tool_calls_in_order():
    messages = [
        user("go"),
        asst("let me look"),
        asst("", [call("ls", "1")]),  # content: null from the client
        asst("and this", [call("cat", "2")]),
        tool("files", "1"),
        tool("text", "2"),
    ]
    assert normalize_messages(messages) == [
        user("go"),
        asst("let me look\n\nand this", [call("ls", "1"), call("cat", "2")]),
        tool("files", "1"),
        tool("text", "2"),
    ]


def test_empty_texts_add_no_blank_line():
    assert normalize_messages([user(""), user("b")]) == [user("b")]
    assert normalize_messages([asst("", [call("ls", "1")]), asst("")]) == [
        asst("", [call("ls", "1")])
    ]


def test_tool_messages_are_never_merged_or_moved():
    messages = [user("u"), asst("", [call("a", "1")]), tool("x", "1"), tool("y", "1"), user("v")]
    assert normalize_messages(messages) == messages


def test_messages_merge_only_when_their_names_agree():
    messages = [user("a", name="ann"), user("b", name="ann"), user("c", name="bob"), user("d")]
    assert normalize_messages(messages) == [
        user("a\n\nb", name="ann"),
        user("c", name="bob"),
        user("d"),
    ]


def test_a_system_message_named_otherwise_stays_where_it_is():
    messages = [system("a"), user("u"), system("b", name="ops"), system("c")]
    assert normalize_messages(messages) == [system("a\n\nc"), user("u"), system("b", name="ops")]


def test_no_text_is_lost():
    messages = [
        dev("d"),
        user("u1"),
        system("s"),
        user("u2"),
        asst("a1"),
        asst("a2", [call("f", "9")]),
        tool("t", "9"),
        asst("a3"),
    ]
    out = normalize_messages(messages)
    words = sorted(w for m in out for w in m["content"].split())
    assert words == sorted(m["content"] for m in messages)
    assert [c for m in out for c in m.get("tool_calls", ())] == [call("f", "9")]


def test_parsed_client_history_normalizes():
    """As the chat route sees it: parse_chat's output (content null with tool calls is "")."""
    body = {
        "messages": [
            {"role": "developer", "content": "terse"},
            {"role": "user", "content": [{"type": "text", "text": "fix it"}]},
            {"role": "user", "content": "please"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        ]
    }
    out = normalize_messages(parse_chat(body).messages)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[1]["content"] == "fix it\n\nplease"
    assert out[2]["content"] == "" and out[2]["tool_calls"][0]["id"] == "c1"
    assert out[3]["tool_call_id"] == "c1"


@pytest.mark.parametrize(
    "error, message",
    [
        (jinja2.TemplateError("Conversation roles must alternate"), "Conversation roles must"),
        (jinja2.UndefinedError("'dict object' has no attribute 'x'"), "has no attribute 'x'"),
        (KeyError(""), "''"),
        (ValueError(), "ValueError"),
    ],
)
def test_a_failing_template_is_a_400_with_its_message(error, message):
    e = template_error(error)
    assert e.status == 400 and e.param == "messages"
    assert str(e).startswith("chat template failed: ") and message in str(e)


def test_merged_assistant_turns_keep_both_reasonings():
    from tandem.server.chat_history import normalize_messages

    out = normalize_messages(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "first"},
            {"role": "assistant", "content": "", "reasoning_content": "second", "tool_calls": []},
        ]
    )
    assert [m["role"] for m in out] == ["user", "assistant"]
    assert "first" in out[1]["reasoning_content"] and "second" in out[1]["reasoning_content"]
