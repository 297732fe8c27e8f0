"""The tool-call formats (markers checked against the models' chat templates and vLLM's
parsers): each is a scanner over the model's text, built per request (XML formats type their
parameters by the request's tools)."""

from __future__ import annotations

from typing import Any

from tandem.server.tool_calls.base import (
    ANY,
    OK,
    PARTIAL,
    WS,
    Alt,
    CallStart,
    Event,
    JStr,
    Lit,
    Opt,
    Peek,
    ToolCall,
    Upto,
    Wait,
    Word,
    call_from_obj,
    decode_at,
    match_seq,
    skip_ws,
    whole_call,
)
from tandem.server.tool_calls.harmony import HarmonyScanner
from tandem.server.tool_calls.section import (
    CallForm,
    JsonArgs,
    Scanner,
    Section,
    SectionScanner,
    Step,
)
from tandem.server.tool_calls.xml_params import XmlSpec

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGS_BEGIN = "<|tool_call_argument_begin|>"
QWEN_FUNCTION, QWEN_PARAMETER = "<function=", "<parameter="
GLM_KEY, GLM_VALUE = "<arg_key>", "<arg_value>"
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX_INVOKE, MINIMAX_PARAMETER = "<invoke name=", "<parameter name="
LLAMA3_KEYS = ("parameters", "arguments")


def _obj_head(keys: tuple[str, ...]) -> tuple[Any, ...]:
    """``{"name": "...", "arguments": `` up to the arguments' opening brace."""
    name = (Lit("{"), WS, Lit('"name"'), WS, Lit(":"), WS, JStr(), WS, Lit(","), WS)
    return (*name, Alt(tuple(f'"{k}"' for k in keys)), WS, Lit(":"), WS, Peek("{"))


def _quoted_name(captured: list[Any]) -> CallStart | None:
    name = captured[-1].strip().strip("\"'") if captured else ""
    return CallStart(name) if name else None


def _mistral_start(captured: list[Any]) -> CallStart | None:
    """``name[CALL_ID]id[ARGS]``: the name and, when given, the model's id."""
    call_id = captured[1][0].strip() if len(captured) > 1 else ""
    return CallStart(captured[0], call_id or None)


def _kimi_start(captured: list[Any]) -> CallStart | None:
    """``functions.NAME:IDX``: the name, and the whole as the call's id."""
    raw = captured[-1].strip() if captured else ""
    base, _, index = raw.rpartition(":")
    name = (base if base and index.isdigit() else raw).removeprefix("functions.")
    return CallStart(name, raw) if name else None


# --- fallbacks: blocks whose header does not stream, decided whole --------------------------


def _hermes_whole(buf: str, i: int, final: bool) -> tuple[list[Event], int] | Wait:
    """A block no streaming header matched: a complete call object (keys in any order,
    arguments as a JSON string) or, malformed, content up to its closing tag."""
    body = i + len(HERMES_OPEN)
    q = skip_ws(buf, body)
    if q == len(buf) and not final:
        return ANY
    if q < len(buf) and buf[q] == "{":
        decoded = decode_at(buf, q)
        if decoded is None and not final:
            return Wait("}")  # an unfinished object can only end at a "}"
        call = call_from_obj(decoded[0]) if decoded else None
        if decoded and call:
            r = skip_ws(buf, decoded[1])
            if buf.startswith(HERMES_CLOSE, r):
                return whole_call(call), r + len(HERMES_CLOSE)
            if HERMES_CLOSE.startswith(buf[r:]):  # nothing or part of the tag yet
                return (whole_call(call), len(buf)) if final else ANY
    c = buf.find(HERMES_CLOSE, body)
    if c >= 0:
        return [("content", buf[i : c + len(HERMES_CLOSE)])], c + len(HERMES_CLOSE)
    return ([("content", buf[i:])], len(buf)) if final else Wait(">")


def _mistral_whole(buf: str, i: int, final: bool) -> tuple[list[Event], int] | Wait:
    """``[TOOL_CALLS][...]`` whose first call does not stream (e.g. no arguments key)."""
    body = i + len(MISTRAL_CALLS)
    malformed: tuple[list[Event], int] = ([("content", MISTRAL_CALLS)], body)
    q = skip_ws(buf, body)
    if q == len(buf) or buf[q] != "[":
        return malformed if final or q < len(buf) else ANY
    decoded = decode_at(buf, q)
    if decoded is None:
        return malformed if final else Wait("]")
    items, end = decoded
    calls = [call_from_obj(x) for x in items] if isinstance(items, list) else []
    if calls and all(c is not None for c in calls):
        return [e for c in calls if c is not None for e in whole_call(c)], end
    return malformed


# --- llama3_json: decided by how the output begins ----------------------------------------


class Llama3Scanner(Scanner):
    """The output is ``;``-separated call objects (optionally after ``<|python_tag|>``), else
    all content. Calls stream once their header is certain; an opening that does not stream
    (other key order) is decided all-or-nothing at the end, as before."""

    mode = "start"
    HEAD = _obj_head(LLAMA3_KEYS)

    def __init__(self) -> None:
        self.calls = SectionScanner("", (Section((), (CallForm(self.HEAD, (WS, Lit("}"))),)),))

    def step(self, buf: str, pos: int, final: bool) -> Step:
        if self.mode == "start":
            status, q, _ = match_seq(buf, pos, (WS, Opt((Lit(PYTHON_TAG),)), WS))
            if status == OK:
                status, begun = self.calls._head(buf, q, self.calls.sections[0])
                if begun is not None:
                    self.mode = "calls"
                    return begun
            if status == PARTIAL and not final:
                return [], pos, ANY
            self.mode = "whole" if buf[pos:].lstrip().startswith(("{", PYTHON_TAG)) else "plain"
        if self.mode == "whole":
            if not final:
                return [], pos, ANY
            return [e for x in _parse_llama3(buf[pos:]) for e in x], len(buf), None
        if self.mode == "plain":
            return [("content", buf[pos:])], len(buf), None
        return self._calls(buf, pos, final)

    def _calls(self, buf: str, pos: int, final: bool) -> Step:
        calls = self.calls
        if calls.mode in ("args", "tail"):
            return calls.step(buf, pos, final)
        # between calls: "; {next call" or the end; anything else is content
        status, q, _ = match_seq(buf, pos, (WS, Lit(";"), WS))
        if status == OK:
            status, begun = calls._head(buf, q, calls.sections[0])
            if begun is not None:
                return begun
            if q < len(buf) and buf[q] == "{":  # a call whose header does not stream
                decoded = decode_at(buf, q)
                if decoded is None and not final:
                    return [], pos, Wait("}")
                call = call_from_obj(decoded[0], LLAMA3_KEYS, need_args=True) if decoded else None
                if decoded and call:
                    return whole_call(call), decoded[1], None
        if status == PARTIAL and not final:
            return [], pos, ANY
        self.mode = "plain"
        return [], pos, None

    def close(self) -> list[Event]:
        return self.calls.close()


def _parse_llama3(text: str) -> list[list[Event]]:
    """All-or-nothing: the output is one or more ``;``-separated call objects, else content."""
    pos = skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, pos):
        pos = skip_ws(text, pos + len(PYTHON_TAG))
    calls: list[ToolCall] = []
    while pos < len(text) and text[pos] == "{":
        decoded = decode_at(text, pos)
        call = call_from_obj(decoded[0], LLAMA3_KEYS, need_args=True) if decoded else None
        if decoded is None or call is None:
            return [[("content", text)]]
        calls.append(call)
        pos = skip_ws(text, decoded[1])
        if pos < len(text) and text[pos] == ";":
            pos = skip_ws(text, pos + 1)
    if calls and pos == len(text):
        return [whole_call(c) for c in calls]
    return [[("content", text)]]


# --- the registry --------------------------------------------------------------------------

_HERMES = Section(
    (WS,),
    (CallForm(_obj_head(("arguments", "parameters")), (WS, Lit("}"))),),
    close=(WS, Lit(HERMES_CLOSE)),
)
_MISTRAL_ARRAY = Section(
    (WS, Lit("["), WS),
    (CallForm(_obj_head(("arguments", "parameters")), (WS, Lit("}"))),),
    sep=(WS, Lit(","), WS),
    close=(WS, Lit("]")),
    whole_items=True,
)
_MISTRAL_NAMED = Section(
    (),
    (
        CallForm(
            (WS, Word(r"[^\s\[\]{}]"), WS, Opt((Lit(MISTRAL_CALL_ID), Upto(MISTRAL_ARGS, "\n"))))
            + (Lit(MISTRAL_ARGS), WS, Peek("{")),
            name_of=_mistral_start,
        ),
    ),
)
_DEEPSEEK = Section(
    (WS,),
    (
        CallForm(  # V3 / R1: function<｜tool▁sep｜>NAME\n```json\n{...}\n```
            (Lit(DS_CALL_BEGIN), Upto(DS_SEP, "\n{"), Lit(DS_SEP), Upto("\n", "<{"), WS)
            + (Lit("```json"), WS, Peek("{")),
            (WS, Lit("```"), WS, Lit(DS_CALL_END)),
        ),
        CallForm(  # V3.1: NAME<｜tool▁sep｜>{...}
            (Lit(DS_CALL_BEGIN), Upto(DS_SEP, "\n{"), Lit(DS_SEP), WS, Peek("{")),
            (WS, Lit(DS_CALL_END)),
        ),
    ),
    sep=(WS,),
    close=(WS, Lit(DS_CALLS_END)),
)
_KIMI = Section(
    (WS,),
    (
        CallForm(
            (Lit(KIMI_CALL_BEGIN), WS, Upto(KIMI_ARGS_BEGIN, "\n<"), Lit(KIMI_ARGS_BEGIN), WS)
            + (Peek("{"),),
            (WS, Lit(KIMI_CALL_END)),
            name_of=_kimi_start,
        ),
    ),
    sep=(WS,),
    close=(WS, Lit(KIMI_SECTION_END)),
)
_QWEN_XML = Section(
    (WS,),
    (CallForm((Lit(QWEN_FUNCTION), Upto(">", " \t\n<"), Lit(">"))),),
    sep=(WS,),
    close=(WS, Lit(HERMES_CLOSE)),
)
QWEN_PARAMS = XmlSpec(
    (Lit(QWEN_PARAMETER), Upto(">", "\n<"), Lit(">")),
    "</parameter>",
    (QWEN_PARAMETER, "</function>", HERMES_CLOSE),
    (("</function>", True), (HERMES_CLOSE, False)),
)
_GLM = Section(
    (),
    (
        CallForm(
            (WS, Word(r"[^\s<>{}\"]")),
        ),
    ),
    close=(WS, Lit(HERMES_CLOSE)),
)
GLM_PARAMS = XmlSpec(
    (Lit(GLM_KEY), Upto("</arg_key>", "<"), Lit("</arg_key>"), WS, Lit(GLM_VALUE)),
    "</arg_value>",
    (GLM_KEY, HERMES_CLOSE),
    ((HERMES_CLOSE, False),),
)
_MINIMAX = Section(
    (WS,),
    (CallForm((Lit(MINIMAX_INVOKE), Upto(">", "\n<"), Lit(">")), name_of=_quoted_name),),
    sep=(WS,),
    close=(WS, Lit(MINIMAX_CLOSE)),
)
MINIMAX_PARAMS = XmlSpec(
    (Lit(MINIMAX_PARAMETER), Upto(">", "\n<"), Lit(">")),
    "</parameter>",
    (MINIMAX_PARAMETER, "</invoke>", MINIMAX_CLOSE),
    (("</invoke>", True), (MINIMAX_CLOSE, False)),
)

FORMATS = (
    "hermes",
    "llama3_json",
    "mistral",
    "qwen3_coder",
    "harmony",
    "deepseek_v3",
    "deepseek_v31",
    "kimi_k2",
    "glm45",
    "minimax_m2",
)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; expected one of {FORMATS}")
    return fmt


def make_scanner(fmt: str, tools: list[dict[str, Any]] | None = None) -> Scanner:
    """A fresh scanner for one output in format ``fmt``."""
    if check_format(fmt) == "hermes":
        return SectionScanner(HERMES_OPEN, (_HERMES,), fallback=_hermes_whole)
    if fmt == "llama3_json":
        return Llama3Scanner()
    if fmt == "mistral":
        sections = (_MISTRAL_ARRAY, _MISTRAL_NAMED)
        return SectionScanner(MISTRAL_CALLS, sections, fallback=_mistral_whole)
    if fmt == "harmony":
        return HarmonyScanner()
    if fmt in ("deepseek_v3", "deepseek_v31"):  # both parse either call form
        return SectionScanner(DS_CALLS_BEGIN, (_DEEPSEEK,))
    if fmt == "kimi_k2":
        return SectionScanner(KIMI_SECTION_BEGIN, (_KIMI,))
    if fmt == "qwen3_coder":
        return SectionScanner(HERMES_OPEN, (_QWEN_XML,), tools=tools, xml=QWEN_PARAMS)
    if fmt == "glm45":
        return SectionScanner(HERMES_OPEN, (_GLM,), tools=tools, xml=GLM_PARAMS)
    return SectionScanner(MINIMAX_OPEN, (_MINIMAX,), tools=tools, xml=MINIMAX_PARAMS)


__all__ = ["JsonArgs", "make_scanner"]
