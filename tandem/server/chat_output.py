"""Shape a chat choice's generated text into OpenAI message fields: ``reasoning_content`` (the
leading ``<think>`` block, or harmony's analysis channel), ``content`` and ``tool_calls`` —
streamed as delta fields (a call's arguments as they are generated), or whole. Text in, dicts
out; the tokens never change."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.server import tool_calls as tc
from tandem.server.guided import ToolMode
from tandem.server.reasoning import ReasoningSplitter


@dataclass
class ChatOutput:
    """One choice. ``reasoning``: split a leading think block (``inside``: the prompt already
    opened it). ``tools``/``fmt``: how tool calls appear (auto: parsed from the text in the
    model's format; required/named: the whole text is the grammar-enforced JSON)."""

    reasoning: bool = False
    inside: bool = False
    tools: ToolMode | None = None
    fmt: str | None = None
    calls: list[tuple[tc.ToolCall, str]] = field(default_factory=list)
    _forced_text: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._splitter = ReasoningSplitter(inside=self.inside) if self.reasoning else None
        auto = self.tools is not None and self.tools.choice == "auto"
        parse = self.fmt is not None and (auto or self.fmt == "harmony")
        tools = self.tools.tools if self.tools is not None else None
        self._streamer = tc.ToolCallStreamer(self.fmt, tools) if parse and self.fmt else None
        self._forced = self.tools if self.tools is not None and self.tools.forced else None
        self._one_call = self.tools is not None and not self.tools.parallel
        self._dropping = False  # inside a call parallel_tool_calls=false leaves out
        self._later: list[tc.Event] = []  # events held for the next delta (see _in_order)
        self._named_ws = ""  # a named call's trailing whitespace, held until more follows

    def feed(self, text: str) -> dict[str, Any]:
        """Delta fields for a piece of text (possibly none while a tag is incomplete)."""
        reasoning, content = self._splitter.feed(text) if self._splitter else ("", text)
        return self._shape(reasoning, content, final=False)

    def finish(self) -> dict[str, Any]:
        """Whatever was held back, once the output has ended."""
        reasoning, content = self._splitter.flush() if self._splitter else ("", "")
        return self._shape(reasoning, content, final=True)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self, text: str) -> dict[str, Any]:
        """The whole ``message`` of a non-streamed choice."""
        parts = [self.feed(text), self.finish()]
        msg: dict[str, Any] = {"role": "assistant"}
        reasoning = "".join(p.get("reasoning_content", "") for p in parts)
        content = "".join(p.get("content", "") for p in parts)
        msg["content"] = content if content or not self.calls else None
        if reasoning or self.reasoning:
            msg["reasoning_content"] = reasoning if reasoning else None
        if self.calls:
            msg["tool_calls"] = [tc.to_openai(c, cid) for c, cid in self.calls]
        return msg

    def _shape(self, reasoning: str, content: str, *, final: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        deltas: list[dict[str, Any]] = []
        if self._forced is not None and self._forced.choice == "function":
            deltas = self._named_deltas(content, final)
            content = ""
        elif self._forced is not None:
            self._forced_text.append(content)
            content = ""
            if final:
                text = "".join(self._forced_text)
                calls = self._forced_calls(text)
                if not calls:
                    content = text  # cut short (max_tokens): the text, not silence
                for call in calls[: 1 if self._one_call else None]:
                    cid = tc.make_call_id()
                    deltas.append(tc.to_openai_delta(call, len(self.calls), cid))
                    self.calls.append((call, cid))
        elif self._streamer is not None:
            events = self._later + (self._streamer.feed(content) if content else [])
            if final:
                events += self._streamer.finish()
            events, self._later = (events, []) if final else _in_order(events)
            content = "".join(v for k, v in events if k == "content" and isinstance(v, str))
            reasoning += "".join(v for k, v in events if k == "reasoning" and isinstance(v, str))
            deltas = self._call_deltas(events)
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if deltas:
            out["tool_calls"] = deltas
        return out

    def _call_deltas(self, events: list[tc.Event]) -> list[dict[str, Any]]:
        """``delta.tool_calls`` entries: a call's first carries its index, id, type, name and
        the arguments so far; later ones its index and more arguments. Consecutive fragments
        of one call share an entry."""
        entries: list[dict[str, Any]] = []
        for kind, value in events:
            if kind == "call_start" and isinstance(value, tc.CallStart):
                self._dropping = self._one_call and len(self.calls) >= 1
                if self._dropping:
                    continue
                cid = value.id or tc.make_call_id()
                function = {"name": value.name, "arguments": ""}
                entries.append({"index": len(self.calls), "id": cid, "type": "function"})
                entries[-1]["function"] = function
                self.calls.append((tc.ToolCall(value.name, ""), cid))
            elif kind == "call_args" and isinstance(value, str) and not self._dropping:
                index = len(self.calls) - 1
                call, cid = self.calls[index]
                self.calls[index] = (tc.ToolCall(call.name, call.arguments + value), cid)
                if entries and entries[-1]["index"] == index:
                    entries[-1]["function"]["arguments"] += value
                else:
                    entries.append({"index": index, "function": {"arguments": value}})
            elif kind == "tool_call" and isinstance(value, tc.ToolCall):
                if not self._dropping:
                    self.calls[-1] = (value, self.calls[-1][1])
                self._dropping = False
        return entries

    def _named_deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """A named tool_choice: the whole output is the call's arguments (grammar-enforced
        JSON), streamed as generated; surrounding whitespace is dropped, as whole."""
        assert self._forced is not None and self._forced.name is not None
        text = self._named_ws + text
        if not self.calls:
            text = text.lstrip()
        body = text if final else text.rstrip()
        self._named_ws = "" if final else text[len(body) :]
        if final:
            body = body.rstrip()
        if not self.calls:
            if not body and not final:
                return []
            cid = tc.make_call_id()
            self.calls.append((tc.ToolCall(self._forced.name, body), cid))
            function = {"name": self._forced.name, "arguments": body}
            return [{"index": 0, "id": cid, "type": "function", "function": function}]
        if not body:
            return []
        call, cid = self.calls[0]
        self.calls[0] = (tc.ToolCall(call.name, call.arguments + body), cid)
        return [{"index": 0, "function": {"arguments": body}}]

    def _forced_calls(self, text: str) -> list[tc.ToolCall]:
        return tc.calls_from_required(text)


def _in_order(events: list[tc.Event]) -> tuple[list[tc.Event], list[tc.Event]]:
    """Events for this delta, and those held for the next. A delta's fields carry no order
    between them, and consumers read reasoning and content before tool calls; so text that
    follows a call's events waits for the next delta."""
    seen_call = False
    for i, (kind, _) in enumerate(events):
        if kind in ("content", "reasoning") and seen_call:
            return events[:i], events[i:]
        seen_call = seen_call or kind not in ("content", "reasoning")
    return events, []
