"""Checks of a live server's responses that a schema cannot state: an error body in its API's
own shape, and an event stream that is well formed and ends as its API ends one."""

from __future__ import annotations

import json


def check_error_body(body: bytes, path: str = "") -> str | None:
    """None if ``body`` is the error body of the path's API (OpenAI's; Anthropic's under
    /v1/messages), else what is wrong with it."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return "error body is not JSON"
    if path.startswith("/v1/messages"):
        err = obj.get("error") if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or obj.get("type") != "error" or not isinstance(err, dict):
            return "not an Anthropic error body"
        if not all(isinstance(err.get(k), str) and err[k] for k in ("type", "message")):
            return "error.type / error.message are not non-empty strings"
        return None
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return "error body has no 'error' object"
    if not isinstance(err.get("message"), str) or not err["message"]:
        return "error.message is not a non-empty string"
    if not isinstance(err.get("type"), str) or not err["type"]:
        return "error.type is not a non-empty string"
    if "param" not in err or not (err["param"] is None or isinstance(err["param"], str)):
        return "error.param is not a string or null"
    if "code" not in err or not (err["code"] is None or isinstance(err["code"], str | int)):
        return "error.code is not a string, integer or null"
    return None


# The last event of a whole stream of the APIs whose events are named.
LAST_EVENT = {
    "/v1/messages": ("message_stop",),
    "/v1/responses": ("response.completed", "response.incomplete"),
}


def check_event_stream(body: bytes, cut_short: bool, path: str = "") -> str | None:
    """None if an SSE body is well formed, has no error event and ends as its API ends a
    stream ([DONE] for OpenAI's, the closing event for Anthropic's and Responses')."""
    events = [
        line[5:].strip()
        for line in body.decode("utf-8", "replace").splitlines()
        if line.startswith("data:")
    ]
    if path in LAST_EVENT:
        types = []
        for data in events:
            try:
                obj = json.loads(data)
            except ValueError:
                return f"stream event is not JSON: {data[:200]}"
            types.append(obj.get("type") if isinstance(obj, dict) else None)
            if types[-1] in ("error", "response.failed"):
                return f"error event in a 200 stream: {data[:300]}"
        if not cut_short and (not types or types[-1] not in LAST_EVENT[path]):
            return f"stream does not end with {LAST_EVENT[path]}"
        return None
    for data in events:
        if data == "[DONE]":
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            return f"stream event is not JSON: {data[:200]}"
        if isinstance(obj, dict) and "error" in obj:
            return f"error event in a 200 stream: {data[:300]}"
    if not cut_short and (not events or events[-1] != "[DONE]"):
        return "stream does not end with data: [DONE]"
    return None
