"""What every tool-call format shares: calls and stream events, JSON helpers, and small
patterns that match markup on text that may still be growing.

A pattern's answer on a prefix is OK only when every longer text gives the same answer;
PARTIAL means more text could still make it match. That is what lets a streamed parse make
the same decisions as a parse of the whole text."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from tandem.server.reasoning import partial_suffix

__all__ = ["partial_suffix"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


class CallStart(NamedTuple):
    name: str
    id: str | None = None  # the model's own call id (Kimi K2, Mistral), else one is made


# Stream events, in output order: ("content", text), ("reasoning", text) (harmony's analysis
# channel), and per call ("call_start", CallStart), ("call_args", fragment)..., then
# ("tool_call", ToolCall) whose arguments are the joined fragments.
Event = (
    tuple[Literal["content", "reasoning", "call_args"], str]
    | tuple[Literal["call_start"], CallStart]
    | tuple[Literal["tool_call"], ToolCall]
)


class Wait(NamedTuple):
    """Undecided until more text comes; only text holding one of ``triggers`` (any text when
    empty) can decide it, so the streamer skips re-scanning a long block for other deltas."""

    triggers: str


ANY = Wait("")


def make_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def to_openai(call: ToolCall, call_id: str) -> dict[str, Any]:
    """A ``message.tool_calls`` entry."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def to_openai_delta(call: ToolCall, index: int, call_id: str) -> dict[str, Any]:
    """A ``delta.tool_calls`` entry carrying the whole call at once."""
    return {"index": index, **to_openai(call, call_id)}


def whole_call(call: ToolCall, call_id: str | None = None) -> list[Event]:
    """The events of a call decided all at once."""
    events: list[Event] = [("call_start", CallStart(call.name, call_id))]
    if call.arguments:
        events.append(("call_args", call.arguments))
    return [*events, ("tool_call", call)]


# --- JSON ----------------------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")


def skip_ws(text: str, pos: int) -> int:
    m = _WS.match(text, pos)
    return m.end() if m else pos


def decode_at(text: str, pos: int) -> tuple[Any, int] | None:
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def arguments_json(value: Any) -> str | None:
    """OpenAI ``arguments`` text from what the model gave, or None when unusable."""
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):  # arguments JSON-encoded as a string: keep it if it is JSON
        try:
            json.loads(value)
        except ValueError:
            return None
        return value
    return None


def call_from_obj(
    obj: Any, keys: tuple[str, ...] = ("arguments", "parameters"), *, need_args: bool = False
) -> ToolCall | None:
    """A call from ``{"name": ..., <one of keys>: ...}``; None if ``obj`` isn't one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    key = next((k for k in keys if k in obj), None)
    if key is None and need_args:
        return None
    arguments = arguments_json(obj[key] if key is not None else None)
    return None if arguments is None else ToolCall(name.strip(), arguments)


_JSON_SPECIAL = re.compile(r'["\\{}\[\]]')


class JsonSpan:
    """Finds where a JSON value starting with ``{`` ends, fed piece by piece; the text is not
    validated (arguments are passed on as generated, as OpenAI does)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def read(self, buf: str, pos: int) -> tuple[int, bool]:
        """How far ``buf[pos:]`` belongs to the value, and whether the value ended there."""
        i = pos
        while True:
            if self.escaped:
                if i >= len(buf):
                    return len(buf), False
                self.escaped, i = False, i + 1
            m = _JSON_SPECIAL.search(buf, i)
            if m is None:
                return len(buf), False
            c, i = m.group(), m.end()
            if self.in_string:
                if c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i, True


# --- patterns over growing text ------------------------------------------------------------

OK, PARTIAL, FAIL = 0, 1, 2
Matched = tuple[int, int, Any]  # (status, end, captured value or None)


class Lit(NamedTuple):
    text: str

    def match(self, buf: str, pos: int) -> Matched:
        if buf.startswith(self.text, pos):
            return OK, pos + len(self.text), None
        rest = buf[pos:]
        if len(rest) < len(self.text) and self.text.startswith(rest):
            return PARTIAL, len(buf), None
        return FAIL, pos, None


class Ws(NamedTuple):
    """Optional whitespace (never last in a pattern: more of it could still come)."""

    def match(self, buf: str, pos: int) -> Matched:
        return OK, skip_ws(buf, pos), None


WS = Ws()


class Word(NamedTuple):
    """One or more characters of a class (a regex like ``[^\\s<]``), captured."""

    chars: str
    max_len: int = 256

    def match(self, buf: str, pos: int) -> Matched:
        m = re.compile(f"(?:{self.chars})*").match(buf, pos)  # compiled once (re's cache)
        end = m.end() if m else pos
        if end - pos > self.max_len:
            return FAIL, pos, None
        if end == len(buf):
            return PARTIAL, end, None
        return (OK, end, buf[pos:end]) if end > pos else (FAIL, pos, None)


class Upto(NamedTuple):
    """Text up to (not including) ``stop``, captured; it may hold none of ``bad``."""

    stop: str
    bad: str = ""
    max_len: int = 256

    def match(self, buf: str, pos: int) -> Matched:
        i = buf.find(self.stop, pos, pos + self.max_len + len(self.stop))
        # not found: what could still begin the stop is not checked yet
        end = i if i >= 0 else len(buf) - partial_suffix(buf, self.stop, pos)
        seg = buf[pos:end]
        if any(c in seg for c in self.bad) or len(seg) > self.max_len:
            return FAIL, pos, None
        return (OK, i, seg) if i >= 0 else (PARTIAL, len(buf), None)


class JStr(NamedTuple):
    """A JSON string, captured decoded."""

    def match(self, buf: str, pos: int) -> Matched:
        if pos == len(buf):
            return PARTIAL, pos, None
        if buf[pos] != '"':
            return FAIL, pos, None
        decoded = decode_at(buf, pos)
        if decoded is not None:
            return OK, decoded[1], decoded[0]
        closed = re.compile(r'"(?:[^"\\]|\\.)*"').match(buf, pos)
        return (FAIL, pos, None) if closed else (PARTIAL, len(buf), None)


class Peek(NamedTuple):
    """The next character is ``char`` (not consumed)."""

    char: str

    def match(self, buf: str, pos: int) -> Matched:
        if pos == len(buf):
            return PARTIAL, pos, None
        return (OK, pos, None) if buf[pos] == self.char else (FAIL, pos, None)


class Alt(NamedTuple):
    """One of several literals."""

    options: tuple[str, ...]

    def match(self, buf: str, pos: int) -> Matched:
        results = [Lit(o).match(buf, pos) for o in self.options]
        ok = [r for r in results if r[0] == OK]
        if ok:
            return ok[0]
        return (PARTIAL, len(buf), None) if any(r[0] == PARTIAL for r in results) else results[0]


class Opt(NamedTuple):
    """An optional sub-pattern; captures the list of its captures when it matched some."""

    parts: tuple[Any, ...]

    def match(self, buf: str, pos: int) -> Matched:
        status, end, captured = match_seq(buf, pos, self.parts)
        if status == FAIL:
            return OK, pos, None
        return status, end, (captured or None) if status == OK else None


Pattern = tuple[Any, ...]


def match_seq(buf: str, pos: int, parts: Pattern) -> tuple[int, int, list[Any]]:
    """(status, end, captures) of a sequence of patterns at ``pos``."""
    captured: list[Any] = []
    for part in parts:
        status, pos, value = part.match(buf, pos)
        if status != OK:
            return status, pos, captured
        if value is not None:
            captured.append(value)
    return OK, pos, captured
