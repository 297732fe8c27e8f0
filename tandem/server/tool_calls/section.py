"""The scanner that most formats are: text, then blocks opened by a marker that hold one or
more calls, each a header naming the function and its arguments (JSON, or XML parameters).

A scanner keeps its state between scans; each scan sees the text not yet consumed and
consumes only what every continuation would parse the same way, so streaming equals parsing.
Once a call's header has matched, the call stands: its arguments stream as they come."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.server.tool_calls.base import (
    ANY,
    FAIL,
    OK,
    PARTIAL,
    CallStart,
    Event,
    JsonSpan,
    Pattern,
    ToolCall,
    Wait,
    call_from_obj,
    decode_at,
    match_seq,
    partial_suffix,
    whole_call,
)
from tandem.server.tool_calls.xml_params import XmlArgs, XmlSpec, tool_properties

Step = tuple[list[Event], int, Wait | None]  # events, where scanning resumes, what it waits for


class Scanner(ABC):
    """Turns output text into events. ``scan`` may be called again with more text appended
    to what it did not consume; ``close`` ends the output (after a final scan)."""

    mode = "text"

    def scan(self, buf: str, final: bool) -> Step:
        events: list[Event] = []
        pos = 0
        while pos < len(buf):
            mode = self.mode
            step_events, end, wait = self.step(buf, pos, final)
            events += step_events
            if wait is not None:
                return events, end, wait
            assert end > pos or self.mode != mode, f"no progress in mode {mode}"
            pos = end
        return events, pos, None

    @abstractmethod
    def step(self, buf: str, pos: int, final: bool) -> Step:
        """Events from ``buf[pos:]`` up to where this mode ends, that end, and what an
        undecided rest waits for."""

    def close(self) -> list[Event]:
        return []


def text_until(buf: str, pos: int, markers: tuple[str, ...], final: bool) -> tuple[str, int, int]:
    """Content from ``pos`` up to the first marker (holding back what could begin one):
    (content, where it ends, index of the marker found or -1)."""
    found = [(i, n) for n, m in enumerate(markers) if (i := buf.find(m, pos)) >= 0]
    if found:
        i, n = min(found)
        return buf[pos:i], i, n
    hold = 0 if final else max(partial_suffix(buf, m, pos) for m in markers)
    return buf[pos : len(buf) - hold], len(buf) - hold, -1


# --- arguments -------------------------------------------------------------------------------


class JsonArgs:
    """Arguments that are one JSON object: the fragments are its raw text."""

    def __init__(self) -> None:
        self.span = JsonSpan()

    def read(self, buf: str, pos: int, final: bool) -> tuple[str, int, bool, Wait | None]:
        end, done = self.span.read(buf, pos)
        return buf[pos:end], end, done, None

    def close(self) -> str:
        return ""


# --- sections ------------------------------------------------------------------------------


def last_capture(captured: list[Any]) -> CallStart | None:
    name = captured[-1].strip() if captured and isinstance(captured[-1], str) else ""
    return CallStart(name) if name else None


@dataclass(frozen=True)
class CallForm:
    """One way a call is written: ``head`` (naming it, ``name_of`` its captures) is followed
    by the arguments, then by ``tail``."""

    head: Pattern
    tail: Pattern = ()
    name_of: Callable[[list[Any]], CallStart | None] = last_capture


@dataclass(frozen=True)
class Section:
    """A block after the open marker: ``first``, then calls in one of ``forms`` separated by
    ``sep`` (None: one call per block), then ``close``. ``whole_items``: a later item
    no form matches may be a complete ``{"name": ..., "arguments": ...}`` object."""

    first: Pattern
    forms: tuple[CallForm, ...]
    sep: Pattern | None = None
    close: Pattern = ()
    whole_items: bool = False


Fallback = Callable[[str, int, bool], tuple[list[Event], int] | Wait]


class SectionScanner(Scanner):
    """Text with call blocks that start with ``open``. A block no section matches goes to
    ``fallback`` (default: the marker stays content). ``xml``: XML parameters, typed by the
    request's ``tools``; else JSON arguments."""

    def __init__(
        self,
        open_marker: str,
        sections: tuple[Section, ...],
        *,
        tools: list[dict[str, Any]] | None = None,
        xml: XmlSpec | None = None,
        fallback: Fallback | None = None,
    ) -> None:
        self.open, self.sections, self.tools, self.xml = open_marker, sections, tools, xml
        self.fallback = fallback
        self.section, self.form = sections[0], sections[0].forms[0]
        self.reader: JsonArgs | XmlArgs | None = None
        self.call: list[str] = []  # the open call's name, then its fragments

    def step(self, buf: str, pos: int, final: bool) -> Step:
        return getattr(self, f"_{self.mode}")(buf, pos, final)

    def close(self) -> list[Event]:
        if self.mode != "args" or self.reader is None:
            return []
        tail = self.reader.close()
        self.call.append(tail)
        return ([("call_args", tail)] if tail else []) + self._end_call()

    def _text(self, buf: str, pos: int, final: bool) -> Step:
        text, end, found = text_until(buf, pos, (self.open,), final)
        events: list[Event] = [("content", text)] if text else []
        if found >= 0:
            self.mode = "open"
            return events, end, None
        return events, end, None if end == len(buf) else ANY

    def _open(self, buf: str, pos: int, final: bool) -> Step:
        statuses = []
        for section in self.sections:
            status, q, _ = match_seq(buf, pos + len(self.open), section.first)
            if status == OK:
                status, begun = self._head(buf, q, section)
                if begun is not None:
                    return begun
            statuses.append(status)
        if PARTIAL in statuses and not final:
            return [], pos, ANY
        self.mode = "text"
        if self.fallback is None:
            return [("content", self.open)], pos + len(self.open), None
        resolved = self.fallback(buf, pos, final)
        if isinstance(resolved, Wait):
            self.mode = "open"
            return [], pos, resolved
        return resolved[0], resolved[1], None

    def _head(self, buf: str, q: int, section: Section) -> tuple[int, Step | None]:
        statuses = []
        for form in section.forms:
            status, end, captured = match_seq(buf, q, form.head)
            start = form.name_of(captured) if status == OK else None
            if start is not None:
                self.section, self.form, self.mode = section, form, "args"
                props = tool_properties(self.tools, start.name)
                self.reader = XmlArgs(self.xml, props) if self.xml else JsonArgs()
                self.call = [start.name]
                return OK, ([("call_start", start)], end, None)
            statuses.append(FAIL if status == OK else status)
        return (PARTIAL if PARTIAL in statuses else FAIL), None

    def _args(self, buf: str, pos: int, final: bool) -> Step:
        assert self.reader is not None
        fragment, end, done, wait = self.reader.read(buf, pos, final)
        events: list[Event] = [("call_args", fragment)] if fragment else []
        self.call.append(fragment)
        if done:
            self.mode = "tail"
            return events + self._end_call(), end, None
        return events, end, wait if end < len(buf) else None

    def _end_call(self) -> list[Event]:
        name, *fragments = self.call
        self.reader, self.call = None, []
        return [("tool_call", ToolCall(name, "".join(fragments)))]

    def _tail(self, buf: str, pos: int, final: bool) -> Step:
        status, end, _ = match_seq(buf, pos, self.form.tail)
        if status == PARTIAL and not final:
            return [], pos, ANY
        if status == OK:
            one = "end" if self.section.close else "text"
            self.mode = "next" if self.section.sep is not None else one
            return [], end, None
        self.mode = "text"  # a cut-off tail is dropped; anything else is content
        return [], len(buf) if status == PARTIAL else pos, None

    def _end(self, buf: str, pos: int, final: bool) -> Step:
        """After the call of a one-call block: its closing markup."""
        status, end, _ = match_seq(buf, pos, self.section.close)
        if status == PARTIAL and not final:
            return [], pos, ANY
        self.mode = "text"
        return [], end if status == OK else len(buf) if status == PARTIAL else pos, None

    def _next(self, buf: str, pos: int, final: bool) -> Step:
        section = self.section
        assert section.sep is not None
        status, end, _ = match_seq(buf, pos, section.close)
        if status == OK or (status == PARTIAL and final):
            self.mode = "text"
            return [], end, None
        statuses = [status]
        status, q, _ = match_seq(buf, pos, section.sep)
        if status == OK:
            status, begun = self._head(buf, q, section)
            if begun is not None:
                return begun
            if status == FAIL and section.whole_items:
                whole = self._whole_item(buf, q, final)
                if whole is not None:  # waiting: rescan from before the separator
                    return ([], pos, whole[2]) if whole[2] is not None else whole
        statuses.append(status)
        if PARTIAL in statuses and not final:
            return [], pos, ANY
        self.mode = "text"
        return [], pos, None

    def _whole_item(self, buf: str, q: int, final: bool) -> Step | None:
        if q == len(buf) or buf[q] != "{":
            return None
        decoded = decode_at(buf, q)
        if decoded is None:
            return None if final else ([], q, Wait("}"))
        call = call_from_obj(decoded[0])
        return (whole_call(call), decoded[1], None) if call else None
