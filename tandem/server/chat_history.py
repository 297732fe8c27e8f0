"""Chat histories as coding agents send them, reshaped into what strict chat templates accept.

Strict templates (Mistral's, Gemma's, Llama 2's and their descendants) raise on a system
message that is not first, on a second system message, on roles they do not know
(``developer``) and on two user or two assistant turns in a row ("Conversation roles must
alternate user/assistant/user/assistant/..."). Agents routinely send all of these.
``normalize_messages`` applies the few rules below, in this order, and nothing else:

1. ``developer`` becomes ``system`` (OpenAI's newer name for the same instructions).
2. System messages are joined, in order and separated by a blank line, into one leading
   system message.
3. Consecutive user messages are joined into one (blank line between texts); consecutive
   assistant messages likewise, their ``tool_calls`` concatenated in order.

Messages merge only when their ``name`` fields agree (both absent counts), so no name is
lost; a system message named differently from the first stays where it is. Tool messages are
never merged or moved (each carries its ``tool_call_id``). Empty texts (e.g. the ``content:
null`` of an assistant message that only calls tools) add no blank line. A history that breaks
none of these rules comes back unchanged, so its prompt is byte-identical.
"""

from __future__ import annotations

from typing import Any

from tandem.server.errors import RequestError

SEPARATOR = "\n\n"
_MERGED_ROLES = ("user", "assistant")


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history with the rules above applied (messages as ``parse_chat`` builds them:
    ``role``, ``content`` str, optional ``name``, ``tool_calls``, ``tool_call_id``). The
    input is not modified; messages that no rule touches are returned as they are."""
    renamed = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    runs: list[list[dict[str, Any]]] = []  # consecutive mergeable messages, merged once each
    for m in _hoist_system(renamed):
        if runs and m["role"] in _MERGED_ROLES and _mergeable(runs[-1][0], m):
            runs[-1].append(m)
        else:
            runs.append([m])
    return [_merge(run) if len(run) > 1 else run[0] for run in runs]


def _mergeable(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["role"] == b["role"] and a.get("name") == b.get("name")


def _hoist_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    systems = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if not systems or systems == [0]:
        return messages
    first = messages[systems[0]]
    moved = [i for i in systems if _mergeable(first, messages[i])]
    lead = _merge([messages[i] for i in moved]) if len(moved) > 1 else first
    gone = set(moved)
    rest = [m for i, m in enumerate(messages) if i not in gone]
    return [lead, *rest]


def _merge(run: list[dict[str, Any]]) -> dict[str, Any]:
    """One message of the first's role and name with all texts, tool calls and reasonings, in
    order (one pass: a long run costs its length, not its square)."""
    out = {**run[0], "content": SEPARATOR.join(m["content"] for m in run if m["content"])}
    calls = [c for m in run for c in m.get("tool_calls", ())]
    if calls:
        out["tool_calls"] = calls
    thoughts = [m["reasoning_content"] for m in run if m.get("reasoning_content")]
    if thoughts:
        out["reasoning_content"] = SEPARATOR.join(thoughts)
    return out


def check_request_template(kwargs: dict[str, Any], trusted: bool) -> None:
    """A request's own chat template is Jinja run on the server: only when the server trusts
    its clients (``--trust-request-chat-template``)."""
    if "chat_template" in kwargs and not trusted:
        raise RequestError(
            "chat_template_kwargs.chat_template needs a server started with "
            "--trust-request-chat-template",
            param="chat_template_kwargs",
        )


def template_error(e: Exception) -> RequestError:
    """A chat template that fails is the request's fault: a 400 with the template's own
    message (``raise_exception`` raises jinja's ``TemplateError`` carrying it), or the
    exception's type where it has none."""
    return RequestError(f"chat template failed: {str(e) or type(e).__name__}", param="messages")
