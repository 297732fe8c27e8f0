"""Property-based HTTP fuzzing from the server's own /openapi.json (schemathesis on hypothesis),
CI-sized: schemathesis's deterministic coverage cases plus TANDEM_FUZZ_EXAMPLES (default 300)
seeded hypothesis examples. No 5xx, OpenAI error bodies, well-formed streams, responses as the
schema says, /health 200 and the process alive after, RSS within 200 MiB of a warm-up.

Long run (thousands of requests, JSON summary; tandem/testing/openapi_fuzz.py):

    .venv/bin/python -m tandem.testing.openapi_fuzz --examples 5000
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tandem.server import openai_schema as o
from tandem.server.openapi import REF
from tandem.testing import openapi_fuzz
from tandem.testing.live_server import API_KEY, Server
from tandem.testing.openapi_fuzz import SERVER_ARGS

EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "300"))
SEED = int(os.environ.get("TANDEM_FUZZ_SEED", "0"))
RSS_BOUND_MIB = 200


@pytest.fixture(scope="module")
def fuzz_server(served_model):
    s = Server(served_model, *SERVER_ARGS)
    yield s
    s.stop()


def _as_published(node):
    """A schema as FastAPI writes it into the document: null defaults left out (numbers become
    floats too, which compare equal)."""
    if isinstance(node, dict):
        return {k: _as_published(v) for k, v in node.items() if not (k == "default" and v is None)}
    if isinstance(node, list):
        return [_as_published(v) for v in node]
    return node


def test_the_published_request_schemas_are_the_pydantic_models(fuzz_server):
    """One source: /openapi.json's request bodies are generated from the models the routes
    validate with, and the statuses a route answers with are documented (no 422)."""
    doc = fuzz_server.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for path, model in (
        ("/v1/completions", o.CompletionRequest),
        ("/v1/chat/completions", o.ChatCompletionRequest),
    ):
        name = model.__name__
        op = doc["paths"][path]["post"]
        body = op["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"{REF}{name}"}
        generated = _as_published(model.model_json_schema(ref_template=REF + "{model}"))
        for ref, definition in generated.pop("$defs").items():
            assert schemas[ref] == definition, ref
        assert schemas[name] == generated
        assert "422" not in op["responses"]
        for code in ("400", "401", "404", "413", "503"):
            error = op["responses"][code]["content"]["application/json"]["schema"]
            assert error == {"$ref": f"{REF}ErrorResponse"}
        assert "text/event-stream" in op["responses"]["200"]["content"]
        assert schemas[name]["additionalProperties"] is False
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == o.MAX_MESSAGES
    members = [m["$ref"].removeprefix(REF) for m in chat["messages"]["items"]["oneOf"]]
    roles = {schemas[m]["properties"]["role"]["const"] for m in members}
    assert roles == {"system", "developer", "user", "assistant", "tool"}
    assert all(schemas[m]["additionalProperties"] is False for m in members)
    for field in ("response_format", "tools", "tool_choice", "parallel_tool_calls"):
        assert field in chat
    assert schemas["FunctionDefinition"]["additionalProperties"] is False
    assert doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]["text/plain"]
    assert doc["paths"]["/health"]["get"]["responses"]["503"]


HI = [{"role": "user", "content": "hi"}]
HISTORY = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "done"},
]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# (path, body, valid by the published schema, the server's status, the error's param)
AGREEMENT = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}, True, 200, None),
    (
        "/v1/completions",
        {"prompt": [[5, 6], [7]], "max_tokens": 1, "n": 2, "logprobs": 1, "logit_bias": {"5": 1}},
        True,
        200,
        None,
    ),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 0}, True, 200, None),
    ("/v1/chat/completions", {"messages": HISTORY, "max_tokens": 2}, True, 200, None),
    (
        "/v1/chat/completions",
        {"messages": HI, "max_tokens": 2, "tools": [TOOL], "tool_choice": "none"},
        True,
        200,
        None,
    ),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, False, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, False, 400, "n"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, False, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, False, 400, "logit_bias"),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"x": 1}},
        False,
        400,
        "stream_options.x",
    ),
    ("/v1/completions", {"prompt": "x", "top_logprobs": 3}, False, 400, "top_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
        False,
        400,
        "tools[0].function.x",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        False,
        400,
        "messages[0].content[0].type",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        False,
        400,
        "messages[0].role",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]},
        False,
        400,
        "messages[0].tool_call_id",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "response_format": {"type": "text", "x": 1}},
        False,
        400,
        "response_format.x",
    ),
    # Cross-field rules a JSON schema does not hold: valid by the schema, a 400 naming the field.
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, True, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, True, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, True, 400, "best_of"),
    (
        "/v1/chat/completions",
        {"messages": HI, "guided_regex": "a", "response_format": {"type": "json_object"}},
        True,
        400,
        "response_format",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "valid", "status", "param"),
    AGREEMENT,
    ids=[str(i) for i in range(len(AGREEMENT))],
)
def test_the_published_schema_accepts_and_rejects_as_the_server_does(
    fuzz_server, path, body, valid, status, param
):
    jsonschema = pytest.importorskip("jsonschema")
    doc = fuzz_server.get("/openapi.json").json()
    name = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**name, "components": doc["components"]})
    assert validator.is_valid(body) is valid, list(validator.iter_errors(body))[:1]
    r = fuzz_server.post(path, json=body)
    assert r.status_code == status, r.text
    if status >= 400:
        assert r.json()["error"]["param"] == param, r.text


def test_fuzz_from_the_openapi_schema(fuzz_server, served_model: Path):
    pytest.importorskip("schemathesis")  # the test extra
    vocab = json.loads((served_model / "config.json").read_text())["vocab_size"]
    summary = openapi_fuzz.fuzz(
        fuzz_server.url,
        api_key=API_KEY,
        examples=EXAMPLES,
        seed=SEED,
        server_pid=fuzz_server.proc.pid,
        vocab_size=vocab,
    )
    report = json.dumps(
        {k: summary[k] for k in ("requests", "status_counts", "failure_counts", "failures")},
        indent=1,
        ensure_ascii=False,
    )[:8000]
    tail = "".join(fuzz_server.log[-40:])
    assert summary["server_errors"] == 0, report + "\n" + tail
    assert not summary["failures"], report + "\n" + tail
    assert summary["health_after"] and summary["alive_after"], tail
    assert summary["requests"] >= EXAMPLES
    assert summary["rss_growth_mib"] is not None
    assert summary["rss_growth_mib"] <= RSS_BOUND_MIB, summary
    # Still exact after the fuzz.
    r = fuzz_server.post(
        "/v1/completions",
        json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
