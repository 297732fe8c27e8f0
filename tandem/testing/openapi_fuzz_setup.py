"""What the OpenAPI fuzzer (``tandem.testing.openapi_fuzz``) does before fuzzing: narrow the
served schema to this server's facts, and warm the server up so its memory baseline holds
what the first requests of each kind allocate."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import httpx


def _nodes(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _nodes(value)


def narrow(
    document: dict[str, Any], *, vocab_size: int | None, max_model_len: int | None
) -> dict[str, Any]:
    """A copy of the served document with two facts of this server that a schema cannot hold:
    prompt token ids below its vocabulary size, max_tokens / min_tokens within its context
    length. More of the schema-conforming bodies then get past validation into the engine
    (negative bodies still test both bounds)."""
    doc = copy.deepcopy(document)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in (
        "CompletionRequest",
        "ChatCompletionRequest",
        "MessagesRequest",
        "ResponsesRequest",
    ):
        props = schemas.get(name, {}).get("properties", {})
        for key in ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"):
            for node in _nodes(props.get(key)):
                if max_model_len and node.get("type") == "integer":
                    node["maximum"] = max_model_len
        for node in _nodes(props.get("prompt")):
            if vocab_size and node.get("type") == "integer":
                node["maximum"] = vocab_size - 1
    return doc


def warm_up(url: str, headers: dict[str, str]) -> None:
    """Representative valid requests, so the RSS baseline includes what the first requests of
    each kind allocate (graphs for batch sizes, log-probability, prompt-logprob and guided
    decoding paths)."""
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 8}),
        ("/v1/completions", {"prompt": "x " * 100, "max_tokens": 32, "ignore_eos": True}),
        ("/v1/completions", {"prompt": [5, 6, 7], "n": 16, "max_tokens": 8, "logprobs": 20}),
        ("/v1/completions", {"prompt": ["a", "b"], "best_of": 4, "n": 2, "max_tokens": 4}),
        ("/v1/completions", {"prompt": "echo", "echo": True, "logprobs": 3, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "p", "prompt_logprobs": 20, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "s", "stream": True, "max_tokens": 8}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 5},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "presence_penalty": 1,
                "repetition_penalty": 1.2,
                "stream_options": {"include_usage": True},
            },
        ),
    ]
    hi = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    bodies += [  # guided decoding: the grammar compiler and its caches
        ("/v1/completions", {"prompt": "j", "response_format": {"type": "json_object"}}),
        (
            "/v1/completions",
            {
                "prompt": "s",
                "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
            },
        ),
        ("/v1/completions", {"prompt": "r", "guided_regex": "[0-9]{3}", "stream": True}),
        ("/v1/completions", {"prompt": "g", "guided_grammar": 'start: "a" | "b"'}),
        ("/v1/completions", {"prompt": "c", "guided_choice": ["yes", "no"], "n": 4}),
        ("/v1/chat/completions", {"messages": hi, "tools": [tool], "tool_choice": "required"}),
        ("/v1/chat/completions", {"messages": hi, "tools": [tool], "stream": True}),
    ]
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for _ in range(2):
            for path, body in bodies:
                client.post(path, json=body).raise_for_status()
