"""Anthropic's Messages API: ``POST /v1/messages`` (whole or streamed) and
``POST /v1/messages/count_tokens``.

A request becomes chat messages for the model's template (``to_chat``); the output runs
through the same ``ChatOutput`` shaper as chat completions, and ``Blocks`` turns its delta
fields into Anthropic content blocks — the events of a stream, or the blocks of a whole
message, from the same code, so the two always agree."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.sampling_params import check_vocab
from tandem.server import anthropic_schema as a
from tandem.server.chat_output import ChatOutput
from tandem.server.chat_prep import ChatPlan, plan_chat
from tandem.server.errors import RequestError
from tandem.server.guided import parse_tools, tool_grammar
from tandem.server.service import Piece, Pump, Service, sse, whole

BILLING_HEADER = "x-anthropic-billing-header"
PING_S = 5.0  # a ping after this long without an event (e.g. while a long prompt prefills)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(e: RequestError) -> JSONResponse:
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": str(e)}}
    return JSONResponse(body, status_code=e.status)


def _text(blocks: str | list[Any] | None, where: str) -> str:
    """The text of a string or of text blocks (an image is refused)."""
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    for j, b in enumerate(blocks):
        if b.type != "text":
            raise RequestError(f"{b.type} content is not supported", param=f"{where}[{j}]")
    return "\n".join(b.text for b in blocks)


def system_text(system: str | list[a.TextBlock] | None, keep_billing: bool) -> str | None:
    """The system prompt. Blocks starting with the billing header change on every request and
    would defeat the prefix cache: they are dropped unless the server keeps them."""
    if system is None:
        return None
    blocks = [a.TextBlock(type="text", text=system)] if isinstance(system, str) else system
    if not keep_billing:
        blocks = [b for b in blocks if not b.text.lstrip().startswith(BILLING_HEADER)]
    return "\n".join(b.text for b in blocks) if blocks else None


def to_chat(req: a._Prompt, keep_billing: bool) -> list[dict[str, Any]]:
    """Chat-template messages. In a user turn the tool results come first, as ``tool``
    messages in their order, then the turn's text; an assistant turn's text, thinking and
    tool uses become one message (``content``, ``reasoning_content``, ``tool_calls``)."""
    out: list[dict[str, Any]] = []
    system = system_text(req.system, keep_billing)
    if system is not None:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(m.content):
            here = f"{where}[{j}]"
            if b.type == "text":
                texts.append(b.text)
            elif b.type == "image":
                raise RequestError("image content is not supported by this server", param=here)
            elif b.type == "tool_result" and m.role == "user":
                body = _text(b.content, f"{here}.content")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": b.tool_use_id,
                        "content": f"Error: {body}" if b.is_error else body,
                    }
                )
            elif b.type == "tool_use" and m.role == "assistant":
                fn = {"name": b.name, "arguments": b.input}
                calls.append({"id": b.id, "type": "function", "function": fn})
            elif b.type == "thinking" and m.role == "assistant":
                thinking.append(b.thinking)
            elif b.type == "redacted_thinking" and m.role == "assistant":
                continue  # encrypted by another provider: nothing a local model can read
            else:
                raise RequestError(f"{b.type} blocks are not allowed in {m.role} turns", param=here)
        if m.role == "user":
            if texts or not m.content:
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools_body(req: a._Prompt) -> dict[str, Any]:
    """The request's tools in chat completions' shape (what the templates and the tool-call
    machinery take)."""
    if not req.tools:
        if req.tool_choice is not None and req.tool_choice.type not in ("auto", "none"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return {}
    tools = []
    for t in req.tools:
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        if t.strict is not None:
            fn["strict"] = t.strict
        tools.append({"type": "function", "function": fn})
    body: dict[str, Any] = {"tools": tools}
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if getattr(choice, "disable_parallel_tool_use", None):
            body["parallel_tool_calls"] = False
    return body


def prepare(svc: Service, req: a._Prompt) -> tuple[ChatPlan, dict[str, Any]]:
    """The chat plan of a request, and its sampling fields so far."""
    svc.check_model(req.model)
    tools = parse_tools(_tools_body(req), None)
    kwargs: dict[str, Any] = {}
    guided = None
    if tools is not None:
        if tools.choice != "none":
            kwargs["tools"] = list(tools.tools)
        guided = tool_grammar(tools)
    thinking = req.thinking
    budget = None
    if thinking is not None:
        kwargs["enable_thinking"] = thinking.type != "disabled"
        if isinstance(thinking, a.ThinkingEnabled):
            budget = thinking.budget_tokens
    messages = to_chat(req, svc.settings.keep_billing_header)
    plan = plan_chat(
        svc,
        messages,
        template_kwargs=kwargs,
        tools=tools,
        separate_reasoning=None,
        guided=guided,
        guided_param="tool_choice",
        thinking_budget=budget,
        continue_final=True,
    )
    sampling: dict[str, Any] = {}
    if plan.guided is not None:
        sampling["guided"] = plan.guided
    return plan, sampling


class Blocks:
    """Content blocks built from a shaper's delta fields, with the stream events that build
    them. A block is closed when a block of another kind begins."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._json: list[str] = []  # tool_use blocks: the arguments' JSON text so far
        self._open = False

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.blocks.append(block)
        self._json.append("")
        self._open = True
        start = {"type": "content_block_start", "index": len(self.blocks) - 1}
        shown = {**block, "input": {}} if block["type"] == "tool_use" else block
        return out + [sse({**start, "content_block": dict(shown)}, "content_block_start")]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        event = {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}
        return sse(event, "content_block_delta")

    def _current(self, kind: str) -> bool:
        return self._open and self.blocks[-1]["type"] == kind

    def feed(self, fields: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if text := fields.get("reasoning_content"):
            if not self._current("thinking"):
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += text
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        if text := fields.get("content"):
            if not self._current("text"):
                out += self._start({"type": "text", "text": ""})
            self.blocks[-1]["text"] += text
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in fields.get("tool_calls", []):
            fn = call.get("function", {})
            if "id" in call:
                block = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}
                out += self._start(block)
            if fragment := fn.get("arguments"):
                self._json[-1] += fragment
                out.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        return out

    def close(self) -> list[bytes]:
        if not self._open:
            return []
        self._open = False
        i = len(self.blocks) - 1
        block = self.blocks[i]
        if block["type"] == "tool_use":
            block["input"] = _input(self._json[i])
        return [sse({"type": "content_block_stop", "index": i}, "content_block_stop")]


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    # Arguments that are not a JSON object (a call cut short by max_tokens) are kept whole.
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def stop_reason(piece: Piece, shaper: ChatOutput) -> tuple[str, str | None]:
    if piece.finish_reason == "length":
        return "max_tokens", None
    if shaper.calls:
        return "tool_use", None
    if piece.stop_sequence is not None:
        return "stop_sequence", piece.stop_sequence
    return "end_turn", None


def usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    """Anthropic's accounting: ``input_tokens`` are the prompt tokens not read from the cache,
    so input + cache_read is the whole prompt (what count_tokens returns)."""
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


def install_anthropic_routes(app: FastAPI, svc: Service) -> None:
    @app.post(
        "/v1/messages/count_tokens",
        response_model=a.CountTokensResponse,
        responses={400: {"model": a.AnthropicErrorResponse}},
    )
    async def count_tokens(body: a.CountTokensRequest) -> a.CountTokensResponse:
        plan, _ = await asyncio.to_thread(prepare, svc, body)
        return a.CountTokensResponse(input_tokens=len(plan.ids))

    @app.post(
        "/v1/messages",
        response_model=a.MessageResponse,
        responses={400: {"model": a.AnthropicErrorResponse}},
    )
    async def messages(body: a.MessagesRequest, request: Request) -> Response:
        plan, sampling = await asyncio.to_thread(prepare, svc, body)
        for key in ("temperature", "top_p", "top_k"):
            if (value := getattr(body, key)) is not None:
                sampling[key] = value
        params = svc.params_for(body.max_tokens, sampling, len(plan.ids), body.max_tokens)
        vocab = int(svc.client.info.get("vocab_size") or 0)
        if vocab:
            check_vocab(params, vocab)
        stops = list(body.stop_sequences or [])
        svc.check_capacity(1)
        shaper = plan.shaper()
        keep_special = plan.keep_special
        mid = "msg_" + uuid.uuid4().hex
        model = svc.settings.served_model_name
        prompt = len(plan.ids)
        pump = Pump(svc, svc.run_one(plan.ids, params, stops, keep_special=keep_special))
        blocks = Blocks()

        async def pieces() -> AsyncIterator[tuple[list[bytes], Piece | None]]:
            """Events of each piece; (a ping, None) while nothing comes for PING_S."""
            async for item in pump.items(PING_S):
                if item is None:
                    yield [sse({"type": "ping"}, "ping")], None
                    continue
                events = blocks.feed(shaper.feed(item.text) if item.text else {})
                if item.finish_reason is not None:
                    events += blocks.feed(shaper.finish()) + blocks.close()
                yield events, item
                if item.finish_reason is not None:
                    return  # the answer is whole: do not wait for the producer's clean-up

        if not body.stream:

            async def collect() -> Piece | None:
                last = None
                async for _, piece in pieces():
                    last = piece or last
                return last

            try:
                last = await whole(svc, request, "messages", asyncio.create_task(collect()))
            finally:
                await pump.close()
            if last is None:
                return Response(status_code=499)  # the client went away
            reason, sequence = stop_reason(last, shaper)
            return JSONResponse(
                {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": blocks.blocks,
                    "stop_reason": reason,
                    "stop_sequence": sequence,
                    "usage": usage(prompt, last.cached_tokens, last.num_tokens),
                }
            )

        async def events() -> AsyncIterator[bytes]:
            start = {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage(prompt, 0, 0),
            }
            yield sse({"type": "message_start", "message": start}, "message_start")
            status = "error"
            try:
                async for out, piece in pieces():
                    for event in out:
                        yield event
                    if piece is not None and piece.finish_reason is not None:
                        reason, sequence = stop_reason(piece, shaper)
                        delta = {"stop_reason": reason, "stop_sequence": sequence}
                        final = usage(prompt, piece.cached_tokens, piece.num_tokens)
                        yield sse(
                            {"type": "message_delta", "delta": delta, "usage": final},
                            "message_delta",
                        )
                        yield sse({"type": "message_stop"}, "message_stop")
                        status = "ok"
            except (GeneratorExit, asyncio.CancelledError):
                status = "disconnected"
                raise
            except RequestError as e:
                kind = ERROR_TYPES.get(e.status, "api_error")
                yield sse({"type": "error", "error": {"type": kind, "message": str(e)}}, "error")
            except Exception as e:  # never a broken stream without a word
                yield sse(
                    {"type": "error", "error": {"type": "api_error", "message": str(e)}}, "error"
                )
            finally:
                svc.metrics.requests.labels("messages", status).inc()
                await pump.close()

        return StreamingResponse(events(), media_type="text/event-stream")
