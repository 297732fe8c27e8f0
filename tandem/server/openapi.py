"""The OpenAPI document served at ``/openapi.json``: FastAPI's, generated from the routes'
pydantic models (request bodies, JSON responses), plus what a route signature cannot say —
the API-key security scheme, each API's error body for the statuses the server answers with
(in place of FastAPI's 422: a body that does not validate is a 400), and the server-sent
events a generation route streams. Nothing here describes a body by hand but the SSE event."""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from tandem.server.openai_output_schema import ErrorResponse

Schema = dict[str, Any]

MAX_BODY_BYTES = 4 << 20  # ServerSettings.max_body_bytes' default (no flag changes it)
REF = "#/components/schemas/"

ERRORS = {
    "400": "Invalid request: malformed JSON, an unknown or unsupported field, a value out of "
    "range, or prompt + max_tokens over the context length.",
    "401": "Missing or wrong API key (only when the server runs with --api-key).",
    "404": "Unknown model name.",
    "413": f"Request body over {MAX_BODY_BYTES} bytes.",
    "503": "Too many requests in the engine (--max-pending), or the engine is gone.",
}
# Generation routes: they stream with stream: true (OpenAI's events are data: lines ending with
# data: [DONE]; the others name each event) and answer 503 when the engine is full or gone.
STREAMING = {
    "/v1/completions": False,
    "/v1/chat/completions": False,
    "/v1/messages": True,
    "/v1/responses": True,
}
OPEN = ("/health",)  # never needs the API key


def _sse_event(named: bool) -> Schema:
    """One server-sent event (OpenAPI < 3.2: a text/event-stream schema describes an event)."""
    if named:
        props = {
            "event": {"type": "string", "description": "The event's type."},
            "data": {"type": "string", "description": "The event as JSON (its type again)."},
        }
    else:
        props = {
            "data": {
                "type": "string",
                "description": "A JSON chunk (choices with deltas; a last one with usage when "
                "asked for; {error: {message, type}} when the request fails after the stream "
                "started), then [DONE].",
            }
        }
    return {"type": "object", "properties": props, "required": list(props)}


def _add(schemas: Schema, model: type[BaseModel]) -> None:
    """``model``'s generated schema (and those it refers to) as components."""
    schema = model.model_json_schema(ref_template=REF + "{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema


def patch_openapi(schema: Schema) -> Schema:
    """FastAPI's generated document with the security scheme, error bodies and SSE events."""
    out = copy.deepcopy(schema)
    components = out.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body: never sent
        schemas.pop(name, None)
    _add(schemas, ErrorResponse)
    components["securitySchemes"] = {
        "bearerAuth": {
            "type": "http",
            "scheme": "bearer",
            "description": "The --api-key the server was started with (every route but /health).",
        }
    }
    for path, methods in out.get("paths", {}).items():
        for operation in methods.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path in OPEN:
                continue
            operation["security"] = [{"bearerAuth": []}]
            if "requestBody" in operation:
                codes = ["400", "401", "404", "413"]
            else:  # a query parameter can be invalid too
                codes = ["400", "401"] if operation.get("parameters") else ["401"]
            if path in STREAMING:
                codes.append("503")
                content = responses.setdefault("200", {}).setdefault("content", {})
                content["text/event-stream"] = {"schema": _sse_event(STREAMING[path])}
            # Anthropic's error body under /v1/messages, OpenAI's everywhere else.
            body = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
            for code in codes:
                responses[code] = {
                    "description": ERRORS[code],
                    "content": {"application/json": {"schema": {"$ref": REF + body}}},
                }
    return out


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` (and /openapi.json) return the patched document. Lazy: routes
    added after this call are included."""
    generate = app.openapi

    def openapi() -> Schema:
        if app.openapi_schema is None:
            app.openapi_schema = patch_openapi(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
