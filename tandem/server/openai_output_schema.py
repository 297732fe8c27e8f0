"""What the OpenAI routes return, as pydantic models for /openapi.json: the JSON bodies of
completions, chat completions and the model list, and the error body of every OpenAI-shaped
route. The routes build these bodies as dicts (``openai_routes``); the schema fuzz checks that
they match (a field may be added; none of these may go missing)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, server_error.")
    param: str | None = Field(description="The offending field as a path: messages[2].content.")
    code: str | int | None = Field(description="A code such as model_not_found, else the status.")


class ErrorResponse(BaseModel):
    """OpenAI's error body (``app.error_response``)."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0, description="Prompt tokens read from the prefix cache.")


class CompletionUsage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float


class PromptLogprob(BaseModel):
    """A prompt token of the ``prompt_logprobs`` extension (the first token has none: null)."""

    token: str
    logprob: float
    top_logprobs: list[TopLogprob]


class CompletionLogprobs(BaseModel):
    """One entry per token (the echoed prompt's first: null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _Choice(BaseModel):
    index: int = Field(ge=0)
    finish_reason: str | None = Field(description="stop, length, tool_calls; null mid-stream.")
    prompt_logprobs: list[PromptLogprob | None] | None = None
    token_ids: list[int] | None = Field(None, description="Extension: with return_token_ids.")


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class ChatTopLogprob(TopLogprob):
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="JSON text, as generated.")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(
        None, description="A leading think block, when the server splits reasoning off."
    )
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Choice):
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int = Field(description="Context length in tokens.")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
