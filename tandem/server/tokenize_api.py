"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Clients that score prompts offline need the server's own tokenizer: lm-eval's ``remote``
tokenizer backend probes ``/tokenizer_info`` and ``/tokenize`` and then uses both for every
request. The bodies are vLLM's shapes, typed with pydantic (FastAPI documents them); a body
that does not validate is a 400 in OpenAI's error shape (``validation_error`` in app.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.frontend.tokenizer import Tokenizer
from tandem.server.chat_history import check_request_template, normalize_messages, template_error
from tandem.server.errors import RequestError
from tandem.server.openai_schema import MAX_MESSAGES, check_template_kwargs
from tandem.server.requests import parse_chat

MAX_DETOKENIZE = 1 << 20  # token ids per /detokenize body


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="The served model's name (checked if given).")
    return_token_strs: bool = Field(False, description="Also each token's string.")


class TokenizeCompletion(_Body):
    """Tokenize a text as /v1/completions would (BOS and the like when add_special_tokens)."""

    prompt: str
    add_special_tokens: bool = True


class TokenizeChat(_Body):
    """Tokenize messages through the chat template, as /v1/chat/completions would."""

    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)

    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """What a client needs to tokenize as the server does (lm-eval reads eos_token and
    chat_template)."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    eos_token: str | None
    eos_token_ids: list[int]
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int) -> TokenizerInfo:
    hf = tokenizer.hf
    template = getattr(hf, "chat_template", None)

    def special(name: str) -> str | None:
        value = getattr(hf, name, None)
        return value if isinstance(value, str) else None

    return TokenizerInfo(
        tokenizer_class=type(hf).__name__,
        vocab_size=tokenizer.vocab_size,
        model_max_length=max_model_len,
        eos_token=special("eos_token"),
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        bos_token=special("bos_token"),
        pad_token=special("pad_token"),
        unk_token=special("unk_token"),
        chat_template=template if isinstance(template, str) else None,
    )


def install_tokenize_routes(
    app: FastAPI,
    tokenizer: Tokenizer,
    max_model_len: int,
    check_model: Callable[[str | None], None],
    trust_request_chat_template: bool = False,
) -> None:
    def strs(ids: list[int]) -> list[str]:
        return list(tokenizer.hf.convert_ids_to_tokens(ids))

    @app.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
    async def tokenize(body: TokenizeCompletion | TokenizeChat) -> TokenizeResponse:
        check_model(body.model)
        if isinstance(body, TokenizeCompletion):
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            chat: dict[str, Any] = {"messages": body.messages}
            if body.tools is not None:
                chat["tools"] = body.tools
            if body.chat_template_kwargs is not None:
                chat["chat_template_kwargs"] = body.chat_template_kwargs
            req = parse_chat(chat)  # the same messages, tools and template rules as chat
            kwargs = dict(req.template_kwargs)
            check_request_template(kwargs, trust_request_chat_template)
            if body.continue_final_message:
                kwargs["continue_final_message"] = True
            try:
                ids = await asyncio.to_thread(  # templating off the event loop
                    lambda: tokenizer.apply_chat_template(
                        normalize_messages(req.messages),  # as the chat route renders them
                        add_generation_prompt=body.add_generation_prompt,
                        add_special_tokens=body.add_special_tokens,
                        **kwargs,
                    )
                )
            except Exception as e:  # template errors are the request's fault
                raise template_error(e) from None
        return TokenizeResponse(
            count=len(ids),
            max_model_len=max_model_len,
            tokens=ids,
            token_strs=strs(ids) if body.return_token_strs else None,
        )

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        n = tokenizer.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < n), None)
        if bad is not None:
            raise RequestError(f"token ids must be in [0, {n})", param=f"tokens[{bad}]")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))

    info = tokenizer_info(tokenizer, max_model_len)

    @app.get("/tokenizer_info", response_model=TokenizerInfo)
    async def get_tokenizer_info() -> TokenizerInfo:
        return info
