"""Lark grammars (llguidance) for ``strict`` tools under ``tool_choice: "auto"``: free text,
or a format's call markup whose arguments follow the called tool's JSON schema (any object
for a tool that is not strict). The parsers in this package read back what these allow.

A marker that is one token in the model's vocabulary is written as that token (``<[id]>``):
llguidance treats added tokens such as ``<tool_call>`` as special, so the literal text would
not match them. Free text may not contain a call's opening marker, so every call goes through
the grammar."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from tandem.engine.grammar import JSON_OPTIONS
from tandem.server.tool_calls import formats as f
from tandem.server.tool_calls.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START
from tandem.server.tool_calls.schemas import is_strict, rebase, tool_parameters
from tandem.server.tool_calls.xml_params import param_kind

THINK_TAGS = ("<think>", "</think>")
NEWLINE = '"\\n"'  # a newline in Lark
_MARKERS = {
    "hermes": (f.HERMES_OPEN, f.HERMES_CLOSE),
    "llama3_json": (f.PYTHON_TAG,),
    "mistral": (f.MISTRAL_CALLS, f.MISTRAL_ARGS),
    "qwen3_coder": (f.HERMES_OPEN, f.HERMES_CLOSE),
    "harmony": (START, CHANNEL, MESSAGE, END, CALL, CONSTRAIN),
    "deepseek_v3": (f.DS_CALLS_BEGIN, f.DS_CALLS_END, f.DS_CALL_BEGIN, f.DS_CALL_END, f.DS_SEP),
    "kimi_k2": (f.KIMI_SECTION_BEGIN, f.KIMI_SECTION_END, f.KIMI_CALL_BEGIN, f.KIMI_CALL_END)
    + (f.KIMI_ARGS_BEGIN,),
    "glm45": (f.HERMES_OPEN, f.HERMES_CLOSE, f.GLM_KEY, "</arg_key>", f.GLM_VALUE, "</arg_value>"),
    "minimax_m2": (f.MINIMAX_OPEN, f.MINIMAX_CLOSE),
}
_MARKERS["deepseek_v31"] = _MARKERS["deepseek_v3"]


def grammar_markers(fmt: str) -> tuple[str, ...]:
    """The markers a strict grammar for ``fmt`` writes, think tags included."""
    return (*_MARKERS.get(fmt, ()), *THINK_TAGS)


def single_token_ids(
    markers: tuple[str, ...], encode: Callable[[str], list[int]]
) -> dict[str, int]:
    """The markers that the tokenizer encodes as one token, with that token's id."""
    return {m: ids[0] for m in markers if len(ids := encode(m)) == 1}


class Rules:
    """Builds one grammar: markers as tokens or literals, numbered rules for tool schemas."""

    def __init__(self, tools: list[dict[str, Any]], ids: Mapping[str, int]) -> None:
        self.tools, self.ids = tools, ids
        self.lines: list[str] = []
        self.n = 0

    def lit(self, marker: str) -> str:
        return f"<[{self.ids[marker]}]>" if marker in self.ids else quote(marker)

    def rule(self, body: str) -> str:
        self.n += 1
        self.lines.append(f"r{self.n}: {body}")
        return f"r{self.n}"

    def terminal(self, name: str, definition: str) -> str:
        """A named terminal, defined once."""
        line = f"{name}: {definition}"
        if line not in self.lines:
            self.lines.append(line)
        return name

    def schema(self, tool: dict[str, Any]) -> dict[str, Any]:
        return tool_parameters(tool) if is_strict(tool) else {"type": "object"}

    def json(self, schema: dict[str, Any]) -> str:
        return self.rule("%json " + json.dumps({"x-guidance": JSON_OPTIONS, **schema}))

    def named_object(self, key: str) -> str:
        """``{"name": NAME, key: ARGS}`` for each tool (the arguments under its schema)."""
        alts = []
        for tool in self.tools:
            args = rebase(self.schema(tool), "#/$defs/args")
            obj = {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    key: {"$ref": "#/$defs/args"},
                },
                "required": ["name", key],
                "additionalProperties": False,
                "$defs": {"args": args},
            }
            alts.append(self.json(obj))
        return self.rule(" | ".join(alts))

    def per_tool(self, call: Callable[[str, dict[str, Any]], str]) -> str:
        """One alternative per tool: ``call(quoted name, tool)``."""
        return self.rule(" | ".join(call(quote(t["function"]["name"]), t) for t in self.tools))

    def until(self, close: str, stops: tuple[str, ...]) -> str:
        """Text holding none of ``stops`` (``close`` included), then ``close``."""
        self.n += 1
        self.lines.append(f"V{self.n}: {without((close, *stops))}")
        if close in self.ids:
            return self.rule(f"V{self.n} {self.lit(close)}")
        self.lines.append(f"W{self.n}: V{self.n} {quote(close)}")
        return f"W{self.n}"

    def text_calls(self, opener: str, call: str, parallel: bool) -> str:
        """Free text with calls, each starting with ``opener``."""
        text = self.terminal("TEXT", without((opener,)))
        if opener in self.ids:
            lead = self.rule(f"{text} {self.lit(opener)}")
        else:  # text then the literal marker, as one lexeme
            lead = self.terminal("LEAD", f"{text} {quote(opener)}")
        return f"({lead} {call}){'*' if parallel else '?'} {text}"

    def grammar(self, body: str) -> str:
        return "\n".join([f"body: {body}", *self.lines]) + "\n"


def quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _regex(text: str) -> str:
    """``text`` as a literal inside Lark's /.../ (Rust regex syntax)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$/-&~#" else c for c in text)


def without(markers: tuple[str, ...]) -> str:
    alts = "|".join(_regex(m) for m in markers)
    return f"/(?s:.*)/ & ~/(?s:.*)({alts})(?s:.*)/"


def repeat(item: str, sep: str, parallel: bool) -> str:
    return f"{item} ({sep} {item})*" if parallel else item


# --- formats --------------------------------------------------------------------------------


def _hermes(r: Rules, parallel: bool) -> str:
    call = f'"\\n"? {r.named_object("arguments")} "\\n"? {r.lit(f.HERMES_CLOSE)}'
    return r.text_calls(f.HERMES_OPEN, r.rule(call), parallel)


def _llama3(r: Rules, parallel: bool) -> str:
    # Plain text may not begin (after whitespace) like a call: "{" or <|python_tag|>.
    tag = _regex(f.PYTHON_TAG)
    r.terminal(
        "PLAIN", f"/[ \\t\\n]*/ | (/[ \\t\\n]*[^{{ \\t\\n](?s:.*)/ & ~/[ \\t\\n]*{tag}(?s:.*)/)"
    )
    calls = repeat(r.named_object("parameters"), '"; "', parallel)
    tag_rule = f"{r.lit(f.PYTHON_TAG)}? " if f.PYTHON_TAG in r.ids else ""
    return f"PLAIN | {tag_rule}{calls}"


def _mistral(r: Rules, parallel: bool) -> str:
    if f.MISTRAL_ARGS in r.ids:  # tokenizers with an [ARGS] token: [TOOL_CALLS]name[ARGS]{...}
        call = r.per_tool(lambda name, t: f"{name} {r.lit(f.MISTRAL_ARGS)} {r.json(r.schema(t))}")
    else:  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
        items = repeat(r.named_object("arguments"), '", "', parallel)
        call = r.rule(f'"[" {items} "]"')
    return r.text_calls(f.MISTRAL_CALLS, call, parallel)


def _deepseek(r: Rules, parallel: bool, v31: bool) -> str:
    def call(name: str, tool: dict[str, Any]) -> str:
        args = r.json(r.schema(tool))
        begin, sep, end = r.lit(f.DS_CALL_BEGIN), r.lit(f.DS_SEP), r.lit(f.DS_CALL_END)
        if v31:
            return f"{begin} {name} {sep} {args} {end}"
        return f'{begin} "function" {sep} {name} "\\n```json\\n" {args} "\\n```" {end}'

    calls = repeat(r.per_tool(call), '"\\n"?', parallel)
    return r.text_calls(f.DS_CALLS_BEGIN, r.rule(f"{calls} {r.lit(f.DS_CALLS_END)}"), parallel)


def _kimi(r: Rules, parallel: bool) -> str:
    r.terminal("IDX", "/[0-9]+/")

    def call(name: str, tool: dict[str, Any]) -> str:
        args = r.json(r.schema(tool))
        head = f'{r.lit(f.KIMI_CALL_BEGIN)} "functions." {name} ":" IDX'
        return f"{head} {r.lit(f.KIMI_ARGS_BEGIN)} {args} {r.lit(f.KIMI_CALL_END)}"

    calls = repeat(r.per_tool(call), "", parallel)
    section = r.rule(f"{calls} {r.lit(f.KIMI_SECTION_END)}")
    return r.text_calls(f.KIMI_SECTION_BEGIN, section, parallel)


def _harmony(r: Rules, parallel: bool) -> str | None:
    if not all(m in r.ids for m in (START, CHANNEL, MESSAGE, END, CONSTRAIN)):
        return None  # its markers must be tokens: free text could spell them out otherwise
    r.terminal("CHAN", '"analysis" | "commentary" | "final"')
    r.terminal("MTEXT", without((START, CHANNEL, MESSAGE, END, CALL, RETURN)))  # none spelled out
    msg = r.rule(f"{r.lit(CHANNEL)} CHAN {r.lit(MESSAGE)} MTEXT")

    def call(name: str, tool: dict[str, Any]) -> str:
        args = r.json(r.schema(tool))
        return f'{name} " " {r.lit(CONSTRAIN)} "json" {r.lit(MESSAGE)} {args}'

    called = r.rule(f'{r.lit(CHANNEL)} "commentary to=functions." {r.per_tool(call)}')
    return f'({msg} {r.lit(END)} {r.lit(START)} "assistant")* ({msg} | {called})'


class _Xml:
    """How an XML format writes one parameter, for its grammar."""

    def __init__(self, head: Callable[[str], str], post: str, close: str, stops: tuple[str, ...]):
        self.head, self.post, self.close, self.stops = head, post, close, stops

    def params(self, r: Rules, tool: dict[str, Any], after: str) -> str:
        """A tool's parameters in schema order (the required ones required); a tool that is
        not strict, or has no properties listed, takes any parameters as text."""
        schema = r.schema(tool)
        props = schema.get("properties")
        if not is_strict(tool) or not isinstance(props, dict):
            name = r.terminal("PNAME", '/[^<>\\n"]+/')
            any_param = r.rule(f"{self.head(name)} {r.until(self.close, self.stops)} {after}")
            return f"{any_param}*"
        required = set(schema.get("required") or ())
        parts = []
        for name, sub in props.items():
            rule = r.rule(f"{self.head(quote(name))} {self.value(r, sub, schema)} {after}")
            parts.append(rule if name in required else f"{rule}?")
        return " ".join(parts)

    def value(self, r: Rules, sub: Any, root: dict[str, Any]) -> str:
        if param_kind(sub) == "json":
            defs = {"$defs": root["$defs"]} if "$defs" in root else {}
            return " ".join(x for x in (r.json({**sub, **defs}), self.post, r.lit(self.close)) if x)
        options = sub.get("enum", [sub["const"]] if "const" in sub else None)
        if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
            alts = " | ".join(quote(o) for o in options)
            return f"({alts}) {r.lit(self.close)}"
        return r.until(self.close, self.stops)


def _qwen3_coder(r: Rules, parallel: bool) -> str:
    xml = _Xml(lambda n: f'"<parameter=" {n} ">\\n"', '"\\n"', "</parameter>", f.QWEN_PARAMS.stops)

    def call(name: str, tool: dict[str, Any]) -> str:
        body = xml.params(r, tool, NEWLINE)
        return f'"\\n<function=" {name} ">\\n" {body} "</function>\\n" {r.lit(f.HERMES_CLOSE)}'

    return r.text_calls(f.HERMES_OPEN, r.per_tool(call), parallel)


def _glm45(r: Rules, parallel: bool) -> str:
    key, value = f"{r.lit(f.GLM_KEY)} ", f' {r.lit("</arg_key>")} "\\n" {r.lit(f.GLM_VALUE)}'
    xml = _Xml(lambda n: key + n + value, "", "</arg_value>", f.GLM_PARAMS.stops)

    def call(name: str, tool: dict[str, Any]) -> str:
        return f'{name} "\\n" {xml.params(r, tool, NEWLINE)} {r.lit(f.HERMES_CLOSE)}'

    return r.text_calls(f.HERMES_OPEN, r.per_tool(call), parallel)


def _minimax(r: Rules, parallel: bool) -> str:
    xml = _Xml(
        lambda n: f'"<parameter name=\\"" {n} "\\">"', "", "</parameter>", f.MINIMAX_PARAMS.stops
    )

    def call(name: str, tool: dict[str, Any]) -> str:
        body = xml.params(r, tool, NEWLINE)
        return f'"<invoke name=\\"" {name} "\\">\\n" {body} "</invoke>\\n"'

    block = f'"\\n" {repeat(r.per_tool(call), "", parallel)} {r.lit(f.MINIMAX_CLOSE)}'
    return r.text_calls(f.MINIMAX_OPEN, r.rule(block), parallel)


_BUILDERS: dict[str, Callable[[Rules, bool], str | None]] = {
    "hermes": _hermes,
    "llama3_json": _llama3,
    "mistral": _mistral,
    "deepseek_v3": lambda r, p: _deepseek(r, p, v31=False),
    "deepseek_v31": lambda r, p: _deepseek(r, p, v31=True),
    "kimi_k2": _kimi,
    "harmony": _harmony,
    "qwen3_coder": _qwen3_coder,
    "glm45": _glm45,
    "minimax_m2": _minimax,
}


def call_grammar(
    fmt: str, tools: list[dict[str, Any]], ids: Mapping[str, int], *, parallel: bool
) -> str | None:
    """Lark rules defining ``body`` (the whole output, after any think block) for ``fmt``;
    None when this format's markup cannot be expressed for this tokenizer."""
    r = Rules(tools, ids)
    body = _BUILDERS[fmt](r, parallel)
    return None if body is None else r.grammar(body)
