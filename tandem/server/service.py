"""What every generation route shares: admission (capacity, the served model's name), the
sampling parameters a prompt gets, and one request's output as text pieces (detokenized,
stop strings applied, metrics observed). The routes (OpenAI, Anthropic, Responses) only shape
these pieces into their API's bodies and events."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from tandem.frontend.engine_client import Delta, EngineClient
from tandem.frontend.stop import StopStringMatcher
from tandem.frontend.tokenizer import IncrementalDetokenizer, Tokenizer
from tandem.sampling_params import SamplingParams, stop_token_set
from tandem.server.errors import RequestError
from tandem.server.metrics import Metrics
from tandem.server.openapi import MAX_BODY_BYTES
from tandem.server.reasoning import THINK_END
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
    keep_billing_header: bool = False  # /v1/messages: keep x-anthropic-billing-header blocks
    trust_request_chat_template: bool = False  # chat_template_kwargs may carry a template
    ui: bool = True  # the playground at / and the dashboard at /dashboard


@dataclass
class Piece:
    text: str
    token_ids: list[int]  # new since the previous piece
    num_tokens: int  # generated so far
    finish_reason: str | None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[Any] | None = None  # one entry per token_ids entry, when asked for
    prompt_logprobs: list[Any] | None = None  # on the first piece, when asked for
    stop_sequence: str | None = None  # the stop string that ended the output


def engine_error(d: Delta, *, dead: bool) -> RequestError:
    """A request the engine ended with an error: the client's fault (400) unless the engine
    died or hit a bug (500) or ran out of device memory (503: retry later)."""
    message = d.error or "request failed"
    if dead or d.error_kind == "internal":
        return RequestError(message, status=500, kind="server_error")
    if d.error_kind == "resource":
        return RequestError(message, status=503, kind="server_error")
    return RequestError(message)


class Service:
    """One per app: the engine client, the tokenizer and the server's settings, and what the
    routes need from them."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, settings: ServerSettings):
        self.client, self.tokenizer, self.settings = client, tokenizer, settings
        self.metrics = Metrics()
        self.max_model_len = int(client.info.get("max_model_len", 0))
        template = getattr(tokenizer.hf, "chat_template", None)
        self.template = template if isinstance(template, str) else None
        self.tool_format = (
            detect_format(self.template, client.info.get("model_type"))
            if settings.tool_call_format == "auto"
            else settings.tool_call_format
        )
        self.thinks = settings.reasoning == "on" or (
            settings.reasoning == "auto"
            and self.template is not None
            and THINK_END in self.template
        )
        self.admitted = 0  # generation tasks alive (admitted requests), across all routes

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.served_model_name:
            raise RequestError(
                f"model '{name}' does not exist", param="model", status=404, code="model_not_found"
            )

    def check_capacity(self, n: int) -> None:
        client, most = self.client, self.settings.max_pending
        if not client.healthy:
            state = "restarting" if client.restarting else "not available"
            raise RequestError(f"engine is {state}", status=503, kind="server_error")
        if n > most:
            raise RequestError(
                f"this request asks for {n} sequences (prompts x n); the server admits at "
                f"most {most} at once",
                param="n",
            )
        if self.admitted + n > most:
            raise RequestError("server is overloaded, retry later", status=503, kind="server_error")

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run one admitted generation; it counts against max_pending until it ends."""
        self.admitted += 1
        task = asyncio.create_task(coro)
        task.add_done_callback(lambda _: setattr(self, "admitted", self.admitted - 1))
        return task

    def params_for(
        self,
        max_tokens: int | None,
        sampling: dict[str, Any],
        prompt_len: int,
        default: int,
        param: str = "max_tokens",
    ) -> SamplingParams:
        """The request's sampling parameters for a prompt of ``prompt_len`` tokens (without
        ``max_tokens``: ``default`` capped by the room left in the context)."""
        room = self.max_model_len - prompt_len
        limit = self.max_model_len
        if room < 1:
            raise RequestError(
                f"prompt ({prompt_len} tokens) leaves no room in the context length "
                f"({limit} tokens)",
                param="prompt" if max_tokens is None else param,
            )
        n = max_tokens if max_tokens is not None else min(default, room)
        if n < 1 or prompt_len + n > limit:
            raise RequestError(
                f"prompt ({prompt_len} tokens) + {param} ({n}) exceeds the context length "
                f"({limit} tokens)",
                param=param,
            )
        try:
            return SamplingParams(max_tokens=n, **sampling)
        except ValueError as e:  # e.g. min_tokens above the max_tokens this prompt gets
            name = "min_tokens" if "min_tokens" in str(e) else None
            raise RequestError(str(e), param=name) from None

    async def run_one(
        self,
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
        client, tokenizer, metrics = self.client, self.tokenizer, self.metrics
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
            lps = pending_lps if want_lps else None
            p = Piece(text, pending_ids, count, reason, cached, lps, prompt_lps)
            prompt_lps = None
            return p

        start = last = time.monotonic()
        gen = client.generate(rid, prompt_ids, params, follows=follows)
        if follows is None:
            metrics.prompt_tokens.inc(len(prompt_ids))
        try:
            async for d in gen:
                if d.finish_reason == "error":
                    raise engine_error(d, dead=client.dead is not None)
                now = time.monotonic()
                metrics.token_arrived(now - (start if count == 0 else last), first=count == 0)
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
                ids = d.new_token_ids
                lps = d.logprobs or []
                metrics.generated(len(ids))
                text = ""
                for i, token in enumerate(ids):
                    # One token at a time: with speculation an output may carry several, and
                    # a stop string that ends inside them ends the output there (the ids,
                    # logprobs and usage after it are not the request's, as without it).
                    count += 1
                    pending_ids.append(token)
                    if i < len(lps):
                        pending_lps.append(lps[i])
                    if d.finish_reason == "stop" and i == len(ids) - 1 and token in stop_ids:
                        break  # the stop token is not text (a completed grammar's is)
                    text += matcher.feed(detok.add([token]))
                    if matcher.stopped:
                        break
                if d.finish_reason is not None and not matcher.stopped:
                    # (what the detokenizer held back: a trailing U+FFFD is text too)
                    text += matcher.feed(detok.finish())
                if matcher.stopped:
                    p = piece(text, "stop")
                    p.stop_sequence = matcher.matched
                    yield p
                    return
                if d.finish_reason is not None:
                    yield piece(text + matcher.flush(), d.finish_reason)
                    return
                if text:
                    yield piece(text, None)
                    pending_ids, pending_lps = [], []
        finally:
            metrics.request_ended(time.monotonic() - start)
            await gen.aclose()


async def watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


class Gone(Exception):
    """The client disconnected before the response was ready."""


async def unless_gone(request: Request, task: asyncio.Future) -> Any:
    """``task``'s result, or ``Gone`` (the task cancelled) if the client leaves first; the
    task's own exception (a RequestError: the error response) is raised as it is."""
    watcher = asyncio.create_task(watch_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Gone
    return task.result()


async def whole(svc: Service, request: Request, endpoint: str, task: asyncio.Future) -> Any:
    """A non-streamed generation's result, counted in ``tandem_requests`` under ``endpoint``;
    None if the client left first (counted as disconnected; the work is cancelled). The
    task's own exception (a RequestError: the error response) is counted and raised."""
    try:
        result = await unless_gone(request, task)
    except Gone:
        svc.metrics.requests.labels(endpoint, "disconnected").inc()
        return None
    except Exception:
        svc.metrics.requests.labels(endpoint, "error").inc()
        raise
    svc.metrics.requests.labels(endpoint, "ok").inc()
    return result


_END = object()


class Pump:
    """One admitted request's items, produced by a task that counts against max_pending (so
    admission holds even if nobody reads) and read in order, with an idle tick."""

    def __init__(self, svc: Service, items: AsyncIterator[Any]) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.task = svc.spawn(self._run(items))

    async def _run(self, items: AsyncIterator[Any]) -> None:
        try:
            async for item in items:
                await self.queue.put(item)
            await self.queue.put(_END)
        except Exception as e:  # raised to the reader
            await self.queue.put(e)

    async def items(self, idle_s: float | None = None) -> AsyncIterator[Any]:
        """The items; None after every ``idle_s`` without one; what the producer raised."""
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), idle_s)
            except TimeoutError:
                yield None
                continue
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    async def close(self) -> None:
        """Stop the producer. Not awaited: its clean-up (e.g. aborting a request a stop string
        ended, a send that may wait) must not hold the response open."""
        self.task.cancel()


def sse(obj: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event (with an ``event:`` line when named, as Anthropic's are)."""
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return (b"event: " + event.encode() + b"\n" + data) if event else data
