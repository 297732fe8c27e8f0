"""The OpenAPI document served at ``/openapi.json``.

The routes read raw JSON and validate it by hand (``tandem.server.requests``), so FastAPI's
generated document has no request bodies. ``install_openapi`` keeps FastAPI's document (paths,
operation ids) and adds hand-written JSON schemas (OpenAPI 3.1, JSON Schema 2020-12) of the
request bodies, the responses and the OpenAI error body. The bounds are the ones the server
enforces; what a schema cannot express (the context length, the vocabulary size, cross-field
rules) is in the descriptions.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from tandem.sampling_params import INT_MAX, MAX_GUIDED_SPEC, MAX_LOGPROBS
from tandem.server.guided import GUIDED_FIELDS
from tandem.server.requests import MAX_MESSAGES, MAX_N, MAX_STOP_LENGTH, MAX_STOP_STRINGS
from tandem.server.tool_calls import MAX_TOOLS

Schema = dict[str, Any]

MAX_BODY_BYTES = 4 << 20  # ServerSettings.max_body_bytes' default (no flag changes it)
REF = "#/components/schemas/"
INTEGERS = (
    "Integer fields take JSON integers written without a fraction (2, not 2.0); null in an "
    "optional field means the field is not given."
)


def _ref(name: str) -> Schema:
    return {"$ref": REF + name}


def _nullable(schema: Schema, description: str | None = None) -> Schema:
    """``schema`` or ``null`` (every optional field accepts null, meaning "not given")."""
    out: Schema = {"anyOf": [schema, {"type": "null"}]}
    if description:
        out["description"] = description
    return out


def _int(minimum: int, maximum: int = INT_MAX, description: str | None = None) -> Schema:
    return _nullable({"type": "integer", "minimum": minimum, "maximum": maximum}, description)


def _number(description: str | None = None, **bounds: float) -> Schema:
    return _nullable({"type": "number", **bounds}, description)


def _bool(description: str | None = None) -> Schema:
    return _nullable({"type": "boolean"}, description)


def _string(description: str | None = None) -> Schema:
    return _nullable({"type": "string"}, description)


def _common_properties(max_tokens_doc: str) -> dict[str, Schema]:
    """Fields both generation endpoints accept (``requests._COMMON``)."""
    stop_string: Schema = {"type": "string", "maxLength": MAX_STOP_LENGTH}
    return {
        "model": _string("The served model name (GET /v1/models); any other name is a 404."),
        "max_tokens": _int(1, description=max_tokens_doc),
        "temperature": _number("0 is greedy.", minimum=0),
        "top_p": _number("Nucleus sampling; 1 disables it.", exclusiveMinimum=0, maximum=1),
        "top_k": _int(-1, description="0 or -1 disables top-k."),
        "seed": _int(0, description="Same seed and inputs, same output. Sample j uses seed + j."),
        "stop": _nullable(
            {
                "anyOf": [
                    stop_string,
                    {"type": "array", "items": stop_string, "maxItems": MAX_STOP_STRINGS},
                ]
            },
            "Strings matched on the generated text; the output ends before the first match.",
        ),
        "stop_token_ids": _nullable(
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT_MAX}},
            "Token ids that end the output (as EOS does).",
        ),
        "ignore_eos": _bool("Keep generating past EOS (until max_tokens or a stop)."),
        "n": _int(1, MAX_N, "Samples per prompt."),
        "prompt_logprobs": _int(
            0,
            MAX_LOGPROBS,
            "Extension: log-probabilities of every prompt token after the first, with the "
            "top k alternatives, in each choice's prompt_logprobs.",
        ),
        "min_p": _number("In [0, 1], relative to the most likely token.", minimum=0, maximum=1),
        "min_tokens": _int(
            0, description="EOS and stop_token_ids cannot end the output earlier. <= max_tokens."
        ),
        "presence_penalty": _number(minimum=-2, maximum=2),
        "frequency_penalty": _number(minimum=-2, maximum=2),
        "repetition_penalty": _number(
            "As vLLM: over prompt and generated tokens; 1 disables it.",
            exclusiveMinimum=0,
            maximum=10,
        ),
        "logit_bias": _nullable(
            {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            },
            "Token id (a decimal string, below the vocabulary size) to a bias added to its logit.",
        ),
        "user": _string("Accepted for compatibility; not used."),
        "stream": _bool("Server-sent events (text/event-stream), ending with data: [DONE]."),
        "stream_options": _nullable(
            {
                "type": "object",
                "properties": {
                    "include_usage": _bool("A final chunk with usage."),
                    "continuous_usage_stats": _bool(
                        "Extension (as vLLM): usage so far on every chunk."
                    ),
                },
                "additionalProperties": False,
            }
        ),
        "return_token_ids": _bool("Extension (as vLLM): token_ids in each choice."),
        "response_format": _response_format(),
        **{
            key: _nullable(_guided_spec(kind), f"Extension (as vLLM): {kind} constraint.")
            for key, kind in GUIDED_FIELDS.items()
        },
    }


def _text_parts() -> Schema:
    return {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
            "required": ["type", "text"],
            "additionalProperties": False,
        },
        "description": "Text parts, concatenated.",
    }


def _message(role: str, extra: dict[str, Schema], required: list[str], **more: Any) -> Schema:
    content: Schema = {"anyOf": [{"type": "string"}, _text_parts()]}
    if role == "assistant":
        content = {"anyOf": [*content["anyOf"], {"type": "null"}]}
    return {
        "type": "object",
        "title": f"{role} message",
        "properties": {
            "role": {"const": role},
            "content": content,
            "name": {"type": ["string", "null"]},
            **extra,
        },
        "required": ["role", *required],
        "additionalProperties": False,
        **more,
    }


def _messages() -> Schema:
    tool_call: Schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {
                        "type": ["string", "object"],
                        "description": "A JSON object, or its JSON text (default {}).",
                    },
                },
                "required": ["name"],
                "additionalProperties": False,
            },
        },
        "required": ["function"],
        "additionalProperties": False,
    }
    return {
        "type": "array",
        "minItems": 1,
        "maxItems": MAX_MESSAGES,
        "items": {
            "oneOf": [
                _message("system", {}, ["content"]),
                _message("developer", {}, ["content"]),
                _message("user", {}, ["content"]),
                _message(
                    "assistant",
                    {"tool_calls": _nullable({"type": "array", "items": tool_call})},
                    [],
                    anyOf=[
                        {
                            "required": ["content"],
                            "properties": {"content": {"not": {"type": "null"}}},
                        },
                        {
                            "required": ["tool_calls"],
                            "properties": {"tool_calls": {"type": "array"}},
                        },
                    ],
                ),
                _message(
                    "tool",
                    {"tool_call_id": _string("The call answered.")},
                    ["content"],
                ),
            ]
        },
        "description": "Rendered with the model's chat template.",
    }


def _guided_spec(kind: str) -> Schema:
    """The value of a guided_* field / response_format entry of this kind."""
    if kind == "json_schema":
        return {
            "anyOf": [
                {"type": ["object", "boolean"]},
                {"type": "string", "description": "JSON text of a schema."},
            ]
        }
    if kind == "choice":
        return {"type": "array", "minItems": 1, "items": {"type": "string"}}
    return {"type": "string", "minLength": 1, "maxLength": MAX_GUIDED_SPEC}


def _response_format() -> Schema:
    def kind(name: str, **fields: Schema) -> Schema:
        return {
            "type": "object",
            "properties": {"type": {"const": name}, **fields},
            "required": ["type", *fields],
            "additionalProperties": False,
        }

    json_schema: Schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "description": {"type": "string"},
            "schema": {
                "type": ["object", "boolean"],
                "description": "The JSON Schema the output must match (default: any JSON).",
            },
            "strict": {"type": ["boolean", "null"]},
        },
        "additionalProperties": False,
    }
    return _nullable(
        {
            "oneOf": [
                kind("text"),
                kind("json_object"),
                kind("json_schema", json_schema=json_schema),
                kind("regex", regex=_guided_spec("regex")),
                kind("grammar", grammar=_guided_spec("grammar")),
                kind("choice", choice=_guided_spec("choice")),
            ]
        },
        "Constrained decoding: the output is a JSON object, matches a JSON Schema, a regular "
        "expression, a grammar (Lark in llguidance's dialect, or GBNF) or is one of the "
        "choices. {type: text} is unconstrained. At most one of response_format and the "
        "guided_* fields constrains a request; an invalid grammar is a 400.",
    )


def _tools() -> dict[str, Schema]:
    function: Schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "description": {"type": "string"},
            "parameters": {"type": "object", "description": "JSON Schema of the arguments."},
            "strict": {"type": ["boolean", "null"]},
        },
        "required": ["name"],
        "additionalProperties": False,
    }
    tool: Schema = {
        "type": "object",
        "properties": {"type": {"const": "function"}, "function": function},
        "required": ["type", "function"],
        "additionalProperties": False,
    }
    named: Schema = {
        "type": "object",
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
                "additionalProperties": False,
            },
        },
        "required": ["type", "function"],
        "additionalProperties": False,
    }
    return {
        "tools": _nullable(
            {"type": "array", "items": tool, "maxItems": MAX_TOOLS},
            "Functions the model may call (distinct names).",
        ),
        "tool_choice": _nullable(
            {"anyOf": [{"enum": ["none", "auto", "required"]}, named]},
            "Default auto with tools. required or a named function (one of tools) force a "
            "call and exclude response_format / guided_*; without tools only none or auto.",
        ),
        "parallel_tool_calls": _bool("With tool_choice required: false allows one call only."),
    }


def _conflicts(chat: bool) -> Schema:
    """Combinations of valid fields that are a 400 (for ``not``): two output constraints (the
    guided_* fields and a response_format other than text; null means absent); for chat also
    a forced tool_choice (required or a function) without tools or with an output constraint,
    and top_logprobs without logprobs: true."""
    given: dict[str, Schema] = {key: {"not": {"type": "null"}} for key in GUIDED_FIELDS}
    given["response_format"] = {
        "not": {
            "anyOf": [
                {"type": "null"},
                {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]},
            ]
        }
    }
    keys = list(given)
    rules: list[Schema] = [
        {"required": [a, b], "properties": {a: given[a], b: given[b]}}
        for i, a in enumerate(keys)
        for b in keys[i + 1 :]
    ]
    if chat:
        forced: Schema = {"anyOf": [{"const": "required"}, {"type": "object"}]}
        no_tools: Schema = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
        rules.append(
            {"required": ["tool_choice"], "properties": {"tool_choice": forced, "tools": no_tools}}
        )
        rules += [
            {"required": ["tool_choice", k], "properties": {"tool_choice": forced, k: given[k]}}
            for k in keys
        ]
        rules.append(
            {
                "required": ["top_logprobs"],
                "properties": {
                    "top_logprobs": {"type": "integer"},
                    "logprobs": {"not": {"const": True}},
                },
            }
        )
    return {"anyOf": rules}


def completion_request_schema() -> Schema:
    """POST /v1/completions (``requests.COMPLETION_FIELDS`` and the neutral fields)."""
    token_ids: Schema = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "integer", "minimum": 0},
    }
    return {
        "type": "object",
        "title": "CompletionRequest",
        "description": INTEGERS,
        "properties": {
            "prompt": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                    token_ids,
                    {"type": "array", "minItems": 1, "items": token_ids},
                ],
                "description": "A string, token ids (each below the vocabulary size), or a list "
                "of either: one choice (times n) per prompt.",
            },
            **_common_properties(
                "Tokens to generate (default 16). Prompt tokens + max_tokens must fit the "
                "context length (GET /v1/models max_model_len), else 400."
            ),
            "max_tokens": _int(
                0,
                description="Tokens to generate (default 16). Prompt tokens + max_tokens must "
                "fit the context length (GET /v1/models max_model_len), else 400. 0 only with "
                "echo: the prompt and its logprobs, no output.",
            ),
            "logprobs": _int(0, MAX_LOGPROBS, "Log-probabilities of the sampled tokens, top k."),
            "echo": _bool("Return the prompt (and its logprobs) before the output."),
            "best_of": _int(
                1, MAX_N, "Sample best_of >= n per prompt, return the n most likely; not streamed."
            ),
            "suffix": {
                "type": ["string", "null"],
                "description": "Fill-in-the-middle: the text after the insertion point (each "
                "prompt is the text before it). Needs FIM tokens in the model's vocabulary and "
                "text prompts; not with echo. Empty or null: a plain completion.",
            },
            "top_logprobs": {"enum": [0, None], "description": "Chat's; here only 0 or null."},
            "tools": {
                "anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}],
                "description": "Chat's; here only [] or null.",
            },
            "tool_choice": {"enum": ["none", None], "description": "Chat's; here only none."},
            "parallel_tool_calls": {"type": "null", "description": "Chat's; here only null."},
        },
        "required": ["prompt"],
        "additionalProperties": False,
        "not": _conflicts(chat=False),
    }


def chat_request_schema() -> Schema:
    """POST /v1/chat/completions (``requests.CHAT_FIELDS`` and tools / response_format)."""
    return {
        "type": "object",
        "title": "ChatCompletionRequest",
        "description": INTEGERS,
        "properties": {
            "messages": _messages(),
            **_common_properties(
                "Tokens to generate (default: --default-max-tokens, at most the context left). "
                "Prompt tokens + max_tokens must fit the context length, else 400."
            ),
            "max_completion_tokens": _int(1, description="Takes precedence over max_tokens."),
            "logprobs": _bool("Log-probabilities of the sampled tokens."),
            "top_logprobs": _int(0, MAX_LOGPROBS, "Alternatives per token; needs logprobs."),
            "chat_template_kwargs": _nullable(
                {"type": "object"}, "Extra variables for the chat template (as vLLM)."
            ),
            **_tools(),
            "separate_reasoning": _bool(
                "Return a leading <think> block as message.reasoning_content (default: the "
                "server's --reasoning)."
            ),
        },
        "required": ["messages"],
        "additionalProperties": False,
        "not": _conflicts(chat=True),
    }


def error_schema() -> Schema:
    """``app.error_response``: the OpenAI error body."""
    return {
        "type": "object",
        "title": "ErrorResponse",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {
                        "type": ["string", "integer", "null"],
                        "description": "A code such as model_not_found, else the HTTP status.",
                    },
                },
                "required": ["message", "type", "param", "code"],
            }
        },
        "required": ["error"],
    }


def _usage() -> Schema:
    count: Schema = {"type": "integer", "minimum": 0}
    return {
        "type": "object",
        "properties": {
            "prompt_tokens": count,
            "completion_tokens": count,
            "total_tokens": count,
            "prompt_tokens_details": {
                "type": "object",
                "properties": {"cached_tokens": count},
            },
        },
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    }


def _choice(body: dict[str, Schema], required: list[str]) -> Schema:
    return {
        "type": "object",
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            **body,
            "logprobs": {"type": ["object", "null"]},
            "finish_reason": {"type": ["string", "null"]},
            "prompt_logprobs": {"type": ["array", "null"]},
            "token_ids": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["index", *required, "finish_reason"],
    }


def _completion_response(obj: str, choice: Schema) -> Schema:
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _usage(),
        },
        "required": ["id", "object", "created", "model", "choices", "usage"],
    }


def completion_response_schema() -> Schema:
    return _completion_response("text_completion", _choice({"text": {"type": "string"}}, ["text"]))


def chat_response_schema() -> Schema:
    message: Schema = {
        "type": "object",
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": ["string", "null"]},
            "reasoning_content": {"type": ["string", "null"]},
            "tool_calls": {"type": "array"},
        },
        "required": ["role"],
    }
    return _completion_response("chat.completion", _choice({"message": message}, ["message"]))


def models_schema() -> Schema:
    model: Schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {"type": "integer", "description": "Context length in tokens."},
        },
        "required": ["id", "object", "created", "owned_by"],
    }
    return {
        "type": "object",
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": model}},
        "required": ["object", "data"],
    }


def _status(*values: str, reason: bool = False, restarts: bool = False) -> Schema:
    props: dict[str, Schema] = {"status": {"enum": list(values)}}
    if reason:
        props["reason"] = {"type": ["string", "null"]}
    if restarts:
        props["engine_restarts"] = {"type": "integer", "minimum": 0}
    return {"type": "object", "properties": props, "required": ["status"]}


COMPONENTS: dict[str, Callable[[], Schema]] = {
    "CompletionRequest": completion_request_schema,
    "ChatCompletionRequest": chat_request_schema,
    "CompletionResponse": completion_response_schema,
    "ChatCompletionResponse": chat_response_schema,
    "ErrorResponse": error_schema,
    "ModelList": models_schema,
}

_ERRORS = {
    "400": "Invalid request: malformed JSON, an unknown or unsupported field, a value out of "
    "range, or prompt + max_tokens over the context length.",
    "401": "Missing or wrong API key (only when the server runs with --api-key).",
    "404": "Unknown model name.",
    "413": f"Request body over {MAX_BODY_BYTES} bytes.",
    "503": "Too many requests in the engine (--max-pending), or the engine is gone.",
}


def _error(code: str) -> Schema:
    return {
        "description": _ERRORS[code],
        "content": {"application/json": {"schema": _ref("ErrorResponse")}},
    }


def _json(description: str, schema: Schema) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _sse_event() -> Schema:
    """One server-sent event (OpenAPI < 3.2: a text/event-stream schema describes an event)."""
    return {
        "type": "object",
        "properties": {
            "data": {
                "type": "string",
                "description": "A JSON chunk (choices with deltas; a last one with usage when "
                "asked for; {error: {message, type}} when the request fails after the stream "
                "started), then [DONE].",
            }
        },
        "required": ["data"],
    }


def _generation(request: str, response: str, description: str) -> Schema:
    return {
        "description": description,
        "security": [{"bearerAuth": []}],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": {
            "200": {
                "description": "The result; with stream: true, server-sent events of chunks, "
                "then data: [DONE] (an error after the stream started is an event with an "
                "error object).",
                "content": {
                    "application/json": {"schema": _ref(response)},
                    "text/event-stream": {"schema": _sse_event()},
                },
            },
            **{code: _error(code) for code in ("400", "401", "404", "413", "503")},
        },
    }


def _operations() -> dict[tuple[str, str], Schema]:
    authed = {"security": [{"bearerAuth": []}]}
    control = {"401": _error("401")}
    return {
        ("/v1/completions", "post"): _generation(
            "CompletionRequest", "CompletionResponse", "OpenAI text completions."
        ),
        ("/v1/chat/completions", "post"): _generation(
            "ChatCompletionRequest", "ChatCompletionResponse", "OpenAI chat completions."
        ),
        ("/v1/models", "get"): {
            **authed,
            "description": "The served model.",
            "responses": {"200": _json("The model list.", _ref("ModelList")), **control},
        },
        ("/health", "get"): {
            "description": "Liveness; never needs the API key.",
            "responses": {
                "200": _json("The engine is running.", _status("ok", restarts=True)),
                "503": _json(
                    "The engine is restarting after its process died, or gone for good.",
                    _status("restarting", "unhealthy", reason=True, restarts=True),
                ),
            },
        },
        ("/metrics", "get"): {
            **authed,
            "description": "Prometheus metrics.",
            "responses": {
                "200": {
                    "description": "Prometheus text exposition format.",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
                **control,
            },
        },
        ("/pause", "post"): {
            **authed,
            "description": "Stop scheduling (in-flight steps finish; nothing is dropped).",
            "responses": {"200": _json("Paused.", _status("paused")), **control},
        },
        ("/resume", "post"): {
            **authed,
            "description": "Restart scheduling.",
            "responses": {"200": _json("Running.", _status("running")), **control},
        },
    }


def patch_openapi(schema: Schema) -> Schema:
    """FastAPI's generated document with Tandem's request / response / error schemas."""
    out = copy.deepcopy(schema)
    components = out.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name, make in COMPONENTS.items():
        schemas[name] = make()
    components.setdefault("securitySchemes", {})["bearerAuth"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "The --api-key the server was started with (every route but /health).",
    }
    paths = out.setdefault("paths", {})
    patches = _operations()
    for (path, method), patch in patches.items():
        operation = paths.get(path, {}).get(method)
        if operation is None:  # a route this app does not have
            continue
        operation.update(patch)
    # Routes with pydantic-typed bodies (their schemas are FastAPI's): the API key, and
    # OpenAI error bodies where FastAPI would document its own 422.
    for path, methods in paths.items():
        for method, operation in methods.items():
            if (path, method) in patches:
                continue
            operation["security"] = [{"bearerAuth": []}]
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            codes = ("400", "401", "404", "413") if "requestBody" in operation else ("401",)
            if path in STREAMING_PATHS:
                codes += ("503",)
                content = responses.setdefault("200", {}).setdefault("content", {})
                content["text/event-stream"] = {"schema": _named_sse_event()}
            responses.update({code: _error(code) for code in codes})
            if path.startswith("/v1/messages"):  # Anthropic's error body there
                for code in codes:
                    body = responses[code]["content"]["application/json"]
                    body["schema"] = _ref("AnthropicErrorResponse")
    return out


# Pydantic-typed generation routes that stream (events named by an event: line).
STREAMING_PATHS = ("/v1/messages", "/v1/responses")


def _named_sse_event() -> Schema:
    return {
        "type": "object",
        "properties": {
            "event": {"type": "string", "description": "The event's type."},
            "data": {"type": "string", "description": "The event as JSON (its type again)."},
        },
        "required": ["event", "data"],
    }


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` (and /openapi.json) return the patched document. Lazy: routes
    added after this call are included."""
    generate = app.openapi

    def openapi() -> Schema:
        if app.openapi_schema is None:
            app.openapi_schema = patch_openapi(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
