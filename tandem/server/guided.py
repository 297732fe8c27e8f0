"""Request fields that constrain the output: ``response_format``, the ``guided_*``
extensions, ``tools`` / ``tool_choice``. They become one (kind, spec) grammar for the engine
(SamplingParams.guided) plus, for chat, how to read tool calls back out of the text.

The grammar is checked here (llguidance, no tokenizer needed) so a bad one is a 400 naming
the field before anything reaches the engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.grammar import JSON_OPTIONS, grammar_text
from tandem.sampling_params import MAX_GUIDED_SPEC
from tandem.server import tool_calls
from tandem.server.errors import RequestError
from tandem.server.tool_calls.grammar import THINK_TAGS

# Extensions (vLLM's names): at most one guided source per request.
GUIDED_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
    "guided_choice": "choice",
}
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar", "choice")


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's output carries tool calls."""

    tools: list[dict[str, Any]]
    choice: str  # "none" | "auto" | "required" | "function" (``name`` set)
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The grammar enforces the call: the whole output is its JSON."""
        return self.choice in ("required", "function")

    @property
    def strict(self) -> bool:
        """Under auto, a strict tool's calls are enforced by a grammar (strict_tool_grammar)."""
        return self.choice == "auto" and any(tool_calls.is_strict(t) for t in self.tools)


def check_grammar(kind: str, spec: str, param: str) -> tuple[str, str]:
    import llguidance

    if len(spec) > MAX_GUIDED_SPEC:
        raise RequestError(f"'{param}' is longer than {MAX_GUIDED_SPEC} characters", param=param)
    try:
        err = llguidance.LLMatcher.validate_grammar(grammar_text(kind, spec))
    except ValueError as e:
        raise RequestError(f"invalid {kind} in '{param}': {e}", param=param) from None
    if err:
        raise RequestError(f"invalid {kind} in '{param}': {err.strip()}", param=param)
    return kind, spec


def _response_format(rf: Any) -> tuple[str, str] | None:
    param = "response_format"
    if not isinstance(rf, dict) or rf.get("type") not in RESPONSE_FORMATS:
        raise RequestError(
            f"'response_format' must be an object with type one of {', '.join(RESPONSE_FORMATS)}",
            param=param,
        )
    kind = rf["type"]
    allowed = {"type", kind} if kind not in ("text", "json_object") else {"type"}
    if extra := set(rf) - allowed:
        raise RequestError(
            f"'response_format' of type {kind} has no field {sorted(extra)[0]!r}", param=param
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return check_grammar("json_object", "", param)
    if kind == "json_schema":
        js = rf.get("json_schema")
        keys = {"name", "schema", "strict", "description"}
        if (
            not isinstance(js, dict)
            or set(js) - keys
            or not isinstance(js.get("schema", {}), dict | bool)
        ):
            raise RequestError(
                "'response_format.json_schema' must be an object with a 'schema' object "
                "(and optionally name, description, strict)",
                param="response_format.json_schema",
            )
        return _constraint("json_schema", js.get("schema", {}), "response_format.json_schema")
    return _constraint(kind, rf.get(kind), f"response_format.{kind}")


def _extension(body: dict[str, Any], key: str) -> tuple[str, str]:
    kind, value = GUIDED_FIELDS[key], body[key]
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RequestError(f"'{key}' is not valid JSON: {e}", param=key) from None
    return _constraint(kind, value, key)


def _constraint(kind: str, value: Any, param: str) -> tuple[str, str]:
    """One constraint's value, type-checked and validated as a grammar."""
    if kind == "json_schema":
        if not isinstance(value, dict | bool):
            raise RequestError(f"'{param}' must be a JSON schema object", param=param)
        return check_grammar(kind, json.dumps(value), param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise RequestError(f"'{param}' must be a non-empty list of strings", param=param)
        return check_grammar(kind, json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{param}' must be a non-empty string", param=param)
    return check_grammar(kind, value, param)


def guided_source(body: dict[str, Any]) -> str:
    """The request field a constraint came from (for error messages)."""
    return next((k for k in GUIDED_FIELDS if body.get(k) is not None), "response_format")


def parse_guided(body: dict[str, Any]) -> tuple[str, str] | None:
    """The one grammar ``response_format`` or a ``guided_*`` field asks for (None: free)."""
    sources = [k for k in GUIDED_FIELDS if body.get(k) is not None]
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        sources.append("response_format")
    if len(sources) > 1:
        raise RequestError(f"at most one of {', '.join(sources)} may be given", param=sources[1])
    if not sources:
        if rf is not None:
            _response_format(rf)  # {"type": "text"}: checked, nothing to enforce
        return None
    if sources[0] == "response_format":
        return _response_format(rf)
    return _extension(body, sources[0])


def parse_tools(body: dict[str, Any], guided: tuple[str, str] | None) -> ToolMode | None:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat request."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise RequestError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    try:
        tools = tool_calls.validate_tools(raw)
    except ValueError as e:
        raise RequestError(str(e), param="tools") from None
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if (
            choice.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise RequestError(
                "'tool_choice' must be none, auto, required or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        name, choice = fn["name"], "function"
        if not any(t["function"]["name"] == name for t in tools):
            raise RequestError(
                f"'tool_choice' names unknown function {name!r}", param="tool_choice"
            )
    elif choice not in ("none", "auto", "required"):
        raise RequestError(
            "'tool_choice' must be none, auto, required or a function", param="tool_choice"
        )
    mode = ToolMode(tools, choice, name, parallel is not False)
    if mode.forced and guided is not None:
        raise RequestError(
            "'tool_choice' required or a named function cannot be combined with "
            "'response_format' or guided_* fields",
            param="tool_choice",
        )
    if mode.strict and guided is not None:
        raise RequestError(
            "'strict' tools under tool_choice auto cannot be combined with 'response_format' "
            "or guided_* fields (both would constrain the output)",
            param="tools",
        )
    return mode


def tool_grammar(mode: ToolMode) -> tuple[str, str] | None:
    """The grammar enforcing a required or named tool choice."""
    if mode.choice == "function":
        assert mode.name is not None
        schema = tool_calls.named_schema(mode.tools, mode.name)
    elif mode.choice == "required":
        schema = tool_calls.required_schema(mode.tools)
        if not mode.parallel:
            schema = {**schema, "maxItems": 1}
    else:
        return None
    return check_grammar("json_schema", json.dumps(schema), "tools")


def strict_tool_grammar(
    mode: ToolMode,
    fmt: str | None,
    encode: Callable[[str], list[int]],
    *,
    reasoning: bool = False,
    inside: bool = False,
) -> tuple[str, str] | None:
    """The grammar enforcing ``strict`` tools under ``tool_choice: "auto"`` (None when there
    are none): free text, or calls in the model's format ``fmt`` whose arguments follow the
    tool's schema. ``encode`` (text -> token ids, no special tokens added) finds the markers
    that are single tokens. ``reasoning``: a leading think block stays free (``inside``: the
    prompt opened it). A format whose markup cannot be expressed is a 400, not ignored."""
    if not mode.strict:
        return None
    if fmt is None:
        raise RequestError("'strict' tools need the model's tool-call format", param="tools")
    ids = tool_calls.single_token_ids(tool_calls.grammar_markers(fmt), encode)
    body = tool_calls.call_grammar(fmt, mode.tools, ids, parallel=mode.parallel)
    if body is None:
        raise RequestError(
            f"'strict' tools under tool_choice auto are not supported with the {fmt} tool-call "
            "format for this tokenizer; use tool_choice 'required' or a named function",
            param="tools",
        )
    # harmony's reasoning is a channel of its own, inside the format's grammar
    start = _think_first(ids, inside) if reasoning and fmt != "harmony" else "start: body\n"
    return check_grammar("grammar", start + body, "tools")


def _think_first(ids: dict[str, int], inside: bool) -> str:
    """``start`` for a free think block before ``body``. Its tags are tokens where the
    vocabulary has them; the thought may hold the format's marker tokens (free text cannot)."""
    close, opening = (f"<[{ids[t]}]>" if t in ids else json.dumps(t) for t in THINK_TAGS[::-1])
    markers = ",".join(str(i) for m, i in ids.items() if m not in THINK_TAGS)
    piece = f"(THOUGHT | <[{markers}]>)*" if markers else "THOUGHT?"
    lines = ["THOUGHT: /(?s:.+)/ & ~/(?s:.*)<\\/think>(?s:.*)/"]
    if "</think>" in ids:
        lines.append(f"thought: {piece} {close}")
    else:  # text then the literal tag, as one lexeme
        lines += [
            f"thought: {piece} THOUGHT_END",
            'THOUGHT_END: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/ "</think>"',
        ]
    start = "start: thought body" if inside else f"start: ({opening} thought)? body"
    return "\n".join([start, *lines]) + "\n"


# Reasoning models think first: the constraint applies after the think block, which the model
# may also skip (a template that disabled thinking) — or is already inside (the prompt opened
# it). The thought itself is free text up to </think>.
_NO_CLOSE = "/(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/"  # text without the closing tag's text


def think_block(ids: dict[str, int], *, inside: bool, budget: int | None = None) -> tuple[str, str]:
    """A leading think block for a Lark grammar: (the expression that opens ``start``, the
    rules it needs). Tags that are one token in the vocabulary (Qwen3's are special tokens,
    which a text literal never matches) are written as that token. ``budget``: the thought
    has at most that many tokens, then the closing tag is the only way on."""
    attr = f"max_tokens={budget}" if budget else ""
    opening, close = (f"<[{ids[t]}]>" if t in ids else json.dumps(t) for t in THINK_TAGS)
    if "</think>" in ids:
        rules = f"thought{f'[{attr}]' if attr else ''}: THOUGHT\nTHOUGHT: {_NO_CLOSE}\n"
    else:  # the stop string ends the thought; the literal is what a spent budget forces
        rules = f'thought[stop="</think>"{", " + attr if attr else ""}]: /(.|\\n)*/\n'
    block = f"thought {close}" if inside else f"({opening} thought {close})?"
    return block, rules


def after_reasoning(
    guided: tuple[str, str],
    inside: bool,
    param: str = "response_format",
    ids: dict[str, int] | None = None,
) -> tuple[str, str]:
    """The same constraint, applied after a leading <think>…</think> block (Lark). ``ids``:
    the think tags that are single tokens (``think_tag_ids``)."""
    kind, spec = guided
    if kind in ("json_schema", "json_object"):
        schema = json.loads(spec) if kind == "json_schema" else {"type": "object"}
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": JSON_OPTIONS}
        body = f"body: %json {json.dumps(schema)}\n"
    elif kind == "regex":
        body = f"body: BODY\nBODY: /{_lark_regex(spec)}/\n"
    elif kind == "choice":
        options = json.loads(spec)
        body = "body: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in options) + "\n"
    else:
        return guided  # a user grammar is taken as it is
    block, rules = think_block(ids or {}, inside=inside)
    start = f"start: {block} GAP body\nGAP: /[ \\n]{{0,4}}/\n"
    return check_grammar("grammar", start + rules + body, param)


def think_tag_ids(encode: Callable[[str], list[int]]) -> dict[str, int]:
    """The think tags the tokenizer encodes as one token, with their ids."""
    return tool_calls.single_token_ids(THINK_TAGS, encode)


def _lark_regex(pattern: str) -> str:
    """A regex inside Lark's /.../: slashes not already escaped get a backslash."""
    out, escaped = [], False
    for ch in pattern:
        if ch == "/" and not escaped:
            out.append("\\")
        out.append(ch)
        escaped = ch == "\\" and not escaped
    return "".join(out)
