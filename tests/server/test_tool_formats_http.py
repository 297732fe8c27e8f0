"""New tool-call formats end to end: a server started with ``--tool-call-format F``, the
model's output forced (a regex of the exact text the format's template writes), the calls
parsed into ``tool_calls`` — whole, and streamed as fragments that join to the same
arguments."""

from __future__ import annotations

import json

import httpx
import pytest

from tandem.testing.live_server import Server
from tandem.testing.tool_call_texts import WEATHER_TOOL, render

TOOLS = [
    WEATHER_TOOL,
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
CALLS = (("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {}))
META = set(".+*?()|[]{}^$\\#&-~")


def literal(text: str) -> str:
    """A regex matching exactly ``text`` (llguidance's regex syntax)."""
    return "".join("\\n" if c == "\n" else ("\\" + c if c in META else c) for c in text)


def stream(server, body) -> tuple[str, list[dict], str | None]:
    content, calls, reason = "", {}, None
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers=server.headers(),
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            content += delta.get("content") or ""
            for d in delta.get("tool_calls") or []:
                entry = calls.setdefault(d["index"], {"name": None, "arguments": ""})
                if "id" in d:
                    entry["name"], entry["id"] = d["function"]["name"], d["id"]
                entry["arguments"] += d["function"].get("arguments", "")
            reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize(
    "fmt",
    ["qwen3_coder", "kimi_k2", "harmony", "deepseek_v3", "deepseek_v31", "glm45", "minimax_m2"],
)
def test_forced_output_in_format_parses_to_tool_calls(served_model, fmt):
    text = render(fmt, *CALLS)
    if fmt != "harmony":
        text = "Checking. " + text
    s = Server(served_model, "--tool-call-format", fmt)
    try:
        body = {
            "messages": [{"role": "user", "content": "weather and time?"}],
            "tools": TOOLS,
            "max_tokens": 400,
            "temperature": 0,
            "guided_regex": literal(text),
        }
        r = s.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        msg = choice["message"]
        calls = msg["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 3}
        assert json.loads(calls[1]["function"]["arguments"] or "{}") == {}
        if fmt != "harmony":
            assert msg["content"] == "Checking."
        content, streamed, reason = stream(s, body)
        assert reason == "tool_calls"
        assert content == (msg["content"] or "")
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls
        ]
    finally:
        s.stop()
