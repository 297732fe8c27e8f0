"""OpenAI-compatible HTTP routes. Chat templates, tokenization, detokenization, stop strings
and SSE all run here, in the HTTP process; the engine core only sees token ids."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.frontend.engine_client import Delta, EngineClient, EngineDeadError
from tandem.frontend.stop import StopStringMatcher
from tandem.frontend.tokenizer import IncrementalDetokenizer, Tokenizer
from tandem.sampling_params import INT_MAX, SamplingParams, check_vocab, stop_token_set
from tandem.server.chat_output import ChatOutput
from tandem.server.guided import after_reasoning
from tandem.server.metrics import Metrics
from tandem.server.openapi import MAX_BODY_BYTES, install_openapi
from tandem.server.reasoning import THINK_END, starts_inside
from tandem.server.requests import (
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    RequestError,
    parse_chat,
    parse_completion,
)
from tandem.server.tokenize_api import install_tokenize_routes
from tandem.server.tool_calls import detect_format


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_pending: int = 1024  # requests in the engine (running + queued) before 503
    default_max_tokens: int = 2048  # chat completions without max_tokens
    reasoning: str = "auto"  # split <think> blocks: auto (template uses them) | on | off
    tool_call_format: str = "auto"  # auto (template / model type) | a tool_calls.FORMATS name


SEEDS = INT_MAX + 1  # seed + j of sample j wraps within the 64-bit range


def _engine_error(d: Delta, *, dead: bool) -> RequestError:
    """A request the engine ended with an error: the client's fault (400) unless the engine
    died or hit a bug (500) or ran out of device memory (503: retry later)."""
    message = d.error or "request failed"
    if dead or d.error_kind == "internal":
        return RequestError(message, status=500, kind="server_error")
    if d.error_kind == "resource":
        return RequestError(message, status=503, kind="server_error")
    return RequestError(message)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Delta fields of two pieces as one (strings joined, tool-call lists appended)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


def error_response(e: RequestError) -> JSONResponse:
    body = {
        "error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.code or e.status}
    }
    return JSONResponse(body, status_code=e.status)


def validation_error(e: RequestValidationError) -> RequestError:
    """A pydantic-typed body that does not validate: a 400 naming the first offending field."""
    errors = e.errors()
    if not errors:
        return RequestError("invalid request body")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # A union body (e.g. /tokenize) reports each member's errors under the member's name.
    loc = [x for x in loc if not x[:1].isupper()]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    return RequestError(f"{param}: {message}" if param else message, param=param)


@dataclass
class Piece:
    text: str
    token_ids: list[int]  # new since the previous piece
    num_tokens: int  # generated so far
    finish_reason: str | None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[Any] | None = None  # one entry per token_ids entry, when asked for
    prompt_logprobs: list[Any] | None = None  # on the first piece, when asked for


def create_app(client: EngineClient, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None)
    install_openapi(app)
    metrics = Metrics()
    max_model_len = int(client.info.get("max_model_len", 0))
    template = getattr(tokenizer.hf, "chat_template", None)
    template = template if isinstance(template, str) else None
    tool_format = (
        detect_format(template, client.info.get("model_type"))
        if settings.tool_call_format == "auto"
        else settings.tool_call_format
    )
    thinks = settings.reasoning == "on" or (
        settings.reasoning == "auto" and template is not None and THINK_END in template
    )

    app.add_middleware(_Guard, settings=settings)

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > settings.max_body_bytes:
            raise RequestError(f"request body exceeds {settings.max_body_bytes} bytes", status=413)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # also ints past Python's digit limit
            raise RequestError(f"malformed JSON: {e}") from None

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.served_model_name:
            raise RequestError(
                f"model '{name}' does not exist",
                param="model",
                status=404,
                code="model_not_found",
            )

    admitted = [0]  # generation tasks alive (admitted requests), across all routes

    def check_capacity(n: int) -> None:
        if not client.healthy:
            state = "restarting" if client.restarting else "not available"
            raise RequestError(f"engine is {state}", status=503, kind="server_error")
        if n > settings.max_pending:
            raise RequestError(
                f"this request asks for {n} sequences (prompts x n); the server admits at "
                f"most {settings.max_pending} at once",
                param="n",
            )
        if admitted[0] + n > settings.max_pending:
            raise RequestError("server is overloaded, retry later", status=503, kind="server_error")

    def spawn(coro) -> asyncio.Task:
        """Run one admitted generation; it counts against max_pending until it ends."""
        admitted[0] += 1
        task = asyncio.create_task(coro)
        task.add_done_callback(lambda _: admitted.__setitem__(0, admitted[0] - 1))
        return task

    def params_for(req: GenerationRequest, prompt_len: int, default: int) -> SamplingParams:
        room = max_model_len - prompt_len
        if room < 1:
            raise RequestError(
                f"prompt ({prompt_len} tokens) leaves no room in the context length "
                f"({max_model_len} tokens)",
                param="prompt" if req.max_tokens is None else "max_tokens",
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else min(default, room)
        if max_tokens < 1 or prompt_len + max_tokens > max_model_len:
            raise RequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context length ({max_model_len} tokens)",
                param="max_tokens",
            )
        try:
            return SamplingParams(max_tokens=max_tokens, **req.sampling)
        except ValueError as e:  # e.g. min_tokens above the max_tokens this prompt gets
            param = "min_tokens" if "min_tokens" in str(e) else None
            raise RequestError(str(e), param=param) from None

    async def run_one(
        prompt_ids: list[int],
        params: SamplingParams,
        stops: list[str],
        rid: str | None = None,
        follows: str | None = None,
        keep_special: bool = False,
        score_only: bool = False,
    ) -> AsyncIterator[Piece]:
        """The request's output as text pieces. ``score_only``: one piece at the end with the
        prompt's log-probabilities and no output (max_tokens 0 with echo)."""
        rid = rid or uuid.uuid4().hex
        detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=not keep_special)
        matcher = StopStringMatcher(stops)
        stop_ids = stop_token_set(params, tokenizer.eos_token_ids)
        count = cached = 0
        pending_ids: list[int] = []
        pending_lps: list[Any] = []
        want_lps = params.logprobs is not None
        prompt_lps: list[Any] | None = None

        def piece(text: str, reason: str | None) -> Piece:
            nonlocal prompt_lps
            p = Piece(
                text,
                pending_ids,
                count,
                reason,
                cached,
                pending_lps if want_lps else None,
                prompt_lps,
            )
            prompt_lps = None
            return p

        start = last = time.monotonic()
        gen = client.generate(rid, prompt_ids, params, follows=follows)
        if follows is None:
            metrics.prompt_tokens.inc(len(prompt_ids))
        try:
            async for d in gen:
                if d.finish_reason == "error":
                    raise _engine_error(d, dead=client.dead is not None)
                now = time.monotonic()
                (metrics.ttft if count == 0 else metrics.itl).observe(
                    now - (start if count == 0 else last)
                )
                last = now
                if d.cached_tokens is not None:
                    cached = d.cached_tokens
                if d.prompt_logprobs is not None:
                    prompt_lps = d.prompt_logprobs
                if score_only:
                    if d.finish_reason is not None:
                        yield piece("", "length")
                        return
                    continue
                count += len(d.new_token_ids)
                metrics.generation_tokens.inc(len(d.new_token_ids))
                ids = d.new_token_ids
                pending_ids += ids
                pending_lps += d.logprobs or []
                if d.finish_reason == "stop" and ids and ids[-1] in stop_ids:
                    ids = ids[:-1]  # the stop token is not text (a completed grammar's is)
                text = matcher.feed(detok.add(ids))
                if matcher.stopped:
                    yield piece(text, "stop")
                    return
                if d.finish_reason is not None:
                    yield piece(text + matcher.flush(), d.finish_reason)
                    return
                if text:
                    yield piece(text, None)
                    pending_ids, pending_lps = [], []
        finally:
            metrics.e2e.observe(time.monotonic() - start)
            await gen.aclose()

    def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def generate(
        request: Request,
        endpoint: str,
        req: GenerationRequest,
        prompts: list[list[int]],
        default_max: int,
        chat: bool,
        shaper: Callable[[], ChatOutput] | None = None,
    ) -> Response:
        plist = [params_for(req, len(p), default_max) for p in prompts]
        vocab = int(client.info.get("vocab_size") or 0)
        try:  # before anything streams: the engine would only fail it later
            if vocab and plist:
                check_vocab(plist[0], vocab)
        except ValueError as e:
            raise RequestError(str(e), param="logit_bias") from None
        # n samples per prompt: choice p * n + j. Samples after the first follow it (they
        # reuse its prefill through the prefix cache) and draw with seed + j.
        # best_of (completions): sample m >= n per prompt, return the n with the highest total
        # log-probability (so those samples carry their log-probabilities internally).
        n = req.n
        m = getattr(req, "best_of", None) or n
        rids = [uuid.uuid4().hex for _ in range(len(prompts) * m)]
        jobs: list[tuple[list[int], SamplingParams, str, str | None]] = []
        for p, (prompt, sp) in enumerate(zip(prompts, plist, strict=True)):
            if m > n and sp.logprobs is None:
                sp = replace(sp, logprobs=0)
            for j in range(m):
                seeded = (
                    sp if sp.seed is None or j == 0 else replace(sp, seed=(sp.seed + j) % SEEDS)
                )
                jobs.append((prompt, seeded, rids[p * m + j], rids[p * m] if j else None))
        check_capacity(len(jobs))
        shapers = [shaper() if shaper else ChatOutput() for _ in jobs]
        keep_special = shapers[0].fmt == "mistral"  # its [TOOL_CALLS] is a special token
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "created": created, "model": settings.served_model_name}

        offsets = [0] * len(jobs)  # completions' text_offset, per choice

        def tok(t: int) -> str:
            return tokenizer.decode([t])

        echo = getattr(req, "echo", False)
        score_only = getattr(req, "score_only", False)

        def pieces(i: int) -> AsyncIterator[Piece]:
            return run_one(*jobs[i][:2], req.stop, *jobs[i][2:], keep_special, score_only)

        echoed = [False] * len(jobs)

        def echo_text(i: int) -> str:
            """The prompt's text, once per choice (completions with echo)."""
            if not echo or echoed[i]:
                return ""
            echoed[i] = True
            return tokenizer.decode(jobs[i][0])

        def prompt_entries(i: int, plps: list[Any] | None) -> list[Any]:
            """Completions-format logprobs of the echoed prompt (the first token has none)."""
            prompt = jobs[i][0]
            lps = [None] + [tuple(e) for e in plps or []]
            return list(zip(prompt, lps, strict=False))

        def logprobs_obj(
            i: int, ids: list[int], lps: list[Any] | None, plps: list[Any] | None = None
        ) -> Any:
            """OpenAI's logprobs shapes: completions (tokens, token_logprobs, top_logprobs,
            text_offset; the echoed prompt first) or chat (content entries with bytes)."""
            if lps is None:
                return None
            if chat:
                content = []
                for t, (lp, top) in zip(ids, lps, strict=False):
                    s = tok(t)
                    content.append(
                        {
                            "token": s,
                            "logprob": lp,
                            "bytes": list(s.encode()),
                            "top_logprobs": [
                                {"token": tok(a), "logprob": v, "bytes": list(tok(a).encode())}
                                for a, v in top
                            ],
                        }
                    )
                return {"content": content}
            pairs = list(zip(ids, lps, strict=False))
            if plps is not None and echo:
                pairs = prompt_entries(i, plps) + pairs
            strs = [tok(t) for t, _ in pairs]
            text_offset = []
            for s in strs:
                text_offset.append(offsets[i])
                offsets[i] += len(s)
            return {
                "tokens": strs,
                "token_logprobs": [e[0] if e else None for _, e in pairs],
                "top_logprobs": [{tok(a): v for a, v in e[1]} if e else None for _, e in pairs],
                "text_offset": text_offset,
            }

        def prompt_logprobs_field(i: int, plps: list[Any]) -> list[Any]:
            """The ``prompt_logprobs`` extension: None for the first prompt token, then each
            token's log-probability and the top-k there."""
            out: list[Any] = [None]
            for t, (lp, top) in zip(jobs[i][0][1:], plps, strict=False):
                out.append(
                    {
                        "token": tok(t),
                        "logprob": lp,
                        "top_logprobs": [{"token": tok(a), "logprob": v} for a, v in top],
                    }
                )
            return out

        def choice(
            i: int,
            text: str | None,
            reason: str | None,
            first: bool = False,
            ids: list[int] | None = None,
            lps: list[Any] | None = None,
            plps: list[Any] | None = None,
            fields: dict[str, Any] | None = None,
        ) -> dict[str, Any]:
            lp_obj = logprobs_obj(i, ids or [], lps, plps)
            if not chat:
                text = echo_text(i) + (text or "")
                c = {"index": i, "text": text, "logprobs": lp_obj, "finish_reason": reason}
                if plps is not None and not echo:
                    c["prompt_logprobs"] = prompt_logprobs_field(i, plps)
                if req.return_token_ids and ids is not None:
                    c["token_ids"] = ids
                return c
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if fields is not None:
                delta.update(fields)  # content / reasoning_content / tool_calls
            elif text is not None:
                delta["content"] = text
            c = {"index": i, "delta": delta, "logprobs": lp_obj, "finish_reason": reason}
            if plps is not None:
                c["prompt_logprobs"] = prompt_logprobs_field(i, plps)
            if req.return_token_ids and ids is not None:
                c["token_ids"] = ids
            return c

        if not req.stream:

            async def collect(i: int):
                parts, ids, n, reason, cached = [], [], 0, None, 0
                lps: list[Any] | None = None
                plps: list[Any] | None = None
                async for piece in pieces(i):
                    if piece.prompt_logprobs is not None:
                        plps = piece.prompt_logprobs
                    parts.append(piece.text)
                    ids += piece.token_ids
                    n, reason, cached = piece.num_tokens, piece.finish_reason, piece.cached_tokens
                    if piece.logprobs is not None:
                        lps = (lps or []) + piece.logprobs
                if plps is None and jobs[i][1].prompt_logprobs is not None:
                    plps = []  # a one-token prompt
                return "".join(parts), n, reason, ids, cached, lps, plps

            tasks = [spawn(collect(i)) for i in range(len(jobs))]
            gathered = asyncio.gather(*tasks)
            watcher = asyncio.create_task(_watch_disconnect(request))
            done, _ = await asyncio.wait({watcher, gathered}, return_when=asyncio.FIRST_COMPLETED)
            watcher.cancel()
            if gathered not in done:
                for t in tasks:
                    t.cancel()  # the client went away: abort its requests in the engine
                await asyncio.gather(*tasks, return_exceptions=True)
                metrics.requests.labels(endpoint, "disconnected").inc()
                return Response(status_code=499)
            if gathered.exception() is not None:
                for t in tasks:
                    t.cancel()
                metrics.requests.labels(endpoint, "error").inc()
            results = gathered.result()  # re-raises the first RequestError
            keep = list(range(len(jobs)))
            if m > n:
                keep = []
                for p in range(len(prompts)):
                    group = range(p * m, (p + 1) * m)
                    score = {i: sum(lp for lp, _ in results[i][5] or []) for i in group}
                    keep += sorted(group, key=lambda i: -score[i])[:n]
            choices = []
            for index, i in enumerate(keep):
                text, _, reason, ids, _, lps, plps = results[i]
                if m > n and req.sampling.get("logprobs") is None:
                    lps = None
                if chat:
                    c = {
                        "index": index,
                        "message": shapers[i].message(text),
                        "logprobs": logprobs_obj(i, ids, lps),
                        **({"prompt_logprobs": prompt_logprobs_field(i, plps)} if plps else {}),
                        "finish_reason": shapers[i].finish_reason(reason),
                    }
                    if req.return_token_ids:
                        c["token_ids"] = ids
                    choices.append(c)
                else:
                    c = choice(i, text, reason, ids=ids, lps=lps, plps=plps)
                    c["index"] = index
                    choices.append(c)
            n_out = sum(r[1] for r in results)
            metrics.requests.labels(endpoint, "ok").inc()
            return JSONResponse(
                {
                    **base,
                    "object": obj,
                    "choices": choices,
                    "usage": usage(sum(map(len, prompts)), n_out, sum(r[4] for r in results[::m])),
                }
            )

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        queue: asyncio.Queue[tuple[int, Piece | Exception]] = asyncio.Queue()
        counts = [0] * len(jobs)
        cached_counts = [0] * len(jobs)
        held_ids: list[list[int]] = [[] for _ in jobs]

        async def pump(i: int) -> None:
            try:
                async for piece in pieces(i):
                    await queue.put((i, piece))
            except Exception as e:  # reported in-stream
                await queue.put((i, e))

        # Started now, so admission accounting holds even if the body is never iterated.
        tasks = [spawn(pump(i)) for i in range(len(jobs))]

        def usage_so_far() -> dict[str, Any]:
            return usage(sum(map(len, prompts)), sum(counts), sum(cached_counts[::m]))

        def running_usage() -> dict[str, Any]:
            """stream_options.continuous_usage_stats: usage so far on every chunk (as vLLM
            sends it: the request's prompt tokens, its choices' completion tokens so far)."""
            return {"usage": usage_so_far()} if req.continuous_usage else {}

        async def events() -> AsyncIterator[bytes]:
            try:
                if chat:
                    yield _sse(
                        {
                            **base,
                            "object": chunk_obj,
                            "choices": [choice(i, "", None, first=True) for i in range(len(jobs))],
                            **running_usage(),
                        }
                    )
                left = len(jobs)
                while left:
                    i, item = await queue.get()
                    if isinstance(item, Exception):
                        kind = item.kind if isinstance(item, RequestError) else "server_error"
                        yield _sse({"error": {"message": str(item), "type": kind}})
                        left -= 1
                        continue
                    counts[i] = item.num_tokens
                    cached_counts[i] = item.cached_tokens
                    fields: dict[str, Any] | None = None
                    reason = item.finish_reason
                    if chat:
                        fields = shapers[i].feed(item.text) if item.text else {}
                        if reason is not None:
                            fields = _merge(fields, shapers[i].finish())
                            reason = shapers[i].finish_reason(reason)
                    # Token ids of text a shaper holds back ride on the next chunk sent.
                    held_ids[i] += item.token_ids
                    if (fields if chat else item.text) or reason or item.logprobs:
                        ids, held_ids[i] = held_ids[i], []
                        yield _sse(
                            {
                                **base,
                                "object": chunk_obj,
                                "choices": [
                                    choice(
                                        i,
                                        item.text if item.text or not chat else None,
                                        reason,
                                        ids=ids,
                                        lps=item.logprobs,
                                        plps=item.prompt_logprobs,
                                        fields=fields,
                                    )
                                ],
                                **running_usage(),
                            }
                        )
                    if item.finish_reason:
                        left -= 1
                if req.include_usage:
                    yield _sse(
                        {
                            **base,
                            "object": chunk_obj,
                            "choices": [],
                            "usage": usage_so_far(),
                        }
                    )
                yield b"data: [DONE]\n\n"
                metrics.requests.labels(endpoint, "ok").inc()
            finally:
                for t in tasks:
                    t.cancel()  # a disconnected client aborts its requests
                await asyncio.gather(*tasks, return_exceptions=True)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, e: RequestError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        """Routing errors (unknown path 404, wrong method 405) in OpenAI's error shape."""
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        response = error_response(RequestError(str(e.detail), status=e.status_code, kind=kind))
        response.headers.update(e.headers or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        return error_response(validation_error(e))

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, e: EngineDeadError):
        return error_response(RequestError(str(e), status=503, kind="server_error"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = parse_completion(await read_json(request), tokenizer.vocab_size)
        check_model(req.model)
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
        return await generate(request, "completions", req, prompts, 16, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatRequest = parse_chat(await read_json(request))
        check_model(req.model)
        try:
            ids = tokenizer.apply_chat_template(req.messages, **req.template_kwargs)
        except Exception as e:  # template errors are the request's fault
            raise RequestError(f"chat template failed: {e}", param="messages") from None
        reasoning = thinks if req.separate_reasoning is None else req.separate_reasoning
        tools = req.tools
        if tools is not None and tools.choice == "auto" and tool_format is None:
            raise RequestError(
                "this model's tool-call format is unknown (start the server with "
                "--tool-call-format); use tool_choice 'required' or a named function",
                param="tools",
            )
        inside = reasoning and starts_inside(tokenizer.decode(ids[-8:], skip_special_tokens=False))
        guided = req.sampling.get("guided")
        if reasoning and guided is not None and guided[0] == "grammar" and inside:
            # A user grammar is the whole output: nothing of it is reasoning.
            reasoning = inside = False
        elif reasoning and guided is not None:
            # The model thinks freely first; the constraint holds after </think>.
            req.sampling["guided"] = after_reasoning(guided, inside, req.guided_param)

        def shaper() -> ChatOutput:
            fmt = tool_format if tools is not None and tools.choice == "auto" else None
            return ChatOutput(reasoning=reasoning, inside=inside, tools=tools, fmt=fmt)

        return await generate(
            request, "chat", req, [ids], settings.default_max_tokens, chat=True, shaper=shaper
        )

    install_tokenize_routes(app, tokenizer, max_model_len, check_model)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "tandem",
                    "max_model_len": max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        restarts = client.restarts
        if client.restarting:
            body = {"status": "restarting", "reason": None, "engine_restarts": restarts}
            return JSONResponse(body, status_code=503)
        if not client.healthy:
            body = {"status": "unhealthy", "reason": client.dead, "engine_restarts": restarts}
            return JSONResponse(body, status_code=503)
        return {"status": "ok", "engine_restarts": restarts}

    @app.get("/metrics")
    async def prometheus():
        stats = {**client.stats, "engine_restarts": client.restarts}
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.post("/pause")
    async def pause():
        await client.pause()
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        await client.resume()
        return {"status": "running"}

    return app


class _Guard:
    """API key and body-size checks as a plain ASGI middleware (Starlette's
    ``BaseHTTPMiddleware`` hides client disconnects from ``request.is_disconnected()``, so
    a non-streaming request would run on after its client left)."""

    def __init__(self, app: Any, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            error = self._check(Request(scope))
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, request: Request) -> RequestError | None:
        settings = self.settings
        if settings.api_key is not None and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), settings.api_key.encode()):
                return RequestError("invalid API key", status=401, kind="authentication_error")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return RequestError(f"request body exceeds {settings.max_body_bytes} bytes", status=413)
        return None


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
