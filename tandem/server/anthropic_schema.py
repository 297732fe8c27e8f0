"""Typed bodies of Anthropic's Messages API (``POST /v1/messages``, ``/count_tokens``).

Unknown fields are rejected, as Anthropic's API does; content blocks and tool choices are
discriminated unions on ``type``. FastAPI documents these in /openapi.json."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.server.openai_schema import MAX_MESSAGES, MAX_STOP_LENGTH, MAX_STOP_STRINGS
from tandem.server.tool_calls import MAX_TOOLS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    """Accepted: Tandem's prefix cache keeps every prompt's pages anyway."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ImageBlock(_Strict):
    """Parsed so that the refusal can name it: this server has no vision models."""

    type: Literal["image"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = (
        None
    )
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    """A client tool (server tools such as web search are not available here)."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None


class _Choice(_Strict):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAuto(_Choice):
    type: Literal["auto"]


class ToolChoiceAny(_Choice):
    type: Literal["any"]


class ToolChoiceTool(_Choice):
    type: Literal["tool"]
    name: str


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1, description="Cap on the tokens of the think block.")
    display: Literal["summarized"] | None = Field(
        None, description="Thinking is returned as written (omitted is not supported)."
    )


class ThinkingAdaptive(_Strict):
    """Thinking on, the model decides how much (no cap)."""

    type: Literal["adaptive"]
    display: Literal["summarized"] | None = Field(
        None, description="Thinking is returned as written (omitted is not supported)."
    )


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


Thinking = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")
]


class Metadata(_Strict):
    user_id: str | None = None


class _Prompt(_Strict):
    """What both /v1/messages and /v1/messages/count_tokens take."""

    model: str
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(_Prompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(max_length=MAX_STOP_LENGTH)]] | None = Field(
        None, max_length=MAX_STOP_STRINGS
    )
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _budget_below_max(self) -> MessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) and (
            self.thinking.budget_tokens >= self.max_tokens
        ):
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self


class CountTokensRequest(_Prompt):
    pass


class CountTokensResponse(BaseModel):
    input_tokens: int


class Usage(BaseModel):
    input_tokens: int = Field(description="Prompt tokens not read from the prefix cache.")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="Prompt tokens read from the prefix cache.")
    cache_creation_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: Usage


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
