"""Split a reasoning model's ``<think>…</think>`` block from its answer, streamed or whole.

Only a block at the very start of the output (leading whitespace allowed) is reasoning; a
``<think>`` later on is plain content. Whitespace right after the end tag is dropped, and an
output that stops inside the block (truncated) is all reasoning."""

from __future__ import annotations

from typing import Literal

THINK_START = "<think>"
THINK_END = "</think>"

_State = Literal["before", "reasoning", "after_end", "content"]


def partial_suffix(text: str, tag: str, start: int = 0) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Feed text deltas; get ``(reasoning_delta, content_delta)`` back. Text that could still be
    the start of a tag is held until it can't be; ``flush`` releases it at the end."""

    def __init__(self, start: str = THINK_START, end: str = THINK_END, *, inside: bool = False):
        if not start or not end:
            raise ValueError("reasoning start and end tags must be non-empty")
        self.start, self.end = start, end
        self._state: _State = "reasoning" if inside else "before"
        self._buffer = ""
        self.saw_reasoning = inside  # True once a reasoning block has begun

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = [], []
        while True:
            if self._state == "before":
                head = self._buffer.lstrip()
                if head.startswith(self.start):
                    self._buffer = head[len(self.start) :]
                    self._state, self.saw_reasoning = "reasoning", True
                    continue
                if self.start.startswith(head):  # whitespace or part of the tag so far
                    break
                self._state = "content"
                continue
            if self._state == "reasoning":
                i = self._buffer.find(self.end)
                if i >= 0:
                    reasoning.append(self._buffer[:i])
                    self._buffer = self._buffer[i + len(self.end) :]
                    self._state = "after_end"
                    continue
                cut = len(self._buffer) - partial_suffix(self._buffer, self.end)
                reasoning.append(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                break
            if self._state == "after_end":
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    break
                self._state = "content"
            content.append(self._buffer)
            self._buffer = ""
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """End of output: release what is held (reasoning if the block never closed)."""
        held, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return held, ""
        if self._state == "after_end":
            return "", ""
        return "", held


def split_reasoning(
    text: str, *, inside: bool = False, start: str = THINK_START, end: str = THINK_END
) -> tuple[str | None, str]:
    """A complete output as ``(reasoning, content)``; reasoning is None when there was no
    block. Equal to joining what a ``ReasoningSplitter`` streams for any split of ``text``."""
    splitter = ReasoningSplitter(start, end, inside=inside)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.flush()
    return (r1 + r2 if splitter.saw_reasoning else None), c1 + c2


def starts_inside(prompt_text: str, start: str = THINK_START) -> bool:
    """True when the rendered prompt already opened the reasoning block (generation starts
    inside it), e.g. templates whose generation prompt ends with ``<think>\\n``."""
    return bool(start) and prompt_text.rstrip().endswith(start)
