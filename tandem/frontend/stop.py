"""Stop strings matched on generated text, across token boundaries (OpenAI semantics: the
stop string and everything after it are removed)."""

from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas; get back the text that is safe to emit. Holds back the longest
    suffix that could still be the start of a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buffer = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the output

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self._buffer += text
        hits = [(i, s) for s in self.stops if (i := self._buffer.find(s)) >= 0]
        if hits:
            self.stopped = True
            at, self.matched = min(hits, key=lambda h: h[0])
            out, self._buffer = self._buffer[:at], ""
            return out
        cut = len(self._buffer) - self._hold if self._hold else len(self._buffer)
        if cut <= 0:
            return ""
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out

    def flush(self) -> str:
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out
