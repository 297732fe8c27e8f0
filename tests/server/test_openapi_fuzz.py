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

from tandem.server import requests as parser
from tandem.server.openapi import chat_request_schema, completion_request_schema
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


def test_schema_fields_are_the_parsers_fields():
    """Every field the parser accepts is documented, and nothing else (chat's suffix, accepted
    only as null, is left out)."""
    neutral = set(parser._NEUTRAL)
    assert set(completion_request_schema()["properties"]) == parser.COMPLETION_FIELDS | neutral
    chat = parser.CHAT_FIELDS | (neutral - {"suffix"})
    assert set(chat_request_schema()["properties"]) == chat


def test_openapi_documents_the_request_bodies(fuzz_server):
    doc = fuzz_server.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for path, name in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{name}"
        }
        for code in ("400", "401", "404", "413", "503"):
            error = op["responses"][code]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}
        assert schemas[name]["additionalProperties"] is False
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == 1024
    roles = {m["properties"]["role"]["const"] for m in chat["messages"]["items"]["oneOf"]}
    assert roles == {"system", "developer", "user", "assistant", "tool"}
    for field in ("response_format", "tools", "tool_choice", "parallel_tool_calls"):
        assert field in chat
    assert doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]["text/plain"]
    assert doc["paths"]["/health"]["get"]["responses"]["503"]


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
