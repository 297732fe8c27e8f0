"""XML-style parameters (Qwen3-Coder, GLM-4.5, MiniMax-M2): each value is text, typed by the
request's tool schema (JSON for a number, integer, boolean, object or array parameter), and
the arguments stream as the JSON object built so far, one parameter at a time."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.server.tool_calls.base import ANY, OK, PARTIAL, Lit, Pattern, Wait, match_seq, skip_ws


@dataclass(frozen=True)
class XmlSpec:
    """How a format writes parameters: ``param`` opens one (capturing its name), its value
    runs to ``value_end`` (or to one of ``stops`` when that tag is missing), and one of
    ``ends`` (tag, consumed?) ends the call."""

    param: Pattern
    value_end: str
    stops: tuple[str, ...]
    ends: tuple[tuple[str, bool], ...]

    @property
    def triggers(self) -> str:
        tags = (self.value_end, *self.stops, *(t for t, _ in self.ends))
        return "".join(sorted({t[-1] for t in tags}))


def param_kind(schema: Any) -> str:
    """``"json"`` when a tool's schema says a parameter is not a string, else ``"string"``."""
    if not isinstance(schema, dict):
        return "string"
    types: set[str] = set()
    for node in (schema, *schema.get("anyOf", ()), *schema.get("oneOf", ())):
        if isinstance(node, dict):
            t = node.get("type")
            types |= {t} if isinstance(t, str) else {x for x in t or () if isinstance(x, str)}
            types |= {"object"} if "properties" in node else set()
            types |= {"array"} if "items" in node else set()
    return "json" if types and "string" not in types else "string"


def tool_properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    for tool in tools or ():
        function = tool.get("function") or {}
        if function.get("name") == name:
            props = (function.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter's value: JSON when its schema says so and it parses, else the text (less
    the newline templates put on either side)."""
    if param_kind(schema) == "json":
        text = raw.strip()
        try:
            return json.loads(text)
        except ValueError:
            if text.lower() in ("true", "false") and schema.get("type") == "boolean":
                return text.lower() == "true"
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


class XmlArgs:
    """XML parameters, streamed as the JSON object built so far: ``{"a": 1`` once ``a`` is
    complete, then ``, "b": "x"``, then ``}``."""

    def __init__(self, spec: XmlSpec, props: dict[str, Any]) -> None:
        self.spec, self.props = spec, props
        self.count = 0
        self.closed = False
        self.seen = 0  # text after ``pos`` already searched for the held value's end

    def read(self, buf: str, pos: int, final: bool) -> tuple[str, int, bool, Wait | None]:
        spec, out = self.spec, []
        while True:
            q = skip_ws(buf, pos)
            if q == len(buf):
                return self._result(out, pos, final, ANY)
            for tag, consumed in spec.ends:
                if buf.startswith(tag, q):
                    out.append(self._close())
                    return "".join(out), q + len(tag) if consumed else q, True, None
            status, e, captured = match_seq(buf, q, spec.param)
            ends_partial = any(Lit(t).match(buf, q)[0] == PARTIAL for t, _ in spec.ends)
            if status == OK:
                longest = max(len(t) for t in (spec.value_end, *spec.stops))
                found = self._value_end(buf, max(e, pos + self.seen - longest))
                if found is None and not final:  # hold from pos; a long value is searched once
                    self.seen = len(buf) - pos
                    return "".join(out), pos, False, Wait(spec.triggers)
                j, pos = found or (len(buf), len(buf))
                self.seen = 0
                out.append(self._param(captured[0], buf[e:j]))
                continue
            if status == PARTIAL or ends_partial:
                return self._result(out, pos, final, ANY)
            # Stray text between parameters: skip to the next tag we know.
            first = spec.param[0].text
            tags = (first, *(t for t, _ in spec.ends))
            nexts = [i for t in tags if (i := buf.find(t, q + 1)) >= 0]
            if not nexts:
                return self._result(out, pos, final, Wait(spec.triggers))
            pos = min(nexts)

    def _result(
        self, out: list[str], pos: int, final: bool, wait: Wait
    ) -> tuple[str, int, bool, Wait | None]:
        if final:
            return "".join([*out, self._close()]), pos, True, None
        return "".join(out), pos, False, wait

    def _value_end(self, buf: str, start: int) -> tuple[int, int] | None:
        spec = self.spec
        ends = [(buf.find(spec.value_end, start), len(spec.value_end))]
        ends += [(buf.find(s, start), 0) for s in spec.stops]
        found = [(i, i + n) for i, n in ends if i >= 0]
        return min(found) if found else None

    def _param(self, raw_name: str, raw_value: str) -> str:
        name = raw_name.strip().strip("\"'")
        value = typed_value(raw_value, self.props.get(name))
        text = json.dumps(name, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        self.count += 1
        return ("{" if self.count == 1 else ", ") + text

    def _close(self) -> str:
        self.closed = True
        return "}" if self.count else "{}"

    def close(self) -> str:
        return "" if self.closed else self._close()
