"""gpt-oss's harmony format. The output is a run of messages, each a header then a body:
``<|channel|>analysis<|message|>…<|end|>`` is reasoning, ``<|start|>assistant<|channel|>
final<|message|>…`` is content, and a message addressed to a function is a call, e.g.
``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}``
(the recipient may also sit in the role part: ``<|start|>assistant to=functions.NAME<|channel|>
commentary json<|message|>``). ``<|call|>`` and ``<|return|>`` are stop tokens, so a call's
body usually just ends with the output. All of these markers are special tokens: the text has
to be decoded with special tokens kept."""

from __future__ import annotations

import re

from tandem.server.tool_calls.base import ANY, CallStart, Event, ToolCall, Wait
from tandem.server.tool_calls.section import Scanner, Step, text_until

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
MAX_HEADER = 512  # characters from a message's start to its <|message|>

_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
_BODY_ENDS = (END, CALL, RETURN, START)


class HarmonyScanner(Scanner):
    mode = "between"

    def __init__(self) -> None:
        self.kind = "content"  # what the open message's body is: content, reasoning or call
        self.call: list[str] = []

    def step(self, buf: str, pos: int, final: bool) -> Step:
        return getattr(self, f"_{self.mode}")(buf, pos, final)

    def _between(self, buf: str, pos: int, final: bool) -> Step:
        text, end, found = text_until(buf, pos, (START, CHANNEL), final)
        events: list[Event] = [("content", text)] if text else []  # text outside messages
        if found >= 0:
            self.mode = "header"
            return events, end, None
        return events, end, None if end == len(buf) else ANY

    def _header(self, buf: str, pos: int, final: bool) -> Step:
        k = buf.find(MESSAGE, pos, pos + MAX_HEADER + len(MESSAGE))
        if k < 0:
            if not final and len(buf) - pos <= MAX_HEADER:
                return [], pos, Wait(">")
            marker = START if buf.startswith(START, pos) else CHANNEL
            self.mode = "between"  # no message follows: the marker is content
            return [("content", marker)], pos + len(marker), None
        header = buf[pos:k]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header.replace(CONSTRAIN, " "))
        events: list[Event] = []
        if recipient:
            name = recipient.group(1).removeprefix("functions.")
            self.kind, self.call = "call", [name]
            events.append(("call_start", CallStart(name)))
        else:
            self.kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
        self.mode = "body"
        return events, k + len(MESSAGE), None

    def _body(self, buf: str, pos: int, final: bool) -> Step:
        text, end, found = text_until(buf, pos, _BODY_ENDS, final)
        kind = "call_args" if self.kind == "call" else self.kind
        events: list[Event] = [(kind, text)] if text else []  # type: ignore[list-item]
        if self.kind == "call":
            self.call.append(text)
        if found < 0:
            return events, end, None if end == len(buf) else ANY
        self.mode = "between"
        if _BODY_ENDS[found] != START:
            end += len(_BODY_ENDS[found])
        return events + self._end_call(), end, None

    def _end_call(self) -> list[Event]:
        if self.kind != "call":
            return []
        name, *fragments = self.call
        self.kind, self.call = "content", []
        return [("tool_call", ToolCall(name, "".join(fragments)))]

    def close(self) -> list[Event]:
        return self._end_call() if self.mode == "body" else []
