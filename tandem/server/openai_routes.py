"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions``: bodies, choices, logprobs and
SSE chunks from the pieces ``Service.run_one`` yields."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.frontend.fim import fim_prompt, fim_tokens
from tandem.sampling_params import INT_MAX, SamplingParams, check_vocab
from tandem.server import openai_output_schema as out
from tandem.server import openai_schema as o
from tandem.server.chat_output import ChatOutput
from tandem.server.chat_prep import plan_chat
from tandem.server.errors import RequestError
from tandem.server.logprobs_format import LogprobsFormatter
from tandem.server.requests import (
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    chat_request,
    completion_request,
)
from tandem.server.service import Piece, Service, sse, whole

SEEDS = INT_MAX + 1  # seed + j of sample j wraps within the 64-bit range


def merge_fields(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Delta fields of two pieces as one (strings joined, tool-call lists appended)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def install_openai_routes(app: FastAPI, svc: Service) -> None:
    async def generate(
        request: Request,
        endpoint: str,
        req: GenerationRequest,
        prompts: list[list[int]],
        default_max: int,
        chat: bool,
        shaper: Callable[[], ChatOutput] | None = None,
        keep_special: bool = False,
    ) -> Response:
        plist = [svc.params_for(req.max_tokens, req.sampling, len(p), default_max) for p in prompts]
        vocab = int(svc.client.info.get("vocab_size") or 0)
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
        svc.check_capacity(len(jobs))
        shapers = [shaper() if shaper else ChatOutput() for _ in jobs]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "created": created, "model": svc.settings.served_model_name}

        offsets = [0] * len(jobs)  # completions' text_offset, per choice

        lp_format = LogprobsFormatter(svc.tokenizer)  # unique token strings, token bytes

        echo = getattr(req, "echo", False)
        score_only = getattr(req, "score_only", False)

        def pieces(i: int) -> AsyncIterator[Piece]:
            return svc.run_one(*jobs[i][:2], req.stop, *jobs[i][2:], keep_special, score_only)

        echoed = [False] * len(jobs)

        def echo_text(i: int) -> str:
            """The prompt's text, once per choice (completions with echo)."""
            if not echo or echoed[i]:
                return ""
            echoed[i] = True
            return svc.tokenizer.decode(jobs[i][0])

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
                return lp_format.chat(ids, lps)
            pairs = list(zip(ids, lps, strict=False))
            if plps is not None and echo:
                pairs = prompt_entries(i, plps) + pairs
            context = [] if plps is not None and echo else jobs[i][0]
            out, offsets[i] = lp_format.completion(i, pairs, offsets[i], context)
            return out

        def prompt_logprobs_field(i: int, plps: list[Any]) -> list[Any]:
            """The ``prompt_logprobs`` extension: None for the first prompt token, then each
            token's log-probability and the top-k there."""
            return lp_format.prompt(jobs[i][0], plps)

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

            tasks = [svc.spawn(collect(i)) for i in range(len(jobs))]
            try:
                results = await whole(svc, request, endpoint, asyncio.gather(*tasks))
            except Exception:
                for t in tasks:
                    t.cancel()  # one choice failed: the others end too
                await asyncio.gather(*tasks, return_exceptions=True)
                raise  # the first RequestError is the error response
            if results is None:  # the client went away: its requests were aborted
                return Response(status_code=499)
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
        tasks = [svc.spawn(pump(i)) for i in range(len(jobs))]

        def usage_so_far() -> dict[str, Any]:
            return usage(sum(map(len, prompts)), sum(counts), sum(cached_counts[::m]))

        def running_usage() -> dict[str, Any]:
            """stream_options.continuous_usage_stats: usage so far on every chunk (as vLLM
            sends it: the request's prompt tokens, its choices' completion tokens so far)."""
            return {"usage": usage_so_far()} if req.continuous_usage else {}

        async def events() -> AsyncIterator[bytes]:
            try:
                if chat:
                    yield sse(
                        {
                            **base,
                            "object": chunk_obj,
                            "choices": [choice(i, "", None, first=True) for i in range(len(jobs))],
                            **running_usage(),
                        }
                    )
                left = len(jobs)
                failed = False  # a choice ended with an error event: not an ok request
                while left:
                    i, item = await queue.get()
                    if isinstance(item, Exception):
                        kind = item.kind if isinstance(item, RequestError) else "server_error"
                        yield sse({"error": {"message": str(item), "type": kind}})
                        failed = True
                        left -= 1
                        continue
                    counts[i] = item.num_tokens
                    cached_counts[i] = item.cached_tokens
                    fields: dict[str, Any] | None = None
                    reason = item.finish_reason
                    if chat:
                        fields = shapers[i].feed(item.text) if item.text else {}
                        if reason is not None:
                            fields = merge_fields(fields, shapers[i].finish())
                            reason = shapers[i].finish_reason(reason)
                    # Token ids of text a shaper holds back ride on the next chunk sent.
                    held_ids[i] += item.token_ids
                    if (fields if chat else item.text) or reason or item.logprobs:
                        ids, held_ids[i] = held_ids[i], []
                        yield sse(
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
                    yield sse(
                        {
                            **base,
                            "object": chunk_obj,
                            "choices": [],
                            "usage": usage_so_far(),
                        }
                    )
                yield b"data: [DONE]\n\n"
                svc.metrics.requests.labels(endpoint, "error" if failed else "ok").inc()
            finally:
                for t in tasks:
                    t.cancel()  # a disconnected client aborts its requests
                await asyncio.gather(*tasks, return_exceptions=True)

        return StreamingResponse(events(), media_type="text/event-stream")

    fim = fim_tokens(svc.tokenizer)  # this tokenizer's fill-in-the-middle layout, if any

    def fim_prompts(req: CompletionRequest, suffix: str) -> list[list[int]]:
        if fim is None:
            raise RequestError(
                "'suffix' needs a model with fill-in-the-middle tokens; this one has none",
                param="suffix",
            )
        if fim.stop_ids:  # the family's end-of-middle token ends the output too
            stops = req.sampling.get("stop_token_ids", ())
            req.sampling["stop_token_ids"] = (*stops, *fim.stop_ids)
        try:
            # Text prompts only: the schema refuses token ids with a suffix.
            return [fim_prompt(fim, svc.tokenizer, str(p), suffix) for p in req.prompts]
        except ValueError as e:
            raise RequestError(str(e), param="suffix") from None

    @app.post("/v1/completions", response_model=out.CompletionResponse)
    async def completions(body: o.CompletionRequest, request: Request) -> Response:
        """OpenAI text completions."""
        req = completion_request(body, svc.tokenizer.vocab_size)
        svc.check_model(req.model)
        if req.suffix is not None:
            prompts = fim_prompts(req, req.suffix)
        else:
            prompts = [svc.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]
        return await generate(request, "completions", req, prompts, 16, chat=False)

    @app.post("/v1/chat/completions", response_model=out.ChatCompletionResponse)
    async def chat_completions(body: o.ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions."""
        req: ChatRequest = chat_request(body)
        svc.check_model(req.model)
        plan = await asyncio.to_thread(  # templating off the event loop
            plan_chat,
            svc,
            req.messages,
            template_kwargs=req.template_kwargs,
            tools=req.tools,
            separate_reasoning=req.separate_reasoning,
            guided=req.sampling.get("guided"),
            guided_param=req.guided_param,
        )
        if plan.guided is not None:
            req.sampling["guided"] = plan.guided
        return await generate(
            request,
            "chat",
            req,
            [plan.ids],
            svc.settings.default_max_tokens,
            chat=True,
            shaper=plan.shaper,
            keep_special=plan.keep_special,
        )
