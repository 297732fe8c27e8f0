"""The client-error exception of the HTTP layer, and the one that a body failing its pydantic
schema becomes."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any


class RequestError(ValueError):
    """A client error: becomes an OpenAI error body with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind


# A field path at the start of a message: "role: must be one of ..." (a discriminator),
# "top_logprobs: needs ..." (a cross-field rule), "tools[0]: ...".
_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[\d+\])*")
_NOT_AN_OBJECT = ("model_type", "model_attributes_type", "dict_type", "missing")
_TYPE_LABELS = {"str", "int", "float", "bool", "bytes", "none"}  # a plain union's members


def invalid_body(errors: Sequence[Mapping[str, Any]]) -> RequestError:
    """A 400 for a body that failed its schema (pydantic's ``errors()``, FastAPI's with a
    leading "body"), naming the first offending field as a path: ``messages[2].content``.
    Union members in the location (a model's or tag's capitalized name, a type label such as
    ``list[str]``) are left out."""
    if not errors:
        return RequestError("invalid request body")
    first = errors[0]
    kind = first.get("type")
    ctx = first.get("ctx") or {}
    loc = list(first.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    if kind == "json_invalid":  # FastAPI's: the location is the character offset
        at = f" (at character {loc[0]})" if loc else ""
        return RequestError(f"malformed JSON: {ctx.get('error', 'cannot be decoded')}{at}")
    path: list[str | int] = [x for x in loc if isinstance(x, int) or _is_field(x)]
    if kind in ("union_tag_invalid", "union_tag_not_found") and "discriminator" in ctx:
        path.append(str(ctx["discriminator"]).strip("'"))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    head, sep, rest = message.partition(": ")
    if sep and _PATH.fullmatch(head):
        path += [int(x) if x.isdigit() else x for x in re.findall(r"\w+", head)]
        message = rest
    if not path and kind in _NOT_AN_OBJECT:
        message = "request body must be a JSON object (content-type: application/json)"
    param = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in path).lstrip(".")
    return RequestError(f"{param}: {message}" if param else message, param=param or None)


def _is_field(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name.isidentifier()
        and not name[:1].isupper()
        and name not in _TYPE_LABELS
    )
