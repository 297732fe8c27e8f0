"""Tool calls in model output text (Hermes, Llama 3 JSON, Mistral), whole or streamed, plus the
JSON schemas that enforce ``tool_choice`` and the validation of a request's ``tools``.

Model output never raises here: whatever does not parse as a tool call stays content."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from tandem.server.reasoning import partial_suffix

FORMATS = ("hermes", "llama3_json", "mistral")
MAX_TOOLS = 128

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")
_MISTRAL_NAME = re.compile(r"[^\s\[\]{}]+")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


Event = tuple[Literal["content"], str] | tuple[Literal["tool_call"], ToolCall]


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


# --- calls from decoded JSON -------------------------------------------------------------


def _arguments_json(value: Any) -> str | None:
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


def _call_from_obj(
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
    arguments = _arguments_json(obj[key] if key is not None else None)
    return None if arguments is None else ToolCall(name.strip(), arguments)


def _skip_ws(text: str, pos: int) -> int:
    m = _WS.match(text, pos)
    return m.end() if m else pos


def _decode_at(text: str, pos: int) -> tuple[Any, int] | None:
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


# --- block resolvers ---------------------------------------------------------------------
# A resolver looks at the markup starting at ``buf[i]`` and returns (items, end): the calls it
# holds, or the markup as content text, and where scanning resumes. With ``final=False`` it
# returns a Wait while more text could still change the answer; any answer it gives is the one
# it would give on every longer text, which is what makes streaming equal to parsing.


class Wait(NamedTuple):
    """Undecided until more text comes; only text holding one of ``triggers`` (any text when
    empty) can decide it, so the streamer skips re-scanning a long block for other deltas."""

    triggers: str


ANY = Wait("")
Item = str | ToolCall
Resolved = tuple[list[Item], int] | Wait
Resolver = Callable[[str, int, bool], Resolved]


def _resolve_hermes(buf: str, i: int, final: bool) -> Resolved:
    body = i + len(HERMES_OPEN)
    q = _skip_ws(buf, body)
    if q == len(buf) and not final:
        return ANY
    if q < len(buf) and buf[q] == "{":
        decoded = _decode_at(buf, q)
        if decoded is None and not final:
            return Wait("}")  # an unfinished object can only end at a "}"
        call = _call_from_obj(decoded[0]) if decoded else None
        if decoded and call:
            r = _skip_ws(buf, decoded[1])
            if buf.startswith(HERMES_CLOSE, r):
                return [call], r + len(HERMES_CLOSE)
            if HERMES_CLOSE.startswith(buf[r:]):  # nothing or part of the tag yet
                return ([call], len(buf)) if final else ANY
    # Malformed: the block up to its closing tag stays content.
    c = buf.find(HERMES_CLOSE, body)
    if c >= 0:
        return [buf[i : c + len(HERMES_CLOSE)]], c + len(HERMES_CLOSE)
    return ([buf[i:]], len(buf)) if final else Wait(">")


def _resolve_mistral(buf: str, i: int, final: bool) -> Resolved:
    body = i + len(MISTRAL_CALLS)
    malformed: Resolved = ([MISTRAL_CALLS], body)  # the marker stays content; scan on after it
    q = _skip_ws(buf, body)
    if q == len(buf):
        return malformed if final else ANY
    if buf[q] == "[":  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
        decoded = _decode_at(buf, q)
        if decoded is None:
            return malformed if final else Wait("]")
        items, end = decoded
        calls = [_call_from_obj(x) for x in items] if isinstance(items, list) else []
        if calls and all(c is not None for c in calls):
            return [c for c in calls if c is not None], end
        return malformed
    # [TOOL_CALLS]name[ARGS]{...}, also name[CALL_ID]id[ARGS]{...}
    k = buf.find(MISTRAL_ARGS, body)
    if k < 0:
        return malformed if final else Wait("]")
    name = buf[body:k].split(MISTRAL_CALL_ID, 1)[0].strip()
    if not _MISTRAL_NAME.fullmatch(name):
        return malformed
    a = _skip_ws(buf, k + len(MISTRAL_ARGS))
    if a == len(buf):
        return malformed if final else ANY
    if buf[a] != "{":
        return malformed
    decoded = _decode_at(buf, a)
    if decoded is None:
        return malformed if final else Wait("}")
    arguments = _arguments_json(decoded[0]) if isinstance(decoded[0], dict) else None
    return ([ToolCall(name, arguments)], decoded[1]) if arguments else malformed


Scanned = tuple[list[Item], int, Wait | None]


def _scan_blocks(buf: str, marker: str, resolve: Resolver, final: bool) -> Scanned:
    """Content and calls from ``buf``, how much of it was consumed, and what the rest waits for
    when it is an undecided block."""
    out: list[Item] = []
    pos = 0
    while pos < len(buf):
        i = buf.find(marker, pos)
        if i < 0:  # hold back what could be the start of the marker
            end = len(buf) if final else len(buf) - partial_suffix(buf, marker, pos)
            if end > pos:
                out.append(buf[pos:end])
            return out, end, None
        if i > pos:
            out.append(buf[pos:i])
        resolved = resolve(buf, i, final)
        if isinstance(resolved, Wait):
            return out, i, resolved
        items, pos = resolved
        out.extend(items)
    return out, pos, None


def _parse_llama3(text: str) -> list[Item]:
    """All-or-nothing: the output is one or more ``;``-separated call objects, else content."""
    pos = _skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, pos):
        pos = _skip_ws(text, pos + len(PYTHON_TAG))
    calls: list[Item] = []
    while pos < len(text) and text[pos] == "{":
        decoded = _decode_at(text, pos)
        if decoded is None:
            return [text]
        call = _call_from_obj(decoded[0], ("parameters", "arguments"), need_args=True)
        if call is None:
            return [text]
        calls.append(call)
        pos = _skip_ws(text, decoded[1])
        if pos < len(text) and text[pos] == ";":
            pos = _skip_ws(text, pos + 1)
    return calls if calls and pos == len(text) else [text]


def _scan(buf: str, fmt: str, final: bool) -> Scanned:
    if fmt == "hermes":
        return _scan_blocks(buf, HERMES_OPEN, _resolve_hermes, final)
    if fmt == "mistral":
        return _scan_blocks(buf, MISTRAL_CALLS, _resolve_mistral, final)
    # llama3_json: decided by how the output begins.
    head = buf.lstrip()
    if head.startswith(("{", PYTHON_TAG)):
        return (_parse_llama3(buf), len(buf), None) if final else ([], 0, ANY)
    if not final and PYTHON_TAG.startswith(head):  # whitespace or part of the tag so far
        return [], 0, ANY
    return [buf], len(buf), None


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; expected one of {FORMATS}")
    return fmt


def parse_tool_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """A complete output as (content without the tool-call markup, stripped; calls)."""
    items, _, _ = _scan(text, _check_format(fmt), final=True)
    content = "".join(x for x in items if isinstance(x, str)).strip()
    return content, [x for x in items if isinstance(x, ToolCall)]


class ToolCallStreamer:
    """Feed text deltas; get content and tool-call events as soon as they are certain.
    Joined content events equal ``parse_tool_calls``'s content exactly: leading whitespace is
    dropped and whitespace is held until more content follows it."""

    def __init__(self, fmt: str) -> None:
        self.fmt = _check_format(fmt)
        self._buffer = ""
        self._started = False  # content emitted so far (leading whitespace is dropped)
        self._pending_ws = ""
        self._finished = False
        self._plain = False  # llama3_json: the output did not start as JSON, all is content
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
        events = self._drain(final=True)
        self._finished, self._pending_ws = True, ""
        return events

    def _drain(self, final: bool) -> list[Event]:
        if self._plain:
            items, consumed, self._wait = [self._buffer], len(self._buffer), None
        else:
            items, consumed, self._wait = _scan(self._buffer, self.fmt, final)
            # llama3_json decides once, on how the output begins
            self._plain = self.fmt == "llama3_json" and consumed > 0
        self._buffer = self._buffer[consumed:]
        events: list[Event] = []
        for item in items:
            if isinstance(item, ToolCall):
                events.append(("tool_call", item))
                continue
            text = self._pending_ws + (item if self._started else item.lstrip())
            body = text.rstrip()
            self._pending_ws = text[len(body) :]
            if body:
                self._started = True
                events.append(("content", body))
        return events


# --- which format a model uses -----------------------------------------------------------

_LLAMA3_HINTS = ("<|python_tag|>", "ipython", "respond with a json for a function call")


def detect_format(chat_template: str | None, model_type: str | None = None) -> str | None:
    """The tool call format a model emits, from its chat template, else its model_type."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_CALLS in template:
        return "mistral"
    lowered = template.lower()
    if any(hint in lowered for hint in _LLAMA3_HINTS):
        return "llama3_json"
    kind = (model_type or "").lower()
    if kind.startswith("qwen"):
        return "hermes"
    if kind.startswith(("mistral", "mixtral", "ministral")):
        return "mistral"
    if kind.startswith("llama"):
        return "llama3_json"
    return None


# --- tools in requests and tool_choice enforcement ---------------------------------------


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` if well formed, else ValueError naming the problem."""
    if not isinstance(tools, list):
        raise ValueError("tools must be an array")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools may hold at most {MAX_TOOLS} entries, got {len(tools)}")
    seen: set[str] = set()
    for n, tool in enumerate(tools):
        where = f"tools[{n}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object")
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is used by an earlier tool")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"{where}.function.parameters must be an object (a JSON schema)")
    return tools


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def _rebase(node: Any, base: str) -> Any:
    """A copy of a schema whose local references (``#...``) point below ``base``."""
    if isinstance(node, dict):
        out = {k: _rebase(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(node, list):
        return [_rebase(v, base) for v in node]
    return node


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Schema for ``tool_choice="required"``: a non-empty array of ``{name, parameters}``.
    Each tool's parameters live under ``$defs/tool_i`` with their own references rebased
    there, so schemas with ``$ref`` / ``$defs`` (e.g. from Pydantic) keep resolving."""
    if not tools:
        raise ValueError("tool_choice 'required' needs at least one tool")
    defs = {f"tool_{i}": _rebase(_parameters(t), f"#/$defs/tool_{i}") for i, t in enumerate(tools)}
    choices = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "parameters": {"$ref": f"#/$defs/tool_{i}"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, tool in enumerate(tools)
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": choices}, "$defs": defs}


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Schema for ``tool_choice={"type": "function", "function": {"name": name}}``."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return _parameters(tool)
    raise ValueError(f"tool_choice names function {name!r}, which is not in tools")


def calls_from_required(text: str) -> list[ToolCall]:
    """Calls from output generated under ``required_schema``; [] if it is not such an array
    (e.g. cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = [_call_from_obj(x, ("parameters", "arguments"), need_args=True) for x in items]
    return [c for c in calls if c is not None] if all(c is not None for c in calls) else []


def call_from_named(text: str, name: str) -> ToolCall:
    """The call from output generated under ``named_schema``. Arguments that are not valid
    JSON (cut short) are passed on as generated, as OpenAI does."""
    try:
        arguments = json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        arguments = text.strip()
    return ToolCall(name, arguments)
