"""A request's ``tools``: their validation, and the JSON schemas that enforce a required or
named ``tool_choice`` (the whole output is then the calls' JSON)."""

from __future__ import annotations

import json
from typing import Any

from tandem.server.tool_calls.base import ToolCall, call_from_obj

MAX_TOOLS = 128


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
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"{where}.function.strict must be a boolean")
    return tools


def is_strict(tool: dict[str, Any]) -> bool:
    return tool["function"].get("strict") is True


def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def rebase(node: Any, base: str) -> Any:
    """A copy of a schema whose local references (``#...``) point below ``base``."""
    if isinstance(node, dict):
        out = {k: rebase(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(node, list):
        return [rebase(v, base) for v in node]
    return node


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Schema for ``tool_choice="required"``: a non-empty array of ``{name, parameters}``.
    Each tool's parameters live under ``$defs/tool_i`` with their own references rebased
    there, so schemas with ``$ref`` / ``$defs`` (e.g. from Pydantic) keep resolving."""
    if not tools:
        raise ValueError("tool_choice 'required' needs at least one tool")
    defs = {
        f"tool_{i}": rebase(tool_parameters(t), f"#/$defs/tool_{i}") for i, t in enumerate(tools)
    }
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
            return tool_parameters(tool)
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
    calls = [call_from_obj(x, ("parameters", "arguments"), need_args=True) for x in items]
    return [c for c in calls if c is not None] if all(c is not None for c in calls) else []
