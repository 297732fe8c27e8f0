"""How each tool-call format writes calls, as the models' chat templates render them: crafted
model outputs for parser tests and for grammar-forced end-to-end tests."""

from __future__ import annotations

import json

# A tool whose parameters are typed (so the XML formats' values parse as JSON by the schema).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}


def xml_value(v: object) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


# How each format writes a call (as the models' chat templates render them).
def qwen3_coder(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{xml_value(v)}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def glm45(name: str, args: dict) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{xml_value(v)}</arg_value>\n" for k, v in args.items()
    )
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def minimax_invoke(name: str, args: dict) -> str:
    params = "".join(f'<parameter name="{k}">{xml_value(v)}</parameter>\n' for k, v in args.items())
    return f'<invoke name="{name}">\n{params}</invoke>\n'


def minimax(*calls: tuple[str, dict]) -> str:
    return (
        "<minimax:tool_call>\n"
        + "".join(minimax_invoke(*c) for c in calls)
        + "</minimax:tool_call>"
    )


def dumps(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def deepseek_v3(*calls: tuple[str, dict]) -> str:
    items = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{dumps(a)}\n```<｜tool▁call▁end｜>"
        for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{items}<｜tool▁calls▁end｜>"


def deepseek_v31(*calls: tuple[str, dict]) -> str:
    items = "".join(
        f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{dumps(a)}<｜tool▁call▁end｜>" for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{items}<｜tool▁calls▁end｜>"


def kimi(*calls: tuple[str, dict]) -> str:
    items = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{dumps(a)}"
        "<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{items}<|tool_calls_section_end|>"


def harmony_call(name: str, args: dict, *, start: bool = True) -> str:
    head = "<|start|>assistant" if start else ""
    body = f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{dumps(args)}"
    return head + body


def render(fmt: str, *calls: tuple[str, dict]) -> str:
    """Calls as ``fmt`` writes them."""
    if fmt == "qwen3_coder":
        return "\n".join(qwen3_coder(*c) for c in calls)
    if fmt == "glm45":
        return "\n".join(glm45(*c) for c in calls)
    if fmt == "minimax_m2":
        return minimax(*calls)
    if fmt == "harmony":
        return "<|call|>".join(harmony_call(*c) for c in calls)
    return {"deepseek_v3": deepseek_v3, "deepseek_v31": deepseek_v31, "kimi_k2": kimi}[fmt](*calls)
