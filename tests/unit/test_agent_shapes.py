"""Anthropic content blocks and Responses output items from the chat shaper's deltas: for any
split of a crafted output, the streamed events add up to the whole message, and the whole
message does not depend on the split."""

from __future__ import annotations

import json
import random

import pytest

from tandem.server import anthropic_schema as a
from tandem.server.anthropic_routes import BILLING_HEADER, Blocks, system_text
from tandem.server.chat_output import ChatOutput
from tandem.server.guided import ToolMode
from tandem.server.responses_routes import Items, decode_reasoning, encode_reasoning
from tandem.testing.tool_call_texts import WEATHER_TOOL, render

TOOLS = [
    WEATHER_TOOL,
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
]
OUTPUT = (
    "<think>The user wants weather. Ünïcode too.</think>\n\nLet me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a/b.py", "n": [1, 2]}}\n'
    "</tool_call>"
)


def shaper() -> ChatOutput:
    return ChatOutput(reasoning=True, tools=ToolMode(TOOLS, "auto"), fmt="hermes")


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(40, len(text) - 1))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def sse_events(raw: list[bytes]) -> list[dict]:
    out = []
    for chunk in raw:
        lines = chunk.decode().strip().split("\n")
        data = json.loads(lines[-1].removeprefix("data: "))
        assert lines[0] == f"event: {data['type']}"
        out.append(data)
    return out


def replay_blocks(events: list[dict]) -> list[dict]:
    """What a client builds from the events (as the SDK's accumulator does)."""
    blocks: list[dict] = []
    json_bufs: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            d, b = e["delta"], blocks[e["index"]]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            else:
                json_bufs[e["index"]] = json_bufs.get(e["index"], "") + d["partial_json"]
        elif e["type"] == "content_block_stop" and e["index"] in json_bufs:
            blocks[e["index"]]["input"] = json.loads(json_bufs[e["index"]])
    return blocks


def run_blocks(pieces: list[str]) -> tuple[list[dict], list[dict]]:
    s, b = shaper(), Blocks()
    raw: list[bytes] = []
    for p in pieces:
        raw += b.feed(s.feed(p))
    raw += b.feed(s.finish()) + b.close()
    return b.blocks, sse_events(raw)


def test_blocks_stream_equals_whole_over_random_splits():
    whole, _ = run_blocks([OUTPUT])
    assert [x["type"] for x in whole] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole[0]["thinking"] == "The user wants weather. Ünïcode too."
    assert whole[1]["text"] == "Let me check both."
    assert whole[2]["name"] == "get_weather" and whole[2]["input"] == {"city": "Paris"}
    assert whole[3]["input"] == {"path": "a/b.py", "n": [1, 2]}
    rng = random.Random(0)
    for _ in range(60):
        blocks, events = run_blocks(splits(OUTPUT, rng))
        assert strip_ids(blocks) == strip_ids(whole)
        assert strip_ids(replay_blocks(events)) == strip_ids(whole)
        kinds = [e["type"] for e in events]
        assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4


def strip_ids(blocks: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def run_items(pieces: list[str]) -> tuple[list[dict], list[dict]]:
    s, it = shaper(), Items(encrypt=True)
    events: list[dict] = []
    for p in pieces:
        events += it.feed(s.feed(p))
    events += it.feed(s.finish()) + it.close()
    return it.items, events


def test_items_stream_equals_whole_over_random_splits():
    whole, _ = run_items([OUTPUT])
    assert [x["type"] for x in whole] == ["reasoning", "message", "function_call", "function_call"]
    text = whole[0]["content"][0]["text"]
    assert decode_reasoning(whole[0]["encrypted_content"]) == text
    assert whole[1]["content"][0]["text"] == "Let me check both."
    assert json.loads(whole[3]["arguments"]) == {"path": "a/b.py", "n": [1, 2]}
    rng = random.Random(1)
    for _ in range(60):
        items, events = run_items(splits(OUTPUT, rng))
        assert strip(items) == strip(whole)
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert strip(done) == strip(whole)
        args = "".join(
            e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
        )
        assert args == whole[2]["arguments"] + whole[3]["arguments"]
        added = [e for e in events if e["type"] == "response.output_item.added"]
        assert all(e["item"]["status"] == "in_progress" for e in added)


def strip(items: list[dict]) -> list[dict]:
    skip = ("id", "call_id", "encrypted_content")
    return [{k: v for k, v in i.items() if k not in skip} for i in items]


def test_billing_header_blocks():
    blocks = [
        a.TextBlock(type="text", text=f"{BILLING_HEADER}: cc_version=2.1; cch=abc;"),
        a.TextBlock(type="text", text="You are Claude Code."),
    ]
    assert system_text(blocks, keep_billing=False) == "You are Claude Code."
    assert system_text(blocks, keep_billing=True).startswith(BILLING_HEADER)
    assert system_text(None, keep_billing=False) is None
    assert system_text([blocks[0]], keep_billing=False) is None


def test_foreign_encrypted_content_is_not_read():
    assert decode_reasoning(encode_reasoning("ok ü")) == "ok ü"
    assert decode_reasoning("gAAAAABo-opaque") is None
    assert decode_reasoning("tandem-r1:!!!") is None


FORMATS = ("hermes", "qwen3_coder", "harmony", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm45")
CALLS = (("get_weather", {"city": "Oslo", "days": 3}), ("read_file", {"path": "a.py"}))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_streams_into_blocks_and_items(fmt):
    calls_text = (
        "\n".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
            for n, a in CALLS
        )
        if fmt == "hermes"
        else render(fmt, *CALLS)
    )
    text = calls_text if fmt == "harmony" else "Checking. " + calls_text

    def make() -> ChatOutput:
        return ChatOutput(tools=ToolMode(TOOLS, "auto"), fmt=fmt)

    def blocks_of(pieces):
        s, b = make(), Blocks()
        raw = [e for p in pieces for e in b.feed(s.feed(p))] + b.feed(s.finish()) + b.close()
        return b.blocks, sse_events(raw)

    def items_of(pieces):
        s, it = make(), Items(encrypt=False)
        events = [e for p in pieces for e in it.feed(s.feed(p))]
        return it.items, events + it.feed(s.finish()) + it.close()

    whole, _ = blocks_of([text])
    uses = [b for b in whole if b["type"] == "tool_use"]
    assert [(b["name"], b["input"]) for b in uses] == [(n, a) for n, a in CALLS]
    items, _ = items_of([text])
    fcs = [i for i in items if i["type"] == "function_call"]
    assert [(i["name"], json.loads(i["arguments"])) for i in fcs] == [(n, a) for n, a in CALLS]
    rng = random.Random(fmt)
    for _ in range(25):
        pieces = splits(text, rng)
        blocks, events = blocks_of(pieces)
        assert strip_ids(blocks) == strip_ids(whole)
        assert strip_ids(replay_blocks(events)) == strip_ids(whole)
        got, _ = items_of(pieces)
        assert strip(got) == strip(items)
