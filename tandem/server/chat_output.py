"""Shape a chat choice's generated text into OpenAI message fields: ``reasoning_content`` (the
leading ``<think>`` block), ``content`` and ``tool_calls`` — streamed as delta fields, or
whole. Text in, dicts out; the tokens never change."""

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
        parse = self.tools is not None and self.tools.choice == "auto" and self.fmt is not None
        self._streamer = tc.ToolCallStreamer(self.fmt) if parse and self.fmt else None
        self._forced = self.tools if self.tools is not None and self.tools.forced else None

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
        if reasoning:
            out["reasoning_content"] = reasoning
        new_calls: list[tc.ToolCall] = []
        if self._forced is not None:
            self._forced_text.append(content)
            content = ""
            if final:
                text = "".join(self._forced_text)
                new_calls = self._forced_calls(text)
                if not new_calls:
                    content = text  # cut short (max_tokens): the text, not silence
        elif self._streamer is not None:
            events = self._streamer.feed(content) if content else []
            if final:
                events += self._streamer.finish()
            content = "".join(e[1] for e in events if e[0] == "content")  # type: ignore[misc]
            new_calls = [e[1] for e in events if e[0] == "tool_call"]  # type: ignore[misc]
        if content:
            out["content"] = content
        if self.tools is not None and not self.tools.parallel:
            new_calls = new_calls[: max(0, 1 - len(self.calls))]  # parallel_tool_calls: false
        if new_calls:
            deltas = []
            for call in new_calls:
                cid = tc.make_call_id()
                deltas.append(tc.to_openai_delta(call, len(self.calls), cid))
                self.calls.append((call, cid))
            out["tool_calls"] = deltas
        return out

    def _forced_calls(self, text: str) -> list[tc.ToolCall]:
        assert self._forced is not None
        if self._forced.choice == "function":
            assert self._forced.name is not None
            return [tc.call_from_named(text, self._forced.name)]
        return tc.calls_from_required(text)
