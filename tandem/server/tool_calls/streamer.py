"""Output text in, events out: streamed (``ToolCallStreamer``) or whole (``parse_output``),
the same either way for any split of the text."""

from __future__ import annotations

from typing import Any, NamedTuple

from tandem.server.tool_calls.base import Event, ToolCall, Wait
from tandem.server.tool_calls.formats import check_format, make_scanner


class ToolCallStreamer:
    """Feed text deltas; get events as soon as they are certain. Joined content events equal
    ``parse_output``'s content exactly: leading whitespace is dropped and whitespace is held
    until more content follows it. ``tools`` (the request's) type XML formats' parameters."""

    def __init__(self, fmt: str, tools: list[dict[str, Any]] | None = None) -> None:
        self.fmt = check_format(fmt)
        self._scanner = make_scanner(fmt, tools)
        self._buffer = ""
        self._started = False  # content emitted so far (leading whitespace is dropped)
        self._pending_ws = ""
        self._finished = False
        self._wait: Wait | None = None

    def feed(self, delta: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("feed after finish")
        self._buffer += delta
        triggers = self._wait.triggers if self._wait else ""
        if triggers and not any(c in delta for c in triggers):
            return []  # the pending block cannot be decided by this delta
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        if self._finished:
            return []
        events = self._drain(final=True) + self._shape(self._scanner.close())
        self._finished, self._pending_ws = True, ""
        return events

    def _drain(self, final: bool) -> list[Event]:
        events, consumed, self._wait = self._scanner.scan(self._buffer, final)
        self._buffer = self._buffer[consumed:]
        return self._shape(events)

    def _shape(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if event[0] != "content":
                out.append(event)
                continue
            text = self._pending_ws + (event[1] if self._started else event[1].lstrip())
            body = text.rstrip()
            self._pending_ws = text[len(body) :]
            if body:
                self._started = True
                out.append(("content", body))
        return out


class Parsed(NamedTuple):
    content: str
    reasoning: str
    calls: list[ToolCall]


def parse_output(text: str, fmt: str, tools: list[dict[str, Any]] | None = None) -> Parsed:
    """A complete output: content (without tool-call markup, stripped), reasoning (harmony's
    analysis channel) and calls."""
    streamer = ToolCallStreamer(fmt, tools)
    events = streamer.feed(text) + streamer.finish()
    return Parsed(
        "".join(v for k, v in events if k == "content" and isinstance(v, str)),
        "".join(v for k, v in events if k == "reasoning" and isinstance(v, str)),
        [v for k, v in events if k == "tool_call" and isinstance(v, ToolCall)],
    )


def parse_tool_calls(
    text: str, fmt: str, tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[ToolCall]]:
    """A complete output as (content without the tool-call markup, stripped; calls)."""
    parsed = parse_output(text, fmt, tools)
    return parsed.content, parsed.calls
