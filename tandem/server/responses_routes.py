"""OpenAI's Responses API, stateless: ``POST /v1/responses`` (whole or streamed).

Input items become chat messages for the model's template (``to_chat``); the output runs
through the same ``ChatOutput`` shaper as chat completions, and ``Items`` turns its delta
fields into output items — the events of a stream or the items of a whole response, from the
same code. Reasoning can round-trip: with ``include: ["reasoning.encrypted_content"]`` a
reasoning item carries its text, encoded, for the client to send back next turn."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.sampling_params import check_vocab
from tandem.server import responses_schema as r
from tandem.server.chat_prep import ChatPlan, plan_chat
from tandem.server.errors import RequestError
from tandem.server.guided import parse_guided, parse_tools, tool_grammar
from tandem.server.service import Piece, Pump, Service, sse, whole

ENCRYPTED_PREFIX = "tandem-r1:"  # encrypted_content this server wrote (plain, encoded)


def encode_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def decode_reasoning(blob: str | None) -> str | None:
    """The text of an encrypted_content this server wrote; None for any other (another
    provider's is opaque, and a local model could not read it anyway)."""
    if not blob or not blob.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.b64decode(blob[len(ENCRYPTED_PREFIX) :], validate=True).decode()
    except ValueError:
        return None


def _parts_text(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text"):
            texts.append(part.text)
        elif part.type == "refusal":
            texts.append(part.refusal)
        else:
            raise RequestError(f"{part.type} content is not supported", param=f"{where}[{j}]")
    return "".join(texts)


def to_chat(req: r.ResponsesRequest) -> list[dict[str, Any]]:
    """Chat-template messages. Function calls join the assistant message before them (or
    start one); a reasoning item's text goes with the assistant turn that follows it."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    items = [r.MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else []
    items = items or list(req.input)  # type: ignore[arg-type]
    reasoning: list[str] = []

    def assistant(content: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            text = _parts_text(item.content, f"{where}.content")
            if item.role == "assistant":
                assistant(text)
            else:
                out.append({"role": item.role, "content": text})
        elif item.type == "function_call":
            last = out[-1] if out and out[-1]["role"] == "assistant" and not reasoning else None
            msg = last or assistant("")
            fn = {"name": item.name, "arguments": _arguments(item.arguments, where)}
            call = {"id": item.call_id, "type": "function", "function": fn}
            msg.setdefault("tool_calls", []).append(call)
        elif item.type == "function_call_output":
            text = _parts_text(item.output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
        else:  # reasoning
            text = decode_reasoning(item.encrypted_content)
            if text is None:
                text = "".join(p.text for p in item.content or item.summary)
            reasoning.append(text)
    return out


def _arguments(arguments: str, where: str) -> Any:
    """Arguments as an object for the template; text that is not a JSON object (a call cut
    short, as this server returns it) stays the text, so any call it returned can come back."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _chat_body(req: r.ResponsesRequest) -> dict[str, Any]:
    """Tools, tool choice and text format in chat completions' shape."""
    body: dict[str, Any] = {}
    if req.tools:
        tools = []
        for t in req.tools:
            fn = {k: v for k, v in t.items() if k != "type" and v is not None}
            tools.append({"type": "function", "function": fn})
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, r.NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, r.TextFormatJsonSchema):
        spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    return body


def prepare(svc: Service, req: r.ResponsesRequest) -> ChatPlan:
    svc.check_model(req.model)
    body = _chat_body(req)
    guided = parse_guided(body)
    param = "text.format"
    tools = parse_tools(body, guided)
    kwargs: dict[str, Any] = {}
    if tools is not None:
        if tools.choice != "none":
            kwargs["tools"] = list(tools.tools)
        forced = tool_grammar(tools)
        if forced is not None:
            guided, param = forced, "tool_choice"
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None:
        kwargs["enable_thinking"] = effort not in ("none", "minimal")
    return plan_chat(
        svc,
        to_chat(req),
        template_kwargs=kwargs,
        tools=tools,
        separate_reasoning=None,
        guided=guided,
        guided_param=param,
    )


class Items:
    """Output items built from a shaper's delta fields, with the stream events that build
    them (without sequence numbers). An item is done when an item of another kind begins."""

    def __init__(self, encrypt: bool) -> None:
        self.items: list[dict[str, Any]] = []
        self.encrypt = encrypt
        self._open = False

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.items.append(item)
        self._open = True
        index = len(self.items) - 1
        out.append({"type": "response.output_item.added", "output_index": index, "item": item})
        part = {"reasoning": "reasoning_text", "message": "output_text"}.get(item["type"])
        if part is not None:
            out.append(self._at({"type": "response.content_part.added", "content_index": 0}))
            out[-1]["part"] = _part(part, "")
        return _copies(out)

    def _at(self, event: dict[str, Any]) -> dict[str, Any]:
        item = self.items[-1]
        return {**event, "output_index": len(self.items) - 1, "item_id": item["id"]}

    def _current(self, kind: str) -> bool:
        return self._open and self.items[-1]["type"] == kind

    def feed(self, fields: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if text := fields.get("reasoning_content"):
            if not self._current("reasoning"):
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
                out += self._start({**item, "status": "in_progress"})
            self.items[-1]["_text"] = self.items[-1].get("_text", "") + text
            delta = {"type": "response.reasoning_text.delta", "content_index": 0, "delta": text}
            out.append(self._at(delta))
        if text := fields.get("content"):
            if not self._current("message"):
                item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": []}
                out += self._start({**item, "status": "in_progress"})
            self.items[-1]["_text"] = self.items[-1].get("_text", "") + text
            delta = {"type": "response.output_text.delta", "content_index": 0, "delta": text}
            out.append(self._at({**delta, "logprobs": []}))
        for call in fields.get("tool_calls", []):
            fn = call.get("function", {})
            if "id" in call:
                item = {
                    "id": _id("fc"),
                    "type": "function_call",
                    "call_id": call["id"],
                    "name": fn["name"],
                    "arguments": "",
                    "status": "in_progress",
                }
                out += self._start(item)
            if fragment := fn.get("arguments"):
                self.items[-1]["arguments"] += fragment
                delta = {"type": "response.function_call_arguments.delta", "delta": fragment}
                out.append(self._at(delta))
        return out

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        item = self.items[-1]
        out: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            done = {"type": "response.function_call_arguments.done"}
            out.append(self._at({**done, "arguments": item["arguments"]}))
        else:
            text = item.pop("_text", "")
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            done = {"type": f"response.{kind}.done", "content_index": 0, "text": text}
            if kind == "output_text":
                done["logprobs"] = []
            out.append(self._at(done))
            part = self._at({"type": "response.content_part.done", "content_index": 0})
            out.append({**part, "part": _part(kind, text)})
            item["content"] = [_part(kind, text)]
            if kind == "reasoning_text" and self.encrypt:
                item["encrypted_content"] = encode_reasoning(text)
        item["status"] = status
        index = len(self.items) - 1
        out.append({"type": "response.output_item.done", "output_index": index, "item": item})
        return _copies(out)


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": kind, "text": text}


def _copies(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events hold snapshots: an item sent as added must not change when it grows later."""
    return json.loads(json.dumps(events))


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def install_responses_routes(app: FastAPI, svc: Service) -> None:
    @app.post("/v1/responses")
    async def responses(body: r.ResponsesRequest, request: Request) -> Response:
        plan = await asyncio.to_thread(prepare, svc, body)  # templating off the loop
        sampling: dict[str, Any] = {}
        if plan.guided is not None:
            sampling["guided"] = plan.guided
        for key in ("temperature", "top_p"):
            if (value := getattr(body, key)) is not None:
                sampling[key] = value
        default = svc.settings.default_max_tokens
        params = svc.params_for(
            body.max_output_tokens, sampling, len(plan.ids), default, "max_output_tokens"
        )
        vocab = int(svc.client.info.get("vocab_size") or 0)
        if vocab:
            check_vocab(params, vocab)
        svc.check_capacity(1)
        shaper = plan.shaper()
        keep_special = plan.keep_special
        encrypt = "reasoning.encrypted_content" in (body.include or [])
        items = Items(encrypt)
        prompt = len(plan.ids)
        rid = _id("resp")
        created = int(time.time())

        tool_choice = body.model_dump(mode="json", include={"tool_choice"})["tool_choice"]
        tool_choice = tool_choice or "auto"

        def snapshot(status: str, last: Piece | None) -> dict[str, Any]:
            out: dict[str, Any] = {
                "id": rid,
                "object": "response",
                "created_at": created,
                "status": status,
                "model": svc.settings.served_model_name,
                "output": items.items if last else [],
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "tool_choice": tool_choice,
                "tools": body.tools or [],
                "temperature": body.temperature,
                "top_p": body.top_p,
                "max_output_tokens": body.max_output_tokens,
                "instructions": body.instructions,
                "metadata": body.metadata or {},
                "text": {"format": {"type": "text"}},
                "reasoning": {"effort": body.reasoning.effort} if body.reasoning else None,
                "store": False,
                "previous_response_id": None,
                "truncation": "disabled",
                "user": body.user,
                "error": None,
                "incomplete_details": None,
                "usage": None,
            }
            if body.text is not None and body.text.format is not None:
                out["text"] = {"format": body.text.format.model_dump(by_alias=True)}
            if last is not None:
                reasoning = sum(
                    len(svc.tokenizer.encode(c["text"]))
                    for i in items.items
                    if i["type"] == "reasoning"
                    for c in i.get("content", [])
                )
                out["usage"] = {
                    "input_tokens": prompt,
                    "input_tokens_details": {"cached_tokens": last.cached_tokens},
                    "output_tokens": last.num_tokens,
                    "output_tokens_details": {"reasoning_tokens": reasoning},
                    "total_tokens": prompt + last.num_tokens,
                }
                if status == "incomplete":
                    out["incomplete_details"] = {"reason": "max_output_tokens"}
            return out

        async def pieces() -> AsyncIterator[tuple[list[dict[str, Any]], Piece]]:
            async for piece in svc.run_one(plan.ids, params, [], keep_special=keep_special):
                events = items.feed(shaper.feed(piece.text) if piece.text else {})
                if piece.finish_reason is not None:
                    events += items.feed(shaper.finish())
                    events += items.close(_status(piece))
                yield events, piece

        if not body.stream:

            async def collect() -> Piece | None:
                last = None
                async for _, piece in pieces():
                    last = piece
                return last

            last = await whole(svc, request, "responses", svc.spawn(collect()))
            if last is None:
                return Response(status_code=499)  # the client went away
            return JSONResponse(snapshot(_status(last), last))

        pump = Pump(svc, pieces())

        async def events() -> AsyncIterator[bytes]:
            seq = 0

            def emit(event: dict[str, Any]) -> bytes:
                nonlocal seq
                event = {**event, "sequence_number": seq}
                seq += 1
                return sse(event, event["type"])

            status = "error"
            try:
                yield emit({"type": "response.created", "response": snapshot("in_progress", None)})
                yield emit(
                    {"type": "response.in_progress", "response": snapshot("in_progress", None)}
                )
                try:
                    async for out, piece in pump.items():
                        for event in out:
                            yield emit(event)
                        if piece.finish_reason is not None:
                            final = _status(piece)
                            done = "completed" if final == "completed" else "incomplete"
                            response = snapshot(final, piece)
                            yield emit({"type": f"response.{done}", "response": response})
                            status = "ok"
                            break  # whole: do not wait for the producer's clean-up
                except Exception as e:  # reported in-stream, never a broken stream
                    code = "server_error"
                    if isinstance(e, RequestError) and e.status < 500:
                        code = "invalid_request_error"
                    yield emit({"type": "error", "code": code, "message": str(e)})
                    failed = snapshot("failed", None)
                    failed["error"] = {"code": code, "message": str(e)}
                    yield emit({"type": "response.failed", "response": failed})
            except (GeneratorExit, asyncio.CancelledError):
                status = "disconnected"
                raise
            finally:
                svc.metrics.requests.labels("responses", status).inc()
                await pump.close()

        return StreamingResponse(events(), media_type="text/event-stream")


def _status(piece: Piece) -> str:
    return "incomplete" if piece.finish_reason == "length" else "completed"
